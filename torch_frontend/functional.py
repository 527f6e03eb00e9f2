"""The functional torch step: launch the core kernel on CUDA, run the numpy step on CPU.

Both paths follow docs/FORMAT.md operation by operation, so they give the same bits.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from packed_adamw.core import Hyperparams, StateFormat, adamw_step
from packed_adamw.core import launch
from packed_adamw.core.hyperparams import HPARAM_FIELDS
from packed_adamw.core.numpy_step import step_scalar_row


def new_state(param: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Zero state for one parameter: uint32 words, or float32 [2, *shape] in fp32 mode."""
    if fmt.mode == "fp32":
        return torch.zeros((2, *param.shape), dtype=torch.float32, device=param.device)
    # Created as int32 and viewed: torch fills uint32 on every device only from 2.3 on.
    return torch.zeros(param.shape, dtype=torch.int32, device=param.device).view(torch.uint32)


def _check_inputs(params, grads, states, counts, hparams, fmt: StateFormat) -> None:
    """The kernel reads raw addresses: anything else than contiguous float32 tensors of the
    expected shapes on one device would update the wrong memory."""
    if not len(params) == len(grads) == len(states) == len(counts) == len(hparams):
        raise ValueError("adamw_step_: params, grads, states, counts and hparams must have the same length")
    device = params[0].device
    state_dtype = torch.float32 if fmt.mode == "fp32" else torch.uint32
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        state_shape = (2, *p.shape) if fmt.mode == "fp32" else tuple(p.shape)
        problems = [
            what for what, bad in (
                ("param is not contiguous float32", p.dtype != torch.float32 or not p.is_contiguous()),
                ("grad is not a contiguous float32 tensor of the param's shape",
                 g.dtype != torch.float32 or not g.is_contiguous() or g.is_sparse or g.shape != p.shape),
                (f"state is not a contiguous {state_dtype} tensor of shape {state_shape}",
                 s.dtype != state_dtype or not s.is_contiguous() or tuple(s.shape) != state_shape),
                (f"tensors are not all on {device}", not (p.device == g.device == s.device == device)),
            ) if bad
        ]
        if problems:
            raise ValueError(f"adamw_step_: tensor {i}: " + "; ".join(problems))


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1) if t.dim() != 0 else t.detach().reshape(1)
    if t.dtype == torch.uint32:
        return flat.view(torch.int32).numpy().view(np.uint32)
    return flat.numpy()


def _state_view(state: torch.Tensor, fmt: StateFormat) -> np.ndarray:
    if fmt.mode == "fp32":
        return state.detach().reshape(2, -1).numpy()
    return _numpy_view(state)


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
) -> list[int]:
    """One AdamW step in place over tensors on one device; returns each tensor's rejected count.

    `counts[i]` is tensor i's step number after incrementing; `hparams[i]` its
    (lr, b1, b2, eps, weight_decay). On CUDA, `multi_tensor` updates every tensor in one
    launch (docs/MULTI_TENSOR.md); otherwise one launch per tensor. Same bits either way.
    Without `count_nonfinite` the CUDA path never waits for the GPU and returns zeros.
    `check_inputs=False` skips the checks below, for callers that made them already.
    """
    if not params:
        return []
    if check_inputs:
        _check_inputs(params, grads, states, counts, hparams, fmt)
    if params[0].device.type == "cuda":
        return _cuda_step_(params, grads, states, counts, hparams, fmt, multi_tensor, count_nonfinite)
    rejected = []
    for p, g, s, count, hp in zip(params, grads, states, counts, hparams):
        rejected.append(
            adamw_step(_numpy_view(p), _numpy_view(g), _state_view(s, fmt), count=count,
                       hp=_hyperparams(hp), fmt=fmt)
        )
    return rejected


def _hyperparams(row) -> Hyperparams:
    return Hyperparams(**dict(zip(HPARAM_FIELDS, row)))


def scalar_table(counts, hparams) -> np.ndarray:
    """[n, 8] float32 step scalars, one row per tensor, derived on the host (FORMAT.md,
    "Step scalars"); tensors of one group share a row object, so each distinct
    (count, row) is derived once."""
    unique, index, keys = [], [], {}
    previous = None
    for count, row in zip(counts, hparams):
        key = (count, row if type(row) is tuple else tuple(row))
        if key != previous:
            previous = key
            slot = keys.get(key)
            if slot is None:
                slot = keys[key] = len(unique)
                unique.append(step_scalar_row(count, row))
        index.append(slot)
    return np.asarray(unique, dtype=np.float32)[index]


def _cuda_step_(params, grads, states, counts, hparams, fmt, multi_tensor: bool, count_nonfinite: bool) -> list[int]:
    scalars = scalar_table(counts, hparams)
    if multi_tensor:
        staged, pointers = stage_step(3 * len(params), scalars)
        pointers[:] = [t.data_ptr() for t in (*params, *grads, *states)]
        return launch_multi_tensor(staged, tuple(p.numel() for p in params), params[0].device, fmt, count_nonfinite,
                                   aligned=not (pointers & 15).any())
    from packed_adamw.core.kernel import adamw_kernel

    device, n, block = params[0].device, len(params), launch.GPU_BLOCK
    staged, _ = stage_step(0, scalars)
    with torch.cuda.device(device):
        scalars_dev = staged.to(device, non_blocking=True).view(torch.float32).view(n, 8)
        rejected = torch.zeros(n, dtype=torch.int32, device=device) if count_nonfinite else None
        for i, (p, g, s) in enumerate(zip(params, grads, states)):
            if p.numel() == 0:
                continue
            words = s if fmt.mode == "fp32" else s.view(torch.int32)
            adamw_kernel[launch.grid(p.numel(), block)](
                p, g, words, scalars_dev[i], scalars_dev if rejected is None else rejected[i:], p.numel(), p, words,
                num_warps=launch.GPU_NUM_WARPS, **_constants(fmt, False, count_nonfinite, block), **launch.COMPILE_OPTIONS,
            )
    return rejected.tolist() if count_nonfinite else [0] * n


def stage_step(n_pointers: int, scalars: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Pinned int64 host buffer holding `n_pointers` addresses (for the caller to fill) and
    then the [n, 8] float32 step scalars: one host-to-device copy carries a whole step.

    Pinned memory from torch's host allocator is not handed out again before the copy that
    reads it has finished, so the host never waits for the GPU."""
    staged = torch.empty(n_pointers + 4 * len(scalars), dtype=torch.int64, pin_memory=True)
    host = staged.numpy()
    host[n_pointers:].view(np.float32)[:] = scalars.reshape(-1)
    return staged, host[:n_pointers]


def launch_multi_tensor(staged: torch.Tensor, numels: tuple[int, ...], device: torch.device, fmt: StateFormat,
                        count_nonfinite: bool, aligned: bool) -> list[int]:
    """One launch of the multi-tensor kernel over a buffer from `stage_step` whose addresses
    are every parameter, then every gradient, then every state buffer (`aligned`: all of them
    on 16 bytes)."""
    from packed_adamw.core.kernel import adamw_multi_tensor_kernel

    n = len(numels)
    with torch.cuda.device(device):
        block_tensor, block_index, numels_dev = _block_table(numels, device, launch.GPU_BLOCK)
        if block_tensor.numel() == 0:  # only empty tensors: nothing to launch
            return [0] * n
        table = staged.to(device, non_blocking=True)
        rejected = torch.zeros(n, dtype=torch.int32, device=device) if count_nonfinite else None
        adamw_multi_tensor_kernel[(block_tensor.numel(),)](
            table, block_tensor, block_index, numels_dev, table[3 * n:].view(torch.float32),
            block_index if rejected is None else rejected,  # unused without the count
            n, ALIGNED=aligned, num_warps=launch.GPU_NUM_WARPS,
            **_constants(fmt, None, count_nonfinite, launch.GPU_BLOCK), **launch.COMPILE_OPTIONS,
        )
    return rejected.tolist() if count_nonfinite else [0] * n


@functools.lru_cache(maxsize=64)
def _constants(fmt: StateFormat, write_update, count_nonfinite: bool, block: int) -> dict:
    return launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=count_nonfinite, block=block)


@functools.lru_cache(maxsize=16)
def _block_table(numels: tuple[int, ...], device: torch.device, block: int):
    """Depends only on the tensor sizes, so it is built once and kept on the device."""
    block_tensor, block_index = launch.block_table(list(numels), block)
    as_device = lambda a, dtype: torch.as_tensor(a, dtype=dtype).to(device)  # noqa: E731
    return as_device(block_tensor, torch.int32), as_device(block_index, torch.int32), as_device(numels, torch.int64)
