"""Muon's Triton source: the two elementwise phases (docs/MUON.md), bit for bit with
core/muon/numpy_step.py. Compile with launch.COMPILE_OPTIONS (`enable_fp_fusion=False`): the
contract's only fused multiply-adds are the explicit `tl.fma`s below.

`muon_momentum_kernel` reads the gradient and the stored momentum, writes the Newton-Schulz
input X (bf16 bits) and the new momentum into a scratch entry, and adds the matrix's refusing
elements to one counter. The framework runs Newton-Schulz on X. `muon_weight_kernel` then, if
the counter is zero, commits the scratch momentum to the state and steps the weights; a refused
matrix keeps everything (MUON.md, "The matrix is refused"). One launch of each per matrix, or
(`muon_momentum_table_kernel`, `muon_weight_table_kernel`) one per Newton-Schulz batch, whose
matrices' addresses come from a table: the same arithmetic per element, other addressing.

With `track_format` a frontend launches the momentum phase's counting twins instead
(`muon_momentum_counting_kernel`, `muon_momentum_table_counting_kernel`): the same stores, and
each matrix's format counts (MUON.md, "Format counts") added to its counter row (core/launch.py's
layout). Whether a matrix is accepted is known only after all its blocks ran, so the frontend
keeps the counts of accepted matrices; the uncounted kernels are compiled without counting.
"""
import triton
import triton.language as tl

from ..kernel import (
    ALL_ONES,
    COUNTER_ROW,
    FLOAT32_MAGNITUDE_MASK,
    FLOAT32_MAX,
    FLOAT32_SIGN_BIT,
    SPLIT_LO_SIGN,
    SPLIT_MAGNITUDE_MASK,
    SPLIT_MASTER_MAX,
    add_counts,
    code_magnitude,
    decode,
    encode_magnitude,
    finish_code,
    join_master,
    lane_bit,
    split_master,
)
from .hyperparams import SCALAR_FIELDS

PACKED_MODE = tl.constexpr(0)  # StateFormat.kernel_constexprs' MODE: MODES.index(mode)
BF16_MODE = tl.constexpr(1)
FP32_MODE = tl.constexpr(2)
EXPONENT_MASK = tl.constexpr(0x7F800000)
BF16_EXPONENT_MASK = tl.constexpr(0x7F80)


@triton.jit
def _finite(x):
    return (x.to(tl.uint32, bitcast=True) & EXPONENT_MASK) != EXPONENT_MASK


@triton.jit
def _bf16_from_bits(bits16):
    """int16 bf16 bits -> float32 (exact)."""
    return ((bits16.to(tl.uint16, bitcast=True).to(tl.uint32)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """float32 -> bf16 bits in a uint32, nearest even (Inf's bits past bf16's range)."""
    bits = x.to(tl.uint32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def lerp(start, end, weight):
    """MUON.md's lerp: fma(w, end - start, start) if |w| < 0.5, else fma(w - 1, end - start, end)."""
    difference = end - start
    low = tl.fma(weight + tl.zeros_like(difference), difference, start)
    high = tl.fma((weight - 1.0) + tl.zeros_like(difference), difference, end)
    return tl.where(tl.abs(weight) < 0.5, low, high)


@triton.jit
def _momentum_elements(grad_ptr, state_ptr, new_state_ptr, x_ptr, x_offsets, scalars_ptr, refused_ptr, offsets,
                       in_bounds, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr,
                       MU_MAX: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
                       GRAD_BF16: tl.constexpr):
    """Phase 1 of one block of a matrix: every pointer but `x` is read and written at `offsets`,
    the Newton-Schulz input at `x_offsets` (a batch slot may hold it transposed)."""
    _momentum_block(grad_ptr, state_ptr, new_state_ptr, x_ptr, x_offsets, scalars_ptr, refused_ptr, offsets,
                    in_bounds, MODE, MU_FRAC, MU_BIAS, MU_MAX, NESTEROV, MAXIMIZE, GRAD_BF16, False)


@triton.jit
def _momentum_block(grad_ptr, state_ptr, new_state_ptr, x_ptr, x_offsets, scalars_ptr, refused_ptr, offsets,
                    in_bounds, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr,
                    MU_MAX: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
                    GRAD_BF16: tl.constexpr, TRACK_FORMAT: tl.constexpr):
    """`_momentum_elements`; with TRACK_FORMAT (packed mode) returns the block's format counts in
    their lane fields (`lane_bit`, rule.FORMAT_COUNTS order), zeros otherwise."""
    format_lanes = tl.zeros(offsets.shape, tl.int32)
    one_minus_momentum = tl.load(scalars_ptr)
    momentum = tl.load(scalars_ptr + 1)
    if GRAD_BF16:
        g = _bf16_from_bits(tl.load(grad_ptr + offsets, mask=in_bounds, other=0))
    else:
        g = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    bad = ~_finite(g)
    if MAXIMIZE:  # on the bits: compiled negation may become 0 - x, which loses -0
        g = (g.to(tl.uint32, bitcast=True) ^ FLOAT32_SIGN_BIT).to(tl.float32, bitcast=True)
    if MODE == FP32_MODE:
        m = tl.load(state_ptr + offsets, mask=in_bounds, other=0.0)
    elif MODE == BF16_MODE:
        m = _bf16_from_bits(tl.load(state_ptr + offsets, mask=in_bounds, other=0))
    else:
        code = tl.load(state_ptr + offsets, mask=in_bounds, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        m = decode(code, True, MU_FRAC, MU_BIAS)
    m_next = lerp(m, g, one_minus_momentum)
    bad = bad | ~_finite(m_next)
    if NESTEROV:
        x = lerp(g, m_next, momentum)
    else:
        x = m_next
    x_bits = _bf16_bits(x)
    bad = bad | ~_finite(x) | ((x_bits & BF16_EXPONENT_MASK) == BF16_EXPONENT_MASK)
    tl.store(x_ptr + x_offsets, x_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
    if MODE == FP32_MODE:
        tl.store(new_state_ptr + offsets, m_next, mask=in_bounds)
    elif MODE == BF16_MODE:
        m_bits = _bf16_bits(m_next)
        bad = bad | ((m_bits & BF16_EXPONENT_MASK) == BF16_EXPONENT_MASK)
        tl.store(new_state_ptr + offsets, m_bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
    else:
        m_raw = encode_magnitude(tl.abs(m_next), MU_FRAC, MU_BIAS)
        m_code = finish_code(m_raw, m_next, True, MU_MAX)
        tl.store(new_state_ptr + offsets, m_code.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
        if TRACK_FORMAT:  # MUON.md, "Format counts"; as AdamW's kernel counts (core/adamw/kernel.py)
            magnitude = code_magnitude(m_code, True)
            # Each test leaves its answer in bit 31: x + (2**31 - 1 - k) has it set exactly when
            # x > k (for 0 <= x < 2**31); magnitude - 1 wraps exactly when magnitude == 0.
            saturated = m_raw + (FLOAT32_MAGNITUDE_MASK - MU_MAX)
            zero = magnitude - 1
            subnormal = (magnitude - (1 << MU_FRAC)) & (zero ^ ALL_ONES)  # `^ ALL_ONES`: see AdamW's kernel
            nonzero = (m_next.to(tl.uint32, bitcast=True) & FLOAT32_MAGNITUDE_MASK) + FLOAT32_MAGNITUDE_MASK
            lanes = lane_bit(saturated, 0) | lane_bit(zero & nonzero, 1) | lane_bit(subnormal, 2)
            format_lanes = tl.where(in_bounds, lanes, 0)
    n_bad = tl.sum((bad & in_bounds).to(tl.int32), axis=0)
    tl.atomic_add(refused_ptr, n_bad, mask=n_bad > 0)
    return format_lanes


@triton.jit
def _weight_elements(param_ptr, lo_ptr, ortho_ptr, ortho_offsets, new_state_ptr, state_ptr, scalars_ptr,
                     rejected_ptr, offsets, in_bounds, SPLIT: tl.constexpr, update_ptr, UPDATE: tl.constexpr):
    """Phase 2 of one block of an accepted matrix; the Newton-Schulz result read at `ortho_offsets`.
    UPDATE (float32 weights only): the weights are left as they are and `update` takes the
    optax update u for them, `float32_update(p, p')` (u = p' - p, clipped to the float32 range,
    -0.0 where p' has p's bits), as the JAX transform returns it."""
    tl.store(state_ptr + offsets, tl.load(new_state_ptr + offsets, mask=in_bounds), mask=in_bounds)
    decay = tl.load(scalars_ptr + 2)
    neg_adjusted_lr = tl.load(scalars_ptr + 3)
    o = _bf16_from_bits(tl.load(ortho_ptr + ortho_offsets, mask=in_bounds, other=0))
    if SPLIT:
        w_bits = tl.load(param_ptr + offsets, mask=in_bounds, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo_bits = tl.load(lo_ptr + offsets, mask=in_bounds, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        p = join_master(w_bits, lo_bits)
        # A zero weight beside a negative low half reads as that signed zero (codecs.read_master).
        stale = ((w_bits & SPLIT_MAGNITUDE_MASK) == 0) & ((lo_bits & SPLIT_LO_SIGN) != 0)
        p = tl.where(stale, (w_bits << 16).to(tl.float32, bitcast=True), p)
    else:
        p = tl.load(param_ptr + offsets, mask=in_bounds, other=0.0)
    p_next = tl.fma(neg_adjusted_lr + tl.zeros_like(o), o, p * decay)
    if SPLIT:
        accepted = tl.abs(p_next) <= SPLIT_MASTER_MAX
    else:
        accepted = _finite(p_next)
    p_next = tl.where(accepted, p_next, p)
    if SPLIT:
        w_next, lo_next = split_master(p_next)
        tl.store(param_ptr + offsets, w_next.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
        tl.store(lo_ptr + offsets, lo_next.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
    elif UPDATE:
        tl.store(update_ptr + offsets, float32_update(p, p_next), mask=in_bounds)
    else:
        tl.store(param_ptr + offsets, p_next, mask=in_bounds)
    n_rejected = tl.sum((~accepted & in_bounds).to(tl.int32), axis=0)
    tl.atomic_add(rejected_ptr, n_rejected, mask=n_rejected > 0)


@triton.jit
def float32_update(p, p_next):
    """The float32 u with `p + u` = p' wherever p' - p is exact: p' - p clipped to the float32
    range, or -0.0 where p' keeps p's bits (p + -0.0 is p for every p, -0.0 included): the JAX
    transform's `_float32_update`, elementwise."""
    u = tl.minimum(tl.maximum(p_next - p, -FLOAT32_MAX), FLOAT32_MAX)
    unchanged = p_next.to(tl.uint32, bitcast=True) == p.to(tl.uint32, bitcast=True)
    return tl.where(unchanged, negative_zeros(u), u)


@triton.jit
def negative_zeros(like):
    """-0.0 in `like`'s shape (float32), made on the bits: compiled by Triton 3.6, `-x` is
    0 - x, so `-tl.zeros_like(x)` was +0.0 (an H100 run wrote +0.0 for it)."""
    return (tl.zeros_like(like).to(tl.uint32, bitcast=True) | FLOAT32_SIGN_BIT).to(tl.float32, bitcast=True)


@triton.jit
def muon_momentum_kernel(
    grad_ptr, state_ptr, new_state_ptr, x_ptr, scalars_ptr, refused_ptr, n_elements,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 1 of one matrix (flat, n_elements): `grad` float32 (or int16 bf16 bits with
    GRAD_BF16); `state` and `new_state` int16 codes (float32 in fp32 mode); `x` int16 bf16 bits;
    `scalars` the matrix's float32 step-scalar row; `refused` one int32 counter."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _momentum_elements(grad_ptr, state_ptr, new_state_ptr, x_ptr, offsets, scalars_ptr, refused_ptr, offsets,
                       offsets < n_elements, MODE, MU_FRAC, MU_BIAS, MU_MAX, NESTEROV, MAXIMIZE, GRAD_BF16)


@triton.jit
def muon_momentum_counting_kernel(
    grad_ptr, state_ptr, new_state_ptr, x_ptr, scalars_ptr, refused_ptr, counts_ptr, n_elements,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """`muon_momentum_kernel` (packed mode) that also adds the matrix's format counts to
    `counts`, its int64 counter row (core/launch.py: COUNTER_ROW), whether or not it is refused."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    format_lanes = _momentum_block(grad_ptr, state_ptr, new_state_ptr, x_ptr, offsets, scalars_ptr, refused_ptr,
                                   offsets, offsets < n_elements, MODE, MU_FRAC, MU_BIAS, MU_MAX, NESTEROV,
                                   MAXIMIZE, GRAD_BF16, True)
    add_counts(counts_ptr, format_lanes, format_lanes, False, True)


@triton.jit
def muon_weight_kernel(
    param_ptr, lo_ptr, ortho_ptr, new_state_ptr, state_ptr, scalars_ptr, refused_ptr, rejected_ptr, n_elements,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 2 of one matrix, unless `refused` (phase 1's counter) is nonzero: commits
    `new_state` to `state` (same dtype, copied as bits), then p' = fma(neg_adjusted_lr, O,
    p * decay) on float32 weights (SPLIT: int16 bf16 weights and their int16 low halves);
    elements whose p' is not finite (or past SPLIT_MASTER_MAX) keep p and are added to `rejected`."""
    if tl.load(refused_ptr) == 0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _weight_elements(param_ptr, lo_ptr, ortho_ptr, offsets, new_state_ptr, state_ptr, scalars_ptr,
                         rejected_ptr, offsets, offsets < n_elements, SPLIT, param_ptr, False)


# ---- one launch per Newton-Schulz batch -------------------------------------------------------
# A batch's matrices share one wide shape (rows, cols), rows <= cols; a tall matrix is its
# transpose. Matrix j of a launch is row j of an int64 table of MOMENTUM_TABLE_COLUMNS (or
# WEIGHT_TABLE_COLUMNS) words: its addresses, its index into the step's scalar rows and
# counters, its slot in the batch's [B, rows, cols] buffers, and whether it is tall (its slot
# holds it transposed). The elementwise arithmetic is the per-matrix kernels'.
MOMENTUM_TABLE_COLUMNS = 5  # grad, state, matrix index, slot, tall
WEIGHT_TABLE_COLUMNS = 6  # param, low half (the param again without SPLIT), state, matrix index, slot, tall
_MOMENTUM_COLUMNS = tl.constexpr(MOMENTUM_TABLE_COLUMNS)  # Triton reads globals only as constexprs
_WEIGHT_COLUMNS = tl.constexpr(WEIGHT_TABLE_COLUMNS)
MATRIX_SCALARS = tl.constexpr(len(SCALAR_FIELDS))  # a matrix's step_scalar_row
MATRIX_COUNTERS = tl.constexpr(2)  # refused elements, rejected weights


@triton.jit
def _slot_offsets(offsets, tall, rows, cols):
    """Where element `offsets` of a matrix lies in its [rows, cols] slot: itself for a wide
    matrix; for a tall one ([cols, rows] row-major) the transposed position."""
    slot_offsets = offsets
    if tall != 0:
        slot_offsets = (offsets % rows) * cols + offsets // rows
    return slot_offsets


@triton.jit
def muon_momentum_table_kernel(
    table_ptr, scratch_ptr, x_ptr, scalars_ptr, counters_ptr, rows, cols,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 1 of a batch's matrices, grid (blocks per matrix, matrices): the new momentum into
    the matrix's slot of `scratch` ([B, rows * cols], the state's dtype), X into its slot of `x`
    ([B, rows, cols] int16 bf16 bits, a tall matrix transposed); `scalars` the step's [n, 4]
    float32 rows, `counters` its [n, 2] int32 rows."""
    _momentum_table_block(table_ptr, scratch_ptr, x_ptr, scalars_ptr, counters_ptr, rows, cols, MODE, MU_FRAC,
                          MU_BIAS, MU_MAX, NESTEROV, MAXIMIZE, GRAD_BF16, BLOCK, False)


@triton.jit
def muon_momentum_table_counting_kernel(
    table_ptr, scratch_ptr, x_ptr, scalars_ptr, counters_ptr, counts_ptr, rows, cols,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """`muon_momentum_table_kernel` (packed mode) that also adds each matrix's format counts to
    its row of `counts` ([n, COUNTER_ROW] int64, at the matrix's index), refused or not."""
    format_lanes, index = _momentum_table_block(table_ptr, scratch_ptr, x_ptr, scalars_ptr, counters_ptr, rows, cols,
                                                MODE, MU_FRAC, MU_BIAS, MU_MAX, NESTEROV, MAXIMIZE, GRAD_BF16, BLOCK,
                                                True)
    add_counts(counts_ptr + index * COUNTER_ROW, format_lanes, format_lanes, False, True)


@triton.jit
def _momentum_table_block(table_ptr, scratch_ptr, x_ptr, scalars_ptr, counters_ptr, rows, cols,
                          MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
                          NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr,
                          BLOCK: tl.constexpr, TRACK_FORMAT: tl.constexpr):
    """A table kernel's program of phase 1: its matrix's row of the table, then `_momentum_block`.
    Returns the block's format lanes and the matrix's index."""
    row = table_ptr + tl.program_id(1).to(tl.int64) * _MOMENTUM_COLUMNS
    n_elements = tl.cast(rows, tl.int64) * cols  # tl.cast: a 1 may arrive as a constexpr
    index = tl.load(row + 2)
    slot = tl.load(row + 3) * n_elements
    if GRAD_BF16:
        grad_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
    else:
        grad_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    if MODE == FP32_MODE:
        state_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    else:
        state_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int16))
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x_offsets = _slot_offsets(offsets, tl.load(row + 4), rows, cols)
    format_lanes = _momentum_block(grad_ptr, state_ptr, scratch_ptr + slot, x_ptr + slot, x_offsets,
                                   scalars_ptr + index * MATRIX_SCALARS, counters_ptr + index * MATRIX_COUNTERS,
                                   offsets, offsets < n_elements, MODE, MU_FRAC, MU_BIAS, MU_MAX, NESTEROV, MAXIMIZE,
                                   GRAD_BF16, TRACK_FORMAT)
    return format_lanes, index


@triton.jit
def muon_weight_table_kernel(
    table_ptr, scratch_ptr, ortho_ptr, scalars_ptr, counters_ptr, rows, cols,
    MODE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 2 of a batch's matrices, grid (blocks per matrix, matrices), each unless its refused
    counter is nonzero: `ortho` the batch's Newton-Schulz result [B, rows, cols] (int16 bf16
    bits, a tall matrix transposed), `scratch` phase 1's new momenta."""
    row = table_ptr + tl.program_id(1).to(tl.int64) * _WEIGHT_COLUMNS
    index = tl.load(row + 3)
    counters_ptr += index * MATRIX_COUNTERS
    if tl.load(counters_ptr) == 0:
        n_elements = tl.cast(rows, tl.int64) * cols  # tl.cast: a 1 may arrive as a constexpr
        slot = tl.load(row + 4) * n_elements
        if SPLIT:
            param_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
            lo_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        else:
            param_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
            lo_ptr = param_ptr
        if MODE == FP32_MODE:
            state_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        else:
            state_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int16))
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ortho_offsets = _slot_offsets(offsets, tl.load(row + 5), rows, cols)
        _weight_elements(param_ptr, lo_ptr, ortho_ptr + slot, ortho_offsets, scratch_ptr + slot, state_ptr,
                         scalars_ptr + index * MATRIX_SCALARS, counters_ptr + 1, offsets, offsets < n_elements, SPLIT,
                         param_ptr, False)
