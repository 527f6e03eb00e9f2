"""Muon's capturable step (`capturable=True`, docs/MUON.md "Capturable steps (CUDA graphs)"):
the step-scalar rows derived on the device from each group's lr tensor, and the device tensors
a step reuses, so that a step makes no host synchronisation and copies no changing value from
the host: `torch.cuda.graph` can capture it, and its replays follow the lr tensors.

The host derives a row in binary64 and rounds each scalar once to float32
(`core.muon.step_scalar_row`); the device does the same in one launch of core's
`muon_capturable_scalars_kernel` (binary64, nothing fused into a multiply-add, rounded to
nearest even as numpy does): the rows have the host's bits. What does not
follow lr (1 - momentum, momentum, the weight decay, each shape's lr ratio, the matrices' groups)
is a constant of the plan, made by an eager step and never written again: a capture reads those
tensors at every replay, so a plan that no longer holds is replaced by a new one, never updated,
and every capture keeps the plan and the tensors it read (`_capture.keep`); the batched kernels'
address table follows `_capture.AddressTable`. A step under capture whose plan is missing or out
of date is refused: an eager step makes it.

An invalid lr (NaN, Inf or negative, or lr * weight_decay past float32's range: the host's
checks) cannot raise on the device: each matrix of its group is refused whole for that step
(weights and momentum kept), as a matrix with a non-finite gradient is.
"""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core import launch
from packed_adamw.core.muon import adjusted_lr

from . import _capture

FLOAT64 = torch.float64


class DevicePlan:
    """The tensors a capturable Muon step reuses for one list of matrices: each matrix's group
    index and its float64 momentum, weight decay and lr ratio; with
    `batch_ns`, the batched kernels' address table (`_capture.AddressTable`). Its constants are never
    written once made."""

    def __init__(self, key: tuple, group_of: list[int], fixed_rows: list[tuple], device: torch.device,
                 name: str = "PackedMuon"):
        self.key, self.name = key, name  # name: the optimizer's, in refusals
        self.group_index = torch.tensor(group_of, dtype=torch.int64).to(device)
        self.momentum = torch.tensor([momentum for momentum, _, _ in fixed_rows], dtype=FLOAT64).to(device)
        self.weight_decay = torch.tensor([wd for _, wd, _ in fixed_rows], dtype=FLOAT64).to(device)
        # The host's finite-product check reads weight decay as float32 (validate_hyperparams).
        self.weight_decay32 = torch.tensor([float(np.float32(wd)) for _, wd, _ in fixed_rows], dtype=FLOAT64).to(device)
        self.lr_ratio = torch.tensor([ratio for _, _, ratio in fixed_rows], dtype=FLOAT64).to(device)
        self.addresses: _capture.AddressTable | None = None  # the batched kernels' table, made by an eager step

    def scalars_and_counters(self, groups: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's [n, 4] float32 scalar rows (SCALAR_FIELDS order) and [n, MATRIX_COUNTERS]
        int32 counters (core/muon/kernel.py's COUNTER_COLUMNS: refused elements first), zeroed, a
        matrix whose group's lr is invalid counted refused: each group's lr copied into a float64 vector,
        then core's `muon_capturable_scalars_kernel`."""
        from packed_adamw.core.muon.kernel import MATRIX_COUNTERS, muon_capturable_scalars_kernel

        device = self.group_index.device
        # Each group's lr as float64 (exact: every floating dtype widens), in a tensor of this step's
        # own (a capture's from its graph's pool), so no graph shares it with another step.
        lr64 = torch.empty(len(groups), dtype=FLOAT64, device=device)
        for g, group in enumerate(groups):
            lr64[g].copy_(group["lr"].reshape(()))
        n = len(self.lr_ratio)
        scalars = torch.empty((n, 4), dtype=torch.float32, device=device)
        counters = torch.empty((n, MATRIX_COUNTERS), dtype=torch.int32, device=device)
        muon_capturable_scalars_kernel[launch.grid(n, launch.SCALAR_BLOCK_ROWS)](
            lr64, self.group_index, self.momentum, self.weight_decay, self.weight_decay32, self.lr_ratio,
            n, scalars, counters, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **launch.COMPILE_OPTIONS)
        return scalars, counters

    def batch_table(self, words: list[int], capturing: bool) -> tuple[torch.Tensor, tuple]:
        """The batched step's address table on the device, and what a capture must keep
        (`_capture.AddressTable`)."""
        words = tuple(words)
        if capturing:
            self.check_batches(words)
            return self.addresses.captured(words)
        if self.addresses is None or self.addresses.length != len(words):  # a capture keeps the old one
            self.addresses = _capture.AddressTable(len(words), self.group_index.device, self.name)
        table = self.addresses.eager(words)
        return table, (table,)

    def check_batches(self, words) -> None:
        """Under capture, before anything is captured: an eager step made a table for batches of
        these words, and it holds them or a spare is left."""
        if self.addresses is None or self.addresses.length != len(words):
            raise RuntimeError(_capture.refusal(self.name, "the matrices' batches changed"))
        self.addresses.check_capture(words)


def check_host_values(group: dict, where: str) -> None:
    """Only lr is read on the device: momentum, weight_decay and eps must be numbers, read on
    the host once a plan is made (a tensor there would be read on the host at every step, a
    synchronisation a capture cannot make)."""
    for key in ("momentum", "weight_decay", "eps"):
        if isinstance(group.get(key), torch.Tensor):
            raise ValueError(f"{where}[{key!r}] is a tensor: capturable=True reads only lr on the device; pass "
                             f"{key} as a Python number (a change takes effect at the next eager step, and a "
                             "capture must follow one)")


def check_lr(group: dict, where: str, device: torch.device) -> None:
    """A capturable group's lr: a one-element floating tensor on the parameters' device."""
    lr = group.get("lr")
    if not (isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point()):
        raise ValueError(f"{where}['lr'] is {lr!r}: capturable=True needs each group's lr as a one-element "
                         "floating tensor on the parameters' device, which a captured step reads at every replay "
                         "(LR schedulers update it in place): lr=torch.tensor(0.02, device='cuda')")
    if lr.device != device:
        raise ValueError(f"{where}['lr'] is on {lr.device}, the matrices on {device}: capturable=True reads the lr "
                         "on the parameters' device; move it there")


def device_plan(opt, work: list, capturing: bool) -> DevicePlan:
    """The optimizer's plan for these matrices (`work`: muon.Matrix), made anew when what it
    holds changed; refused under capture then."""
    index_of = {id(g): i for i, g in enumerate(opt.param_groups)}
    group_of = [index_of[id(w.group)] for w in work]
    fixed_rows = [(float(w.row[1]), float(w.row[2]), adjusted_lr(1.0, tuple(w.param.shape), w.group["adjust_lr_fn"]))
                  for w in work]
    device = work[0].weights.device
    # The lr tensors by identity and memory: a capture reads them where they were, so one
    # replaced since the plan was made (load_state_dict copies the groups) needs a new plan.
    lrs = tuple((id(g["lr"]), g["lr"].data_ptr()) for g in opt.param_groups)
    key = (tuple(id(w.param) for w in work), tuple(group_of), tuple(fixed_rows), lrs, device)
    plan = opt.__dict__.get("_muon_device_plan")
    if plan is None or plan.key != key:
        if capturing:
            raise RuntimeError(_capture.refusal(opt.optimizer_name, "the matrices, their groups, their momentum or "
                                                "weight decay, or an lr tensor changed"))
        plan = opt._muon_device_plan = DevicePlan(key, group_of, fixed_rows, device, opt.optimizer_name)
    return plan
