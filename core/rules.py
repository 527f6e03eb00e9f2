"""The rules a saved state can name, found by the format identity it records.

Every saved state (a torch state_dict, a checkpoint, a training state, a PortableState)
records each tensor's format as its state format's `identity` string and nothing else, so a
reader that is handed a file learns the rule from that string: `state_format_from_identity`
asks every rule in RULES for the format whose identity spells it exactly. Each entry says
what a reader needs of a rule it does not otherwise know: its declaration (`Rule`: its codes,
count names, group keys), its state format class, the modes that class takes, and how the
stored state entry reads as the values of the rule's codes (`code_values`). A new rule of this
package is one more entry here, a rule defined elsewhere one `register_rule` call; format_health
and `python -m packed_adamw.inspect` name no rule.

numpy only: no torch, no jax.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .adamw.state_format import StateFormat as AdamWFormat
from .adamw.state_format import MODES as ADAMW_MODES
from .adamw.state_format import unpack_words
from .codecs import BIAS_RANGE, MiniFloat
from .muon.numpy_step import decode_momentum
from .muon.state_format import MODES as MUON_MODES
from .muon.state_format import StateFormat as MuonFormat
from .rule import Rule, StateLayout

# ---- a 16-bit code's identity, read back ------------------------------------------------------

_MINIFLOAT_IDENTITY = re.compile(r"(?P<sign>[SU])E(?P<e>\d+)M(?P<f>\d+)b(?P<bias>\d+)(?P<ieee>ieee)?")


def parse_minifloat_identity(text: str) -> dict:
    """`MiniFloat.identity` (e.g. "SE4M11b15") -> its fields (signed, exponent_bits,
    fraction_bits, bias, ieee_specials)."""
    match = _MINIFLOAT_IDENTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a 16-bit format identity such as 'SE4M11b15' or 'UE4M12b18'")
    return {"signed": match["sign"] == "S", "exponent_bits": int(match["e"]), "fraction_bits": int(match["f"]),
            "bias": int(match["bias"]), "ieee_specials": match["ieee"] is not None}


# ---- what each rule's stored state entry reads as ---------------------------------------------


def moment_values(moments: np.ndarray, fmt: AdamWFormat, exponent=None) -> tuple[np.ndarray, np.ndarray]:
    """AdamW's (first moments, RMS values) as float32 arrays from a stored state: uint32 words
    decoded exactly as the step decodes them (`MiniFloat.decode_table`), or an fp32 state's
    [2, ...] (m, v) with RMS = sqrt(v) rounded to float32, as the step computes it. Both are
    new arrays, never views of `moments`. AdamW keeps no exponent (`exponent` must be None)."""
    if exponent is not None:
        raise ValueError(f"{fmt.identity} keeps no per-matrix exponent; pass exponent=None")
    moments = np.asarray(moments)
    if fmt.mode == "fp32":
        if moments.dtype != np.float32 or moments.ndim < 1 or moments.shape[0] != 2:
            raise ValueError(f"an fp32 state is float32 [2, ...], got {moments.dtype} {moments.shape}")
        with np.errstate(invalid="ignore"):
            return moments[0].copy(), np.sqrt(moments[1])  # copies: the state may be stepped in place later
    if moments.dtype == np.int32:  # words saved as int32 views of the same bits
        moments = moments.view(np.uint32)
    if moments.dtype != np.uint32:
        raise ValueError(f"a {fmt.mode} state is uint32 words, got {moments.dtype}")
    m_fmt, r_fmt = fmt.formats
    m_codes, rms_codes = unpack_words(moments)
    return m_fmt.decode_table[m_codes], r_fmt.decode_table[rms_codes]


def momentum_values(momentum: np.ndarray, fmt: MuonFormat, exponent=None) -> tuple[np.ndarray]:
    """Muon's (momenta,) as a float32 array from a stored state: packed codes decoded as the
    step decodes them, times 2**exponent per matrix (`exponent`: the int32 `mu_exponent` entry,
    shape () for one matrix or the leading axes' for a stack of them, as
    `StateFormat.check_exponent` checks it; None for a state saved before the exponents, which
    read with 0), bf16 bits widened exactly, fp32 values copied. torch keeps the 16-bit codes
    in int16 tensors (muon.py): they are read as the same bits."""
    momentum = np.asarray(momentum)
    if exponent is not None and fmt.mode != "packed":
        raise ValueError(f"{fmt.identity} keeps no per-matrix exponent; pass exponent=None")
    if fmt.mode == "fp32":
        if momentum.dtype != np.float32:
            raise ValueError(f"an fp32 Muon state is float32 momenta, got {momentum.dtype}")
        return (momentum.copy(),)
    if momentum.dtype == np.int16:
        momentum = momentum.view(np.uint16)
    if momentum.dtype != np.uint16:
        raise ValueError(f"a {fmt.mode} Muon state is 16-bit codes, got {momentum.dtype}")
    if fmt.mode == "bf16" or exponent is None:
        return (np.asarray(decode_momentum(momentum, fmt), np.float32),)
    if momentum.ndim < 2:
        raise ValueError(f"a packed Muon momentum is a matrix or a stack of them, got shape {momentum.shape}")
    exponent = fmt.check_exponent(exponent, "momentum_values: the exponents", shape=momentum.shape[:-2],
                                  remedy="pass the state's own (its mu_exponent entry)")
    values = np.empty(momentum.shape, np.float32)
    for index in np.ndindex(exponent.shape):
        values[index] = decode_momentum(momentum[index], fmt, exponent[index])
    return (values,)


# ---- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleFormats:
    """One rule as a reader of saved states sees it. Its state format class is built as
    `state_format(mode, **biases)` with one bias field per code (`StateCode.bias_option`);
    `state_format()` is its packed format at the default biases."""

    rule: Rule
    state_format: type
    modes: tuple[str, ...]
    # (the stored state entry, its state format, its per-matrix exponent or None) -> each code's
    # values as float32 arrays shaped like the parameter, in `rule.codes` order: what the step
    # reads (a float32 mode's values are those a packed state would encode)
    code_values: Callable[[np.ndarray, StateLayout, np.ndarray | None], tuple[np.ndarray, ...]]
    # the same arguments -> the rule's moments as its step reads them, float32, shaped like the
    # parameter, first moment first (AdamW: m and v): what an export of the state in another
    # optimizer's terms reads (training_state.export_reference_layout). None: its codes' values
    # are its moments (Muon's momentum)
    step_moments: Callable[[np.ndarray, StateLayout, np.ndarray | None], tuple[np.ndarray, ...]] | None = None

    @property
    def name(self) -> str:
        return self.rule.name

    def default_bias(self, code: int) -> int:
        return getattr(self.state_format(), self.rule.codes[code].bias_option)

    def packed(self, **biases) -> StateLayout:
        """The packed format with the given codes' biases (by bias option), the others at their defaults."""
        return dataclasses.replace(self.state_format(), **biases)

    def code_format(self, code: int, bias: int) -> MiniFloat:
        """Code `code`'s 16-bit format at exponent bias `bias`."""
        return self.packed(**{self.rule.codes[code].bias_option: bias}).formats[code]

    def parse(self, identity: str) -> StateLayout | None:
        """The format of this rule whose identity is exactly `identity` (or its legacy identity:
        Muon's packed one before the per-matrix exponents), or None. The biases are read from
        the identity's 16-bit code identities in their order; a mode whose codes have a fixed
        bias (fp16) or no code is matched at the defaults."""
        biases = [int(match["bias"]) for match in _MINIFLOAT_IDENTITY.finditer(identity)]
        codes = self.rule.codes
        candidates = [{}]
        if len(biases) == len(codes):
            candidates.insert(0, {code.bias_option: bias for code, bias in zip(codes, biases)})
        for mode in self.modes:
            for fields in candidates:
                try:
                    fmt = self.state_format(mode, **fields)
                except (TypeError, ValueError):  # a bias outside the range: no format of this code
                    continue
                if identity in (fmt.identity, getattr(fmt, "legacy_identity", None)):
                    return fmt
        return None

    def examples(self) -> list[str]:
        """Each mode's identity at the default biases, for messages."""
        return [self.state_format(mode).identity for mode in self.modes]


def adamw_step_moments(moments: np.ndarray, fmt: AdamWFormat, exponent=None) -> tuple[np.ndarray, np.ndarray]:
    """AdamW's (m, v) as float32 arrays, as its step reads them: a packed or fp16 state's first
    moment and v = rms * rms (the square the step computes, in float32); an fp32 state's stored m
    and v, copied."""
    moments = np.asarray(moments)
    if fmt.mode == "fp32":
        m, _ = moment_values(moments, fmt, exponent)  # its checks; v is stored as it is
        return m, moments[1].copy()
    m, rms = moment_values(moments, fmt, exponent)
    return m, rms * rms


RULES: dict[str, RuleFormats] = {
    entry.name: entry for entry in (
        RuleFormats(AdamWFormat().rule, AdamWFormat, ADAMW_MODES, moment_values, adamw_step_moments),
        RuleFormats(MuonFormat().rule, MuonFormat, MUON_MODES, momentum_values),
    )
}


def register_rule(entry: RuleFormats) -> RuleFormats:
    """Add a rule defined outside this package (an `ElementwiseOptimizer` / `packed_rule` rule:
    docs/ARCHITECTURE.md, "How a rule plugs in") to the registry, so that saved states naming its
    formats read back: `state_format_from_identity`, `format_health` and `python -m
    packed_adamw.inspect`. Registering the same entry again is a no-op; a different rule under a
    name already taken, a format identity another rule already spells, a mode its state format
    does not build, a format naming another rule or two modes of one identity are refused, and
    the registry is left as it was."""
    if not isinstance(entry, RuleFormats):
        raise TypeError(f"register_rule takes a RuleFormats (its rule, state format class, modes and code_values), "
                        f"got {type(entry).__name__}")
    known = RULES.get(entry.name)
    if known is not None:
        if known == entry:
            return known
        raise ValueError(f"a rule named {entry.name!r} is registered already ({known.state_format.__name__}); "
                         "give the new rule a name of its own")
    where = f"register_rule: rule {entry.name!r}"
    for mode in entry.modes:  # every mode at its default biases builds, and its saved states read back as it
        try:
            fmt = entry.state_format(mode)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{where}: its state format {entry.state_format.__name__} does not build mode {mode!r} "
                             f"({error}); list in modes only the modes it takes") from None
        identity = fmt.identity
        for other in RULES.values():
            if other.parse(identity) is not None:
                raise ValueError(f"rule {entry.name!r}: its format identity {identity!r} is rule {other.name!r}'s; "
                                 "a saved state would be read as the other rule's: give its identity a prefix "
                                 "of its own")
        if fmt.rule != entry.rule:  # `rule_formats` finds a format's entry by its rule's name
            raise ValueError(f"{where}: its format {identity!r} names rule {fmt.rule.name!r}; give the entry the "
                             "rule its state format declares")
        if entry.parse(identity) != fmt:
            raise ValueError(f"{where}: its format {identity!r} (mode {mode!r}) reads back as "
                             f"{entry.parse(identity)!r}; give each mode an identity of its own")
    RULES[entry.name] = entry
    return entry


def rule_formats(of) -> RuleFormats:
    """The registry entry of a rule, given its name, its `Rule` or one of its state formats."""
    name = of if isinstance(of, str) else of.name if isinstance(of, Rule) else of.rule.name
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"no rule named {name!r}; the rules are {sorted(RULES)}") from None


def state_format_from_identity(identity: str) -> StateLayout:
    """The state format, of whichever rule, whose `identity` is exactly `identity` (e.g.
    "packed:m=SE4M11b15,rms=UE4M12b15" for AdamW, "muon-packed:mu=SE5M10b31:scale=pow2/matrix"
    for Muon, or the legacy "muon-packed:mu=SE5M10b31"); its `rule` names the rule. A string
    that names no format this code makes is refused."""
    if isinstance(identity, str):
        for entry in RULES.values():
            fmt = entry.parse(identity)
            if fmt is not None:
                return fmt
    known = "; ".join(f"{entry.name}: " + ", ".join(map(repr, entry.examples())) for entry in RULES.values())
    raise ValueError(f"{identity!r} is not the state format identity of any rule this code has ({known}; "
                     f"the biases may be any in {list(BIAS_RANGE)})")


def step_moments(state: np.ndarray, fmt: StateLayout, exponent=None) -> tuple[np.ndarray, ...]:
    """A stored state entry's moments as its rule's step reads them (`RuleFormats.step_moments`);
    `exponent`: a per-matrix exponent where the format keeps one (None: read with 0)."""
    entry = rule_formats(fmt)
    return (entry.step_moments or entry.code_values)(state, fmt, exponent)


def code_values(state: np.ndarray, fmt: StateLayout, exponent=None) -> tuple[np.ndarray, ...]:
    """A stored state entry's values of each of its rule's codes (`RuleFormats.code_values`);
    `exponent`: a Muon packed state's per-matrix exponents (None: read with 0)."""
    return rule_formats(fmt).code_values(state, fmt, exponent)
