"""One element's step spelled out, every float32 intermediate in the order of docs/FORMAT.md.

The arithmetic uses only the scalar authority's primitives (`authority.f32`, `authority.power`,
`authority.codecs`): each operation is done in binary64 and rounded to binary32 at once, as
the authority does. The result is tested equal, bit for bit, to `core.numpy_step.adamw_step`
and to `authority.adamw_element`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from packed_adamw.core.adamw import authority
from packed_adamw.core.authority import f32, f32_bits
from packed_adamw.core.codecs import CODE_MASK, MiniFloat
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT, StateFormat

FLT_MAX = authority.bits_f32(0x7F7FFFFF)


@dataclass
class Line:
    """One intermediate: `name = expr` evaluates to `value` (a float32 number, an int or a bool)."""

    name: str
    expr: str
    value: float | int | bool
    note: str = ""

    def as_dict(self) -> dict:
        entry = {"name": self.name, "expr": self.expr, "value": self.value, "note": self.note}
        if isinstance(self.value, float):
            entry["bits"] = f"0x{f32_bits(self.value):08X}"
        return entry


@dataclass
class CodeFields:
    """A 16-bit code taken apart by its MiniFloat's fields."""

    code: int
    format: str
    sign: int | None
    exponent: int
    fraction: int
    kind: str  # zero, subnormal, normal, maximum (the largest finite value), reserved (FP16 Inf/NaN code)
    formula: str
    value: float

    def as_dict(self) -> dict:
        return {"code": self.code, "hex": f"0x{self.code:04X}", "format": self.format, "sign": self.sign,
                "exponent": self.exponent, "fraction": self.fraction, "kind": self.kind, "formula": self.formula,
                "value": self.value, "bits": f"0x{f32_bits(self.value):08X}"}


def code_fields(code: int, fmt: MiniFloat, codec: authority.Codec) -> CodeFields:
    """`code`'s sign, exponent and fraction fields (layout from `fmt`) and the value the step
    reads (decoded by the authority's codec, with the finite formula for every code)."""
    magnitude = code & ~fmt.sign_bit & CODE_MASK
    exponent, fraction = magnitude >> fmt.fraction_bits, magnitude & ((1 << fmt.fraction_bits) - 1)
    sign = (1 if code & fmt.sign_bit else 0) if fmt.signed else None
    minus = "-" if sign else ""
    F, B = fmt.fraction_bits, fmt.bias
    if exponent == 0:
        kind = "zero" if fraction == 0 else "subnormal"
        formula = f"{minus}{fraction} * 2^({1 - B - F})"
    else:
        kind = "normal"
        formula = f"{minus}(1 + {fraction}/2^{F}) * 2^({exponent} - {B})"
        if exponent > fmt.max_exponent_code:
            kind = "reserved"  # an IEEE half Inf/NaN code: never encoded, read with the finite formula
        elif magnitude == fmt.max_magnitude_code:
            kind = "maximum"
    return CodeFields(code, fmt.identity, sign, exponent, fraction, kind, formula, codec.decode(code))


@dataclass
class Walk:
    """One element's step: inputs, the step scalars and the per-element lines in order."""

    fmt: StateFormat
    count: int
    inputs: list[Line] = field(default_factory=list)
    scalars: list[Line] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    word: int | None = None  # packed / fp16: the stored word before and after
    word_next: int | None = None
    fields: dict = field(default_factory=dict)  # "m", "rms" (before) and "m_next", "rms_next" (stored after)
    p: float = 0.0
    p_next: float = 0.0
    update: float = 0.0
    state_next: object = None  # the word (int) or the (m, v) pair that is stored after the step
    accepted: bool = True

    def value(self, name: str):
        for line in (*self.inputs, *self.scalars, *self.lines):
            if line.name == name:
                return line.value
        raise KeyError(name)

    def as_dict(self) -> dict:
        out = {"format": self.fmt.identity, "count": self.count,
               "inputs": [x.as_dict() for x in self.inputs], "scalars": [x.as_dict() for x in self.scalars],
               "lines": [x.as_dict() for x in self.lines],
               "fields": {k: v.as_dict() for k, v in self.fields.items()},
               "accepted": self.accepted, "p": self.p, "p_bits": f"0x{f32_bits(self.p):08X}",
               "p_next": self.p_next, "p_next_bits": f"0x{f32_bits(self.p_next):08X}",
               "update": self.update, "update_bits": f"0x{f32_bits(self.update):08X}"}
        if self.word is not None:
            out["word"], out["word_next"] = f"0x{self.word:08X}", f"0x{self.word_next:08X}"
        else:
            m, v = self.state_next
            out["m_next_stored"], out["v_next_stored"] = m, v
            out["m_next_stored_bits"], out["v_next_stored_bits"] = f"0x{f32_bits(m):08X}", f"0x{f32_bits(v):08X}"
        return out


def walk_step(p, g, state, *, count: int, lr, b1, b2, eps, weight_decay, fmt: StateFormat,
              maximize: bool = False) -> Walk:
    """Spell out one step of one element. `state` is the uint32 word (packed, fp16) or the
    (m, v) float32 pair (fp32); `count` is the step count t of this step (after incrementing,
    as in FORMAT.md). `maximize` steps on the negated gradient, which gives the bits of
    torch's `maximize=True` (see `numpy_step.step_scalar_row`)."""
    if not 1 <= count < 2**31:
        raise ValueError(f"step count t={count} must be in [1, 2**31)")
    walk = Walk(fmt, count)
    add = walk.lines.append

    # Inputs, rounded to float32 as the step reads them.
    lr, b1, b2, eps, weight_decay, p, g = (f32(float(x)) for x in (lr, b1, b2, eps, weight_decay, p, g))
    for name, value in (("lr", lr), ("b1", b1), ("b2", b2), ("eps", eps), ("weight_decay", weight_decay),
                        ("p", p), ("g", g)):
        walk.inputs.append(Line(name, "float32", value))
    if maximize:
        g = -g
        walk.inputs.append(Line("g", "-g  (maximize: a step on the negated gradient)", g))
    walk.p = p

    # The step scalars (FORMAT.md, "Step scalars").
    s = walk.scalars.append
    b1_t, b2_t = authority.power(b1, count), authority.power(b2, count)
    s(Line("b1^t", f"square-and-multiply, t={count}", b1_t))
    s(Line("b2^t", f"square-and-multiply, t={count}", b2_t))
    one_minus_b1, one_minus_b2 = f32(1.0 - b1), f32(1.0 - b2)
    s(Line("one_minus_b1", "1 - b1", one_minus_b1))
    s(Line("one_minus_b2", "1 - b2", one_minus_b2))
    bias_correction1 = f32(1.0 - b1_t)
    s(Line("1 - b1^t", "1 - b1^t", bias_correction1))
    step_size = f32(lr / bias_correction1)
    s(Line("step_size", "lr / (1 - b1^t)", step_size))
    bias_correction2 = f32(1.0 - b2_t)
    s(Line("1 - b2^t", "1 - b2^t", bias_correction2))
    sqrt_bc2 = f32(math.sqrt(bias_correction2))
    s(Line("sqrt(1 - b2^t)", "sqrt(1 - b2^t)", sqrt_bc2))
    inv_sqrt_bc2 = f32(1.0 / sqrt_bc2)
    s(Line("inv_sqrt_bc2", "1 / sqrt(1 - b2^t)", inv_sqrt_bc2))
    lr_wd = f32(lr * weight_decay)
    s(Line("lr_wd", "lr * weight_decay", lr_wd))

    # The element (FORMAT.md, "The step").
    finite = math.isfinite(g)  # |g| <= FLT_MAX
    add(Line("finite", "|g| <= FLT_MAX", finite, "" if finite else "the element will be skipped"))
    g_used = g if finite else 0.0
    add(Line("g", "finite ? g : 0", g_used))
    if fmt.mode == "fp32":
        m, v = (f32(float(x)) for x in state)
        add(Line("m", "stored float32", m))
        add(Line("v", "stored float32", v))
    else:
        word = int(state)
        if not 0 <= word <= 0xFFFFFFFF:
            raise ValueError(f"word {word} does not fit in 32 bits")
        walk.word = word
        m_fmt, r_fmt = fmt.formats
        m_codec, r_codec = authority.codecs(fmt.mode, fmt.m_bias, fmt.rms_bias)
        walk.fields["m"] = code_fields(word >> MOMENT_SHIFT, m_fmt, m_codec)
        walk.fields["rms"] = code_fields(word & CODE_MASK, r_fmt, r_codec)
        m, rms = walk.fields["m"].value, walk.fields["rms"].value
        add(Line("m", f"decode(0x{word >> MOMENT_SHIFT:04X})  {walk.fields['m'].formula}", m))
        add(Line("rms", f"decode(0x{word & CODE_MASK:04X})  {walk.fields['rms'].formula}", rms))
        v = f32(rms * rms)
        add(Line("v", "rms * rms", v))
    b1_m = f32(b1 * m)
    add(Line("b1*m", "b1 * m", b1_m))
    c1_g = f32(one_minus_b1 * g_used)
    add(Line("(1-b1)*g", "one_minus_b1 * g", c1_g))
    m_next = f32(b1_m + c1_g)
    add(Line("m'", "b1*m + (1-b1)*g", m_next))
    b2_v = f32(b2 * v)
    add(Line("b2*v", "b2 * v", b2_v))
    g_sq = f32(g_used * g_used)
    add(Line("g*g", "g * g", g_sq))
    c2_gg = f32(one_minus_b2 * g_sq)
    add(Line("(1-b2)*g*g", "one_minus_b2 * (g*g)", c2_gg))
    v_next = f32(b2_v + c2_gg)
    add(Line("v'", "b2*v + (1-b2)*(g*g)", v_next))
    rms_next = f32(math.sqrt(v_next))
    add(Line("r'", "sqrt(v')", rms_next))
    scaled = f32(rms_next * inv_sqrt_bc2)
    add(Line("r'*inv_sqrt_bc2", "r' * inv_sqrt_bc2", scaled))
    denom = f32(scaled + eps)
    add(Line("denom", "r'*inv_sqrt_bc2 + eps", denom))
    ratio = f32(m_next / denom)
    add(Line("m'/denom", "m' / denom", ratio))
    adam_term = f32(step_size * ratio)
    add(Line("step_size*(m'/denom)", "step_size * (m'/denom)", adam_term))
    decay_term = f32(lr_wd * p)
    add(Line("lr_wd*p", "lr_wd * p", decay_term))
    update = -f32(adam_term + decay_term)
    add(Line("u", "-(step_size*(m'/denom) + lr_wd*p)", update))
    p_next = f32(p + update)
    add(Line("p'", "p + u", p_next))

    accepted = finite and math.isfinite(p_next)
    if fmt.mode == "fp32":
        accepted = accepted and math.isfinite(m_next) and math.isfinite(v_next)
        state_next = (m_next, v_next)
    else:
        rms_code = r_codec.encode(rms_next)
        add(Line("rms code'", f"encode(r') in {r_fmt.identity}", rms_code, _encode_note(rms_next, rms_code, r_fmt, r_codec)))
        m_code_raw = m_codec.encode(m_next)
        add(Line("m code (encoded)", f"encode(m') in {m_fmt.identity}", m_code_raw, _encode_note(m_next, m_code_raw, m_fmt, m_codec)))
        m_code = 0 if rms_code == 0 else m_code_raw
        rule = "the RMS survives: m code kept"
        if rms_code == 0:
            rule = "RMS code 0: m code stored as 0" + (f" (dropped 0x{m_code_raw:04X})" if m_code_raw else "")
        add(Line("m code'", "zero-RMS rule: rms code' == 0 ? 0 : m code", m_code, rule))
        state_next = (m_code << MOMENT_SHIFT) | rms_code
        add(Line("word'", "(m code' << 16) | rms code'", state_next))
    add(Line("accepted", "finite and p' finite" + (" and m', v' finite" if fmt.mode == "fp32" else ""), accepted,
             "" if accepted else "rejected: p and the state keep their bits, u = -0.0"))
    if accepted:
        walk.p_next, walk.update, walk.state_next = p_next, update, state_next
    else:
        walk.p_next, walk.update, walk.state_next = p, -0.0, (state if fmt.mode != "fp32" else (m, v))
    walk.accepted = accepted
    if fmt.mode != "fp32":
        walk.word_next = int(walk.state_next)  # what is stored: the old word when rejected
        walk.fields["m_next"] = code_fields(walk.word_next >> MOMENT_SHIFT, m_fmt, m_codec)
        walk.fields["rms_next"] = code_fields(walk.word_next & CODE_MASK, r_fmt, r_codec)
    return walk


def _encode_note(value: float, code: int, fmt: MiniFloat, codec: authority.Codec) -> str:
    magnitude = abs(value)
    stored = str(np.float32(codec.decode(code)))
    if math.isinf(magnitude) or magnitude >= fmt.max_value:
        return f"saturated: |x| >= max {str(np.float32(fmt.max_value))}, stored {stored}"
    if magnitude != 0 and code & ~fmt.sign_bit == 0:
        return f"flushed: |x| <= {str(np.float32(fmt.min_subnormal / 2))} (half the smallest subnormal) encodes as 0"
    if magnitude == 0:
        return "zero"
    kind = "subnormal" if (code & ~fmt.sign_bit) >> fmt.fraction_bits == 0 else "normal"
    return f"{kind}, stored {stored}"


# The rules whose one element's step can be spelled out, by `Rule.name`: each walk takes the
# element's (p, g, stored state) and the rule's hyperparameter row by field name (and maximize).
# A rule with a matrix phase (Muon's Newton-Schulz) has none: its update reads the whole matrix.
ELEMENT_WALKS = {"adamw": walk_step}
