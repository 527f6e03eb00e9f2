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
addresses), as the AdamW leaf-group kernel takes them. The elementwise arithmetic is
core/muon/kernel.py's (`_momentum_block`, `_weight_block`), as torch's kernels; only the
addressing differs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from packed_adamw.core import launch
from packed_adamw.core.kernel import FLOAT32_SIGN_BIT, LEAF_GROUP_SLOTS, leaf_slot
from packed_adamw.core.muon import adjusted_lr, ns_kernel, step_scalar_row
from packed_adamw.core.muon.kernel import (
    FP32_MODE,
    MATRIX_COUNTERS,
    MATRIX_SCALARS,
    REJECTED_COUNTER,
    _momentum_block,
    _slot_offsets,
    _weight_block,
    negative_zeros,
)

from ._triton_launch import _jax_triton

# The group kernels' slots of each buffer kind (as the AdamW leaf-group kernel's).
SLOTS = launch.LEAF_GROUP_SLOTS
# Leaves per launch, at most SLOTS: `_gpu_phases` splits larger groups (a test lowers it).
LEAVES_PER_LAUNCH = SLOTS


@triton.jit
def _momentum_pointer(address, MODE: tl.constexpr):
    """A slot's momentum buffer (its int64 address) as a typed pointer: float32 momenta in fp32
    mode, else int16 codes. jax-triton declares every buffer 16-byte aligned; the selection
    hides it from the compiler."""
    if MODE == FP32_MODE:
        return tl.multiple_of(address, 16).to(tl.pointer_type(tl.float32))
    else:
        return tl.multiple_of(address, 16).to(tl.pointer_type(tl.int16))


@triton.jit
def _exponent_pointer(address):
    """A slot's exponents (its int64 address) as an int32 pointer (jax-triton's 16-byte alignment
    hidden from the compiler, as `_momentum_pointer`'s)."""
    return tl.multiple_of(address, 16).to(tl.pointer_type(tl.int32))


@triton.jit
def _grad_pointer(address, GRAD_BF16: tl.constexpr):
    if GRAD_BF16:
        return tl.multiple_of(address, 16).to(tl.pointer_type(tl.int16))
    else:
        return tl.multiple_of(address, 16).to(tl.pointer_type(tl.float32))


@triton.jit
def muon_momentum_group_kernel(
    grad_0, grad_1, grad_2, grad_3, grad_4, grad_5, grad_6, grad_7, grad_8, grad_9, grad_10, grad_11, grad_12,
    grad_13, grad_14, grad_15,
    state_0, state_1, state_2, state_3, state_4, state_5, state_6, state_7, state_8, state_9, state_10,
    state_11, state_12, state_13, state_14, state_15,
    exponent_0, exponent_1, exponent_2, exponent_3, exponent_4, exponent_5, exponent_6, exponent_7, exponent_8,
    exponent_9, exponent_10, exponent_11, exponent_12, exponent_13, exponent_14, exponent_15,
    table_ptr, scalars_ptr, x_in_ptr, counters_in_ptr, n_elements, rows, cols,
    x_ptr, counters_ptr,
    TALL: tl.constexpr, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 1 of up to LEAF_GROUP_SLOTS leaves of one shape group and orientation, grid
    (blocks per matrix, the most matrices of a leaf, leaves): program (i, z, t) takes block i
    of matrix z of leaf t (slot t of each buffer kind; `group_table`'s `table`; `exponent`
    element z its exponent in packed mode, a placeholder otherwise), X into slot `slot0[t]` + z
    of `x` ([*, rows, cols] int16 bf16 bits; TALL: the matrix transposed), its refusing
    elements, max |m'| and old exponent into that row of `counters` ([*, MATRIX_COUNTERS]
    int32). Scalar row t of `scalars` ([leaves, 4]). `x_in` and `counters_in` are `x` and
    `counters` (aliased: jax-triton passes outputs after the inputs). Slots past the launch's
    leaves hold one-element placeholders that no program reads."""
    leaf = tl.program_id(2)
    z = tl.program_id(1).to(tl.int64)
    if z < tl.load(table_ptr + LEAF_GROUP_SLOTS + leaf):  # a leaf of fewer matrices has idle programs
        slot = tl.load(table_ptr + leaf) + z
        grad = leaf_slot(
            leaf, grad_0, grad_1, grad_2, grad_3, grad_4, grad_5, grad_6, grad_7, grad_8, grad_9, grad_10,
            grad_11, grad_12, grad_13, grad_14, grad_15
        )
        state = leaf_slot(
            leaf, state_0, state_1, state_2, state_3, state_4, state_5, state_6, state_7, state_8, state_9,
            state_10, state_11, state_12, state_13, state_14, state_15
        )
        exponent = leaf_slot(
            leaf, exponent_0, exponent_1, exponent_2, exponent_3, exponent_4, exponent_5, exponent_6, exponent_7,
            exponent_8, exponent_9, exponent_10, exponent_11, exponent_12, exponent_13, exponent_14, exponent_15
        )
        base = z * n_elements
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _momentum_block(_grad_pointer(grad, GRAD_BF16) + base, _momentum_pointer(state, MODE) + base,
                        _exponent_pointer(exponent) + z, x_ptr + slot * n_elements,
                        _slot_offsets(offsets, TALL, rows, cols), scalars_ptr + leaf * MATRIX_SCALARS,
                        counters_ptr + slot * MATRIX_COUNTERS, offsets, offsets < n_elements, MODE, MU_FRAC, MU_BIAS,
                        NESTEROV, False, GRAD_BF16)


@triton.jit
def muon_weight_group_kernel(
    param_0, param_1, param_2, param_3, param_4, param_5, param_6, param_7, param_8, param_9, param_10,
    param_11, param_12, param_13, param_14, param_15,
    lo_0, lo_1, lo_2, lo_3, lo_4, lo_5, lo_6, lo_7, lo_8, lo_9, lo_10, lo_11, lo_12, lo_13, lo_14, lo_15,
    grad_0, grad_1, grad_2, grad_3, grad_4, grad_5, grad_6, grad_7, grad_8, grad_9, grad_10, grad_11, grad_12,
    grad_13, grad_14, grad_15,
    state_0, state_1, state_2, state_3, state_4, state_5, state_6, state_7, state_8, state_9, state_10,
    state_11, state_12, state_13, state_14, state_15,
    exponent_0, exponent_1, exponent_2, exponent_3, exponent_4, exponent_5, exponent_6, exponent_7, exponent_8,
    exponent_9, exponent_10, exponent_11, exponent_12, exponent_13, exponent_14, exponent_15,
    table_ptr, ortho_ptr, scalars_ptr, counters_in_ptr, n_elements, rows, cols,
    out_0, out_1, out_2, out_3, out_4, out_5, out_6, out_7, out_8, out_9, out_10, out_11, out_12, out_13,
    out_14, out_15,
    new_lo_0, new_lo_1, new_lo_2, new_lo_3, new_lo_4, new_lo_5, new_lo_6, new_lo_7, new_lo_8, new_lo_9,
    new_lo_10, new_lo_11, new_lo_12, new_lo_13, new_lo_14, new_lo_15,
    new_state_0, new_state_1, new_state_2, new_state_3, new_state_4, new_state_5, new_state_6, new_state_7,
    new_state_8, new_state_9, new_state_10, new_state_11, new_state_12, new_state_13, new_state_14,
    new_state_15,
    new_exponent_0, new_exponent_1, new_exponent_2, new_exponent_3, new_exponent_4, new_exponent_5,
    new_exponent_6, new_exponent_7, new_exponent_8, new_exponent_9, new_exponent_10, new_exponent_11,
    new_exponent_12, new_exponent_13, new_exponent_14, new_exponent_15,
    counters_ptr,
    TALL: tl.constexpr, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, UPDATE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 2 of the leaves of a `muon_momentum_group_kernel` launch, on its grid: matrix z of
    leaf t, unless its row of `counters` (aliased to `counters_in`) counts a refusing element,
    computes its new momentum again from `grad` and `state` and stores it in `new_state`
    (aliased to `state`; packed mode: its exponent into element z of `new_exponent`, aliased to
    `exponent`), then steps its weights with O read from its slot of `ortho`, its rejected
    elements counted in its row. The weights: SPLIT, int16 bf16 bits and low halves, the new
    ones to `out` and `new_lo` (aliased to `param` and `lo`); otherwise float32, to `out`
    (aliased to `param`), or with UPDATE (the transform's float32 leaves) read from `param`
    only, `out` a buffer of its own taking the optax update u (core/muon/kernel.py's
    `float32_update`; -0.0 everywhere for a refused matrix, whose weights stay): so XLA keeps no
    copy of the weights for a `p' - p` and makes no pass of its own for it. Without SPLIT, `lo`
    and `new_lo` are one-element placeholders that no program reads; outside packed mode so are
    `exponent` and `new_exponent`."""
    leaf = tl.program_id(2)
    z = tl.program_id(1).to(tl.int64)
    if z < tl.load(table_ptr + LEAF_GROUP_SLOTS + leaf):
        slot = tl.load(table_ptr + leaf) + z
        base = z * n_elements
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_bounds = offsets < n_elements
        out = leaf_slot(
            leaf, out_0, out_1, out_2, out_3, out_4, out_5, out_6, out_7, out_8, out_9, out_10, out_11, out_12,
            out_13, out_14, out_15
        )
        row_in = counters_in_ptr + slot * MATRIX_COUNTERS
        if tl.load(row_in) == 0:
            grad = leaf_slot(
                leaf, grad_0, grad_1, grad_2, grad_3, grad_4, grad_5, grad_6, grad_7, grad_8, grad_9, grad_10,
                grad_11, grad_12, grad_13, grad_14, grad_15
            )
            new_state = leaf_slot(
                leaf, new_state_0, new_state_1, new_state_2, new_state_3, new_state_4, new_state_5,
                new_state_6, new_state_7, new_state_8, new_state_9, new_state_10, new_state_11, new_state_12,
                new_state_13, new_state_14, new_state_15
            )
            new_exponent = leaf_slot(
                leaf, new_exponent_0, new_exponent_1, new_exponent_2, new_exponent_3, new_exponent_4,
                new_exponent_5, new_exponent_6, new_exponent_7, new_exponent_8, new_exponent_9, new_exponent_10,
                new_exponent_11, new_exponent_12, new_exponent_13, new_exponent_14, new_exponent_15
            )
            if SPLIT:
                new_lo = leaf_slot(
                    leaf, new_lo_0, new_lo_1, new_lo_2, new_lo_3, new_lo_4, new_lo_5, new_lo_6, new_lo_7,
                    new_lo_8, new_lo_9, new_lo_10, new_lo_11, new_lo_12, new_lo_13, new_lo_14, new_lo_15
                )
                param_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.int16))
                lo_ptr = tl.multiple_of(new_lo, 16).to(tl.pointer_type(tl.int16))
                update_ptr = param_ptr  # unused
            elif UPDATE:
                param = leaf_slot(
                    leaf, param_0, param_1, param_2, param_3, param_4, param_5, param_6, param_7, param_8,
                    param_9, param_10, param_11, param_12, param_13, param_14, param_15
                )
                param_ptr = tl.multiple_of(param, 16).to(tl.pointer_type(tl.float32))
                lo_ptr = param_ptr  # unused
                update_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.float32))
            else:
                param_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.float32))
                lo_ptr = param_ptr  # unused
                update_ptr = param_ptr  # unused
            # The stored momentum and exponent are read and written through the aliased outputs,
            # which hold the inputs' values: each program its own elements, and the exponent's old
            # value is read from the counters row, never from `new_exponent`.
            _weight_block(param_ptr + base, lo_ptr + base, ortho_ptr + slot * n_elements,
                          _slot_offsets(offsets, TALL, rows, cols), _grad_pointer(grad, GRAD_BF16) + base,
                          _momentum_pointer(new_state, MODE) + base, _exponent_pointer(new_exponent) + z,
                          scalars_ptr + leaf * MATRIX_SCALARS, row_in,
                          counters_ptr + slot * MATRIX_COUNTERS + REJECTED_COUNTER, offsets, in_bounds, MODE,
                          MU_FRAC, MU_BIAS, MU_MAX, False, GRAD_BF16, SPLIT, update_ptr + base, UPDATE, False)
        elif UPDATE:
            update_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.float32))
            tl.store(update_ptr + base + offsets, negative_zeros(tl.zeros((BLOCK,), tl.float32)), mask=in_bounds)


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
    # Negated on the bits after the rounding (which is symmetric): Triton 3.6 compiles -x as 0 - x,
    # which gives lr = 0 +0.0 (`negative_zeros` met it on an H100).
    scaled_lr = (lr * ratio).to(tl.float32)
    tl.store(out_ptr + 3, (scaled_lr.to(tl.uint32, bitcast=True) ^ FLOAT32_SIGN_BIT).to(tl.float32, bitcast=True))


@triton.jit
def _value(row_ptr, bits64_ptr, i: tl.constexpr, STATIC: tl.constexpr):
    if (STATIC >> i) & 1:
        # Each word read as uint32 before widening: a launcher that hands the words over as int32
        # (the tests' interpreter stand-in) would otherwise sign-extend them.
        low = tl.load(bits64_ptr + 2 * i).to(tl.uint32, bitcast=True).to(tl.uint64)
        high = tl.load(bits64_ptr + 2 * i + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
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
    return (launch.grid(view.rows * view.cols, launch.GPU_BLOCK)[0], max(batches), len(batches))


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
        UPDATE=bool(write_update), BLOCK=launch.GPU_BLOCK,
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
