"""The CUDA path: jax-triton launches of the core kernels, over groups of leaves or one leaf.

Imported lazily: `import jax_triton` fails with a CPU-only jaxlib.

With `track_format` every launch also returns its counter rows (launch.COUNTER_ROW uint32 per
leaf): a zeroed array passed in and aliased to an output, which the kernel adds to with
atomics. The step sums their slots on the device; nothing waits for the GPU.

bf16 leaves with split masters (docs/FORMAT.md, "Split masters") launch core's
`adamw_split_kernel` alone (2**24 elements or more, or `multi_tensor=False`) or the split
leaf-group kernel, one launch per kind: FP32 leaves, split leaves with float32 gradients,
split leaves with bf16 gradients. A split launch always writes the new weight and low half.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.adamw.kernel import adamw_programs as _adamw_programs


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


@triton.jit
def adamw_counting_kernel(
    param_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
    out_ptr, new_state_ptr, new_counters_ptr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr = 1, LAYOUT: tl.constexpr = 0,
):
    """Core's `adamw_kernel` with its counter row as an output as well: jax-triton passes every
    output, aliased ones too, after the inputs, so a launch that returns its counts needs this
    last argument. `counters_ptr` and `new_counters_ptr` name one buffer (aliased); the counts
    are added through the output's."""
    _adamw_programs(
        param_ptr, grad_ptr, state_ptr, param_ptr, scalars_ptr, new_counters_ptr, n_elements,
        out_ptr, new_state_ptr, out_ptr, MODE, WRITE_UPDATE, False, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK, BLOCKS_PER_PROGRAM, LAYOUT,
    )


@triton.jit
def adamw_split_counting_kernel(
    weight_ptr, lo_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
    new_weight_ptr, new_lo_ptr, new_state_ptr, new_counters_ptr,
    MODE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr = 1, LAYOUT: tl.constexpr = 0,
):
    """Core's `adamw_split_kernel` with its counter row as an output as well (as
    `adamw_counting_kernel` for `adamw_kernel`)."""
    _adamw_programs(
        weight_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, new_counters_ptr, n_elements,
        new_weight_ptr, new_state_ptr, new_lo_ptr, MODE, False, True, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK, BLOCKS_PER_PROGRAM, LAYOUT,
    )


def _zeroed_counters(n_leaves: int):
    return jnp.zeros((n_leaves, launch.COUNTER_ROW), jnp.uint32)


def _format_counts(counters):
    """[leaves, COUNTER_ROW] counter rows -> [leaves, len(FORMAT_COUNTS)] uint32 counts (fewer
    than 2**32 per leaf and launch: `_step.check_countable`)."""
    return launch.sum_counter_slots(counters).astype(jnp.uint32)


def step_scalars(hparams, counts):
    """[rows, 5] float32 hyperparameters and [rows] int32 counts -> [rows, 8] step scalars."""
    from packed_adamw.core.adamw.kernel import step_scalars_kernel

    rows = hparams.shape[0]
    return _jax_triton().triton_call(
        hparams, counts, rows,
        kernel=step_scalars_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, 8), jnp.float32),
        grid=launch.grid(rows, launch.SCALAR_BLOCK_ROWS),
        BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS,
        **launch.COMPILE_OPTIONS,
    )


def _first_output_alias(write_update: bool, alias_grads: bool) -> int | None:
    """Which of (param, grad) the kernel's first output overwrites: the parameter in the fused
    step; the gradient in the transform with `alias_grads` (u then needs no buffer of its own
    where the gradient dies in the step; XLA copies a gradient that is still needed, such as
    an argument of the jitted function, first); none otherwise."""
    if not write_update:
        return 0
    return 1 if alias_grads else None


def leaf_step(p, g, s, scalars, *, fmt: StateFormat, write_update: bool, alias_grads: bool = False,
              track_format: bool = False):
    """Returns (update or new parameter, new state) for one leaf; `scalars` is its [8] row.
    With `track_format`, also the leaf's [6] format counts.

    The state buffer is aliased to the new state, and the first output to the input that
    `_first_output_alias` names: each element is read before its own output is written, so
    under jit with donated arguments the kernel works in place.
    """
    from packed_adamw.core.adamw.kernel import adamw_kernel

    n = int(p.size)  # not 0: a grid of zero programs is not a launch
    first = _first_output_alias(write_update, alias_grads)
    flat_p, flat_g = p.reshape(-1), g.reshape(-1)
    flat_s = s.reshape((2, -1) if fmt.mode == "fp32" else (-1,))
    out_shape = [jax.ShapeDtypeStruct(flat_p.shape, jnp.float32), jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype)]
    aliases = {2: 1, **({} if first is None else {first: 0})}
    if track_format:  # a program takes several blocks, as in torch's counting launches
        constants = launch.single_tensor_constants(fmt, write_update=write_update, count_nonfinite=False,
                                                   block=launch.GPU_BLOCK, track_format=True)
        kernel, counters, num_warps = adamw_counting_kernel, _zeroed_counters(1), launch.single_tensor_warps(constants)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[4] = 2  # the counter row: input 4, output 2
    else:
        # single_tensor_constants: BLOCKS_PER_PROGRAM must be passed, since jax-triton fills in
        # no default constexpr (H200: every launch alone failed without it).
        constants = launch.single_tensor_constants(fmt, write_update=write_update, count_nonfinite=False,
                                                   block=launch.GPU_BLOCK)
        # The scalars stand in for the unused counters (COUNT_NONFINITE and TRACK_FORMAT off).
        kernel, counters, num_warps = adamw_kernel, scalars, launch.GPU_NUM_WARPS
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
    return (out, new_s, _format_counts(results[2])[0]) if track_format else (out, new_s)


def _split_weight_alias(write_update: bool, alias_grads: bool, grad) -> int | None:
    """Which of (weight, low half, grad) a split launch's new weight overwrites: the weight in
    the fused step; in the transform (which still needs the old weight for u) a bf16
    gradient's buffer with `alias_grads`; none otherwise."""
    if not write_update:
        return 0
    return 2 if alias_grads and grad.dtype == jnp.bfloat16 else None


def split_leaf_step(w, lo, g, s, scalars, *, fmt: StateFormat, write_update: bool, alias_grads: bool = False,
                    track_format: bool = False):
    """Returns (new weight, new low half, new state) for one bf16 leaf with a split master,
    through core's `adamw_split_kernel`, and with `track_format` its [6] format counts. The
    low half and state are aliased to their new ones, the weight as `_split_weight_alias` says."""
    from packed_adamw.core.adamw.kernel import adamw_split_kernel

    n = int(w.size)  # not 0: a grid of zero programs is not a launch
    flat_s = s.reshape((2, -1) if fmt.mode == "fp32" else (-1,))
    out_shape = [jax.ShapeDtypeStruct((n,), w.dtype), jax.ShapeDtypeStruct((n,), lo.dtype),
                 jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype)]
    first = _split_weight_alias(write_update, alias_grads, g)
    aliases = {1: 1, 3: 2, **({} if first is None else {first: 0})}
    constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=False, block=launch.GPU_BLOCK,
                                               split=True, track_format=track_format)
    if track_format:  # a program takes several blocks, as in torch's counting launches
        kernel, counters = adamw_split_counting_kernel, _zeroed_counters(1)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[5] = 3  # the counter row: input 5, output 3
    else:
        # The scalars stand in for the unused counters (COUNT_NONFINITE and TRACK_FORMAT off).
        kernel, counters = adamw_split_kernel, scalars
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
    return (*new, _format_counts(results[3])[0]) if track_format else new


def split_group_step(weights, lows, grads, states, rows, scalars, *, fmt: StateFormat, write_update: bool,
                     alias_grads: bool = False, track_format: bool = False):
    """`split_leaf_step` over up to `_leaf_group.LEAVES_PER_LAUNCH` non-empty bf16 leaves
    whose gradients share one dtype, in one launch of the split leaf-group kernel. Returns
    (new weights, new low halves, new states), and with `track_format` their [n, 6] counts."""
    from ._leaf_group import leaf_group_kernel, leaf_group_table

    n = len(weights)
    numels = [int(w.size) for w in weights]
    grad_bf16 = grads[0].dtype == jnp.bfloat16
    if any((g.dtype == jnp.bfloat16) != grad_bf16 for g in grads):
        raise ValueError("split_group_step: the gradients of one launch must all be bf16 or all float32")
    inputs, out_shape, aliases = [], [], {}
    for i, (w, lo, g, s) in enumerate(zip(weights, lows, grads, states)):
        flat_s = s.reshape((2, -1) if fmt.mode == "fp32" else (-1,))
        inputs += [w.reshape(-1), lo.reshape(-1), g.reshape(-1), flat_s]
        out_shape += [jax.ShapeDtypeStruct((numels[i],), w.dtype), jax.ShapeDtypeStruct((numels[i],), lo.dtype),
                      jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype)]
        aliases[4 * i + 1], aliases[4 * i + 3] = 3 * i + 1, 3 * i + 2
        first = _split_weight_alias(write_update, alias_grads, g)
        if first is not None:
            aliases[4 * i + first] = 3 * i
    table = jnp.asarray(leaf_group_table(numels, rows))
    block = launch.GPU_BLOCK
    if track_format:  # the counter rows: input 4n + 2 (after the table and scalars), output 3n
        counters = _zeroed_counters(n)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[4 * n + 2] = 3 * n
    else:
        counters = scalars  # stands in for the unused counters
    results = _jax_triton().triton_call(
        *inputs, table, scalars, counters,
        kernel=leaf_group_kernel(n, counting=track_format, split=True),
        out_shape=out_shape,
        grid=(launch.grid(max(numels), block)[0], n),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases=aliases,
        **launch.COMPILE_OPTIONS,
        **launch.kernel_constants(fmt, write_update=False, count_nonfinite=False, block=block,
                                  track_format=track_format, split=True),
        GRAD_BF16=bool(grad_bf16),
    )
    new_weights = [results[3 * i].reshape(w.shape) for i, w in enumerate(weights)]
    new_lows = [results[3 * i + 1].reshape(lo.shape) for i, lo in enumerate(lows)]
    new_states = [results[3 * i + 2].reshape(s.shape) for i, s in enumerate(states)]
    if track_format:
        return new_weights, new_lows, new_states, _format_counts(results[3 * n])
    return new_weights, new_lows, new_states


def group_step(params, grads, states, rows, scalars, *, fmt: StateFormat, write_update: bool,
               alias_grads: bool = False, track_format: bool = False):
    """`leaf_step` over up to `_leaf_group.LEAVES_PER_LAUNCH` non-empty leaves in one launch;
    `rows[i]` picks leaf i's row of `scalars` ([rows, 8]). Returns (outs, new states), and
    with `track_format` the leaves' [n, 6] format counts."""
    from ._leaf_group import leaf_group_kernel, leaf_group_table

    n = len(params)
    numels = [int(p.size) for p in params]
    first = _first_output_alias(write_update, alias_grads)
    inputs, out_shape, aliases = [], [], {}
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        flat_s = s.reshape((2, -1) if fmt.mode == "fp32" else (-1,))
        inputs += [p.reshape(-1), g.reshape(-1), flat_s]
        out_shape += [jax.ShapeDtypeStruct((numels[i],), jnp.float32), jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype)]
        aliases[3 * i + 2] = 2 * i + 1
        if first is not None:
            aliases[3 * i + first] = 2 * i
    table = jnp.asarray(leaf_group_table(numels, rows))
    block = launch.GPU_BLOCK
    if track_format:  # the counter rows: input 3n + 2 (after the table and scalars), output 2n
        counters = _zeroed_counters(n)
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[3 * n + 2] = 2 * n
    else:
        counters = scalars  # stands in for the unused counters (COUNT_NONFINITE and TRACK_FORMAT off)
    results = _jax_triton().triton_call(
        *inputs, table, scalars, counters,
        kernel=leaf_group_kernel(n, counting=track_format),
        out_shape=out_shape,
        grid=(launch.grid(max(numels), block)[0], n),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases=aliases,
        **launch.COMPILE_OPTIONS,
        **launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=False, block=block,
                                  track_format=track_format),
    )
    outs = [results[2 * i].reshape(p.shape) for i, p in enumerate(params)]
    new_states = [results[2 * i + 1].reshape(s.shape) for i, s in enumerate(states)]
    if track_format:
        return outs, new_states, _format_counts(results[2 * n])
    return outs, new_states


def step(params, grads, states, decay, hparams, count, *, fmt: StateFormat, write_update: bool, multi_tensor: bool,
         alias_grads: bool = False, track_format: bool = False, lows=None):
    """Every leaf's (out, new state), and the step's format counts ([n_leaves, 6] uint32 with
    `track_format`, else None): `hparams` holds the row with weight decay, then the row
    without; `decay[i]` picks leaf i's. Large leaves launch alone, the others in groups of one
    kind. `lows`: per leaf, the low half of a bf16 leaf with a split master (None for a FP32
    leaf); with it a fourth result follows, the new low halves per leaf, and a split leaf's
    out is its new weight."""
    given_lows = lows is not None
    lows = list(lows) if given_lows else [None] * len(params)
    scalars = step_scalars(hparams, jnp.stack([count, count]))
    rows = [0 if d else 1 for d in decay]
    numels = [int(p.size) for p in params]
    # The launch kinds: FP32 leaves; split leaves with float32 gradients; with bf16 gradients.
    kinds = [(lo is not None, lo is not None and g.dtype == jnp.bfloat16) for lo, g in zip(lows, grads)]
    solo, groups = [], []
    for kind in sorted(set(kinds)):
        members = [i for i, k in enumerate(kinds) if k == kind]
        if multi_tensor:
            from ._leaf_group import leaf_groups

            kind_solo, kind_groups = leaf_groups([numels[i] for i in members])
            solo += [members[j] for j in kind_solo]
            groups += [[members[j] for j in group] for group in kind_groups]
        else:
            solo += [i for i in members if numels[i]]
    # Empty leaves stay as they are (a split leaf's out is its weight, u is zeros otherwise).
    outs = [p if lo is not None or not write_update else jnp.zeros_like(p) for p, lo in zip(params, lows)]
    new_states, new_lows = list(states), list(lows)
    counts = [jnp.zeros(len(launch.FORMAT_COUNTS), jnp.uint32)] * len(params)  # an empty leaf counts nothing
    for i in solo:
        if lows[i] is None:
            results = leaf_step(params[i], grads[i], states[i], scalars[rows[i]], fmt=fmt, write_update=write_update,
                                alias_grads=alias_grads, track_format=track_format)
            outs[i], new_states[i] = results[:2]
        else:
            results = split_leaf_step(params[i], lows[i], grads[i], states[i], scalars[rows[i]], fmt=fmt,
                                      write_update=write_update, alias_grads=alias_grads, track_format=track_format)
            outs[i], new_lows[i], new_states[i] = results[:3]
        if track_format:
            counts[i] = results[-1]
    for group in groups:
        pick = lambda xs: [xs[i] for i in group]  # noqa: E731
        if lows[group[0]] is None:
            results = group_step(pick(params), pick(grads), pick(states), pick(rows), scalars, fmt=fmt,
                                 write_update=write_update, alias_grads=alias_grads, track_format=track_format)
            for k, i in enumerate(group):
                outs[i], new_states[i] = results[0][k], results[1][k]
        else:
            results = split_group_step(pick(params), pick(lows), pick(grads), pick(states), pick(rows), scalars,
                                       fmt=fmt, write_update=write_update, alias_grads=alias_grads,
                                       track_format=track_format)
            for k, i in enumerate(group):
                outs[i], new_lows[i], new_states[i] = results[0][k], results[1][k], results[2][k]
        if track_format:
            for k, i in enumerate(group):
                counts[i] = results[-1][k]
    if track_format:
        counts = jnp.stack(counts) if counts else jnp.zeros((0, len(launch.FORMAT_COUNTS)), jnp.uint32)
    else:
        counts = None
    return (outs, new_states, counts, new_lows) if given_lows else (outs, new_states, counts)
