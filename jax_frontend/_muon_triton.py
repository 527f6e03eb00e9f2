"""`packed_muon`'s GPU step: core/muon's Triton kernels through jax-triton (docs/MUON.md, "JAX /
optax", "On a GPU"). Imported lazily: `import jax_triton` fails with a CPU-only jaxlib.

Per Muon leaf ([batch, rows, cols] in the JAX [in, out] layout), one momentum launch writes each
matrix's Newton-Schulz input into its slot of its shape group's [B, k, n] buffer (in the wide
orientation torch gives the same layer: transposed unless in < out) and its new momentum into a
scratch; Newton-Schulz runs once per shape group (core/muon/ns_kernel.py's launches, the ones
torch's `ns_impl="triton"` makes); one weight launch per leaf commits the momentum and steps the
weights of each accepted matrix. The elementwise arithmetic is core/muon/kernel.py's
(`_momentum_elements`, `_weight_elements`), as torch's kernels; only the addressing differs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from packed_adamw.core import launch
from packed_adamw.core.muon import adjusted_lr, ns_kernel, step_scalar_row
from packed_adamw.core.muon.kernel import _momentum_elements, _slot_offsets, _weight_elements

from ._triton_launch import _jax_triton


@triton.jit
def muon_momentum_leaf_kernel(
    grad_ptr, state_ptr, scalars_ptr, x_in_ptr, refused_in_ptr, n_elements, slot0, rows, cols,
    new_state_ptr, x_ptr, refused_ptr,
    TALL: tl.constexpr, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (blocks per matrix, matrices of the leaf): phase 1 of matrix z into the scratch
    `new_state` [z], X into slot slot0 + z of `x` ([*, rows, cols] int16 bf16 bits; TALL: the
    matrix transposed), its refusing elements added to `refused[slot0 + z]` (one counter a
    slot of the shape group). `x_in` and `refused_in` are `x` and `refused` (aliased:
    jax-triton passes outputs after the inputs)."""
    z = tl.program_id(1).to(tl.int64)
    base = z * n_elements
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x_offsets = _slot_offsets(offsets, TALL, rows, cols)
    _momentum_elements(grad_ptr + base, state_ptr + base, new_state_ptr + base, x_ptr + (slot0 + z) * n_elements,
                       x_offsets, scalars_ptr, refused_ptr + slot0 + z, offsets, offsets < n_elements, MODE, MU_FRAC,
                       MU_BIAS, MU_MAX, NESTEROV, False, GRAD_BF16)


@triton.jit
def muon_weight_leaf_kernel(
    param_in_ptr, lo_in_ptr, ortho_ptr, new_state_ptr, state_in_ptr, scalars_ptr, refused_ptr, rejected_in_ptr,
    n_elements, slot0, rows, cols,
    param_ptr, lo_ptr, state_ptr, rejected_ptr,
    TALL: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (blocks per matrix, matrices of the leaf): phase 2 of matrix z unless
    `refused[slot0 + z]`: commits the scratch momentum to `state`, steps the weights (SPLIT:
    int16 bf16 bits and low halves) with O read from slot slot0 + z of `ortho`, its rejected
    elements counted in `rejected[slot0 + z]`. The `*_in` inputs are aliased to the outputs of
    the same name (a matrix that is not stepped keeps them)."""
    z = tl.program_id(1).to(tl.int64)
    if tl.load(refused_ptr + slot0 + z) == 0:
        base = z * n_elements
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ortho_offsets = _slot_offsets(offsets, TALL, rows, cols)
        _weight_elements(param_ptr + base, lo_ptr + base, ortho_ptr + (slot0 + z) * n_elements, ortho_offsets,
                         new_state_ptr + base, state_ptr + base, scalars_ptr, rejected_ptr + slot0 + z, offsets,
                         offsets < n_elements, SPLIT, param_ptr, False)


@triton.jit
def muon_update_leaf_kernel(
    param_ptr, ortho_ptr, new_state_ptr, state_in_ptr, scalars_ptr, refused_ptr, rejected_in_ptr,
    n_elements, slot0, rows, cols,
    update_ptr, state_ptr, rejected_ptr,
    TALL: tl.constexpr, BLOCK: tl.constexpr,
):
    """`muon_weight_leaf_kernel` for a float32 leaf of the transform (`packed_muon`'s update):
    the weights are only read, and `update` takes u (core/muon/kernel.py's `float32_update`:
    -0.0 everywhere for a refused matrix, whose weights stay). So XLA keeps no copy of the
    weights for the `p' - p` after the launch, and makes no pass of its own for it."""
    z = tl.program_id(1).to(tl.int64)
    base = z * n_elements
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n_elements
    if tl.load(refused_ptr + slot0 + z) == 0:
        ortho_offsets = _slot_offsets(offsets, TALL, rows, cols)
        _weight_elements(param_ptr + base, param_ptr + base, ortho_ptr + (slot0 + z) * n_elements, ortho_offsets,
                         new_state_ptr + base, state_ptr + base, scalars_ptr, rejected_ptr + slot0 + z, offsets,
                         in_bounds, False, update_ptr + base, True)
    else:
        tl.store(update_ptr + base + offsets, -tl.zeros((BLOCK,), tl.float32), mask=in_bounds)


@triton.jit
def muon_scalars_kernel(row_ptr, bits64_ptr, out_ptr, STATIC: tl.constexpr):
    """MUON.md's step scalars in binary64 on the device, from (lr, momentum, weight_decay) and
    the matrix's ratio: element i of the float32 `row` widened exactly, or, where bit i of
    STATIC is set, the binary64 number whose bits are pairs 2i, 2i + 1 of `bits64` (uint32, low
    word first; pair 3 is the ratio); each scalar rounded once to float32."""
    lr = _value(row_ptr, bits64_ptr, 0, STATIC)
    momentum = _value(row_ptr, bits64_ptr, 1, STATIC)
    weight_decay = _value(row_ptr, bits64_ptr, 2, STATIC)
    ratio = _value(row_ptr, bits64_ptr, 3, 8)
    tl.store(out_ptr, (1.0 - momentum).to(tl.float32))
    tl.store(out_ptr + 1, momentum.to(tl.float32))
    tl.store(out_ptr + 2, (1.0 - lr * weight_decay).to(tl.float32))
    tl.store(out_ptr + 3, (-(lr * ratio)).to(tl.float32))


@triton.jit
def _value(row_ptr, bits64_ptr, i: tl.constexpr, STATIC: tl.constexpr):
    if (STATIC >> i) & 1:
        low = tl.load(bits64_ptr + 2 * i).to(tl.uint64)
        high = tl.load(bits64_ptr + 2 * i + 1).to(tl.uint64)
        return ((high << 32) | low).to(tl.float64, bitcast=True)
    return tl.load(row_ptr + i).to(tl.float64)


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


def momentum_step(grads, states, scalars, x, refused, slot0, view, *, fmt, nesterov):
    """One leaf's momentum launch. `grads`/`states` [batch, rows, cols] (float32 or bf16
    gradients; uint16 codes or float32 momenta); `x` its group's int16 [B, k, n] buffer and
    `refused` the group's int32 [B] counters (both updated, the leaf's slots from `slot0`).
    Returns (scratch, x, refused)."""
    k, n, tall = wide_shape(view)
    batch, n_elements = grads.shape[0], view.rows * view.cols
    grad_bf16 = grads.dtype == jnp.bfloat16
    state_in = states if fmt.mode == "fp32" else _bits16(states)
    constants = fmt.kernel_constexprs(track_format=False)
    scratch, x, refused = _jax_triton().triton_call(
        _bits16(grads) if grad_bf16 else grads, state_in, scalars, x, refused, n_elements, slot0, k, n,
        kernel=muon_momentum_leaf_kernel,
        out_shape=(jax.ShapeDtypeStruct(state_in.shape, state_in.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct(refused.shape, refused.dtype)),
        grid=(launch.grid(n_elements, launch.GPU_BLOCK)[0], batch),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases={3: 1, 4: 2},
        TALL=tall, MODE=constants["MODE"], MU_FRAC=constants["MU_FRAC"], MU_BIAS=constants["MU_BIAS"],
        MU_MAX=constants["MU_MAX"], NESTEROV=bool(nesterov), GRAD_BF16=bool(grad_bf16), BLOCK=launch.GPU_BLOCK,
        **launch.COMPILE_OPTIONS,
    )
    return scratch, x, refused


def weight_step(params, lows, states, scratch, scalars, refused, rejected, ortho, slot0, view, *, fmt):
    """One leaf's weight launch: returns (new params, new low halves or None, new states, the
    group's `rejected` counters [B] updated), each matrix stepped unless its `refused` slot
    (the group's [B] counters) is set."""
    k, n, tall = wide_shape(view)
    batch, n_elements = params.shape[0], view.rows * view.cols
    split = lows is not None
    weights = _bits16(params) if split else params
    # Without a low half the kernel never touches `lo`: a one-element stand-in, not aliased.
    # (Passing the weights again aliased one buffer to two outputs, and XLA copied the weights
    # twice for every matrix.)
    low = lows if split else jnp.zeros((1,), jnp.int16)
    aliases = {0: 0, 1: 1, 4: 2, 7: 3} if split else {0: 0, 4: 2, 7: 3}
    state_in = states if fmt.mode == "fp32" else _bits16(states)
    new_weights, new_low, new_states, rejected = _jax_triton().triton_call(
        weights, low, ortho, scratch, state_in, scalars, refused, rejected, n_elements, slot0, k, n,
        kernel=muon_weight_leaf_kernel,
        out_shape=(jax.ShapeDtypeStruct(weights.shape, weights.dtype), jax.ShapeDtypeStruct(low.shape, low.dtype),
                   jax.ShapeDtypeStruct(state_in.shape, state_in.dtype),
                   jax.ShapeDtypeStruct(rejected.shape, rejected.dtype)),
        grid=(launch.grid(n_elements, launch.GPU_BLOCK)[0], batch),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases=aliases,
        TALL=tall, SPLIT=split, BLOCK=launch.GPU_BLOCK,
        **launch.COMPILE_OPTIONS,
    )
    if fmt.mode != "fp32":
        new_states = jax.lax.bitcast_convert_type(new_states, jnp.uint16)
    if split:
        return jax.lax.bitcast_convert_type(new_weights, jnp.bfloat16), new_low, new_states, rejected
    return new_weights, None, new_states, rejected


def update_step(params, states, scratch, scalars, refused, rejected, ortho, slot0, view, *, fmt):
    """`weight_step` for a float32 leaf of the transform: returns (the leaf's update u, new
    states, `rejected` updated); the weights are only read (`muon_update_leaf_kernel`)."""
    k, n, tall = wide_shape(view)
    batch, n_elements = params.shape[0], view.rows * view.cols
    state_in = states if fmt.mode == "fp32" else _bits16(states)
    update, new_states, rejected = _jax_triton().triton_call(
        params, ortho, scratch, state_in, scalars, refused, rejected, n_elements, slot0, k, n,
        kernel=muon_update_leaf_kernel,
        out_shape=(jax.ShapeDtypeStruct(params.shape, jnp.float32), jax.ShapeDtypeStruct(state_in.shape, state_in.dtype),
                   jax.ShapeDtypeStruct(rejected.shape, rejected.dtype)),
        grid=(launch.grid(n_elements, launch.GPU_BLOCK)[0], batch),
        num_warps=launch.GPU_NUM_WARPS,
        input_output_aliases={3: 1, 6: 2},
        TALL=tall, BLOCK=launch.GPU_BLOCK,
        **launch.COMPILE_OPTIONS,
    )
    if fmt.mode != "fp32":
        new_states = jax.lax.bitcast_convert_type(new_states, jnp.uint16)
    return update, new_states, rejected


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
