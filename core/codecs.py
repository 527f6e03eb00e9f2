"""The generic codecs every rule's state is built from (spec: docs/FORMAT.md): 16-bit
minifloat codes and split FP32 masters. Nothing here knows an optimizer; a rule (core/adamw/)
says which codes it stores and where.

A `MiniFloat` describes one 16-bit code: an optional sign bit, then the exponent field, then
the fraction field. Every exponent code is finite (exponent 0 is subnormal), except in the
IEEE half format, whose top exponent is reserved for Inf/NaN and never produced. Encoding
rounds to nearest, ties to even, saturates at the largest finite magnitude, writes zero as
code 0 whatever its sign, and refuses NaN.

These numpy codecs serve the numpy steps, tools and tests; the Triton kernels (core/kernel.py)
and the scalar authorities (core/authority.py) implement the same spec independently.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

CODE_BITS = 16  # a code is half of a uint32 word
CODE_MASK = 0xFFFF
CODE_SIGN_BIT = 1 << (CODE_BITS - 1)  # the sign of a signed code
CODE_MAGNITUDE_MASK = CODE_SIGN_BIT - 1
BIAS_RANGE = (0, 100)  # keeps every code exactly representable as float32
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


@dataclass(frozen=True)
class MiniFloat:
    name: str
    signed: bool
    exponent_bits: int
    fraction_bits: int
    bias: int
    ieee_specials: bool = False  # top exponent reserved (IEEE half); never encoded

    def __post_init__(self):
        if int(self.signed) + self.exponent_bits + self.fraction_bits != CODE_BITS:
            raise ValueError(f"{self.name}: sign + exponent + fraction bits must be {CODE_BITS}")
        if not BIAS_RANGE[0] <= self.bias <= BIAS_RANGE[1]:
            raise ValueError(
                f"{self.name}: exponent bias {self.bias} is outside {BIAS_RANGE}; choose a bias in that range"
            )

    # ---- derived constants (used by the kernel launchers too) ----
    @property
    def sign_bit(self) -> int:
        return CODE_SIGN_BIT if self.signed else 0

    @property
    def max_exponent_code(self) -> int:
        return (1 << self.exponent_bits) - 1 - int(self.ieee_specials)

    @property
    def max_magnitude_code(self) -> int:
        return (self.max_exponent_code << self.fraction_bits) | ((1 << self.fraction_bits) - 1)

    @property
    def max_value(self) -> float:
        e = self.max_exponent_code - self.bias
        return float(np.ldexp(2.0 - 2.0 ** -self.fraction_bits, e))

    @property
    def min_normal(self) -> float:
        return float(np.ldexp(1.0, 1 - self.bias))

    @property
    def min_subnormal(self) -> float:
        return float(np.ldexp(1.0, 1 - self.bias - self.fraction_bits))

    @property
    def identity(self) -> str:
        sign = "S" if self.signed else "U"
        return f"{sign}E{self.exponent_bits}M{self.fraction_bits}b{self.bias}" + ("ieee" if self.ieee_specials else "")

    # ---- numpy codecs ----
    def decode(self, codes) -> np.ndarray:
        """uint16-valued codes -> float32 values (IEEE specials decode as Inf/NaN)."""
        codes = np.asarray(codes).astype(np.uint32)
        if np.any(codes > CODE_MASK):
            raise ValueError(f"{self.name}.decode: codes must fit in {CODE_BITS} bits")
        frac_bits = self.fraction_bits
        magnitude = codes & np.uint32(CODE_MASK & ~self.sign_bit)
        exponent = magnitude >> np.uint32(frac_bits)
        fraction = magnitude & np.uint32((1 << frac_bits) - 1)
        normal_bits = ((exponent.astype(np.int64) - self.bias + 127) << 23) | (fraction.astype(np.int64) << (23 - frac_bits))
        normal = np.where(exponent > 0, normal_bits, 0).astype(np.uint32).view(np.float32)
        subnormal = fraction.astype(np.float32) * np.float32(np.ldexp(1.0, 1 - self.bias - frac_bits))
        values = np.where(exponent > 0, normal, subnormal).astype(np.float32)
        if self.ieee_specials:
            special = exponent == (1 << self.exponent_bits) - 1
            values = np.where(special & (fraction == 0), np.float32(np.inf), values)
            values = np.where(special & (fraction != 0), np.float32(np.nan), values)
        if self.signed:
            values = np.where(codes & np.uint32(self.sign_bit), -values, values)
        return values.astype(np.float32)

    @functools.cached_property
    def decode_table(self) -> np.ndarray:
        """All 65,536 codes as the step decodes them (the numpy step looks them up). The step
        reads every code with the finite formula, FP16's reserved Inf/NaN codes included:
        those are never stored, and a foreign word holding one still gives a finite value,
        the same in the kernel, the authority and here."""
        finite = dataclasses.replace(self, ieee_specials=False)
        return finite.decode(np.arange(1 << CODE_BITS, dtype=np.uint32))

    def encode(self, values) -> np.ndarray:
        """float32 values -> uint16 codes (RNE, saturating, canonical zero; NaN refused)."""
        values = np.asarray(values, dtype=np.float32)
        if np.isnan(values).any():
            raise ValueError(f"{self.name}.encode: NaN cannot be encoded; no code stands for NaN")
        if not self.signed and (values < 0).any():
            raise ValueError(f"{self.name}.encode: the format is unsigned; got negative values")
        return self.encode_unchecked(values).astype(np.uint16)

    def encode_unchecked(self, values: np.ndarray) -> np.ndarray:
        """`encode` for float32 values known to hold no NaN (and no negatives if unsigned),
        as uint32 codes; the numpy step's hot path."""
        code = np.minimum(self.unsaturated_code(np.abs(values)), np.int32(self.max_magnitude_code)).view(np.uint32)
        if self.signed:
            code = np.where((values < 0) & (code != 0), code | np.uint32(self.sign_bit), code)
        return code

    def unsaturated_code(self, magnitude: np.ndarray) -> np.ndarray:
        """float32 magnitudes -> their magnitude codes rounded to nearest even, before
        saturation (int32; above `max_magnitude_code` where the value saturates)."""
        bits = magnitude.view(np.int32)
        drop = 23 - self.fraction_bits
        # Normal results: re-bias the float32 exponent, then round the dropped mantissa bits.
        # (int32 suffices: bits <= Inf's 0x7F800000; elsewhere the value is discarded.)
        rebased = bits - np.int32((127 - self.bias) << 23)
        normal = (rebased + np.int32((1 << (drop - 1)) - 1) + ((rebased >> drop) & 1)) >> drop
        # Subnormal results: scale to units of the smallest subnormal; float32 addition of
        # 2**23 rounds that to an integer, ties to even.
        magic = np.float32(2.0**23)
        with np.errstate(over="ignore"):  # overflows only where the result is normal
            scaled = np.minimum(magnitude * np.float32(np.ldexp(1.0, self.fraction_bits - 1 + self.bias)), magic)
        subnormal = ((scaled + magic) - magic).astype(np.int32)
        return np.where(magnitude >= np.float32(self.min_normal), normal, subnormal)


FP16 = MiniFloat("FP16", signed=True, exponent_bits=5, fraction_bits=10, bias=15, ieee_specials=True)  # IEEE half


# Split masters (FORMAT.md, "Split masters"): a bf16 parameter's FP32 master is its bf16 live
# weight plus an int16 low half. The helpers with numpy codecs are below; the kernel reads these.
SPLIT_SIGN_BIT = 1 << 15  # bf16's sign bit
SPLIT_LO_SIGN = 1 << 15  # int16's sign bit: adding it to an FP32 magnitude rounds to bf16, ties away from zero
SPLIT_MASTER_MAX = float(np.uint32(0x7F7F7FFF).view(np.float32))  # the largest master whose live weight is finite
SPLIT_MASTER_MAX_BITS = int(np.float32(SPLIT_MASTER_MAX).view(np.uint32))  # its float32 bits, 0x7F7F7FFF
LOW_HALF_KEY = "lo"  # the state entry of a bf16 parameter's low half
LOW_HALF_DTYPE = "int16"
_FP32_MAGNITUDE_MASK = 0x7FFFFFFF


def split_master(master) -> tuple[np.ndarray, np.ndarray]:
    """FP32 masters -> (bf16 live-weight bits as uint16, low halves as int16), any shape.

    The weight is the master rounded to the nearest bf16, ties away from zero; the low half is
    the signed remainder in float32 ulps (FORMAT.md, "Split masters"). Every
    float32 bit pattern has a split and `join_master` undoes it exactly; the weight is finite
    exactly when |master| <= SPLIT_MASTER_MAX (NaN and Inf masters are never stored). To write
    into a torch bf16 tensor, view it as `.view(torch.int16).numpy().view(np.uint16)`."""
    bits = np.asarray(master, dtype=np.float32).view(np.uint32)
    rounded = ((bits & np.uint32(_FP32_MAGNITUDE_MASK)) + np.uint32(SPLIT_LO_SIGN)) & np.uint32(_FP32_MAGNITUDE_MASK)
    w_bits = ((bits >> np.uint32(16)) & np.uint32(SPLIT_SIGN_BIT)) | (rounded >> np.uint32(16))
    lo = ((rounded & np.uint32(0xFFFF)) ^ np.uint32(SPLIT_LO_SIGN)).astype(np.uint16).view(np.int16)
    return w_bits.astype(np.uint16), lo


def join_master(w_bits, lo) -> np.ndarray:
    """(bf16 bits, low halves) -> FP32 masters, the inverse of `split_master` on all 2**32 pairs.

    `w_bits`: uint16 arrays of bf16 bits (int16 views of the same bits, as torch's
    `bf16.view(torch.int16).numpy()` gives, are read as their bits too); `lo`: int16 (or its
    uint16 view). Shapes broadcast. magnitude = (w's magnitude << 16) + lo, mod 2**31."""
    w_bits = _bits16(w_bits, "w_bits").astype(np.uint32)
    lo_bits = _bits16(lo, "lo").view(np.int16).astype(np.int32).view(np.uint32)  # sign-extended
    high = (w_bits & np.uint32(SPLIT_SIGN_BIT - 1)) << np.uint32(16)
    magnitude = (high + lo_bits) & np.uint32(_FP32_MAGNITUDE_MASK)  # uint32 wraps: mod 2**32, then mod 2**31
    return (((w_bits & np.uint32(SPLIT_SIGN_BIT)) << np.uint32(16)) | magnitude).view(np.float32)


def read_master(w_bits, lo) -> np.ndarray:
    """The master a step reads from (bf16 bits, low half): `join_master`, except that a zero
    weight with a negative low half reads as that signed zero (FORMAT.md, "Split masters",
    "Writes to the weight"). Only a write of zero to the weight outside the optimizer leaves
    such a pair (split never makes one from a number); joined, it would be a NaN."""
    w_bits = _bits16(w_bits, "w_bits")
    master = join_master(w_bits, lo)
    stale = ((w_bits & np.uint16(SPLIT_SIGN_BIT - 1)) == 0) & (_bits16(lo, "lo").view(np.int16) < 0)
    zero = (w_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.where(stale, zero, master)


def _bits16(array, name: str) -> np.ndarray:
    """A 16-bit array as its uint16 bits (a view: writes reach the caller's memory)."""
    array = np.asarray(array)
    if array.dtype == np.int16:
        return array.view(np.uint16)
    if array.dtype != np.uint16:
        raise TypeError(f"{name} must be a uint16 or int16 array of 16-bit patterns, got dtype {array.dtype}; "
                        f"view a torch bf16 tensor as .view(torch.int16).numpy()")
    return array
