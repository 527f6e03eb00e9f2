"""The rules the JAX step primitive (`_step.py`) runs, as `RuleSteps`: AdamW's (elementwise: its
numpy step and Triton entry points) and Muon's (a matrix phase: its own lowering, `_muon_step.lower`).
The primitive, its launches and its sharding take a rule's `RuleSteps` and state format and name no
rule."""
from __future__ import annotations

from packed_adamw.core.adamw import numpy_step
from packed_adamw.core.adamw.rule import RULE
from packed_adamw.core.muon.rule import RULE as MUON_RULE

from ._muon_step import lower as muon_lower
from ._step import RuleSteps


def _adamw_kernels():
    from packed_adamw.core.adamw.kernel import FUNCTIONAL_KERNELS  # imports Triton: only when compiling for CUDA

    return FUNCTIONAL_KERNELS


ADAMW = RuleSteps(rule=RULE, apply_step=numpy_step.apply_step, apply_split_step=numpy_step.apply_split_step,
                  step_scalar_row=numpy_step.step_scalar_row, kernels=_adamw_kernels)
MUON = RuleSteps(rule=MUON_RULE, lower=muon_lower, names=("packed_muon", "optax.contrib.muon"))
