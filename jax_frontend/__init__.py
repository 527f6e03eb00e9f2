"""packed_adamw.jax: the optax frontend (CUDA through jax-triton, CPU through numpy; Muon on the CPU).

A new elementwise rule is `packed_rule(RuleSteps(...), its state format, ...)`, the builder
`packed_adamw` is written on: docs/ARCHITECTURE.md, "How a rule plugs in"."""
from packed_adamw.core import StateFormat
from packed_adamw.core.portable import PortableState

from ._step import RuleSteps
from .muon import PackedMuonState, packed_muon, packed_muon_fused_step
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
    packed_rule,
)

# PackedAdamWSplitState and PackedAdamWTrackedState are PackedAdamWState (their 1.0 names).
__all__ = ["DEFAULT_WEIGHT_DECAY", "FormatCounts", "PackedAdamWSplitState", "PackedAdamWState",
           "PackedAdamWTrackedState", "PackedMuonState", "PortableState", "RefusedStepWarning", "StateFormat",
           "packed_adamw", "packed_adamw_fused_step", "packed_muon", "packed_muon_fused_step", "export_state",
           "format_stats", "import_state", "load_master_weights", "master_weights", "packed_rule", "RuleSteps"]
