"""packed_adamw.jax: the optax frontend (CUDA through jax-triton, CPU through numpy)."""
from packed_adamw.core import StateFormat
from packed_adamw.core.portable import PortableState

from .transform import (
    DEFAULT_WEIGHT_DECAY,
    PackedAdamWState,
    export_state,
    import_state,
    packed_adamw,
    packed_adamw_fused_step,
)

__all__ = ["DEFAULT_WEIGHT_DECAY", "PackedAdamWState", "PortableState", "StateFormat", "packed_adamw",
           "packed_adamw_fused_step", "export_state", "import_state"]
