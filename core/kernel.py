"""The fused AdamW update: the one Triton kernel source, for every mode and both frontends.

Launch rules (the launchers in `launch.py` follow them): compile with
`enable_fp_fusion=False` so no multiply-add is contracted into an FMA; every division and
square root is the correctly rounded `div_rn` / `sqrt_rn`. Then the compiled kernel, its
interpreted run on CPU, the numpy path and the scalar authority agree bit for bit.

The hyperparameters arrive as a float32 row in device memory and the step count as an int32,
and the step scalars are derived here, so neither a new learning rate nor a new step
recompiles the kernel, and a CUDA graph can capture it.
"""
import triton
import triton.language as tl

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
HPARAM_ROW = tl.constexpr(5)  # lr, b1, b2, eps, weight_decay (see hyperparams.HPARAM_FIELDS)


@triton.jit
def _float32_power(base, exponent):
    """base**exponent by square-and-multiply over 31 bits: plain float32 products, no pow()."""
    result = base * 0.0 + 1.0
    square = base
    k = exponent
    for _ in tl.static_range(31):
        result = tl.where((k & 1) != 0, result * square, result)
        square = square * square
        k = k >> 1
    return result


@triton.jit
def _decode(code, SIGNED: tl.constexpr, FRAC_BITS: tl.constexpr, BIAS: tl.constexpr):
    """16-bit code (in a uint32) -> float32. Exact: the values are all float32 numbers."""
    if SIGNED:
        magnitude = code & 0x7FFF
    else:
        magnitude = code
    exponent = magnitude >> FRAC_BITS
    fraction = magnitude & ((1 << FRAC_BITS) - 1)
    normal = (((exponent + (127 - BIAS)) << 23) | (fraction << (23 - FRAC_BITS))).to(tl.float32, bitcast=True)
    subnormal = fraction.to(tl.float32) * (2.0 ** (1 - BIAS - FRAC_BITS))
    value = tl.where(exponent > 0, normal, subnormal)
    if SIGNED:
        value = tl.where((code & 0x8000) != 0, -value, value)
    return value


@triton.jit
def _encode(x, SIGNED: tl.constexpr, FRAC_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_MAGNITUDE: tl.constexpr):
    """finite float32 -> 16-bit code: round to nearest even, saturate, zero is code 0."""
    DROP: tl.constexpr = 23 - FRAC_BITS
    magnitude = tl.abs(x)
    # Normal codes: move the exponent bias, then round away the dropped mantissa bits.
    rebased = magnitude.to(tl.uint32, bitcast=True) - ((127 - BIAS) << 23)
    normal = (rebased + ((1 << (DROP - 1)) - 1) + ((rebased >> DROP) & 1)) >> DROP
    # Subnormal codes: count smallest subnormals; adding 2**23 rounds to an integer, ties to even.
    scaled = magnitude * (2.0 ** (FRAC_BITS - 1 + BIAS))
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(magnitude >= 2.0 ** (1 - BIAS), normal, subnormal)
    code = tl.minimum(code, MAX_MAGNITUDE)
    if SIGNED:
        code = tl.where((x < 0.0) & (code != 0), code | 0x8000, code)
    return code


@triton.jit
def _adamw_block(
    param_ptr, grad_ptr, state_ptr, hparams_ptr, count_ptr, nonfinite_ptr, out_ptr, new_state_ptr,
    offsets, n_elements,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
):
    """One block of one tensor; the whole step contract lives here (FORMAT.md, "The step")."""
    in_bounds = offsets < n_elements
    lr = tl.load(hparams_ptr + 0)
    b1 = tl.load(hparams_ptr + 1)
    b2 = tl.load(hparams_ptr + 2)
    eps = tl.load(hparams_ptr + 3)
    weight_decay = tl.load(hparams_ptr + 4)
    count = tl.load(count_ptr)
    one_minus_b1 = 1.0 - b1
    one_minus_b2 = 1.0 - b2
    step_size = tl.div_rn(lr, 1.0 - _float32_power(b1, count))
    sqrt_bias_correction2 = tl.sqrt_rn(1.0 - _float32_power(b2, count))
    lr_wd = lr * weight_decay

    p = tl.load(param_ptr + offsets, mask=in_bounds, other=0.0)
    g = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    grad_finite = tl.abs(g) <= FLOAT32_MAX
    g = tl.where(grad_finite, g, 0.0)
    if MODE == 2:
        m = tl.load(state_ptr + offsets, mask=in_bounds, other=0.0)
        v = tl.load(state_ptr + n_elements + offsets, mask=in_bounds, other=0.0)
    else:
        word = tl.load(state_ptr + offsets, mask=in_bounds, other=0).to(tl.uint32, bitcast=True)
        m = _decode(word >> 16, M_SIGNED, M_FRAC, M_BIAS)
        rms = _decode(word & 0xFFFF, R_SIGNED, R_FRAC, R_BIAS)
        v = rms * rms

    m_next = b1 * m + one_minus_b1 * g
    v_next = b2 * v + one_minus_b2 * (g * g)
    rms_next = tl.sqrt_rn(v_next)
    denom = tl.div_rn(rms_next, sqrt_bias_correction2) + eps
    update = -(step_size * tl.div_rn(m_next, denom) + lr_wd * p)
    p_next = p + update
    accepted = grad_finite & (tl.abs(p_next) <= FLOAT32_MAX)
    if MODE == 2:
        accepted = accepted & (tl.abs(m_next) <= FLOAT32_MAX) & (tl.abs(v_next) <= FLOAT32_MAX)
    store_mask = in_bounds & accepted

    if WRITE_UPDATE:
        tl.store(out_ptr + offsets, tl.where(accepted, update, -0.0), mask=in_bounds)
    else:
        tl.store(out_ptr + offsets, p_next, mask=store_mask)
    if MODE == 2:
        if WRITE_UPDATE:  # a fresh output buffer: rejected elements copy the old state
            m_next = tl.where(accepted, m_next, m)
            v_next = tl.where(accepted, v_next, v)
            store_mask = in_bounds
        tl.store(new_state_ptr + offsets, m_next, mask=store_mask)
        tl.store(new_state_ptr + n_elements + offsets, v_next, mask=store_mask)
    else:
        rms_code = _encode(rms_next, R_SIGNED, R_FRAC, R_BIAS, R_MAX)
        m_code = tl.where(rms_code == 0, tl.zeros_like(rms_code), _encode(m_next, M_SIGNED, M_FRAC, M_BIAS, M_MAX))  # zero-RMS rule
        new_word = (m_code << 16) | rms_code
        if WRITE_UPDATE:
            new_word = tl.where(accepted, new_word, word)
            store_mask = in_bounds
        tl.store(new_state_ptr + offsets, new_word.to(new_state_ptr.dtype.element_ty, bitcast=True), mask=store_mask)
    if COUNT_NONFINITE:
        rejected = tl.sum((in_bounds & ~accepted).to(tl.int32), axis=0)
        tl.atomic_add(nonfinite_ptr, rejected, mask=rejected > 0)


@triton.jit
def adamw_kernel(
    param_ptr, grad_ptr, state_ptr, hparams_ptr, count_ptr, nonfinite_ptr, n_elements,
    out_ptr, new_state_ptr,
    MODE: tl.constexpr, WRITE_UPDATE: tl.constexpr, COUNT_NONFINITE: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One tensor: program i updates elements [i*BLOCK, (i+1)*BLOCK) with 64-bit offsets.

    In place (torch): out_ptr is param_ptr and new_state_ptr is state_ptr. Functional (optax):
    out_ptr receives the update u (p_next = p + u exactly), and new_state_ptr a new state.
    Inputs and scalars come before the outputs because jax-triton appends outputs last.
    """
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _adamw_block(
        param_ptr, grad_ptr, state_ptr, hparams_ptr, count_ptr, nonfinite_ptr, out_ptr, new_state_ptr,
        offsets, n_elements, MODE, WRITE_UPDATE, COUNT_NONFINITE,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
    )


@triton.jit
def adamw_multi_tensor_kernel(
    pointers_ptr, block_tensor_ptr, block_index_ptr, numels_ptr, hparams_ptr, counts_ptr, nonfinite_ptr,
    n_tensors,
    MODE: tl.constexpr, COUNT_NONFINITE: tl.constexpr,
    M_SIGNED: tl.constexpr, M_FRAC: tl.constexpr, M_BIAS: tl.constexpr, M_MAX: tl.constexpr,
    R_SIGNED: tl.constexpr, R_FRAC: tl.constexpr, R_BIAS: tl.constexpr, R_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Many tensors in one launch, in place: program i updates block `block_index[i]` of
    tensor `block_tensor[i]`. `pointers` holds the addresses of every parameter, then every
    gradient, then every state buffer (int64); tensor t has its own hyperparameter row and
    count, so one launch serves several parameter groups.
    """
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    offsets = tl.load(block_index_ptr + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    param_ptr = tl.load(pointers_ptr + t).to(tl.pointer_type(tl.float32))
    grad_ptr = tl.load(pointers_ptr + n_tensors + t).to(tl.pointer_type(tl.float32))
    if MODE == 2:
        state_ptr = tl.load(pointers_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    else:
        state_ptr = tl.load(pointers_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.uint32))
    _adamw_block(
        param_ptr, grad_ptr, state_ptr, hparams_ptr + t * HPARAM_ROW, counts_ptr + t, nonfinite_ptr + t,
        param_ptr, state_ptr, offsets, tl.load(numels_ptr + t), MODE, False, COUNT_NONFINITE,
        M_SIGNED, M_FRAC, M_BIAS, M_MAX, R_SIGNED, R_FRAC, R_BIAS, R_MAX,
    )
