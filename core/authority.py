"""The scalar authority: the spec (docs/FORMAT.md) executed one element at a time.

Pure Python floats and integers only; it shares no code with the numpy path or the kernel,
so agreeing with it is evidence, not tautology. Every float32 operation is done in binary64
and rounded to binary32 at once, which is exact for + - * / and sqrt (binary64 has more than
twice binary32's precision, so the double rounding is innocuous).
"""
from __future__ import annotations

import math
import struct

MODES = ("packed", "fp16", "fp32")


def f32(x: float) -> float:
    """Round a binary64 value to the nearest binary32 (ties to even), keeping Inf and NaN."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class Codec:
    """One 16-bit format: sign?, exponent field, fraction field, bias (see FORMAT.md)."""

    def __init__(self, signed: bool, exponent_bits: int, fraction_bits: int, bias: int, ieee_specials=False):
        self.signed, self.e_bits, self.f_bits, self.bias = signed, exponent_bits, fraction_bits, bias
        self.top_exponent = (1 << exponent_bits) - 1 - (1 if ieee_specials else 0)
        self.max_magnitude = (self.top_exponent << fraction_bits) | ((1 << fraction_bits) - 1)
        self.sign_bit = 1 << 15 if signed else 0

    def decode(self, code: int) -> float:
        magnitude = code & ~self.sign_bit & 0xFFFF
        exponent, fraction = magnitude >> self.f_bits, magnitude & ((1 << self.f_bits) - 1)
        if exponent == 0:
            value = math.ldexp(fraction, 1 - self.bias - self.f_bits)
        else:
            value = math.ldexp((1 << self.f_bits) + fraction, exponent - self.bias - self.f_bits)
        return -value if code & self.sign_bit else value

    def encode(self, value: float) -> int:
        if math.isnan(value):
            raise ValueError("NaN has no code")
        magnitude = abs(value)
        if math.isinf(magnitude):
            code = self.max_magnitude
        elif magnitude >= math.ldexp(1.0, 1 - self.bias):
            exponent = math.frexp(magnitude)[1] - 1  # magnitude in [2**exponent, 2**(exponent+1))
            if exponent + self.bias > self.top_exponent:
                code = self.max_magnitude
            else:
                significand = round(math.ldexp(magnitude, self.f_bits - exponent))  # round() ties to even
                code = ((exponent + self.bias) << self.f_bits) + significand - (1 << self.f_bits)
        else:
            code = round(math.ldexp(magnitude, self.f_bits - 1 + self.bias))
        code = min(code, self.max_magnitude)
        if self.signed and value < 0 and code != 0:
            code |= self.sign_bit
        return code


def codecs(mode: str, m_bias: int = 15, rms_bias: int = 15) -> tuple[Codec, Codec]:
    if mode == "packed":
        return Codec(True, 4, 11, m_bias), Codec(False, 4, 12, rms_bias)
    if mode == "fp16":
        half = Codec(True, 5, 10, 15, ieee_specials=True)
        return half, half
    raise ValueError(f"mode {mode!r} has no codecs")


def power(base: float, exponent: int) -> float:
    """base**exponent by square-and-multiply over 31 bits, each product rounded."""
    result, square = 1.0, base
    for _ in range(31):
        if exponent & 1:
            result = f32(result * square)
        square = f32(square * square)
        exponent >>= 1
    return result


def adamw_element(p, g, state, *, count, lr, b1, b2, eps, weight_decay, mode="packed", m_bias=15, rms_bias=15):
    """One element's step. `state` is a uint32 word (packed, fp16) or an (m, v) pair (fp32).

    Returns (p_new, update, state_new, accepted). A rejected element (non-finite gradient or
    result) keeps p and state, and its update is -0.0.
    """
    lr, b1, b2, eps, weight_decay, p, g = (f32(x) for x in (lr, b1, b2, eps, weight_decay, p, g))
    one_minus_b1, one_minus_b2 = f32(1.0 - b1), f32(1.0 - b2)
    step_size = f32(lr / f32(1.0 - power(b1, count)))
    inv_sqrt_bias_correction2 = f32(1.0 / f32(math.sqrt(f32(1.0 - power(b2, count)))))
    lr_wd = f32(lr * weight_decay)

    if mode == "fp32":
        m, v = state
    else:
        m_codec, r_codec = codecs(mode, m_bias, rms_bias)
        m, rms = m_codec.decode(state >> 16), r_codec.decode(state & 0xFFFF)
        v = f32(rms * rms)
    grad_finite = math.isfinite(g)
    g_used = g if grad_finite else 0.0
    m_next = f32(f32(b1 * m) + f32(one_minus_b1 * g_used))
    v_next = f32(f32(b2 * v) + f32(one_minus_b2 * f32(g_used * g_used)))
    rms_next = f32(math.sqrt(v_next))
    denom = f32(f32(rms_next * inv_sqrt_bias_correction2) + eps)  # >= eps > 0
    ratio = f32(m_next / denom)
    update = -f32(f32(step_size * ratio) + f32(lr_wd * p))
    p_next = f32(p + update)
    accepted = grad_finite and math.isfinite(p_next)
    if mode == "fp32":
        accepted = accepted and math.isfinite(m_next) and math.isfinite(v_next)
        state_next = (m_next, v_next)
    else:
        rms_code = r_codec.encode(rms_next)
        m_code = 0 if rms_code == 0 else m_codec.encode(m_next)  # the zero-RMS rule
        state_next = (m_code << 16) | rms_code
    if not accepted:
        return p, -0.0, state, False
    return p_next, update, state_next, True


# ---- split masters (FORMAT.md, "Split masters"): a bf16 weight and an int16 low half ----
SPLIT_MASTER_MAX_BITS = 0x7F7F7FFF  # the largest master whose bf16 weight is finite


def split_master(master_bits: int) -> tuple[int, int]:
    """FP32 master bits -> (bf16 bits, low half as a Python int in [-32768, 32767]): add half
    a bf16 step (2**15) to the 31-bit magnitude, mod 2**31, keep the top 15 bits under the
    sign, and the remainder below them less 2**15."""
    sign, magnitude = master_bits >> 31, master_bits & (2**31 - 1)
    rounded = (magnitude + 2**15) % 2**31
    return (sign << 15) | (rounded >> 16), (rounded % 2**16) - 2**15


def join_master(w_bits: int, lo: int) -> int:
    """(bf16 bits, low half in [-32768, 32767]) -> FP32 master bits."""
    magnitude = ((w_bits % 2**15) * 2**16 + lo) % 2**31
    return ((w_bits >> 15) << 31) | magnitude


def adamw_split_element(w_bits, lo, g, state, **step):
    """One element of a bf16 parameter held as (bf16 bits, low half): the master's
    `adamw_element` step (same keyword arguments), with a new master past SPLIT_MASTER_MAX
    rejected like a non-finite one. Returns (w_bits_new, lo_new, state_new, accepted)."""
    if w_bits % 2**15 == 0 and lo < 0:  # a zero written to the weight: it reads as that zero
        master_bits = (w_bits >> 15) << 31
    else:
        master_bits = join_master(w_bits, lo)
    master = bits_f32(master_bits)
    p_next, _, state_next, accepted = adamw_element(master, g, state, **step)
    if accepted and (f32_bits(p_next) & (2**31 - 1)) > SPLIT_MASTER_MAX_BITS:
        accepted = False
    if not accepted:  # the element keeps what it read (the same pair, but for a zero's stale low half)
        return (*split_master(master_bits), state, False)
    return (*split_master(f32_bits(p_next)), state_next, True)
