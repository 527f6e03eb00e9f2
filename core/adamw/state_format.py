"""AdamW's state format: the mode, the two 16-bit codes of the packed word and their biases
(spec: docs/FORMAT.md). Its state entries come from the declaration in core/adamw/rule.py."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np

from ..codecs import BIAS_RANGE, CODE_MASK, FP16, MiniFloat
from ..rule import Rule, StateEntry, StateLayout
from .rule import MOMENTS, RULE, WORDS

MOMENT_SHIFT = 16  # first-moment code in the high half of the word, RMS code in the low half
DEFAULT_M_BIAS = 15
DEFAULT_RMS_BIAS = 15

MODES = ("packed", "fp16", "fp32")
MODE_IDS = {"packed": 0, "fp16": 1, "fp32": 2}  # the kernel's constexpr MODE


@functools.cache
def first_moment_format(bias: int = DEFAULT_M_BIAS) -> MiniFloat:
    return MiniFloat("E4M11", signed=True, exponent_bits=4, fraction_bits=11, bias=bias)


@functools.cache
def rms_format(bias: int = DEFAULT_RMS_BIAS) -> MiniFloat:
    return MiniFloat("E4M12", signed=False, exponent_bits=4, fraction_bits=12, bias=bias)


E4M11 = first_moment_format()
E4M12 = rms_format()


@dataclass(frozen=True)
class StateFormat(StateLayout):
    """What a saved state must match: the mode and, for packed words, both formats. The state's
    layout (key, dtype, shapes, bytes; the low half) comes from `state_entry` (`StateLayout`)."""

    mode: str = "packed"
    m_bias: int = DEFAULT_M_BIAS
    rms_bias: int = DEFAULT_RMS_BIAS

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        for name in ("m_bias", "rms_bias"):
            bias = _static_int(name, getattr(self, name))
            if not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
                raise ValueError(f"{name}={bias} is outside {list(BIAS_RANGE)}; choose an exponent bias in that range")
            object.__setattr__(self, name, bias)

    @property
    def formats(self) -> tuple[MiniFloat, MiniFloat] | None:
        """(first moment, RMS) codecs of the packed word; None in fp32 mode."""
        if self.mode == "packed":
            return first_moment_format(self.m_bias), rms_format(self.rms_bias)
        if self.mode == "fp16":
            return FP16, FP16
        return None

    @property
    def identity(self) -> str:
        """Recorded in every saved state and compared on load."""
        if self.formats is None:
            return "fp32:m=f32,v=f32"
        m_fmt, r_fmt = self.formats
        return f"{self.mode}:m={m_fmt.identity},rms={r_fmt.identity}"

    # ---- the state's layout, from AdamW's declaration (rule.py here): every frontend asks ----
    @property
    def state_entry(self) -> StateEntry:
        """The state entry that holds the moments: fp32 mode's [2, *shape] float32 moments, else
        one uint32 word per element."""
        return MOMENTS if self.mode == "fp32" else WORDS

    @property
    def state_words_per_param(self) -> int:
        """uint32 words (packed, fp16) or float32 values (fp32) of state per parameter."""
        return self.state_entry.values_per_param

    # ---- what the generic launch (core/launch.py) asks of a rule's format ----
    @property
    def rule(self) -> Rule:
        return RULE

    def kernel_constexprs(self, *, track_format: bool) -> dict:
        """The constexpr arguments of AdamW's kernels (core/adamw/kernel.py) that this format
        fixes: MODE and each code's sign, fraction bits, bias and largest magnitude code."""
        if track_format and self.mode == "fp32":
            raise ValueError("track_format counts packed or fp16 codes; fp32 mode has none")
        if self.mode == "fp32":
            m_fmt = r_fmt = None
        else:
            m_fmt, r_fmt = self.formats
        codec = lambda f: (  # noqa: E731
            (f.signed, f.fraction_bits, f.bias, f.max_magnitude_code) if f else (False, 0, 0, 0)
        )
        m_signed, m_frac, m_bias, m_max = codec(m_fmt)
        r_signed, r_frac, r_bias, r_max = codec(r_fmt)
        return dict(MODE=MODE_IDS[self.mode], M_SIGNED=m_signed, M_FRAC=m_frac, M_BIAS=m_bias, M_MAX=m_max,
                    R_SIGNED=r_signed, R_FRAC=r_frac, R_BIAS=r_bias, R_MAX=r_max)


def _static_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: an exponent bias is an int (e.g. {name}=15), not a bool")
    try:
        return operator.index(value)
    except Exception:
        raise TypeError(
            f"{name}={value!r}: exponent biases fix the state format, so they must be Python ints known "
            "before compilation (with optax.inject_hyperparams pass static_args=('mode', 'm_bias', 'rms_bias'))"
        ) from None


def pack_words(m_codes, rms_codes) -> np.ndarray:
    return (np.asarray(m_codes).astype(np.uint32) << MOMENT_SHIFT) | np.asarray(rms_codes).astype(np.uint32)


def unpack_words(words) -> tuple[np.ndarray, np.ndarray]:
    words = np.asarray(words, dtype=np.uint32)
    return (words >> MOMENT_SHIFT).astype(np.uint16), (words & CODE_MASK).astype(np.uint16)
