"""AdamW's declaration (core/rule.py): its state entries, counts, hyperparameters, scalars."""
from __future__ import annotations

from ..rule import Rule, StateEntry
from .hyperparams import FINITE_PRODUCTS, HPARAM_BOUNDS, HPARAM_FIELDS, SCALAR_FIELDS

# The state of one parameter: a uint32 word of two 16-bit codes (packed and fp16 modes), or
# the two float32 moments stacked before the parameter's axes (fp32 mode).
WORDS = StateEntry("words", "uint32")
MOMENTS = StateEntry("moments", "float32", leading=(2,))
# FORMAT.md, "Format counts": each count for the first moment's code, then the RMS code's.
FORMAT_COUNTS = ("saturated_m", "saturated_rms", "flushed_m", "flushed_rms", "subnormal_m", "subnormal_rms")

RULE = Rule(
    name="adamw",
    hyperparam_fields=HPARAM_FIELDS,
    scalar_fields=SCALAR_FIELDS,
    bounds=HPARAM_BOUNDS,
    finite_products=FINITE_PRODUCTS,
    count_names=FORMAT_COUNTS,
)
