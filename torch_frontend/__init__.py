"""packed_adamw.torch: the PyTorch frontend.

`PackedAdamW` is the optimizer; `functional.adamw_step_` the functional step it calls. The
reference GPT, its trainer and checkpoints live apart, in `packed_adamw.torch.gpt`.
"""
from .functional import adamw_step_, new_state
from .optimizer import NonFiniteGradientError, PackedAdamW

__all__ = ["PackedAdamW", "NonFiniteGradientError", "adamw_step_", "new_state"]
