"""Muon's declaration (core/rule.py): its state entries, counts, hyperparameters, scalars."""
from __future__ import annotations

from ..rule import Rule, StateCode, StateEntry, format_count_names
from .hyperparams import FINITE_PRODUCTS, GROUP_KEYS, HPARAM_BOUNDS, HPARAM_FIELDS, SCALAR_FIELDS, group_row, \
    row_group, validate_hyperparams

# One momentum value per parameter element: a 16-bit code (packed: E5M10; bf16: bf16 bits) or
# a float32 (fp32 mode, torch.optim.Muon's buffer under its name).
MOMENTUM_CODE = StateEntry("momentum_code", "uint16")
MOMENTUM_BUFFER = StateEntry("momentum_buffer", "float32")
# Packed mode's power-of-two scale: one int32 exponent s per matrix, the momentum of a code c being
# decode(c) * 2**s (MUON.md, "E5M10 (packed)"); replicated on every shard of a sharded matrix.
MOMENTUM_EXPONENT = StateEntry("mu_exponent", "int32", per_matrix=True)
# The one 16-bit code of packed mode: the momentum (state_format.py's E5M10, its bias mu_bias).
CODES = (StateCode("mu", "momenta", "mu_bias"),)
# MUON.md, "Format counts": over the elements of accepted matrices, packed mode:
# ("saturated_mu", "flushed_mu", "subnormal_mu").
FORMAT_COUNTS = format_count_names(CODES)

RULE = Rule(
    name="muon",
    hyperparam_fields=HPARAM_FIELDS,
    scalar_fields=SCALAR_FIELDS,
    bounds=HPARAM_BOUNDS,
    finite_products=FINITE_PRODUCTS,
    count_names=FORMAT_COUNTS,
    matrix_phase=True,
    codes=CODES,
    group_keys=GROUP_KEYS,
    group_row=group_row,
    row_group=row_group,
    validate=validate_hyperparams,
    # One row for every matrix (no mask), and the weight phase always reads the weights:
    # row_variants and param_read_through keep their defaults.
)
