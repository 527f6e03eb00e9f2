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
# MUON.md, "E5M10 (packed)": a matrix's largest |m'| is encoded with exponent field 30.
_AMAX_EXPONENT_FIELD = 30


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


def ldexp(x: float, n: int) -> float:
    """MUON.md's ldexp32: (x * 2**(n >> 1)) * 2**(n - (n >> 1)), each product rounded to
    binary32 (a binary32 value times a power of two is exact in binary64)."""
    half = n >> 1
    return f32(f32(x * 2.0**half) * 2.0**(n - half))


def floor_log2(magnitude: float) -> int:
    """floor(log2 x) of a positive float (frexp's exponent is exact)."""
    return math.frexp(magnitude)[1] - 1


def matrix_exponent(amax: float, old: int, mu_bias: int = 31) -> int:
    """The exponent that puts amax * 2**-s in exponent field 30 of the code; `old` when amax is 0."""
    return old if amax == 0 else floor_log2(amax) + mu_bias - _AMAX_EXPONENT_FIELD


def decode(state, mode: str, mu_bias: int = 31, exponent: int = 0) -> float:
    if mode == "fp32":
        return state
    if mode == "bf16":
        return bits_f32(state << 16)
    return ldexp(codec(mu_bias).decode(state), exponent)


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


def momentum_matrix(grads, states, *, momentum, exponent=0, mode="packed", mu_bias=31, nesterov=True,
                    maximize=False):
    """One matrix's phase 1, element by element (its elements in any order). `momentum` as the
    user gave it (binary64); `exponent` the matrix's (packed mode). Returns (states_new,
    exponent_new, ns_inputs, ok): `ns_inputs` the bf16-rounded Newton-Schulz inputs as floats;
    `ok` False where the matrix is refused (then states and exponent are the old ones)."""
    one_minus_momentum, momentum = f32(1.0 - momentum), f32(momentum)
    refused = (list(states), exponent, None, False)
    m_nexts, ns_inputs = [], []
    for g, state in zip(grads, states):
        g = f32(g)
        if not math.isfinite(g):
            return refused
        if maximize:
            g = -g
        m_next = lerp(decode(state, mode, mu_bias, exponent), g, one_minus_momentum)
        if not math.isfinite(m_next):
            return refused
        x = lerp(g, m_next, momentum) if nesterov else m_next
        ns_input = bf16_round(x) if math.isfinite(x) else x
        if not math.isfinite(ns_input):
            return refused
        m_nexts.append(m_next)
        ns_inputs.append(ns_input)
    if mode == "packed":
        amax = max((abs(m) for m in m_nexts), default=0.0)
        exponent = matrix_exponent(amax, exponent, mu_bias)
        stored = [encode(ldexp(m, -exponent), mode, mu_bias) for m in m_nexts]
    else:
        stored = [encode(m, mode, mu_bias) for m in m_nexts]
        if any(s is None for s in stored):
            return refused
    return stored, exponent, ns_inputs, True


def momentum_element(g, state, *, momentum, exponent=0, mode="packed", mu_bias=31, nesterov=True, maximize=False):
    """`momentum_matrix` of a one-element matrix: (state_new, ns_input, ok)."""
    stored, _, ns_inputs, ok = momentum_matrix([g], [state], momentum=momentum, exponent=exponent, mode=mode,
                                               mu_bias=mu_bias, nesterov=nesterov, maximize=maximize)
    return (stored[0], ns_inputs[0], True) if ok else (state, None, False)


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
