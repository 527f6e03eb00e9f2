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


def _cuda_step_(params, grads, states, counts, hparams, fmt, multi_tensor: bool, count_nonfinite: bool) -> list[int]:
    from packed_adamw.core.kernel import adamw_kernel, adamw_multi_tensor_kernel, step_scalars_kernel

    device, n = params[0].device, len(params)
    # Two small host-to-device copies carry every tensor's hyperparameters and count.
    hparams_dev = torch.from_numpy(np.asarray(hparams, dtype=np.float32)).to(device, non_blocking=True)
    counts_dev = torch.from_numpy(np.asarray(counts, dtype=np.int32)).to(device, non_blocking=True)
    scalars = torch.empty((n, 8), dtype=torch.float32, device=device)
    rejected = torch.zeros(n, dtype=torch.int32, device=device) if count_nonfinite else counts_dev
    block = launch.GPU_BLOCK
    with torch.cuda.device(device):
        step_scalars_kernel[launch.grid(n, launch.SCALAR_BLOCK_ROWS)](
            hparams_dev, counts_dev, n, scalars, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **launch.COMPILE_OPTIONS)
        if multi_tensor:
            block_tensor, block_index, numels = _block_table(tuple(p.numel() for p in params), device, block)
            if block_tensor.numel() == 0:  # only empty tensors: nothing to launch
                return [0] * n
            pointers = np.fromiter((t.data_ptr() for t in (*params, *grads, *states)), dtype=np.int64, count=3 * n)
            adamw_multi_tensor_kernel[(block_tensor.numel(),)](
                torch.from_numpy(pointers).to(device, non_blocking=True), block_tensor, block_index, numels,
                scalars, rejected, n, ALIGNED=not (pointers % 16).any(), num_warps=launch.GPU_NUM_WARPS,
                **launch.kernel_constants(fmt, write_update=None, count_nonfinite=count_nonfinite, block=block),
                **launch.COMPILE_OPTIONS,
            )
        else:
            constants = launch.kernel_constants(fmt, write_update=False, count_nonfinite=count_nonfinite, block=block)
            for i, (p, g, s) in enumerate(zip(params, grads, states)):
                if p.numel() == 0:
                    continue
                words = s if fmt.mode == "fp32" else s.view(torch.int32)
                adamw_kernel[launch.grid(p.numel(), block)](
                    p, g, words, scalars[i], rejected[i:], p.numel(), p, words,
                    num_warps=launch.GPU_NUM_WARPS, **constants, **launch.COMPILE_OPTIONS,
                )
    return rejected.tolist() if count_nonfinite else [0] * n


@functools.lru_cache(maxsize=16)
def _block_table(numels: tuple[int, ...], device: torch.device, block: int):
    """Depends only on the tensor sizes, so it is built once and kept on the device."""
    block_tensor, block_index = launch.block_table(list(numels), block)
    as_device = lambda a, dtype: torch.as_tensor(a, dtype=dtype).to(device)  # noqa: E731
    return as_device(block_tensor, torch.int32), as_device(block_index, torch.int32), as_device(numels, torch.int64)
