"""The generic Triton pieces every rule's kernels are built from (no rule's arithmetic here).

The 16-bit minifloat codec given a format's constexpr fields (`decode`, `encode_magnitude`,
`finish_code`), the split-master codec (`join_master`, `split_master`), loads and stores
that are masked only where a block crosses the tensor's end, the multi-tensor pointer table
(`table_address`), a leaf-group kernel's slot selection (`leaf_slot`), float32 powers by
square-and-multiply, and the per-tensor counter rows (`lane_bit`, `add_counts`; layout:
launch.py). The launch skeleton (core/skeleton.py) and a rule's block step import
them; Triton inlines them, so the compiled code is what it would be written in place.

Launch rules (the launchers in `launch.py` follow them): compile with
`enable_fp_fusion=False` so no multiply-add is contracted into an FMA; every division and
square root is the correctly rounded `div_rn` / `sqrt_rn`. Then the compiled kernel, its
interpreted run on CPU, the numpy path and the scalar authority agree bit for bit.
"""
from typing import Any, NamedTuple

import triton
import triton.language as tl

from . import codecs, launch

# Every layout fact comes from codecs.py and launch.py; Triton reads globals only as constexprs.
FLOAT32_MAX = tl.constexpr(codecs.FLOAT32_MAX)
CODE_MASK = tl.constexpr(codecs.CODE_MASK)
CODE_SIGN_BIT = tl.constexpr(codecs.CODE_SIGN_BIT)
CODE_MAGNITUDE_MASK = tl.constexpr(codecs.CODE_MAGNITUDE_MASK)
FLOAT32_SIGN_BIT = tl.constexpr(1 << 31)
FLOAT32_MAGNITUDE_MASK = tl.constexpr((1 << 31) - 1)
ALL_ONES = tl.constexpr((1 << 32) - 1)
CODE_SIGN_TO_FLOAT32 = tl.constexpr(31 - (codecs.CODE_BITS - 1))  # shift from a code's sign bit to float32's
COUNTER_ROW = tl.constexpr(launch.COUNTER_ROW)
FORMAT_SLOTS = tl.constexpr(launch.FORMAT_SLOTS)
FORMAT_COUNT_PAIRS = tl.constexpr(launch.MAX_FORMAT_COUNTS // 2)  # add_counts reduces two counts at once
SPLIT_SIGN_BIT = tl.constexpr(codecs.SPLIT_SIGN_BIT)  # bf16's sign bit
SPLIT_MAGNITUDE_MASK = tl.constexpr(codecs.SPLIT_SIGN_BIT - 1)
SPLIT_LO_SIGN = tl.constexpr(codecs.SPLIT_LO_SIGN)  # int16's sign bit, and half a bf16 step of the low half
SPLIT_MASTER_MAX = tl.constexpr(codecs.SPLIT_MASTER_MAX)


@triton.jit
def float32_power(base, exponent):
    """base**exponent by square-and-multiply over 31 bits: plain float32 products, no pow()."""
    result = tl.full(base.shape, 1.0, tl.float32)
    square = base
    k = exponent
    for _ in tl.static_range(31):
        result = tl.where((k & 1) != 0, result * square, result)
        square = square * square
        k = k >> 1
    return result


@triton.jit
def decode(code, SIGNED: tl.constexpr, FRAC_BITS: tl.constexpr, BIAS: tl.constexpr):
    """16-bit code (in a uint32) -> float32. Exact: the values are all float32 numbers.

    The code's exponent and fraction fields, moved into float32's, make the float32 of the
    code's value times 2**(BIAS - 127): normal codes become normal float32s and subnormal codes
    float32 subnormals with the same fraction. One multiplication by 2**(127 - BIAS), exact
    for every bias in codecs.BIAS_RANGE, rescales both, with no branch on the exponent (and no
    int-to-float conversion). It relies on float32 subnormal inputs being kept: compiled, Triton's
    float32 multiplication does not flush them (`mul.rn.f32`, no `.ftz`); interpreted (tests and
    TRITON_INTERPRET only: CPU tensors take core.numpy_step), numpy keeps them unless the process
    flushes subnormals (`torch.set_flush_denormal(True)`), which would decode subnormal codes as 0.
    """
    magnitude = code_magnitude(code, SIGNED)
    bits = magnitude << (23 - FRAC_BITS)
    if SIGNED:  # the sign moves across as a bit: -0.0 stays -0.0
        bits = bits | ((code & CODE_SIGN_BIT) << CODE_SIGN_TO_FLOAT32)
    return bits.to(tl.float32, bitcast=True) * (2.0 ** (127 - BIAS))


@triton.jit
def encode_magnitude(magnitude, FRAC_BITS: tl.constexpr, BIAS: tl.constexpr):
    """finite float32 magnitude -> its code rounded to nearest even, before saturation."""
    DROP: tl.constexpr = 23 - FRAC_BITS
    # Normal codes: move the exponent bias, then round away the dropped mantissa bits.
    rebased = magnitude.to(tl.uint32, bitcast=True) - ((127 - BIAS) << 23)
    normal = (rebased + ((1 << (DROP - 1)) - 1) + ((rebased >> DROP) & 1)) >> DROP
    # Subnormal codes: count smallest subnormals; adding 2**23 rounds to an integer, ties to even.
    # magnitude * 2**(FRAC_BITS - 1 + BIAS) is exact, so the fused multiply-add rounds once, as
    # the sum would. For a subnormal code's magnitude the sum lies in [2**23, 2**24), where a
    # float32's bits are 2**23's plus the integer: no float-to-int conversion (a slow pipe).
    subnormal = tl.fma(magnitude, 2.0 ** (FRAC_BITS - 1 + BIAS), 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    return tl.where(magnitude >= 2.0 ** (1 - BIAS), normal, subnormal)


@triton.jit
def finish_code(raw, x, SIGNED: tl.constexpr, MAX_MAGNITUDE: tl.constexpr):
    """`encode_magnitude`'s code of |x| -> the stored code: saturate, then the sign (zero is code 0)."""
    code = tl.minimum(raw, MAX_MAGNITUDE)
    if SIGNED:
        code = tl.where((x < 0.0) & (code != 0), code | CODE_SIGN_BIT, code)
    return code


@triton.jit
def code_magnitude(code, SIGNED: tl.constexpr):
    if SIGNED:
        code = code & CODE_MAGNITUDE_MASK
    return code


# Format counts per lane: a rule's counts (at most launch.MAX_FORMAT_COUNTS) share one int32,
# LANE_FIELD bits each, so adding an element's counts is one add. A lane meets one element per block of its
# program, so a program takes fewer than 2**LANE_FIELD blocks. Before the program's reductions
# the fields are spread into pairs of 16-bit fields, which hold a program's
# BLOCK * BLOCKS_PER_PROGRAM < 2**16 elements without carries. Counting is on the critical path
# of a kernel close to its instruction-issue limit: every instruction per element shows
# (docs/results/SWEEP.md; benchmarks/investigations/kernel_instructions.py counted them).
_LANE_FIELD_BITS = 5
LANE_FIELD = tl.constexpr(_LANE_FIELD_BITS)
LANE_FIELD_MASK = tl.constexpr((1 << _LANE_FIELD_BITS) - 1)
LANE_FIELD_LIMIT = tl.constexpr(1 << _LANE_FIELD_BITS)
LANE_ONE = tl.constexpr(1)
COUNT_FIELD = tl.constexpr(16)
COUNT_FIELD_MASK = tl.constexpr((1 << 16) - 1)
COUNT_FIELD_LIMIT = tl.constexpr(1 << 16)


@triton.jit
def lane_bit(flag, INDEX: tl.constexpr):
    """Bit 31 of `flag` (uint32) as format count `INDEX` (the rule's `count_names` order), in
    its lane field (int32)."""
    return ((flag >> (31 - INDEX * LANE_FIELD)) & (LANE_ONE << (INDEX * LANE_FIELD))).to(tl.int32, bitcast=True)


@triton.jit
def _add_fields(pointer, format_lanes, LOW: tl.constexpr):
    """Adds counts LOW and LOW + 1 of every lane to their slots (the second FORMAT_SLOTS on)."""
    low = (format_lanes >> (LOW * LANE_FIELD)) & LANE_FIELD_MASK
    high = (format_lanes >> ((LOW + 1) * LANE_FIELD)) & LANE_FIELD_MASK
    total = tl.sum(low | (high << COUNT_FIELD), axis=0)
    low_total = (total & COUNT_FIELD_MASK).to(tl.int64)
    high_total = ((total >> COUNT_FIELD) & COUNT_FIELD_MASK).to(tl.int64)
    tl.atomic_add(pointer, low_total, mask=low_total > 0, sem="relaxed")  # a count: no ordering needed
    tl.atomic_add(pointer + FORMAT_SLOTS, high_total, mask=high_total > 0, sem="relaxed")


@triton.jit
def rejected_lanes(accepted, in_bounds, MASKED: tl.constexpr, COUNT_NONFINITE: tl.constexpr):
    """A block's per-lane rejected count for `add_counts`: 1 where an element's step was refused
    (a non-finite gradient), 0 elsewhere and past the tensor's end (MASKED: a partial block's
    `in_bounds`); all 0 without COUNT_NONFINITE."""
    rejected = tl.zeros(accepted.shape, tl.int32)
    if COUNT_NONFINITE:
        if MASKED:
            accepted = accepted | ~in_bounds
        rejected = (~accepted).to(tl.int32)
    return rejected


@triton.jit
def add_counts(row_ptr, rejected, format_lanes, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr):
    """Adds one program's per-lane counts to its tensor's counter row (launch.py): one
    reduction per pair of format counts, then one relaxed atomic per nonzero count."""
    if COUNT_NONFINITE:
        n_rejected = tl.sum(rejected, axis=0).to(tl.int64)
        tl.atomic_add(row_ptr, n_rejected, mask=n_rejected > 0)
    if TRACK_FORMAT:
        slot = row_ptr + 1 + tl.program_id(0) % FORMAT_SLOTS
        for pair in tl.static_range(FORMAT_COUNT_PAIRS):
            _add_fields(slot + 2 * pair * FORMAT_SLOTS, format_lanes, 2 * pair)


@triton.jit
def join_master(w_bits, lo_bits):
    """A bf16 live weight's bits and its int16 low half (both in uint32, 16 bits used) -> the
    FP32 master (FORMAT.md, "Split masters"): magnitude = w's magnitude * 2**16 + lo, mod 2**31."""
    magnitude = ((w_bits & SPLIT_MAGNITUDE_MASK) << 16) + (lo_bits ^ SPLIT_LO_SIGN) - SPLIT_LO_SIGN
    bits = ((w_bits & SPLIT_SIGN_BIT) << 16) | (magnitude & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def split_master(master):
    """FP32 master -> (bf16 bits, int16 low half), each in a uint32: the magnitude rounded to
    nearest, ties away from zero, and the signed remainder (FORMAT.md, "Split masters")."""
    bits = master.to(tl.uint32, bitcast=True)
    rounded = ((bits & 0x7FFFFFFF) + SPLIT_LO_SIGN) & 0x7FFFFFFF
    w_bits = ((bits >> 16) & SPLIT_SIGN_BIT) | (rounded >> 16)
    lo_bits = (rounded & 0xFFFF) ^ SPLIT_LO_SIGN
    return w_bits, lo_bits


@triton.jit
def masked_load(pointer, mask, other, MASKED: tl.constexpr):
    if MASKED:
        value = tl.load(pointer, mask=mask, other=other)
    else:
        value = tl.load(pointer)
    return value


@triton.jit
def masked_store(pointer, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(pointer, value, mask=mask)
    else:
        tl.store(pointer, value)


@triton.jit
def table_address(table_ptr, index, ALIGNED: tl.constexpr):
    address = tl.load(table_ptr + index)
    if ALIGNED:  # every buffer starts on 16 bytes: lets the loads and stores be 16 bytes wide
        address = tl.multiple_of(address, 16)
    return address


# ---- the launch skeleton's addressing, shared by every rule's kernels ---------------------------
# A multi-tensor launch (torch) reads a table of int64 addresses laid out by the torch launcher
# (`_launch.step_layout`): every weight, then every gradient, then every state buffer, then
# (SPLIT) every low half; program i steps block `block_index[i]` of tensor `block_tensor[i]`.
# A leaf-group launch (jax-triton) passes each leaf's buffers as arguments of their own
# (`leaf_slot`). A rule's kernel takes its program's block and weight pointers from these and
# casts its own state entry's pointer (its dtype is the rule's).
@triton.jit
def table_block(block_tensor_ptr, block_index_ptr, numels_ptr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's block of a multi-tensor launch: (tensor t, the block's first element, its
    offsets, t's element count)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    start = tl.load(block_index_ptr + pid).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    if ALIGNED:
        offsets = tl.max_contiguous(tl.multiple_of(offsets, BLOCK), BLOCK)
    return t, start, offsets, tl.load(numels_ptr + t)


@triton.jit
def table_weights(pointers_ptr, t, n_tensors, ALIGNED: tl.constexpr, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr):
    """Tensor t's (weight, low half, gradient) pointers from a multi-tensor table: SPLIT, a bf16
    weight's bits (uint16) and its int16 low half; otherwise the float32 weight, and the low
    half's pointer is the weight's (unused). GRAD_BF16: the gradient is bf16."""
    if SPLIT:
        param_ptr = table_address(pointers_ptr, t, ALIGNED).to(tl.pointer_type(tl.uint16))
        lo_ptr = table_address(pointers_ptr, 3 * n_tensors + t, ALIGNED).to(tl.pointer_type(tl.int16))
    else:
        param_ptr = table_address(pointers_ptr, t, ALIGNED).to(tl.pointer_type(tl.float32))
        lo_ptr = param_ptr
    if GRAD_BF16:
        grad_ptr = table_address(pointers_ptr, n_tensors + t, ALIGNED).to(tl.pointer_type(tl.bfloat16))
    else:
        grad_ptr = table_address(pointers_ptr, n_tensors + t, ALIGNED).to(tl.pointer_type(tl.float32))
    return param_ptr, lo_ptr, grad_ptr


@triton.jit
def table_state(pointers_ptr, t, n_tensors, ALIGNED: tl.constexpr):
    """Tensor t's state buffer's address (int64) from a multi-tensor table; the rule casts it."""
    return table_address(pointers_ptr, 2 * n_tensors + t, ALIGNED)


@triton.jit
def leaf_address(address):
    """A leaf-group argument's int64 address, 16-byte aligned: jax-triton declares every buffer
    so, and the selection by `leaf_slot` hides it from the compiler."""
    return tl.multiple_of(address, 16)


@triton.jit
def leaf_weights(param, lo, out, new_lo, grad, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr):
    """A leaf's (weight, its output, low half, new low half, gradient) pointers from its
    `leaf_slot` addresses: SPLIT, bf16 weight bits (uint16) and int16 low halves; otherwise
    float32 weights, the low halves' pointers the weights' (unused). GRAD_BF16: bf16 gradient."""
    if SPLIT:
        param_ptr = leaf_address(param).to(tl.pointer_type(tl.uint16))
        out_ptr = leaf_address(out).to(tl.pointer_type(tl.uint16))
        lo_ptr = leaf_address(lo).to(tl.pointer_type(tl.int16))
        new_lo_ptr = leaf_address(new_lo).to(tl.pointer_type(tl.int16))
    else:
        param_ptr = leaf_address(param).to(tl.pointer_type(tl.float32))
        out_ptr = leaf_address(out).to(tl.pointer_type(tl.float32))
        lo_ptr = param_ptr
        new_lo_ptr = out_ptr
    if GRAD_BF16:
        grad_ptr = leaf_address(grad).to(tl.pointer_type(tl.bfloat16))
    else:
        grad_ptr = leaf_address(grad).to(tl.pointer_type(tl.float32))
    return param_ptr, out_ptr, lo_ptr, new_lo_ptr, grad_ptr


LEAF_GROUP_SLOTS = tl.constexpr(launch.LEAF_GROUP_SLOTS)  # `leaf_slot`'s slots


@triton.jit
def leaf_slot(leaf, slot_0, slot_1, slot_2, slot_3, slot_4, slot_5, slot_6, slot_7, slot_8, slot_9, slot_10, slot_11,
              slot_12, slot_13, slot_14, slot_15):
    """The address in slot `leaf` of LEAF_GROUP_SLOTS buffer arguments, as an int64. `leaf`
    is the program's, the same on every lane: each selection is one scalar instruction."""
    address = slot_0.to(tl.int64)
    address = tl.where(leaf == 1, slot_1.to(tl.int64), address)
    address = tl.where(leaf == 2, slot_2.to(tl.int64), address)
    address = tl.where(leaf == 3, slot_3.to(tl.int64), address)
    address = tl.where(leaf == 4, slot_4.to(tl.int64), address)
    address = tl.where(leaf == 5, slot_5.to(tl.int64), address)
    address = tl.where(leaf == 6, slot_6.to(tl.int64), address)
    address = tl.where(leaf == 7, slot_7.to(tl.int64), address)
    address = tl.where(leaf == 8, slot_8.to(tl.int64), address)
    address = tl.where(leaf == 9, slot_9.to(tl.int64), address)
    address = tl.where(leaf == 10, slot_10.to(tl.int64), address)
    address = tl.where(leaf == 11, slot_11.to(tl.int64), address)
    address = tl.where(leaf == 12, slot_12.to(tl.int64), address)
    address = tl.where(leaf == 13, slot_13.to(tl.int64), address)
    address = tl.where(leaf == 14, slot_14.to(tl.int64), address)
    address = tl.where(leaf == 15, slot_15.to(tl.int64), address)
    return address


class FunctionalKernels(NamedTuple):
    """A rule's entry points for a launcher that returns its outputs instead of writing its
    inputs (jax-triton: every output an argument after the inputs, aliased ones too), as the
    JAX frontend launches them. core/adamw/kernel.py's `FUNCTIONAL_KERNELS` is AdamW's."""

    tensor: Any  # one FP32 tensor (`adamw_kernel`'s arguments)
    tensor_counting: Any  # the same with the counter row as its last output
    split_tensor: Any  # one bf16 tensor with a split master (`adamw_split_kernel`'s arguments)
    split_tensor_counting: Any  # the same with the counter row as its last output
    leaf_group: Any  # up to LEAF_GROUP_SLOTS tensors of one launch kind (`adamw_leaf_group_kernel`'s)
    step_scalars: Any  # [rows, hyperparameters] and [rows] counts -> [rows, step scalars]
