"""What an optimizer rule declares, so that the shared machinery can serve it without knowing it.

A rule (AdamW in core/adamw/; Muon next) is an update written elementwise, possibly after a
phase that needs whole matrices, over state kept in the generic codecs (core/codecs.py). The
machinery (launch layout, counter rows, checkpoints, sharding, split masters) reads only what
the rule declares here: its state entries, its count names, its hyperparameters and the
step-scalar row derived from them. docs/ARCHITECTURE.md, "How a rule plugs in", says what a
rule writes itself.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from .codecs import FLOAT32_MAX, LOW_HALF_DTYPE, LOW_HALF_KEY


@dataclass(frozen=True)
class StateEntry:
    """One state tensor kept per parameter: `leading` axes, then the parameter's shape.

    It shards with its parameter: the parameter's axes, moved past the leading ones (which
    are never split), as fp32 mode's [2, *shape] moments. A `per_matrix` entry is one value per
    2-D matrix instead (shape (): Muon's packed momentum exponent), whole on every shard: a
    sharded parameter's ranks hold the same value (replicated)."""

    key: str  # its name in a state dict (torch) and in checkpoints
    dtype: str  # numpy name of its dtype
    leading: tuple[int, ...] = ()  # axes before the parameter's, whole on every shard
    per_matrix: bool = False  # one value per matrix (shape ()), not per element

    def __post_init__(self):
        if self.per_matrix and self.leading:
            raise ValueError(f"state entry {self.key!r}: a per-matrix entry has no leading axes")

    def shape(self, param_shape) -> tuple[int, ...]:
        return () if self.per_matrix else (*self.leading, *param_shape)

    def flat_shape(self, n_elements: int) -> tuple[int, ...]:
        """`shape` of the flattened parameter, as the kernels and the numpy steps read it."""
        return self.shape((n_elements,))

    @property
    def values_per_param(self) -> int:
        """Values of `dtype` per parameter element (0 for a per-matrix entry: a matrix's one
        value is no part of any element's bytes)."""
        return 0 if self.per_matrix else math.prod(self.leading)

    @property
    def bytes_per_param(self) -> int:
        return np.dtype(self.dtype).itemsize * self.values_per_param

    def sharded_axis(self, param_axis: int) -> int:
        """The axis of this entry that shards as the parameter's axis `param_axis` does."""
        if self.per_matrix:
            raise ValueError(f"state entry {self.key!r} is one value per matrix: no axis of it is sharded")
        return len(self.leading) + param_axis

    def sharding(self, param_spec: tuple) -> tuple:
        """The entry's partition spec (one item per axis; None: whole) from its parameter's
        (a per-matrix entry: (), replicated)."""
        return () if self.per_matrix else (None,) * len(self.leading) + tuple(param_spec)


# A bf16 parameter's low half (FORMAT.md, "Split masters"): the same for every rule.
LOW_HALF = StateEntry(LOW_HALF_KEY, LOW_HALF_DTYPE)

# The most steps a stored state may have taken, for every rule and frontend. The count is int32
# (JAX keeps it so, and the step scalars' powers b**t need it below 2**31), so it stops at
# 2**31 - 1, where a step no longer moves it: a state holding that could never step again, and
# one step short of it is the last count a loader may accept.
MAX_STEP_COUNT = 2**31 - 2


@dataclass(frozen=True)
class Bound:
    """The valid values of one hyperparameter, as the float32 number the step uses:
    low <= x <= high (x < high with `high_open`). NaN is never valid. `holds` takes Python
    or numpy numbers and arrays alike, so device-side checks can be written from it."""

    low: float
    high: float
    high_open: bool = False

    def holds(self, value):
        below = value < self.high if self.high_open else value <= self.high
        return (value >= self.low) & below


@dataclass(frozen=True)
class StateCode:
    """One 16-bit code a rule's state keeps per element, as format-health reports name it. The
    state format's `formats` gives its codec, in the rule's `codes` order."""

    suffix: str  # its format counts end in "_<suffix>" (saturated_m)
    holds: str  # what its values are, plural, for messages ("first moments")
    bias_option: str  # the state format's field, and the optimizers' option, that sets its exponent bias


# The format events counted per code (FORMAT.md, "Format counts"): each event for every code.
FORMAT_EVENTS = ("saturated", "flushed", "subnormal")


def format_count_names(codes: tuple[StateCode, ...]) -> tuple[str, ...]:
    """Count names of `codes` in counter-row order: each event, for each code in turn."""
    return tuple(f"{event}_{code.suffix}" for event in FORMAT_EVENTS for code in codes)


@dataclass(frozen=True)
class RowVariant:
    """One hyperparameter row a step carries: the group's row with the fields in `zeroed` set
    to 0. Every leaf of a step takes one of its rule's variants (AdamW: the row with weight
    decay, and the row without it for the leaves its mask leaves out, as optax.adamw's mask)."""

    name: str
    zeroed: tuple[str, ...] = ()


# A rule with no variants: every leaf takes its group's row as it is.
GROUP_ROW = RowVariant("group")


# The smallest magnitude that rounds to float32 infinity (ties to even: FLOAT32_MAX's significand is odd).
FLOAT32_OVERFLOW = 2.0 ** 128 * (1 - 2.0 ** -25)


_FLOAT32 = struct.Struct("f")


def float_or_inf(x, convert=float) -> float:
    """`convert(x)` (a float), or +-Inf where x is a number past a float's range (an int or a
    Fraction of 400 digits): its bound then refuses it by name, where float() would raise a bare
    OverflowError. The one home of that reading, for every check of a hyperparameter's value."""
    try:
        return convert(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def float32_of(x) -> float:
    """A hyperparameter as the kernels see it: numpy's float32 of it (the value the torch frontend
    checks, whatever numpy's rounding of a numpy integer), as a Python float (`float_or_inf`)."""
    return float_or_inf(x, lambda v: float(np.float32(v)))


def _as_float32(x) -> float:
    """A Python number rounded to float32 (to nearest even, as numpy's float32 rounds it), as a
    Python float: +-Inf past float32's range, NaN as NaN. `struct` rounds with the C cast, at
    a third of numpy's host time, and refuses what overflows: that is checked first. An int past
    binary64's range is +-Inf too (`float_or_inf`)."""
    x = float_or_inf(x)
    return math.copysign(math.inf, x) if abs(x) >= FLOAT32_OVERFLOW else _FLOAT32.unpack(_FLOAT32.pack(x))[0]


@dataclass(frozen=True)
class Rule:
    """A rule's declaration. Its state entries depend on the state format it runs in, so the
    format (e.g. core/adamw's StateFormat) gives them; the rest is fixed."""

    name: str
    hyperparam_fields: tuple[str, ...]  # the float32 hyperparameter row, in order
    scalar_fields: tuple[str, ...]  # the step-scalar row its kernels read, in order
    bounds: Mapping[str, Bound]  # per hyperparameter field: its valid float32 values
    finite_products: tuple[tuple[str, str], ...] = ()  # pairs whose float32 product must stay finite
    count_names: tuple[str, ...] = ()  # format counts, in counter-row order (launch.py)
    matrix_phase: bool = False  # a phase over whole matrices (Muon's Newton-Schulz) precedes the elementwise one
    codes: tuple[StateCode, ...] = ()  # the 16-bit codes its state keeps per element, as `count_names` names them
    # The hyperparameters as an optimizer's parameter group holds them (torch.optim's keys; the
    # learning rate first), the order `group_row` and `validate` take their values in:
    group_keys: tuple[str, ...] = ()
    # (values in group_keys order, *, number=float) -> the hyperparameter row, each value passed
    # through `number` (floats for torch's rows; JAX keeps traced values as they are):
    group_row: Callable | None = None
    row_group: Callable | None = None  # (a hyperparameter row) -> its values in group_keys order: group_row's inverse
    # (values in group_keys order, *, allow_arrays=False) -> None, or ValueError/TypeError saying what to do;
    # with allow_arrays, values that are not plain numbers (schedules, traced arrays) are left to rows_valid:
    validate: Callable | None = None
    # The rows a step carries, each leaf taking one (RowVariant); the first is the group's row as it is.
    row_variants: tuple[RowVariant, ...] = (GROUP_ROW,)
    masked_variant: str | None = None  # the variant of the leaves a frontend's mask leaves out (None: no mask)
    # The hyperparameter fields through which the elementwise update reads the parameter's value
    # (AdamW: weight_decay, its decay lr * wd * p): where each is 0 in a leaf's row, the update
    # is the same for every finite parameter, so it can be computed without the parameters.
    # None: the update always reads them.
    param_read_through: tuple[str, ...] | None = None

    def __post_init__(self):
        if set(self.bounds) != set(self.hyperparam_fields):
            raise ValueError(f"rule {self.name}: bounds must cover exactly {self.hyperparam_fields}")
        if self.codes and format_count_names(self.codes) != tuple(self.count_names):
            raise ValueError(f"rule {self.name}: count_names must be {format_count_names(self.codes)}, "
                             "each format event for each of its codes")
        if not self.row_variants or self.row_variants[0].zeroed:
            raise ValueError(f"rule {self.name}: the first row variant must be the group's row as it is "
                             "(nothing zeroed)")
        names = [variant.name for variant in self.row_variants]
        zeroed = {field for variant in self.row_variants for field in variant.zeroed}
        read_through = set(self.param_read_through or ())
        if len(set(names)) != len(names) or not zeroed | read_through <= set(self.hyperparam_fields):
            raise ValueError(f"rule {self.name}: row variants need distinct names, and their zeroed fields and "
                             f"param_read_through must be among {self.hyperparam_fields}")
        if self.masked_variant is not None and self.masked_variant not in names[1:]:
            raise ValueError(f"rule {self.name}: masked_variant must name one of the row variants after the first")

    def rows_valid(self, rows):
        """Whether each hyperparameter row (the last axis: `hyperparam_fields`) holds valid
        values: every field within its `Bound` and every `finite_products` pair's product a
        finite number, in the rows' own arithmetic (float32 for float32 arrays). Takes numpy
        or jax.numpy arrays: a frontend's in-graph check is this one, not a copy of it."""
        column = {name: rows[..., i] for i, name in enumerate(self.hyperparam_fields)}
        valid = None
        for name in self.hyperparam_fields:
            holds = self.bounds[name].holds(column[name])
            valid = holds if valid is None else valid & holds
        for a, b in self.finite_products:
            product = column[a] * column[b]
            valid = valid & (product >= -FLOAT32_MAX) & (product <= FLOAT32_MAX)
        return valid

    def field_holds(self, index: int, row) -> bool:
        """Whether field `index` of a hyperparameter row of Python numbers (`hyperparam_fields`
        order) passes every check of `validate` that reads it: its `Bound` as a float32 number,
        and each `finite_products` pair it is in (the float32 values' product, in Python's
        arithmetic, at most FLOAT32_MAX). A host that validated a row can take a new value of
        this one field on this check alone (a scheduler's lr, every step)."""
        name = self.hyperparam_fields[index]
        value = _as_float32(row[index])
        if not self.bounds[name].holds(value):
            return False
        for pair in self.finite_products:
            if name in pair:
                other = pair[1] if pair[0] == name else pair[0]
                product = value * _as_float32(row[self.hyperparam_fields.index(other)])
                if not abs(product) <= FLOAT32_MAX:  # NaN (0 * Inf) too
                    return False
        return True

    def variant_rows(self, row) -> list[tuple]:
        """The rows a step carries (`row_variants` order) from the group's hyperparameter row
        (`hyperparam_fields` order; numbers or arrays, kept as they are): each the row with its
        variant's `zeroed` fields 0.0."""
        return [tuple(0.0 if name in variant.zeroed else value for name, value in zip(self.hyperparam_fields, row))
                for variant in self.row_variants]

    def leaf_variant(self, masked_in: bool) -> int:
        """The row variant (an index into `variant_rows`) of a leaf a frontend's mask selects
        (`masked_in`) or leaves out (`masked_variant`; a rule without one takes no mask)."""
        if masked_in:
            return 0
        if self.masked_variant is None:
            raise ValueError(f"rule {self.name}: it has no masked row variant, so its leaves cannot be masked out")
        return [variant.name for variant in self.row_variants].index(self.masked_variant)

    def param_reading_fields(self, variant: int) -> tuple[str, ...] | None:
        """The fields of a leaf's row (of `variant`) through which its update reads the
        parameter: `param_read_through` less those the variant zeroes (None: it always reads it)."""
        if self.param_read_through is None:
            return None
        zeroed = self.row_variants[variant].zeroed
        return tuple(name for name in self.param_read_through if name not in zeroed)

    def refusal_reason(self, row) -> str:
        """What makes a hyperparameter row invalid (a row `rows_valid` refused in a graph), in
        the words of the rule's host validation (`validate`)."""
        values = [float(x) for x in row]
        try:
            self.validate(*self.row_group(*values))
        except ValueError as e:
            return str(e)
        # not reached when rows_valid refused the row: both are written from the same bounds
        return f"[{', '.join(self.hyperparam_fields)}] = {values}"

    @property
    def hyperparam_row(self) -> int:
        return len(self.hyperparam_fields)

    @property
    def scalar_row(self) -> int:
        return len(self.scalar_fields)

    @property
    def scalar_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.scalar_fields)}


class StateLayout:
    """The layout a rule's state format gives every frontend, derived from its one
    `state_entry` (and the low half every rule shares): a state format (AdamW's, Muon's)
    defines `state_entry` and inherits the rest, so no frontend re-derives a shape or a size."""

    state_entry: StateEntry  # defined by each state format (a property of its mode)

    @property
    def state_key(self) -> str:
        """The state entry's name in state dicts and checkpoints."""
        return self.state_entry.key

    @property
    def state_dtype(self) -> str:
        """numpy name of the state entry's dtype."""
        return self.state_entry.dtype

    def state_shape(self, param_shape) -> tuple[int, ...]:
        """The state entry of one parameter of shape `param_shape`."""
        return self.state_entry.shape(param_shape)

    def flat_state_shape(self, n_elements: int) -> tuple[int, ...]:
        """`state_shape` of the flattened parameter, as the kernels and the numpy steps read it."""
        return self.state_entry.flat_shape(n_elements)

    @property
    def state_bytes_per_param(self) -> int:
        return self.state_entry.bytes_per_param

    # A per-matrix scale kept beside the codes (Muon's packed `mu_exponent`); None for a format
    # without one. A state format whose mode keeps one defines it.
    exponent_entry: StateEntry | None = None

    def param_entries(self, split: bool) -> tuple[StateEntry, ...]:
        """Every entry a parameter's state holds, in the order they are made: the state entry,
        the per-matrix exponent where the format keeps one, and (`split`: a bf16 parameter) the
        low half of its FP32 master."""
        scale = () if self.exponent_entry is None else (self.exponent_entry,)
        return (self.state_entry, *scale, *((LOW_HALF,) if split else ()))

    # ---- a bf16 parameter's low half (FORMAT.md, "Split masters"), as every rule keeps it ----
    @property
    def low_half_key(self) -> str:
        """The state entry that holds a bf16 parameter's low half (absent for FP32 parameters)."""
        return LOW_HALF.key

    @property
    def low_half_dtype(self) -> str:
        """numpy name of the low half's dtype: int16, one per parameter element."""
        return LOW_HALF.dtype

    def low_half_shape(self, param_shape) -> tuple[int, ...]:
        """The low half of one bf16 parameter: the parameter's shape."""
        return LOW_HALF.shape(param_shape)

    @property
    def low_half_bytes_per_param(self) -> int:
        return LOW_HALF.bytes_per_param

    @property
    def split_state_bytes_per_param(self) -> int:
        """Optimizer state of a bf16 parameter: its state entry plus the low half."""
        return self.state_bytes_per_param + LOW_HALF.bytes_per_param
