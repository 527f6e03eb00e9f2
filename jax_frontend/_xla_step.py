"""The AdamW step written in jax.numpy and lax bit operations: an XLA-native elementwise step.

`xla_step` takes the step primitive's operands and config (`_step.StepOperands`,
`_step.StepConfig`) and returns its results (`_step.StepResults`), so the transform calls it
where it would call `_sharding.sharded_step` (`impl="xla"`, and `impl="auto"` on CUDA GPUs).
Being ordinary XLA operations, it fuses with what surrounds it (`optax.apply_updates`, the gradient's producer) and is partitioned by XLA like any
elementwise computation; the primitive's Triton kernel and numpy callback can do neither.

It follows docs/FORMAT.md ("The step", "Split masters") operation for operation, in the order
of `core/adamw/numpy_step.update_chunk`, each float32 operation rounded on its own. What stands
between XLA and those bits (measured on CPU, jax 0.10.2; tests/jax_frontend/test_jax_xla_step.py checks each):

- **FMA contraction.** XLA's CPU backend contracts `a * b + c` into one fused multiply-add:
  `jit(lambda a, b, c: a * b + c)` on a = b = 1 + 2**-12, c = -(1 + 2**-11) gives 2**-24, the
  fused result, where numpy gives 0; the optimized HLO keeps multiply and add apart, LLVM fuses
  them (vfmadd in the object code). Every product that feeds a sum therefore goes through
  `_rounded`: its bits are OR'ed with a zero XLA cannot know is zero, the count's sign bit
  (`contraction_guard`), so the rounded product must exist before the sum. A constant zero does
  not do: XLA folds it even behind `lax.optimization_barrier`. Whether the GPU backend
  contracts is what `contraction_barriers=False` and the `cuda` tests measure.
- **Algebraic rewrites.** XLA's simplifier turns `1 / sqrt(x)` into `rsqrt(x)` (other bits at
  count 7) and `(x + 2**23) - 2**23` into `x`: the step scalars hide the square root behind the
  same guard, and `encode` reads the rounded integer from the sum's bits.
- **Subnormals on CPU.** XLA's CPU runtime runs compiled code with FTZ and DAZ set (as it does
  its callbacks: `_step._subnormals_kept`), so a float32 operation with a subnormal input or
  result gives 0 where numpy gives the subnormal; no flag turns it off. `decode` and `encode`
  never need a float subnormal (normal codes are built with integer operations, subnormal codes
  from a normal intermediate), but the arithmetic on subnormal parameters, gradients and
  products cannot avoid them: on CPU this step has the bits of the numpy step run under
  FTZ/DAZ, which differ from the contract only where a subnormal arises. The numpy callback
  (`_step.py`) therefore stays the CPU step. XLA's GPU backend is expected to keep float32
  subnormals (`--xla_gpu_ftz` defaults to off); the `cuda` tests check it and compare with the
  contract itself.
- **Division and square root on the GPU.** XLA's GPU backend does not round float32 division
  and square root correctly (measured on an H100, jax 0.11.2, by
  benchmarks/investigations/xla_gpu_rounding.py: `a / b` 1 ulp off in 19,041 of 65,536 random
  elements, `sqrt(x)` in 11,028), so both are computed in float64 and rounded once to float32
  (`_divide`, `_sqrt`): a float64 quotient or square root of float32 operands, rounded to
  float32, is the correctly rounded float32 result (53 >= 2 * 24 + 2 bits, so the double
  rounding is innocuous). Their float64 operands carry the guard too (`_widened`): LLVM
  otherwise narrows the float64 division of widened float32 values back to a float32 one
  (measured: the same 19,041 elements off, though the optimized HLO divides in float64). With
  that the `cuda` tests pass: the step gives the contract's bits on an H100 (2026-12-06).

On CPU XLA splits the step into several loop fusions with float32 temporaries between them
(12 bytes per parameter in benchmarks/jax_xla_step.py). On an H100 its temporaries in a jitted
train step were optax.adamw's (0.50 bytes per parameter; docs/results/JAX_XLA_STEP.md).

Format counts (`track_format`) are not implemented here; the config is refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from packed_adamw.core.adamw.hyperparams import SCALAR_INDEX
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT
from packed_adamw.core.codecs import CODE_MASK, SPLIT_MASTER_MAX, MiniFloat

from . import _masters
from ._step import StepConfig, StepOperands, StepResults

F32 = jnp.float32
U32 = jnp.uint32
FLOAT32_SIGN_BIT = np.uint32(0x80000000)
POWER_ROUNDS = 31  # square-and-multiply over the count's 31 low bits (FORMAT.md, "Step scalars")
_MAGIC = np.float32(2.0**23)  # adding it rounds a float in [0, 2**23] to an integer, ties to even
_MAGIC_BITS = np.uint32(0x4B000000)  # 2**23's bits: OR'ed with n < 2**23 it is the float 2**23 + n


def contraction_guard(count):
    """A uint32 zero that XLA cannot prove is zero, from the step count (int32, >= 0): its sign
    bit. The operand of `_opaque`'s OR.

    The value must come from a runtime input: a constant zero is folded into the fusion even
    behind `lax.optimization_barrier` (measured on CPU, jax 0.10.2: the OR with constant 0 is
    dropped and LLVM contracts the sum), whereas an OR with a loaded value reaches LLVM (and on
    GPU ptxas) as an OR with an unknown register, across which no multiply-add can be fused.
    The transform's count is always read from the optimizer state, so it is such a value."""
    return lax.shift_right_logical(lax.bitcast_convert_type(jnp.asarray(count, jnp.int32).reshape(()), U32),
                                   np.uint32(31))


def _rounded(x, guard):
    """`x`, a product, as its rounded float32 value: never fused into a following add.
    With `guard=None` (`contraction_barriers=False`) x itself, for what the compiler makes of it."""
    return x if guard is None else _opaque(x, guard)


def _opaque(x, guard):
    """float32 `x`, its bits OR'ed with the zero `guard` (`contraction_guard`): the same value,
    which no compiler pass can combine with the operation that made it."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, U32) | guard, F32)


def _negated(x):
    """-x by its sign bit: a compiled negation may become 0 - x, which turns -0.0 into +0.0
    (the kernel flips the bit for the same reason)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, U32) ^ FLOAT32_SIGN_BIT, F32)


def _float64_scope():
    """A scope in which jnp makes float64 arrays (jax_enable_x64 for the traced operations only)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # older jax
        from jax.experimental import enable_x64 as enable
        return enable()
    return enable(True)


def _widened(x, guard):
    """float32 `x` as float64, its bits OR'ed with the zero `guard` (None: plainly converted).

    LLVM's instruction combiner narrows `fptrunc(fdiv(fpext a, fpext b))` to a float32 `fdiv a,
    b`, a legal rewrite (the double rounding is innocuous), which XLA's GPU backend then lowers
    to its float32 division, not correctly rounded. Measured on an H100 (jax 0.11.2,
    2026-12-06): the float64 division of widened float32 operands differed from the correctly
    rounded quotient in 19,041 of 65,536 elements, the count of the float32 division, though the
    optimized HLO divides in float64. An operand that is not recognisably a widened float32
    cannot be narrowed."""
    wide = x.astype(jnp.float64)
    if guard is None:
        return wide
    bits = lax.bitcast_convert_type(wide, jnp.uint64) | guard.astype(jnp.uint64)
    return lax.bitcast_convert_type(bits, jnp.float64)


def _divide(a, b, guard):
    """float32 a / b, correctly rounded: in float64 (`_widened` operands), then rounded once."""
    with _float64_scope():
        return (_widened(a, guard) / _widened(b, guard)).astype(F32)


def _sqrt(x, guard):
    """float32 sqrt(x), correctly rounded: in float64 (a `_widened` operand), then rounded once."""
    with _float64_scope():
        return jnp.sqrt(_widened(x, guard)).astype(F32)


# ---------------------------------------------------------------------------------------------
# The 16-bit codes (FORMAT.md, "The two formats"; core/codecs.py MiniFloat)
# ---------------------------------------------------------------------------------------------
def decode(code, fmt: MiniFloat):
    """uint32 codes (< 2**16) -> float32 values, every exponent code read with the finite
    formula (`MiniFloat.decode_table`: FP16's Inf/NaN codes read as numbers too).

    No float operation sees a subnormal, so the result is exact under FTZ/DAZ as well: a normal
    code's value is a normal float32 (bias <= 100) built by moving the code's exponent and
    fraction into float32's fields with integer operations; a subnormal code's fraction f
    becomes the float (2**23 + f) - 2**23 = f, times 2**(1 - bias - fraction bits), a normal
    float32 or zero."""
    frac_bits = fmt.fraction_bits
    magnitude = code & np.uint32(CODE_MASK & ~fmt.sign_bit)
    exponent = magnitude >> np.uint32(frac_bits)
    fraction = magnitude & np.uint32((1 << frac_bits) - 1)
    normal = (magnitude << np.uint32(23 - frac_bits)) + np.uint32((127 - fmt.bias) << 23)
    fraction_value = lax.bitcast_convert_type(fraction | _MAGIC_BITS, F32) - _MAGIC
    subnormal = lax.bitcast_convert_type(fraction_value * np.float32(fmt.min_subnormal), U32)
    bits = jnp.where(exponent > 0, normal, subnormal)
    if fmt.signed:  # the sign moves across as a bit: code 0x8000 is -0.0
        bits = bits | ((code & np.uint32(fmt.sign_bit)) << np.uint32(16))  # bit 15 -> bit 31
    return lax.bitcast_convert_type(bits, F32)


def encode(values, fmt: MiniFloat):
    """float32 values (no NaN; no negatives if unsigned) -> uint32 codes: round to nearest
    even, saturate at the largest finite code, zero (either sign) to code 0. The operations of
    `MiniFloat.unsaturated_code` and `encode_unchecked`, in int32 as there."""
    magnitude = jnp.abs(values)
    bits = lax.bitcast_convert_type(magnitude, jnp.int32)
    drop = 23 - fmt.fraction_bits
    rebased = bits - np.int32((127 - fmt.bias) << 23)
    normal = (rebased + np.int32((1 << (drop - 1)) - 1) + ((rebased >> drop) & 1)) >> drop
    # Subnormal codes: the magnitude in units of the smallest subnormal, rounded to an integer
    # by adding 2**23 (ties to even). The sum lies in [2**23, 2**24], where a float32's bits are
    # 2**23's plus that integer: read it with an integer subtraction. Not numpy's
    # `(x + 2**23) - 2**23`: XLA's algebraic simplifier (every backend) folds that back to x
    # (measured: the optimized HLO is a copy, and the codes came out truncated). The product is
    # exact (a power of two; a magnitude it would make subnormal gives code 0 flushed or not),
    # so a contracted multiply-add rounds as the sum does.
    scaled = jnp.minimum(magnitude * np.float32(np.ldexp(1.0, fmt.fraction_bits - 1 + fmt.bias)), _MAGIC)
    subnormal = lax.bitcast_convert_type(scaled + _MAGIC, jnp.int32) - lax.bitcast_convert_type(_MAGIC, jnp.int32)
    unsaturated = jnp.where(magnitude >= np.float32(fmt.min_normal), normal, subnormal)
    code = lax.bitcast_convert_type(jnp.minimum(unsaturated, np.int32(fmt.max_magnitude_code)), U32)
    if fmt.signed:
        code = jnp.where((values < 0) & (code != 0), code | np.uint32(fmt.sign_bit), code)
    return code


# ---------------------------------------------------------------------------------------------
# Step scalars (FORMAT.md, "Step scalars"; numpy_step.step_scalar_row)
# ---------------------------------------------------------------------------------------------
def _float32_power(base, exponent, guard):
    """base**exponent (float32 [...], int32 scalar in [0, 2**31)) by the contract's
    square-and-multiply, every product rounded."""
    result = jnp.ones_like(base)
    square = base
    for _ in range(POWER_ROUNDS):
        result = jnp.where((exponent & 1) == 1, _rounded(result * square, guard), result)
        square = _rounded(square * square, guard)
        exponent = exponent >> 1
    return result


def step_scalars(hparams, count, guard):
    """[rows, 5] float32 hyperparameter rows and the int32 count after the step -> [rows, 8]
    float32 step scalars in SCALAR_FIELDS order."""
    hparams = hparams.astype(F32)
    lr, b1, b2, eps, wd = (hparams[:, i] for i in range(5))
    count = jnp.asarray(count, jnp.int32).reshape(())
    one = np.float32(1.0)
    bias_correction1 = one - _float32_power(b1, count, guard)
    bias_correction2 = one - _float32_power(b2, count, guard)
    # XLA's algebraic simplifier rewrites 1 / sqrt(x) into rsqrt(x), one differently rounded
    # operation (measured on CPU: other bits at count 7); the guard keeps the two roundings.
    sqrt_bias_correction2 = _opaque(_sqrt(bias_correction2, guard), contraction_guard(count))
    fields = dict(b1=b1, one_minus_b1=one - b1, b2=b2, one_minus_b2=one - b2,
                  step_size=_divide(lr, bias_correction1, guard),
                  inv_sqrt_bias_correction2=_divide(jnp.full_like(sqrt_bias_correction2, one), sqrt_bias_correction2,
                                                    guard),
                  eps=eps, lr_wd=lr * wd)
    columns = [None] * len(SCALAR_INDEX)
    for name, index in SCALAR_INDEX.items():
        columns[index] = fields[name]
    # A barrier, so that XLA derives the few scalars once instead of fusing their 90-odd
    # operations into every element of the elementwise step.
    return lax.optimization_barrier(jnp.stack(columns, axis=1))


# ---------------------------------------------------------------------------------------------
# The step (FORMAT.md, "The step"; numpy_step.update_chunk)
# ---------------------------------------------------------------------------------------------
def element_step(p, g, m, v_or_rms, s, fmt, *, split: bool, guard):
    """(update, p + update, m', v' or rms', accepted) for float32 p, g and the decoded moments;
    `s` maps the scalar names to float32 scalars; `v_or_rms` is v in fp32 mode (then v' is
    returned), else the decoded RMS (then rms')."""
    finite_grad = jnp.isfinite(g)
    g = jnp.where(finite_grad, g, np.float32(0.0))
    v = v_or_rms if fmt.mode == "fp32" else v_or_rms * v_or_rms
    r = lambda x: _rounded(x, guard)  # noqa: E731
    m_next = r(s["b1"] * m) + r(s["one_minus_b1"] * g)
    v_next = r(s["b2"] * v) + r(s["one_minus_b2"] * (g * g))
    rms_next = _sqrt(v_next, guard)
    denom = r(rms_next * s["inv_sqrt_bias_correction2"]) + s["eps"]
    update = _negated(r(s["step_size"] * _divide(m_next, denom, guard)) + r(s["lr_wd"] * p))
    p_next = p + update
    accepted = finite_grad & jnp.isfinite(p_next)
    if split:
        accepted &= jnp.abs(p_next) <= np.float32(SPLIT_MASTER_MAX)
    if fmt.mode == "fp32":
        accepted &= jnp.isfinite(m_next) & jnp.isfinite(v_next)
        return update, p_next, m_next, v_next, accepted
    return update, p_next, m_next, rms_next, accepted


def leaf_step(p, g, state, scalars, fmt, *, write_update: bool, low_half=None, guard=None):
    """One leaf: (out, new state, new low half or None), as the step primitive returns them.

    `p` float32 (or a bf16 weight with its int16 `low_half`: a split master), `g` float32 (or
    bf16 for a split leaf), `state` uint32 words of p's shape (packed, fp16) or float32
    [2, *shape] (fp32), `scalars` the leaf's float32 [8] row. `out` is the update (write_update)
    or the new parameter; for a split leaf always the new bf16 weight."""
    s = {name: scalars[i] for name, i in SCALAR_INDEX.items()}
    split = low_half is not None
    if split:
        master = _masters.read(p, low_half)
        if g.dtype == jnp.bfloat16:  # exact: bf16 is float32's top half
            g = lax.bitcast_convert_type(_masters.bits16(g).astype(U32) << np.uint32(16), F32)
    else:
        master = p
    if fmt.mode == "fp32":
        m, second = state[0], state[1]
    else:
        m_fmt, r_fmt = fmt.formats
        m = decode(state >> np.uint32(MOMENT_SHIFT), m_fmt)
        second = decode(state & np.uint32(CODE_MASK), r_fmt)
    update, p_next, m_next, second_next, accepted = element_step(master, g, m, second, s, fmt, split=split,
                                                                 guard=guard)
    if fmt.mode == "fp32":
        new_state = jnp.where(accepted, jnp.stack([m_next, second_next]), state)
    else:
        rms_code = encode(second_next, r_fmt)
        m_code = jnp.where(rms_code == 0, np.uint32(0), encode(m_next, m_fmt))  # the zero-RMS rule
        new_state = jnp.where(accepted, (m_code << np.uint32(MOMENT_SHIFT)) | rms_code, state)
    if split:
        w_next, lo_next = _masters.split(jnp.where(accepted, p_next, master))
        return w_next, new_state, lo_next
    if write_update:
        return jnp.where(accepted, update, np.float32(-0.0)), new_state, None
    return jnp.where(accepted, p_next, p), new_state, None


def xla_step(operands: StepOperands, *, config: StepConfig, contraction_barriers: bool = True) -> StepResults:
    """The step primitive's results (`_step.local_step`), computed by XLA operations.

    A drop-in for `_sharding.sharded_step` wherever `config.track_format` is off: the same
    operands, the same results (new states and low halves of the inputs' shapes; outs the
    update, new parameter or new bf16 weight). Sharded leaves need no shard_map: every
    operation is elementwise and XLA partitions it. `config.multi_tensor` and
    `config.alias_grads` concern kernel launches and are ignored: XLA fuses and places buffers.

    `contraction_barriers=False` leaves the products unguarded (see the module docstring); only
    for measuring what the compiler does, never for training."""
    if config.track_format:
        raise ValueError("packed_adamw: the XLA-native step does not count formats; use the kernel step "
                         "(impl='kernel') with track_format=True")
    guard = contraction_guard(operands.count) if contraction_barriers else None
    rows = step_scalars(operands.hparams, operands.count, guard)
    outs, states, lows = [], [], []
    for p, g, state, low_half, leaf_row in zip(operands.params, operands.grads, operands.states, operands.lows,
                                               config.leaf_rows):
        out, new_state, new_low = leaf_step(p, g, state, rows[leaf_row], config.fmt,
                                            write_update=config.write_update, low_half=low_half, guard=guard)
        outs.append(out)
        states.append(new_state)
        lows.append(new_low)
    return StepResults(outs, states, lows, None)


