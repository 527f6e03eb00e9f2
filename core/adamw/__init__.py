"""AdamW's rule: its declaration (rule.py), state format, hyperparameters, numpy step, scalar
authority and Triton kernels. The shared machinery it plugs into is core/'s (docs/ARCHITECTURE.md,
"How a rule plugs in"). Imports neither torch nor jax; kernel.py imports triton and is loaded on
first use."""
from .hyperparams import HPARAM_BOUNDS, Hyperparams, validate_hyperparams
from .numpy_step import adamw_step, apply_split_step, apply_step, step_scalar_row, step_scalars
from .rule import FORMAT_COUNTS, RULE
from .state_format import (
    DEFAULT_M_BIAS,
    DEFAULT_RMS_BIAS,
    E4M11,
    E4M12,
    MODES,
    StateFormat,
    first_moment_format,
    pack_words,
    rms_format,
    unpack_words,
)

__all__ = [
    "RULE", "FORMAT_COUNTS", "StateFormat", "MODES", "DEFAULT_M_BIAS", "DEFAULT_RMS_BIAS", "E4M11", "E4M12",
    "first_moment_format", "rms_format", "pack_words", "unpack_words", "Hyperparams", "HPARAM_BOUNDS",
    "validate_hyperparams", "adamw_step", "apply_step", "apply_split_step", "step_scalar_row", "step_scalars",
]
