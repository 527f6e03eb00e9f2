"""Muon's declaration (core/rule.py): its state entries, counts, hyperparameters, scalars."""
from __future__ import annotations

from ..rule import Rule, StateEntry
from .hyperparams import FINITE_PRODUCTS, HPARAM_BOUNDS, HPARAM_FIELDS, SCALAR_FIELDS

# One momentum value per parameter element: a 16-bit code (packed: E5M10; bf16: bf16 bits) or
# a float32 (fp32 mode, torch.optim.Muon's buffer under its name).
MOMENTUM_CODE = StateEntry("momentum_code", "uint16")
MOMENTUM_BUFFER = StateEntry("momentum_buffer", "float32")
# MUON.md, "Format counts": over the elements of accepted matrices, packed mode.
FORMAT_COUNTS = ("saturated_mu", "flushed_mu", "subnormal_mu")

RULE = Rule(
    name="muon",
    hyperparam_fields=HPARAM_FIELDS,
    scalar_fields=SCALAR_FIELDS,
    bounds=HPARAM_BOUNDS,
    finite_products=FINITE_PRODUCTS,
    count_names=FORMAT_COUNTS,
    matrix_phase=True,
)
