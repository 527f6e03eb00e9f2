"""Muon's state format: the momentum buffer's mode and, in packed mode, its 16-bit code and
bias (spec: docs/MUON.md, "The momentum formats")."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np

from ..codecs import BIAS_RANGE, MiniFloat
from ..rule import Rule, StateEntry, StateLayout
from .rule import MOMENTUM_BUFFER, MOMENTUM_CODE, RULE

DEFAULT_MU_BIAS = 31
MODES = ("packed", "bf16", "fp32")


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
            return f"muon-packed:mu={self.code.identity}"
        return "muon-bf16:mu=bf16" if self.mode == "bf16" else "muon-fp32:mu=f32"

    def check_identity(self, saved: str) -> None:
        """Refuse a saved state written in another format."""
        if saved != self.identity:
            raise ValueError(f"the saved Muon state has format {saved!r} but this optimizer uses {self.identity!r}; "
                             "construct the optimizer with the saved state's mode and mu_bias")

    @property
    def state_entry(self) -> StateEntry:
        """One uint16 code (packed: E5M10; bf16: the bf16 bits) or one float32 per element."""
        return MOMENTUM_BUFFER if self.mode == "fp32" else MOMENTUM_CODE

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
