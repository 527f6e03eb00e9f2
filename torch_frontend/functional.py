"""The functional torch step: launch the core kernel on CUDA, run the numpy step on CPU.

Both paths follow docs/FORMAT.md operation by operation, so they give the same bits.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

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


def scalar_table(counts, hparams) -> tuple[np.ndarray, tuple[int, ...]]:
    """The step scalars, derived on the host (FORMAT.md, "Step scalars"): [rows, 8] float32,
    one row per distinct (count, hyperparameters), and each tensor's row. Tensors of one group
    share a row object, so each distinct pair is derived once."""
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
    return np.asarray(unique, dtype=np.float32), tuple(index)


def _cuda_step_(params, grads, states, counts, hparams, fmt, multi_tensor: bool, count_nonfinite: bool) -> list[int]:
    scalars, rows = scalar_table(counts, hparams)
    n = len(params)
    staged, pointers = stage_step(3 * n if multi_tensor else 0, scalars)
    device = params[0].device
    if multi_tensor:
        pointers[:] = [t.data_ptr() for t in (*params, *grads, *states)]
        tables = launch_tables(tuple(p.numel() for p in params), rows, device)
        return launch_step(staged.to(device, non_blocking=True), params, grads, states, tables, fmt,
                           count_nonfinite, aligned=not (pointers & 15).any())
    with _on(device):
        scalars_dev = staged.to(device, non_blocking=True).view(torch.float32).view(-1, 8)
        rejected = torch.zeros(n, dtype=torch.int32, device=device) if count_nonfinite else None
        for i, (p, g, s) in enumerate(zip(params, grads, states)):
            _launch_one(p, g, s, scalars_dev[rows[i]], rejected, i, fmt, count_nonfinite)
    return rejected.tolist() if count_nonfinite else [0] * n


def stage_step(n_pointers: int, scalars: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Pinned int64 host buffer holding `n_pointers` addresses (for the caller to fill) and
    then the [rows, 8] float32 step scalars: one host-to-device copy carries a whole step.

    Pinned memory from torch's host allocator is not handed out again before the copy that
    reads it has finished, so the host never waits for the GPU."""
    staged = torch.empty(n_pointers + 4 * len(scalars), dtype=torch.int64, pin_memory=True)
    host = staged.numpy()
    host[n_pointers:].view(np.float32)[:] = scalars.reshape(-1)
    return staged, host[:n_pointers]


class StagingRing:
    """`stage_step`'s buffer for a caller that steps the same tensors again and again (a step
    plan): pinned host buffers and device buffers for 3n addresses and up to `max_rows` scalar
    rows, reused in turn, so a step allocates nothing. A slot is refilled only after the launch
    that read it has finished (an event per slot), whatever stream that launch ran on."""

    DEPTH = 4

    def __init__(self, n_tensors: int, max_rows: int, device: torch.device):
        words = 3 * n_tensors + 4 * max_rows
        self.n_pointers = 3 * n_tensors
        self.host = [torch.empty(words, dtype=torch.int64, pin_memory=True) for _ in range(self.DEPTH)]
        self.host_arrays = [h.numpy() for h in self.host]
        self.torch_device = device
        with _on(device):
            self.device = [torch.empty(words, dtype=torch.int64, device=device) for _ in range(self.DEPTH)]
            self.events = [torch.cuda.Event() for _ in range(self.DEPTH)]
        self.used = [False] * self.DEPTH
        self.slot = 0

    def stage(self, scalars: np.ndarray) -> np.ndarray:
        """The next slot's host words, scalars written; returns the address part to fill."""
        self.slot = (self.slot + 1) % self.DEPTH
        if self.used[self.slot]:
            self.events[self.slot].synchronize()  # DEPTH steps back: normally long finished
        host = self.host_arrays[self.slot]
        self.n_words = self.n_pointers + 4 * len(scalars)
        host[self.n_pointers:self.n_words].view(np.float32)[:] = scalars.reshape(-1)
        return host[:self.n_pointers]

    def send(self) -> torch.Tensor:
        """Copies the staged slot to the device (on the current stream) and returns it there."""
        table = self.device[self.slot][:self.n_words]
        table.copy_(self.host[self.slot][:self.n_words], non_blocking=True)
        return table

    def launched(self) -> None:
        """Call after the launch that reads this slot."""
        self.events[self.slot].record(torch.cuda.current_stream(self.torch_device))
        self.used[self.slot] = True


def launch_step(table: torch.Tensor, params, grads, states, tables: "LaunchTables", fmt: StateFormat,
                count_nonfinite: bool, aligned: bool, compiled: dict | None = None) -> list[int]:
    """The CUDA step over a device table laid out by `stage_step`: the addresses of every
    parameter, then every gradient, then every state buffer (`aligned`: all on 16 bytes),
    then the scalar rows that `tables.rows` assigns to the tensors. Tensors of at least
    `launch.SOLO_ELEMENTS` elements get a launch of their own, which skips the table lookups;
    all others share one launch of the multi-tensor kernel (docs/MULTI_TENSOR.md).

    `compiled`: a dict owned by a caller whose tensor count and table shapes stay fixed (a
    step plan); the compiled multi-tensor kernel is kept there and relaunched directly, which
    skips Triton's argument binding (its specialization cannot change for such a caller)."""
    from packed_adamw.core.kernel import adamw_multi_tensor_kernel

    n, device = len(params), params[0].device
    with _on(device):
        scalars = table[3 * n:].view(torch.float32)
        rejected = torch.zeros(n, dtype=torch.int32, device=device) if count_nonfinite else None
        if tables.block_tensor.numel():  # none when every tensor is empty or solo
            grid = (tables.block_tensor.numel(),)
            args = (table, tables.block_tensor, tables.block_index, tables.numels, tables.rows_device, scalars,
                    tables.block_index if rejected is None else rejected, n)  # block_index: unused without the count
            key = (aligned, count_nonfinite)
            kernel = compiled.get(key) if compiled is not None else None
            if kernel is not None:
                kernel[0][(grid[0], 1, 1)](*args, *kernel[1])
            else:
                constants = {**_constants(fmt, None, count_nonfinite, launch.GPU_BLOCK), "ALIGNED": aligned}
                kernel = adamw_multi_tensor_kernel[grid](
                    *args, num_warps=launch.GPU_NUM_WARPS, **constants, **launch.COMPILE_OPTIONS)
                if compiled is not None and hasattr(kernel, "run"):  # a CompiledKernel: keep it
                    names = adamw_multi_tensor_kernel.arg_names[len(args):]
                    compiled[key] = (kernel, tuple(constants[name] for name in names))
        if tables.solo:
            rows = scalars.view(-1, 8)
            for i in tables.solo:
                _launch_one(params[i], grads[i], states[i], rows[tables.rows[i]], rejected, i, fmt, count_nonfinite)
    return rejected.tolist() if count_nonfinite else [0] * n


def _launch_one(p, g, s, scalars, rejected, i: int, fmt: StateFormat, count_nonfinite: bool) -> None:
    """The single-tensor kernel on tensor i of a step, in place; `scalars` is its [8] row."""
    from packed_adamw.core.kernel import adamw_kernel

    n, block = p.numel(), launch.GPU_BLOCK
    if n == 0:
        return
    words = s if fmt.mode == "fp32" else s.view(torch.int32)
    adamw_kernel[launch.grid(n, block)](
        p, g, words, scalars, scalars if rejected is None else rejected[i:], n, p, words,
        num_warps=launch.GPU_NUM_WARPS, **_constants(fmt, False, count_nonfinite, block), **launch.COMPILE_OPTIONS,
    )


def _on(device: torch.device):
    """torch.cuda.device(device), skipped when it is already current (a step's host cost counts)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


@functools.lru_cache(maxsize=64)
def _constants(fmt: StateFormat, write_update, count_nonfinite: bool, block: int) -> dict:
    return launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=count_nonfinite, block=block)


class LaunchTables(NamedTuple):
    """What a multi-tensor launch needs besides the step's table; depends only on the tensor
    sizes and scalar rows, so it is built once and kept on the device."""

    block_tensor: torch.Tensor  # per program: its tensor
    block_index: torch.Tensor  # per program: its block in that tensor
    numels: torch.Tensor  # per tensor (int64)
    rows_device: torch.Tensor  # per tensor: its scalar row (int32)
    rows: tuple[int, ...]  # the same, on the host
    solo: tuple[int, ...]  # tensors launched on their own (no blocks in the shared launch)


def launch_tables(numels: tuple[int, ...], rows: tuple[int, ...], device: torch.device) -> LaunchTables:
    return _launch_tables(numels, rows, device, launch.GPU_BLOCK, launch.SOLO_ELEMENTS)


@functools.lru_cache(maxsize=16)
def _launch_tables(numels, rows, device, block: int, solo_elements: int) -> LaunchTables:
    solo = tuple(i for i, n in enumerate(numels) if n >= solo_elements)
    shared = [0 if n >= solo_elements else n for n in numels]
    block_tensor, block_index = launch.block_table(shared, block)
    as_device = lambda a, dtype: torch.as_tensor(a, dtype=dtype).to(device)  # noqa: E731
    return LaunchTables(as_device(block_tensor, torch.int32), as_device(block_index, torch.int32),
                        as_device(numels, torch.int64), as_device(rows, torch.int32), rows, solo)
