"""Muon's scalar authority: its elementwise phases (docs/MUON.md) executed one element at a time.

Pure Python numbers only (floats, ints and exact fractions), on core/authority.py's primitives;
it shares no code with the numpy phases. The fused multiply-add is computed exactly with
fractions and rounded once, by integer arithmetic, to binary32.
"""
from __future__ import annotations

import math
from fractions import Fraction

from ..authority import SPLIT_MASTER_MAX_BITS, Codec, bits_f32, f32, f32_bits, join_master, split_master

MODES = ("packed", "bf16", "fp32")
_BF16 = Codec(True, 8, 7, 127, ieee_specials=True)  # bf16's finite codes
_BF16_OVERFLOW = math.ldexp(2.0 - 2.0**-8, 127)  # from here up, nearest-even rounding gives Inf


def round_to_f32(value: Fraction) -> float:
    """An exact rational rounded to the nearest binary32, ties to even (Inf past the range)."""
    if value == 0:
        return 0.0
    sign, magnitude = (-1.0 if value < 0 else 1.0), abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1  # now 2**exponent <= magnitude < 2**(exponent + 1)
    quantum_exponent = max(exponent, -126) - 23  # binary32's ulp there (subnormals: 2**-149)
    scaled = magnitude / Fraction(2) ** quantum_exponent
    whole = scaled.numerator // scaled.denominator
    rest = scaled - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    if whole * Fraction(2) ** quantum_exponent >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * math.ldexp(whole, quantum_exponent)


def fma(a: float, b: float, c: float) -> float:
    """a * b + c with one rounding to binary32; non-finite operands as IEEE 754's fusedMultiplyAdd."""
    if not all(math.isfinite(x) for x in (a, b, c)):
        return a * b + c  # Inf and NaN propagate as in one rounding (no finite intermediate)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:  # IEEE 754's sign of an exact zero sum: -0 only from -0 plus -0
        product_negative = math.copysign(1.0, a) * math.copysign(1.0, b) < 0
        both_negative_zeros = (a == 0 or b == 0) and product_negative and c == 0 and math.copysign(1.0, c) < 0
        return -0.0 if both_negative_zeros else 0.0
    return round_to_f32(exact)


def lerp(start: float, end: float, weight: float) -> float:
    difference = f32(end - start)
    if abs(weight) < 0.5:
        return fma(weight, difference, start)
    return fma(f32(weight - 1.0), difference, end)


def codec(mu_bias: int = 31) -> Codec:
    return Codec(True, 5, 10, mu_bias)


def decode(state, mode: str, mu_bias: int = 31) -> float:
    if mode == "fp32":
        return state
    if mode == "bf16":
        return bits_f32(state << 16)
    return codec(mu_bias).decode(state)


def encode(value: float, mode: str, mu_bias: int = 31):
    """The stored momentum, or None where bf16 rounding would give Inf (the matrix is refused)."""
    if mode == "fp32":
        return value
    if mode == "bf16":
        if abs(value) >= _BF16_OVERFLOW:
            return None
        return _BF16.encode(abs(value)) | (0x8000 if math.copysign(1.0, value) < 0 else 0)  # bf16 keeps -0
    return codec(mu_bias).encode(value)


def bf16_round(value: float):
    """bf16 nearest-even rounding, as a float32 value (Inf past bf16's range)."""
    if abs(value) >= _BF16_OVERFLOW:
        return math.copysign(math.inf, value)
    return math.copysign(_BF16.decode(_BF16.encode(abs(value))), value)


def momentum_element(g, state, *, momentum, mode="packed", mu_bias=31, nesterov=True, maximize=False):
    """One element's phase 1. `momentum` as the user gave it (binary64). Returns
    (state_new, ns_input, ok): `ns_input` is the bf16-rounded Newton-Schulz input as a float,
    and `ok` is False where this element refuses its matrix (then nothing else is meaningful)."""
    one_minus_momentum, momentum = f32(1.0 - momentum), f32(momentum)
    g = f32(g)
    if not math.isfinite(g):
        return state, None, False
    if maximize:
        g = -g
    m_next = lerp(decode(state, mode, mu_bias), g, one_minus_momentum)
    if not math.isfinite(m_next):
        return state, None, False
    x = lerp(g, m_next, momentum) if nesterov else m_next
    ns_input = bf16_round(x) if math.isfinite(x) else x
    stored = encode(m_next, mode, mu_bias)
    if not math.isfinite(ns_input) or stored is None:
        return state, None, False
    return stored, ns_input, True


def weight_element(p, o, *, lr, weight_decay, adjusted_lr):
    """One element's phase 2 on an FP32 weight: (p_new, accepted)."""
    decay, neg_adjusted_lr = f32(1.0 - lr * weight_decay), f32(-adjusted_lr)
    p_next = fma(neg_adjusted_lr, o, f32(p * decay))
    if not math.isfinite(p_next):
        return p, False
    return p_next, True


def weight_split_element(w_bits, lo, o, **step):
    """`weight_element` on a bf16 weight's split master: (w_bits_new, lo_new, accepted)."""
    if w_bits % 2**15 == 0 and lo < 0:  # a zero written to the weight reads as that zero
        master_bits = (w_bits >> 15) << 31
    else:
        master_bits = join_master(w_bits, lo)
    p_next, accepted = weight_element(bits_f32(master_bits), o, **step)
    if accepted and (f32_bits(p_next) & (2**31 - 1)) > SPLIT_MASTER_MAX_BITS:
        accepted = False
    return (*split_master(f32_bits(p_next) if accepted else master_bits), accepted)
