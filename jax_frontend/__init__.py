"""packed_adamw.jax: the optax frontend (CUDA through jax-triton, CPU through numpy)."""
from .transform import PackedAdamWState, packed_adamw, packed_adamw_fused_step

__all__ = ["PackedAdamWState", "packed_adamw", "packed_adamw_fused_step"]
