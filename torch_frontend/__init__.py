"""packed_adamw.torch: the PyTorch frontend.

`PackedAdamW` is the optimizer; `functional.adamw_step_` the functional step it calls. The
reference GPT, its trainer and checkpoints live apart, in `packed_adamw.torch.gpt`.
"""
from packed_adamw.core.portable import PortableState

from .functional import adamw_step_, new_state
from .optimizer import NonFiniteGradientError, PackedAdamW

__all__ = ["PackedAdamW", "NonFiniteGradientError", "PortableState", "adamw_step_", "new_state"]
