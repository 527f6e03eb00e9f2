"""packed_adamw.core: formats, the scalar authority, the numpy CPU step and the Triton kernel.

Imports neither torch nor jax. The kernel module imports triton and is loaded on first use.
"""
from .formats import (
    DEFAULT_M_BIAS,
    DEFAULT_RMS_BIAS,
    E4M11,
    E4M12,
    FP16,
    MODES,
    MiniFloat,
    StateFormat,
    first_moment_format,
    pack_words,
    rms_format,
    unpack_words,
)
from .hyperparams import Hyperparams, validate_hyperparams
from .numpy_step import adamw_step, step_scalars

__version__ = "1.1.0"

__all__ = [
    "DEFAULT_M_BIAS", "DEFAULT_RMS_BIAS", "E4M11", "E4M12", "FP16", "MODES", "MiniFloat",
    "StateFormat", "first_moment_format", "rms_format", "pack_words", "unpack_words",
    "Hyperparams", "validate_hyperparams", "adamw_step", "step_scalars", "__version__",
]
