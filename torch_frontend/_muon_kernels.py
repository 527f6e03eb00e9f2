"""PackedMuon's step on CUDA: the launches of core/muon/kernel.py's phases around Newton-Schulz,
per matrix (`cuda_step`) or per batch of one shape (`_cuda_step_batched`), and what a capturable
step reads on the device. The step's choices (which Newton-Schulz, which batches) are
`_muon_ns.py`'s and the matrices and their scalar rows `_muon_step.py`'s, read through those
modules so that one place decides each."""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core import launch
from packed_adamw.core.muon import step_scalar_row

from . import _capture, _checks, _dtensor, _muon_capturable, _muon_ns, _muon_step
from ._state import format_counts, new_counters

BFLOAT16 = torch.bfloat16


def cuda_step(opt, work: list[_muon_step.Matrix]) -> tuple[list[bool], list[int]]:
    """One momentum launch and one weight launch per matrix (core/muon/kernel.py), with
    Newton-Schulz per matrix between them; with `batch_ns`, `_cuda_step_batched` (for plain
    parameters: DTensor ones take this path, gathering each X). Nothing waits for the GPU
    unless `check_nonfinite` asks."""
    if _muon_ns._batches_ns(opt, work[0].weights.device) and not any(w.sharded for w in work):
        return _cuda_step_batched(opt, work)
    from packed_adamw.core.muon.kernel import (COUNTER_COLUMNS, MATRIX_COUNTERS, muon_momentum_kernel,
                                               muon_weight_counting_kernel, muon_weight_kernel)

    fmt = opt.state_format
    constants = fmt.kernel_constexprs(track_format=False)
    device = work[0].weights.device
    block = launch.block_size()
    if opt.capturable:
        scalar_rows, counters, _ = _capturable_rows(opt, work)
    else:
        counters = torch.zeros((len(work), MATRIX_COUNTERS), dtype=torch.int32, device=device)  # kernel.COUNTER_COLUMNS
        scalar_rows = torch.tensor(np.array([_muon_step._scalar_row(w) for w in work], np.float32).reshape(len(work), 4),
                                   device=device)
    # Each matrix's views made in two calls, not by indexing per launch (host time is the cost here).
    rows, counter_rows = scalar_rows.unbind(0), counters.unbind(0)
    # With track_format (packed mode) the weight phase's counting twin adds each accepted matrix's
    # format counts to its row here; the default path launches the uncounted kernel as before.
    format_rows = new_counters(len(work), device) if _muon_step._counting(opt) else None
    weight_kernel = muon_weight_kernel if format_rows is None else muon_weight_counting_kernel
    for batch in _muon_ns._ns_batches(opt, work):
        inputs = {}
        for i in batch:
            w = work[i]
            n = w.weights.numel()
            x = torch.empty(w.weights.shape, dtype=torch.int16, device=device)
            grad_bf16 = w.grad.dtype is BFLOAT16
            # A DTensor's empty local shard launches one program too, which touches no element: each
            # rank keeps its copy of the matrix's exponent.
            muon_momentum_kernel[launch.grid(max(n, 1), block)](
                w.grad.view(torch.int16) if grad_bf16 else w.grad, w.momentum, _exponent_pointer(w, counter_rows[i]),
                x, rows[i], counter_rows[i], n, **constants, NESTEROV=bool(w.group["nesterov"]),
                MAXIMIZE=bool(w.group.get("maximize", False)), GRAD_BF16=grad_bf16, BLOCK=block,
                **launch.COMPILE_OPTIONS)
            if w.sharded:
                # On the device, without a wait: a refusing rank sends NaNs, and every rank's
                # refused count becomes the whole X's non-finite count, which the weight kernel reads.
                x = _muon_step._gathered_input(w.param, torch.where(counter_rows[i][0] > 0, _muon_step.NAN_BF16_BITS, x))
                counter_rows[i][0].copy_((~torch.isfinite(x.view(BFLOAT16))).sum())
            inputs[i] = x.view(BFLOAT16)
        if fmt.exponent_entry is not None:  # a sharded matrix's exponent from its largest |m'| over every shard
            amax = COUNTER_COLUMNS.index("amax_bits")
            sharded = [i for i in batch if work[i].sharded]
            whole = _muon_step._amax_over_shards([work[i] for i in sharded], [counter_rows[i][amax] for i in sharded])
            for i in sharded:
                counter_rows[i][amax].copy_(whole[id(work[i].param)])
        # A refused matrix's X may hold anything: Newton-Schulz runs anyway (no host wait); its
        # output is not used, and a batch's matrices do not mix.
        for i, result in zip(batch, _muon_ns._ns(opt, list(inputs.values()), work[batch[0]].group)):
            w = work[i]
            n = w.weights.numel()
            # An O that is not finite refuses the matrix (the whole O: every rank's, for a sharded one).
            _refuse_nonfinite_output(result, counter_rows[i])
            ortho = (_muon_step._local_part(w.param, result) if w.sharded else result.contiguous()).view(torch.int16)
            split = w.low is not None
            weights = w.weights.detach().view(torch.int16) if split else w.weights.detach()
            grad_bf16 = w.grad.dtype is BFLOAT16
            counted = () if format_rows is None else (format_rows[i],)
            weight_kernel[launch.grid(max(n, 1), block)](
                weights, w.low if split else weights, ortho, w.grad.view(torch.int16) if grad_bf16 else w.grad,
                w.momentum, _exponent_pointer(w, counter_rows[i]), rows[i], counter_rows[i], *counted, n,
                **constants, MAXIMIZE=bool(w.group.get("maximize", False)), GRAD_BF16=grad_bf16, SPLIT=split,
                BLOCK=block, **launch.COMPILE_OPTIONS)
            if w.sharded and opt.check_nonfinite:
                rejected = COUNTER_COLUMNS.index("rejected")
                counter_rows[i][rejected].copy_(_dtensor.summed_over_shards(w.param, counter_rows[i][rejected]))
    _track_launches(opt, work, counters, format_rows)
    return _counted(opt, counters)


def _exponent_pointer(w: _muon_step.Matrix, placeholder: torch.Tensor) -> torch.Tensor:
    """The kernels' exponent argument: packed mode's 0-d exponent; in the other modes a tensor
    of the launch's that the kernels never read there."""
    return placeholder if w.exponent is None else w.exponent


def _track_launches(opt, work: list[_muon_step.Matrix], counters: torch.Tensor, format_rows: torch.Tensor | None) -> None:
    """`_muon_step._track` after the kernels' step: a matrix was accepted where its refused count is 0;
    its format counts are in `format_rows` (None: nothing counted but refusals)."""
    if not opt.track_format:
        return
    counts = format_counts(format_rows) if format_rows is not None else \
        torch.zeros((len(work), launch.MAX_FORMAT_COUNTS), dtype=torch.int64, device=counters.device)
    _muon_step._track(opt, work, counts, counters[:, 0] == 0)


def capture_inputs(opt, work: list[_muon_step.Matrix], words: list[int] | None, *, capturing: bool, dry_run: bool = False):
    """What a capturable step reads on the device besides its scalar rows: the plan, the
    batched address table (with `words`), the Triton Newton-Schulz's scalar rows. Under capture
    each must have been made by an eager step (refused otherwise); `dry_run` only checks."""
    plan = _muon_capturable.device_plan(opt, work, capturing)
    kept = []
    if _muon_ns._ns_impl(opt, work[0].weights.device) == "triton":  # its scalar rows, made outside any capture
        for w in work:
            kept.append(_muon_ns._ns_scalars(w.group["ns_coefficients"], w.group["eps"], w.weights.device,
                                             opt.optimizer_name if capturing else None))
    if words is None:
        return plan, None, kept
    if dry_run:  # the table a capture would take exists (_capture.AddressTable)
        plan.check_batches(words)
        return plan, None, kept
    table, table_kept = plan.batch_table(words, capturing)
    return plan, table, kept + list(table_kept)


def _capturable_rows(opt, work: list[_muon_step.Matrix], words: list[int] | None = None):
    """(scalar rows, counters) derived on the device, and with `words` the batched address
    table too (`_muon_capturable`); under capture, what the graph reads is kept alive."""
    capturing = _checks.capturing()
    plan, table, kept = capture_inputs(opt, work, words, capturing=capturing)
    scalars, counters = plan.scalars_and_counters(opt.param_groups)
    if capturing:  # the state and lrs too, by their memory: a state loaded later or `.data` swapped frees none
        tensors = [t for w in work for t in (w.weights, w.momentum, w.low, w.exponent) if t is not None]
        tensors += [group["lr"] for group in opt.param_groups]
        _capture.keep(opt, plan, *kept, *map(_capture.storage, tensors))
    return scalars, counters, table


def _counted(opt, counters: torch.Tensor) -> tuple[list[bool], list[int]]:
    """Per matrix: refused, and how many weights were rejected (read only if `check_nonfinite`)."""
    if not opt.check_nonfinite:
        return [False] * len(counters), [0] * len(counters)
    host = counters[:, :2].cpu().tolist()  # refused elements, rejected weights
    return [r > 0 for r, _ in host], [n for _, n in host]


def batch_tables(opt, work: list[_muon_step.Matrix]) -> tuple[list[int], list[tuple]]:
    """The batched step's table words (every matrix's addresses, index and slot) and, per
    Newton-Schulz batch, (matrix indices, rows, cols, group, momentum launches, weight
    launches), each launch {kernel constants: (first table row's word, matrices)}, the tall
    matrices' launches apart from the wide ones' (TALL, their tiles transposed). A matrix
    without an exponent (bf16 and fp32 modes) has its momentum's address in that column, unread."""
    words, plans = [], []
    for batch in _muon_ns._ns_batches(opt, work):
        batch = [i for i in batch if _tall(work[i].param)] + [i for i in batch if not _tall(work[i].param)]
        rows, cols = sorted(work[batch[0]].param.shape)
        momentum_rows, weight_rows = {}, {}
        for slot, i in enumerate(batch):
            w = work[i]
            tall = _tall(w.param)
            maximize, grad_bf16 = bool(w.group.get("maximize", False)), w.grad.dtype is BFLOAT16
            exponent = (w.momentum if w.exponent is None else w.exponent).data_ptr()
            # The table rows' words, in the order core/muon/kernel.py's *_TABLE_COLUMNS name them.
            momentum_rows.setdefault((bool(w.group["nesterov"]), maximize, grad_bf16, tall), []).append(
                (w.grad.data_ptr(), w.momentum.data_ptr(), exponent, i, slot))
            split = w.low is not None
            low = w.low if split else w.weights
            weight_rows.setdefault((maximize, grad_bf16, split, tall), []).append(
                (w.weights.data_ptr(), low.data_ptr(), w.grad.data_ptr(), w.momentum.data_ptr(), exponent, i, slot))
        launches = []
        for table_rows in (momentum_rows, weight_rows):
            offsets = {}
            for constants, members in table_rows.items():
                offsets[constants] = (len(words), len(members))
                words.extend(word for member in members for word in member)
            launches.append(offsets)
        plans.append((batch, rows, cols, work[batch[0]].group, *launches))
    return words, plans


def _cuda_step_batched(opt, work: list[_muon_step.Matrix]) -> tuple[list[bool], list[int]]:
    """The CUDA step with `batch_ns`: per Newton-Schulz batch one momentum launch, which writes
    each matrix's X into its slot of one [B, m, n] buffer (a tall matrix transposed, as
    `newton_schulz_batched` stacks it: the tall first), Newton-Schulz on that buffer, and one
    weight launch reading each matrix's slot of the result (core/muon/kernel.py's table kernels;
    a batch whose matrices differ in a kernel constant, such as bf16 and float32 gradients,
    takes one launch per constant). Every matrix's addresses and the step's scalar rows reach
    the GPU in one copy. A matrix's counters row refuses it alone, as per matrix."""
    from packed_adamw.core.muon.kernel import (MATRIX_COUNTERS, matrix_programs, muon_momentum_table_kernel,
                                               muon_weight_table_counting_kernel, muon_weight_table_kernel, tall_tile)

    fmt = opt.state_format
    device = work[0].weights.device
    words, plans = batch_tables(opt, work)
    if opt.capturable:
        scalars, counters, table = _capturable_rows(opt, work, words)
    else:
        # A model's matrices share a few (row, shape, adjustment)s: each scalar row is computed once.
        row_keys = [(w.row, tuple(w.param.shape), w.group["adjust_lr_fn"]) for w in work]
        distinct = {k: step_scalar_row(k[0], k[1], adjust_lr_fn=k[2]) for k in dict.fromkeys(row_keys)}
        scalar_rows = np.array([distinct[k] for k in row_keys], np.float32).reshape(len(work), 4)
        staged = torch.empty(len(words) + scalar_rows.size // 2, dtype=torch.int64, pin_memory=device.type == "cuda")
        host = staged.numpy()
        host[:len(words)] = words
        host[len(words):].view(np.float32)[:] = scalar_rows.reshape(-1)
        table = staged.to(device, non_blocking=True)
        scalars = table[len(words):].view(torch.float32)
        counters = torch.zeros((len(work), MATRIX_COUNTERS), dtype=torch.int32, device=device)  # kernel.COUNTER_COLUMNS
    constants = fmt.kernel_constexprs(track_format=False)
    block, tile = launch.block_size(), tall_tile()
    # Two warps: eight elements a thread, one 16-byte vector of each bf16 buffer (JAX's launches too).
    warps = launch.GPU_NUM_WARPS
    format_rows = new_counters(len(work), device) if _muon_step._counting(opt) else None  # as in `_cuda_step`
    weight_kernel, counted = ((muon_weight_table_kernel, ()) if format_rows is None else
                              (muon_weight_table_counting_kernel, (format_rows,)))
    for batch, rows, cols, group, momentum_launches, weight_launches in plans:
        x = torch.empty((len(batch), rows, cols), dtype=torch.int16, device=device)
        for (nesterov, maximize, grad_bf16, tall), (offset, count) in momentum_launches.items():
            muon_momentum_table_kernel[(matrix_programs(rows, cols, tall, block, tile), count)](
                table[offset:], x, scalars, counters, rows, cols, **constants, NESTEROV=nesterov, MAXIMIZE=maximize,
                GRAD_BF16=grad_bf16, TALL=tall, BLOCK=block, TILE=tile, num_warps=warps, **launch.COMPILE_OPTIONS)
        # A refused matrix's X may hold anything: Newton-Schulz runs anyway (no host wait); its
        # output is not used, and a batch's matrices do not mix.
        ortho = _muon_ns._stacked_ns(_muon_ns._ns_impl(opt, x.device))(x.view(BFLOAT16), tuple(group["ns_coefficients"]),
                                                     int(group["ns_steps"]), float(group["eps"]))
        _refuse_nonfinite_outputs(ortho, table, momentum_launches, counters)
        ortho = ortho.view(torch.int16)
        for (maximize, grad_bf16, split, tall), (offset, count) in weight_launches.items():
            weight_kernel[(matrix_programs(rows, cols, tall, block, tile), count)](
                table[offset:], ortho, scalars, counters, *counted, rows, cols, **constants, MAXIMIZE=maximize,
                GRAD_BF16=grad_bf16, SPLIT=split, TALL=tall, BLOCK=block, TILE=tile, num_warps=warps,
                **launch.COMPILE_OPTIONS)
    _track_launches(opt, work, counters, format_rows)
    return _counted(opt, counters)


def _refuse_nonfinite_outputs(ortho: torch.Tensor, table: torch.Tensor, momentum_launches: dict,
                              counters: torch.Tensor) -> None:
    """Refuses each matrix of a batch whose slot of `ortho` ([B, rows, cols], bf16) is not finite,
    before the weight launch reads it (core/muon/kernel.py's `muon_refuse_nonfinite_table_kernel`,
    one launch per momentum launch, its rows of the device table: nothing waits and a capture
    replays it). One read of O; elementwise torch ops here cost 0.55 ms of a 5.65 ms d12 step."""
    from packed_adamw.core.muon.kernel import muon_refuse_nonfinite_table_kernel, refuse_block

    _, rows, cols = ortho.shape
    block = refuse_block()
    for offset, count in momentum_launches.values():
        muon_refuse_nonfinite_table_kernel[(launch.grid(rows * cols, block)[0], count)](
            table[offset:], ortho.view(torch.int16), counters, rows, cols, BLOCK=block)


def _refuse_nonfinite_output(result: torch.Tensor, counter_row: torch.Tensor) -> None:
    """`_refuse_nonfinite_outputs` for one matrix's Newton-Schulz output (any orientation)."""
    from packed_adamw.core.muon.kernel import muon_refuse_nonfinite_kernel, refuse_block

    dense = result if result.is_contiguous() else result.mT if result.mT.is_contiguous() else result.contiguous()
    block = refuse_block()
    muon_refuse_nonfinite_kernel[launch.grid(max(dense.numel(), 1), block)](
        dense.view(torch.int16), counter_row, dense.numel(), BLOCK=block)


def _tall(p: torch.Tensor) -> bool:
    return p.size(0) > p.size(1)
