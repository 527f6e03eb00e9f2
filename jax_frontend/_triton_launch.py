"""The CUDA path: one jax-triton launch of the core kernel per leaf.

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

    # jax-triton 0.3.1 blanks TRITON_CACHE_DIR on import, which breaks later torch-side
    # Triton launches in the same process (ENGINEERING_NOTES.md): put it back.
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


def leaf_step(p, g, s, scalars, *, fmt: StateFormat, write_update: bool):
    """Returns (update or new parameter, new state) for one leaf; `scalars` is its [8] row.

    In the fused step (write_update=False) the parameter and state buffers are aliased to
    the outputs, so under jit with donated arguments the kernel updates them in place.
    """
    from packed_adamw.core.kernel import adamw_kernel

    n = int(p.size)
    if n == 0:  # a grid of zero programs is not a launch
        return (jnp.zeros_like(p) if write_update else p), s
    flat_p, flat_g = p.reshape(-1), g.reshape(-1)
    flat_s = s.reshape((2, -1) if fmt.mode == "fp32" else (-1,))
    block = launch.GPU_BLOCK
    out_shape = (jax.ShapeDtypeStruct(flat_p.shape, jnp.float32), jax.ShapeDtypeStruct(flat_s.shape, flat_s.dtype))
    # The scalars stand in for the unused non-finite counter (COUNT_NONFINITE=False).
    out, new_s = _jax_triton().triton_call(
        flat_p, flat_g, flat_s, scalars, scalars, n,
        kernel=adamw_kernel,
        out_shape=out_shape,
        grid=launch.grid(n, block),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases={2: 1} if write_update else {0: 0, 2: 1},
        **launch.COMPILE_OPTIONS,
        **launch.kernel_constants(fmt, write_update=write_update, count_nonfinite=False, block=block),
    )
    return out.reshape(p.shape), new_s.reshape(s.shape)
