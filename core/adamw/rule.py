"""AdamW's declaration (core/rule.py): its state entries, counts, hyperparameters, scalars."""
from __future__ import annotations

from ..rule import Rule, StateCode, StateEntry, format_count_names
from .hyperparams import FINITE_PRODUCTS, GROUP_KEYS, HPARAM_BOUNDS, HPARAM_FIELDS, MASKED_VARIANT, \
    PARAM_READ_THROUGH, ROW_VARIANTS, SCALAR_FIELDS, group_row, row_group, validate_hyperparams

# The state of one parameter: a uint32 word of two 16-bit codes (packed and fp16 modes), or
# the two float32 moments stacked before the parameter's axes (fp32 mode).
WORDS = StateEntry("words", "uint32")
MOMENTS = StateEntry("moments", "float32", leading=(2,))
# The two 16-bit codes of a word (state_format.py: the first moment's in the high half).
CODES = (StateCode("m", "first moments", "m_bias"), StateCode("rms", "RMS values", "rms_bias"))
# FORMAT.md, "Format counts": each count for the first moment's code, then the RMS code's:
# ("saturated_m", "saturated_rms", "flushed_m", "flushed_rms", "subnormal_m", "subnormal_rms").
FORMAT_COUNTS = format_count_names(CODES)

RULE = Rule(
    name="adamw",
    hyperparam_fields=HPARAM_FIELDS,
    scalar_fields=SCALAR_FIELDS,
    bounds=HPARAM_BOUNDS,
    finite_products=FINITE_PRODUCTS,
    count_names=FORMAT_COUNTS,
    codes=CODES,
    group_keys=GROUP_KEYS,
    group_row=group_row,
    row_group=row_group,
    validate=validate_hyperparams,
    row_variants=ROW_VARIANTS,
    masked_variant=MASKED_VARIANT,
    param_read_through=PARAM_READ_THROUGH,
)
