"""The scalar authority's shared primitives: float32 rounding, one 16-bit code, powers and
split masters, for a rule's authority (core/adamw/authority.py) to execute the spec
(docs/FORMAT.md) one element at a time.

Pure Python floats and integers only; it shares no code with the numpy paths or the kernels,
so agreeing with it is evidence, not tautology. Every float32 operation is done in binary64
and rounded to binary32 at once, which is exact for + - * / and sqrt (binary64 has more than
twice binary32's precision, so the double rounding is innocuous).
"""
from __future__ import annotations

import math
import struct



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


def power(base: float, exponent: int) -> float:
    """base**exponent by square-and-multiply over 31 bits, each product rounded."""
    result, square = 1.0, base
    for _ in range(31):
        if exponent & 1:
            result = f32(result * square)
        square = f32(square * square)
        exponent >>= 1
    return result


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
