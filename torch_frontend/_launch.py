"""CUDA launches of the core kernels from torch: staging, launch tables, the launches.

Private to the torch frontend: `functional.adamw_step_` and `_plan.StepPlan` call these.
A step's device table is one int64 buffer (`stage_step` / `StagingRing`): the addresses of
every parameter, then every gradient, then every state buffer, then the float32 step-scalar
rows (hyperparams.SCALAR_FIELDS), so one host-to-device copy carries a whole step.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.hyperparams import SCALAR_ROW, SCALAR_ROW_INT64_WORDS


def stage_step(n_pointers: int, scalars: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Pinned int64 host buffer holding `n_pointers` addresses (for the caller to fill) and
    then the [rows, SCALAR_ROW] float32 step scalars.

    Pinned memory from torch's host allocator is not handed out again before the copy that
    reads it has finished, so the host never waits for the GPU."""
    staged = torch.empty(n_pointers + SCALAR_ROW_INT64_WORDS * len(scalars), dtype=torch.int64, pin_memory=True)
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
        words = 3 * n_tensors + SCALAR_ROW_INT64_WORDS * max_rows
        self.n_pointers = 3 * n_tensors
        self.host = [torch.empty(words, dtype=torch.int64, pin_memory=True) for _ in range(self.DEPTH)]
        self.host_arrays = [h.numpy() for h in self.host]
        self.torch_device = device
        with on_device(device):
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
        self.n_words = self.n_pointers + SCALAR_ROW_INT64_WORDS * len(scalars)
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


def _counters(n: int, device, count_nonfinite: bool, track_format: bool, counters):
    """The counter rows a launch adds to: the caller's (they accumulate format counts across
    steps), or fresh ones when only the non-finite count is wanted, or None."""
    if counters is not None:
        if count_nonfinite:
            counters[:, 0].zero_()  # the non-finite count is per step
        return counters
    if count_nonfinite or track_format:
        return torch.zeros((n, launch.COUNTER_ROW), dtype=torch.int64, device=device)
    return None


def _rejected(counters, count_nonfinite: bool, n: int) -> list[int]:
    return counters[:, 0].tolist() if count_nonfinite else [0] * n


def cuda_step_(params, grads, states, scalars: np.ndarray, rows: tuple[int, ...], fmt: StateFormat,
               multi_tensor: bool, count_nonfinite: bool, counters=None, track_format: bool = False) -> list[int]:
    """One step on CUDA from scratch (no plan): stage, then one multi-tensor launch (plus solo
    launches), or one launch per tensor. `scalars` holds the distinct step-scalar rows and
    `rows[i]` tensor i's. `counters` ([n, launch.COUNTER_ROW] int64 on the device): the
    kernels add their counts there."""
    n = len(params)
    staged, pointers = stage_step(3 * n if multi_tensor else 0, scalars)
    device = params[0].device
    if multi_tensor:
        pointers[:] = [t.data_ptr() for t in (*params, *grads, *states)]
        tables = launch_tables(tuple(p.numel() for p in params), rows, device)
        return launch_step(staged.to(device, non_blocking=True), params, grads, states, tables, fmt,
                           count_nonfinite, aligned=not (pointers & 15).any(), counters=counters,
                           track_format=track_format)
    with on_device(device):
        scalars_dev = staged.to(device, non_blocking=True).view(torch.float32).view(-1, SCALAR_ROW)
        counters = _counters(n, device, count_nonfinite, track_format, counters)
        for i, (p, g, s) in enumerate(zip(params, grads, states)):
            _launch_one(p, g, s, scalars_dev[rows[i]], counters, i, fmt, count_nonfinite, track_format)
    return _rejected(counters, count_nonfinite, n)


def launch_step(table: torch.Tensor, params, grads, states, tables: LaunchTables, fmt: StateFormat,
                count_nonfinite: bool, aligned: bool, relaunch: dict | None = None, counters=None,
                track_format: bool = False, scalars: torch.Tensor | None = None) -> list[int]:
    """The CUDA step over a device table laid out as this module's docstring says
    (`aligned`: every address on 16 bytes), the scalar rows assigned by `tables.rows`.
    Tensors of at least `launch.SOLO_ELEMENTS` elements get a launch of their own, which skips
    the table lookups; all others share one launch of the multi-tensor kernel
    (docs/MULTI_TENSOR.md). `counters` as in `cuda_step_`.

    `relaunch`: a dict owned by a caller whose tensor count and table shapes stay fixed (a
    step plan), where `_Relaunch` keeps the compiled multi-tensor kernel between steps.
    `scalars`: the scalar rows as a device tensor of their own (derived on the device)
    instead of the table's tail."""
    from packed_adamw.core.kernel import adamw_multi_tensor_kernel

    n, device = len(params), params[0].device
    with on_device(device):
        if scalars is None:
            scalars = table[3 * n:].view(torch.float32)
        counters = _counters(n, device, count_nonfinite, track_format, counters)
        if tables.block_tensor.numel():  # none when every tensor is empty or solo
            grid = (tables.block_tensor.numel(),)
            args = (table, tables.block_tensor, tables.block_index, tables.numels, tables.rows_device, scalars,
                    tables.block_index if counters is None else counters, n)  # block_index: unused without counts
            key = (aligned, count_nonfinite, track_format)
            fast = relaunch.get(key) if relaunch is not None else None
            if fast is not None:
                fast(grid, args)
            else:
                constants = {**_constants(fmt, None, count_nonfinite, launch.GPU_BLOCK, track_format), "ALIGNED": aligned}
                compiled = adamw_multi_tensor_kernel[grid](
                    *args, num_warps=launch.GPU_NUM_WARPS, **constants, **launch.COMPILE_OPTIONS)
                if relaunch is not None:
                    fast = _Relaunch.of(adamw_multi_tensor_kernel, compiled, len(args), constants)
                    if fast is not None:
                        relaunch[key] = fast
        if tables.solo:
            rows = scalars.view(-1, SCALAR_ROW)
            for i in tables.solo:
                _launch_one(params[i], grads[i], states[i], rows[tables.rows[i]], counters, i, fmt, count_nonfinite,
                            track_format)
    return _rejected(counters, count_nonfinite, n)


class _Relaunch:
    """Launches an already compiled Triton kernel again, skipping `JITFunction.run`'s argument
    binding and specialization (docs/results/BENCHMARKS.md times a step with and without it):
    only valid for a caller whose argument types, alignments and integer values cannot change
    between launches, which a step plan guarantees.

    It relies on Triton internals (`CompiledKernel[grid](*args)`, `JITFunction.arg_names`),
    so it is used only on the Triton versions it was checked on; elsewhere `of` returns None
    and the caller launches normally (same bits, more host time)."""

    CHECKED_TRITON = ((3, 6),)  # on the H200; the CPU interpreter never returns a CompiledKernel
    enabled = True  # the benchmark switches it off to time what it saves

    def __init__(self, compiled, constants: tuple):
        self.compiled, self.constants = compiled, constants

    @classmethod
    def of(cls, jit_fn, compiled, n_args: int, constants: dict) -> "_Relaunch | None":
        if not cls.enabled or _triton_version() not in cls.CHECKED_TRITON or not hasattr(compiled, "run"):
            return None
        names = getattr(jit_fn, "arg_names", None)
        if names is None or set(names[n_args:]) != set(constants):
            return None
        return cls(compiled, tuple(constants[name] for name in names[n_args:]))

    def __call__(self, grid: tuple[int], args: tuple) -> None:
        self.compiled[(grid[0], 1, 1)](*args, *self.constants)


@functools.cache
def _triton_version() -> tuple[int, int]:
    import triton

    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def _launch_one(p, g, s, scalars, counters, i: int, fmt: StateFormat, count_nonfinite: bool,
                track_format: bool) -> None:
    """The single-tensor kernel on tensor i of a step, in place; `scalars` is its row."""
    from packed_adamw.core.kernel import adamw_kernel

    n = p.numel()
    if n == 0:
        return
    words = s if fmt.mode == "fp32" else s.view(torch.int32)
    constants = _constants(fmt, False, count_nonfinite, launch.GPU_BLOCK, track_format)
    adamw_kernel[launch.single_tensor_grid(n, constants)](
        p, g, words, scalars, scalars if counters is None else counters[i], n, p, words,
        num_warps=launch.GPU_NUM_WARPS, **constants, **launch.COMPILE_OPTIONS,
    )


def on_device(device: torch.device):
    """torch.cuda.device(device), skipped when it is already current (a step's host cost counts)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


@functools.lru_cache(maxsize=64)
def _constants(fmt: StateFormat, write_update, count_nonfinite: bool, block: int, track_format: bool = False) -> dict:
    return launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=count_nonfinite, block=block,
                                   track_format=track_format)
