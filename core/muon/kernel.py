"""Muon's Triton source: the two elementwise phases (docs/MUON.md), bit for bit with
core/muon/numpy_step.py. Compile with launch.COMPILE_OPTIONS (`enable_fp_fusion=False`): the
contract's only fused multiply-adds are the explicit `tl.fma`s below.

`muon_momentum_kernel` reads the gradient and the stored momentum, writes the Newton-Schulz
input X (bf16 bits), adds the matrix's refusing elements to its counters row and (packed mode)
takes the maximum of |m'| over the matrix into it, with the matrix's old exponent beside it.
The framework runs Newton-Schulz on X. `muon_weight_kernel` then, if no element refused the
matrix, computes m' again from the same gradient and stored momentum (the same operations, the
same bits), stores it (packed mode: encoded with the exponent chosen from the whole matrix's
largest |m'|, which it writes too) and steps the weights; a refused matrix keeps everything
(MUON.md, "The matrix is refused"). So the momentum is committed only with its matrix, from
the stored state the momentum kernel read: no kernel reads an exponent another program of it
may have written (the weight kernel reads the old one from the counters row). One launch of
each per matrix, or (`muon_momentum_table_kernel`, `muon_weight_table_kernel`) one per
Newton-Schulz batch, whose matrices' addresses come from a table: the same arithmetic per
element, other addressing.

Each matrix has a counters row of MATRIX_COUNTERS int32: refused elements (and blocks of a
Newton-Schulz output that is not finite: read only as zero or not), rejected weights,
the float32 bits of max |m'| (non-negative floats order as their bits: the atomic maximum is
order-independent) and the exponent the momentum was read with. A DTensor's shards take the
maximum over every shard before the weight kernel (torch_frontend/_muon_step.py).

With `track_format` a frontend launches the weight phase's counting twins instead
(`muon_weight_counting_kernel`, `muon_weight_table_counting_kernel`): the same stores, and each
accepted matrix's format counts (MUON.md, "Format counts") added to its counter row
(core/launch.py's layout); a refused matrix's row stays zero.
"""
import triton
import triton.language as tl

from ..launch import INTERPRETER_BLOCK, interpreting

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
from .state_format import AMAX_EXPONENT_FIELD as _AMAX_EXPONENT_FIELD

PACKED_MODE = tl.constexpr(0)  # StateFormat.kernel_constexprs' MODE: MODES.index(mode)
BF16_MODE = tl.constexpr(1)
FP32_MODE = tl.constexpr(2)
EXPONENT_MASK = tl.constexpr(0x7F800000)
BF16_EXPONENT_MASK = tl.constexpr(0x7F80)
QUIET_NAN_BF16 = tl.constexpr(0x7FC0)  # what bf16 rounding makes of any NaN (float32.QUIET_NAN_BF16)
AMAX_EXPONENT_FIELD = tl.constexpr(_AMAX_EXPONENT_FIELD)  # the code's exponent field of a matrix's largest |m'|
# A matrix's counters row: refused elements (or non-finite output blocks), rejected weights, the
# bits of max |m'| (packed mode), the exponent its momentum was read with (packed mode).
COUNTER_COLUMNS = ("refused", "rejected", "amax_bits", "old_exponent")
MATRIX_COUNTERS = tl.constexpr(len(COUNTER_COLUMNS))
REJECTED_COUNTER = tl.constexpr(COUNTER_COLUMNS.index("rejected"))
AMAX_COUNTER = tl.constexpr(COUNTER_COLUMNS.index("amax_bits"))
EXPONENT_COUNTER = tl.constexpr(COUNTER_COLUMNS.index("old_exponent"))


@triton.jit
def _finite(x):
    return (x.to(tl.uint32, bitcast=True) & EXPONENT_MASK) != EXPONENT_MASK


@triton.jit
def _bf16_nonfinite(bits):
    """Whether bf16 bits (any integer type) are Inf or NaN: the exponent field all ones."""
    return (bits & BF16_EXPONENT_MASK) == BF16_EXPONENT_MASK


@triton.jit
def _bf16_from_bits(bits16):
    """int16 bf16 bits -> float32 (exact)."""
    return ((bits16.to(tl.uint16, bitcast=True).to(tl.uint32)) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """float32 -> bf16 bits in a uint32, nearest even (Inf's bits past bf16's range); every NaN
    gives the quiet NaN 0x7FC0 (float32.bf16_bits: rounding a NaN's bits could carry into the
    sign and make it -0, as a GPU's NaN 0x7FFFFFFF did)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where((bits & FLOAT32_MAGNITUDE_MASK) > EXPONENT_MASK, QUIET_NAN_BF16, rounded)


@triton.jit
def lerp(start, end, weight):
    """MUON.md's lerp: fma(w, end - start, start) if |w| < 0.5, else fma(w - 1, end - start, end)."""
    difference = end - start
    low = tl.fma(weight + tl.zeros_like(difference), difference, start)
    high = tl.fma((weight - 1.0) + tl.zeros_like(difference), difference, end)
    return tl.where(tl.abs(weight) < 0.5, low, high)


@triton.jit
def power_of_two(j):
    """2**j as float32 for int32 j in [-126, 127], made on the bits (MUON.md's ldexp32)."""
    return ((j + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ldexp32(x, n):
    """MUON.md's x * 2**n: (x * 2**(n >> 1)) * 2**(n - (n >> 1)), two rounded products, the
    numpy step's and the authority's bits (n an int32 scalar in [-252, 254])."""
    half = n >> 1
    return (x * power_of_two(half)) * power_of_two(n - half)


@triton.jit
def matrix_exponent(amax_bits, old, MU_BIAS: tl.constexpr):
    """Packed mode's new exponent from the float32 bits of a matrix's largest |m'| (int32,
    non-negative): floor(log2 amax) + MU_BIAS - 30, exactly from the bits (normal: the
    exponent field - 127; subnormal: the highest set bit's position - 149, read as the exponent
    field of its exact float32 conversion); `old` when amax is 0."""
    field = amax_bits >> 23
    subnormal = ((amax_bits.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127) - 149
    k = tl.where(field != 0, field - 127, subnormal)
    return tl.where(amax_bits == 0, old, k + (MU_BIAS - AMAX_EXPONENT_FIELD))


@triton.jit
def _next_momentum(grad_ptr, state_ptr, offsets, in_bounds, one_minus_momentum, exponent, MODE: tl.constexpr,
                   MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr):
    """(g, m') of one block (g negated with MAXIMIZE): what both phases compute from the
    gradient and the stored momentum (packed mode: its codes times 2**exponent)."""
    if GRAD_BF16:
        g = _bf16_from_bits(tl.load(grad_ptr + offsets, mask=in_bounds, other=0))
    else:
        g = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    if MAXIMIZE:  # on the bits: compiled negation may become 0 - x, which loses -0
        g_used = (g.to(tl.uint32, bitcast=True) ^ FLOAT32_SIGN_BIT).to(tl.float32, bitcast=True)
    else:
        g_used = g
    if MODE == FP32_MODE:
        m = tl.load(state_ptr + offsets, mask=in_bounds, other=0.0)
    elif MODE == BF16_MODE:
        m = _bf16_from_bits(tl.load(state_ptr + offsets, mask=in_bounds, other=0))
    else:
        code = tl.load(state_ptr + offsets, mask=in_bounds, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        m = ldexp32(decode(code, True, MU_FRAC, MU_BIAS), exponent)
    return g, g_used, lerp(m, g_used, one_minus_momentum)


@triton.jit
def _momentum_block(grad_ptr, state_ptr, exponent_ptr, x_ptr, x_offsets, x_in_bounds, scalars_ptr, counters_ptr,
                    offsets, in_bounds, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr,
                    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, TALL: tl.constexpr,
                    TILE: tl.constexpr):
    """Phase 1 of one block of a matrix: the gradient and the momentum read at `offsets`, the
    Newton-Schulz input written at `x_offsets` (`block_offsets`: TALL, a tile transposed); the
    block's refusing elements, and (packed mode) its largest |m'| and the matrix's exponent
    (read at `exponent_ptr`), into the matrix's counters row."""
    one_minus_momentum = tl.load(scalars_ptr)
    momentum = tl.load(scalars_ptr + 1)
    if MODE == PACKED_MODE:
        exponent = tl.load(exponent_ptr)
    else:
        exponent = 0
    g, g_used, m_next = _next_momentum(grad_ptr, state_ptr, offsets, in_bounds, one_minus_momentum, exponent, MODE,
                                       MU_FRAC, MU_BIAS, MAXIMIZE, GRAD_BF16)
    bad = ~_finite(g) | ~_finite(m_next)
    if NESTEROV:
        x = lerp(g_used, m_next, momentum)
    else:
        x = m_next
    x_bits = _bf16_bits(x)
    bad = bad | ~_finite(x) | _bf16_nonfinite(x_bits)
    tl.store(x_ptr + x_offsets, tile_transposed(x_bits.to(tl.uint16).to(tl.int16, bitcast=True), TALL, TILE),
             mask=x_in_bounds)
    if MODE == BF16_MODE:
        m_bits = _bf16_bits(m_next)
        bad = bad | _bf16_nonfinite(m_bits)
    elif MODE == PACKED_MODE:
        magnitude = (m_next.to(tl.uint32, bitcast=True) & FLOAT32_MAGNITUDE_MASK).to(tl.int32, bitcast=True)
        block_max = tl.max(tl.where(in_bounds, magnitude, 0), axis=0)
        # Every program of a matrix updates the same two words, and such updates queue at one
        # L2 slice: a block whose max is below the one already seen (a load, perhaps stale, never
        # above the true max) skips its atomic, and program 0 alone stores the exponent (the
        # same value in every program). Before, the d12 momentum launch ran at 0.88 TB/s.
        seen = tl.load(counters_ptr + AMAX_COUNTER)
        tl.atomic_max(counters_ptr + AMAX_COUNTER, block_max, mask=block_max > seen)
        tl.store(counters_ptr + EXPONENT_COUNTER, exponent, mask=tl.program_id(0) == 0)  # axis 0: the block
    n_bad = tl.sum((bad & in_bounds).to(tl.int32), axis=0)
    tl.atomic_add(counters_ptr, n_bad, mask=n_bad > 0)


@triton.jit
def _weight_block(param_ptr, lo_ptr, ortho_ptr, ortho_offsets, ortho_in_bounds, grad_ptr, state_ptr, exponent_ptr,
                  scalars_ptr, counters_ptr, rejected_ptr, offsets, in_bounds, MODE: tl.constexpr,
                  MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr, MAXIMIZE: tl.constexpr,
                  GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, update_ptr, UPDATE: tl.constexpr,
                  TRACK_FORMAT: tl.constexpr, TALL: tl.constexpr, TILE: tl.constexpr):
    """Phase 2 of one block of an accepted matrix: m' again (the momentum phase's operations on
    the same gradient and stored momentum, with the exponent it read, from `counters`), stored
    at `offsets` (packed mode: m' * 2**-s encoded, s from the counters row's max |m'|, and s
    written at `exponent_ptr`); then the weights, the Newton-Schulz result read at
    `ortho_offsets` (`block_offsets`), their rejected elements added at `rejected_ptr`. UPDATE (float32 weights
    only): the weights are left as they are and `update` takes the optax update u for them,
    `float32_update(p, p')` (u = p' - p, clipped to the float32 range, -0.0 where p' has p's
    bits), as the JAX transform returns it. With TRACK_FORMAT (packed mode) returns the block's
    format counts in their lane fields (`lane_bit`, rule.FORMAT_COUNTS order), zeros otherwise."""
    format_lanes = tl.zeros(offsets.shape, tl.int32)
    one_minus_momentum = tl.load(scalars_ptr)
    if MODE == PACKED_MODE:
        old_exponent = tl.load(counters_ptr + EXPONENT_COUNTER)
        exponent = matrix_exponent(tl.load(counters_ptr + AMAX_COUNTER), old_exponent, MU_BIAS)
    else:
        old_exponent = 0
        exponent = 0
    _, _, m_next = _next_momentum(grad_ptr, state_ptr, offsets, in_bounds, one_minus_momentum, old_exponent, MODE,
                                  MU_FRAC, MU_BIAS, MAXIMIZE, GRAD_BF16)
    if MODE == FP32_MODE:
        tl.store(state_ptr + offsets, m_next, mask=in_bounds)
    elif MODE == BF16_MODE:
        tl.store(state_ptr + offsets, _bf16_bits(m_next).to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
    else:
        scaled = ldexp32(m_next, -exponent)
        m_raw = encode_magnitude(tl.abs(scaled), MU_FRAC, MU_BIAS)
        m_code = finish_code(m_raw, scaled, True, MU_MAX)
        tl.store(state_ptr + offsets, m_code.to(tl.uint16).to(tl.int16, bitcast=True), mask=in_bounds)
        tl.store(exponent_ptr, exponent, mask=tl.program_id(0) == 0)  # the same in every program; none reads it
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
    decay = tl.load(scalars_ptr + 2)
    neg_adjusted_lr = tl.load(scalars_ptr + 3)
    o = _bf16_from_bits(tile_transposed(tl.load(ortho_ptr + ortho_offsets, mask=ortho_in_bounds, other=0), TALL, TILE))
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
    return format_lanes


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


# The step-scalar row's columns (hyperparams.SCALAR_FIELDS) and the counters' (COUNTER_COLUMNS).
_ONE_MINUS_MOMENTUM, _MOMENTUM, _DECAY, _NEG_ADJUSTED_LR = (tl.constexpr(SCALAR_FIELDS.index(name)) for name in (
    "one_minus_momentum", "momentum", "decay", "neg_adjusted_lr"))
_ROW_WIDTH = tl.constexpr(len(SCALAR_FIELDS))
REFUSED_COUNTER = tl.constexpr(COUNTER_COLUMNS.index("refused"))


@triton.jit
def step_scalar_values(lr, momentum, weight_decay, ratio):
    """The one device derivation of MUON.md's step scalars (`hyperparams.step_scalar_row`, in
    SCALAR_FIELDS order) from binary64 lr, momentum, weight decay and the matrix's lr ratio:
    each computed in binary64 and rounded once to float32 (launch's COMPILE_OPTIONS keep the
    product and the difference from fusing into one rounding). -(lr * ratio) is negated on the
    bits after its rounding, which is symmetric: Triton 3.6 compiles -x as 0 - x, which makes
    +0.0 of lr 0 (`negative_zeros` met it on an H100)."""
    scaled_lr = (lr * ratio).to(tl.float32)
    return ((1.0 - momentum).to(tl.float32), momentum.to(tl.float32), (1.0 - lr * weight_decay).to(tl.float32),
            (scaled_lr.to(tl.uint32, bitcast=True) ^ FLOAT32_SIGN_BIT).to(tl.float32, bitcast=True))


@triton.jit
def muon_capturable_scalars_kernel(lr_ptr, group_index_ptr, momentum_ptr, weight_decay_ptr, weight_decay32_ptr,
                                   lr_ratio_ptr, n_rows, scalars_ptr, counters_ptr, BLOCK_ROWS: tl.constexpr):
    """A capturable step's scalar rows and counters in one launch (torch `capturable=True`): row
    i is a matrix of group `group_index[i]`, whose lr is `lr[group]` (float64, copied from the
    group's lr tensor in the same stream, a captured step's at every replay), with its float64
    momentum, weight decay and lr ratio (`step_scalar_values`). The counters row is zeroed and
    refused where the host's validation would refuse lr (NaN, negative, past float32's range as
    a float32, or lr * weight decay past it, the weight decay read as float32: the row's
    `weight_decay32`): a refused matrix keeps weights and momentum."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = rows < n_rows
    group = tl.load(group_index_ptr + rows, mask=valid, other=0)
    lr = tl.load(lr_ptr + group, mask=valid, other=0.0)
    weight_decay = tl.load(weight_decay_ptr + rows, mask=valid, other=0.0)
    one_minus_momentum, momentum, decay, neg_adjusted_lr = step_scalar_values(
        lr, tl.load(momentum_ptr + rows, mask=valid, other=0.0), weight_decay,
        tl.load(lr_ratio_ptr + rows, mask=valid, other=0.0))
    out = scalars_ptr + rows * _ROW_WIDTH
    tl.store(out + _ONE_MINUS_MOMENTUM, one_minus_momentum, mask=valid)
    tl.store(out + _MOMENTUM, momentum, mask=valid)
    tl.store(out + _DECAY, decay, mask=valid)
    tl.store(out + _NEG_ADJUSTED_LR, neg_adjusted_lr, mask=valid)
    lr32 = lr.to(tl.float32).to(tl.float64)
    weight_decay32 = tl.load(weight_decay32_ptr + rows, mask=valid, other=0.0)
    accepted = (lr32 >= 0.0) & (lr32 <= FLOAT32_MAX) & (lr32 * weight_decay32 <= FLOAT32_MAX)
    counters = counters_ptr + rows * MATRIX_COUNTERS
    for column in tl.static_range(MATRIX_COUNTERS):
        if column == REFUSED_COUNTER:
            tl.store(counters + column, tl.where(accepted, 0, 1), mask=valid)
        else:
            tl.store(counters + column, tl.zeros_like(group).to(tl.int32), mask=valid)


@triton.jit
def muon_momentum_kernel(
    grad_ptr, state_ptr, exponent_ptr, x_ptr, scalars_ptr, counters_ptr, n_elements,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 1 of one matrix (flat, n_elements): `grad` float32 (or int16 bf16 bits with
    GRAD_BF16); `state` int16 codes (float32 in fp32 mode), read only; `exponent` the matrix's
    int32 exponent (packed mode; any pointer otherwise, unread); `x` int16 bf16 bits; `scalars`
    the matrix's float32 step-scalar row; `counters` its MATRIX_COUNTERS int32, zeroed before."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n_elements
    _momentum_block(grad_ptr, state_ptr, exponent_ptr, x_ptr, offsets, in_bounds, scalars_ptr, counters_ptr, offsets,
                    in_bounds, MODE, MU_FRAC, MU_BIAS, NESTEROV, MAXIMIZE, GRAD_BF16, False, 1)


@triton.jit
def muon_weight_kernel(
    param_ptr, lo_ptr, ortho_ptr, grad_ptr, state_ptr, exponent_ptr, scalars_ptr, counters_ptr, n_elements,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Phase 2 of one matrix, unless `counters` (phase 1's row) counts a refusing element:
    the new momentum into `state` (packed mode: its exponent into `exponent`), from the same
    `grad` and `state` phase 1 read; then p' = fma(neg_adjusted_lr, O, p * decay) on float32
    weights (SPLIT: int16 bf16 weights and their int16 low halves); elements whose p' is not
    finite (or past SPLIT_MASTER_MAX) keep p and are counted in the row's rejected weights."""
    _weight_program(param_ptr, lo_ptr, ortho_ptr, grad_ptr, state_ptr, exponent_ptr, scalars_ptr, counters_ptr,
                    counters_ptr, n_elements, MODE, MU_FRAC, MU_BIAS, MU_MAX, MAXIMIZE, GRAD_BF16, SPLIT, BLOCK, False)


@triton.jit
def muon_weight_counting_kernel(
    param_ptr, lo_ptr, ortho_ptr, grad_ptr, state_ptr, exponent_ptr, scalars_ptr, counters_ptr, counts_ptr,
    n_elements, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
):
    """`muon_weight_kernel` (packed mode) that also adds an accepted matrix's format counts to
    `counts`, its int64 counter row (core/launch.py: COUNTER_ROW)."""
    _weight_program(param_ptr, lo_ptr, ortho_ptr, grad_ptr, state_ptr, exponent_ptr, scalars_ptr, counters_ptr,
                    counts_ptr, n_elements, MODE, MU_FRAC, MU_BIAS, MU_MAX, MAXIMIZE, GRAD_BF16, SPLIT, BLOCK, True)


@triton.jit
def _weight_program(param_ptr, lo_ptr, ortho_ptr, grad_ptr, state_ptr, exponent_ptr, scalars_ptr, counters_ptr,
                    counts_ptr, n_elements, MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr,
                    MU_MAX: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK: tl.constexpr, TRACK_FORMAT: tl.constexpr):
    if tl.load(counters_ptr) == 0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_bounds = offsets < n_elements
        format_lanes = _weight_block(param_ptr, lo_ptr, ortho_ptr, offsets, in_bounds, grad_ptr, state_ptr,
                                     exponent_ptr, scalars_ptr, counters_ptr, counters_ptr + REJECTED_COUNTER, offsets,
                                     in_bounds, MODE, MU_FRAC, MU_BIAS, MU_MAX, MAXIMIZE, GRAD_BF16, SPLIT, param_ptr,
                                     False, TRACK_FORMAT, False, 1)
        if TRACK_FORMAT:
            add_counts(counts_ptr, format_lanes, format_lanes, False, True)


@triton.jit
def _refuse_nonfinite_block(ortho_ptr, offsets, in_bounds, refused_ptr):
    """Adds 1 to a matrix's refused count (`refused_ptr`) if this block of its Newton-Schulz
    output (int16 bf16 bits) holds a value that is not finite (numpy_step.ortho_finite): the
    weight phase then stores neither its momentum nor its weights (MUON.md, "The matrix is
    refused"). A count of blocks, not a flag: integer sums come out the same in any order."""
    bits = tl.load(ortho_ptr + offsets, mask=in_bounds, other=0)
    nonfinite = tl.max(_bf16_nonfinite(bits).to(tl.int32), axis=0)
    tl.atomic_add(refused_ptr, nonfinite, mask=nonfinite > 0)


@triton.jit
def muon_refuse_nonfinite_kernel(ortho_ptr, counters_ptr, n_elements, BLOCK: tl.constexpr):
    """Between Newton-Schulz and the weight phase of one matrix: `ortho` its output (n_elements
    int16 bf16 bits, any order), `counters` its counters row (`_refuse_nonfinite_block`)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _refuse_nonfinite_block(ortho_ptr, offsets, offsets < n_elements, counters_ptr)


# ---- one launch per Newton-Schulz batch -------------------------------------------------------
# A batch's matrices share one wide shape (rows, cols), rows <= cols; a tall matrix is its
# transpose. Matrix j of a launch is row j of an int64 table of MOMENTUM_TABLE_COLUMNS (or
# WEIGHT_TABLE_COLUMNS) words: its addresses, its index into the step's scalar rows and
# counters, and its slot in the batch's [B, rows, cols] buffers. A launch's matrices share an
# orientation (TALL: each slot holds its matrix transposed). The elementwise arithmetic is the
# per-matrix kernels'.
MOMENTUM_TABLE_COLUMNS = 5  # grad, state, exponent, matrix index, slot
WEIGHT_TABLE_COLUMNS = 7  # param, low half (the param again without SPLIT), grad, state, exponent, index, slot
_MOMENTUM_COLUMNS = tl.constexpr(MOMENTUM_TABLE_COLUMNS)  # Triton reads globals only as constexprs
_WEIGHT_COLUMNS = tl.constexpr(WEIGHT_TABLE_COLUMNS)
MATRIX_SCALARS = tl.constexpr(len(SCALAR_FIELDS))  # a matrix's step_scalar_row
# A tall matrix's programs take TALL_TILE x TALL_TILE tiles (`block_offsets`): 1,024 elements, as
# two GPU_BLOCKs; runs of 32 consecutive elements on each side (64 to 128 bytes).
TALL_TILE = 32
INTERPRETER_TALL_TILE = 8


def matrix_programs(rows: int, cols: int, tall: bool, block: int, tile: int) -> int:
    """Programs per matrix of a batch launch (`block_offsets`): a [rows, cols] slot's elements
    BLOCK at a time, or a tall matrix's TILE x TILE tiles."""
    if tall:
        return -(-rows // tile) * -(-cols // tile)
    return -(-(rows * cols) // block)


# The refusal of a non-finite Newton-Schulz output reads 2 bytes an element and compares them:
# 4,096 elements a program (a launch of AdamW's 512-element programs, 1 KB each, ran at 1.5 TB/s
# on d12's outputs, D12_STACK.md 12:47). Any size gives the same zero or nonzero counts.
REFUSE_BLOCK = 4096


def refuse_block() -> int:
    return INTERPRETER_BLOCK if interpreting() else REFUSE_BLOCK


def tall_tile() -> int:
    """A tall matrix's tile side: TALL_TILE compiled; interpreted, small enough that the tests'
    small matrices span several tiles and their edges."""
    return INTERPRETER_TALL_TILE if interpreting() else TALL_TILE


@triton.jit
def block_offsets(block, rows, cols, TALL: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Program `block`'s elements of a matrix whose batch slot is [rows, cols] (rows <= cols):
    (offsets in the matrix, in bounds there, offsets in the slot, in bounds there). A wide
    matrix: BLOCK consecutive elements, at the same offsets in its slot. A tall matrix ([cols,
    rows] row-major, its slot holding its transpose): a TILE x TILE tile, listed along the
    matrix's rows for the matrix and along its columns for the slot, so that both sides read
    and write consecutive addresses (`tile_transposed` moves a tile's values between the two
    lists, through shared memory on a GPU); element by element, where it lay before (the
    transposed position of each offset, by an int64 division and remainder each) cost about
    4.6x the phase's bytes on the d12 matrices (D12_STACK.md)."""
    if TALL:
        tiles_across = tl.cdiv(rows, TILE)  # the matrix's columns are the slot's rows
        tile_i = block // tiles_across * TILE
        tile_j = block % tiles_across * TILE
        lanes = tl.arange(0, TILE * TILE)
        i = tile_i + lanes // TILE  # the matrix's row, its column j consecutive within a tile row
        j = tile_j + lanes % TILE
        offsets = i * rows + j
        in_bounds = (i < cols) & (j < rows)
        slot_i = tile_i + lanes % TILE  # the same tile, i consecutive: the slot's contiguous axis
        slot_j = tile_j + lanes // TILE
        slot_offsets = slot_j * cols + slot_i
        slot_in_bounds = (slot_i < cols) & (slot_j < rows)
    else:
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        in_bounds = offsets < tl.cast(rows, tl.int64) * cols
        slot_offsets = offsets
        slot_in_bounds = in_bounds
    return offsets, in_bounds, slot_offsets, slot_in_bounds


@triton.jit
def tile_transposed(values, TALL: tl.constexpr, TILE: tl.constexpr):
    """A tall matrix's tile values from one of `block_offsets`' two lists to the other (the
    transpose of a square tile, so either way); a wide matrix's as they are."""
    if TALL:
        values = tl.reshape(tl.trans(tl.reshape(values, (TILE, TILE))), (TILE * TILE,))
    return values


@triton.jit
def _state_pointer(address, MODE: tl.constexpr):
    if MODE == FP32_MODE:
        return address.to(tl.pointer_type(tl.float32))
    else:
        return address.to(tl.pointer_type(tl.int16))


@triton.jit
def _grad_pointer(address, GRAD_BF16: tl.constexpr):
    if GRAD_BF16:
        return address.to(tl.pointer_type(tl.int16))
    else:
        return address.to(tl.pointer_type(tl.float32))


@triton.jit
def muon_momentum_table_kernel(
    table_ptr, x_ptr, scalars_ptr, counters_ptr, rows, cols,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, TALL: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    """Phase 1 of a batch's matrices of one orientation, grid (`matrix_programs`, matrices): X
    into the matrix's slot of `x` ([B, rows, cols] int16 bf16 bits; TALL: the matrices are
    tall, their slots hold them transposed); `scalars` the step's [n, 4] float32 rows,
    `counters` its [n, MATRIX_COUNTERS] int32 rows."""
    row = table_ptr + tl.program_id(1).to(tl.int64) * _MOMENTUM_COLUMNS
    n_elements = tl.cast(rows, tl.int64) * cols  # tl.cast: a 1 may arrive as a constexpr
    index = tl.load(row + 3)
    slot = tl.load(row + 4) * n_elements
    offsets, in_bounds, x_offsets, x_in_bounds = block_offsets(tl.program_id(0).to(tl.int64), rows, cols, TALL,
                                                               BLOCK, TILE)
    _momentum_block(_grad_pointer(tl.load(row), GRAD_BF16), _state_pointer(tl.load(row + 1), MODE),
                    tl.load(row + 2).to(tl.pointer_type(tl.int32)), x_ptr + slot, x_offsets, x_in_bounds,
                    scalars_ptr + index * MATRIX_SCALARS, counters_ptr + index * MATRIX_COUNTERS, offsets,
                    in_bounds, MODE, MU_FRAC, MU_BIAS, NESTEROV, MAXIMIZE, GRAD_BF16, TALL, TILE)


@triton.jit
def muon_refuse_nonfinite_table_kernel(table_ptr, ortho_ptr, counters_ptr, rows, cols, BLOCK: tl.constexpr):
    """`muon_refuse_nonfinite_kernel` for a momentum launch's matrices, grid (blocks per matrix,
    matrices): `ortho` the batch's Newton-Schulz output [B, rows, cols], the matrices' rows and
    slots read from the momentum launch's `table` (nothing waits; a capture replays it)."""
    row = table_ptr + tl.program_id(1).to(tl.int64) * _MOMENTUM_COLUMNS
    n_elements = tl.cast(rows, tl.int64) * cols  # tl.cast: a 1 may arrive as a constexpr
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _refuse_nonfinite_block(ortho_ptr + tl.load(row + 4) * n_elements, offsets, offsets < n_elements,
                            counters_ptr + tl.load(row + 3) * MATRIX_COUNTERS)


@triton.jit
def muon_weight_table_kernel(
    table_ptr, ortho_ptr, scalars_ptr, counters_ptr, rows, cols,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, TALL: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """Phase 2 of a batch's matrices of one orientation, on phase 1's grid, each unless its row of
    `counters` counts a refusing element: `ortho` the batch's Newton-Schulz result [B, rows,
    cols] (int16 bf16 bits, a tall matrix transposed)."""
    _weight_table_program(table_ptr, ortho_ptr, scalars_ptr, counters_ptr, counters_ptr, rows, cols, MODE, MU_FRAC,
                          MU_BIAS, MU_MAX, MAXIMIZE, GRAD_BF16, SPLIT, TALL, BLOCK, TILE, False)


@triton.jit
def muon_weight_table_counting_kernel(
    table_ptr, ortho_ptr, scalars_ptr, counters_ptr, counts_ptr, rows, cols,
    MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
    MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, TALL: tl.constexpr, BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """`muon_weight_table_kernel` (packed mode) that also adds each accepted matrix's format
    counts to its row of `counts` ([n, COUNTER_ROW] int64, at the matrix's index)."""
    _weight_table_program(table_ptr, ortho_ptr, scalars_ptr, counters_ptr, counts_ptr, rows, cols, MODE, MU_FRAC,
                          MU_BIAS, MU_MAX, MAXIMIZE, GRAD_BF16, SPLIT, TALL, BLOCK, TILE, True)


@triton.jit
def _weight_table_program(table_ptr, ortho_ptr, scalars_ptr, counters_ptr, counts_ptr, rows, cols,
                          MODE: tl.constexpr, MU_FRAC: tl.constexpr, MU_BIAS: tl.constexpr, MU_MAX: tl.constexpr,
                          MAXIMIZE: tl.constexpr, GRAD_BF16: tl.constexpr, SPLIT: tl.constexpr, TALL: tl.constexpr,
                          BLOCK: tl.constexpr, TILE: tl.constexpr, TRACK_FORMAT: tl.constexpr):
    row = table_ptr + tl.program_id(1).to(tl.int64) * _WEIGHT_COLUMNS
    index = tl.load(row + 5)
    counters_ptr += index * MATRIX_COUNTERS
    if tl.load(counters_ptr) == 0:
        n_elements = tl.cast(rows, tl.int64) * cols  # tl.cast: a 1 may arrive as a constexpr
        slot = tl.load(row + 6) * n_elements
        if SPLIT:
            param_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
            lo_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        else:
            param_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
            lo_ptr = param_ptr
        offsets, in_bounds, ortho_offsets, ortho_in_bounds = block_offsets(tl.program_id(0).to(tl.int64), rows, cols,
                                                                           TALL, BLOCK, TILE)
        format_lanes = _weight_block(param_ptr, lo_ptr, ortho_ptr + slot, ortho_offsets, ortho_in_bounds,
                                     _grad_pointer(tl.load(row + 2), GRAD_BF16), _state_pointer(tl.load(row + 3), MODE),
                                     tl.load(row + 4).to(tl.pointer_type(tl.int32)),
                                     scalars_ptr + index * MATRIX_SCALARS, counters_ptr,
                                     counters_ptr + REJECTED_COUNTER, offsets, in_bounds, MODE, MU_FRAC,
                                     MU_BIAS, MU_MAX, MAXIMIZE, GRAD_BF16, SPLIT, param_ptr, False, TRACK_FORMAT, TALL,
                                     TILE)
        if TRACK_FORMAT:
            add_counts(counts_ptr + index * COUNTER_ROW, format_lanes, format_lanes, False, True)
