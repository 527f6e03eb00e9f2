"""The CUDA path: jax-triton launches of the core kernels, over groups of leaves or one leaf.

Imported lazily: `import jax_triton` fails with a CPU-only jaxlib.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from packed_adamw.core import StateFormat, launch


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


def step_scalars(hparams, counts):
    """[rows, 5] float32 hyperparameters and [rows] int32 counts -> [rows, 8] step scalars."""
    from packed_adamw.core.kernel import step_scalars_kernel

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


def leaf_step(p, g, s, scalars, *, fmt: StateFormat, write_update: bool, alias_grads: bool = False):
    """Returns (update or new parameter, new state) for one leaf; `scalars` is its [8] row.

    The state buffer is aliased to the new state, and the first output to the input that
    `_first_output_alias` names: each element is read before its own output is written, so
    under jit with donated arguments the kernel works in place.
    """
    from packed_adamw.core.kernel import adamw_kernel

    n = int(p.size)  # not 0: a grid of zero programs is not a launch
    first = _first_output_alias(write_update, alias_grads)
    flat_p, flat_g = p.reshape(-1), g.reshape(-1)
    flat_s = s.reshape((2, -1) if fmt.mode == "fp32" else (-1,))
    constants = launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=False, block=launch.GPU_BLOCK)
    out_shape = (jax.ShapeDtypeStruct(flat_p.shape, jnp.float32), jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype))
    # The scalars stand in for the unused non-finite counter (COUNT_NONFINITE=False).
    out, new_s = _jax_triton().triton_call(
        flat_p, flat_g, flat_s, scalars, scalars, n,
        kernel=adamw_kernel,
        out_shape=out_shape,
        grid=launch.single_tensor_grid(n, constants),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases={2: 1, **({} if first is None else {first: 0})},
        **launch.COMPILE_OPTIONS,
        **constants,
    )
    return out.reshape(p.shape), new_s.reshape(s.shape)


def group_step(params, grads, states, rows, scalars, *, fmt: StateFormat, write_update: bool,
               alias_grads: bool = False):
    """`leaf_step` over up to `_leaf_group.LEAVES_PER_LAUNCH` non-empty leaves in one launch;
    `rows[i]` picks leaf i's row of `scalars` ([rows, 8]). Returns (outs, new states)."""
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
    # The scalars stand in for the unused non-finite counter (COUNT_NONFINITE=False).
    results = _jax_triton().triton_call(
        *inputs, table, scalars, scalars,
        kernel=leaf_group_kernel(n),
        out_shape=out_shape,
        grid=(launch.grid(max(numels), block)[0], n),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases=aliases,
        **launch.COMPILE_OPTIONS,
        **launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=False, block=block),
    )
    outs = [results[2 * i].reshape(p.shape) for i, p in enumerate(params)]
    new_states = [results[2 * i + 1].reshape(s.shape) for i, s in enumerate(states)]
    return outs, new_states


def step(params, grads, states, decay, hparams, count, *, fmt: StateFormat, write_update: bool, multi_tensor: bool,
         alias_grads: bool = False):
    """Every leaf's (out, new state): `hparams` holds the row with weight decay, then the row
    without; `decay[i]` picks leaf i's. Large leaves launch alone, the others in groups."""
    scalars = step_scalars(hparams, jnp.stack([count, count]))
    rows = [0 if d else 1 for d in decay]
    numels = [int(p.size) for p in params]
    if multi_tensor:
        from ._leaf_group import leaf_groups

        solo, groups = leaf_groups(numels)
    else:
        solo, groups = [i for i, n in enumerate(numels) if n], []
    outs = [jnp.zeros_like(p) if write_update else p for p in params]  # empty leaves stay so
    new_states = list(states)
    for i in solo:
        outs[i], new_states[i] = leaf_step(params[i], grads[i], states[i], scalars[rows[i]], fmt=fmt,
                                           write_update=write_update, alias_grads=alias_grads)
    for group in groups:
        pick = lambda xs: [xs[i] for i in group]  # noqa: E731
        group_outs, group_states = group_step(pick(params), pick(grads), pick(states), pick(rows), scalars,
                                              fmt=fmt, write_update=write_update, alias_grads=alias_grads)
        for i, out, new_state in zip(group, group_outs, group_states):
            outs[i], new_states[i] = out, new_state
    return outs, new_states
