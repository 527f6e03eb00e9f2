"""Muon's rule: its declaration (rule.py), state format, hyperparameters, elementwise phases
in numpy and a scalar authority (docs/MUON.md). The Newton-Schulz phase between them is the
frameworks' (a float32 numpy reference is in numpy_step for tests); its Triton kernels, which
both frontends launch on GPUs, are ns_kernel (mirrored in numpy by ns_reference), imported by name
(`from packed_adamw.core.muon import ns_kernel`) only where launched: it needs triton, which a
CPU-only JAX install lacks. Imports neither torch nor jax."""
from .hyperparams import (
    ADJUST_LR_FNS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    HPARAM_BOUNDS,
    Hyperparams,
    adjusted_lr,
    step_scalar_row,
    validate_hyperparams,
    validate_ns,
)
from .float32 import bf16_bits, bf16_values, fma32, ldexp32, lerp32
from .numpy_step import (
    MomentumUpdate,
    commit_momentum,
    decode_momentum,
    matrix_exponent,
    momentum_phase,
    momentum_update,
    newton_schulz_reference,
    ortho_finite,
    weight_phase,
    weight_phase_split,
)
from .rule import FORMAT_COUNTS, RULE
from .state_format import DEFAULT_MU_BIAS, E5M10, MODES, StateFormat, momentum_format

__all__ = [
    "RULE", "FORMAT_COUNTS", "StateFormat", "MODES", "DEFAULT_MU_BIAS", "E5M10", "momentum_format",
    "Hyperparams", "HPARAM_BOUNDS", "validate_hyperparams", "validate_ns", "adjusted_lr", "step_scalar_row",
    "ADJUST_LR_FNS", "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "fma32", "lerp32", "bf16_bits", "bf16_values",
    "momentum_phase", "weight_phase", "weight_phase_split", "newton_schulz_reference", "momentum_update",
    "commit_momentum", "ortho_finite", "MomentumUpdate", "decode_momentum", "ldexp32", "matrix_exponent",
]
