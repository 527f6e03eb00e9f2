"""The optimizer state as torch tensors: the one place the torch frontend turns core's state
layout (`StateFormat`, docs/FORMAT.md) into torch dtypes and shapes, and reads the counter rows
the kernels and the numpy step add to (core/launch.py's layout).

A parameter's state entries: the rule's state entry (`fmt.state_entry`, core/rule.py: its key,
dtype and shape; AdamW's uint32 words, or float32 [2, *shape] moments in fp32 mode), for a bf16
parameter its low half (`LOW_HALF_KEY`, int16, the parameter's shape), and its step count
(`STEP_KEY`, torch.optim's "step").
"""
from __future__ import annotations

import torch

from packed_adamw.core import StateFormat, codecs as formats, launch

# core's numpy dtype names as torch dtypes: the only such map in the torch frontend. 16-bit codes
# (Muon's momentum) live in int16 tensors: torch has few uint16 operations, and core reads an
# int16 view as the codes' bits.
TORCH_DTYPES = {"float32": torch.float32, "uint32": torch.uint32, "int16": torch.int16, "uint16": torch.int16,
                "int32": torch.int32}
LOW_HALF_KEY = formats.LOW_HALF_KEY  # the state entry of a bf16 parameter's low half
LOW_HALF_DTYPE = TORCH_DTYPES[formats.LOW_HALF_DTYPE]
STEP_KEY = "step"


def state_dtype(fmt: StateFormat) -> torch.dtype:
    """The torch dtype of a plain (not sharded) parameter's moments."""
    return TORCH_DTYPES[fmt.state_dtype]


def has_format_counts(fmt: StateFormat) -> bool:
    """Whether the state holds codes whose format events can be counted (`track_format`):
    packed and fp16 words do; fp32 mode stores float32 moments and has none."""
    return fmt.formats is not None


def new_state(param: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Zero state for one parameter, laid out as `fmt.state_shape` says."""
    shape = fmt.state_shape(param.shape)
    if state_dtype(fmt) is torch.uint32:
        # Created as int32 and viewed: torch fills uint32 on every device only from 2.3 on.
        return torch.zeros(shape, dtype=torch.int32, device=param.device).view(torch.uint32)
    return torch.zeros(shape, dtype=state_dtype(fmt), device=param.device)


def new_low_half(param: torch.Tensor) -> torch.Tensor:
    """The low half of a new bf16 parameter: zeros, so its master starts at its bf16 value."""
    return torch.zeros(param.shape, dtype=LOW_HALF_DTYPE, device=param.device)


def flat_moments(state: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """A parameter's moments laid out as the kernels and the numpy step read them
    (`fmt.flat_state_shape`): a view."""
    return state.detach().reshape(fmt.flat_state_shape(-1))


# ---- counter rows (core/launch.py: column 0 the non-finite count, then each of the rule's
# format counts, `count_names` order, in FORMAT_SLOTS slots; MAX_FORMAT_COUNTS counts a row) ----
NONFINITE_COLUMN = 0


def new_counters(n: int, device) -> torch.Tensor:
    """Zero counter rows for n tensors."""
    return torch.zeros((n, launch.COUNTER_ROW), dtype=torch.int64, device=device)


def format_count_slots(counters: torch.Tensor) -> torch.Tensor:
    """[n, MAX_FORMAT_COUNTS, FORMAT_SLOTS] view of counter rows' format counts (a rule's
    `count_names` first, in order)."""
    return counters[:, NONFINITE_COLUMN + 1:].view(len(counters), launch.MAX_FORMAT_COUNTS, launch.FORMAT_SLOTS)


def format_counts(counters: torch.Tensor) -> torch.Tensor:
    """[n, MAX_FORMAT_COUNTS] format counts of counter rows (a rule's `count_names` first),
    their slots summed (a new tensor)."""
    return launch.sum_counter_slots(counters)
