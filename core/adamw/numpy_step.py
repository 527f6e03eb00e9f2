"""The CPU implementation of one AdamW step, in numpy float32, bit-identical to the kernel.

numpy rounds every float32 operation on its own (no FMA contraction) and its float32 sqrt is
correctly rounded, so following the contract's operation order gives the kernel's bits.
Both frontends run this on CPU: torch on zero-copy views, JAX through `jax.pure_callback`.
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from ..codecs import CODE_MASK, SPLIT_MASTER_MAX, read_master, split_master
from .hyperparams import SCALAR_FIELDS, Hyperparams
from .state_format import MOMENT_SHIFT, StateFormat

F32 = np.float32
CHUNK = 1 << 16  # keeps the temporaries in cache


POWER_TABLE = 1024  # exponents derived together: a step then only looks its powers up


@functools.lru_cache(maxsize=16)
def _power_table(base: float, first: int) -> np.ndarray:
    """base**e for e in [first, first + POWER_TABLE), each by square-and-multiply with every
    product rounded to float32 (the contract), vectorized over the exponents."""
    exponents = np.arange(first, first + POWER_TABLE, dtype=np.int64)
    result = np.ones(POWER_TABLE, F32)
    square = np.full(POWER_TABLE, base, F32)
    for _ in range(31):  # the kernel's 31 rounds
        result = np.where((exponents & 1) == 1, result * square, result)
        square = square * square
        exponents >>= 1
    return result


def _float32_power(base: np.float32, exponent: int) -> np.float32:
    """base**exponent exactly as the kernel derives it (FORMAT.md, "Step scalars")."""
    if not 0 <= exponent < 2**31:
        raise ValueError(f"step count {exponent} is outside [0, 2**31)")
    offset = exponent % POWER_TABLE
    return _power_table(float(base), exponent - offset)[offset]


def step_scalar_row(count: int, row, *, maximize: bool = False) -> tuple[np.float32, ...]:
    """The per-step float32 scalars in SCALAR_FIELDS order, derived exactly as the kernel's
    `step_scalars_kernel` derives them; `row` is (lr, b1, b2, eps, weight_decay).

    `maximize` negates `one_minus_b1`: the first moment then takes `(1 - b1) * (-g)`, which
    rounds to the same bits as `-((1 - b1) * g)`, and `g * g` is unchanged, so the step has
    exactly the bits of a step on the negated gradient (torch.optim's `maximize`)."""
    count = operator.index(count)  # a float step count is a mistake, never rounded
    lr, b1, b2, eps, wd = (F32(x) for x in row)
    one = F32(1.0)
    bias_correction1 = F32(one - _float32_power(b1, count))
    bias_correction2 = F32(one - _float32_power(b2, count))
    one_minus_b1 = F32(one - b1)
    return (
        b1, -one_minus_b1 if maximize else one_minus_b1, b2, F32(one - b2),
        F32(lr / bias_correction1),
        F32(one / F32(np.sqrt(bias_correction2))),
        eps,
        F32(lr * wd),
    )


def step_scalars(count: int, hp: Hyperparams) -> dict[str, np.float32]:
    """`step_scalar_row` by name."""
    return dict(zip(SCALAR_FIELDS, step_scalar_row(count, hp.as_float32_list())))


def update_chunk(p, g, state, s, fmt: StateFormat, counts=None, split=False):
    """Returns (update, new_state, accepted) for one chunk; inputs are not modified. With
    `counts` (int64, rule.FORMAT_COUNTS order), adds this chunk's format counts to it.
    `split`: `p` is a split master, and a result past SPLIT_MASTER_MAX is rejected too (its
    live weight would be Inf; FORMAT.md, "Split masters"), before anything is counted."""
    finite_grad = np.isfinite(g)
    g = np.where(finite_grad, g, F32(0.0))
    if fmt.mode == "fp32":
        m, v = state[0], state[1]
    else:
        m_fmt, r_fmt = fmt.formats
        m = m_fmt.decode_table[state >> np.uint32(MOMENT_SHIFT)]
        rms = r_fmt.decode_table[state & np.uint32(CODE_MASK)]
        v = rms * rms
    m_next = s["b1"] * m + s["one_minus_b1"] * g
    v_next = s["b2"] * v + s["one_minus_b2"] * (g * g)
    rms_next = np.sqrt(v_next)
    denom = rms_next * s["inv_sqrt_bias_correction2"] + s["eps"]
    update = -(s["step_size"] * (m_next / denom) + s["lr_wd"] * p)
    accepted = finite_grad & np.isfinite(p + update)
    if split:
        accepted &= np.abs(p + update) <= F32(SPLIT_MASTER_MAX)
    if fmt.mode == "fp32":
        accepted &= np.isfinite(m_next) & np.isfinite(v_next)
        new_state = np.stack([m_next, v_next])
    else:
        rms_code = r_fmt.encode_unchecked(rms_next)
        m_code = m_fmt.encode_unchecked(m_next)
        m_code = np.where(rms_code == 0, np.uint32(0), m_code)  # zero-RMS rule (FORMAT.md)
        new_state = (m_code << np.uint32(MOMENT_SHIFT)) | rms_code
        if counts is not None:
            counts += format_counts(m_next, rms_next, m_code, rms_code, accepted, m_fmt, r_fmt)
    return update, new_state, accepted


def format_counts(m, rms, m_code, rms_code, accepted, m_fmt, r_fmt) -> np.ndarray:
    """The format counts of FORMAT.md ("Format counts") over the accepted elements, in
    rule.FORMAT_COUNTS order: saturated (the value lay beyond the largest code), flushed (a
    nonzero value stored as code 0, the zero-RMS rule included), subnormal (a nonzero code
    with exponent field 0); for the first moment, then the RMS."""
    out = np.zeros(6, np.int64)
    for k, (value, code, fmt) in enumerate(((m, m_code, m_fmt), (rms, rms_code, r_fmt))):
        magnitude = code & np.uint32(CODE_MASK & ~fmt.sign_bit)
        with np.errstate(over="ignore", invalid="ignore"):  # rejected elements may hold anything
            beyond = fmt.unsaturated_code(np.abs(value).astype(np.float32)) > fmt.max_magnitude_code
        out[0 + k] = np.count_nonzero(accepted & beyond)
        out[2 + k] = np.count_nonzero(accepted & (value != 0) & (magnitude == 0))
        out[4 + k] = np.count_nonzero(accepted & (magnitude != 0) & ((magnitude >> np.uint32(fmt.fraction_bits)) == 0))
    return out


def adamw_step(param, grad, state, *, count: int, hp: Hyperparams, fmt: StateFormat, update_out=None) -> int:
    """One step over flat float32 `param`, `grad` and `state`, in place.

    `state` is uint32 words of shape [n] (packed, fp16) or float32 of shape [2, n] (fp32).
    With `update_out`, the update u is written there and `param` is left alone (optax);
    otherwise param += u. Elements whose gradient (or result) is not finite keep their
    parameter and state and get u = -0.0. Returns how many elements were so rejected.
    """
    return apply_step(param, grad, state, step_scalar_row(count, hp.as_float32_list()), fmt=fmt, update_out=update_out)


def apply_step(param, grad, state, scalars, *, fmt: StateFormat, update_out=None, format_counts_out=None) -> int:
    """`adamw_step` with the step scalars already derived (`step_scalar_row`): the frontends
    validate hyperparameters when they change and derive each distinct row once per step.
    `format_counts_out` (int64 [6], packed and fp16 modes): the step adds its format counts."""
    s = dict(zip(SCALAR_FIELDS, scalars))
    rejected = 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for start in range(0, param.shape[0], CHUNK):
            sl = slice(start, start + CHUNK)
            chunk_state = state[:, sl] if fmt.mode == "fp32" else state[sl]
            update, new_state, accepted = update_chunk(param[sl], grad[sl], chunk_state, s, fmt, format_counts_out)
            update = np.where(accepted, update, F32(-0.0))  # p + (-0.0) == p for every p
            rejected += int(accepted.size - np.count_nonzero(accepted))
            chunk_state[...] = np.where(accepted, new_state, chunk_state)
            if update_out is None:
                param[sl] = np.where(accepted, param[sl] + update, param[sl])
            else:
                update_out[sl] = update
    return rejected


def adamw_split_step(weight_bits, low_half, grad, state, *, count: int, hp: Hyperparams, fmt: StateFormat) -> int:
    """`apply_split_step` with the step scalars derived from `count` and `hp`."""
    return apply_split_step(weight_bits, low_half, grad, state, step_scalar_row(count, hp.as_float32_list()), fmt=fmt)


def apply_split_step(weight_bits, low_half, grad, state, scalars, *, fmt: StateFormat, format_counts_out=None) -> int:
    """One step of a bf16 parameter held as a split master (FORMAT.md, "Split masters"), in place.

    `weight_bits`: the bf16 live weights' bits, flat uint16 [n] (or the int16 view of the same
    bits: a torch bf16 tensor's `.view(torch.int16).numpy()`); `low_half`: flat int16 [n] (the
    state entry `fmt.low_half_key`); `grad`: flat float32 [n] values, or bf16 gradients as their
    bits in uint16/int16 [n], upcast exactly (bits << 16); `state` and `scalars` as in
    `apply_step`. The master join(weight, low half) takes exactly `apply_step`'s step; an element
    is rejected when that step rejects it or when the new master is past SPLIT_MASTER_MAX. A
    rejected element keeps its weight, low half and state; an accepted one gets the split of
    the new master. Returns the number rejected; `format_counts_out` as in `apply_step`.
    """
    weights, lows = _bits16_array(weight_bits, "weight_bits"), _bits16_array(low_half, "low_half").view(np.int16)
    n = weights.shape[0]
    state_length = state.shape[-1] if fmt.mode == "fp32" else state.shape[0]
    for name, length in (("low_half", lows.shape[0]), ("grad", np.shape(grad)[0]), ("state", state_length)):
        if length != n:
            raise ValueError(f"{name} has {length} elements but weight_bits has {n}; pass one per parameter element")
    bf16_grad = _gradient_is_bf16_bits(grad)
    s = dict(zip(SCALAR_FIELDS, scalars))
    rejected = 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for start in range(0, n, CHUNK):
            sl = slice(start, start + CHUNK)
            master = read_master(weights[sl], lows[sl])
            g = (grad[sl].view(np.uint16).astype(np.uint32) << np.uint32(16)).view(F32) if bf16_grad else grad[sl]
            chunk_state = state[:, sl] if fmt.mode == "fp32" else state[sl]
            update, new_state, accepted = update_chunk(master, g, chunk_state, s, fmt, format_counts_out, split=True)
            rejected += int(accepted.size - np.count_nonzero(accepted))
            chunk_state[...] = np.where(accepted, new_state, chunk_state)
            # A rejected element rewrites its own weight and low half: split(join(w, lo)) == (w, lo).
            weights[sl], lows[sl] = split_master(np.where(accepted, master + update, master))
    return rejected


def _bits16_array(array, name: str) -> np.ndarray:
    """A flat uint16/int16 array as uint16 (a view, so in-place writes reach the caller)."""
    if not isinstance(array, np.ndarray) or array.dtype not in (np.uint16, np.int16) or array.ndim != 1:
        raise TypeError(f"{name} must be a flat uint16 or int16 numpy array (bf16 bits or the low half), got "
                        f"{type(array).__name__} {getattr(array, 'dtype', '')} {np.shape(array)}")
    return array.view(np.uint16)


def _gradient_is_bf16_bits(grad) -> bool:
    dtype = getattr(grad, "dtype", None)
    if dtype == np.float32:
        return False
    if dtype in (np.uint16, np.int16):
        return True
    raise TypeError(f"grad must be float32 values or bf16 bits as uint16/int16, got dtype {dtype}; "
                    "pass a torch bf16 gradient as .view(torch.int16).numpy()")
