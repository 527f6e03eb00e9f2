"""AdamW's hyperparameters: their rows, their valid values, and validation with errors that
say what to do."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from ..codecs import FLOAT32_MAX, FLOAT32_TINY
from ..rule import Bound, RowVariant, float32_of

# The hyperparameter row: float32 values in this order, one row per parameter group (torch) or
# per row variant (JAX, below). Step scalars are derived from it and the step count.
HPARAM_FIELDS = ("lr", "b1", "b2", "eps", "weight_decay")
HPARAM_ROW = len(HPARAM_FIELDS)
# The step-scalar row the update kernels and the numpy step read, in this order (FORMAT.md,
# "Step scalars"). The kernel addresses each field by its index here, never by a literal.
SCALAR_FIELDS = ("b1", "one_minus_b1", "b2", "one_minus_b2", "step_size", "inv_sqrt_bias_correction2", "eps", "lr_wd")
SCALAR_ROW = len(SCALAR_FIELDS)
SCALAR_INDEX = {name: i for i, name in enumerate(SCALAR_FIELDS)}
# The valid values of each field, as float32 numbers: the one table the host check below is
# written from (a device-side check can be written from it too: `Bound.holds` takes arrays).
# eps keeps the update finite; each beta must leave 1 - beta > 0.
HPARAM_BOUNDS = {
    "lr": Bound(0.0, FLOAT32_MAX),
    "b1": Bound(0.0, 1.0, high_open=True),
    "b2": Bound(0.0, 1.0, high_open=True),
    "eps": Bound(FLOAT32_TINY, FLOAT32_MAX),
    "weight_decay": Bound(0.0, FLOAT32_MAX),
}
# The step derives lr * weight_decay: it must be a finite float32 number too.
FINITE_PRODUCTS = (("lr", "weight_decay"),)
# The hyperparameters as a parameter group holds them (torch.optim.AdamW's keys: "betas" is
# the pair (b1, b2)), in the order `group_row` and `validate_hyperparams` take them.
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


# The rows a step carries: the group's, and for the leaves a mask leaves out (optax.adamw's
# `mask`) the same row without weight decay.
ROW_VARIANTS = (RowVariant("decayed"), RowVariant("undecayed", zeroed=("weight_decay",)))
MASKED_VARIANT = "undecayed"
# The update reads the parameter only through its decay, lr * weight_decay * p.
PARAM_READ_THROUGH = ("weight_decay",)


def group_row(lr, betas, eps, weight_decay, *, number=float) -> tuple:
    """The hyperparameter row (HPARAM_FIELDS order) of a group's values, each passed through
    `number` (Python floats by default). Raises TypeError or ValueError where a value is not a
    number or betas not a pair."""
    b1, b2 = betas
    return number(lr), number(b1), number(b2), number(eps), number(weight_decay)


def row_group(lr, b1, b2, eps, weight_decay) -> tuple:
    """The group's values (GROUP_KEYS order) of a hyperparameter row: `group_row`'s inverse."""
    return lr, (b1, b2), eps, weight_decay


@dataclass(frozen=True)
class Hyperparams:
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self):
        validate_hyperparams(self.lr, (self.b1, self.b2), self.eps, self.weight_decay)

    def as_float32_list(self) -> list[float]:
        return [float(getattr(self, name)) for name in HPARAM_FIELDS]


def _is_number(x) -> bool:
    """A plain real number: Python or numpy scalars (not bools, not arrays)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


_f32 = float32_of  # the value the kernel will see


def _beta_problem(value) -> str:
    if not _is_number(value) or np.isnan(_f32(value)):
        return "is not a number"
    if _f32(value) < 0:
        return "is negative"
    return "is not below 1 as a float32 number (values within 3e-8 of 1 round to 1)"


def validate_hyperparams(lr, betas, eps, weight_decay, *, allow_arrays=False) -> None:
    """Raise ValueError naming the bad argument; messages begin as torch.optim.AdamW's do.
    Values are checked as the float32 numbers the step will use: betas=(0.9, 1 - 1e-9) is 1.0
    in float32 and refused.

    With `allow_arrays`, values that are not plain numbers (a schedule, a traced or
    injected array) are left to the caller: they may only be known inside a compiled step.
    """
    skip = (lambda x: not _is_number(x)) if allow_arrays else (lambda x: False)
    bounds = HPARAM_BOUNDS
    if not skip(lr):
        if not _is_number(lr) or not bounds["lr"].holds(_f32(lr)):
            raise ValueError(f"Invalid learning rate: lr={lr!r}; the learning rate must be a finite float32 number >= 0")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Invalid betas: betas={betas!r}; pass a pair (b1, b2), e.g. (0.9, 0.999)") from None
    for index, beta in enumerate((b1, b2)):
        if skip(beta):
            continue
        if not _is_number(beta) or not bounds[f"b{index + 1}"].holds(_f32(beta)):
            raise ValueError(f"Invalid beta parameter at index {index}: b{index + 1} (betas[{index}])={beta!r} "
                             f"{_beta_problem(beta)}; each beta must be in [0, 1)")
    if not skip(eps) and (not _is_number(eps) or not bounds["eps"].holds(_f32(eps))):
        raise ValueError(f"Invalid epsilon value: eps={eps!r}; eps must be a finite float32-normal number > 0 "
                         "(it keeps the update finite)")
    if not skip(weight_decay):
        if not _is_number(weight_decay) or not bounds["weight_decay"].holds(_f32(weight_decay)):
            raise ValueError(f"Invalid weight_decay value: weight_decay={weight_decay!r}; weight decay must be a "
                             "finite number >= 0")
        if not skip(lr) and _f32(lr) * _f32(weight_decay) > FLOAT32_MAX:  # FINITE_PRODUCTS
            raise ValueError(f"Invalid weight_decay value: lr * weight_decay = {lr} * {weight_decay} overflows "
                             "float32; lower one of them")
