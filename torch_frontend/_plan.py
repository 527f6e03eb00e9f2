"""A step plan: what `PackedAdamW` can reuse between steps while only gradients and
hyperparameters change, so a step costs a fraction of a full step's host time.

Its surface is three calls: `StepPlan(opt, ...)`, made by a full step (`_engine.full_step`)
over the tensors it checked; `plan.run(...)`, the step itself, which the full step calls with
the gradients and counts it checked; and `plan.step(opt, rows)`, which later steps call: it
checks that the plan still holds, then runs it and returns the rejected counts, or returns
None, having changed nothing, when the full step must run. So every step reaches the launches
(or the numpy step) through `run`. The checks the kernel's raw addresses need are still made
every step.

Those checks are a step's host cost (docs/MULTI_TENSOR.md, "The host side"), so they are
written as passes of C-level `map`s over the plan's tensors, each compared at once with what
the plan was made for, rather than as a Python loop per tensor: the gradients' dtypes, shapes,
contiguity, devices and addresses, the parameters' addresses, dtypes and contiguity,
the state entries and step counts by identity. Nothing is skipped on the strength of an
earlier step (a tensor's `.data` can be swapped, or its metadata changed in place, between
any two steps), so every refusal of a full step fires whenever its condition appears.
"""
from __future__ import annotations

import operator
from itertools import repeat

import numpy as np
import torch

from . import _capture, _dtensor, _launch
from ._state import LOW_HALF_KEY, STEP_KEY

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16
_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_get_device = torch.Tensor.get_device
_grad_of = operator.attrgetter("grad")
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_step_of = operator.itemgetter(STEP_KEY)
_is = operator.is_


def _same_objects(now, then) -> bool:
    """Whether two sequences hold the same objects, in order (identity: `==` would compare
    tensors element by element)."""
    return len(now) == len(then) and all(map(_is, now, then))


class StepPlan:
    """Which parameters step, their addresses, shapes and state; rebuilt by a full step
    whenever any of it changes."""

    def __init__(self, opt, params: list, kernel_params: list, states: list[dict], stored: list, moments: list,
                 group_of: list[int], device: int, counters=None, *, rule: _launch.RuleLaunch, kinds=None, lows=None,
                 stored_lows=None):
        """`rule`: what the launches need of the optimizer's rule (`_launch.RuleLaunch`, e.g.
        `functional.ADAMW_LAUNCH`); the plan itself knows none. `params` as the optimizer holds
        them; `kernel_params` and `moments` the tensors the kernel updates (a DTensor's local
        shard, the uint32 view of sharded words); `stored` the state tensors as the state dicts
        hold them; `counters` the format counts the steps of this plan accumulate into (with
        `track_format`). `kinds`: each tensor's `_launch.LaunchKind` (all FP32 when left out);
        `lows` the int16 low halves the kernel updates for bf16 parameters (None for FP32 ones),
        `stored_lows` as the state dicts hold them."""
        everything = [p for group in opt.param_groups for p in group["params"]]
        with_grad = set(map(id, params))
        n = len(params)
        # track_format may be switched between steps (it picks the launch); a plan made
        # without counters holds only while it stays off. `run` counts the steps it counted.
        self.options = (opt.state_format, opt.multi_tensor, opt.check_nonfinite)
        self.rule = rule
        self.counters, self.tracked_steps = counters, 0
        self.state, self.state_dicts = opt.state, list(opt.state.values())
        self.param_lists = [list(group["params"]) for group in opt.param_groups]
        self.params_without_grad = [p for p in everything if id(p) not in with_grad]
        self.params, self.kernel_params, self.states, self.moments = params, kernel_params, states, moments
        self.kinds = tuple(kinds) if kinds is not None else (_launch.FP32_KIND,) * n
        self.lows = list(lows) if lows is not None else [None] * n
        self.any_split = any(kind.split for kind in self.kinds)
        self.stored_lows = list(stored_lows) if stored_lows is not None else [None] * n
        # What the raw addresses rely on, per tensor: the dtypes stay those the launches were made for.
        self.param_dtypes = [BFLOAT16 if kind.split else FLOAT32 for kind in self.kinds]
        self.grad_dtypes = [BFLOAT16 if kind.grad_bf16 else FLOAT32 for kind in self.kinds]
        self.sharded = [_dtensor.is_dtensor(p) for p in params]
        # A sharded gradient must stay laid out like its parameter (the full step checks it).
        self.layouts = [(p.device_mesh, tuple(p.placements)) if sharded else None
                        for p, sharded in zip(params, self.sharded)]
        self.any_sharded = any(self.sharded)
        self.stored = list(stored)
        self.shapes = [p.shape for p in kernel_params]
        self.param_pointers = list(map(_data_ptr, kernel_params))
        self.devices = [device] * n
        self.numels = tuple(p.numel() for p in kernel_params)
        self.group_of = tuple(group_of)
        self.device, self.torch_device = device, kernel_params[0].device
        self.state_entry_of = operator.itemgetter(opt.state_format.state_key)
        self.on_device_counts = False
        self.last_count = None  # the step count `run` wrote into every state, one int object
        self.cuda_tables = device >= 0 and opt.multi_tensor
        if self.cuda_tables:
            self.relaunch = {}  # _launch.launch_step keeps each launch kind's compiled kernel here
            self.launches = {}  # (staging slot, words, aligned) -> _launch.planned_launches' launches, or False
            self.group_layout = _launch.step_layout(self.kinds, self.numels, self.group_of, self.torch_device)
            # Every address but the gradients' is fixed: laid out once, the gradients' slots noted.
            self.n_pointers = _launch.layout_pointers(self.group_layout)
            self.static_pointers, self.grad_slots = _launch.fixed_addresses(
                self.group_layout, self.param_pointers, *map(_launch.addresses_of, (moments, self.lows)))
            self.aligned = not (self.static_pointers & 15).any()
            self.staging = _launch.StagingRing(self.n_pointers, max(n, len(opt.param_groups)), rule.scalar_row,
                                               self.torch_device)

    def addresses(self, grad_pointers: list[int]) -> np.ndarray:
        """The step's table addresses, given the gradients' (a new array)."""
        pointers = self.static_pointers.copy()
        pointers[self.grad_slots] = grad_pointers
        return pointers

    def layout(self, rows: tuple[int, ...]):
        """The launch layout for tensors taking the scalar rows `rows`."""
        if rows == self.group_of:
            return self.group_layout
        return _launch.step_layout(self.kinds, self.numels, rows, self.torch_device)

    def _gradients(self, opt) -> tuple[list, list[int], int | list[int] | None] | None:
        """(gradients, their addresses, the new step count: one for all, or each tensor's) if
        the plan still holds."""
        state = opt.state
        if (state is not self.state or not _same_objects(state.values(), self.state_dicts)
                or (opt.state_format, opt.multi_tensor, opt.check_nonfinite) != self.options
                or (opt.track_format and self.counters is None)):
            return None
        groups = opt.param_groups
        if len(groups) != len(self.param_lists) or not all(
                _same_objects(group["params"], params) for group, params in zip(groups, self.param_lists)):
            return None
        if any(p.grad is not None for p in self.params_without_grad):
            return None
        states = self.states
        try:
            if not _same_objects(list(map(self.state_entry_of, states)), self.stored):
                return None
            if self.any_split and not _same_objects(list(map(dict.get, states, repeat(LOW_HALF_KEY))),
                                                    self.stored_lows):
                return None
            counts = None if self.on_device_counts else self._counts()
        except (KeyError, TypeError):
            return None
        if self.any_sharded:
            return self._sharded_gradients(counts)
        params = self.params
        grads = list(map(_grad_of, params))
        try:  # the cheapest checks first; a missing gradient fails (None has no dtype), a sparse one raises
            if (list(map(_dtype_of, grads)) != self.grad_dtypes or list(map(_shape_of, grads)) != self.shapes
                    or not all(map(_is_contiguous, grads)) or list(map(_get_device, grads)) != self.devices
                    or list(map(_data_ptr, params)) != self.param_pointers
                    or list(map(_dtype_of, params)) != self.param_dtypes or not all(map(_is_contiguous, params))):
                return None
            return grads, list(map(_data_ptr, grads)), counts
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    def _counts(self) -> int | list[int]:
        """This step's count: one for every tensor while each state still holds the count the
        last step wrote (the same int object: a count set by hand, even an equal one, is
        checked afresh), else each tensor's (raises TypeError for a count that is no number)."""
        steps = list(map(_step_of, self.states))
        last = self.last_count
        if last is not None and all(map(_is, steps, repeat(last))):
            return last + 1
        return [step + 1 for step in steps]

    def _sharded_gradients(self, counts) -> tuple[list, list[int], int | list[int] | None] | None:
        """`_gradients`' per-tensor checks where some parameters are DTensors: each sharded
        gradient must stay laid out like its parameter; the kernel reads local shards."""
        device, grads, grad_pointers = self.device, [], []
        param_dtypes, grad_dtypes = self.param_dtypes, self.grad_dtypes
        try:  # one pass, the cheapest checks first; a sparse gradient fails or raises
            for i, (p, shape, address) in enumerate(zip(self.params, self.shapes, self.param_pointers)):
                g = p.grad
                if self.sharded[i]:
                    if not _dtensor.is_dtensor(g) or (g.device_mesh, tuple(g.placements)) != self.layouts[i]:
                        return None
                    g, p = g.to_local(), p.to_local()
                if (g is None or g.dtype is not grad_dtypes[i] or not g.is_contiguous() or g.shape != shape
                        or g.get_device() != device or _data_ptr(p) != address or p.dtype is not param_dtypes[i]
                        or not p.is_contiguous()):
                    return None
                grads.append(g)
                grad_pointers.append(_data_ptr(g))
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        return grads, grad_pointers, counts

    def step(self, opt, group_rows: list[tuple[float, ...]]) -> list[int] | None:
        """The step, given each group's validated hyperparameter row; None if the plan no
        longer holds (nothing changed)."""
        found = self._gradients(opt)
        if found is None:
            return None
        return self.run(opt, *found, group_rows)

    def run(self, opt, grads: list, grad_pointers: list[int], counts: int | list[int] | None,
            group_rows: list[tuple[float, ...]]) -> list[int] | None:
        """The step over the plan's tensors with these (checked) gradients, their addresses
        and the new step counts (one for all tensors, or a list); None, having changed nothing,
        if the step scalars cannot be derived."""
        fmt, multi_tensor, count_nonfinite = self.options
        track_format = opt.track_format
        # Scalars first: a bad step count raises here, before anything changes; the full step
        # then names the parameter.
        if type(counts) is list and counts.count(counts[0]) == len(counts) and type(counts[0]) is int:
            counts = counts[0]  # one count: written as one object (`_counts`)
        try:
            if type(counts) is int:  # one row per group
                row_scalars = self.rule.row_scalars
                scalars = np.asarray([row_scalars(counts, row) for row in group_rows], dtype=np.float32)
                rows = self.group_of
            else:
                if type(counts) is int:
                    counts = [counts] * len(self.states)
                scalars, rows = _launch.scalar_table(counts, [group_rows[i] for i in self.group_of],
                                                     self.rule.row_scalars)
            layout = self.layout(rows) if self.cuda_tables else None
        except (TypeError, ValueError):
            return None
        if self.device < 0:
            rejected = self.rule.cpu_step(self.kernel_params, grads, self.moments, scalars, rows, fmt, self.counters,
                                 track_format, self.lows)
        elif not multi_tensor:
            rejected = _launch.cuda_step_(self.rule, self.kernel_params, grads, self.moments, scalars, rows, fmt, False,
                                          count_nonfinite, self.counters, track_format, self.lows)
        else:  # CUDA: only the gradients' addresses and the scalars are new
            staging = self.staging
            pointers = staging.stage(scalars)
            pointers[:] = self.static_pointers
            grad_addresses = np.array(grad_pointers, dtype=np.int64)
            pointers[self.grad_slots] = grad_addresses
            aligned = self.aligned and not (grad_addresses & 15).any()
            table = staging.send()
            # Launches made before over this slot's table, while nothing but the table's contents
            # changes: no counts taken (a plan that keeps format counters, with track_format off,
            # launches the same uncounted kernel, which never reads them), the plan's own layout,
            # its device current (the launcher takes the current device's stream).
            key = (staging.slot, staging.n_words, aligned)
            plain = not (count_nonfinite or track_format) and rows is self.group_of
            launches = self.launches.get(key) if plain else None
            if launches and torch.cuda.current_device() == self.device:
                for fast, grid, args in launches:
                    fast(grid, args)
                rejected = [0] * len(grads)
            else:
                rejected = _launch.launch_step(self.rule, table, self.kernel_params, grads, self.moments, layout, fmt,
                                               count_nonfinite, aligned, self.relaunch, self.counters, track_format,
                                               lows=self.lows)
                if plain and launches is None:  # False: none can be kept (a solo tensor, no relaunch)
                    self.launches[key] = _launch.planned_launches(table, layout, aligned, self.relaunch) or False
            staging.launched()
        if type(counts) is int:
            for state in self.states:
                state[STEP_KEY] = counts
            self.last_count = counts
        else:
            for state, count in zip(self.states, counts):
                state[STEP_KEY] = count
            self.last_count = None
        if track_format:
            self.tracked_steps += 1
        return rejected


class CapturableStepPlan(StepPlan):
    """The plan of `PackedAdamW(capturable=True)` on CUDA: the step count of every tensor
    (`state["step"]`, an int32 tensor) and each group's learning rate (a tensor) stay on the
    device, and the step scalars are derived there by the rule's capturable scalar kernel
    (AdamW's: core's `capturable_step_scalars_kernel`), which also reads and checks each
    group's lr tensor and advances the counts, from the same recipe as the host's. A step then
    makes no host synchronisation and no host-to-device copy of a changing value, so
    `torch.cuda.graph` can capture it and replays follow the lr tensor.

    What a capture reads follows `_capture`'s rules: the buffer addresses come from an
    `AddressTable`; the plan and every tensor the capture read are kept as long as the
    optimizer (a plan rebuilt later must not free them); and the tensors a capture read as
    constants (the hyperparameter rows, maximize's signs, the lr addresses) are never written
    again: an eager step that changes them writes new ones, so a graph keeps what it captured."""

    def __init__(self, opt, params, kernel_params, states, stored, moments, group_of, device, counters=None, **kinds):
        super().__init__(opt, params, kernel_params, states, stored, moments, group_of, device, counters, **kinds)
        rule = self.rule.rule

        self.on_device_counts = True
        n, torch_device = len(params), self.torch_device
        # One device vector of counts; each state's "step" is a view of its element.
        self.counts = torch.stack([torch.as_tensor(state[STEP_KEY], dtype=torch.int32).to(torch_device).reshape(())
                                   for state in states])
        for i, state in enumerate(states):
            state[STEP_KEY] = self.counts[i]
        self.step_tensors = [state[STEP_KEY] for state in states]
        self.tables = self.layout(tuple(range(n)))  # one scalar row per tensor
        self.group_index = torch.as_tensor(self.group_of, dtype=torch.int64).to(torch_device)
        self.b1_sign = torch.ones(n, dtype=torch.float32, device=torch_device)
        self.hparams = torch.zeros((len(opt.param_groups), rule.hyperparam_row), dtype=torch.float32,
                                   device=torch_device)
        self.scalars = torch.empty((n, rule.scalar_row), dtype=torch.float32, device=torch_device)
        # Each group's lr is read on the device through its address: the lr tensor itself when
        # it is a float32 on the device, else that group's element of `lr_staging`, which the
        # step fills from it. `lr_tensors` keeps alive the tensors whose addresses are uploaded.
        self.lr_addresses = torch.zeros(len(opt.param_groups), dtype=torch.int64, device=torch_device)
        self.lr_staging = torch.zeros(len(opt.param_groups), dtype=torch.float32, device=torch_device)
        self.lr_tensors = self.lr_key = None
        self.constants = None
        self.address_table = _capture.AddressTable(self.n_pointers, torch_device, opt.optimizer_name)
        self.taken = set()  # which of "constants" and "lr_addresses" a capture read (never written again)

    def captured_reads(self, table_kept: tuple) -> list:
        """What a capture of this plan reads, for `_capture.keep`: the plan (its counts, scalars
        and staging), the constants it captured (replaced by later changes, not rewritten), its
        address table, and the memory of the user's tensors (`.data = ...` can move them): the lr
        tensors, parameters, state words and low halves."""
        user = [*self.lr_tensors, *self.kernel_params, *self.moments, *(low for low in self.lows if low is not None)]
        return [self, self.hparams, self.b1_sign, self.lr_addresses, *table_kept, *map(_capture.storage, user)]

    def _direct_lr(self, lr: torch.Tensor) -> bool:
        """Whether the scalar kernel can read this lr tensor where it is."""
        return lr.dtype == torch.float32 and lr.device == self.torch_device

    def step(self, opt, group_rows) -> list[int] | None:
        found = self._gradients(opt)
        if found is None or not _same_objects(list(map(_step_of, self.states)), self.step_tensors):
            return None
        if len(opt.param_groups) != len(self.hparams):
            return None  # groups were added: a new plan
        return self.run(opt, *found, group_rows)

    def run(self, opt, grads, grad_pointers, counts, group_rows) -> list[int]:
        """The step on the device; `counts` is unused (the counts live there)."""
        del counts
        fmt = self.options[0]  # capturable optimizers never count formats (PackedAdamW.track_format)
        from packed_adamw.core import launch

        rule = self.rule
        width = rule.rule.hyperparam_row  # a torch row: the hyperparameter row (lr first), then maximize
        # Every hyperparameter but lr (validated floats; AdamW's b1, b2, eps, weight decay) and
        # maximize: constants of a capture
        constants = tuple(row[1:width + 1] for row in group_rows)
        capturing = torch.cuda.is_current_stream_capturing()
        addresses = tuple(self.addresses(grad_pointers).tolist())
        if capturing:
            self.address_table.check_capture(addresses)  # refused before anything is recorded
        with _launch.on_device(self.torch_device):
            if constants != self.constants:
                if capturing:
                    raise RuntimeError(_capture.refusal(opt.optimizer_name, f"{', '.join(rule.rule.group_keys[1:])} "
                                                                            "or maximize changed"))
                if "constants" in self.taken:  # a graph reads these: it keeps the values it captured
                    self.hparams, self.b1_sign = torch.zeros_like(self.hparams), torch.empty_like(self.b1_sign)
                    self.taken.discard("constants")
                for g, row in enumerate(constants):
                    self.hparams[g, 1:] = torch.tensor(row[:width - 1], dtype=torch.float32)
                signs = [-1.0 if constants[g][width - 1] else 1.0 for g in self.group_of]
                self.b1_sign.copy_(torch.tensor(signs, dtype=torch.float32))
                self.constants = constants
            if capturing and any(isinstance(group["lr"], torch.Tensor) and group["lr"].device != self.torch_device
                                 for group in opt.param_groups):
                raise RuntimeError(f"{opt.optimizer_name}(capturable=True): an lr tensor is not on the parameters' "
                                   "device; a captured step reads it there at every replay: move it there before "
                                   "capturing")
            # The learning rates are read and checked on the device, the counts advanced and the
            # scalars derived by one kernel: an invalid lr refuses its group's step (a NaN row
            # rejects every element; FORMAT.md), and its tensors' counts stay.
            lr_tensors = [group["lr"] for group in opt.param_groups]
            # The tensors and where their data lives: `lr.data = ...` keeps the object but moves it.
            lr_key = tuple((id(lr), lr.data_ptr(), lr.dtype, lr.device) for lr in lr_tensors)
            if lr_key != self.lr_key:
                if capturing:
                    raise RuntimeError(_capture.refusal(opt.optimizer_name, "an lr tensor was replaced (change lr "
                                                                            "tensors in place)"))
                if "lr_addresses" in self.taken:  # a graph reads its lr tensors through these
                    self.lr_addresses = torch.empty_like(self.lr_addresses)
                    self.taken.discard("lr_addresses")
                self.lr_addresses.copy_(torch.tensor(
                    [lr.data_ptr() if self._direct_lr(lr) else self.lr_staging[g].data_ptr()
                     for g, lr in enumerate(lr_tensors)], dtype=torch.int64))
                self.lr_tensors, self.lr_key = lr_tensors, lr_key
            for g, lr in enumerate(lr_tensors):
                if not self._direct_lr(lr):
                    self.lr_staging[g].copy_(lr.reshape(()))
            n = len(self.counts)
            rule.kernel(rule.capturable_scalars_kernel)[launch.grid(n, launch.SCALAR_BLOCK_ROWS)](
                self.lr_addresses, self.hparams, self.group_index, self.b1_sign, self.counts, n, self.scalars,
                BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **launch.COMPILE_OPTIONS)
            scalars = self.scalars
            if capturing:
                # The warm-up steps torch.cuda.graph asks for leave the eager table holding the
                # captured addresses whenever the gradients stay put (static ones, or
                # zero_grad(set_to_none=False)): the graph then reads it in place, copying nothing.
                table, table_kept = self.address_table.captured(addresses)
                _capture.keep(opt, *self.captured_reads(table_kept))
                self.taken.update(("constants", "lr_addresses"))
            else:
                table = self.address_table.eager(addresses)
            aligned = not any(a & 15 for a in addresses)
            _launch.launch_step(rule, table, self.kernel_params, grads, self.moments, self.tables, fmt, False, aligned,
                                self.relaunch, self.counters, False, scalars=scalars, lows=self.lows)
        return [0] * n
