"""The seam a rule plugs in at (docs/ARCHITECTURE.md, "How a rule plugs in"), proved by a rule
written here and nowhere else: heavy-ball momentum with a 16-bit momentum code,

    m' = momentum * m + g,    p' = p - (lr * m' + (lr * weight_decay) * p),

m kept as an E5M10 code (core's shared codecs), every float32 operation rounded on its own. This
file holds the whole rule: its declaration (`Rule`), its state format and entry, its step
scalars, its numpy step, its scalar authority, its Triton block step (which the launch skeleton,
core/skeleton.py, calls from every entry point) and step-scalar kernels; then it runs it, with no other file
naming it, through torch's `ElementwiseOptimizer` (eager, compiled, state_dict, capturable on
CUDA) and JAX's `packed_rule` (jit, sharded over 8 CPU devices), and demands equal bits from
all of them.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from packed_adamw.core import authority, launch, skeleton
from packed_adamw.core.codecs import BIAS_RANGE, FLOAT32_MAX, SPLIT_MASTER_MAX, MiniFloat, read_master, split_master
from packed_adamw.core.kernel import (
    ALL_ONES,
    FLOAT32_MAGNITUDE_MASK,
    FLOAT32_SIGN_BIT,
    SPLIT_LO_SIGN,
    SPLIT_MAGNITUDE_MASK,
    code_magnitude,
    decode,
    encode_magnitude,
    finish_code,
    join_master,
    lane_bit,
    masked_load,
    masked_store,
    rejected_lanes,
)
from packed_adamw.core.kernel import FLOAT32_MAX as TL_FLOAT32_MAX
from packed_adamw.core.kernel import SPLIT_MASTER_MAX as TL_SPLIT_MASTER_MAX
from packed_adamw.core.kernel import split_master as tl_split_master
from packed_adamw.core.rule import Bound, Rule, RowVariant, StateCode, StateEntry, StateLayout, format_count_names

F32 = np.float32

# =============================================================================================
# The rule
# =============================================================================================
HPARAM_FIELDS = ("lr", "momentum", "weight_decay")
# grad_sign: -1 for torch's maximize (a step on -g: the product is exact); four fields, as the
# torch launcher stages scalar rows in float32 pairs.
SCALAR_FIELDS = ("momentum", "grad_sign", "lr", "lr_wd")
BOUNDS = {"lr": Bound(0.0, FLOAT32_MAX), "momentum": Bound(0.0, 1.0, high_open=True),
          "weight_decay": Bound(0.0, FLOAT32_MAX)}
CODES = (StateCode("mu", "momenta", "mu_bias"),)
MOMENTUM_CODES = StateEntry("heavy_ball_momentum", "uint16")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def validate(lr, momentum, weight_decay, *, allow_arrays=False) -> None:
    values = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
    for name, value in values.items():
        if allow_arrays and not _is_number(value):
            continue
        with np.errstate(over="ignore"):
            if not _is_number(value) or not BOUNDS[name].holds(float(F32(value))):
                raise ValueError(f"Invalid {name}: {name}={value!r}; it must be a float32 number in "
                                 f"[{BOUNDS[name].low}, {BOUNDS[name].high}" + (")" if BOUNDS[name].high_open else "]"))
    if all(map(_is_number, (lr, weight_decay))) and abs(float(F32(lr)) * float(F32(weight_decay))) > FLOAT32_MAX:
        raise ValueError(f"Invalid weight_decay: lr * weight_decay = {lr} * {weight_decay} overflows float32")


RULE = Rule(
    name="heavy_ball",
    hyperparam_fields=HPARAM_FIELDS,
    scalar_fields=SCALAR_FIELDS,
    bounds=BOUNDS,
    finite_products=(("lr", "weight_decay"),),
    count_names=format_count_names(CODES),  # saturated_mu, flushed_mu, subnormal_mu
    codes=CODES,
    group_keys=HPARAM_FIELDS,
    group_row=lambda lr, momentum, weight_decay, *, number=float: (number(lr), number(momentum), number(weight_decay)),
    row_group=lambda lr, momentum, weight_decay: (lr, momentum, weight_decay),
    validate=validate,
    row_variants=(RowVariant("decayed"), RowVariant("undecayed", zeroed=("weight_decay",))),
    masked_variant="undecayed",
    param_read_through=("weight_decay",),
)


@functools.cache
def momentum_format(bias: int) -> MiniFloat:
    return MiniFloat("E5M10", signed=True, exponent_bits=5, fraction_bits=10, bias=bias)


@dataclasses.dataclass(frozen=True)
class HeavyBallFormat(StateLayout):
    mode: str = "packed"
    mu_bias: int = 15

    def __post_init__(self):
        if self.mode != "packed" or not BIAS_RANGE[0] <= self.mu_bias <= BIAS_RANGE[1]:
            raise ValueError(f"heavy ball: mode 'packed' and a bias in {list(BIAS_RANGE)}")

    @property
    def formats(self) -> tuple[MiniFloat]:
        return (momentum_format(self.mu_bias),)

    @property
    def identity(self) -> str:
        return f"heavy-ball-packed:mu={self.formats[0].identity}"

    @property
    def state_entry(self) -> StateEntry:
        return MOMENTUM_CODES

    @property
    def rule(self) -> Rule:
        return RULE

    def kernel_constexprs(self, *, track_format: bool) -> dict:
        """The launch skeleton's constexprs (core/skeleton.py): the block step, its FORMAT."""
        codec = self.formats[0]
        return skeleton.constexprs(heavy_ball_block, (codec.fraction_bits, codec.bias, codec.max_magnitude_code),
                                   RULE)


FMT = HeavyBallFormat()


# ---- the step scalars, the numpy step ------------------------------------------------------------
def step_scalar_row(count: int, row, *, maximize: bool = False) -> tuple:
    operator.index(count)  # no bias correction: the count only has to be one
    lr, momentum, weight_decay = (F32(x) for x in row)
    return momentum, F32(-1.0 if maximize else 1.0), lr, F32(lr * weight_decay)


def _update(p, g, codes, scalars, fmt: HeavyBallFormat, split: bool, counts):
    """(update, new codes, accepted) of one flat array; inputs unchanged."""
    momentum, grad_sign, lr, lr_wd = (F32(x) for x in scalars)
    codec = fmt.formats[0]
    finite = np.abs(g) <= F32(FLOAT32_MAX)
    g = np.where(finite, g, F32(0.0))
    m_next = momentum * codec.decode_table[codes] + grad_sign * g
    update = -(lr * m_next + lr_wd * p)
    accepted = finite & (np.abs(p + update) <= F32(SPLIT_MASTER_MAX if split else FLOAT32_MAX))
    new_codes = codec.encode_unchecked(m_next)
    if counts is not None:
        magnitude = new_codes & np.uint32(~codec.sign_bit & 0xFFFF)
        beyond = codec.unsaturated_code(np.abs(m_next)) > codec.max_magnitude_code
        counts[0] += np.count_nonzero(accepted & beyond)
        counts[1] += np.count_nonzero(accepted & (m_next != 0) & (magnitude == 0))
        subnormal = (magnitude != 0) & ((magnitude >> np.uint32(codec.fraction_bits)) == 0)
        counts[2] += np.count_nonzero(accepted & subnormal)
    return update, new_codes, accepted


def apply_step(p, g, state, scalars, *, fmt, update_out=None, format_counts_out=None) -> int:
    codes = state.view(np.uint16)  # torch keeps 16-bit codes as int16
    with np.errstate(over="ignore", invalid="ignore"):
        update, new_codes, accepted = _update(p, g, codes, scalars, fmt, False, format_counts_out)
        codes[...] = np.where(accepted, new_codes, codes)
        if update_out is None:
            p[...] = np.where(accepted, p + update, p)
        else:
            update_out[...] = np.where(accepted, update, F32(-0.0))
    return int(accepted.size - np.count_nonzero(accepted))


def apply_split_step(weight_bits, low_half, grad, state, scalars, *, fmt, format_counts_out=None) -> int:
    weights, lows, codes = weight_bits.view(np.uint16), low_half.view(np.int16), state.view(np.uint16)
    master = read_master(weights, lows)
    g = (grad.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(F32) if grad.dtype != F32 else grad
    with np.errstate(over="ignore", invalid="ignore"):
        update, new_codes, accepted = _update(master, g, codes, scalars, fmt, True, format_counts_out)
        codes[...] = np.where(accepted, new_codes, codes)
        weights[...], lows[...] = split_master(np.where(accepted, master + update, master))
    return int(accepted.size - np.count_nonzero(accepted))


# ---- the scalar authority (core/authority.py's primitives only) --------------------------------
def heavy_ball_element(p, g, code, *, lr, momentum, weight_decay, mu_bias=15, maximize=False):
    """One element's step: (p', code', accepted), a rejected element keeping p and its code."""
    f32 = authority.f32
    lr, momentum, weight_decay, p, g = (f32(x) for x in (lr, momentum, weight_decay, p, g))
    if not abs(g) <= FLOAT32_MAX:
        return p, code, False
    codec = authority.Codec(True, 5, 10, mu_bias)
    m_next = f32(f32(momentum * codec.decode(code)) + (-g if maximize else g))
    total = f32(f32(lr * m_next) + f32(f32(lr * weight_decay) * p))
    p_next = f32(p - total)
    if not abs(p_next) <= FLOAT32_MAX:
        return p, code, False
    return p_next, codec.encode(m_next), True


# ---- the Triton kernels --------------------------------------------------------------------------
S_MOMENTUM, S_GRAD_SIGN, S_LR, S_LR_WD = (tl.constexpr(i) for i in range(len(SCALAR_FIELDS)))
SCALAR_ROW = tl.constexpr(len(SCALAR_FIELDS))
H_LR, H_MOMENTUM, H_WD = (tl.constexpr(i) for i in range(len(HPARAM_FIELDS)))
HPARAM_ROW = tl.constexpr(len(HPARAM_FIELDS))


@triton.jit
def heavy_ball_block(param_ptr, grad_ptr, state_ptr, lo_ptr, scalars_ptr, out_ptr, new_state_ptr, new_lo_ptr,
                     offsets, n_elements, MASKED: tl.constexpr, WRITE_UPDATE: tl.constexpr, SPLIT: tl.constexpr,
                     COUNT_NONFINITE: tl.constexpr, TRACK_FORMAT: tl.constexpr, FORMAT: tl.constexpr):
    """One block: the whole per-element step, as the launch skeleton calls it (core/skeleton.py);
    FORMAT is the momentum code's (fraction bits, bias, largest magnitude code). Returns its
    lanes' (rejected, format counts)."""
    MU_FRAC: tl.constexpr = FORMAT[0]
    MU_BIAS: tl.constexpr = FORMAT[1]
    MU_MAX: tl.constexpr = FORMAT[2]
    state_ptr = state_ptr.to(tl.pointer_type(tl.uint16))  # the frontends hold int16 or uint16 codes
    new_state_ptr = new_state_ptr.to(tl.pointer_type(tl.uint16))
    in_bounds = offsets < n_elements
    momentum, grad_sign = tl.load(scalars_ptr + S_MOMENTUM), tl.load(scalars_ptr + S_GRAD_SIGN)
    lr, lr_wd = tl.load(scalars_ptr + S_LR), tl.load(scalars_ptr + S_LR_WD)
    if SPLIT:
        w_bits = masked_load(param_ptr + offsets, in_bounds, 0, MASKED).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo_bits = masked_load(lo_ptr + offsets, in_bounds, 0, MASKED).to(tl.uint16, bitcast=True).to(tl.uint32)
        p = join_master(w_bits, lo_bits)
        stale = ((w_bits & SPLIT_MAGNITUDE_MASK) == 0) & ((lo_bits & SPLIT_LO_SIGN) != 0)
        p = tl.where(stale, (w_bits << 16).to(tl.float32, bitcast=True), p)
    else:
        p = masked_load(param_ptr + offsets, in_bounds, 0.0, MASKED)
    g = masked_load(grad_ptr + offsets, in_bounds, 0.0, MASKED).to(tl.float32)
    code = masked_load(state_ptr + offsets, in_bounds, 0, MASKED).to(tl.uint32)
    grad_finite = tl.abs(g) <= TL_FLOAT32_MAX
    g = tl.where(grad_finite, g, 0.0)
    m_next = momentum * decode(code, True, MU_FRAC, MU_BIAS) + grad_sign * g
    total = lr * m_next + lr_wd * p
    sign_bit = tl.full(offsets.shape, FLOAT32_SIGN_BIT, tl.uint32)
    update = (total.to(tl.uint32, bitcast=True) ^ sign_bit).to(tl.float32, bitcast=True)
    p_next = p + update
    if SPLIT:
        accepted = grad_finite & (tl.abs(p_next) <= TL_SPLIT_MASTER_MAX)
    else:
        accepted = grad_finite & (tl.abs(p_next) <= TL_FLOAT32_MAX)
    raw = encode_magnitude(tl.abs(m_next), MU_FRAC, MU_BIAS)
    new_code = finish_code(raw, m_next, True, MU_MAX)
    if SPLIT:
        w_next, lo_next = tl_split_master(tl.where(accepted, p_next, p))
        masked_store(out_ptr + offsets, w_next.to(tl.uint16).to(out_ptr.dtype.element_ty, bitcast=True),
                     in_bounds, MASKED)
        masked_store(new_lo_ptr + offsets, lo_next.to(tl.uint16).to(new_lo_ptr.dtype.element_ty, bitcast=True),
                     in_bounds, MASKED)
    elif WRITE_UPDATE:
        masked_store(out_ptr + offsets, tl.where(accepted, update, sign_bit.to(tl.float32, bitcast=True)),
                     in_bounds, MASKED)
    else:
        masked_store(out_ptr + offsets, tl.where(accepted, p_next, p), in_bounds, MASKED)
    stored = tl.where(accepted, new_code, code).to(tl.uint16)
    masked_store(new_state_ptr + offsets, stored, in_bounds, MASKED)
    format_lanes = tl.zeros(offsets.shape, tl.int32)
    if TRACK_FORMAT:  # bit 31 of each test's uint32 is its answer (core/adamw/kernel.py's counts)
        if MASKED:
            counted = accepted & in_bounds
        else:
            counted = accepted
        magnitude = code_magnitude(new_code, True)
        zero = magnitude - 1
        saturated = raw + (FLOAT32_MAGNITUDE_MASK - MU_MAX)
        flushed = zero & ((m_next.to(tl.uint32, bitcast=True) & FLOAT32_MAGNITUDE_MASK) + FLOAT32_MAGNITUDE_MASK)
        subnormal = (magnitude - (1 << MU_FRAC)) & (zero ^ ALL_ONES)
        lanes = lane_bit(saturated, 0) | lane_bit(flushed, 1) | lane_bit(subnormal, 2)
        format_lanes = tl.where(counted, lanes, 0)
    return rejected_lanes(accepted, in_bounds, MASKED, COUNT_NONFINITE), format_lanes


@triton.jit
def _store_scalars(out, valid, lr, momentum, weight_decay, grad_sign):
    tl.store(out + S_MOMENTUM, momentum, mask=valid)
    tl.store(out + S_GRAD_SIGN, grad_sign, mask=valid)
    tl.store(out + S_LR, lr, mask=valid)
    tl.store(out + S_LR_WD, lr * weight_decay, mask=valid)


@triton.jit
def step_scalars_kernel(hparams_ptr, counts_ptr, n_rows, scalars_ptr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = rows < n_rows
    hp = hparams_ptr + rows * HPARAM_ROW
    _store_scalars(scalars_ptr + rows * SCALAR_ROW, valid, tl.load(hp + H_LR, mask=valid, other=0.0),
                   tl.load(hp + H_MOMENTUM, mask=valid, other=0.0), tl.load(hp + H_WD, mask=valid, other=0.0),
                   tl.full([BLOCK_ROWS], 1.0, tl.float32))


@triton.jit
def capturable_step_scalars_kernel(lr_addresses_ptr, hparams_ptr, group_index_ptr, sign_ptr, counts_ptr, n_rows,
                                   scalars_ptr, BLOCK_ROWS: tl.constexpr):
    """torch's capturable step: each row's lr read through its group's address; an lr the host
    would refuse becomes NaN (every element rejected, the count kept)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    valid = rows < n_rows
    group = tl.load(group_index_ptr + rows, mask=valid, other=0)
    lr = tl.load(tl.load(lr_addresses_ptr + group, mask=valid, other=0).to(tl.pointer_type(tl.float32)), mask=valid,
                 other=0.0)
    hp = hparams_ptr + group * HPARAM_ROW
    momentum = tl.load(hp + H_MOMENTUM, mask=valid, other=0.0)
    weight_decay = tl.load(hp + H_WD, mask=valid, other=0.0)
    accepted = (lr >= 0.0) & (lr <= TL_FLOAT32_MAX) & (lr * weight_decay <= TL_FLOAT32_MAX)
    lr = tl.where(accepted, lr, tl.full([BLOCK_ROWS], float("nan"), tl.float32))
    count = tl.load(counts_ptr + rows, mask=valid, other=0) + accepted.to(tl.int32)
    tl.store(counts_ptr + rows, count, mask=valid)
    _store_scalars(scalars_ptr + rows * SCALAR_ROW, valid, lr, momentum, weight_decay,
                   tl.load(sign_ptr + rows, mask=valid, other=1.0))


# Every update kernel is the launch skeleton's (core/skeleton.py), over `heavy_ball_block`.
FUNCTIONAL_KERNELS = skeleton.functional_kernels(step_scalars_kernel)


# ---- the frontends' handles on it ----------------------------------------------------------------
def _torch_frontend():
    from packed_adamw.torch import ElementwiseOptimizer, RuleLaunch, numpy_cpu_step

    launch_ = RuleLaunch(  # the update kernels: the launch skeleton's (RuleLaunch's defaults)
        rule=RULE, kernel_module=__name__, capturable_scalars_kernel="capturable_step_scalars_kernel",
        row_scalars=lambda count, row: step_scalar_row(count, row[:3], maximize=len(row) > 3 and bool(row[3])),
        cpu_step=numpy_cpu_step(apply_step, apply_split_step),
    )

    class PackedHeavyBall(ElementwiseOptimizer):
        rule_launch = launch_
        state_format_class = HeavyBallFormat
        format_keys = ("mu_bias",)

        def __init__(self, params, lr=1e-2, momentum=0.9, weight_decay=0.0, *, mu_bias=15, maximize=False,
                     **options):
            super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, maximize=maximize),
                             HeavyBallFormat(mu_bias=mu_bias), **options)

    return PackedHeavyBall


PackedHeavyBall = _torch_frontend()


def heavy_ball_steps():
    from packed_adamw.jax import RuleSteps

    return RuleSteps(rule=RULE, apply_step=apply_step, apply_split_step=apply_split_step, step_scalar_row=step_scalar_row,
                     kernels=lambda: FUNCTIONAL_KERNELS)


# =============================================================================================
# The tests
# =============================================================================================
HP = dict(lr=0.05, momentum=0.9, weight_decay=0.1)
STEPS = 4
SHAPES = [(7, 5), (33,), ()]  # a matrix, a vector (a partial block), a 0-d parameter


def interpreted() -> bool:
    return launch.interpreting()


def spanning(rng, shape, lo, hi):
    values = np.asarray(10.0 ** rng.uniform(lo, hi, shape) * rng.choice([-1.0, 1.0], shape), F32)
    return np.where(rng.random(shape) < 0.05, F32(0.0), values)


def problem(seed=0, shapes=SHAPES):
    """Parameters and STEPS steps of gradients spanning the code's window: momenta that
    saturate (|m| > 131008), go subnormal (below 2**-14) and flush (below 2**-25), and
    a NaN and an Inf gradient."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(F32) for s in shapes]
    grads = [[spanning(rng, s, -9, 6) for s in shapes] for _ in range(STEPS)]
    grads[1][0].reshape(-1)[3], grads[2][1].reshape(-1)[0] = np.nan, -np.inf
    return params, grads


def numpy_run(params, grads, *, maximize=False, counts=None):
    """The rule's numpy step, leaf by leaf: (params, codes) after each step."""
    params, codes, history = [p.reshape(-1).copy() for p in params], [np.zeros(p.size, np.uint16) for p in params], []
    for count, step_grads in enumerate(grads, 1):
        scalars = step_scalar_row(count, (HP["lr"], HP["momentum"], HP["weight_decay"]), maximize=maximize)
        for i, (p, g, c) in enumerate(zip(params, step_grads, codes)):
            apply_step(p, g.reshape(-1), c, scalars, fmt=FMT, format_counts_out=None if counts is None else counts[i])
        history.append(([p.copy() for p in params], [c.copy() for c in codes]))
    return history


def bits(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().contiguous()
        a = a.view(torch.int16 if a.element_size() == 2 else torch.int32).numpy()
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).copy()


def assert_bits(a, b, what):
    a, b = bits(a), bits(b)
    assert a.shape == b.shape and np.array_equal(a, b), f"{what}: {np.count_nonzero(a != b)} elements differ"


def test_the_numpy_step_is_the_scalar_authority_element_by_element():
    """A few elements through both, maximize too: saturating, subnormal, flushed, rejected."""
    codec = momentum_format(15)
    cases = [(1.5, 3e5, 0), (-0.25, 3e-6, 0), (0.75, 1e-9, 0), (2.0, np.nan, 123), (1.0, np.inf, 0x8100),
             (-3.0, -7.0, int(codec.encode([2.5])[0])), (1e-30, 1e-40, 1), (0.0, -0.0, 0x8000)]
    for maximize in (False, True):
        p = np.array([c[0] for c in cases], F32)
        g = np.array([c[1] for c in cases], F32)
        codes = np.array([c[2] for c in cases], np.uint16)
        counts = np.zeros(3, np.int64)
        rejected = apply_step(p, g, codes, step_scalar_row(3, tuple(HP.values()), maximize=maximize), fmt=FMT,
                              format_counts_out=counts)
        expected = [heavy_ball_element(*c, **HP, maximize=maximize) for c in cases]
        assert_bits(p, np.array([e[0] for e in expected], F32), f"params, maximize={maximize}")
        assert codes.tolist() == [e[1] for e in expected], maximize
        assert rejected == sum(not e[2] for e in expected) == 2
        assert counts[0] >= 1 and counts[2] >= 1 and counts[1] >= 1, counts  # saturated, flushed, subnormal


@pytest.fixture(scope="module")
def reference():
    params, grads = problem()
    counts = [np.zeros(3, np.int64) for _ in params]
    return params, grads, numpy_run(params, grads, counts=counts), counts


def torch_params(params, dtype=torch.float32, device="cpu"):
    return [torch.tensor(p, dtype=dtype, device=device, requires_grad=True) for p in params]


def feed(params, grads):
    """Each gradient in its parameter's dtype (a bf16 one rounded to nearest even, as jnp's cast)."""
    for p, g in zip(params, grads):
        p.grad = torch.tensor(g, device=p.device).to(p.dtype)


def stepped_heavy_ball(params0, grads):
    """The float32 parameters of `params0` and a PackedHeavyBall (the tests' hyperparameters)
    stepped once with each gradient list of `grads`."""
    params = torch_params(params0)
    opt = PackedHeavyBall(params, **HP)
    for step_grads in grads:
        feed(params, step_grads)
        opt.step()
    return params, opt


def bf16_rounded(grads):
    import ml_dtypes

    return [[g.astype(ml_dtypes.bfloat16).astype(F32) for g in step] for step in grads]


def test_torch_eager_on_the_cpu_is_the_numpy_step_with_its_format_counts(reference):
    params0, grads, history, counts = reference
    params = torch_params(params0)
    opt = PackedHeavyBall(params, **HP, track_format=True, check_nonfinite=False)
    for step_grads, (want_params, want_codes) in zip(grads, history):
        feed(params, step_grads)
        opt.step()
        for i, p in enumerate(params):
            assert_bits(p, want_params[i], f"param {i}")
            assert_bits(opt.state[p][MOMENTUM_CODES.key], want_codes[i], f"codes {i}")
            assert opt.state[p][MOMENTUM_CODES.key].dtype == torch.int16
    with pytest.warns(RuntimeWarning, match="momenta saturated at 131008: lower mu_bias"):  # the rule's own code
        stats = opt.format_stats()
    for i, p in enumerate(params):
        assert stats[(0, i)] == {"elements": STEPS * p.numel(), **dict(zip(RULE.count_names, counts[i].tolist()))}
    assert sum(counts).min() > 0, counts  # every event happened


def test_torch_maximize_and_bf16_split_masters_are_the_numpy_step():
    params0, grads = problem(seed=1)
    history = numpy_run(params0, grads, maximize=True)
    fp32 = torch_params(params0)
    opt = PackedHeavyBall([{"params": fp32, "maximize": True}], **HP)
    # bf16 weights: the master of one stepped as the FP32 parameter holding it (FORMAT.md, "Split masters")
    bf16 = torch_params([p.astype(F32) for p in params0], dtype=torch.bfloat16)
    masters = [p.detach().float().numpy() for p in bf16]
    split_history = numpy_run(masters, bf16_rounded(grads))
    split_opt = PackedHeavyBall(bf16, **HP)
    for step_grads, (want, _), (want_split, split_codes) in zip(grads, history, split_history):
        feed(fp32, step_grads)
        feed(bf16, step_grads)
        opt.step()
        split_opt.step()
    for i in range(len(fp32)):
        assert_bits(fp32[i], want[i], f"maximized param {i}")
        assert_bits(split_opt.master_weights()[i], want_split[i], f"bf16 master {i}")
        assert_bits(split_opt.state[bf16[i]][MOMENTUM_CODES.key], split_codes[i], f"bf16 codes {i}")


@pytest.mark.skipif(not launch.interpreting(), reason="the Triton interpreter on CPU (the CUDA tests compile them)")
@pytest.mark.parametrize("write_update", [True, False])
def test_the_triton_kernels_interpreted_are_the_numpy_step(monkeypatch, write_update):
    """Every functional entry point through JAX's launcher, interpreted (jax_helpers'
    jax-triton stand-in): one leaf alone (counting and not), a leaf group of FP32 leaves and
    one of split bf16 leaves, and the step-scalars kernel."""
    import jax.numpy as jnp
    import ml_dtypes

    from jax_helpers import InterpretedJaxTriton
    from packed_adamw.jax import _triton_launch

    stand_in = InterpretedJaxTriton()
    monkeypatch.setattr(_triton_launch, "_jax_triton", lambda: stand_in)
    rng = np.random.default_rng(3)
    sizes = [1300, 1, 7, 600]
    params = [rng.standard_normal(n).astype(F32) for n in sizes]
    grads = [spanning(rng, n, -9, 6) for n in sizes]
    grads[0][5] = np.nan
    codes = [momentum_format(15).encode(spanning(rng, n, -6, 5)) for n in sizes]
    rows = [list(HP.values()), [HP["lr"], HP["momentum"], 0.0]]
    leaf_rows = [0, 1, 0, 1]
    for multi_tensor in (True, False):
        for track_format in (True, False):
            outs, states, counts = _triton_launch.step(
                [jnp.asarray(p) for p in params], [jnp.asarray(g) for g in grads], [jnp.asarray(c) for c in codes],
                leaf_rows, jnp.asarray(rows, jnp.float32), jnp.asarray(2, jnp.int32), fmt=FMT,
                kernels=FUNCTIONAL_KERNELS, write_update=write_update, multi_tensor=multi_tensor,
                track_format=track_format)
            for i in range(len(sizes)):
                p, c, want_counts = params[i].copy(), codes[i].copy(), np.zeros(3, np.int64)
                update = np.empty_like(p) if write_update else None
                apply_step(p, grads[i], c, step_scalar_row(2, rows[leaf_rows[i]]), fmt=FMT, update_out=update,
                           format_counts_out=want_counts)
                where = f"leaf {i}, multi_tensor={multi_tensor}, track_format={track_format}"
                assert_bits(outs[i], update if write_update else p, where)
                assert_bits(states[i], c, where)
                if track_format:
                    assert np.asarray(counts[i]).tolist() == want_counts.tolist(), where
    # bf16 leaves with split masters, bf16 gradients, in one leaf group and alone
    weights = [p.astype(ml_dtypes.bfloat16) for p in params]
    lows = [np.zeros(n, np.int16) for n in sizes]
    bf16_grads = [g.astype(ml_dtypes.bfloat16) for g in grads]
    for multi_tensor in (True, False):
        outs, states, _, new_lows = _triton_launch.step(
            [jnp.asarray(w) for w in weights], [jnp.asarray(g) for g in bf16_grads], [jnp.asarray(c) for c in codes],
            leaf_rows, jnp.asarray(rows, jnp.float32), jnp.asarray(2, jnp.int32), fmt=FMT,
            kernels=FUNCTIONAL_KERNELS, write_update=write_update, multi_tensor=multi_tensor,
            lows=[jnp.asarray(lo) for lo in lows])
        for i in range(len(sizes)):
            w, lo, c = weights[i].view(np.uint16).copy(), lows[i].copy(), codes[i].copy()
            apply_split_step(w, lo, bf16_grads[i].view(np.uint16), c, step_scalar_row(2, rows[leaf_rows[i]]), fmt=FMT)
            where = f"split leaf {i}, multi_tensor={multi_tensor}"
            assert_bits(np.asarray(outs[i]).view(np.uint16), w, where)
            assert_bits(new_lows[i], lo, where)
            assert_bits(states[i], c, where)


@pytest.mark.skipif(not interpreted(), reason="the interpreted kernels (TRITON_INTERPRET=1, the CPU suite's)")
def test_the_skeletons_torch_launches_interpreted_are_the_numpy_step():
    """The launch skeleton's kernels as torch launches them on CUDA, interpreted over this rule's
    block step: the multi-tensor kernel over a pointer table (FP32 weights; split bf16 weights with
    float32 and bf16 gradients; tensors ending mid-block, two scalar rows, NaN/Inf gradients),
    counting rejected elements and format events; and one tensor with one and with several blocks
    a program (the counting launches' shape on a GPU)."""
    import ml_dtypes

    from packed_adamw.core import skeleton

    rng = np.random.default_rng(5)
    block, sizes = 64, [1, 63, 64, 65, 200, 7]
    rows = [list(HP.values()), [HP["lr"], HP["momentum"], 0.0]]
    row_of = [0, 1, 0, 1, 0, 1]
    scalar_rows = [np.asarray(step_scalar_row(3, row), F32) for row in rows]
    scalars = torch.tensor(np.stack(scalar_rows))
    params = [rng.standard_normal(n).astype(F32) for n in sizes]
    grads = [spanning(rng, n, -9, 6) for n in sizes]
    grads[3][5], grads[4][0] = np.nan, np.inf
    codes = [momentum_format(15).encode(spanning(rng, n, -6, 5)) for n in sizes]
    for split, grad_bf16 in ((False, False), (True, False), (True, True)):
        where = f"split={split}, bf16 gradients={grad_bf16}"
        weights = [torch.tensor(p).to(torch.bfloat16) if split else torch.tensor(p.copy()) for p in params]
        lows = [torch.zeros(n, dtype=torch.int16) for n in sizes]
        g = [torch.tensor(x).to(torch.bfloat16) if grad_bf16 else torch.tensor(x) for x in grads]
        states = [torch.tensor(c.view(np.int16).copy()) for c in codes]
        table = torch.tensor([t.data_ptr() for t in [*weights, *g, *states, *(lows if split else [])]])
        block_tensor, block_index = launch.block_table(sizes, block)
        counters = torch.zeros((len(sizes), launch.COUNTER_ROW), dtype=torch.int64)
        constants = launch.kernel_constants(FMT, write_update=None, count_nonfinite=True, block=block,
                                            track_format=True, split=split)
        skeleton.multi_tensor_kernel[(len(block_tensor),)](
            table, torch.from_numpy(block_tensor), torch.from_numpy(block_index), torch.tensor(sizes),
            torch.tensor(row_of, dtype=torch.int32), scalars, counters, len(sizes),
            **constants, ALIGNED=False, GRAD_BF16=grad_bf16)
        counts = launch.sum_counter_slots(counters.numpy())
        for i, n in enumerate(sizes):
            c, want_counts = codes[i].copy(), np.zeros(3, np.int64)
            if split:
                w, lo = params[i].astype(ml_dtypes.bfloat16).view(np.uint16).copy(), np.zeros(n, np.int16)
                gi = grads[i].astype(ml_dtypes.bfloat16).view(np.uint16) if grad_bf16 else grads[i]
                rejected = apply_split_step(w, lo, gi, c, scalar_rows[row_of[i]], fmt=FMT, format_counts_out=want_counts)
                assert_bits(weights[i].view(torch.int16).numpy().view(np.uint16), w, f"{where}, weight {i}")
                assert_bits(lows[i].numpy(), lo, f"{where}, low half {i}")
            else:
                p = params[i].copy()
                rejected = apply_step(p, grads[i], c, scalar_rows[row_of[i]], fmt=FMT, format_counts_out=want_counts)
                assert_bits(weights[i].numpy(), p, f"{where}, parameter {i}")
            assert_bits(states[i].numpy().view(np.uint16), c, f"{where}, codes {i}")
            assert (int(counters[i, 0]), counts[i, :3].tolist()) == (rejected, want_counts.tolist()), f"{where}, {i}"
    n = 5 * block + 3
    p0, g0 = rng.standard_normal(n).astype(F32), spanning(rng, n, -9, 6)
    g0[7] = np.nan
    c0 = momentum_format(15).encode(spanning(rng, n, -6, 5))
    p, c, want_counts = p0.copy(), c0.copy(), np.zeros(3, np.int64)
    rejected = apply_step(p, g0, c, scalar_rows[0], fmt=FMT, format_counts_out=want_counts)
    for blocks in (1, 8):
        tp, ts = torch.tensor(p0.copy()), torch.tensor(c0.view(np.int16).copy())
        counters = torch.zeros((1, launch.COUNTER_ROW), dtype=torch.int64)
        constants = launch.kernel_constants(FMT, write_update=False, count_nonfinite=True, block=block,
                                            track_format=True)
        skeleton.tensor_kernel[launch.grid(n, block * blocks)](tp, torch.tensor(g0), ts, scalars[0], counters, n, tp,
                                                               ts, **constants, BLOCKS_PER_PROGRAM=blocks, LAYOUT=0)
        assert_bits(tp.numpy(), p, f"one tensor, {blocks} blocks a program")
        assert_bits(ts.numpy().view(np.uint16), c, f"one tensor's codes, {blocks} blocks a program")
        got = launch.sum_counter_slots(counters.numpy())[0, :3].tolist()
        assert (int(counters[0, 0]), got) == (rejected, want_counts.tolist()), f"{blocks} blocks a program"


def test_a_compiled_step_and_a_state_dict_round_trip_keep_the_eager_bits(reference):
    """torch.compile(opt.step, fullgraph=True) steps as the eager optimizer does; a state saved
    after two steps and loaded into a new optimizer continues as the uninterrupted one."""
    params0, grads, history, _ = reference
    torch._dynamo.reset()
    compiled_params = torch_params(params0)
    compiled = PackedHeavyBall(compiled_params, **HP)
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    resumed_params = torch_params(params0)
    first = PackedHeavyBall(resumed_params, **HP)
    for k, step_grads in enumerate(grads):
        feed(compiled_params, step_grads)
        step()
        if k == 2:  # the second half in a new optimizer, from the first's state_dict
            saved = first.state_dict()
            assert saved["packed_adamw"]["format"] == FMT.identity
            first = PackedHeavyBall(resumed_params, **HP)
            first.load_state_dict(saved)
        feed(resumed_params, step_grads)
        first.step()
    want_params, want_codes = history[-1]
    for i in range(len(params0)):
        for opt, ps, what in ((compiled, compiled_params, "compiled"), (first, resumed_params, "resumed")):
            assert_bits(ps[i], want_params[i], f"{what} param {i}")
            assert_bits(opt.state[ps[i]][MOMENTUM_CODES.key], want_codes[i], f"{what} codes {i}")
            assert int(opt.state[ps[i]]["step"]) == STEPS
    with pytest.raises(ValueError, match="construct PackedHeavyBall with the same mu_bias"):
        PackedHeavyBall(torch_params(params0), **HP, mu_bias=17).load_state_dict(first.state_dict())


def _rule_class(name="PackedRuleClass", base=None, **attributes):
    """An optimizer class of this rule, built from `attributes` (a test of what a rule class
    must declare); its constructor takes the heavy ball's hyperparameters and `state_format`."""
    from packed_adamw.torch import ElementwiseOptimizer

    def __init__(self, params, state_format=FMT, **options):
        ElementwiseOptimizer.__init__(self, params, {**HP, "maximize": False}, state_format, **options)

    return type(name, (base or ElementwiseOptimizer,), {"__init__": __init__, **attributes})


def test_a_rule_class_missing_a_declaration_is_refused_naming_it():
    """A rule class that forgets `state_format_class` or `format_keys`, or gives something
    else than a RuleLaunch, is refused when the class is made; one without `rule_launch` (a
    base for rule classes) when it is built; a RuleLaunch of another rule than the state
    format's, or a state format of another class, when it is built: each naming what to set,
    never an error from inside a step or a load."""
    from packed_adamw.torch.functional import ADAMW_LAUNCH

    launch_ = PackedHeavyBall.rule_launch
    with pytest.raises(TypeError, match="PackedRuleClass sets no state_format_class"):
        _rule_class(rule_launch=launch_, format_keys=("mu_bias",))
    with pytest.raises(TypeError, match="PackedRuleClass sets no format_keys"):
        _rule_class(rule_launch=launch_, state_format_class=HeavyBallFormat)
    with pytest.raises(TypeError, match="PackedRuleClass.format_keys"):
        _rule_class(rule_launch=launch_, state_format_class=HeavyBallFormat, format_keys="mu_bias")
    with pytest.raises(TypeError, match="PackedRuleClass.rule_launch must be a RuleLaunch"):
        _rule_class(rule_launch=RULE, state_format_class=HeavyBallFormat, format_keys=("mu_bias",))
    base = _rule_class("PackedRuleBase", state_format_class=HeavyBallFormat, format_keys=("mu_bias",))
    with pytest.raises(TypeError, match="PackedRuleBase sets no rule_launch"):
        base(torch_params([np.zeros(3, F32)]))
    mixed = _rule_class(rule_launch=ADAMW_LAUNCH, state_format_class=HeavyBallFormat, format_keys=("mu_bias",))
    with pytest.raises(TypeError, match="rule_launch steps rule 'adamw' but its state format's rule is 'heavy_ball'"):
        mixed(torch_params([np.zeros(3, F32)]))
    from packed_adamw.core import StateFormat

    with pytest.raises(TypeError, match=r"state_format must be a HeavyBallFormat \(its state_format_class\), got "
                                        "StateFormat"):
        _rule_class(rule_launch=launch_, state_format_class=HeavyBallFormat, format_keys=("mu_bias",))(
            torch_params([np.zeros(3, F32)]), StateFormat())
    # a subclass of a rule class keeps its declarations, and its groups' refused options follow its format_keys
    renamed = _rule_class("PackedRenamed", base=PackedHeavyBall, format_keys=("code_bias",))
    assert set(renamed.group_options) >= {"code_bias", "multi_tensor", "capturable"}
    # the launch skeleton's kernels with a format that names no block step: refused when built,
    # not at the first CUDA launch inside Triton
    from packed_adamw.torch import RuleLaunch

    class NoBlockStep(HeavyBallFormat):
        def kernel_constexprs(self, *, track_format: bool) -> dict:
            return {"MU_BIAS": self.mu_bias}

    no_step = _rule_class("PackedNoStep", rule_launch=launch_, state_format_class=NoBlockStep, format_keys=("mu_bias",))
    with pytest.raises(TypeError, match=r"PackedNoStep: its rule_launch launches the launch skeleton's kernels .*"
                                        r"NoBlockStep.kernel_constexprs names none: return "
                                        r"packed_adamw.core.skeleton.constexprs"):
        no_step(torch_params([np.zeros(3, F32)]), NoBlockStep())
    # a RuleLaunch takes keywords only: its fields' order is no contract
    with pytest.raises(TypeError, match="positional"):
        RuleLaunch(RULE, __name__, "capturable_step_scalars_kernel", launch_.row_scalars, launch_.cpu_step)


def test_a_group_cannot_set_an_option_of_the_rules_optimizer():
    """A format option a rule names for itself (not one of the project's) is the optimizer's
    alone, as AdamW's mode and biases are: a group setting it is refused when added and when a
    state_dict's groups load, never stepped with the optimizer's value silently."""
    biased = _rule_class("PackedBiased", rule_launch=PackedHeavyBall.rule_launch, state_format_class=HeavyBallFormat,
                         format_keys=("code_bias",))
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets 'code_bias': a group cannot have its own state "
                                         r"format .*PackedBiased\(\.\.\., code_bias=\.\.\.\)"):
        biased([{"params": torch_params([np.zeros(3, F32)]), "code_bias": 17}])
    opt = biased(torch_params([np.zeros(3, F32)]))
    saved = opt.state_dict()
    saved["param_groups"][0]["code_bias"] = 17
    with pytest.raises(ValueError, match="saved param_groups\\[0\\] sets 'code_bias'"):
        opt.load_state_dict(saved)
    assert "code_bias" not in opt.param_groups[0]


def test_messages_name_the_rules_optimizer_not_packed_adamw():
    """What the shared checks say to a user of another rule names that rule's optimizer."""
    cases = {
        "a float16 parameter": lambda: PackedHeavyBall([torch.zeros(3, dtype=torch.float16, requires_grad=True)]),
        "a float64 parameter": lambda: PackedHeavyBall([torch.zeros(3, dtype=torch.float64, requires_grad=True)]),
        "a meta parameter": lambda: PackedHeavyBall([torch.nn.Parameter(torch.zeros(3, device="meta"))]),
        "a float lr, capturable": lambda: PackedHeavyBall(torch_params([np.zeros(3, F32)]), capturable=True),
    }

    def sparse_gradient():
        (p,) = torch_params([np.zeros(3, F32)])
        p.grad = torch.ones(3).to_sparse()
        PackedHeavyBall([p]).step()

    def damaged_state():
        (p,) = torch_params([np.zeros(3, F32)])
        opt = PackedHeavyBall([p])
        p.grad = torch.ones(3)
        opt.step()
        del opt.state[p][MOMENTUM_CODES.key]
        opt.step()

    cases.update({"a sparse gradient": sparse_gradient, "a damaged state": damaged_state})
    for what, make in cases.items():
        with pytest.raises((TypeError, ValueError, RuntimeError)) as raised:
            make()
        assert "PackedHeavyBall" in str(raised.value) and "PackedAdamW" not in str(raised.value), (what, raised.value)


def test_a_state_dict_of_another_rule_is_refused_naming_the_rules():
    """PackedAdamW's state_dict into this rule's optimizer and the other way: refused before
    anything changes, naming the saved state's rule where it is known, never advising to build
    the optimizer with other biases (no bias makes one rule's state another's)."""
    from packed_adamw.torch import PackedAdamW

    (a,), (h,) = torch_params([np.ones(3, F32)]), torch_params([np.ones(3, F32)])
    adamw, heavy_ball = PackedAdamW([a]), PackedHeavyBall([h])
    for p, opt in ((a, adamw), (h, heavy_ball)):
        p.grad = torch.ones(3)
        opt.step()
    with pytest.raises(ValueError, match="saved by an optimizer of rule 'adamw'.*PackedHeavyBall steps rule 'heavy_ball'"):
        heavy_ball.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="is no format of rule 'adamw'.*another rule's optimizer"):
        adamw.load_state_dict(heavy_ball.state_dict())
    with pytest.raises(ValueError, match="construct PackedHeavyBall with the same mu_bias"):  # its own rule's, other bias
        PackedHeavyBall(torch_params([np.ones(3, F32)]), mu_bias=17).load_state_dict(heavy_ball.state_dict())
    assert int(heavy_ball.state[h]["step"]) == int(adamw.state[a]["step"]) == 1


def test_a_portable_state_of_the_rule_goes_back_into_its_optimizer(reference):
    """`export_state` writes the rule's entries in its format's dtype (uint16 codes, as JAX keeps
    them; torch holds them as int16), and `import_state` takes them back: the imported optimizer
    continues as the uninterrupted one, bit for bit. Another rule's optimizer refuses it."""
    from packed_adamw.torch import PackedAdamW

    params0, grads, history, _ = reference
    params, opt = stepped_heavy_ball(params0, grads[:2])
    portable = opt.export_state()
    assert [m.dtype for m in portable.moments] == [np.uint16] * len(params0)
    resumed = PackedHeavyBall(params, **HP)
    resumed.import_state(portable)
    for step_grads in grads[2:]:
        feed(params, step_grads)
        resumed.step()
    want_params, want_codes = history[-1]
    for i, p in enumerate(params):
        assert_bits(p, want_params[i], f"param {i}")
        assert_bits(resumed.state[p][MOMENTUM_CODES.key], want_codes[i], f"codes {i}")
        assert resumed.state[p][MOMENTUM_CODES.key].dtype == torch.int16
    with pytest.raises(ValueError, match="portable state has format 'heavy-ball-packed"):
        PackedAdamW(torch_params(params0)).import_state(portable)


@dataclasses.dataclass(frozen=True)
class HeavyBallFP32Format(HeavyBallFormat):
    """The rule's momenta as float32 (one per element, no leading axis), for the load checks."""

    @property
    def identity(self) -> str:
        return "heavy-ball-fp32"

    @property
    def state_entry(self) -> StateEntry:
        return StateEntry("heavy_ball_momentum_fp32", "float32")


def test_a_float32_state_of_another_rule_loads_by_its_own_layout():
    """The load's value check reads a float32 state as its rule keeps it: a rule's float32
    momenta may be negative (AdamW's [m, v] rows are not its layout), a 0-d parameter's too;
    a NaN or Inf among them is refused (it would freeze the element)."""
    fp32 = _rule_class("PackedHeavyBallFP32", rule_launch=PackedHeavyBall.rule_launch,
                       state_format_class=HeavyBallFP32Format, format_keys=("mu_bias",))
    params = torch_params([np.zeros((2, 3), F32), np.zeros((), F32)])
    opt = fp32(params, HeavyBallFP32Format())
    saved = opt.state_dict()
    momenta = [torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]]), torch.tensor(-4.0)]
    saved["state"] = {i: {"step": 1, "heavy_ball_momentum_fp32": m} for i, m in enumerate(momenta)}
    opt.load_state_dict(saved)
    for p, m in zip(params, momenta):
        assert torch.equal(opt.state[p]["heavy_ball_momentum_fp32"], m)
    saved["state"][0]["heavy_ball_momentum_fp32"] = torch.tensor([[1.0, np.nan, 3.0], [-1.0, -2.0, np.inf]])
    with pytest.raises(ValueError, match="2 values are NaN or Inf"):
        fp32(torch_params([np.zeros((2, 3), F32), np.zeros((), F32)]), HeavyBallFP32Format()).load_state_dict(saved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_multi_tensor_solo_and_captured_are_the_cpu_bits(reference):
    """On CUDA, the multi-tensor launch, one launch per tensor and a captured capturable step
    (replayed with a new lr written into its tensor) give the numpy step's bits."""
    params0, grads, history, _ = reference
    want_params, want_codes = history[-1]
    for options in (dict(multi_tensor=True), dict(multi_tensor=False)):
        params = torch_params(params0, device="cuda")
        opt = PackedHeavyBall(params, **HP, **options)
        for step_grads in grads:
            feed(params, step_grads)
            opt.step()
        for i, p in enumerate(params):
            assert_bits(p, want_params[i], f"{options} param {i}")
            assert_bits(opt.state[p][MOMENTUM_CODES.key], want_codes[i], f"{options} codes {i}")
    # capturable: eager warm-up steps, then the last steps replayed from a captured graph
    params = torch_params(params0, device="cuda")
    lr = torch.tensor(HP["lr"], device="cuda")
    opt = PackedHeavyBall(params, **{**HP, "lr": lr}, capturable=True)
    static = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, static):
        p.grad = g
    for step_grads in grads[:2]:
        for g, value in zip(static, step_grads):
            g.copy_(torch.tensor(value))
        opt.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step_grads in grads[2:]:
        for g, value in zip(static, step_grads):
            g.copy_(torch.tensor(value))
        graph.replay()
    torch.cuda.synchronize()
    for i, p in enumerate(params):
        assert_bits(p, want_params[i], f"captured param {i}")
        assert_bits(opt.state[p][MOMENTUM_CODES.key], want_codes[i], f"captured codes {i}")


@pytest.mark.cuda
def test_cuda_the_optax_transform_on_a_jax_gpu_is_the_cpu_bits(reference):
    """On a JAX GPU backend, `packed_rule` launches the launch skeleton's kernels through
    jax-triton (the block step and the format tuple as constexprs): leaf groups and single
    leaves, with and without format counts, give the numpy step's bits and counts."""
    import jax

    from jax_helpers import jax_cuda_unavailable, optax_train_step
    from packed_adamw.jax import format_stats, packed_rule

    why = jax_cuda_unavailable()
    if why is not None:
        pytest.skip(f"needs CUDA for JAX plus jax_triton: {why}")
    params0, grads, history, counts = reference
    want_params, want_codes = history[-1]
    gpu = jax.devices("gpu")[0]
    for options in (dict(multi_tensor=True), dict(multi_tensor=False), dict(track_format=True)):
        tx = packed_rule(heavy_ball_steps(), FMT, **HP, **options)
        params = [jax.device_put(p, gpu) for p in params0]
        state = tx.init(params)
        step = jax.jit(optax_train_step(tx))
        for step_grads in grads:
            params, state = step(params, state, [jax.device_put(g, gpu) for g in step_grads])
        for i in range(len(params0)):
            assert_bits(params[i], want_params[i], f"{options} leaf {i}")
            assert_bits(state.moments[i], want_codes[i], f"{options} codes {i}")
        if options.get("track_format"):
            stats = format_stats(state, count_names=RULE.count_names)
            assert [stats[f"[{i}]"] for i in range(len(params0))] == [
                {"elements": STEPS * p.size, **dict(zip(RULE.count_names, c.tolist()))}
                for p, c in zip(params0, counts)]


def test_the_optax_transform_under_jit_gives_torchs_bits():
    """`packed_rule` of this rule, jitted, fed the gradients torch was fed: FP32 leaves the
    same parameters and codes, a bf16 leaf the same weight and low half."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import optax

    from packed_adamw.jax import packed_rule

    params0, grads = problem(seed=2)
    bf16_leaf = params0[0].astype(ml_dtypes.bfloat16)
    t_params = torch_params(params0) + [torch.tensor(bf16_leaf.astype(F32), dtype=torch.bfloat16, requires_grad=True)]
    opt = PackedHeavyBall(t_params, **HP)
    tx = packed_rule(heavy_ball_steps(), FMT, **HP)
    j_params = [jnp.asarray(p) for p in params0] + [jnp.asarray(bf16_leaf)]
    state = tx.init(j_params)
    assert state.moments[0].dtype == jnp.uint16 and state.low_halves[-1].dtype == jnp.int16

    @jax.jit
    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for step_grads in grads:
        step_grads = step_grads + [step_grads[0]]  # the bf16 leaf's gradient: bf16, rounded in each framework
        feed(t_params, step_grads)
        opt.step()
        j_grads = [jnp.asarray(g) for g in step_grads]
        j_params, state = train_step(j_params, state, j_grads[:-1] + [j_grads[-1].astype(jnp.bfloat16)])
    for i, p in enumerate(t_params):
        assert_bits(j_params[i], p, f"leaf {i}")
        assert_bits(state.moments[i], opt.state[p][MOMENTUM_CODES.key], f"codes {i}")
    assert_bits(state.low_halves[-1], opt.state[t_params[-1]]["lo"], "low half")
    assert int(state.count) == STEPS


def test_the_optax_transform_counts_the_rules_format_events(reference):
    """`track_format=True`: the rule's own counts (its `count_names`), as the numpy step counts them."""
    import jax

    from packed_adamw.jax import format_stats, packed_rule

    from jax_helpers import optax_train_step

    params0, grads, history, counts = reference
    tx = packed_rule(heavy_ball_steps(), FMT, **HP, track_format=True)
    params, state = list(params0), tx.init(list(params0))
    step = jax.jit(optax_train_step(tx))
    for step_grads in grads:
        params, state = step(params, state, step_grads)
    with pytest.raises(ValueError, match="pass count_names=fmt.rule.count_names"):
        format_stats(state)
    # a rule with as many counts as AdamW's (two codes): its state's moments say it is not AdamW's
    six = state._replace(format_counts=state.format_counts._replace(
        counts=np.zeros((len(params0), 6, 2), np.uint32)))
    with pytest.raises(ValueError, match="uint16, not packed_adamw's uint32 words.*pass count_names"):
        format_stats(six)
    stats = format_stats(state, count_names=RULE.count_names)
    assert [stats[f"[{i}]"] for i in range(len(params0))] == [
        {"elements": STEPS * p.size, **dict(zip(RULE.count_names, c.tolist()))} for p, c in zip(params0, counts)]


def test_packed_rule_refuses_steps_or_a_format_of_another_rule():
    """`packed_rule` with a RuleSteps of another rule than its state format's (AdamW's steps
    with this rule's format, or this rule's steps with AdamW's format), or a format that is not
    a state format, is refused when built, naming both; not a numpy error inside a callback."""
    from packed_adamw.core import StateFormat
    from packed_adamw.jax import packed_rule
    from packed_adamw.jax._rules import ADAMW

    with pytest.raises(TypeError, match="steps rule 'adamw' but fmt's rule is 'heavy_ball'"):
        packed_rule(ADAMW, FMT, **HP)
    with pytest.raises(TypeError, match="steps rule 'heavy_ball' but fmt's rule is 'adamw'"):
        packed_rule(heavy_ball_steps(), StateFormat(), lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    with pytest.raises(TypeError, match="fmt='packed' must be the rule's state format"):
        packed_rule(heavy_ball_steps(), "packed", **HP)


def test_packed_rule_messages_name_the_rule():
    """What the transform's checks say to a user of another rule names it (its `name`), not
    packed_adamw."""
    import jax.numpy as jnp

    from packed_adamw.jax import packed_adamw, packed_rule

    params = {"w": jnp.ones((3, 4)), "b": jnp.ones((5,), jnp.bfloat16)}
    grads = {"w": jnp.full((3, 4), 0.5), "b": jnp.full((5,), 0.5, jnp.bfloat16)}
    tx = packed_rule(heavy_ball_steps(), FMT, **HP)
    state = tx.init(params)
    tracked = packed_rule(heavy_ball_steps(), FMT, **HP, track_format=True)
    cases = {
        "an AdamW state": lambda: tx.update(grads, packed_adamw(1e-3).init(params), params),
        "a float16 gradient": lambda: tx.update({**grads, "w": grads["w"].astype(jnp.float16)}, state, params),
        "a float16 parameter": lambda: tx.init({**params, "w": params["w"].astype(jnp.float16)}),
        "no low halves": lambda: tx.update(grads, state._replace(low_halves=None), params),
        "counts it was not built for": lambda: tx.update(grads, tracked.init(params), params),
        "no counts": lambda: tracked.update(grads, state, params),
        "a negative count": lambda: tx.update(grads, state._replace(count=jnp.int32(-1)), params),
        "a mask of ints": lambda: packed_rule(heavy_ball_steps(), FMT, {"w": 1, "b": True}, **HP).update(
            grads, state, params),
    }
    for what, make in cases.items():
        with pytest.raises((TypeError, ValueError)) as raised:
            make()
        assert "heavy_ball" in str(raised.value) and "packed_adamw" not in str(raised.value), (what, raised.value)


def test_sharded_on_8_cpu_devices_is_the_unsharded_step():
    from jax_helpers import run_cases_child

    results = run_cases_child(__file__, 8)
    assert results == {"sharded_equals_unsharded": "ok"}, results


def _cases():
    """The child of `test_sharded_on_8_cpu_devices_is_the_unsharded_step` (8 CPU devices)."""
    import jax
    from jax.sharding import AxisType, NamedSharding

    from jax_helpers import SHARDED_SHAPES, case_recorder, normalized_spec, optax_train_step, sharded_specs
    from packed_adamw.jax import packed_rule

    _, case = case_recorder()

    @case("sharded_equals_unsharded")
    def _():
        assert len(jax.devices()) == 8, jax.devices()
        shapes, specs = SHARDED_SHAPES, sharded_specs()
        rng = np.random.default_rng(4)
        params0 = {k: rng.standard_normal(s).astype(F32) for k, s in shapes.items()}
        grads = [{k: spanning(rng, s, -6, 3) for k, s in shapes.items()} for _ in range(3)]
        mask = {k: k != "b" for k in shapes}  # "b" takes the rule's undecayed row
        tx = packed_rule(heavy_ball_steps(), FMT, mask, **HP)
        step = jax.jit(optax_train_step(tx))
        want_p, want_s = params0, tx.init(params0)
        for g in grads:
            want_p, want_s = step(want_p, want_s, g)
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            put = lambda tree: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}  # noqa
            got_p = put(params0)
            got_s = tx.init(got_p)
            for g in grads:
                got_p, got_s = step(got_p, got_s, put(g))
        for k in shapes:
            assert np.array_equal(bits(got_p[k]), bits(want_p[k])), k
            assert np.array_equal(bits(got_s.moments[k]), bits(want_s.moments[k])), k
            leaf = got_s.moments[k]
            assert normalized_spec(leaf.sharding.spec, leaf.ndim) == normalized_spec(specs[k], leaf.ndim), k


if __name__ == "__main__" and "--cases" in sys.argv:
    _cases()


def test_a_portable_state_crosses_between_torch_and_the_optax_transform(reference):
    """torch's export, imported into `packed_rule`'s state (`import_state(..., FMT)`), continues
    as torch's uninterrupted run, bit for bit; JAX's export goes back into torch's optimizer."""
    import jax
    import jax.numpy as jnp
    import optax

    from packed_adamw.jax import export_state, import_state, packed_rule

    params0, grads, history, _ = reference
    params, opt = stepped_heavy_ball(params0, grads[:2])
    tx = packed_rule(heavy_ball_steps(), FMT, **HP)
    j_params = [jnp.asarray(p.detach().numpy()) for p in params]
    state = import_state(opt.export_state(), j_params, FMT)
    with pytest.raises(ValueError, match="AdamW's biases"):
        import_state(opt.export_state(), j_params, FMT, m_bias=15)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for step_grads in grads[2:]:
        j_params, state = step(j_params, state, [jnp.asarray(g) for g in step_grads])
    want_params, want_codes = history[-1]
    for i in range(len(params0)):
        assert_bits(j_params[i], want_params[i], f"param {i}")
        assert_bits(state.moments[i], want_codes[i], f"codes {i}")
    back = PackedHeavyBall(torch_params([np.asarray(p) for p in j_params]), **HP)
    back.import_state(export_state(state, FMT))
    for i, p in enumerate(back.param_groups[0]["params"]):
        assert_bits(back.state[p][MOMENTUM_CODES.key], want_codes[i], f"codes back in torch {i}")


@pytest.fixture
def registered():
    """The rule in core's registry of rules (`core.rules.register_rule`), for this test only."""
    from packed_adamw.core import rules

    def code_values(state, fmt, exponent=None):
        state = np.asarray(state)
        return (fmt.formats[0].decode_table[state.view(np.uint16) if state.dtype == np.int16 else state],)

    entry = rules.register_rule(rules.RuleFormats(RULE, HeavyBallFormat, ("packed",), code_values))
    try:
        yield entry
    finally:
        rules.RULES.pop(entry.name)


def test_a_registered_rules_saved_state_reads_back_in_inspect(registered, reference, tmp_path, capsys):
    """Registered, the rule's identity names its format, and `python -m packed_adamw.inspect`
    reports a torch state_dict of it as it reports AdamW's and Muon's: each tensor's momenta
    against its format's window. Registering another rule under the name, or one whose identity
    another rule spells, is refused."""
    import json

    from packed_adamw.core import rules
    from packed_adamw.inspect.__main__ import main as inspect_main

    assert rules.state_format_from_identity(HeavyBallFormat(mu_bias=18).identity) == HeavyBallFormat(mu_bias=18)
    assert rules.register_rule(registered) is registered  # the same entry again: a no-op
    with pytest.raises(ValueError, match="registered already"):
        rules.register_rule(dataclasses.replace(registered, modes=("packed", "packed")))
    with pytest.raises(ValueError, match="is rule 'adamw''s"):
        rules.register_rule(dataclasses.replace(registered, rule=dataclasses.replace(RULE, name="copy"),
                                                state_format=rules.RULES["adamw"].state_format,
                                                modes=("packed",)))
    params0, grads, _, _ = reference
    params, opt = stepped_heavy_ball(params0, grads)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    assert inspect_main([str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (section,) = report["sections"]
    assert (section["rule"], section["identity"], section["biases"]) == ("heavy_ball", FMT.identity, {"mu_bias": 15})
    assert len(section["tensors"]) == len(params0)
    for tensor, p in zip(section["tensors"], params):  # every stored code classified in the format's window
        assert tensor["mu"]["total"] == p.numel() == sum(tensor["mu"]["counts"].values()), tensor


def test_a_rule_whose_formats_would_not_read_back_is_refused_and_not_registered():
    """`register_rule` refuses, naming the rule and what to fix, an entry that lists a mode its
    state format does not build, or whose formats name another rule (their saved states would be
    read by that rule's entry, or by none); the registry is left as it was."""
    from packed_adamw.core import rules

    def code_values(state, fmt, exponent=None):
        return (fmt.formats[0].decode_table[np.asarray(state).view(np.uint16)],)

    before = dict(rules.RULES)
    with pytest.raises(ValueError, match=r"register_rule: rule 'heavy_ball'.*mode 'fp32'.*modes"):
        rules.register_rule(rules.RuleFormats(RULE, HeavyBallFormat, ("packed", "fp32"), code_values))
    assert rules.RULES == before
    with pytest.raises(ValueError, match=r"register_rule: rule 'copy'.*rule 'heavy_ball'"):
        rules.register_rule(rules.RuleFormats(dataclasses.replace(RULE, name="copy"), HeavyBallFormat, ("packed",),
                                              code_values))
    assert rules.RULES == before

    @dataclasses.dataclass(frozen=True)
    class TwoModesOneIdentity(HeavyBallFormat):
        def __post_init__(self):
            pass

    with pytest.raises(ValueError, match=r"register_rule: rule 'heavy_ball'.*mode 'alias'.*identity of its own"):
        rules.register_rule(rules.RuleFormats(RULE, TwoModesOneIdentity, ("packed", "alias"), code_values))
    assert rules.RULES == before


def test_export_and_import_state_refuse_muons_format():
    """Muon's state is no `packed_rule` state (its packed momenta need their per-matrix exponents,
    which `export_state`/`import_state` do not carry): its format is refused, pointing at Muon's own."""
    import jax.numpy as jnp

    from packed_adamw.core.muon.state_format import StateFormat as MuonFormat
    from packed_adamw.jax import export_state, import_state, packed_adamw

    params = {"w": jnp.zeros((2, 4), jnp.float32)}
    state = packed_adamw(1e-3).init(params)
    with pytest.raises(ValueError, match="export_muon_state"):
        export_state(state, MuonFormat())
    with pytest.raises(ValueError, match="import_muon_state"):
        import_state(export_state(state, "packed"), params, MuonFormat())
