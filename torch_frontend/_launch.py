"""CUDA launches of the core kernels from torch: staging, launch tables, the launches.

Private to the torch frontend: `functional.adamw_step_` and `_plan.StepPlan` call these.
Nothing here names a rule: each call takes a `RuleLaunch`, what the launches need of one
(its Triton entry points, the width of its step-scalar row, its host scalar derivation and
numpy step); AdamW's is `functional.ADAMW_LAUNCH`.

A step's device table is one int64 buffer (`stage_step` / `StagingRing`): the buffer
addresses of each launch kind's tensors (`step_layout`; an FP32-only step has one kind:
every parameter, then every gradient, then every state buffer), then the float32
step-scalar rows (the rule's `scalar_fields`), so one host-to-device copy carries a whole step.

Launch kinds (docs/MULTI_TENSOR.md, "bf16 weights with split masters"): FP32 parameters; bf16
parameters with split masters and FP32 gradients; the same with bf16 gradients. Each kind is
one multi-tensor launch, whose table section also lists the low halves after the states.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.core import launch
from packed_adamw.core.rule import Rule, StateLayout

from ._state import NONFINITE_COLUMN, new_counters


SKELETON_MODULE = "packed_adamw.core.skeleton"


@dataclass(frozen=True, kw_only=True)  # keywords only: the fields' order is no contract
class RuleLaunch:
    """What the torch launches and step plans need of a rule, besides its declaration (`rule`)
    and its state format's constexprs (`kernel_constexprs`). Its kernels are named, not held,
    so that importing the frontend does not load Triton: a name in `kernel_module`, or
    "module:name". They follow AdamW's signatures (core/adamw/kernel.py): the multi-tensor
    kernel reads a pointer table laid out by `step_layout`, the single-tensor kernels (FP32
    weights; bf16 weights with split masters) take (weight[, low half], grad, state, scalar
    row, counter row, n, outputs...), and the capturable scalar kernel derives the scalar rows
    on the device from each group's lr address, the groups' hyperparameter rows, a per-row sign
    for maximize and the counts. The update kernels default to the launch skeleton's
    (core/skeleton.py), which call the block step the state format's `kernel_constexprs` names.
    A torch hyperparameter row is the rule's `hyperparam_fields` (lr first) then maximize."""

    rule: Rule
    kernel_module: str  # imported on the first CUDA launch
    capturable_scalars_kernel: str
    row_scalars: Callable  # (step count, torch hyperparameter row) -> the step-scalar row, on the host
    cpu_step: Callable  # the numpy step over lists of tensors (functional.cpu_step_'s arguments)
    multi_tensor_kernel: str = SKELETON_MODULE + ":multi_tensor_kernel"
    single_tensor_kernel: str = SKELETON_MODULE + ":tensor_kernel"
    split_kernel: str = SKELETON_MODULE + ":split_tensor_kernel"

    @property
    def uses_skeleton(self) -> bool:
        """Whether any update kernel is the launch skeleton's (its state format must then name a
        block step: `skeleton.constexprs`)."""
        return any(name.startswith(SKELETON_MODULE + ":")
                   for name in (self.multi_tensor_kernel, self.single_tensor_kernel, self.split_kernel))

    def __post_init__(self):
        if self.rule.scalar_row % 2:
            raise ValueError(f"rule {self.rule.name}: the torch launcher stages step-scalar rows of float32 pairs "
                             f"in int64 words; pad its scalar_fields to an even count ({self.rule.scalar_row} now)")

    @property
    def scalar_row(self) -> int:
        return self.rule.scalar_row

    @property
    def scalar_row_int64_words(self) -> int:
        """int64 words of the staged table one step-scalar row takes."""
        return self.rule.scalar_row // 2

    def kernel(self, name: str):
        """The Triton kernel called `name` in the rule's kernel module ("module:name": in that one)."""
        module, _, qualified = name.rpartition(":")
        return _kernel(module or self.kernel_module, qualified)


@functools.cache
def _kernel(module: str, name: str):
    return getattr(importlib.import_module(module), name)


# The launch kinds are core's (core/launch.py): FP32; split masters with FP32 or bf16 gradients.
LaunchKind, FP32_KIND = launch.LaunchKind, launch.FP32_KIND


def launch_kind(param: torch.Tensor, grad: torch.Tensor) -> LaunchKind:
    return LaunchKind(param.dtype is torch.bfloat16, grad.dtype is torch.bfloat16)


def scalar_table(counts, hparams, row_scalars: Callable) -> tuple[np.ndarray, tuple[int, ...]]:
    """The step scalars, derived on the host by the rule's `row_scalars` (FORMAT.md, "Step
    scalars"): [rows, scalar row] float32, one row per distinct (count, hyperparameters), and
    each tensor's row. Tensors of one group share a row object, so each distinct pair is
    derived once."""
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


def stage_step(n_pointers: int, scalars: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """Pinned int64 host buffer holding `n_pointers` addresses (for the caller to fill) and
    then the [rows, scalar row] float32 step scalars (an even row width: `RuleLaunch`).

    Pinned memory from torch's host allocator is not handed out again before the copy that
    reads it has finished, so the host never waits for the GPU."""
    staged = torch.empty(n_pointers + scalars.size // 2, dtype=torch.int64, pin_memory=True)
    host = staged.numpy()
    host[n_pointers:].view(np.float32)[:] = scalars.reshape(-1)
    return staged, host[:n_pointers]


class StagingRing:
    """`stage_step`'s buffer for a caller that steps the same tensors again and again (a step
    plan): pinned host buffers and device buffers for `n_pointers` addresses and up to
    `max_rows` scalar rows of `scalar_row` float32 values (even), reused in turn, so a step
    allocates nothing. A slot is refilled only after the launch that read it has finished (an
    event per slot), whatever stream that launch ran on."""

    DEPTH = 4

    def __init__(self, n_pointers: int, max_rows: int, scalar_row: int, device: torch.device):
        self.scalar_row_words = scalar_row // 2
        words = n_pointers + self.scalar_row_words * max_rows
        self.n_pointers = n_pointers
        self.host = [torch.empty(words, dtype=torch.int64, pin_memory=True) for _ in range(self.DEPTH)]
        self.host_arrays = [h.numpy() for h in self.host]
        self.torch_device = device
        with on_device(device):
            self.device = [torch.empty(words, dtype=torch.int64, device=device) for _ in range(self.DEPTH)]
            self.events = [torch.cuda.Event() for _ in range(self.DEPTH)]
        self.used = [False] * self.DEPTH
        self.slot = 0
        self.views = {}  # (slot, words) -> (device view, host view)

    def stage(self, scalars: np.ndarray) -> np.ndarray:
        """The next slot's host words, scalars written; returns the address part to fill."""
        self.slot = (self.slot + 1) % self.DEPTH
        if self.used[self.slot]:
            self.events[self.slot].synchronize()  # DEPTH steps back: normally long finished
        host = self.host_arrays[self.slot]
        self.n_words = self.n_pointers + self.scalar_row_words * len(scalars)
        host[self.n_pointers:self.n_words].view(np.float32)[:] = scalars.reshape(-1)
        return host[:self.n_pointers]

    def send(self) -> torch.Tensor:
        """Copies the staged slot to the device (on the current stream) and returns it there
        (for a slot and length, the same tensor every time: views cost host time)."""
        key = (self.slot, self.n_words)
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = (self.device[self.slot][:self.n_words], self.host[self.slot][:self.n_words])
        table, host = views
        table.copy_(host, non_blocking=True)
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
    return _launch_tables(numels, rows, device, launch.MULTI_TENSOR_BLOCK, launch.SOLO_ELEMENTS)


@functools.lru_cache(maxsize=16)
def _launch_tables(numels, rows, device, block: int, solo_elements: int) -> LaunchTables:
    solo = tuple(i for i, n in enumerate(numels) if n >= solo_elements)
    shared = [0 if n >= solo_elements else n for n in numels]
    block_tensor, block_index = launch.block_table(shared, block)
    as_device = lambda a, dtype: torch.as_tensor(a, dtype=dtype).to(device)  # noqa: E731
    return LaunchTables(as_device(block_tensor, torch.int32), as_device(block_index, torch.int32),
                        as_device(numels, torch.int64), as_device(rows, torch.int32), rows, solo)


class Segment(NamedTuple):
    """The tensors of one launch kind in a step: one multi-tensor launch (plus solo launches)."""

    kind: LaunchKind
    indices: tuple[int, ...]  # the step's tensors of this kind, in step order
    offset: int  # where its addresses start in the step's table
    tables: LaunchTables  # over these tensors (tensor t of the launch is indices[t])
    span: tuple[int, int] | None  # (first, end) when the indices are consecutive: counter rows are a view
    indices_device: torch.Tensor | None  # otherwise, the indices on the device (counts are added back)


def step_layout(kinds: tuple[LaunchKind, ...], numels: tuple[int, ...], rows: tuple[int, ...],
                device: torch.device) -> tuple[Segment, ...]:
    """The table layout of a step: one segment per launch kind present, in LaunchKind order,
    each with its tensors' addresses as `kind.sections` consecutive sections of
    len(indices) entries (parameters, gradients, states, low halves)."""
    return _step_layout(kinds, numels, rows, device, launch.MULTI_TENSOR_BLOCK, launch.SOLO_ELEMENTS)


@functools.lru_cache(maxsize=16)
def _step_layout(kinds, numels, rows, device, block: int, solo_elements: int) -> tuple[Segment, ...]:
    del block, solo_elements  # cache keys: launch_tables reads the current values
    segments, offset = [], 0
    for kind in sorted(set(kinds)):
        indices = tuple(i for i, k in enumerate(kinds) if k == kind)
        tables = launch_tables(tuple(numels[i] for i in indices), tuple(rows[i] for i in indices), device)
        consecutive = indices[-1] - indices[0] + 1 == len(indices)
        span = (indices[0], indices[-1] + 1) if consecutive else None
        on_device = None if consecutive else torch.as_tensor(indices, dtype=torch.int64).to(device)
        segments.append(Segment(kind, indices, offset, tables, span, on_device))
        offset += kind.sections * len(indices)
    return tuple(segments)


def layout_pointers(layout: tuple[Segment, ...]) -> int:
    """How many addresses the table of `layout` holds before its scalar rows."""
    return sum(segment.kind.sections * len(segment.indices) for segment in layout)


def addresses_of(tensors) -> list[int]:
    """Each tensor's address (0 for None: an FP32 parameter's absent low half)."""
    return [0 if t is None else t.data_ptr() for t in tensors]


def fill_addresses(pointers: np.ndarray, layout, *sections: list[int]) -> None:
    """Writes the addresses of every parameter, gradient, state and low half (`sections`, one
    list each, in step order) where `layout` puts them."""
    for segment in layout:
        n, offset, indices = len(segment.indices), segment.offset, list(segment.indices)
        for k, addresses in enumerate(sections[:segment.kind.sections]):
            pointers[offset + k * n:offset + (k + 1) * n] = np.asarray(addresses, dtype=np.int64)[indices]


def fixed_addresses(layout, param_addresses, state_addresses, low_addresses) -> tuple[np.ndarray, np.ndarray]:
    """For a caller whose only changing buffers are the gradients (a step plan): the table's
    addresses with the gradients' left 0, and where each tensor's gradient address goes."""
    n = len(param_addresses)
    pointers = np.zeros(layout_pointers(layout), dtype=np.int64)
    fill_addresses(pointers, layout, param_addresses, [0] * n, state_addresses, low_addresses)
    grad_slots = np.zeros(n, dtype=np.int64)
    for segment in layout:
        count = len(segment.indices)
        grad_slots[list(segment.indices)] = segment.offset + count + np.arange(count)
    return pointers, grad_slots


def _counters(n: int, device, count_nonfinite: bool, track_format: bool, counters):
    """The counter rows a launch adds to: the caller's (they accumulate format counts across
    steps), or fresh ones when only the non-finite count is wanted, or None."""
    if counters is not None:
        if count_nonfinite:
            counters[:, NONFINITE_COLUMN].zero_()  # the non-finite count is per step
        return counters
    if count_nonfinite or track_format:
        return new_counters(n, device)
    return None


def _rejected(counters, count_nonfinite: bool, n: int) -> list[int]:
    return counters[:, NONFINITE_COLUMN].tolist() if count_nonfinite else [0] * n


def cuda_step_(rule: RuleLaunch, params, grads, states, scalars: np.ndarray, rows: tuple[int, ...],
               fmt: StateLayout, multi_tensor: bool, count_nonfinite: bool, counters=None, track_format: bool = False,
               lows=None) -> list[int]:
    """One step of `rule` on CUDA from scratch (no plan): stage, then one multi-tensor launch per launch
    kind (plus solo launches), or one launch per tensor. `scalars` holds the distinct
    step-scalar rows and `rows[i]` tensor i's. `counters` ([n, launch.COUNTER_ROW] int64 on
    the device): the kernels add their counts there. `lows[i]`: tensor i's int16 low half when
    params[i] is a bf16 weight with a split master, else None."""
    n = len(params)
    lows = [None] * n if lows is None else lows
    device = params[0].device
    if multi_tensor:
        kinds = tuple(LaunchKind(lo is not None, g.dtype is torch.bfloat16) for lo, g in zip(lows, grads))
        layout = step_layout(kinds, tuple(p.numel() for p in params), rows, device)
        staged, pointers = stage_step(layout_pointers(layout), scalars)
        fill_addresses(pointers, layout, *map(addresses_of, (params, grads, states, lows)))
        return launch_step(rule, staged.to(device, non_blocking=True), params, grads, states, layout, fmt,
                           count_nonfinite, aligned=not (pointers & 15).any(), counters=counters,
                           track_format=track_format, lows=lows)
    staged, _ = stage_step(0, scalars)
    with on_device(device):
        scalars_dev = staged.to(device, non_blocking=True).view(torch.float32).view(-1, rule.scalar_row)
        counters = _counters(n, device, count_nonfinite, track_format, counters)
        for i, (p, g, s, lo) in enumerate(zip(params, grads, states, lows)):
            _launch_one(rule, p, g, s, lo, scalars_dev[rows[i]], counters, i, fmt, count_nonfinite, track_format)
    return _rejected(counters, count_nonfinite, n)


def launch_step(rule: RuleLaunch, table: torch.Tensor, params, grads, states, layout: tuple[Segment, ...],
                fmt: StateLayout, count_nonfinite: bool, aligned: bool, relaunch: dict | None = None, counters=None,
                track_format: bool = False, scalars: torch.Tensor | None = None, lows=None) -> list[int]:
    """The CUDA step of `rule` over a device table laid out as `layout` says (`aligned`: every address
    on 16 bytes), each segment's scalar rows assigned by its tables. Tensors of at least
    `launch.SOLO_ELEMENTS` elements get a launch of their own, which skips the table lookups;
    all others of one launch kind share one launch of the multi-tensor kernel
    (docs/MULTI_TENSOR.md). `counters` and `lows` as in `cuda_step_`.

    `relaunch`: a dict owned by a caller whose tensor count and table shapes stay fixed (a
    step plan), where `_Relaunch` keeps each launch kind's compiled kernel between steps.
    `scalars`: the scalar rows as a device tensor of their own (derived on the device)
    instead of the table's tail."""
    n, device = len(params), params[0].device
    lows = [None] * n if lows is None else lows
    with on_device(device):
        if scalars is None:
            scalars = table[layout_pointers(layout):].view(torch.float32)
        counters = _counters(n, device, count_nonfinite, track_format, counters)
        for segment in layout:
            _launch_segment(rule, table, segment, scalars, counters, fmt, count_nonfinite, aligned, relaunch,
                            track_format)
        rows = scalars.view(-1, rule.scalar_row)
        for segment in layout:
            for t in segment.tables.solo:
                i = segment.indices[t]
                _launch_one(rule, params[i], grads[i], states[i], lows[i], rows[segment.tables.rows[t]], counters, i,
                            fmt, count_nonfinite, track_format)
    return _rejected(counters, count_nonfinite, n)


def _launch_segment(rule: RuleLaunch, table, segment: Segment, scalars, counters, fmt: StateLayout,
                    count_nonfinite: bool, aligned: bool, relaunch: dict | None, track_format: bool) -> None:
    """One multi-tensor launch of the rule's kernel over a segment's shared (not solo) tensors."""

    tables = segment.tables
    if not tables.block_tensor.numel():  # none when every tensor is empty or solo
        return
    rows = None
    if counters is not None:  # the kernel adds to row t of its launch's tensors
        if segment.span is not None:
            rows = counters[segment.span[0]:segment.span[1]]
        else:
            rows = new_counters(len(segment.indices), counters.device)
    grid = (tables.block_tensor.numel(),)
    args = _segment_args(table, segment, scalars, rows)
    kind = segment.kind
    key = (kind, aligned, count_nonfinite, track_format)  # `relaunch` is one plan's, of one rule
    fast = relaunch.get(key) if relaunch is not None else None
    if fast is not None:
        fast(grid, args)
    else:
        constants = {**_constants(fmt, None, count_nonfinite, launch.MULTI_TENSOR_BLOCK, track_format, kind.split),
                     "ALIGNED": aligned, "GRAD_BF16": kind.grad_bf16}
        multi_tensor_kernel = rule.kernel(rule.multi_tensor_kernel)
        compiled = multi_tensor_kernel[grid](
            *args, num_warps=launch.MULTI_TENSOR_NUM_WARPS, **constants, **launch.COMPILE_OPTIONS)
        if relaunch is not None:
            fast = _Relaunch.of(multi_tensor_kernel, compiled, len(args), constants)
            if fast is not None:
                relaunch[key] = fast
    if rows is not None and segment.span is None:
        counters.index_add_(0, segment.indices_device, rows)


def _segment_args(table, segment: Segment, scalars, rows) -> tuple:
    """The multi-tensor kernel's arguments for a segment (`rows`: its counter rows, or None)."""
    tables = segment.tables
    pointers = table if segment.offset == 0 else table[segment.offset:]
    return (pointers, tables.block_tensor, tables.block_index, tables.numels, tables.rows_device, scalars,
            tables.block_index if rows is None else rows, len(segment.indices))  # block_index: unused without counts


def planned_launches(table: torch.Tensor, layout: tuple[Segment, ...], aligned: bool, relaunch: dict) -> tuple | None:
    """What `launch_step` launches over `table` (its scalar rows at the table's tail) without
    non-finite counts or format counts (counter rows, unread then, are left out), as
    ((relaunch, grid, args), ...) to call
    again while the table's memory stays the same; None while some launch has no compiled
    relaunch yet (`launch_step` makes it) or a tensor launches solo. A step plan keeps these
    per staging slot, so a step spends no host time on views and argument tuples
    (docs/MULTI_TENSOR.md, "The host side")."""
    scalars = table[layout_pointers(layout):].view(torch.float32)
    launches = []
    for segment in layout:
        if segment.tables.solo:
            return None
        if not segment.tables.block_tensor.numel():
            continue
        fast = relaunch.get((segment.kind, aligned, False, False))
        if fast is None:
            return None
        launches.append((fast, (segment.tables.block_tensor.numel(),), _segment_args(table, segment, scalars, None)))
    return tuple(launches)


class UncheckedTritonWarning(UserWarning):
    """The installed Triton is not a release `_Relaunch` was checked on: it stays off."""


class _Relaunch:
    """Launches an already compiled Triton kernel again, skipping `JITFunction.run`'s argument
    binding and specialization (docs/results/BENCHMARKS.md times a step with and without it):
    only valid for a caller whose argument types, alignments and integer values cannot change
    between launches, which a step plan guarantees.

    It relies on Triton internals (`CompiledKernel[grid](*args)`, `JITFunction.arg_names`),
    so it is used only on the Triton releases it was checked on (`CHECKED_TRITON`, major and
    minor). On any other release pyproject allows, `of` returns None, warns once per process
    (`UncheckedTritonWarning`) and the caller launches through `JITFunction.run`: same bits,
    more host time per step (docs/MULTI_TENSOR.md, "The host side")."""

    CHECKED_TRITON = ((3, 6),)  # on the H200; the CPU interpreter never returns a CompiledKernel
    enabled = True  # the benchmark switches it off to time what it saves
    warned = False

    def __init__(self, compiled, constants: tuple):
        self.compiled, self.constants = compiled, constants

    @classmethod
    def of(cls, jit_fn, compiled, n_args: int, constants: dict) -> "_Relaunch | None":
        if not cls.enabled or not hasattr(compiled, "run"):
            return None
        version = _triton_version()
        if version not in cls.CHECKED_TRITON:
            if not cls.warned:
                cls.warned = True
                checked = ", ".join(f"{major}.{minor}" for major, minor in cls.CHECKED_TRITON)
                warnings.warn(
                    f"packed_adamw.torch: Triton {version[0]}.{version[1]} is not a release its fast relaunch of "
                    f"compiled kernels was checked on ({checked}): step plans launch through Triton's usual path instead "
                    "(same bits, more host time per step; docs/MULTI_TENSOR.md)", UncheckedTritonWarning, stacklevel=2)
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

    return triton_release(triton.__version__)


def triton_release(version: str) -> tuple[int, int]:
    """(major, minor) of a Triton version string ("3.6.0", "3.7.0+git1a2b3c", "3.10.0rc1")."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return (0, 0)  # unknown: never a checked release
    return int(match[1]), int(match[2])


def _launch_one(rule: RuleLaunch, p, g, s, lo, scalars, counters, i: int, fmt: StateLayout, count_nonfinite: bool,
                track_format: bool) -> None:
    """The rule's single-tensor kernel on tensor i of a step, in place; `scalars` is its row;
    `lo` the int16 low half of a bf16 weight (the split kernel), or None."""
    n = p.numel()
    if n == 0:
        return
    words = s.view(torch.int32) if s.dtype is torch.uint32 else s  # the kernel reads words as int32
    counter_row = scalars if counters is None else counters[i]  # scalars: unused without counts
    constants = _single_tensor_constants(fmt, count_nonfinite, launch.GPU_BLOCK, track_format, lo is not None)
    grid, warps = launch.single_tensor_grid(n, constants), launch.single_tensor_warps(constants)
    if lo is None:
        rule.kernel(rule.single_tensor_kernel)[grid](p, g, words, scalars, counter_row, n, p, words,
                                                     num_warps=warps, **constants, **launch.COMPILE_OPTIONS)
    else:
        rule.kernel(rule.split_kernel)[grid](p, lo, g, words, scalars, counter_row, n, p, lo, words,
                                             num_warps=warps, **constants, **launch.COMPILE_OPTIONS)


def on_device(device: torch.device):
    """torch.cuda.device(device), skipped when it is already current (a step's host cost counts)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


@functools.lru_cache(maxsize=64)
def _constants(fmt: StateLayout, write_update, count_nonfinite: bool, block: int, track_format: bool = False,
               split: bool = False) -> dict:
    return launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=count_nonfinite, block=block,
                                   track_format=track_format, split=split)


@functools.lru_cache(maxsize=64)
def _single_tensor_constants(fmt: StateLayout, count_nonfinite: bool, block: int, track_format: bool,
                             split: bool) -> dict:
    return launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=count_nonfinite, block=block,
                                          track_format=track_format, split=split)
