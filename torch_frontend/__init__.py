"""packed_adamw.torch: the PyTorch frontend.

`PackedAdamW` is the optimizer; `functional.adamw_step_` the functional step it calls.
A new elementwise rule is an `ElementwiseOptimizer` subclass over its `RuleLaunch` (its CPU step
from `numpy_cpu_step`): docs/ARCHITECTURE.md, "How a rule plugs in"; tests/test_custom_rule.py.
`PackedMuon` is Muon with 2-byte momentum codes (docs/MUON.md); `PackedMuonAdamW` steps Muon
groups and AdamW groups as one optimizer, `muon_param_groups` splits a model for it. The
reference GPT, its trainer and checkpoints live apart, in `packed_adamw.torch.gpt`.
"""
from packed_adamw.core.portable import PortableState

from .combined import PackedMuonAdamW, muon_param_groups
from ._launch import RuleLaunch
from .functional import adamw_step_, new_state, numpy_cpu_step
from .muon import PackedMuon
from .optimizer import ElementwiseOptimizer, NonFiniteGradientError, PackedAdamW

__all__ = ["PackedAdamW", "PackedMuon", "PackedMuonAdamW", "muon_param_groups", "NonFiniteGradientError",
           "PortableState", "adamw_step_", "new_state", "ElementwiseOptimizer", "RuleLaunch", "numpy_cpu_step"]
