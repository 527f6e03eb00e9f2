"""packed_adamw.core: the generic machinery (codecs, rule declarations, launch layout, Triton
pieces, scalar-authority primitives, portable state, format health) and AdamW's rule (core/adamw/).

Imports neither torch nor jax. The kernel modules import triton and are loaded on first use.
"""
from .adamw import (
    DEFAULT_M_BIAS,
    DEFAULT_RMS_BIAS,
    E4M11,
    E4M12,
    MODES,
    Hyperparams,
    StateFormat,
    adamw_step,
    first_moment_format,
    pack_words,
    rms_format,
    step_scalars,
    unpack_words,
    validate_hyperparams,
)
from .codecs import FP16, MiniFloat

__version__ = "1.1.0"

__all__ = [
    "DEFAULT_M_BIAS", "DEFAULT_RMS_BIAS", "E4M11", "E4M12", "FP16", "MODES", "MiniFloat",
    "StateFormat", "first_moment_format", "rms_format", "pack_words", "unpack_words",
    "Hyperparams", "validate_hyperparams", "adamw_step", "step_scalars", "__version__",
]
