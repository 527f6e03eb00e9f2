"""AdamW's fused update: the one Triton source of its step, for every mode and both frontends.

The per-element body (`_adamw_block_step`, the whole step contract: FORMAT.md, "The step")
and the entry points: one tensor (`adamw_kernel`, `adamw_split_kernel`), many tensors in one
launch (`adamw_multi_tensor_kernel`), and the step scalars (`step_scalars_kernel`,
`capturable_step_scalars_kernel`); for a launcher that passes every buffer as an argument
and returns its outputs (jax-triton, `FUNCTIONAL_KERNELS`), the single-tensor kernels with
their counter row as an output too (`adamw_counting_kernel`, `adamw_split_counting_kernel`)
and up to 16 leaves in one launch (`adamw_leaf_group_kernel`). These keep AdamW's named
format constexprs; all but the laid-out single-tensor programs run the launch skeleton's
programs (core/skeleton.py) over `adamw_format_block`. The codecs, masked loads and stores, the
pointer table and the counter rows are core/kernel.py's; the launch rules are in its docstring.

The update kernels read their step scalars (hyperparams.SCALAR_FIELDS) as float32 rows in
device memory, so neither a new learning rate nor a new step recompiles anything. The torch
launcher derives those rows on the host (`numpy_step.step_scalar_row`) and uploads them with
the step's addresses; the JAX launcher derives them on the device with `step_scalars_kernel`,
because under `jax.jit` the learning rate and count are traced. Both follow FORMAT.md's
recipe and give the same bits.
"""
import triton
import triton.language as tl

from .. import launch
from ..skeleton import leaf_program, multi_tensor_program, tensor_programs
from ..kernel import (
    ALL_ONES,
    CODE_MASK,
    COUNT_FIELD_LIMIT,
    COUNTER_ROW,
    FLOAT32_MAGNITUDE_MASK,
    FLOAT32_MAX,
    FLOAT32_SIGN_BIT,
    FunctionalKernels,
    LANE_FIELD_LIMIT,
    LEAF_GROUP_SLOTS,
    SPLIT_LO_SIGN,
    SPLIT_MAGNITUDE_MASK,
    SPLIT_MASTER_MAX,
    add_counts,
    code_magnitude,
    decode,
    encode_magnitude,
    finish_code,
    float32_power,
    join_master,
    lane_bit,
    leaf_address,
    leaf_slot,
    leaf_weights,
    masked_load,
    masked_store,
    rejected_lanes,
    split_master,
    table_block,
    table_state,
    table_weights,
)
from . import hyperparams, state_format

# AdamW's layout facts come from state_format.py and hyperparams.py; Triton reads globals only
# as constexprs.
FP32_MODE = tl.constexpr(state_format.MODE_IDS["fp32"])
MOMENT_SHIFT = tl.constexpr(state_format.MOMENT_SHIFT)
HPARAM_ROW = tl.constexpr(hyperparams.HPARAM_ROW)
H_LR, H_B1, H_B2, H_EPS, H_WD = (tl.constexpr(i) for i in range(hyperparams.HPARAM_ROW))
SCALAR_ROW = tl.constexpr(hyperparams.SCALAR_ROW)
_S = hyperparams.SCALAR_INDEX
S_B1, S_ONE_MINUS_B1 = tl.constexpr(_S["b1"]), tl.constexpr(_S["one_minus_b1"])
S_B2, S_ONE_MINUS_B2 = tl.constexpr(_S["b2"]), tl.constexpr(_S["one_minus_b2"])
S_STEP_SIZE, S_INV_SQRT_BC2 = tl.constexpr(_S["step_size"]), tl.constexpr(_S["inv_sqrt_bias_correction2"])
S_EPS, S_LR_WD = tl.constexpr(_S["eps"]), tl.constexpr(_S["lr_wd"])
LAYOUT_CONSECUTIVE = tl.constexpr(launch.LAYOUT_CONSECUTIVE)
LAYOUT_PREFETCHED = tl.constexpr(launch.LAYOUT_PREFETCHED)


@triton.jit
def step_scalars_kernel(hparams_ptr, counts_ptr, n_rows, scalars_ptr, BLOCK_ROWS: tl.constexpr):
    """The step scalars of rows of hyperparameters and counts, on the device (FORMAT.md)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = rows < n_rows
    hp = hparams_ptr + rows * HPARAM_ROW
    lr = tl.load(hp + H_LR, mask=valid, other=0.0)
    b1 = tl.load(hp + H_B1, mask=valid, other=0.0)
    b2 = tl.load(hp + H_B2, mask=valid, other=0.0)
    eps = tl.load(hp + H_EPS, mask=valid, other=1.0)
    weight_decay = tl.load(hp + H_WD, mask=valid, other=0.0)
    count = tl.load(counts_ptr + rows, mask=valid, other=1)
    _store_step_scalars(scalars_ptr + rows * SCALAR_ROW, valid, lr, b1, b2, eps, weight_decay, count, 1.0,
                        BLOCK_ROWS)


@triton.jit
def capturable_step_scalars_kernel(lr_addresses_ptr, hparams_ptr, group_index_ptr, b1_sign_ptr, counts_ptr, n_rows,
                                   scalars_ptr, BLOCK_ROWS: tl.constexpr):
    """A capturable step's scalars in one launch (torch `capturable=True`): row i belongs to
    group `group_index[i]`, whose learning rate is read through that group's address in
    `lr_addresses` (a float32 on the device, read again at every replay of a captured step).
    An lr the host would refuse (NaN, negative, above float32's range, or lr * weight decay
    overflowing) becomes NaN, which rejects every element of the row's tensor and leaves its
    count; otherwise the count advances, in place. `b1_sign` is -1 for maximizing rows: it
    negates 1 - b1 exactly (FORMAT.md). The group's other hyperparameters come from its
    `hparams` row (the lr column is not read)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = rows < n_rows
    group = tl.load(group_index_ptr + rows, mask=valid, other=0)
    lr_ptr = tl.load(lr_addresses_ptr + group, mask=valid, other=0).to(tl.pointer_type(tl.float32))
    lr = tl.load(lr_ptr, mask=valid, other=0.0)
    hp = hparams_ptr + group * HPARAM_ROW
    b1 = tl.load(hp + H_B1, mask=valid, other=0.0)
    b2 = tl.load(hp + H_B2, mask=valid, other=0.0)
    eps = tl.load(hp + H_EPS, mask=valid, other=1.0)
    weight_decay = tl.load(hp + H_WD, mask=valid, other=0.0)
    accepted = (lr >= 0.0) & (lr <= FLOAT32_MAX) & (lr * weight_decay <= FLOAT32_MAX)
    lr = tl.where(accepted, lr, tl.full([BLOCK_ROWS], float("nan"), tl.float32))
    count = tl.load(counts_ptr + rows, mask=valid, other=0) + accepted.to(tl.int32)
    tl.store(counts_ptr + rows, count, mask=valid)
    sign = tl.load(b1_sign_ptr + rows, mask=valid, other=1.0)
    _store_step_scalars(scalars_ptr + rows * SCALAR_ROW, valid, lr, b1, b2, eps, weight_decay, count, sign,
                        BLOCK_ROWS)


@triton.jit
def _store_step_scalars(out, valid, lr, b1, b2, eps, weight_decay, count, one_minus_b1_sign, BLOCK_ROWS: tl.constexpr):
    """The one place on the device where the step scalars are derived (FORMAT.md)."""
    tl.store(out + S_B1, b1, mask=valid)
    tl.store(out + S_ONE_MINUS_B1, (1.0 - b1) * one_minus_b1_sign, mask=valid)
    tl.store(out + S_B2, b2, mask=valid)
    tl.store(out + S_ONE_MINUS_B2, 1.0 - b2, mask=valid)
    tl.store(out + S_STEP_SIZE, tl.div_rn(lr, 1.0 - float32_power(b1, count)), mask=valid)
    one = tl.full([BLOCK_ROWS], 1.0, tl.float32)
    tl.store(out + S_INV_SQRT_BC2, tl.div_rn(one, tl.sqrt_rn(1.0 - float32_power(b2, count))), mask=valid)
    tl.store(out + S_EPS, eps, mask=valid)
    tl.store(out + S_LR_WD, lr * weight_decay, mask=valid)

@triton.jit
def _step_scalars(scalars_ptr):
    """A tensor's row of `step_scalars_kernel`'s output, as the values `_adamw_block_step` takes."""
    return (tl.load(scalars_ptr + S_B1), tl.load(scalars_ptr + S_ONE_MINUS_B1), tl.load(scalars_ptr + S_B2),
            tl.load(scalars_ptr + S_ONE_MINUS_B2), tl.load(scalars_ptr + S_STEP_SIZE),
            tl.load(scalars_ptr + S_INV_SQRT_BC2), tl.load(scalars_ptr + S_EPS), tl.load(scalars_ptr + S_LR_WD))


@triton.jit
def adamw_block(
    param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
    offsets, n_elements, MASKED: tl.constexpr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
):
    """`_adamw_block_step` with the step scalars read from the tensor's row at `scalars_ptr`."""
    in_bounds = offsets < n_elements  # (before the scalars' loads, as the compiled code always had it)
    step = _step_scalars(scalars_ptr)
    return _adamw_block_step(
        step, out_ptr, new_state_ptr, new_lo_ptr,
        offsets, in_bounds, n_elements, MASKED, MODE, WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
        _load_block(param_ptr, grad_ptr, state_ptr, lo_ptr, offsets, in_bounds, n_elements, MASKED, MODE, SPLIT),
    )


@triton.jit
def adamw_format_block(
    param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
    offsets, n_elements, MASKED: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr, FORMAT: tl.constexpr,
):
    """AdamW's block step as the launch skeleton calls it (core/skeleton.py): FORMAT is
    (MODE, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX), and the state
    pointers are cast to fp32 mode's moments or to the packed words."""
    if FORMAT[0] == FP32_MODE:
        state_ptr = state_ptr.to(tl.pointer_type(tl.float32))
        new_state_ptr = new_state_ptr.to(tl.pointer_type(tl.float32))
    else:
        state_ptr = state_ptr.to(tl.pointer_type(tl.uint32))
        new_state_ptr = new_state_ptr.to(tl.pointer_type(tl.uint32))
    return adamw_block(
        param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
        offsets, n_elements, MASKED, FORMAT[0], WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT,
        FORMAT[1], FORMAT[2], FORMAT[3], FORMAT[4], FORMAT[5], FORMAT[6], FORMAT[7], FORMAT[8],
    )


@triton.jit
def _load_block(param_ptr, grad_ptr, state_ptr, lo_ptr, offsets, in_bounds, n_elements, MASKED: tl.constexpr,
                MODE: tl.constexpr, SPLIT: tl.constexpr):
    """A block's inputs, as `_adamw_block_step` takes them: (the parameter, or the bf16 weight's
    bits; the low half's bits, or the parameter again; the gradient, widened; the words, or fp32
    mode's m; fp32 mode's v, or the words again)."""
    if SPLIT:
        first = masked_load(param_ptr + offsets, in_bounds, 0, MASKED).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = masked_load(lo_ptr + offsets, in_bounds, 0, MASKED).to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        first = masked_load(param_ptr + offsets, in_bounds, 0.0, MASKED)
        lo = first
    g = masked_load(grad_ptr + offsets, in_bounds, 0.0, MASKED).to(tl.float32)  # a bf16 gradient widens exactly
    if MODE == FP32_MODE:
        state = masked_load(state_ptr + offsets, in_bounds, 0.0, MASKED)
        v = masked_load(state_ptr + n_elements + offsets, in_bounds, 0.0, MASKED)
    else:
        state = masked_load(state_ptr + offsets, in_bounds, 0, MASKED).to(tl.uint32, bitcast=True)
        v = state
    return first, lo, g, state, v


@triton.jit
def _adamw_block_step(
    step, out_ptr, new_state_ptr, new_lo_ptr,
    offsets, in_bounds, n_elements, MASKED: tl.constexpr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr, loaded,
):
    """One block of one tensor; the whole step contract lives here (FORMAT.md, "The step").

    `step`: the step scalars (`_step_scalars`); `loaded`: the block's inputs (`_load_block`).
    `in_bounds`: which of `offsets` are the tensor's (used only where MASKED); `n_elements`:
    the tensor's length (fp32 mode's v lies that far past m).

    Returns the block's per-lane counts for `add_counts` (zeros where not asked for): rejected
    elements, and the format counts in their lane fields (`lane_bit`).
    MASKED=False for blocks that lie wholly inside the tensor: a bounds mask the compiler
    cannot prove uniform over 16 bytes splits every access into 4-byte ones.
    SPLIT: the parameter is a bf16 live weight with its int16 low half (FORMAT.md, "Split
    masters"), as `_load_block` read them; the step runs on the FP32 master they hold and
    writes the new weight to `out_ptr` and the new low half to `new_lo_ptr`.
    """
    b1, one_minus_b1, b2, one_minus_b2, step_size, inv_sqrt_bias_correction2, eps, lr_wd = step
    first_in, lo_in, g, state_in, v_in = loaded

    if SPLIT:
        w_bits, lo_bits = first_in, lo_in
        p = join_master(w_bits, lo_bits)
        # A zero weight with a negative low half (a zero written to the weight outside the
        # optimizer) would join to a NaN: it reads as that signed zero (codecs.read_master).
        stale = ((w_bits & SPLIT_MAGNITUDE_MASK) == 0) & ((lo_bits & SPLIT_LO_SIGN) != 0)
        p = tl.where(stale, (w_bits << 16).to(tl.float32, bitcast=True), p)
    else:
        p = first_in
    grad_finite = tl.abs(g) <= FLOAT32_MAX
    g = tl.where(grad_finite, g, 0.0)
    if MODE == FP32_MODE:
        m, v = state_in, v_in
    else:
        word = state_in
        m = decode(word >> MOMENT_SHIFT, M_SIGNED, M_FRAC, M_BIAS)
        rms = decode(word & CODE_MASK, R_SIGNED, R_FRAC, R_BIAS)
        v = rms * rms

    m_next = b1 * m + one_minus_b1 * g
    v_next = b2 * v + one_minus_b2 * (g * g)
    rms_next = tl.sqrt_rn(v_next)
    denom = rms_next * inv_sqrt_bias_correction2 + eps
    # The sign is flipped on the bits: compiled float negation may become 0 - x, which turns
    # the update -0.0 into +0.0 (and then p = -0.0 into +0.0).
    sign_bit = tl.full(offsets.shape, FLOAT32_SIGN_BIT, tl.uint32)
    total = step_size * tl.div_rn(m_next, denom) + lr_wd * p
    update = (total.to(tl.uint32, bitcast=True) ^ sign_bit).to(tl.float32, bitcast=True)
    p_next = p + update
    if SPLIT:  # a master past SPLIT_MASTER_MAX would need an Inf live weight
        accepted = grad_finite & (tl.abs(p_next) <= SPLIT_MASTER_MAX)
    else:
        accepted = grad_finite & (tl.abs(p_next) <= FLOAT32_MAX)
    if MODE == FP32_MODE:
        accepted = accepted & (tl.abs(m_next) <= FLOAT32_MAX) & (tl.abs(v_next) <= FLOAT32_MAX)

    # Rejected elements write back what they read: unmasked stores stay vectorized.
    if SPLIT:  # split(join(w, lo)) is (w, lo): a bijection
        w_next, lo_next = split_master(tl.where(accepted, p_next, p))
        masked_store(out_ptr + offsets, w_next.to(tl.uint16).to(out_ptr.dtype.element_ty, bitcast=True),
                     in_bounds, MASKED)
        masked_store(new_lo_ptr + offsets, lo_next.to(tl.uint16).to(new_lo_ptr.dtype.element_ty, bitcast=True),
                     in_bounds, MASKED)
    elif WRITE_UPDATE:
        masked_store(out_ptr + offsets, tl.where(accepted, update, sign_bit.to(tl.float32, bitcast=True)), in_bounds,
                     MASKED)
    else:
        masked_store(out_ptr + offsets, tl.where(accepted, p_next, p), in_bounds, MASKED)
    format_lanes = tl.zeros(offsets.shape, tl.int32)
    if MODE == FP32_MODE:
        masked_store(new_state_ptr + offsets, tl.where(accepted, m_next, m), in_bounds, MASKED)
        masked_store(new_state_ptr + n_elements + offsets, tl.where(accepted, v_next, v), in_bounds, MASKED)
    else:
        rms_raw = encode_magnitude(tl.abs(rms_next), R_FRAC, R_BIAS)
        m_raw = encode_magnitude(tl.abs(m_next), M_FRAC, M_BIAS)
        rms_code = finish_code(rms_raw, rms_next, R_SIGNED, R_MAX)
        m_code = finish_code(m_raw, m_next, M_SIGNED, M_MAX)
        m_code = tl.where(rms_code == 0, tl.zeros_like(m_code), m_code)  # the zero-RMS rule
        new_word = tl.where(accepted, (m_code << MOMENT_SHIFT) | rms_code, word)
        masked_store(new_state_ptr + offsets, new_word.to(new_state_ptr.dtype.element_ty, bitcast=True), in_bounds,
                     MASKED)
        if TRACK_FORMAT:  # FORMAT.md, "Format counts": over the accepted elements
            if MASKED:
                counted = accepted & in_bounds
            else:
                counted = accepted
            m_mag, rms_mag = code_magnitude(m_code, M_SIGNED), code_magnitude(rms_code, R_SIGNED)
            # Each test leaves its answer in bit 31 of a uint32, so no predicate stays live
            # (Triton 3.6 spills them): x + (2**31 - 1 - k) has bit 31 set exactly when x > k, for
            # 0 <= x < 2**31 (raw codes and float32 magnitudes); mag - 1 wraps exactly when mag == 0.
            saturated_m, saturated_rms = m_raw + (FLOAT32_MAGNITUDE_MASK - M_MAX), rms_raw + (FLOAT32_MAGNITUDE_MASK - R_MAX)
            zero_m, zero_rms = m_mag - 1, rms_mag - 1
            # (`^ ALL_ONES`, not `~`: triton 3.6's interpreter computes `~` of a uint32 as a negative
            # Python integer and refuses it; compiled, both are the same instruction.)
            subnormal_m = (m_mag - (1 << M_FRAC)) & (zero_m ^ ALL_ONES)
            subnormal_rms = (rms_mag - (1 << R_FRAC)) & (zero_rms ^ ALL_ONES)
            nonzero_m = (m_next.to(tl.uint32, bitcast=True) & FLOAT32_MAGNITUDE_MASK) + FLOAT32_MAGNITUDE_MASK
            nonzero_rms = rms_next.to(tl.uint32, bitcast=True) + FLOAT32_MAGNITUDE_MASK  # rms_next >= +0.0: no sign
            flushed_m, flushed_rms = zero_m & nonzero_m, zero_rms & nonzero_rms
            lanes = (lane_bit(saturated_m, 0) | lane_bit(saturated_rms, 1) | lane_bit(flushed_m, 2)
                     | lane_bit(flushed_rms, 3) | lane_bit(subnormal_m, 4) | lane_bit(subnormal_rms, 5))
            format_lanes = tl.where(counted, lanes, 0)
    return rejected_lanes(accepted, in_bounds, MASKED, COUNT_NONFINITE), format_lanes


@triton.jit
def adamw_programs(
    param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, counters_ptr, n_elements,
    out_ptr, new_state_ptr, new_lo_ptr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, LAYOUT: tl.constexpr = 0,
):
    """One tensor: program i updates blocks [i*BLOCKS_PER_PROGRAM, (i+1)*BLOCKS_PER_PROGRAM).

    A counting launch (`launch.single_tensor_constants`) gives a program several blocks so that
    its one reduction and its atomics are paid once for all of them. LAYOUT (launch.LAYOUT_*):
    CONSECUTIVE computes each block's addresses afresh; SHIFTED lays the program out once: its
    pointers moved to its first element, int32 offsets inside it, the step scalars read once,
    whole blocks in a loop and the partial one after it; PREFETCHED is SHIFTED with each whole
    block's loads issued before the block before it is stepped, so that a program keeps a
    block's loads in flight while it computes. `launch.single_tensor_constants` says which
    launch takes which (H200 timings: docs/results/SWEEP.md)."""
    tl.static_assert(BLOCK * BLOCKS_PER_PROGRAM < COUNT_FIELD_LIMIT)
    tl.static_assert(BLOCKS_PER_PROGRAM < LANE_FIELD_LIMIT, "a program takes fewer blocks than its lane fields can count")
    if LAYOUT != LAYOUT_CONSECUTIVE:  # fewer registers a program: 64-bit addresses computed once, not per block
        # fp32 mode is never laid out so (launch.single_tensor_constants), and no test runs it
        # so: it keeps the consecutive layout.
        tl.static_assert(MODE != FP32_MODE, "the laid-out layouts serve packed and fp16 modes only")
        first = tl.program_id(0).to(tl.int64) * (BLOCKS_PER_PROGRAM * BLOCK)
        param_ptr += first
        grad_ptr += first
        state_ptr += first
        lo_ptr += first
        out_ptr += first
        new_state_ptr += first
        new_lo_ptr += first
        # The program's elements, at most BLOCKS_PER_PROGRAM * BLOCK: int32 from here on.
        remaining = tl.minimum(tl.maximum(n_elements - first, 0), BLOCKS_PER_PROGRAM * BLOCK).to(tl.int32)
        whole = remaining // BLOCK
        step = _step_scalars(scalars_ptr)
        rejected = tl.zeros([BLOCK], tl.int32)
        format_lanes = tl.zeros([BLOCK], tl.int32)
        k = 0
        if LAYOUT == LAYOUT_PREFETCHED:  # a block's loads are issued before the block before it is stepped
            offsets = tl.arange(0, BLOCK)
            loaded = _load_block(param_ptr, grad_ptr, state_ptr, lo_ptr, offsets,
                                 tl.full([BLOCK], 1, tl.int1) & (whole > 0), n_elements, True, MODE, SPLIT)
            while k < whole:
                current = loaded
                offsets = (k + 1) * BLOCK + tl.arange(0, BLOCK)
                # one flag for the whole block (not an element-wise bound): the loads stay 16 bytes wide
                loaded = _load_block(param_ptr, grad_ptr, state_ptr, lo_ptr, offsets,
                                     tl.full([BLOCK], 1, tl.int1) & (k + 1 < whole), n_elements, True, MODE, SPLIT)
                r, lanes = _adamw_block_step(
                    step, out_ptr, new_state_ptr, new_lo_ptr,
                    k * BLOCK + tl.arange(0, BLOCK), None, n_elements, False, MODE, WRITE_UPDATE, SPLIT,
                    COUNT_NONFINITE, TRACK_FORMAT, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
                    current,
                )
                rejected += r
                format_lanes += lanes
                k += 1
        else:
            while k < whole:  # (a scalar bound: triton 3.6's interpreter refuses a tensor one in tl.range)
                offsets = k * BLOCK + tl.arange(0, BLOCK)
                r, lanes = _adamw_block_step(
                    step, out_ptr, new_state_ptr, new_lo_ptr,
                    offsets, None, n_elements, False, MODE, WRITE_UPDATE, SPLIT,
                    COUNT_NONFINITE, TRACK_FORMAT, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
                    _load_block(param_ptr, grad_ptr, state_ptr, lo_ptr, offsets, None, n_elements, False, MODE, SPLIT),
                )
                rejected += r
                format_lanes += lanes
                k += 1
        if whole * BLOCK < remaining:  # the tensor's last, partial block
            offsets = whole * BLOCK + tl.arange(0, BLOCK)
            in_bounds = offsets < remaining
            r, lanes = _adamw_block_step(
                step, out_ptr, new_state_ptr, new_lo_ptr,
                offsets, in_bounds, n_elements, True, MODE, WRITE_UPDATE, SPLIT,
                COUNT_NONFINITE, TRACK_FORMAT, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
                _load_block(param_ptr, grad_ptr, state_ptr, lo_ptr, offsets, in_bounds, n_elements, True, MODE, SPLIT),
            )
            rejected += r
            format_lanes += lanes
        add_counts(counters_ptr, rejected, format_lanes, COUNT_NONFINITE, TRACK_FORMAT)
    else:
        tensor_programs(
            param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, counters_ptr, n_elements, out_ptr, new_state_ptr,
            new_lo_ptr, adamw_format_block, (MODE, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX),
            WRITE_UPDATE, SPLIT, COUNT_NONFINITE, TRACK_FORMAT, BLOCK, BLOCKS_PER_PROGRAM,
        )


@triton.jit
def adamw_kernel(
    param_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
    out_ptr, new_state_ptr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, LAYOUT: tl.constexpr = 0,
):
    """One FP32 tensor, on the grid `launch.single_tensor_grid`.

    `scalars_ptr` points at this tensor's row of `step_scalars_kernel`'s output.
    In place (torch): out_ptr is param_ptr and new_state_ptr is state_ptr. Functional (optax):
    out_ptr receives the update u (p_next = p + u exactly), and new_state_ptr a new state.
    Inputs and scalars come before the outputs because jax-triton appends outputs last.
    """
    adamw_programs(
        param_ptr, grad_ptr, state_ptr, param_ptr, scalars_ptr, counters_ptr, n_elements,
        out_ptr, new_state_ptr, out_ptr, MODE, WRITE_UPDATE, False, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK, BLOCKS_PER_PROGRAM, LAYOUT,
    )


@triton.jit
def adamw_split_kernel(
    weight_ptr, lo_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
    new_weight_ptr, new_lo_ptr, new_state_ptr,
    MODE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, LAYOUT: tl.constexpr = 0,
):
    """One bf16 tensor with split masters (FORMAT.md, "Split masters"), on the grid
    `launch.single_tensor_grid`: the bf16 weight and its int16 low half in, the new ones out
    (the same buffers in place); the gradient may be bf16 or float32."""
    adamw_programs(
        weight_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, counters_ptr, n_elements,
        new_weight_ptr, new_state_ptr, new_lo_ptr, MODE, False, True, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK, BLOCKS_PER_PROGRAM, LAYOUT,
    )

@triton.jit
def adamw_multi_tensor_kernel(
    pointers_ptr, block_tensor_ptr, block_index_ptr, numels_ptr, scalar_rows_ptr, scalars_ptr, counters_ptr,
    n_tensors,
    MODE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, ALIGNED: tl.constexpr, SPLIT: tl.constexpr = False, GRAD_BF16: tl.constexpr = False,
):
    """Many tensors in one launch, in place: program i updates block `block_index[i]` of
    tensor `block_tensor[i]`. `pointers` holds the addresses of every parameter, then every
    gradient, then every state buffer (int64), and with SPLIT (bf16 weights with split
    masters) then every low half; tensor t reads scalar row `scalar_rows[t]`, so one launch
    serves several parameter groups and step counts. GRAD_BF16: every gradient is bf16.
    """
    multi_tensor_program(
        pointers_ptr, block_tensor_ptr, block_index_ptr, numels_ptr, scalar_rows_ptr, scalars_ptr, counters_ptr,
        n_tensors, adamw_format_block, (MODE, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX),
        SCALAR_ROW, COUNT_NONFINITE, TRACK_FORMAT, BLOCK, ALIGNED, SPLIT, GRAD_BF16,
    )


@triton.jit
def adamw_leaf_group_kernel(
    param_0, lo_0, grad_0, state_0,
    param_1, lo_1, grad_1, state_1,
    param_2, lo_2, grad_2, state_2,
    param_3, lo_3, grad_3, state_3,
    param_4, lo_4, grad_4, state_4,
    param_5, lo_5, grad_5, state_5,
    param_6, lo_6, grad_6, state_6,
    param_7, lo_7, grad_7, state_7,
    param_8, lo_8, grad_8, state_8,
    param_9, lo_9, grad_9, state_9,
    param_10, lo_10, grad_10, state_10,
    param_11, lo_11, grad_11, state_11,
    param_12, lo_12, grad_12, state_12,
    param_13, lo_13, grad_13, state_13,
    param_14, lo_14, grad_14, state_14,
    param_15, lo_15, grad_15, state_15,
    leaf_table_ptr, scalars_ptr, counters_ptr,
    out_0, new_lo_0, new_state_0,
    out_1, new_lo_1, new_state_1,
    out_2, new_lo_2, new_state_2,
    out_3, new_lo_3, new_state_3,
    out_4, new_lo_4, new_state_4,
    out_5, new_lo_5, new_state_5,
    out_6, new_lo_6, new_state_6,
    out_7, new_lo_7, new_state_7,
    out_8, new_lo_8, new_state_8,
    out_9, new_lo_9, new_state_9,
    out_10, new_lo_10, new_state_10,
    out_11, new_lo_11, new_state_11,
    out_12, new_lo_12, new_state_12,
    out_13, new_lo_13, new_state_13,
    out_14, new_lo_14, new_state_14,
    out_15, new_lo_15, new_state_15,
    new_counters_ptr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr, GRAD_BF16: tl.constexpr,
    COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Up to LEAF_GROUP_SLOTS separate leaves in one launch, for launchers that pass every
    buffer as an argument and the outputs after the inputs (jax-triton): leaf t's buffers are
    slot t of each kind, on a grid (blocks of the largest leaf, leaves). Program (i, t) updates
    block i of leaf t with scalar row `leaf_table[LEAF_GROUP_SLOTS + t]` of `scalars`;
    `leaf_table[t]` is leaf t's size. Slots past the launch's leaves hold placeholders that no
    program reads.

    Per leaf: FP32 parameters as `adamw_kernel` takes them (`lo`, `new_lo` unused), WRITE_UPDATE
    choosing the update or the new parameter for `out`; with SPLIT, bf16 weights with split
    masters as `adamw_split_kernel` takes them (WRITE_UPDATE off: `out` is the new weight) and
    GRAD_BF16 for bf16 gradients. The counts go to the counter rows at `new_counters_ptr`
    (leaf t's at row t); `counters_ptr` is the same buffer as an input, so that a launcher that
    returns its outputs can alias the zeroed rows it passes in to the rows it gets back."""
    leaf = tl.program_id(1)
    param = leaf_slot(
        leaf, param_0, param_1, param_2, param_3, param_4, param_5, param_6, param_7,
        param_8, param_9, param_10, param_11, param_12, param_13, param_14, param_15,
    )
    lo = leaf_slot(
        leaf, lo_0, lo_1, lo_2, lo_3, lo_4, lo_5, lo_6, lo_7,
        lo_8, lo_9, lo_10, lo_11, lo_12, lo_13, lo_14, lo_15,
    )
    grad = leaf_slot(
        leaf, grad_0, grad_1, grad_2, grad_3, grad_4, grad_5, grad_6, grad_7,
        grad_8, grad_9, grad_10, grad_11, grad_12, grad_13, grad_14, grad_15,
    )
    state = leaf_slot(
        leaf, state_0, state_1, state_2, state_3, state_4, state_5, state_6, state_7,
        state_8, state_9, state_10, state_11, state_12, state_13, state_14, state_15,
    )
    out = leaf_slot(
        leaf, out_0, out_1, out_2, out_3, out_4, out_5, out_6, out_7,
        out_8, out_9, out_10, out_11, out_12, out_13, out_14, out_15,
    )
    new_lo = leaf_slot(
        leaf, new_lo_0, new_lo_1, new_lo_2, new_lo_3, new_lo_4, new_lo_5, new_lo_6, new_lo_7,
        new_lo_8, new_lo_9, new_lo_10, new_lo_11, new_lo_12, new_lo_13, new_lo_14, new_lo_15,
    )
    new_state = leaf_slot(
        leaf, new_state_0, new_state_1, new_state_2, new_state_3, new_state_4, new_state_5, new_state_6, new_state_7,
        new_state_8, new_state_9, new_state_10, new_state_11, new_state_12, new_state_13, new_state_14, new_state_15,
    )
    leaf_program(
        param, grad, state, lo, out, new_state, new_lo, leaf_table_ptr, scalars_ptr, new_counters_ptr, leaf,
        adamw_format_block, (MODE, M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX), SCALAR_ROW,
        WRITE_UPDATE, SPLIT, GRAD_BF16, COUNT_NONFINITE, TRACK_FORMAT, BLOCK,
    )


@triton.jit
def adamw_counting_kernel(
    param_ptr, grad_ptr, state_ptr, scalars_ptr, counters_ptr, n_elements,
    out_ptr, new_state_ptr, new_counters_ptr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr = 1, LAYOUT: tl.constexpr = 0,
):
    """`adamw_kernel` with its counter row as an output as well: a launcher that passes every
    output, aliased ones too, after the inputs (jax-triton) needs this last argument to return
    the counts. `counters_ptr` and `new_counters_ptr` name one buffer (aliased); the counts are
    added through the output's."""
    adamw_programs(
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
    """`adamw_split_kernel` with its counter row as an output as well (as `adamw_counting_kernel`
    for `adamw_kernel`)."""
    adamw_programs(
        weight_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, new_counters_ptr, n_elements,
        new_weight_ptr, new_state_ptr, new_lo_ptr, MODE, False, True, COUNT_NONFINITE, TRACK_FORMAT,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX, BLOCK, BLOCKS_PER_PROGRAM, LAYOUT,
    )


# AdamW's entry points as the JAX frontend launches them (its `_triton_launch` takes these).
FUNCTIONAL_KERNELS = FunctionalKernels(
    tensor=adamw_kernel, tensor_counting=adamw_counting_kernel, split_tensor=adamw_split_kernel,
    split_tensor_counting=adamw_split_counting_kernel, leaf_group=adamw_leaf_group_kernel,
    step_scalars=step_scalars_kernel,
)
