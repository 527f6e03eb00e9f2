"""`packed_muon`'s GPU step: core/muon's Triton kernels through jax-triton (docs/MUON.md, "JAX /
optax", "On a GPU"). Imported lazily: `import jax_triton` fails with a CPU-only jaxlib.

Muon leaves are [batch, rows, cols] in the JAX [in, out] layout. Per shape group, one momentum
launch for up to LEAVES_PER_LAUNCH leaves of one kind (orientation, gradient dtype, weight
dtype) writes each matrix's Newton-Schulz input into its slot of the group's [B, k, n] buffer
(in the wide orientation torch gives the same layer: transposed unless in < out) and its
refusing elements, largest |m'| and old exponent into its row of the group's [B, 4] counters;
Newton-Schulz runs once per shape group (core/muon/ns_kernel.py's launches, the ones torch's
`ns_impl="triton"` makes); one weight launch for the same leaves computes each accepted matrix's
new momentum again from its gradient and stored momentum, stores it (packed mode: with the
exponent from the matrix's largest |m'|, which it writes too) and steps the weights. A leaf's
buffers are separate kernel arguments, one slot of each kind (jax-triton passes no tables of
addresses), as the AdamW leaf-group kernel takes them. The kernels are core's
(core/muon/leaf_group_kernel.py: core/muon/kernel.py's elementwise arithmetic, the addressing of
one argument per leaf); this module lays out their operands and launches them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from packed_adamw.core import launch
from packed_adamw.core.muon import adjusted_lr, ns_kernel, step_scalar_row
from packed_adamw.core.muon.kernel import MATRIX_COUNTERS, matrix_programs, tall_tile
from packed_adamw.core.muon.leaf_group_kernel import (  # noqa: F401  (the launches' kernels, named here for tests)
    muon_momentum_group_kernel,
    muon_scalars_kernel,
    muon_weight_group_kernel,
)

from ._triton_launch import _jax_triton

# The group kernels' slots of each buffer kind (as the AdamW leaf-group kernel's).
SLOTS = launch.LEAF_GROUP_SLOTS
# Leaves per launch, at most SLOTS: `_gpu_phases` splits larger groups (a test lowers it).
LEAVES_PER_LAUNCH = SLOTS


def leaf_scalars(row, static_row, torch_shape, adjust_lr_fn):
    """The leaf's float32 step-scalar row [4] on the device. With every hyperparameter a Python
    number, computed on the host (binary64, `step_scalar_row`); otherwise by
    `muon_scalars_kernel` from the graph's float32 values and the known numbers."""
    if all(v is not None for v in static_row[:3]):
        return jnp.asarray(np.array(step_scalar_row(static_row, torch_shape, adjust_lr_fn=adjust_lr_fn), np.float32))
    ratio = adjusted_lr(1.0, torch_shape, adjust_lr_fn)
    numbers = [0.0 if v is None else float(v) for v in static_row[:3]] + [ratio]
    bits64 = jnp.asarray(np.array(numbers, np.float64).view(np.uint32))
    static = sum(1 << i for i, v in enumerate(static_row[:3]) if v is not None)
    return _jax_triton().triton_call(row, bits64, kernel=muon_scalars_kernel,
                                     out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), grid=(1,), STATIC=static,
                                     **launch.COMPILE_OPTIONS)


def wide_shape(view) -> tuple[int, int, bool]:
    """(k, n, tall) of a leaf's matrices: the slot's wide shape and whether the JAX [in, out]
    matrix enters transposed (torch's [out, in] matrix is wide, or square)."""
    rows, cols = view.rows, view.cols  # [in, out]
    tall = rows >= cols
    return (cols, rows, True) if tall else (rows, cols, False)


def _bits16(x):
    return jax.lax.bitcast_convert_type(x, jnp.int16)


def group_table(slot0s: list[int], batches: list[int]) -> np.ndarray:
    """A group launch's table: each leaf's first slot in its shape group's buffers, then its
    number of matrices (0 past the launch's leaves)."""
    if not 1 <= len(slot0s) == len(batches) <= SLOTS:
        raise ValueError(f"a Muon group launch takes 1 to {SLOTS} leaves, got {len(slot0s)}")
    padding = [0] * (SLOTS - len(slot0s))
    return np.asarray([*slot0s, *padding, *batches, *padding], np.int32)  # jnp's default int, x64 or not


def _slots(buffers: list) -> list:
    """`buffers` in the kernel's slots of one kind, one-element placeholders of their dtype
    after them (every launch compiles to the same kernel, whatever its number of leaves)."""
    return [*buffers, *[jnp.zeros((1,), buffers[0].dtype)] * (SLOTS - len(buffers))]


def _out_slots(buffers: list) -> list:
    return [*(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers),
            *[jax.ShapeDtypeStruct((1,), buffers[0].dtype)] * (SLOTS - len(buffers))]


def _grid(view, batches: list[int]) -> tuple[int, int, int]:
    k, n, tall = wide_shape(view)
    return (matrix_programs(k, n, tall, launch.GPU_BLOCK, tall_tile()), max(batches), len(batches))


def _exponent_slots(exponents: list) -> list:
    """The leaves' int32 exponents [batch] (packed mode), or placeholders where there are none."""
    return [jnp.zeros((1,), jnp.int32) if e is None else e for e in exponents]


def momentum_group_step(grads, states, exponents, scalars, x, counters, slot0s, view, *, fmt, nesterov):
    """One momentum launch for up to SLOTS leaves of one shape group, orientation and gradient
    dtype (`view` any of theirs). `grads`/`states`: per leaf [batch, rows, cols] (float32 or
    bf16 gradients; uint16 codes or float32 momenta); `exponents`: per leaf its int32 [batch]
    (packed mode) or None; `scalars` [leaves, 4]; `x` the group's int16 [B, k, n] buffer and
    `counters` its int32 [B, MATRIX_COUNTERS] rows (both updated, leaf t's from `slot0s[t]`).
    Returns (x, counters)."""
    k, n, tall = wide_shape(view)
    batches = [g.shape[0] for g in grads]
    grad_bf16 = grads[0].dtype == jnp.bfloat16
    grad_in = [_bits16(g) if grad_bf16 else g for g in grads]
    state_in = [s if fmt.mode == "fp32" else _bits16(s) for s in states]
    constants = fmt.kernel_constexprs(track_format=False)
    x_input = 3 * SLOTS + 2  # after the slots, the table and the scalars
    results = _jax_triton().triton_call(
        *_slots(grad_in), *_slots(state_in), *_slots(_exponent_slots(exponents)),
        jnp.asarray(group_table(slot0s, batches)), scalars, x, counters, k * n, k, n,
        kernel=muon_momentum_group_kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(counters.shape, counters.dtype)),
        grid=_grid(view, batches),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases={x_input: 0, x_input + 1: 1},
        TALL=tall, **constants, NESTEROV=bool(nesterov), GRAD_BF16=bool(grad_bf16), BLOCK=launch.GPU_BLOCK,
        TILE=tall_tile(),
        **launch.COMPILE_OPTIONS,
    )
    return results[0], results[1]


def weight_group_step(params, lows, grads, states, exponents, scalars, counters, ortho, slot0s, view, *, fmt,
                      write_update: bool):
    """The weight launch for the leaves of a `momentum_group_step` launch: returns (per leaf
    its new params, or with `write_update` (float32 leaves only) its update u; new low halves
    or None; new states; new exponents (None outside packed mode); the group's `counters`
    updated), each matrix stepped unless its row of `counters` counts a refusing element.
    `lows`: None for float32 leaves, else the bf16 leaves' low halves."""
    k, n, tall = wide_shape(view)
    split = lows is not None
    if split and write_update:
        raise ValueError("weight_group_step: a bf16 leaf's update comes from its new weight, not the launch")
    batches = [p.shape[0] for p in params]
    grad_bf16 = grads[0].dtype == jnp.bfloat16
    weights = [_bits16(p) for p in params] if split else list(params)
    # Without low halves (or exponents) the kernel never touches them: placeholders, not aliased.
    low = list(lows) if split else [jnp.zeros((1,), jnp.int16)]
    packed = fmt.exponent_entry is not None
    exponent_in = _exponent_slots(exponents if packed else [None])
    grad_in = [_bits16(g) if grad_bf16 else g for g in grads]
    state_in = [s if fmt.mode == "fp32" else _bits16(s) for s in states]
    slots = SLOTS
    aliases = {5 * slots + 3: 4 * slots}  # the counters
    for t in range(len(params)):
        aliases[3 * slots + t] = 2 * slots + t  # the momentum, stored in place
        if packed:
            aliases[4 * slots + t] = 3 * slots + t  # the exponents
        if not write_update:
            aliases[t] = t  # the weights, stepped in place
        if split:
            aliases[slots + t] = slots + t
    results = _jax_triton().triton_call(
        *_slots(weights), *_slots(low), *_slots(grad_in), *_slots(state_in), *_slots(exponent_in),
        jnp.asarray(group_table(slot0s, batches)), ortho, scalars, counters, k * n, k, n,
        kernel=muon_weight_group_kernel,
        out_shape=(*_out_slots(weights), *_out_slots(low), *_out_slots(state_in), *_out_slots(exponent_in),
                   jax.ShapeDtypeStruct(counters.shape, counters.dtype)),
        grid=_grid(view, batches),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases=aliases,
        TALL=tall, **fmt.kernel_constexprs(track_format=False), GRAD_BF16=bool(grad_bf16), SPLIT=split,
        UPDATE=bool(write_update), BLOCK=launch.GPU_BLOCK, TILE=tall_tile(),
        **launch.COMPILE_OPTIONS,
    )
    n_leaves = len(params)
    new_weights = list(results[:n_leaves])
    new_states = list(results[2 * slots:2 * slots + n_leaves])
    new_exponents = list(results[3 * slots:3 * slots + n_leaves]) if packed else [None] * n_leaves
    if fmt.mode != "fp32":
        new_states = [jax.lax.bitcast_convert_type(s, jnp.uint16) for s in new_states]
    new_lows = None
    if split:
        new_weights = [jax.lax.bitcast_convert_type(w, jnp.bfloat16) for w in new_weights]
        new_lows = list(results[slots:slots + n_leaves])
    return new_weights, new_lows, new_states, new_exponents, results[4 * slots]


def nonfinite_matrices(bits):
    """int32 [B]: 1 where matrix b of an int16 [B, k, n] buffer of bf16 bits has a non-finite
    element (exponent field all ones), else 0."""
    exponent = jnp.int16(0x7F80)
    return jnp.any((bits & exponent) == exponent, axis=(1, 2)).astype(jnp.int32)


def newton_schulz(x_bits, ns_scalars, steps: int):
    """core/muon/ns_kernel.py's Newton-Schulz of an int16 [B, k, n] buffer of bf16 bits (k <= n),
    the launches torch's `newton_schulz_triton_stacked` makes. Returns the int16 result bits."""
    batch, k, n = x_bits.shape
    buffers = {"x": jax.lax.bitcast_convert_type(x_bits, jnp.bfloat16), "scalars": ns_scalars}
    shapes = ns_kernel.buffer_shapes(batch, k, n)
    plan = ns_kernel.launch_plan(batch, k, n, steps, interpreting=launch.interpreting())  # as torch's launches
    for kernel, grid, names, constants, options in plan:
        shape, dtype = shapes[names[-1]]
        buffers[names[-1]] = _jax_triton().triton_call(
            *(buffers[name] for name in names[:-1]), kernel=kernel,
            out_shape=jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), grid=grid, **options, **constants,
            **launch.COMPILE_OPTIONS)
    return _bits16(buffers[ns_kernel.result_buffer(steps)])
