"""The float32 operations Muon's contract is written in (docs/MUON.md), in numpy, bit for bit:
the fused multiply-add and lerp, bf16 rounding, and scaling by powers of two. The numpy step,
the state format's checks and the references build on them; Triton and jnp compute the same.

The contract's lerp and weight update are fused multiply-adds (one rounding), as torch's CPU
kernels compute them. numpy has no fused multiply-add, so `fma32` computes it exactly: the
product of two float32 numbers is exact in float64, the sum's rounding error is recovered
exactly (TwoSum), and the float64 sum is rounded to odd before the final rounding to float32,
which makes the double rounding innocuous (53 >= 24 + 2 bits).
"""
from __future__ import annotations

import numpy as np

F32 = np.float32
QUIET_NAN_BF16 = 0x7FC0  # bf16_bits of every NaN


def fma32(a, b, c) -> np.ndarray:
    """a * b + c rounded once to float32 (ties to even), elementwise; inputs are float32."""
    a, b, c = (np.asarray(x, F32).astype(np.float64) for x in (a, b, c))
    with np.errstate(over="ignore", invalid="ignore"):
        product = a * b  # exact: 24 + 24 significant bits, exponents far inside float64's
        total = product + c
        c_part = total - product
        error = (product - (total - c_part)) + (c - c_part)  # TwoSum: exact sum - total, exactly
        bits = total.view(np.int64)
        # Round to odd: an inexact total with an even last bit moves one float64 ulp toward the
        # exact sum (int64 steps move magnitudes: +1 away from zero, -1 toward it).
        nudge = np.isfinite(total) & (error != 0) & ((bits & 1) == 0)
        away = (error > 0) == (total > 0)
        bits = np.where(nudge, bits + np.where(away, 1, -1), bits)
        return bits.view(np.float64).astype(F32)


def lerp32(start, end, weight) -> np.ndarray:
    """start + weight * (end - start) as MUON.md's `lerp`: weight < 0.5 (in magnitude):
    fma(weight, end - start, start); otherwise fma(weight - 1, end - start, end)."""
    weight = F32(weight)
    with np.errstate(over="ignore", invalid="ignore"):
        difference = np.asarray(end, F32) - np.asarray(start, F32)
    if abs(weight) < F32(0.5):
        return fma32(weight, difference, start)
    return fma32(weight - F32(1.0), difference, end)


def bf16_bits(values) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even as torch's `.bfloat16()`; a value
    that rounds past bf16's largest finite number gives Inf's bits. Every NaN gives the quiet NaN
    QUIET_NAN_BF16: rounding a NaN's bits as a number's could carry into the sign bit and make it
    -0 (a GPU's NaN is 0x7FFFFFFF), which would turn a Newton-Schulz overflow into a zero update.
    (torch's own conversions disagree on NaN: 0xFFFF on CPU, 0x7FFF on CUDA.)"""
    bits = np.asarray(values, F32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where((bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), np.uint16(QUIET_NAN_BF16), rounded)


def bf16_values(bits) -> np.ndarray:
    """bf16 bits (uint16 or int16) -> float32, exactly."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(F32)


def power_of_two(j) -> np.ndarray:
    """2**j as float32 for integers j in [-126, 127] (float32's normal binades), made on the bits."""
    j = np.asarray(j, np.int64)
    if np.any((j < -126) | (j > 127)):
        raise ValueError(f"power_of_two: exponents must lie in [-126, 127], got {j}")
    return ((j + 127) << 23).astype(np.uint32).view(F32)


def ldexp32(x, n) -> np.ndarray:
    """x * 2**n in float32 as MUON.md defines it, the same bits in numpy, Triton and jnp:
    (x * 2**(n >> 1)) * 2**(n - (n >> 1)), two rounded multiplications by float32 powers of two
    (exact unless the result is subnormal). `n` an integer in [-252, 254]."""
    n = np.asarray(n, np.int64)
    half = n >> 1
    with np.errstate(over="ignore", under="ignore"):
        return (np.asarray(x, F32) * power_of_two(half)) * power_of_two(n - half)


def floor_log2(amax) -> int:
    """floor(log2 amax) of a finite nonzero float32 magnitude, exactly, from its bits: the
    exponent field - 127 for a normal one; for a subnormal one the highest set bit's position - 149."""
    bits = int(np.asarray(amax, F32).view(np.uint32))
    field = bits >> 23
    return field - 127 if field else bits.bit_length() - 1 - 149
