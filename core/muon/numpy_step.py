"""Muon's two elementwise phases on the CPU, in numpy float32, bit for bit as docs/MUON.md says
(the float32 operations they are made of: `float32.py`)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..codecs import SPLIT_MASTER_MAX, read_master, split_master
from .float32 import F32, bf16_bits, bf16_values, floor_log2, fma32, ldexp32, lerp32
from .hyperparams import SCALAR_FIELDS
from .state_format import AMAX_EXPONENT_FIELD, StateFormat

BF16_EXPONENT_MASK = 0x7F80


def matrix_exponent(amax, old: int, fmt: StateFormat) -> int:
    """Packed mode's new exponent of a matrix whose largest |m'| is `amax` (float32): the one
    that puts amax * 2**-s in [2**(30 - B), 2**(31 - B)), exponent field 30 of the code
    (B = mu_bias: the codes are the same for every bias); the old one when amax is 0."""
    if amax == 0:
        return int(old)
    return floor_log2(amax) + fmt.mu_bias - AMAX_EXPONENT_FIELD


def decode_momentum(state, fmt: StateFormat, exponent=0) -> np.ndarray:
    """The momentum values of a stored entry: packed codes times 2**exponent (the matrix's, an
    integer; 0 for a state saved before the exponents), bf16 bits widened, fp32 values as they
    are. An exponent no step stores (outside `fmt.exponent_range`) is refused naming it
    (`StateFormat.check_exponent`); the values are not checked: past float32's range they are Inf."""
    if fmt.mode == "fp32":
        return np.asarray(state, F32)
    if fmt.mode == "bf16":
        return bf16_values(state)
    exponent = np.asarray(exponent)
    exponent = int(fmt.check_exponent(exponent[()] if exponent.ndim == 0 and exponent.dtype.kind in "iu" else exponent,
                                      "decode_momentum: the exponent", remedy="pass the matrix's stored exponent "
                                      f"(its {fmt.exponent_entry.key!r} entry)"))
    return ldexp32(fmt.code.decode_table[np.asarray(state).astype(np.intp)], exponent)


def _finite_bf16(bits) -> np.ndarray:
    return (bits & np.uint16(BF16_EXPONENT_MASK)) != np.uint16(BF16_EXPONENT_MASK)


class MomentumUpdate(NamedTuple):
    """An accepted matrix's phase 1 before its momentum is stored (`momentum_update`)."""

    m_next: np.ndarray  # m' (float32)
    ns_bits: np.ndarray  # the Newton-Schulz input X as bf16 bits (uint16)
    stored: np.ndarray | None  # bf16 and fp32 modes: the new state entry; packed mode: None (waits for amax)
    amax: np.float32  # max |m'| over these elements (0 when there are none)


def momentum_phase(grad, state, scalars, *, fmt: StateFormat, exponent=None, nesterov: bool = True,
                   maximize: bool = False, format_counts_out=None):
    """Phase 1 of one matrix's step, in place on `state` and `exponent` (MUON.md, "The momentum
    phase"): `momentum_update`, then, if the matrix is accepted, `commit_momentum`.

    `grad`: the matrix's gradient, float32, or bf16 bits as uint16/int16 (upcast exactly);
    `state`: the momentum entry of the same shape (uint16 codes, or float32 in fp32 mode);
    `exponent` (packed mode only): the matrix's int32 exponent, a one-element array;
    `scalars`: `hyperparams.step_scalar_row`. Returns the Newton-Schulz input as bf16 bits
    (uint16, the gradient's shape), or None when the matrix is refused: a non-finite gradient,
    momentum or Newton-Schulz input anywhere in it. A refused matrix's state is left as it was.
    `format_counts_out` (int64 [3], packed mode): adds the accepted matrix's format counts."""
    update = momentum_update(grad, state, scalars, fmt=fmt, exponent=exponent, nesterov=nesterov, maximize=maximize)
    if update is None:
        return None
    commit_momentum(update, state, fmt=fmt, exponent=exponent, format_counts_out=format_counts_out)
    return update.ns_bits


def momentum_update(grad, state, scalars, *, fmt: StateFormat, exponent=None, nesterov: bool = True,
                    maximize: bool = False) -> MomentumUpdate | None:
    """`momentum_phase` up to the store: m' and X of these elements (a whole matrix, or one
    shard of it), or None where one of them refuses the matrix. Writes nothing."""
    s = dict(zip(SCALAR_FIELDS, scalars))
    g = _gradient_values(grad)
    state = _state_array(state, fmt)
    old = _exponent_array(exponent, fmt)
    if state.shape != g.shape:
        raise ValueError(f"state has shape {np.shape(state)} but the gradient has {g.shape}; pass one momentum "
                         "value per gradient element")
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(g).all():
            return None
        if maximize:
            g = -g
        m_next = lerp32(decode_momentum(state, fmt, 0 if old is None else old[()]), g, s["one_minus_momentum"])
        if not np.isfinite(m_next).all():
            return None
        ns_in = lerp32(g, m_next, s["momentum"]) if nesterov else m_next
        ns_bits = bf16_bits(ns_in)
        if not np.isfinite(ns_in).all() or not _finite_bf16(ns_bits).all():
            return None
        amax = np.abs(m_next).max(initial=F32(0))
        stored = None
        if fmt.mode == "fp32":
            stored = m_next
        elif fmt.mode == "bf16":
            stored = bf16_bits(m_next)
            if not _finite_bf16(stored).all():
                return None
    return MomentumUpdate(m_next, ns_bits, stored, F32(amax))


def commit_momentum(update: MomentumUpdate, state, *, fmt: StateFormat, exponent=None, amax=None,
                    format_counts_out=None) -> None:
    """Stores an accepted update's m' in `state`. Packed mode: the matrix's new exponent, from
    `amax` (the whole matrix's largest |m'|: by default the update's own; the shards of a
    sharded matrix pass the maximum over all of them), into `exponent`, and the codes of
    m' * 2**-s; `format_counts_out` adds their format counts."""
    state = _state_array(state, fmt)
    old = _exponent_array(exponent, fmt)
    if fmt.mode != "packed":
        state[...] = update.stored
        return
    new = matrix_exponent(update.amax if amax is None else F32(amax), old[()], fmt)
    scaled = ldexp32(update.m_next, -new)
    codes = fmt.code.encode_unchecked(scaled).astype(np.uint16)
    if format_counts_out is not None:
        format_counts_out += format_counts(update.m_next, scaled, codes, fmt)
    state[...] = codes
    old[...] = new


def format_counts(m_next, scaled, codes, fmt: StateFormat) -> np.ndarray:
    """MUON.md, "Format counts", in rule.FORMAT_COUNTS order, on the values as encoded (m' *
    2**-s, `scaled`): saturated (beyond the largest code), flushed (a nonzero m' stored as
    code 0), subnormal (a nonzero code with exponent 0)."""
    code = fmt.code
    magnitude = codes.astype(np.uint32) & np.uint32(code.sign_bit - 1)
    beyond = code.unsaturated_code(np.abs(scaled).astype(F32)) > code.max_magnitude_code
    return np.array([
        np.count_nonzero(beyond),
        np.count_nonzero((m_next != 0) & (magnitude == 0)),
        np.count_nonzero((magnitude != 0) & ((magnitude >> np.uint32(code.fraction_bits)) == 0)),
    ], np.int64)


def ortho_finite(ortho) -> bool:
    """Whether Newton-Schulz's output O (float32, or bf16 bits as uint16/int16) is finite in every
    element. A matrix whose O is not (coefficients that pass `validate_ns` can still overflow) is
    refused whole, as a non-finite gradient refuses it (MUON.md, "The matrix is refused"): its
    momentum and exponent are stored only after this check (`momentum_update`, Newton-Schulz,
    this, then `commit_momentum` and the weight phase)."""
    ortho = np.asarray(ortho)
    if ortho.dtype in (np.uint16, np.int16):
        return bool(_finite_bf16(ortho.view(np.uint16)).all())
    return bool(np.isfinite(ortho).all())


def weight_phase(param, ortho, scalars) -> int:
    """Phase 2 of one matrix's step on FP32 weights, in place (MUON.md, "The weight phase"):
    p' = fma(neg_adjusted_lr, O, p * decay). `ortho`: Newton-Schulz's output O, float32 or bf16
    bits (uint16/int16). An element whose p' is not finite keeps its weight. Returns how many."""
    s = dict(zip(SCALAR_FIELDS, scalars))
    o = _ortho_values(ortho, np.shape(param))
    with np.errstate(over="ignore", invalid="ignore"):
        p_next = fma32(s["neg_adjusted_lr"], o, param * s["decay"])
        accepted = np.isfinite(p_next)
    param[...] = np.where(accepted, p_next, param)
    return int(accepted.size - np.count_nonzero(accepted))


def weight_phase_split(weight_bits, low_half, ortho, scalars) -> int:
    """`weight_phase` for a bf16 parameter held as a split master (FORMAT.md, "Split masters"),
    in place on its bf16 bits (uint16/int16) and int16 low half: the master read(w, lo) takes
    the FP32 step; a result past SPLIT_MASTER_MAX is rejected like a non-finite one."""
    weights, lows = np.asarray(weight_bits).view(np.uint16), np.asarray(low_half).view(np.int16)
    if lows.shape != weights.shape:
        raise ValueError(f"low_half has shape {lows.shape} but weight_bits has {weights.shape}")
    s = dict(zip(SCALAR_FIELDS, scalars))
    o = _ortho_values(ortho, weights.shape)
    master = read_master(weights, lows)
    with np.errstate(over="ignore", invalid="ignore"):
        p_next = fma32(s["neg_adjusted_lr"], o, master * s["decay"])
        accepted = np.isfinite(p_next) & (np.abs(p_next) <= F32(SPLIT_MASTER_MAX))
    weights[...], lows[...] = split_master(np.where(accepted, p_next, master))
    return int(accepted.size - np.count_nonzero(accepted))


def newton_schulz_reference(x, coefficients=(3.4445, -4.775, 2.0315), steps=5, eps=1e-7) -> np.ndarray:
    """A float32 Newton-Schulz for documentation and tests: no bits are promised (MUON.md).
    X / max(||X||_F, eps), wide orientation, then `steps` times X <- a X + (b A + c A A) X."""
    a, b, c = (F32(v) for v in coefficients)
    x = np.asarray(x, F32)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(F32(np.linalg.norm(x)), F32(eps))
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x.T if tall else x).astype(F32)


def _state_array(state, fmt: StateFormat) -> np.ndarray:
    """The momentum entry as the phase reads and writes it (a view: writes reach the caller):
    uint16 codes (an int16 view of them, as torch holds 16-bit bits, is read as its bits) or
    float32 in fp32 mode."""
    if not isinstance(state, np.ndarray):
        raise TypeError(f"state must be a numpy array (the {fmt.state_key!r} entry), got {type(state).__name__}")
    if fmt.mode == "fp32" and state.dtype == F32:
        return state
    if fmt.mode != "fp32" and state.dtype in (np.uint16, np.int16):
        return state.view(np.uint16)
    raise TypeError(f"state has dtype {state.dtype} but {fmt.identity} keeps {fmt.state_dtype} "
                    f"(the {fmt.state_key!r} entry); pass the entry this state format created")


def _exponent_array(exponent, fmt: StateFormat) -> np.ndarray | None:
    """Packed mode's exponent as the phase reads and writes it (a 0-d view: writes reach the
    caller); None in the other modes, which have none."""
    if fmt.mode != "packed":
        if exponent is not None:
            raise TypeError(f"exponent: {fmt.identity} keeps no exponent; pass exponent=None")
        return None
    if not isinstance(exponent, np.ndarray) or exponent.dtype != np.int32 or exponent.size != 1:
        raise TypeError(f"exponent must be the matrix's int32 exponent (the {fmt.exponent_entry.key!r} entry) as a "
                        f"one-element numpy array, got {exponent!r}; {fmt.identity} stores one per matrix")
    return exponent.reshape(())


def _gradient_values(grad) -> np.ndarray:
    grad = np.asarray(grad)
    if grad.dtype == F32:
        return grad
    if grad.dtype in (np.uint16, np.int16):
        return bf16_values(grad)
    raise TypeError(f"grad must be float32 values or bf16 bits as uint16/int16, got dtype {grad.dtype}; "
                    "pass a torch bf16 gradient as .view(torch.int16).numpy()")


def _ortho_values(ortho, shape) -> np.ndarray:
    ortho = np.asarray(ortho)
    if ortho.shape != tuple(shape):
        raise ValueError(f"ortho has shape {ortho.shape} but the parameter has {tuple(shape)}")
    if ortho.dtype in (np.uint16, np.int16):
        return bf16_values(ortho)
    if ortho.dtype != F32:
        raise TypeError(f"ortho must be float32 or bf16 bits as uint16/int16, got dtype {ortho.dtype}")
    return ortho
