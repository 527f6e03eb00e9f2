"""The functional torch step: launch the core kernel on CUDA, run the numpy step on CPU.

Both paths follow docs/FORMAT.md operation by operation, so they give the same bits.
`PackedAdamW` calls `adamw_step_` for a full step and a `StepPlan` (`_plan.py`) for the steps
that reuse one.
"""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.numpy_step import apply_step, step_scalar_row

from . import _launch

_TORCH_DTYPES = {"float32": torch.float32, "uint32": torch.uint32}


def state_dtype(fmt: StateFormat) -> torch.dtype:
    return _TORCH_DTYPES[fmt.state_dtype]


def new_state(param: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Zero state for one parameter, laid out as `fmt.state_shape` says."""
    shape = fmt.state_shape(param.shape)
    if fmt.state_dtype == "uint32":
        # Created as int32 and viewed: torch fills uint32 on every device only from 2.3 on.
        return torch.zeros(shape, dtype=torch.int32, device=param.device).view(torch.uint32)
    return torch.zeros(shape, dtype=state_dtype(fmt), device=param.device)


def _check_inputs(params, grads, states, counts, hparams, fmt: StateFormat) -> None:
    """The kernel reads raw addresses: anything else than contiguous float32 tensors of the
    expected shapes on one device would update the wrong memory."""
    if not len(params) == len(grads) == len(states) == len(counts) == len(hparams):
        raise ValueError("adamw_step_: params, grads, states, counts and hparams must have the same length")
    device = params[0].device
    expected_dtype = state_dtype(fmt)
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        state_shape = fmt.state_shape(p.shape)
        problems = [
            what for what, bad in (
                ("param is not contiguous float32", p.dtype != torch.float32 or not p.is_contiguous()),
                ("grad is not a contiguous float32 tensor of the param's shape",
                 g.dtype != torch.float32 or not g.is_contiguous() or g.is_sparse or g.shape != p.shape),
                (f"state is not a contiguous {expected_dtype} tensor of shape {state_shape}",
                 s.dtype != expected_dtype or not s.is_contiguous() or tuple(s.shape) != state_shape),
                (f"tensors are not all on {device}", not (p.device == g.device == s.device == device)),
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
) -> list[int]:
    """One AdamW step in place over tensors on one device; returns each tensor's rejected count.

    `counts[i]` is tensor i's step number after incrementing; `hparams[i]` its
    (lr, b1, b2, eps, weight_decay[, maximize]) row, already validated
    (`core.validate_hyperparams`). On
    CUDA, `multi_tensor` updates every tensor in one launch (docs/MULTI_TENSOR.md); otherwise
    one launch per tensor. Same bits either way. Without `count_nonfinite` the CUDA path never
    waits for the GPU and returns zeros. `check_inputs=False` skips the tensor checks, for callers
    that made them already.

    `counters`: [n, launch.COUNTER_ROW] int64 on the tensors' device, tensor i's row
    accumulating its counts: with `track_format` (packed and fp16 modes) the format counts of
    FORMAT.md ("Format counts"), read with `launch.sum_counter_slots`; the non-finite count
    in column 0 is per step. The CUDA path adds to them without waiting for the GPU.
    """
    if not params:
        return []
    if check_inputs:
        _check_inputs(params, grads, states, counts, hparams, fmt)
    scalars, rows = scalar_table(counts, hparams)  # raises on a step count out of range, before any change
    if params[0].device.type == "cuda":
        return _launch.cuda_step_(params, grads, states, scalars, rows, fmt, multi_tensor, count_nonfinite,
                                  counters, track_format)
    return cpu_step_(params, grads, states, scalars, rows, fmt, counters, track_format)


def cpu_step_(params, grads, states, scalars, rows, fmt: StateFormat, counters=None, track_format=False) -> list[int]:
    """The numpy step per tensor (zero-copy views); counts as `adamw_step_` says."""
    rejected = []
    for i, (p, g, s, row) in enumerate(zip(params, grads, states, rows)):
        counts = np.zeros(len(launch.FORMAT_COUNTS), np.int64) if track_format else None
        rejected.append(apply_step(_numpy_view(p), _numpy_view(g), _state_view(s, fmt), scalars[row], fmt=fmt,
                                   format_counts_out=counts))
        if counts is not None and counters is not None:
            counters[i, 1::launch.FORMAT_SLOTS] += torch.from_numpy(counts)  # slot 0 of each count
    return rejected


def scalar_table(counts, hparams) -> tuple[np.ndarray, tuple[int, ...]]:
    """The step scalars, derived on the host (FORMAT.md, "Step scalars"): [rows, SCALAR_ROW]
    float32, one row per distinct (count, hyperparameters), and each tensor's row. Tensors of
    one group share a row object, so each distinct pair is derived once."""
    unique, index, keys = [], [], {}
    previous = None
    for count, row in zip(counts, hparams):
        key = (count, row if type(row) is tuple else tuple(row))
        if key != previous:
            previous = key
            slot = keys.get(key)
            if slot is None:
                slot = keys[key] = len(unique)
                unique.append(row_scalars(count, key[1]))
        index.append(slot)
    return np.asarray(unique, dtype=np.float32), tuple(index)


def row_scalars(count: int, row: tuple) -> tuple:
    """`step_scalar_row` for a torch hyperparameter row: (lr, b1, b2, eps, weight_decay) and
    optionally `maximize` as a sixth entry."""
    return step_scalar_row(count, row[:5], maximize=len(row) > 5 and bool(row[5]))


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1) if t.dim() != 0 else t.detach().reshape(1)
    if t.dtype == torch.uint32:
        return flat.view(torch.int32).numpy().view(np.uint32)
    return flat.numpy()


def _state_view(state: torch.Tensor, fmt: StateFormat) -> np.ndarray:
    if fmt.mode == "fp32":
        return state.detach().reshape(fmt.flat_state_shape(-1)).numpy()
    return _numpy_view(state)
