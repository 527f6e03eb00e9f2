"""The functional torch step: launch the core kernel on CUDA, run the numpy step on CPU.

Both paths follow docs/FORMAT.md operation by operation, so they give the same bits.
`PackedAdamW` calls `adamw_step_` for a full step and a `StepPlan` (`_plan.py`) for the steps
that reuse one.

A bf16 parameter is a split master (FORMAT.md, "Split masters"): the parameter holds the live
weight, an int16 low half (`new_low_half`) the rest of the FP32 master, and the step runs on the
master they join.
"""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core import StateFormat, codecs as formats
from packed_adamw.core.adamw.numpy_step import apply_split_step, apply_step, step_scalar_row
from packed_adamw.core.adamw.rule import RULE

from . import _launch
from ._state import LOW_HALF_DTYPE, LOW_HALF_KEY, flat_moments, format_count_slots, new_low_half, new_state, \
    state_dtype

__all__ = ["adamw_step_", "new_state", "new_low_half", "state_dtype", "LOW_HALF_KEY", "LOW_HALF_DTYPE"]
SPLIT_PARAM_DTYPE = torch.bfloat16  # parameters of this dtype are live weights of split masters
GRAD_DTYPES = {torch.float32: (torch.float32,), torch.bfloat16: (torch.bfloat16, torch.float32)}


def _check_inputs(params, grads, states, counts, hparams, fmt: StateFormat, lows) -> None:
    """The kernel reads raw addresses: anything else than contiguous tensors of the expected
    dtypes and shapes on one device would update the wrong memory."""
    if not len(params) == len(grads) == len(states) == len(counts) == len(hparams) == len(lows):
        raise ValueError("adamw_step_: params, grads, states, counts, hparams (and lows) must have the same length")
    device = params[0].device
    expected_dtype = state_dtype(fmt)
    for i, (p, g, s, lo) in enumerate(zip(params, grads, states, lows)):
        state_shape = fmt.state_shape(p.shape)
        split = lo is not None
        param_dtype = SPLIT_PARAM_DTYPE if split else torch.float32
        problems = [
            what for what, bad in (
                (f"param is not contiguous {param_dtype}" + ("" if split else " (a bf16 param needs its low half)"),
                 p.dtype != param_dtype or not p.is_contiguous()),
                (f"grad is not a contiguous {' or '.join(map(str, GRAD_DTYPES[param_dtype]))} tensor of the param's "
                 "shape", g.dtype not in GRAD_DTYPES[param_dtype] or not g.is_contiguous() or g.is_sparse
                 or g.shape != p.shape),
                (f"state is not a contiguous {expected_dtype} tensor of shape {state_shape}",
                 s.dtype != expected_dtype or not s.is_contiguous() or tuple(s.shape) != state_shape),
                (f"low half is not a contiguous {LOW_HALF_DTYPE} tensor of the param's shape",
                 split and (lo.dtype != LOW_HALF_DTYPE or not lo.is_contiguous() or lo.shape != p.shape)),
                (f"tensors are not all on {device}",
                 not (p.device == g.device == s.device == device) or (split and lo.device != device)),
            ) if bad
        ]
        if problems:
            raise ValueError(f"adamw_step_: tensor {i}: " + "; ".join(problems))


def adamw_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[torch.Tensor],
    counts: list[int],
    hparams: list[tuple[float, ...]],
    fmt: StateFormat,
    *,
    multi_tensor: bool = True,
    count_nonfinite: bool = True,
    check_inputs: bool = True,
    counters: torch.Tensor | None = None,
    track_format: bool = False,
    lows: list[torch.Tensor | None] | None = None,
) -> list[int]:
    """One AdamW step in place over tensors on one device; returns each tensor's rejected count.

    `counts[i]` is tensor i's step number after incrementing; `hparams[i]` its
    (lr, b1, b2, eps, weight_decay[, maximize]) row, already validated
    (`core.validate_hyperparams`). On
    CUDA, `multi_tensor` updates every tensor in one launch (docs/MULTI_TENSOR.md); otherwise
    one launch per tensor. Same bits either way. Without `count_nonfinite` the CUDA path never
    waits for the GPU and returns zeros. `check_inputs=False` skips the tensor checks, for callers
    that made them already.

    `lows[i]` (int16, params[i]'s shape): params[i] is a bf16 live weight and this its low half
    (FORMAT.md, "Split masters"); the step runs on their FP32 master and writes both back. Its
    gradient may be bf16 or float32. None (or `lows` left out): a float32 parameter. On CUDA
    FP32 parameters, split ones with FP32 gradients and split ones with bf16 gradients are
    three multi-tensor launches (one per kind present).

    `counters`: [n, launch.COUNTER_ROW] int64 on the tensors' device, tensor i's row
    accumulating its counts: with `track_format` (packed and fp16 modes) the format counts of
    FORMAT.md ("Format counts"), read with `launch.sum_counter_slots`; the non-finite count
    in column 0 is per step. The CUDA path adds to them without waiting for the GPU.
    """
    if not params:
        return []
    lows = [None] * len(params) if lows is None else list(lows)
    if check_inputs:
        _check_inputs(params, grads, states, counts, hparams, fmt, lows)
    scalars, rows = scalar_table(counts, hparams)  # raises on a step count out of range, before any change
    if params[0].device.type == "cuda":
        return _launch.cuda_step_(ADAMW_LAUNCH, params, grads, states, scalars, rows, fmt, multi_tensor,
                                  count_nonfinite, counters, track_format, lows)
    return cpu_step_(params, grads, states, scalars, rows, fmt, counters, track_format, lows)


def numpy_cpu_step(apply_step, apply_split_step):
    """A rule's CPU step over lists of tensors (`RuleLaunch.cpu_step`) from its numpy steps,
    `apply_step(p, g, state, scalars, *, fmt, format_counts_out)` and `apply_split_step(bf16
    weight's bits, low half, g, state, scalars, *, fmt, format_counts_out)`, each in place on
    zero-copy views; a rule's format counts (`fmt.rule.count_names`) go to slot 0 of its
    counter rows."""

    def cpu_step(params, grads, states, scalars, rows, fmt, counters=None, track_format=False, lows=None) -> list[int]:
        rejected = []
        lows = [None] * len(params) if lows is None else lows
        n_counts = len(fmt.rule.count_names)
        for i, (p, g, s, lo, row) in enumerate(zip(params, grads, states, lows, rows)):
            counts = np.zeros(n_counts, np.int64) if track_format else None
            if lo is None:
                rejected.append(apply_step(_numpy_view(p), _numpy_view(g), _state_view(s, fmt), scalars[row], fmt=fmt,
                                           format_counts_out=counts))
            else:
                rejected.append(apply_split_step(_numpy_view(p), _numpy_view(lo), _numpy_view(g),
                                                 _state_view(s, fmt), scalars[row], fmt=fmt, format_counts_out=counts))
            if counts is not None and counters is not None:
                format_count_slots(counters)[i, :n_counts, 0] += torch.from_numpy(counts)  # slot 0 of each count
        return rejected

    return cpu_step


# AdamW's numpy step over lists of tensors; counts as `adamw_step_` says.
cpu_step_ = numpy_cpu_step(apply_step, apply_split_step)


def scalar_table(counts, hparams) -> tuple[np.ndarray, tuple[int, ...]]:
    """AdamW's step scalars on the host (`_launch.scalar_table` with `row_scalars`): [rows,
    SCALAR_ROW] float32, one row per distinct (count, hyperparameters), and each tensor's row."""
    return _launch.scalar_table(counts, hparams, row_scalars)


def row_scalars(count: int, row: tuple) -> tuple:
    """`step_scalar_row` for a torch hyperparameter row: (lr, b1, b2, eps, weight_decay) and
    optionally `maximize` as a sixth entry."""
    return step_scalar_row(count, row[:5], maximize=len(row) > 5 and bool(row[5]))


# What the torch launches and step plans need of AdamW's rule (`_launch.RuleLaunch`).
ADAMW_LAUNCH = _launch.RuleLaunch(
    rule=RULE,
    kernel_module="packed_adamw.core.adamw.kernel",
    multi_tensor_kernel="adamw_multi_tensor_kernel",
    single_tensor_kernel="adamw_kernel",
    split_kernel="adamw_split_kernel",
    capturable_scalars_kernel="capturable_step_scalars_kernel",
    row_scalars=row_scalars,
    cpu_step=cpu_step_,
)


# ---- split masters outside the step (core/codecs.py's codecs, on host copies) ----
def join_master(weight: torch.Tensor, low_half: torch.Tensor | None) -> torch.Tensor:
    """The FP32 masters of a bf16 weight and its low half (None: zeros, a weight never
    stepped), as a new float32 tensor of the weight's shape on its device."""
    w_bits = _host_bits16(weight)
    lo = np.zeros_like(w_bits) if low_half is None else _host_bits16(low_half)
    master = formats.read_master(w_bits, lo)
    return torch.from_numpy(master).reshape(weight.shape).to(weight.device)


def split_master_(master: torch.Tensor, weight: torch.Tensor, low_half: torch.Tensor) -> None:
    """Writes the split of FP32 `master` into bf16 `weight` and int16 `low_half` (same shape).
    The caller checks the domain (`outside_split_domain`) first."""
    w_bits, lo = formats.split_master(master.detach().cpu().contiguous().reshape(-1).numpy())
    weight.detach().view(torch.int16).copy_(torch.from_numpy(w_bits.view(np.int16)).reshape(weight.shape))
    low_half.copy_(torch.from_numpy(lo).reshape(low_half.shape))


def outside_split_domain(master: torch.Tensor) -> int:
    """How many FP32 masters have no finite bf16 live weight: NaN, Inf, or |M| > SPLIT_MASTER_MAX
    (of a DTensor: over all its shards)."""
    return _total(~(master.detach().abs() <= formats.SPLIT_MASTER_MAX))


def nonfinite_count(master: torch.Tensor) -> int:
    """How many values of an FP32 master are NaN or Inf (of a DTensor: over all its shards)."""
    return _total(~torch.isfinite(master.detach()))


def _total(flags: torch.Tensor) -> int:
    total = flags.sum()
    return int(total.full_tensor() if hasattr(total, "full_tensor") else total)


def _host_bits16(t: torch.Tensor) -> np.ndarray:
    """A bf16 or int16 tensor's 16-bit patterns as a flat numpy uint16 array (a copy for
    device tensors)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1) if t.dim() != 0 else t.detach().reshape(1)
    if t.dtype == torch.uint32:
        return flat.view(torch.int32).numpy().view(np.uint32)
    if t.dtype == torch.bfloat16:  # numpy has no bf16: its bits, as the split step reads them
        return flat.view(torch.int16).numpy()
    return flat.numpy()


def _state_view(state: torch.Tensor, fmt: StateFormat) -> np.ndarray:
    if state.dtype is torch.uint32:
        return _numpy_view(state)
    return flat_moments(state, fmt).numpy()
