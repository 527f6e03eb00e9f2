"""The CUDA path: jax-triton launches of a rule's kernels, over groups of leaves or one leaf.

Imported lazily: `import jax_triton` fails with a CPU-only jaxlib.

Nothing here knows a rule: the launches take the rule's entry points (`kernels`, a
`core.kernel.FunctionalKernels`: AdamW's are core/adamw/kernel.py's `FUNCTIONAL_KERNELS`) and
its state format (`fmt`, whose `rule` declares the scalar row and the format counts).

With `track_format` every launch also returns its counter rows (launch.COUNTER_ROW uint32 per
leaf): a zeroed array passed in and aliased to an output, which the kernel adds to with
atomics. The step sums their slots on the device; nothing waits for the GPU.

bf16 leaves with split masters (docs/FORMAT.md, "Split masters") launch the rule's split
kernel alone (2**24 elements or more, or `multi_tensor=False`) or the leaf-group kernel with
SPLIT, one launch per kind: FP32 leaves, split leaves with float32 gradients, split leaves
with bf16 gradients. A split launch always writes the new weight and low half.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from packed_adamw.core import launch
from packed_adamw.core.kernel import FunctionalKernels
from packed_adamw.core.rule import StateLayout

from . import _leaf_group
from ._leaf_group import COUNTERS_INPUT, COUNTERS_OUTPUT, input_index, output_index


@functools.cache
def _jax_triton():
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    # jax-triton 0.3.1 blanks TRITON_CACHE_DIR on import; later torch-side Triton launches in
    # the same process then fail with "Could not create or locate cache dir": put it back.
    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


def _zeroed_counters(n_leaves: int):
    return jnp.zeros((n_leaves, launch.COUNTER_ROW), jnp.uint32)


def _format_counts(counters, fmt: StateLayout):
    """[leaves, COUNTER_ROW] counter rows -> [leaves, len(count_names)] uint32 counts of the
    rule's format counts (fewer than 2**32 per leaf and launch: `_step.check_countable`)."""
    return launch.sum_counter_slots(counters)[:, :len(fmt.rule.count_names)].astype(jnp.uint32)


def _flat_state(s, fmt: StateLayout):
    return s.reshape(fmt.flat_state_shape(-1))


def step_scalars(hparams, counts, *, fmt: StateLayout, kernels: FunctionalKernels):
    """[rows, hyperparameters] float32 and [rows] int32 counts -> [rows, step scalars] float32
    (the rows of `fmt.rule`)."""
    rows = hparams.shape[0]
    return _jax_triton().triton_call(
        hparams, counts, rows,
        kernel=kernels.step_scalars,
        out_shape=jax.ShapeDtypeStruct((rows, fmt.rule.scalar_row), jnp.float32),
        grid=launch.grid(rows, launch.SCALAR_BLOCK_ROWS),
        BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS,
        **launch.COMPILE_OPTIONS,
    )


def _first_output_alias(write_update: bool, alias_grads: bool, grad, split: bool) -> str | None:
    """Which input the kernel's first output (the update, new parameter or new weight)
    overwrites: "param" in the fused step; "grad" in the transform with `alias_grads` (u then
    needs no buffer of its own where the gradient dies in the step; XLA copies a gradient that
    is still needed, such as an argument of the jitted function, first), for a split leaf only
    where its gradient is bf16 like its new weight; None otherwise. A split leaf's transform
    keeps its weight (it derives u from the old and new ones)."""
    if not write_update:
        return "param"
    if alias_grads and (not split or grad.dtype == jnp.bfloat16):
        return "grad"
    return None


def leaf_step(p, g, s, scalars, *, fmt: StateLayout, kernels: FunctionalKernels, write_update: bool,
              alias_grads: bool = False, track_format: bool = False):
    """Returns (update or new parameter, new state) for one leaf; `scalars` is its row of step
    scalars. With `track_format`, also the leaf's format counts.

    The state buffer is aliased to the new state, and the first output to the input that
    `_first_output_alias` names: each element is read before its own output is written, so
    under jit with donated arguments the kernel works in place.
    """
    n = int(p.size)  # not 0: a grid of zero programs is not a launch
    flat_p, flat_g, flat_s = p.reshape(-1), g.reshape(-1), _flat_state(s, fmt)
    out_shape = [jax.ShapeDtypeStruct(flat_p.shape, jnp.float32), jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype)]
    first = _first_output_alias(write_update, alias_grads, g, split=False)
    aliases = {2: 1, **({} if first is None else {("param", "grad").index(first): 0})}
    if track_format:  # a program takes several blocks, as in torch's counting launches
        constants = launch.single_tensor_constants(fmt, write_update=write_update, count_nonfinite=False,
                                                   block=launch.GPU_BLOCK, track_format=True)
        kernel, counters = kernels.tensor_counting, _zeroed_counters(1)
        num_warps = launch.single_tensor_warps(constants)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[4] = 2  # the counter row: input 4, output 2
    else:
        # single_tensor_constants: BLOCKS_PER_PROGRAM must be passed, since jax-triton fills in
        # no default constexpr (H200: every launch alone failed without it).
        constants = launch.single_tensor_constants(fmt, write_update=write_update, count_nonfinite=False,
                                                   block=launch.GPU_BLOCK)
        # The scalars stand in for the unused counters (COUNT_NONFINITE and TRACK_FORMAT off).
        kernel, counters, num_warps = kernels.tensor, scalars, launch.GPU_NUM_WARPS
    results = _jax_triton().triton_call(
        flat_p, flat_g, flat_s, scalars, counters, n,
        kernel=kernel,
        out_shape=tuple(out_shape),
        grid=launch.single_tensor_grid(n, constants),
        num_warps=num_warps,
        input_output_aliases=aliases,
        **launch.COMPILE_OPTIONS,
        **constants,
    )
    out, new_s = results[0].reshape(p.shape), results[1].reshape(s.shape)
    return (out, new_s, _format_counts(results[2], fmt)[0]) if track_format else (out, new_s)


def split_leaf_step(w, lo, g, s, scalars, *, fmt: StateLayout, kernels: FunctionalKernels, write_update: bool,
                    alias_grads: bool = False, track_format: bool = False):
    """Returns (new weight, new low half, new state) for one bf16 leaf with a split master,
    through the rule's split kernel, and with `track_format` its format counts. The low half
    and state are aliased to their new ones, the weight as `_first_output_alias` says."""
    n = int(w.size)  # not 0: a grid of zero programs is not a launch
    flat_s = _flat_state(s, fmt)
    out_shape = [jax.ShapeDtypeStruct((n,), w.dtype), jax.ShapeDtypeStruct((n,), lo.dtype),
                 jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype)]
    first = _first_output_alias(write_update, alias_grads, g, split=True)
    aliases = {1: 1, 3: 2, **({} if first is None else {("param", "lo", "grad").index(first): 0})}
    constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=False, block=launch.GPU_BLOCK,
                                               split=True, track_format=track_format)
    if track_format:  # a program takes several blocks, as in torch's counting launches
        kernel, counters = kernels.split_tensor_counting, _zeroed_counters(1)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[5] = 3  # the counter row: input 5, output 3
    else:
        # The scalars stand in for the unused counters (COUNT_NONFINITE and TRACK_FORMAT off).
        kernel, counters = kernels.split_tensor, scalars
    results = _jax_triton().triton_call(
        w.reshape(-1), lo.reshape(-1), g.reshape(-1), flat_s, scalars, counters, n,
        kernel=kernel,
        out_shape=tuple(out_shape),
        grid=launch.single_tensor_grid(n, constants),
        num_warps=launch.single_tensor_warps(constants),
        input_output_aliases=aliases,
        **launch.COMPILE_OPTIONS,
        **constants,
    )
    new = (results[0].reshape(w.shape), results[1].reshape(lo.shape), results[2].reshape(s.shape))
    return (*new, _format_counts(results[3], fmt)[0]) if track_format else new


def _placeholder(like):
    """A one-element stand-in of `like`'s dtype for a slot past a launch's leaves (never read)."""
    return jnp.zeros((1,), like.dtype)


def group_step(params, lows, grads, states, rows, scalars, *, fmt: StateLayout, kernels: FunctionalKernels,
               write_update: bool, alias_grads: bool = False, track_format: bool = False):
    """`leaf_step` (or with `lows`, `split_leaf_step`) over up to `_leaf_group.LEAVES_PER_LAUNCH`
    non-empty leaves of one launch kind in one launch of the leaf-group kernel; `rows[i]`
    picks leaf i's row of `scalars`. `lows`: None for FP32 leaves, else the bf16 leaves' low
    halves, their gradients all bf16 or all float32. Returns (outs, new low halves or None, new
    states), and with `track_format` the leaves' format counts ([n, len(count_names)])."""
    n = len(params)
    split = lows is not None
    numels = [int(p.size) for p in params]
    grad_bf16 = grads[0].dtype == jnp.bfloat16
    if split and any((g.dtype == jnp.bfloat16) != grad_bf16 for g in grads):
        raise ValueError("group_step: the gradients of one launch must all be bf16 or all float32")
    flat_states = [_flat_state(s, fmt) for s in states]
    # FP32 leaves have no low halves: their slots get placeholders too (the kernel reads them
    # only with SPLIT).
    lo_placeholder = jnp.zeros((1,), fmt.low_half_dtype)
    flat_lows = [lo.reshape(-1) for lo in lows] if split else [lo_placeholder] * n
    inputs = list(zip([p.reshape(-1) for p in params], flat_lows, [g.reshape(-1) for g in grads], flat_states))
    out_dtype = params[0].dtype if split else jnp.float32  # a split leaf's new weight; else u or p
    outputs = [(jax.ShapeDtypeStruct((m,), out_dtype), jax.ShapeDtypeStruct(lo.shape, lo.dtype),
                jax.ShapeDtypeStruct(s.shape, s.dtype)) for m, lo, s in zip(numels, flat_lows, flat_states)]
    aliases = {}
    for i, g in enumerate(grads):
        aliases[input_index(i, "state")] = output_index(i, "new_state")
        if split:
            aliases[input_index(i, "lo")] = output_index(i, "new_lo")
        first = _first_output_alias(write_update, alias_grads, g, split)
        if first is not None:
            aliases[input_index(i, first)] = output_index(i, "out")
    out_shape = _leaf_group.fill_slots(outputs, tuple(jax.ShapeDtypeStruct((1,), o.dtype) for o in outputs[0]))
    if track_format:  # the counter rows: an input after the table and scalars, the last output
        counters = _zeroed_counters(n)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[COUNTERS_INPUT] = COUNTERS_OUTPUT
    else:  # the scalars stand in for the unused counters, and a placeholder for their output
        counters = scalars
        out_shape.append(jax.ShapeDtypeStruct((1,), jnp.uint32))
    block = launch.GPU_BLOCK
    constants = launch.kernel_constants(fmt, write_update=None, count_nonfinite=False, block=block,
                                        track_format=track_format, split=split)
    results = _jax_triton().triton_call(
        *_leaf_group.fill_slots(inputs, tuple(_placeholder(x) for x in inputs[0])),
        jnp.asarray(_leaf_group.leaf_group_table(numels, rows)), scalars, counters,
        kernel=kernels.leaf_group,
        out_shape=out_shape,
        grid=(launch.grid(max(numels), block)[0], n),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases=aliases,
        **launch.COMPILE_OPTIONS,
        **constants,
        WRITE_UPDATE=bool(write_update and not split),  # a split launch writes the new weight
        GRAD_BF16=bool(split and grad_bf16),
    )
    outs = [results[output_index(i, "out")].reshape(p.shape) for i, p in enumerate(params)]
    new_lows = [results[output_index(i, "new_lo")].reshape(lo.shape) for i, lo in enumerate(lows)] if split else None
    new_states = [results[output_index(i, "new_state")].reshape(s.shape) for i, s in enumerate(states)]
    if track_format:
        return outs, new_lows, new_states, _format_counts(results[COUNTERS_OUTPUT], fmt)
    return outs, new_lows, new_states


def step(params, grads, states, leaf_rows, hparams, count, *, fmt: StateLayout, kernels: FunctionalKernels,
         write_update: bool, multi_tensor: bool, alias_grads: bool = False, track_format: bool = False, lows=None):
    """Every leaf's (out, new state), and the step's format counts ([n_leaves,
    len(count_names)] uint32 with `track_format`, else None): `hparams` holds the rule's row
    variants; `leaf_rows[i]` picks leaf i's. Large leaves launch alone,
    the others in groups of one kind. `lows`: per leaf, the low half of a bf16 leaf with a
    split master (None for a FP32 leaf); with it a fourth result follows, the new low halves
    per leaf, and a split leaf's out is its new weight."""
    given_lows = lows is not None
    lows = list(lows) if given_lows else [None] * len(params)
    scalars = step_scalars(hparams, jnp.broadcast_to(count, hparams.shape[:1]), fmt=fmt, kernels=kernels)
    rows = list(leaf_rows)
    numels = [int(p.size) for p in params]
    # The launch kinds: FP32 leaves; split leaves with float32 gradients; with bf16 gradients.
    kinds = [(lo is not None, lo is not None and g.dtype == jnp.bfloat16) for lo, g in zip(lows, grads)]
    solo, groups = [], []
    for kind in sorted(set(kinds)):
        members = [i for i, k in enumerate(kinds) if k == kind]
        if multi_tensor:
            kind_solo, kind_groups = _leaf_group.leaf_groups([numels[i] for i in members])
            solo += [members[j] for j in kind_solo]
            groups += [[members[j] for j in group] for group in kind_groups]
        else:
            solo += [i for i in members if numels[i]]
    # Empty leaves stay as they are (a split leaf's out is its weight, u is zeros otherwise).
    outs = [p if lo is not None or not write_update else jnp.zeros_like(p) for p, lo in zip(params, lows)]
    new_states, new_lows = list(states), list(lows)
    n_counts = len(fmt.rule.count_names)
    counts = [jnp.zeros(n_counts, jnp.uint32)] * len(params)  # an empty leaf counts nothing
    options = dict(fmt=fmt, kernels=kernels, write_update=write_update, alias_grads=alias_grads,
                   track_format=track_format)
    for i in solo:
        if lows[i] is None:
            results = leaf_step(params[i], grads[i], states[i], scalars[rows[i]], **options)
            outs[i], new_states[i] = results[:2]
        else:
            results = split_leaf_step(params[i], lows[i], grads[i], states[i], scalars[rows[i]], **options)
            outs[i], new_lows[i], new_states[i] = results[:3]
        if track_format:
            counts[i] = results[-1]
    for group in groups:
        pick = lambda xs: [xs[i] for i in group]  # noqa: E731
        group_lows = None if lows[group[0]] is None else pick(lows)
        results = group_step(pick(params), group_lows, pick(grads), pick(states), pick(rows), scalars, **options)
        for k, i in enumerate(group):
            outs[i], new_states[i] = results[0][k], results[2][k]
            if group_lows is not None:
                new_lows[i] = results[1][k]
            if track_format:
                counts[i] = results[3][k]
    if track_format:
        counts = jnp.stack(counts) if counts else jnp.zeros((0, n_counts), jnp.uint32)
    else:
        counts = None
    return (outs, new_states, counts, new_lows) if given_lows else (outs, new_states, counts)
