"""A step plan: what `PackedAdamW` can reuse between steps while only gradients and
hyperparameters change, so a step costs a fraction of a full step's host time.

Its surface is two calls: `StepPlan(opt, ...)` after a full step, and `plan.step(opt, rows)`,
which either makes the step and returns the rejected counts, or returns None, having changed
nothing, when the plan no longer holds and the full step must run. The checks the kernel's
raw addresses need are still made every step.
"""
from __future__ import annotations

import numpy as np
import torch

from . import _dtensor, _launch
from .functional import cpu_step_, row_scalars, scalar_table

FLOAT32 = torch.float32
_data_ptr = torch.Tensor.data_ptr


class StepPlan:
    """Which parameters step, their addresses, shapes and state; rebuilt by a full step
    whenever any of it changes."""

    def __init__(self, opt, params: list, kernel_params: list, states: list[dict], stored: list, moments: list,
                 group_of: list[int], device: int, counters=None):
        """`params` as the optimizer holds them; `kernel_params` and `moments` the tensors the
        kernel updates (a DTensor's local shard, the uint32 view of sharded words); `stored`
        the state tensors as the state dicts hold them; `counters` the format counts the
        steps of this plan accumulate into (with `track_format`)."""
        everything = [p for group in opt.param_groups for p in group["params"]]
        with_grad = set(map(id, params))
        self.options = (opt.state_format, opt.multi_tensor, opt.check_nonfinite, opt.track_format)
        self.counters, self.tracked_steps = counters, 1 if counters is not None else 0
        self.state, self.state_ids = opt.state, tuple(map(id, opt.state.values()))
        self.param_ids = tuple(map(id, everything))
        self.group_sizes = tuple(len(group["params"]) for group in opt.param_groups)
        self.params_without_grad = [p for p in everything if id(p) not in with_grad]
        self.params, self.kernel_params, self.states, self.moments = params, kernel_params, states, moments
        self.sharded = [_dtensor.is_dtensor(p) for p in params]
        self.any_sharded = any(self.sharded)
        self.stored_ids = list(map(id, stored))
        self.shapes = [p.shape for p in kernel_params]
        self.param_pointers = list(map(_data_ptr, kernel_params))
        self.param_pointer_array = np.array(self.param_pointers, dtype=np.int64)
        self.moment_pointers = np.array(list(map(_data_ptr, moments)), dtype=np.int64)
        self.aligned = not any(address & 15 for address in (*self.param_pointers, *self.moment_pointers.tolist()))
        self.numels = tuple(p.numel() for p in kernel_params)
        self.group_of = tuple(group_of)
        self.device, self.torch_device = device, kernel_params[0].device
        self.state_key = opt.state_format.state_key
        self.cuda_tables = device >= 0 and opt.multi_tensor
        if self.cuda_tables:
            self.relaunch = {}  # _launch.launch_step keeps the compiled multi-tensor kernel here
            self.staging = _launch.StagingRing(len(params), max(len(params), len(opt.param_groups)), self.torch_device)
            self.group_tables = _launch.launch_tables(self.numels, self.group_of, self.torch_device)

    def _gradients(self, opt) -> tuple[list, list[int], list[int]] | None:
        """(gradients, their addresses, the new step counts) if the plan still holds."""
        groups = opt.param_groups
        if (opt.state is not self.state or tuple(map(id, self.state.values())) != self.state_ids
                or (opt.state_format, opt.multi_tensor, opt.check_nonfinite, opt.track_format) != self.options):
            return None
        if (tuple(map(id, [p for group in groups for p in group["params"]])) != self.param_ids
                or tuple(len(group["params"]) for group in groups) != self.group_sizes):
            return None
        if any(p.grad is not None for p in self.params_without_grad):
            return None
        try:
            stored = [state[self.state_key] for state in self.states]
            counts = [state["step"] + 1 for state in self.states]
        except (KeyError, TypeError):
            return None
        if list(map(id, stored)) != self.stored_ids:
            return None
        device, grads, grad_pointers = self.device, [], []
        try:  # one pass, the cheapest checks first; a sparse gradient fails or raises
            for i, (p, shape, address) in enumerate(zip(self.params, self.shapes, self.param_pointers)):
                g = p.grad
                if self.any_sharded and self.sharded[i]:
                    if not _dtensor.is_dtensor(g):
                        return None
                    g, p = g.to_local(), p.to_local()
                if (g is None or g.dtype is not FLOAT32 or not g.is_contiguous() or g.shape != shape
                        or g.get_device() != device or _data_ptr(p) != address or p.dtype is not FLOAT32
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
        grads, grad_pointers, counts = found
        fmt, multi_tensor, count_nonfinite, track_format = self.options
        # Scalars first: a bad step count raises here, before anything changes; the full step
        # then names the parameter.
        try:
            if self.cuda_tables and counts.count(counts[0]) == len(counts):  # one row per group
                scalars = np.asarray([row_scalars(counts[0], row) for row in group_rows], dtype=np.float32)
                rows, tables = self.group_of, self.group_tables
            else:
                scalars, rows = scalar_table(counts, [group_rows[i] for i in self.group_of])
                tables = _launch.launch_tables(self.numels, rows, self.torch_device) if self.cuda_tables else None
        except (TypeError, ValueError):
            return None
        if self.device < 0:
            rejected = cpu_step_(self.kernel_params, grads, self.moments, scalars, rows, fmt, self.counters,
                                 track_format)
        elif not multi_tensor:
            rejected = _launch.cuda_step_(self.kernel_params, grads, self.moments, scalars, rows, fmt, False,
                                          count_nonfinite, self.counters, track_format)
        else:  # CUDA: only the gradients' addresses and the scalars are new
            n, staging = len(counts), self.staging
            pointers = staging.stage(scalars)
            pointers[:n] = self.param_pointer_array
            pointers[n:2 * n] = grad_pointers
            pointers[2 * n:] = self.moment_pointers
            aligned = self.aligned and not (pointers[n:2 * n] & 15).any()
            rejected = _launch.launch_step(staging.send(), self.kernel_params, grads, self.moments, tables, fmt,
                                           count_nonfinite, aligned, self.relaunch, self.counters, track_format)
            staging.launched()
        for state, count in zip(self.states, counts):
            state["step"] = count
        if track_format:
            self.tracked_steps += 1
        return rejected
