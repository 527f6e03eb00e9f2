"""Muon's hyperparameters: the float row, the step-scalar row derived from it per matrix shape,
the learning-rate adjustment, and validation with errors that say what to do (docs/MUON.md)."""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np

from ..codecs import FLOAT32_MAX, FLOAT32_TINY
from ..rule import Bound, float32_of, float_or_inf

# The hyperparameter row, one per parameter group. eps is read by the Newton-Schulz phase only.
HPARAM_FIELDS = ("lr", "momentum", "weight_decay", "eps")
# The step-scalar row the elementwise phases read (MUON.md, "Step scalars"): one per parameter
# group and matrix shape, since the adjusted learning rate depends on the shape.
SCALAR_FIELDS = ("one_minus_momentum", "momentum", "decay", "neg_adjusted_lr")
SCALAR_INDEX = {name: i for i, name in enumerate(SCALAR_FIELDS)}
HPARAM_BOUNDS = {
    "lr": Bound(0.0, FLOAT32_MAX),
    "momentum": Bound(0.0, 1.0, high_open=True),
    "weight_decay": Bound(0.0, FLOAT32_MAX),
    "eps": Bound(FLOAT32_TINY, FLOAT32_MAX),
}
FINITE_PRODUCTS = (("lr", "weight_decay"),)
# The hyperparameters as a parameter group holds them (torch.optim.Muon's keys), in the order
# `group_row` and `validate_hyperparams` take them: the row's own order. The group's other keys
# (nesterov, ns_coefficients, ns_steps, adjust_lr_fn) fix the compiled step, not the row:
# `validate_ns` checks them.
GROUP_KEYS = HPARAM_FIELDS


def group_row(lr, momentum, weight_decay, eps, *, number=float) -> tuple:
    """The hyperparameter row (HPARAM_FIELDS order) of a group's values, each passed through
    `number` (Python floats by default). Raises TypeError or ValueError where a value is not a
    number."""
    return number(lr), number(momentum), number(weight_decay), number(eps)


def row_group(lr, momentum, weight_decay, eps) -> tuple:
    """The group's values (GROUP_KEYS order) of a hyperparameter row: `group_row`'s inverse."""
    return lr, momentum, weight_decay, eps

# Newton-Schulz's quintic (MUON.md, "The Newton-Schulz phase"): X <- a X + (b A + c A A) X, A = X X^T.
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
DEFAULT_NS_STEPS = 5
NS_STEPS_LIMIT = 100  # exclusive, as torch.optim.Muon
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjusted_lr(lr: float, shape, adjust_lr_fn: str | None = None) -> float:
    """The learning rate of a matrix of `shape` (rows, cols), in binary64 (MUON.md, "The
    learning-rate adjustment"): None or "original" scales by sqrt(max(1, rows / cols)),
    "match_rms_adamw" by 0.2 * sqrt(max(rows, cols))."""
    rows, cols = (operator.index(n) for n in tuple(shape)[:2])
    if adjust_lr_fn not in (None, *ADJUST_LR_FNS):
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn!r} is not supported; "
                         f"choose one of {ADJUST_LR_FNS}")
    if rows == 0 or cols == 0:
        # A zero-size matrix has no element to update (the frontends skip it, as
        # torch.optim.Muon does for (0, n)); its rate is only ever recorded.
        return float(lr)
    if adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:  # None or "original"
        ratio = math.sqrt(max(1.0, rows / cols))
    return float(lr) * ratio


def step_scalar_row(row, shape, *, adjust_lr_fn: str | None = None) -> tuple[np.float32, ...]:
    """The float32 step scalars in SCALAR_FIELDS order for a matrix of `shape`; `row` is
    (lr, momentum, weight_decay, eps). Each scalar is computed in binary64 from the values as
    given and rounded once to float32, as torch.optim.Muon's scalar arguments are."""
    lr, momentum, weight_decay, _eps = (float(x) for x in row)
    return (
        np.float32(1.0 - momentum),
        np.float32(momentum),
        np.float32(1.0 - lr * weight_decay),
        np.float32(-adjusted_lr(lr, shape, adjust_lr_fn)),
    )


@dataclass(frozen=True)
class Hyperparams:
    lr: float = 1e-3
    momentum: float = 0.95
    weight_decay: float = 0.1
    eps: float = 1e-7

    def __post_init__(self):
        validate_hyperparams(self.lr, self.momentum, self.weight_decay, self.eps)

    def as_row(self) -> list[float]:
        return [float(getattr(self, name)) for name in HPARAM_FIELDS]


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


_f32 = float32_of  # the value the kernels see


def validate_hyperparams(lr, momentum, weight_decay, eps, *, allow_arrays=False) -> None:
    """Raise ValueError naming the bad argument; messages begin as torch.optim.Muon's do.
    Values are checked as float32 numbers (a momentum that rounds to 1 is refused). With
    `allow_arrays`, values that are not plain numbers (schedules, traced arrays) are left to
    the caller."""
    skip = (lambda x: not _is_number(x)) if allow_arrays else (lambda x: False)
    bounds = HPARAM_BOUNDS
    if not skip(lr) and (not _is_number(lr) or not bounds["lr"].holds(_f32(lr))):
        raise ValueError(f"Learning rate should be >= 0 but is: {lr!r}; pass a finite float32 number >= 0 as lr")
    if not skip(momentum) and (not _is_number(momentum) or not bounds["momentum"].holds(_f32(momentum))):
        # torch.optim.Muon refuses only negative momenta; 1 and above never forget a gradient.
        below_one = _is_number(momentum) and _f32(momentum) >= 1
        raise ValueError(f"momentum should be {'below 1' if below_one else '>= 0'} but is: {momentum!r}; pass "
                         "momentum in [0, 1) (as a float32 number: values within 3e-8 of 1 round to 1)")
    if not skip(weight_decay):
        if not _is_number(weight_decay) or not bounds["weight_decay"].holds(_f32(weight_decay)):
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay!r}; pass a finite number >= 0 "
                             "as weight_decay")
        if not skip(lr) and _f32(lr) * _f32(weight_decay) > FLOAT32_MAX:  # FINITE_PRODUCTS
            raise ValueError(f"weight decay should keep lr * weight_decay finite but is: {weight_decay!r} "
                             f"(lr={lr!r}); lower one of them")
    if not skip(eps) and (not _is_number(eps) or not bounds["eps"].holds(_f32(eps))):
        raise ValueError(f"eps should be > 0 but is: {eps!r}; pass a finite float32-normal number > 0 as eps "
                         "(it bounds the Frobenius norm Newton-Schulz divides by)")


def validate_ns(ns_coefficients, ns_steps, adjust_lr_fn) -> tuple[tuple[float, float, float], int]:
    """The Newton-Schulz settings and the lr adjustment, checked; returns (coefficients, steps)."""
    try:
        coefficients = tuple(float_or_inf(c) for c in ns_coefficients)  # past a float's range: not finite
    except TypeError:
        coefficients = ()
    if len(coefficients) != 3 or not all(math.isfinite(c) for c in coefficients):
        problem = "Coefficients must be a tuple of exactly 3 values" if len(coefficients) != 3 else \
            "a coefficient is not finite"  # the first in torch.optim.Muon's words
        raise ValueError(f"{problem}: ns_coefficients={ns_coefficients!r}; pass three finite numbers (a, b, c), "
                         f"e.g. {DEFAULT_NS_COEFFICIENTS}")
    if isinstance(ns_steps, (bool, np.bool_)) or not isinstance(ns_steps, numbers.Integral):
        raise ValueError(f"ns_steps={ns_steps!r} is not an int: pass a whole number of Newton-Schulz iterations "
                         f"in [1, {NS_STEPS_LIMIT})")
    if not 1 <= ns_steps < NS_STEPS_LIMIT:
        bound = "at least 1" if ns_steps < 1 else f"less than {NS_STEPS_LIMIT}"  # the second in torch.optim.Muon's words
        raise ValueError(f"Number of steps must be {bound}: ns_steps={ns_steps!r}; pass an int "
                         f"in [1, {NS_STEPS_LIMIT})")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn!r} is not supported; "
                         f"adjust_lr_fn must be one of {ADJUST_LR_FNS}")
    return coefficients, int(ns_steps)
