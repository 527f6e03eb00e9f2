"""Muon's step over the matrices `muon.check_step` checked: `Matrix` (one matrix's local tensors),
the CPU phases (core/muon's numpy phases around Newton-Schulz, `cpu_step`), the whole-matrix
Newton-Schulz of DTensor (FSDP2) parameters, and the format counts a step hands to `_engine`.
The CUDA launches (`_muon_kernels.py`) take the same matrices."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.core import launch
from packed_adamw.core.muon import (
    FORMAT_COUNTS,
    commit_momentum,
    momentum_update,
    ortho_finite,
    step_scalar_row,
    weight_phase,
    weight_phase_split,
)

from . import _dtensor, _engine, _muon_ns

FLOAT32, BFLOAT16 = torch.float32, torch.bfloat16
NAN_BF16_BITS = 0x7FC0  # a shard that refuses its part of X sends these (see `_gathered_input`)


class Matrix(NamedTuple):
    """One matrix of a step, with the local tensors its phases read and write (a DTensor
    parameter's local shards; a plain one's tensors themselves)."""
    param: torch.Tensor  # as the optimizer holds it: its shape is the whole matrix's
    grad: torch.Tensor
    group: dict
    row: tuple
    name: str
    weights: torch.Tensor
    momentum: torch.Tensor
    low: torch.Tensor | None  # a bf16 parameter's int16 low half
    exponent: torch.Tensor | None  # packed mode's 0-d int32 exponent

    @property
    def sharded(self) -> bool:
        return _dtensor.is_dtensor(self.param)


def _numpy16(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(torch.int16).numpy()


def _scalar_row(w: Matrix) -> tuple:
    return step_scalar_row(w.row, tuple(w.param.shape), adjust_lr_fn=w.group["adjust_lr_fn"])


# ---- DTensor parameters: Newton-Schulz on the whole matrix ----------------------------------
# Each rank runs the elementwise phases on its shards; the Newton-Schulz input X is gathered
# whole (DTensor.full_tensor), every rank orthogonalises the same bits, and each keeps its part of
# the result for its weight phase. A matrix is refused on every rank or on none: a rank that
# refuses its part sends NaNs in place of X, so all of them see a non-finite X.
def _gathered_input(param: torch.Tensor, local_x: torch.Tensor) -> torch.Tensor:
    """The whole X (bf16 bits as int16, the matrix's shape) from every rank's part `local_x`."""
    pairs = _dtensor.wrap_low_half(param, local_x.contiguous())  # int8 pairs: the collectives carry no int16
    return pairs.full_tensor().view(torch.int16).squeeze(-1)


def _local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole matrix laid out as `param`'s local shard (a local
    redistribution from Replicate: no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local().contiguous()


def cpu_step(opt, work: list[Matrix]) -> tuple[list[bool], list[int]]:
    fmt = opt.state_format
    refused, rejected = [False] * len(work), [0] * len(work)
    # With track_format, each matrix's format counts (added only where it is accepted).
    counts = np.zeros((len(work), launch.MAX_FORMAT_COUNTS), np.int64) if opt.track_format else None
    for batch in _muon_ns._ns_batches(opt, work):
        updates, inputs, scalar_rows = {}, {}, {}
        for i in batch:
            w = work[i]
            scalar_rows[i] = _scalar_row(w)
            grad = w.grad.detach().numpy() if w.grad.dtype is FLOAT32 else _numpy16(w.grad)
            update = momentum_update(grad, w.momentum.numpy(), scalar_rows[i], fmt=fmt,
                                     exponent=None if w.exponent is None else w.exponent.numpy(),
                                     nesterov=w.group["nesterov"], maximize=bool(w.group.get("maximize", False)))
            x = None if update is None else torch.from_numpy(update.ns_bits.view(np.int16))
            if w.sharded:
                x = _gathered_input(w.param, torch.full(w.weights.shape, NAN_BF16_BITS, dtype=torch.int16)
                                    if x is None else x)
                if not bool(torch.isfinite(x.view(BFLOAT16)).all()):
                    x = None
            if x is None:
                refused[i] = True
            else:
                updates[i], inputs[i] = update, x.view(BFLOAT16)
        # A sharded matrix's exponent from its largest |m'| over every shard: one collective for the
        # batch's, before Newton-Schulz (every rank passes the same matrices).
        sharded = [i for i in batch if work[i].sharded] if fmt.exponent_entry else []
        whole_amax = _amax_over_shards([work[i] for i in sharded], [
            torch.tensor(updates[i].amax if i in updates else 0.0) for i in sharded])
        if not inputs:
            continue
        for i, result in zip(inputs, _muon_ns._ns(opt, list(inputs.values()), work[batch[0]].group)):
            w = work[i]
            # The whole O (every rank's, for a sharded matrix: the same) must be finite: one that is
            # not refuses the matrix, and only then are its momentum and exponent stored.
            whole = _numpy16(result.contiguous())
            if not ortho_finite(whole):
                refused[i] = True
                continue
            commit_momentum(updates[i], w.momentum.numpy(), fmt=fmt,
                            exponent=None if w.exponent is None else w.exponent.numpy(),
                            amax=whole_amax.get(id(w.param)),
                            format_counts_out=None if counts is None else counts[i, :len(FORMAT_COUNTS)])
            ortho = _numpy16(_local_part(w.param, result)) if w.sharded else whole
            if w.low is not None:
                rejected[i] = weight_phase_split(_numpy16(w.weights), w.low.numpy(), ortho, scalar_rows[i])
            else:
                rejected[i] = weight_phase(w.weights.detach().numpy(), ortho, scalar_rows[i])
            if w.sharded and opt.check_nonfinite:
                rejected[i] = int(_dtensor.summed_over_shards(w.param, torch.tensor(rejected[i])))
    if counts is not None:
        _track(opt, work, torch.from_numpy(counts), torch.tensor([not r for r in refused]))
    return refused, rejected


def _amax_over_shards(matrices: list[Matrix], values: list[torch.Tensor]) -> dict:
    """id(param) -> the largest |m'| over every rank's part, of the sharded matrices among
    `matrices` (`values`: this rank's, 0-d, in their order): one all-reduce (MAX) per mesh, on
    the values' device, with no wait. Every rank passes the same matrices, refused ones too."""
    if not any(w.sharded for w in matrices):
        return {}
    from torch.distributed.tensor import DTensor, Partial

    by_mesh: dict[int, tuple] = {}
    for w, value in zip(matrices, values):
        if w.sharded:
            by_mesh.setdefault(id(w.param.device_mesh), (w.param.device_mesh, []))[1].append((w, value))
    whole = {}
    for mesh, members in by_mesh.values():
        local = torch.stack([value for _, value in members])
        reduced = DTensor.from_local(local, mesh, [Partial("max")] * mesh.ndim, run_check=False).full_tensor()
        whole.update((id(w.param), reduced[j]) for j, (w, _) in enumerate(members))
    return whole


def _track(opt, work: list[Matrix], counts: torch.Tensor, accepted: torch.Tensor) -> None:
    """A step's counts for `format_stats` (`track_format`): per matrix its format counts ([n,
    MAX_FORMAT_COUNTS], kept only where it was accepted) and whether it was (refused on every
    rank or none, for a DTensor), on the device, without a wait."""
    _engine.add_pending_counts(opt, [w.param for w in work], [w.weights.numel() for w in work], counts, accepted)


def _counting(opt) -> bool:
    """Whether this step launches the counting twins of the momentum kernels: `track_format`
    in packed mode (the other modes have no codes to count, only refusals)."""
    return opt.track_format and opt.state_format.mode == "packed"
