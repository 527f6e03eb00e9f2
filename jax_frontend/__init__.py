"""packed_adamw.jax: the optax frontend (CUDA through jax-triton, CPU through numpy)."""
from packed_adamw.core import StateFormat
from packed_adamw.core.portable import PortableState

from .transform import (
    DEFAULT_WEIGHT_DECAY,
    FormatCounts,
    PackedAdamWSplitState,
    PackedAdamWState,
    PackedAdamWTrackedState,
    RefusedStepWarning,
    export_state,
    format_stats,
    import_state,
    load_master_weights,
    master_weights,
    packed_adamw,
    packed_adamw_fused_step,
)

# PackedAdamWSplitState and PackedAdamWTrackedState are PackedAdamWState (their 1.0 names).
__all__ = ["DEFAULT_WEIGHT_DECAY", "FormatCounts", "PackedAdamWSplitState", "PackedAdamWState",
           "PackedAdamWTrackedState", "PortableState", "RefusedStepWarning", "StateFormat", "packed_adamw",
           "packed_adamw_fused_step", "export_state", "format_stats", "import_state", "load_master_weights",
           "master_weights"]
