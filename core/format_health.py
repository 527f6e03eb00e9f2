"""Format health: where values sit in a 16-bit format's window, and exponent biases chosen
from observed moments (guide: docs/FORMAT_HEALTH.md; formats: docs/FORMAT.md).

A format at exponent bias B covers a fixed window of magnitudes: normals from `min_normal`
up to `max_value` (15 binades for the packed formats, exponent fields 1 to 15), and below
them subnormals down to `min_subnormal`, with fewer significant bits the smaller they are.
Moving the bias slides the window; it never widens it. This module says how a set of values
falls against one window (`window_histogram`), how many are NaN or Inf (`nonfinite_counts`:
a damaged state's, which the statistics leave out, `finite_elements`), and which biases put
observed values inside the normal range with room to grow: for every code of any rule
(`suggest_state_biases`, the rule found through core/rules.py) and, spelled out for AdamW's
first moments and RMS values, `suggest_biases`. Every threshold comes from `MiniFloat` (core/codecs.py); nothing here
restates a format fact.

A rule whose packed format scales each matrix by its own power of two (`scaled_per_matrix`:
Muon's `mu_exponent`, chosen at every step from the matrix's largest |value|) keeps its codes
relative to that exponent: its window is the codes' own (`encoded_values`: what the step encodes),
none saturates, and the bias moves the exponent, not the codes, so there is no bias to choose
(`suggest_state_biases` says so).

numpy only: no torch, no jax.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .adamw.state_format import DEFAULT_M_BIAS, StateFormat, first_moment_format, rms_format
from .codecs import BIAS_RANGE, MiniFloat
from .muon.float32 import ldexp32
from .muon.numpy_step import matrix_exponent
from .rule import StateLayout
from .rules import rule_formats
# Reading stored states and identities back is the rules registry's (core/rules.py); these names
# were this module's own since 1.0 and stay importable from here.
from .rules import moment_values, parse_minifloat_identity, state_format_from_identity  # noqa: F401

# ---- the window classes ------------------------------------------------------------------

# From the top of the magnitude axis down; NaN last (it has no place on the axis).
WINDOW_CLASSES = ("saturated", "normal", "subnormal", "flushed", "zero", "nan")
_SATURATED, _NORMAL, _SUBNORMAL, _FLUSHED, _ZERO, _NAN = range(len(WINDOW_CLASSES))


def classify(values, fmt: MiniFloat) -> np.ndarray:
    """The window class of each value (an index into WINDOW_CLASSES), for the float32 number
    the step would encode (values are converted to float32 first; the sign is ignored):

    - saturated: |x| >= fmt.max_value. Encoding stores the largest finite value; anything
      above it is clamped (a stored value equal to the maximum may have been clamped).
    - normal: encodes to a code with a nonzero exponent field, below the maximum.
    - subnormal: encodes to a nonzero code with exponent field 0 (fewer significant bits).
    - flushed: nonzero, but encodes to code 0 (|x| <= half the smallest subnormal).
    - zero: +0 or -0.
    - nan: NaN (no code stands for it; the step never encodes one).

    The bounds follow from round-to-nearest-even: halfway between the largest subnormal (odd
    fraction) and `min_normal` (even) rounds up, so a value is subnormal below
    `min_normal - min_subnormal / 2`; exactly half the smallest subnormal rounds to the even
    code, 0.
    """
    magnitude = np.abs(np.asarray(values, dtype=np.float32)).astype(np.float64).ravel()
    half_step = fmt.min_subnormal / 2  # exact in binary64 and binary32 for every bias
    classes = np.full(magnitude.shape, _NORMAL, dtype=np.int8)
    classes[magnitude < fmt.min_normal - half_step] = _SUBNORMAL
    classes[magnitude <= half_step] = _FLUSHED
    classes[magnitude == 0] = _ZERO
    classes[magnitude >= fmt.max_value] = _SATURATED
    classes[np.isnan(magnitude)] = _NAN
    return classes


@dataclass(frozen=True)
class WindowCounts:
    """How many values fall in each window class of one format."""

    format: str  # MiniFloat.identity
    counts: dict  # class name -> count, every class of WINDOW_CLASSES

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __getitem__(self, name: str) -> int:
        return self.counts[name]

    def fraction(self, name: str) -> float:
        return self.counts[name] / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        return {"format": self.format, "total": self.total, "counts": dict(self.counts),
                "fractions": {name: self.fraction(name) for name in WINDOW_CLASSES}}


def window_histogram(values, fmt: MiniFloat) -> WindowCounts:
    """Counts of `values` per window class of `fmt` (see `classify`)."""
    counts = np.bincount(classify(values, fmt), minlength=len(WINDOW_CLASSES))
    return WindowCounts(fmt.identity, {name: int(c) for name, c in zip(WINDOW_CLASSES, counts)})


def window_edges(fmt: MiniFloat) -> dict:
    """The window of `fmt` as log2 magnitudes: where flushing ends, subnormals end, and
    saturation begins (for plots and reports)."""
    return {"log2_min_subnormal": float(np.log2(fmt.min_subnormal)), "log2_min_normal": float(np.log2(fmt.min_normal)),
            "log2_max_value": float(np.log2(fmt.max_value))}


# ---- statistics of observed magnitudes -----------------------------------------------------

DEFAULT_LOW_QUANTILE = 0.01  # of nonzero magnitudes: below it, subnormals are tolerated
DEFAULT_HIGH_QUANTILE = 0.999999  # of nonzero magnitudes: kept `headroom` below the maximum
DEFAULT_HEADROOM = 2.0  # factor between the high quantile and the format's largest value


@dataclass(frozen=True)
class MagnitudeQuantiles:
    """Summary of observed magnitudes: the low and high quantiles of the nonzero ones, and,
    when known, the largest magnitude and the values themselves (float32, flattened)."""

    low: float
    high: float
    maximum: float | None = None
    nonzero: int | None = None
    values: np.ndarray | None = field(default=None, repr=False, compare=False)


def _flat_float32(values) -> np.ndarray:
    """One flat float32 array from an array or a sequence of arrays (all tensors of a model)."""
    if isinstance(values, np.ndarray) or np.isscalar(values):
        return np.asarray(values, dtype=np.float32).ravel()
    parts = [np.asarray(v, dtype=np.float32).ravel() for v in values]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def nonfinite_counts(values) -> dict[str, int]:
    """How many of `values` (an array, or a sequence of arrays taken together) are NaN and how
    many are +-Inf, apart: {"nan": ..., "inf": ...}. No step stores either, so a state holding
    one is damaged; statistics and bias suggestions leave such elements out (`finite_elements`)."""
    flat = _flat_float32(values)
    return {"nan": int(np.count_nonzero(np.isnan(flat))), "inf": int(np.count_nonzero(np.isinf(flat)))}


def finite_elements(code_values: Sequence) -> tuple[np.ndarray, ...]:
    """One tensor's values of each code (arrays of one shape, in its rule's `codes` order),
    flattened, keeping only the elements whose every code is finite: an element with a NaN or
    Inf in any code is left out of all of them, so codes read in pairs (AdamW's m and RMS, for
    the zero-RMS rule) stay paired."""
    flat = [np.asarray(x, dtype=np.float32).ravel() for x in code_values]
    if not flat:
        return ()
    keep = np.logical_and.reduce([np.isfinite(x) for x in flat])
    return tuple(x[keep] for x in flat)


def magnitude_quantiles(values, low: float = DEFAULT_LOW_QUANTILE, high: float = DEFAULT_HIGH_QUANTILE
                        ) -> MagnitudeQuantiles:
    """Quantiles `low` and `high` of the nonzero |values| (an array, or a sequence of arrays
    taken together). NaN and Inf are refused: neither has a magnitude a window can place, and
    an Inf would push every bias into saturation; leave them out first (`finite_elements`)."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"quantiles must satisfy 0 <= low <= high <= 1, got low={low}, high={high}")
    flat = _flat_float32(values)
    bad = nonfinite_counts(flat)
    if bad["nan"] or bad["inf"]:
        raise ValueError(f"moment statistics must be finite numbers, and {bad['nan']} NaN and {bad['inf']} Inf "
                         f"values of {flat.size} were given: leave them out first (format_health.finite_elements; "
                         "python -m packed_adamw.inspect counts them per tensor)")
    magnitude = np.abs(flat)
    nonzero = magnitude[magnitude > 0].astype(np.float64)
    if nonzero.size == 0:
        return MagnitudeQuantiles(0.0, 0.0, 0.0, 0, flat)
    q_low, q_high = np.quantile(nonzero, [low, high])
    return MagnitudeQuantiles(float(q_low), float(q_high), float(nonzero.max()), int(nonzero.size), flat)


def log2_quantiles(values, levels=(0.0, 0.01, 0.5, 0.99, 1.0)) -> dict | None:
    """log2 of the nonzero |values| at `levels` (None when every value is zero)."""
    magnitude = np.abs(_flat_float32(values)).astype(np.float64)
    nonzero = magnitude[(magnitude > 0) & np.isfinite(magnitude)]
    if nonzero.size == 0:
        return None
    return {str(level): float(q) for level, q in zip(levels, np.quantile(np.log2(nonzero), levels))}


# ---- choosing a bias ----------------------------------------------------------------------


@dataclass(frozen=True)
class BiasChoice:
    """The bias chosen for one format and why."""

    bias: int
    feasible: bool  # True when both the low quantile and the headroom constraint hold
    reason: str
    span: tuple[int, int] | None  # (b_low, b_sat): every bias that meets both constraints, when feasible
    quantiles: MagnitudeQuantiles
    headroom: float  # requested factor between the high quantile and the format's maximum
    max_value: float  # the chosen format's largest value
    sample: WindowCounts | None  # the sample's classes under the chosen format, when values were given
    # the code is scaled per matrix (`scaled_per_matrix`): every bias stores the same codes, `bias` is the default
    bias_independent: bool = False

    def as_dict(self) -> dict:
        q = self.quantiles
        return {"bias": self.bias, "feasible": self.feasible, "reason": self.reason,
                "bias_independent": self.bias_independent,
                "span": list(self.span) if self.span else None,
                "low_quantile_value": q.low, "high_quantile_value": q.high, "maximum": q.maximum,
                "headroom": self.headroom, "max_value": self.max_value,
                "sample": self.sample.as_dict() if self.sample else None}


def choose_bias(stats, fmt_at: Callable[[int], MiniFloat], *, low: float = DEFAULT_LOW_QUANTILE,
                high: float = DEFAULT_HIGH_QUANTILE, headroom: float = DEFAULT_HEADROOM,
                default: int = DEFAULT_M_BIAS) -> BiasChoice:
    """The exponent bias for one format family (`fmt_at(bias)` -> MiniFloat) from `stats`:
    observed values (an array or a sequence of arrays) or a `MagnitudeQuantiles`.

    Two constraints, each monotone in the bias (a larger bias slides the window down):
      - no saturation: `headroom * high_quantile <= max_value`, and the sample's largest
        magnitude stays below `max_value` (holds for every bias up to some b_sat);
      - no subnormal at the low end: the low quantile encodes as a normal number (holds for
        every bias from some b_low on).
    When both can hold, the smallest bias that keeps the low quantile normal is returned:
    all the remaining room goes above the high quantile, since a saturated moment changes
    the step while a subnormal one only loses relative precision. When they cannot both
    hold, saturation wins: b_sat, the largest bias without saturation, and the low end goes
    subnormal (or flushes). With no nonzero value, `default` is returned.
    """
    if not headroom >= 1.0:
        raise ValueError(f"headroom={headroom!r} must be >= 1 (a factor below the format's largest value)")
    q = stats if isinstance(stats, MagnitudeQuantiles) else magnitude_quantiles(stats, low, high)
    biases = range(BIAS_RANGE[0], BIAS_RANGE[1] + 1)

    def sample_counts(fmt):
        return window_histogram(q.values, fmt) if q.values is not None else None

    if not q.nonzero and q.high == 0:
        fmt = fmt_at(default)
        return BiasChoice(default, True, "no nonzero values: the default bias", None, q, headroom,
                          fmt.max_value, sample_counts(fmt))

    def no_saturation(bias: int) -> bool:
        fmt = fmt_at(bias)
        return q.high * headroom <= fmt.max_value and (q.maximum is None or classify([q.maximum], fmt)[0] != _SATURATED)

    def low_end_normal(bias: int) -> bool:
        return classify([q.low], fmt_at(bias))[0] == _NORMAL

    saturation_free = [b for b in biases if no_saturation(b)]
    b_sat = max(saturation_free) if saturation_free else None
    b_low = next((b for b in biases if low_end_normal(b)), None)
    if b_sat is not None and b_low is not None and b_low <= b_sat:
        bias, feasible, span = b_low, True, (b_low, b_sat)
        reason = (f"smallest bias keeping the low quantile {q.low:.3g} normal; the high quantile {q.high:.3g} sits "
                  f"{fmt_at(bias).max_value / q.high:.3g}x below the maximum (>= {headroom:g} required); "
                  f"biases {b_low} to {b_sat} all meet both constraints")
    elif b_sat is not None:
        bias, feasible, span = b_sat, False, None
        reason = (f"no bias keeps both {q.low:.3g} normal and {q.high:.3g} {headroom:g}x below the maximum; "
                  "largest bias without saturation (the low end goes subnormal)")
    else:
        bias, feasible, span = BIAS_RANGE[0], False, None
        reason = f"even bias {BIAS_RANGE[0]} saturates these values (high quantile {q.high:.3g}, maximum {q.maximum})"
    fmt = fmt_at(bias)
    return BiasChoice(bias, feasible, reason, span, q, headroom, fmt.max_value, sample_counts(fmt))


@dataclass(frozen=True)
class StateBiasSuggestion:
    """`suggest_state_biases`' answer: one exponent bias per code of a rule, and why."""

    state_format: StateLayout  # the rule's packed format at the chosen biases
    choices: tuple[BiasChoice, ...]  # one per code, in the rule's `codes` order
    notes: tuple[str, ...] = ()

    @property
    def biases(self) -> dict[str, int]:
        """The chosen biases by the state format's field (the optimizers' option): {"mu_bias": 31}."""
        return {code.bias_option: choice.bias for code, choice in zip(self.state_format.rule.codes, self.choices)}

    def as_dict(self) -> dict:
        codes = self.state_format.rule.codes
        return {**self.biases, "identity": self.state_format.identity,
                **{code.suffix: choice.as_dict() for code, choice in zip(codes, self.choices)},
                "notes": list(self.notes)}


def suggest_state_biases(rule, code_values, *, low: float = DEFAULT_LOW_QUANTILE, high: float = DEFAULT_HIGH_QUANTILE,
                         headroom: float = DEFAULT_HEADROOM):
    """A bias for each 16-bit code of any rule (`rule`: its name, `Rule` or a state format of
    it; core/rules.py) from observed values: `code_values` holds one entry per code, in the
    rule's `codes` order (AdamW: first moments, RMS values; Muon: momenta), each an array, a
    sequence of arrays or a `MagnitudeQuantiles`, chosen by `choose_bias` against that code's
    format. Per parameter group: pass one mapping `name -> code_values` and get
    `name -> StateBiasSuggestion` back. `suggest_biases` is AdamW's, with (m, rms) spelled out.

    A rule whose packed format scales each matrix (`scaled_per_matrix`: Muon) stores the same
    codes at every bias: each choice is its code's default bias, `bias_independent`, saying so,
    with the values' quantiles and no sample (and a note)."""
    entry = rule_formats(rule)
    if isinstance(code_values, Mapping):
        return {name: suggest_state_biases(entry.name, values, low=low, high=high, headroom=headroom)
                for name, values in code_values.items()}
    codes = entry.rule.codes
    if isinstance(code_values, (np.ndarray, MagnitudeQuantiles)) or len(code_values) != len(codes):
        raise ValueError(f"suggest_state_biases({entry.name!r}, ...) takes one entry of values per code of the rule "
                         f"({', '.join(code.holds for code in codes)}), got "
                         f"{type(code_values).__name__} of length {len(code_values)}")
    if scaled_per_matrix(entry.name):
        choices = tuple(_bias_independent_choice(values, entry.code_format(i, entry.default_bias(i)), codes[i],
                                                 entry.default_bias(i), low=low, high=high, headroom=headroom)
                        for i, values in enumerate(code_values))
        options = " and ".join(code.bias_option for code in codes)
        notes = [f"{entry.name}'s packed codes are relative to each matrix's power-of-two exponent: {options} "
                 "changes nothing, so no bias is suggested"]
    else:
        choices = tuple(choose_bias(values, lambda bias, i=i: entry.code_format(i, bias), low=low, high=high,
                                    headroom=headroom, default=entry.default_bias(i))
                        for i, values in enumerate(code_values))
        notes = _SUGGESTION_NOTES[entry.name](choices) if entry.name in _SUGGESTION_NOTES else ()
    fmt = entry.packed(**{code.bias_option: choice.bias for code, choice in zip(codes, choices)})
    return StateBiasSuggestion(fmt, choices, tuple(notes))


def _bias_independent_choice(stats, fmt: MiniFloat, code, default: int, *, low: float, high: float,
                             headroom: float) -> BiasChoice:
    """A code scaled per matrix: the default bias, and why no other would differ."""
    if not headroom >= 1.0:
        raise ValueError(f"headroom={headroom!r} must be >= 1 (a factor below the format's largest value)")
    q = stats if isinstance(stats, MagnitudeQuantiles) else magnitude_quantiles(stats, low, high)
    reason = (f"every {code.bias_option} stores the same codes: the step keeps each matrix's {code.holds} as codes "
              f"times 2^s, its exponent s chosen at every step from the matrix's largest |value| (the bias moves s, "
              f"not the codes; docs/MUON.md), so none saturates and the bias changes nothing (the default "
              f"{default} is as good as any)")
    return BiasChoice(default, True, reason, BIAS_RANGE, q, headroom, fmt.max_value, None, bias_independent=True)


# ---- codes scaled per matrix ----------------------------------------------------------------


def scaled_per_matrix(fmt) -> bool:
    """Whether the packed format of `fmt`'s rule (`fmt`: a state format, its `Rule` or the
    rule's name) stores each matrix's values as codes times 2**s, one exponent s per matrix
    chosen at every step from the matrix's largest |value| (its `exponent_entry`: Muon's
    `mu_exponent`, docs/MUON.md); such codes are the same bits at every bias."""
    return getattr(rule_formats(fmt).packed(), "exponent_entry", None) is not None


def _matrices(values: np.ndarray) -> np.ndarray:
    """A tensor's values as [matrices, elements]: one matrix per index of its leading axes."""
    return values.reshape(-1, int(np.prod(values.shape[-2:], dtype=np.int64))) if values.ndim >= 2 \
        else values.reshape(1, -1)


def chosen_exponents(values, packed: StateLayout) -> np.ndarray | None:
    """Each matrix's exponent (shape: the leading axes of `values`, () for one matrix) as the
    packed step of `packed` chooses it from the matrix's values (its largest finite |value|; 0
    for an all-zero one), for values kept wider than the code (fp32 and bf16 modes); None for a
    format that keeps no exponent."""
    if getattr(packed, "exponent_entry", None) is None:
        return None
    values = np.asarray(values, np.float32)
    exponents = [matrix_exponent(np.abs(m[np.isfinite(m)]).max(initial=np.float32(0)), 0, packed)
                 for m in _matrices(values)]
    return np.array(exponents, np.dtype(packed.exponent_entry.dtype)).reshape(values.shape[:-2] if values.ndim >= 2
                                                                              else ())


def encoded_values(values, packed: StateLayout, exponents=None) -> np.ndarray:
    """One code's values of a tensor as the packed format `packed` would encode them, the numbers
    its window classifies: for a format scaled per matrix, each matrix's values times 2**-s
    (ldexp32, as the step scales them), s its `exponents` entry (default `chosen_exponents`);
    otherwise the values themselves. For stored codes, their own values (`rules.code_values`
    without the exponent) are these."""
    values = np.asarray(values, np.float32)
    exponents = chosen_exponents(values, packed) if exponents is None else np.asarray(exponents)
    if exponents is None:
        return values
    scaled = [ldexp32(m, -int(s)) for m, s in zip(_matrices(values), exponents.reshape(-1))]
    return np.concatenate(scaled).reshape(values.shape) if scaled else values.copy()


@dataclass(frozen=True)
class BiasSuggestion:
    """`suggest_biases`' answer; unpacks as `m_bias, rms_bias = suggestion`."""

    m_bias: int
    rms_bias: int
    m: BiasChoice
    rms: BiasChoice
    notes: tuple[str, ...] = ()

    def __iter__(self):
        return iter((self.m_bias, self.rms_bias))

    @property
    def state_format(self) -> StateFormat:
        return StateFormat("packed", self.m_bias, self.rms_bias)

    def as_dict(self) -> dict:
        return {"m_bias": self.m_bias, "rms_bias": self.rms_bias, "identity": self.state_format.identity,
                "m": self.m.as_dict(), "rms": self.rms.as_dict(), "notes": list(self.notes)}


def suggest_biases(m, rms=None, *, low: float = DEFAULT_LOW_QUANTILE, high: float = DEFAULT_HIGH_QUANTILE,
                   headroom: float = DEFAULT_HEADROOM):
    """(m_bias, rms_bias) for the packed formats from observed moments.

    `m` and `rms` are the observed first moments (signs are ignored) and RMS values
    (`sqrt(v)`, e.g. from a few steps of FP32 AdamW): each an array, a sequence of arrays
    (all tensors of a model, taken together), or a `MagnitudeQuantiles`. Per parameter group:
    pass one mapping `name -> (m, rms)` and get `name -> BiasSuggestion` back.

    `low` and `high` are quantiles of the nonzero magnitudes: the `low` one must be a normal
    number of the format, the `high` one must sit at least `headroom` times below the
    format's largest value, and no sampled value may saturate. When both cannot hold,
    saturation is avoided first (see `choose_bias`). Returns a `BiasSuggestion`, which
    unpacks as `(m_bias, rms_bias)` and carries each choice's reason and the sample's
    window counts under the chosen formats.
    """
    if rms is None:
        if not isinstance(m, Mapping):
            raise TypeError("suggest_biases(m, rms) takes the first moments and the RMS values, or one mapping "
                            "name -> (m, rms) for per-group suggestions")
        return {name: suggest_biases(*pair, low=low, high=high, headroom=headroom) for name, pair in m.items()}
    suggestion = suggest_state_biases("adamw", (m, rms), low=low, high=high, headroom=headroom)
    m_choice, rms_choice = suggestion.choices
    return BiasSuggestion(m_choice.bias, rms_choice.bias, m_choice, rms_choice, suggestion.notes)


def _zero_rms_notes(choices: Sequence[BiasChoice]) -> list[str]:
    """AdamW's zero-RMS rule (FORMAT.md) at the chosen (m, rms) biases: how many sampled first
    moments it would drop, or, without elementwise pairs, when it can."""
    m_choice, rms_choice = choices
    notes = []
    m_values, rms_values = m_choice.quantiles.values, rms_choice.quantiles.values
    if m_values is not None and rms_values is not None and m_values.shape == rms_values.shape:
        # Elementwise pairs: count the first moments the zero-RMS rule would drop (FORMAT.md).
        dropped = zero_rms_drops(m_values, rms_values, first_moment_format(m_choice.bias),
                                 rms_format(rms_choice.bias))
        if dropped or rms_choice.bias < m_choice.bias:
            notes.append(f"zero-RMS rule: {dropped} of {m_values.size} sampled elements keep a nonzero first "
                         f"moment code while their RMS encodes to 0, so the stored first moment becomes 0")
    elif rms_choice.bias < m_choice.bias:
        notes.append(f"rms_bias {rms_choice.bias} < m_bias {m_choice.bias}: an RMS at or below "
                     f"{rms_format(rms_choice.bias).min_subnormal / 2:.3g} encodes to 0 and the zero-RMS rule then "
                     "drops the first moment too (FORMAT.md); pass elementwise m and RMS arrays to count it")
    return notes


# Notes a rule adds to its suggestions (by `Rule.name`); a rule without an entry adds none.
_SUGGESTION_NOTES: dict[str, Callable[[Sequence[BiasChoice]], list[str]]] = {"adamw": _zero_rms_notes}


def zero_rms_drops(m, rms, m_fmt: MiniFloat, rms_fmt: MiniFloat) -> int:
    """How many elements (m[i], rms[i]) lose their first moment to the zero-RMS rule: the RMS
    encodes to code 0 (zero or flushed) while the first moment alone would not."""
    gone = (_FLUSHED, _ZERO)
    return int(np.count_nonzero(np.isin(classify(rms, rms_fmt), gone) & ~np.isin(classify(m, m_fmt), gone)))
