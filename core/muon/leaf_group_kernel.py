"""Muon's leaf-group kernels: the two phases of core/muon/kernel.py over up to
`LEAF_GROUP_SLOTS` leaves a launch, each leaf's buffers a kernel argument of its own (slot t of
each kind), for launchers that pass no tables of addresses (jax-triton: `packed_muon`'s GPU step,
jax_frontend/_muon_triton.py). The elementwise arithmetic is kernel.py's (`_momentum_block`,
`_weight_block`), as torch's pointer-table kernels; only the addressing differs, as AdamW's
`adamw_leaf_group_kernel` differs from its multi-tensor kernel. Also the step scalars from
traced hyperparameters (`muon_scalars_kernel`), MUON.md's binary64 derivation on the device.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..kernel import LEAF_GROUP_SLOTS, leaf_slot
from .kernel import (
    FP32_MODE,
    MATRIX_COUNTERS,
    MATRIX_SCALARS,
    REJECTED_COUNTER,
    _momentum_block,
    _weight_block,
    block_offsets,
    negative_zeros,
    step_scalar_values,
)


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
    NESTEROV: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
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
        offsets, in_bounds, x_offsets, x_in_bounds = block_offsets(tl.program_id(0).to(tl.int64), rows, cols, TALL,
                                                                   BLOCK, TILE)
        _momentum_block(_grad_pointer(grad, GRAD_BF16) + base, _momentum_pointer(state, MODE) + base,
                        _exponent_pointer(exponent) + z, x_ptr + slot * n_elements, x_offsets, x_in_bounds,
                        scalars_ptr + leaf * MATRIX_SCALARS, counters_ptr + slot * MATRIX_COUNTERS, offsets, in_bounds,
                        MODE, MU_FRAC, MU_BIAS, NESTEROV, False, GRAD_BF16, TALL, TILE)


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
    GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, UPDATE: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
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
        offsets, in_bounds, ortho_offsets, ortho_in_bounds = block_offsets(tl.program_id(0).to(tl.int64), rows, cols,
                                                                           TALL, BLOCK, TILE)
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
            _weight_block(param_ptr + base, lo_ptr + base, ortho_ptr + slot * n_elements, ortho_offsets,
                          ortho_in_bounds, _grad_pointer(grad, GRAD_BF16) + base,
                          _momentum_pointer(new_state, MODE) + base, _exponent_pointer(new_exponent) + z,
                          scalars_ptr + leaf * MATRIX_SCALARS, row_in,
                          counters_ptr + slot * MATRIX_COUNTERS + REJECTED_COUNTER, offsets, in_bounds, MODE,
                          MU_FRAC, MU_BIAS, MU_MAX, False, GRAD_BF16, SPLIT, update_ptr + base, UPDATE, False, TALL,
                          TILE)
        elif UPDATE:
            update_ptr = tl.multiple_of(out, 16).to(tl.pointer_type(tl.float32))
            tl.store(update_ptr + base + offsets, negative_zeros(tl.zeros(offsets.shape, tl.float32)), mask=in_bounds)


@triton.jit
def muon_scalars_kernel(row_ptr, bits64_ptr, out_ptr, STATIC: tl.constexpr):
    """MUON.md's step scalars in binary64 on the device, from (lr, momentum, weight_decay) and
    the matrix's ratio: element i of the float32 `row` widened exactly, or, where bit i of
    STATIC is set, the binary64 number whose bits are pairs 2i, 2i + 1 of `bits64` (uint32, low
    word first; pair 3 is the ratio); `step_scalar_values` derives the row."""
    lr = _value(row_ptr, bits64_ptr, 0, STATIC)
    momentum = _value(row_ptr, bits64_ptr, 1, STATIC)
    weight_decay = _value(row_ptr, bits64_ptr, 2, STATIC)
    ratio = _value(row_ptr, bits64_ptr, 3, 8)
    one_minus_momentum, momentum32, decay, neg_adjusted_lr = step_scalar_values(lr, momentum, weight_decay, ratio)
    tl.store(out_ptr, one_minus_momentum)  # SCALAR_FIELDS order
    tl.store(out_ptr + 1, momentum32)
    tl.store(out_ptr + 2, decay)
    tl.store(out_ptr + 3, neg_adjusted_lr)


@triton.jit
def _value(row_ptr, bits64_ptr, i: tl.constexpr, STATIC: tl.constexpr):
    if (STATIC >> i) & 1:
        # Each word read as uint32 before widening: a launcher that hands the words over as int32
        # (the tests' interpreter stand-in) would otherwise sign-extend them.
        low = tl.load(bits64_ptr + 2 * i).to(tl.uint32, bitcast=True).to(tl.uint64)
        high = tl.load(bits64_ptr + 2 * i + 1).to(tl.uint32, bitcast=True).to(tl.uint64)
        return ((high << 32) | low).to(tl.float64, bitcast=True)
    return tl.load(row_ptr + i).to(tl.float64)
