"""Muon's state format: the momentum buffer's mode and, in packed mode, its 16-bit code, its
bias and each matrix's power-of-two exponent (spec: docs/MUON.md, "The momentum formats")."""
from __future__ import annotations

import functools
import numbers
import operator
from dataclasses import dataclass

import numpy as np

from ..codecs import BIAS_RANGE, MiniFloat
from ..rule import Rule, StateEntry, StateLayout
from .float32 import ldexp32
from .rule import MOMENTUM_BUFFER, MOMENTUM_CODE, MOMENTUM_EXPONENT, RULE

DEFAULT_MU_BIAS = 31
MODES = ("packed", "bf16", "fp32")
# Packed mode scales each matrix by 2**s, s chosen at every step so that the matrix's largest
# |m'| is encoded with this exponent field: one binade below the code's top one (31), so no
# momentum ever saturates and 30 binades of normal codes lie below the largest (MUON.md).
AMAX_EXPONENT_FIELD = 30
# floor(log2 |x|) over float32's finite nonzero values (2**-149 .. FLOAT32_MAX).
FLOAT32_EXPONENTS = (-149, 127)
# What the packed identity adds to the code's: the per-matrix power-of-two exponent. A packed state
# saved before it (the identity without it) is read with s = 0 (`StateFormat.saved_without_exponents`).
SCALE_IDENTITY = "scale=pow2/matrix"


@functools.cache
def momentum_format(bias: int = DEFAULT_MU_BIAS) -> MiniFloat:
    """The packed momentum code: signed, 5 exponent bits (all finite), 10 fraction bits."""
    return MiniFloat("E5M10", signed=True, exponent_bits=5, fraction_bits=10, bias=bias)


E5M10 = momentum_format()


@dataclass(frozen=True)
class StateFormat(StateLayout):
    """What a saved Muon state must match: the mode and, in packed mode, the code's bias."""

    mode: str = "packed"
    mu_bias: int = DEFAULT_MU_BIAS

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if isinstance(self.mu_bias, (bool, np.bool_)):
            raise TypeError(f"mu_bias={self.mu_bias!r}: an exponent bias is an int (e.g. mu_bias=31), not a bool")
        try:
            bias = operator.index(self.mu_bias)
        except TypeError:
            raise TypeError(f"mu_bias={self.mu_bias!r}: the exponent bias fixes the state format, so it must be a "
                            "Python int known before compilation") from None
        if not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
            raise ValueError(f"mu_bias={bias} is outside {list(BIAS_RANGE)}; choose an exponent bias in that range")
        object.__setattr__(self, "mu_bias", bias)

    @property
    def code(self) -> MiniFloat | None:
        """The packed code's codec; None in bf16 and fp32 modes."""
        return momentum_format(self.mu_bias) if self.mode == "packed" else None

    @property
    def formats(self) -> tuple[MiniFloat] | None:
        """The codecs of the rule's `codes`, in their order (core/rule.py's StateCode), as
        AdamW's state format gives its two: (the momentum code,) in packed mode; None in bf16 and
        fp32 modes, whose momenta are not counted (MUON.md, "Format counts")."""
        return (self.code,) if self.mode == "packed" else None

    @property
    def identity(self) -> str:
        """Recorded in every saved state and compared on load."""
        if self.mode == "packed":
            return f"{self.legacy_identity}:{SCALE_IDENTITY}"
        return "muon-bf16:mu=bf16" if self.mode == "bf16" else "muon-fp32:mu=f32"

    @property
    def legacy_identity(self) -> str | None:
        """Packed mode's identity before the per-matrix exponent (its codes read with s = 0,
        exactly the values they had); None in bf16 and fp32 modes, which did not change."""
        return f"muon-packed:mu={self.code.identity}" if self.mode == "packed" else None

    def reads(self, saved) -> bool:
        """Whether a state saved with identity `saved` loads into this format: its own, or (packed
        mode) its legacy identity, the same codes without exponents."""
        return saved == self.identity or (saved is not None and saved == self.legacy_identity)

    def saved_without_exponents(self, saved) -> bool:
        """Whether a state of identity `saved` (one this format `reads`) predates the exponents:
        every matrix's exponent is then 0."""
        return self.legacy_identity is not None and saved == self.legacy_identity

    def check_identity(self, saved) -> bool:
        """Refuse a saved state written in another format; returns `saved_without_exponents`."""
        if not self.reads(saved):
            raise ValueError(f"the saved Muon state has format {saved!r} but this optimizer uses {self.identity!r}; "
                             "construct the optimizer with the saved state's mode and mu_bias")
        return self.saved_without_exponents(saved)

    @property
    def state_entry(self) -> StateEntry:
        """One uint16 code (packed: E5M10; bf16: the bf16 bits) or one float32 per element."""
        return MOMENTUM_BUFFER if self.mode == "fp32" else MOMENTUM_CODE

    def momentum_finite(self, momentum, xp=np):
        """Whether a stored momentum entry holds no NaN or Inf, as no step stores one: fp32 values,
        bf16 codes (exponent all ones is Inf or NaN); a packed code is a number, its range its
        exponent's (`check_exponent`). `xp`: the array module of `momentum` (numpy, jax.numpy), so
        each frontend checks where its arrays are; returns that module's boolean."""
        if self.mode == "fp32":
            return xp.all(xp.isfinite(momentum))
        if self.mode == "bf16":
            exponent_bits = np.uint16(0x7F80)
            return ~xp.any((momentum & exponent_bits) == exponent_bits)
        return xp.bool_(True)

    @property
    def exponent_entry(self) -> StateEntry | None:
        """Packed mode's per-matrix int32 exponent (`mu_exponent`, shape ()); None otherwise."""
        return MOMENTUM_EXPONENT if self.mode == "packed" else None

    @property
    def exponent_range(self) -> tuple[int, int]:
        """The exponents a step stores (packed mode): floor(log2 amax) + mu_bias - 30 over every
        finite nonzero float32 amax; the first step's 0 lies inside for every bias."""
        low, high = (k + self.mu_bias - AMAX_EXPONENT_FIELD for k in FLOAT32_EXPONENTS)
        return low, high

    def check_exponent(self, exponent, where: str, *, shape=(), codes=None,
                       remedy: str = "the state was edited or damaged") -> np.ndarray:
        """The one check of a stored per-matrix exponent (packed mode), which every reader of a
        saved state makes (PortableState, torch's load, inspect, training states) and
        `decode_momentum` makes of its argument: `exponent` must be the format's int32 array of
        `shape` (one per matrix: the parameter's shape less its last two axes; a Python or numpy
        integer stands for shape ()), each one a step stores (`exponent_range`), and, given the
        matrices' `codes` (uint16 or their int16 view, shaped `shape` + the matrix), none under
        which a matrix's largest code decodes past float32's range (NaN or Inf, which no step
        stores). A refusal is a ValueError that begins with `where` (which names the exponent)
        and ends with `remedy`. Returns the exponents as an int32 array."""
        entry = self.exponent_entry
        if entry is None:
            raise ValueError(f"{where}: {self.identity} keeps no per-matrix exponent")
        dtype, shape = np.dtype(entry.dtype), tuple(shape)
        if isinstance(exponent, numbers.Integral) and not isinstance(exponent, (bool, np.bool_)) and shape == ():
            values = np.asarray(int(exponent))  # int64 or object: the range check below sees its value
        elif isinstance(exponent, np.ndarray) and exponent.dtype == dtype and exponent.shape == shape:
            values = exponent
        else:
            got = f"{exponent.dtype} {exponent.shape}" if isinstance(exponent, np.ndarray) else type(exponent).__name__
            raise ValueError(f"{where} must be the matrices' {dtype} exponents of shape {shape} (one per matrix: "
                             f"{self.identity} keeps each matrix's momentum as its codes times 2**{entry.key}), got "
                             f"{got}; {remedy}")
        low, high = self.exponent_range
        if values.size and not (low <= values.min() and values.max() <= high):
            raise ValueError(f"{where} is {values.tolist()}, outside the [{low}, {high}] a step stores with mu_bias "
                             f"{self.mu_bias} ({self.identity}); {remedy}")
        values = values.astype(dtype)
        if codes is not None and values.size:
            codes = np.asarray(codes)
            if codes.dtype not in (np.uint16, np.int16) or codes.shape[:-2] != shape or codes.ndim != len(shape) + 2:
                raise ValueError(f"{where}: the codes are {codes.dtype} {codes.shape}, expected 16-bit codes of "
                                 f"shape {shape} + a matrix's")
            # A code's magnitude orders its value: each matrix's largest tells whether any is past float32's range.
            magnitude = codes.view(np.uint16).reshape(values.size, -1) & np.uint16(self.code.sign_bit - 1)
            largest = self.code.decode_table[magnitude.max(axis=1, initial=0).astype(np.intp)]
            with np.errstate(over="ignore"):
                finite = np.isfinite(ldexp32(largest, values.reshape(-1)))
            if not finite.all():
                raise ValueError(f"{where} is {values.tolist()}, under which the momentum holds NaN or Inf (a code "
                                 f"times 2**{entry.key} past float32's range), which no step stores; {remedy}")
        return values

    @property
    def rule(self) -> Rule:
        return RULE

    def kernel_constexprs(self, *, track_format: bool) -> dict:
        """What this format fixes for Muon's elementwise kernels (to come): MODE and the code."""
        if track_format and self.mode != "packed":
            raise ValueError("track_format counts packed momentum codes; bf16 and fp32 modes have none")
        code = self.code
        return dict(MODE=MODES.index(self.mode), MU_FRAC=code.fraction_bits if code else 0,
                    MU_BIAS=code.bias if code else 0, MU_MAX=code.max_magnitude_code if code else 0)
