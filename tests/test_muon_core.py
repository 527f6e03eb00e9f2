"""Muon's framework-free core (core/muon/, docs/MUON.md): the E5M10 momentum code over all
65,536 codes, the numpy elementwise phases against the scalar authority bit for bit, and, in
fp32 mode, against torch's CPU operations and a whole torch.optim.Muon step."""
from __future__ import annotations

import math

import numpy as np
import pytest

from packed_adamw.core import authority as A
from packed_adamw.core.codecs import split_master
from packed_adamw.core.muon import (
    ADJUST_LR_FNS,
    RULE,
    Hyperparams,
    StateFormat,
    adjusted_lr,
    bf16_bits,
    fma32,
    lerp32,
    momentum_format,
    momentum_phase,
    newton_schulz_reference,
    step_scalar_row,
    validate_hyperparams,
    validate_ns,
    weight_phase,
    weight_phase_split,
)
from packed_adamw.core.muon import authority as MA

F32 = np.float32
U32 = np.uint32
ALL_CODES = np.arange(1 << 16, dtype=np.uint32)
BIASES = (31, 36, 0, 100)


def bits(x):
    return np.ascontiguousarray(np.asarray(x, dtype=F32)).view(U32)


def spread(rng, n, low=-40, high=2):
    """float32 values of both signs over binades 2**low .. 2**high."""
    return (rng.choice([-1.0, 1.0], n) * rng.uniform(1, 2, n) * 2.0 ** rng.integers(low, high, n)).astype(F32)


# ---- the E5M10 code ----
@pytest.mark.parametrize("bias", BIASES)
def test_every_code_decodes_as_the_authority_and_round_trips(bias):
    fmt, ref = momentum_format(bias), MA.codec(bias)
    values = fmt.decode(ALL_CODES)
    assert np.isfinite(values).all()  # every exponent code is a number
    expected = np.array([ref.decode(int(c)) for c in ALL_CODES], F32)
    assert np.array_equal(bits(values), bits(expected))
    again = fmt.encode(values).astype(U32)
    assert np.array_equal(again, np.where(ALL_CODES == 0x8000, 0, ALL_CODES))  # -0 is written as code 0
    assert fmt.max_value == float(values[0x7FFF]) and fmt.min_subnormal == float(values[1])


@pytest.mark.parametrize("bias", BIASES)
def test_ties_go_to_the_even_code_and_inexact_values_to_the_nearest(bias):
    fmt = momentum_format(bias)
    lower = fmt.decode(ALL_CODES[:0x7FFF]).astype(np.float64)
    upper = fmt.decode(ALL_CODES[1:0x8000]).astype(np.float64)
    midpoint = ((lower + upper) / 2).astype(F32)  # exact in float32: 11 bits + one
    assert np.array_equal((lower + upper) / 2, midpoint.astype(np.float64))
    even = np.where(ALL_CODES[:0x7FFF] % 2 == 0, ALL_CODES[:0x7FFF], ALL_CODES[1:0x8000])
    for sign in (1, -1):
        codes = fmt.encode(sign * midpoint).astype(U32)
        assert np.array_equal(codes & 0x7FFF, even)
        assert np.array_equal(codes >> 15, np.where(even == 0, 0, sign < 0))
    above = np.nextafter(midpoint, F32(np.inf))
    assert np.array_equal(fmt.encode(above).astype(U32), ALL_CODES[1:0x8000])
    below = np.nextafter(midpoint, F32(0))
    assert np.array_equal(fmt.encode(below).astype(U32), ALL_CODES[:0x7FFF])
    ref = MA.codec(bias)
    sample = np.concatenate([midpoint[::97], above[::89], below[::83], -midpoint[::101]])
    assert [ref.encode(float(v)) for v in sample] == fmt.encode(sample).astype(int).tolist()


@pytest.mark.parametrize("bias", BIASES)
def test_saturation_zero_sign_and_nan(bias):
    fmt = momentum_format(bias)
    top = F32(fmt.max_value)
    huge = np.array([np.nextafter(top, F32(np.inf)), 2 * top, 3.0e38, np.inf], F32)
    assert (fmt.encode(huge) == 0x7FFF).all() and (fmt.encode(-huge) == 0xFFFF).all()
    tiny = np.array([0.0, -0.0, fmt.min_subnormal / 2, -fmt.min_subnormal / 2, 1e-45, -1e-45], F32)
    assert (fmt.encode(tiny) == 0).all()
    with pytest.raises(ValueError, match="NaN"):
        fmt.encode(np.array([1.0, np.nan], F32))
    with pytest.raises(ValueError, match="NaN"):
        MA.codec(bias).encode(math.nan)


def test_default_code_is_se5m10_bias_31_and_the_state_format_records_it():
    code = momentum_format()
    assert (code.identity, code.max_value, code.min_normal, code.min_subnormal) == \
        ("SE5M10b31", 2 - 2.0**-10, 2.0**-30, 2.0**-40)
    assert StateFormat().identity == "muon-packed:mu=SE5M10b31"
    assert StateFormat(mu_bias=36).identity == "muon-packed:mu=SE5M10b36"
    assert StateFormat("bf16").identity == "muon-bf16:mu=bf16" and StateFormat("fp32").identity == "muon-fp32:mu=f32"
    with pytest.raises(ValueError, match="muon-packed:mu=SE5M10b36"):
        StateFormat().check_identity("muon-packed:mu=SE5M10b36")
    StateFormat(mu_bias=36).check_identity("muon-packed:mu=SE5M10b36")
    for bad, error in ((101, ValueError), (-1, ValueError), (True, TypeError), (31.0, TypeError)):
        with pytest.raises(error, match="mu_bias"):
            StateFormat(mu_bias=bad)
    with pytest.raises(ValueError, match="mode"):
        StateFormat("fp16")


def test_state_entries_and_declaration():
    formats = {mode: StateFormat(mode) for mode in ("packed", "bf16", "fp32")}
    layout = {mode: (f.state_key, f.state_dtype, f.state_bytes_per_param, f.split_state_bytes_per_param)
              for mode, f in formats.items()}
    assert layout == {"packed": ("momentum_code", "uint16", 2, 4), "bf16": ("momentum_code", "uint16", 2, 4),
                      "fp32": ("momentum_buffer", "float32", 4, 6)}
    assert StateFormat().state_shape((3, 5)) == (3, 5) and StateFormat().low_half_key == "lo"
    assert RULE.matrix_phase and RULE.hyperparam_fields == ("lr", "momentum", "weight_decay", "eps")
    # The codecs of the rule's codes, in their order, as format counts and their warnings read them:
    assert StateFormat(mu_bias=20).formats == (momentum_format(20),) and len(RULE.codes) == 1
    assert formats["bf16"].formats is None and formats["fp32"].formats is None


# ---- hyperparameters ----
@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1e-3), "Learning rate should be >= 0 but is: -0.001"),
    (dict(lr=float("nan")), "Learning rate should be >= 0"),
    (dict(momentum=-0.1), "momentum should be >= 0 but is: -0.1"),
    (dict(momentum=float("nan")), "momentum should be >= 0 but is: nan"),
    (dict(momentum=1.0), "momentum should be below 1 but is: 1.0"),
    (dict(momentum=1 - 1e-9), "momentum should be below 1 but is: 0.999999999"),
    (dict(weight_decay=-0.1), "weight decay should be >= 0 but is: -0.1"),
    (dict(lr=1e30, weight_decay=1e30), "weight decay should keep lr \\* weight_decay finite"),
    (dict(eps=0.0), "eps should be > 0 but is: 0.0"),
])
def test_bad_hyperparameters_name_the_argument(kwargs, message):
    args = dict(lr=1e-3, momentum=0.95, weight_decay=0.1, eps=1e-7) | kwargs
    with pytest.raises(ValueError, match=message):
        validate_hyperparams(**args)


def test_ns_settings_are_checked_and_defaults_are_torchs():
    assert Hyperparams().as_row() == [1e-3, 0.95, 0.1, 1e-7]  # torch.optim.Muon's defaults
    with pytest.raises(ValueError, match="momentum should be >= 0"):
        Hyperparams(momentum=-1.0)
    assert validate_ns((3.4445, -4.775, 2.0315), 5, None) == ((3.4445, -4.775, 2.0315), 5)
    with pytest.raises(ValueError, match="Coefficients must be a tuple of exactly 3"):
        validate_ns((1.0, 2.0), 5, None)
    with pytest.raises(ValueError, match="Number of steps must be less than 100"):
        validate_ns((1.0, 2.0, 3.0), 100, None)
    with pytest.raises(ValueError, match="Adjust learning rate function 'rms' is not supported"):
        validate_ns((1.0, 2.0, 3.0), 5, "rms")


def test_adjusted_lr_of_zero_size_matrices_and_unknown_functions():
    # a zero-size matrix is skipped by the step; its rate must not divide by zero
    for shape in ((5, 0), (0, 5), (0, 0)):
        for fn in ADJUST_LR_FNS:
            assert adjusted_lr(0.02, shape, fn) == 0.02
    assert adjusted_lr(0.02, (8, 2), None) == 0.02 * 2.0
    assert adjusted_lr(0.02, (8, 2), "match_rms_adamw") == 0.02 * 0.2 * 8 ** 0.5
    with pytest.raises(ValueError, match="Adjust learning rate function 'rms' is not supported"):
        adjusted_lr(0.02, (0, 5), "rms")


# ---- the fused multiply-add and lerp ----
def test_fma32_is_exactly_rounded_including_double_rounding_traps():
    rng = np.random.default_rng(7)
    n = 3000
    a, b = spread(rng, n, -20, 20), spread(rng, n, -20, 20)
    # c lies 24 to 60 binades below or near the product, where float64 rounding of the sum
    # would land on a float32 midpoint; plus exact cancellations and subnormal results.
    c = (a.astype(np.float64) * b * 2.0 ** -rng.integers(-2, 60, n) * rng.choice([-1, 1], n)).astype(F32)
    c[:300] = -(a[:300].astype(np.float64) * b[:300]).astype(F32)
    a[300:400], b[300:400] = spread(rng, 100, -80, -60), spread(rng, 100, -80, -60)
    got = fma32(a, b, c)
    expected = [MA.fma(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)]
    assert np.array_equal(bits(got), bits(expected))
    midpoint = F32(1 + 2.0**-23)  # (1 + 2**-23)**2 = 1 + 2**-22 + 2**-46: rounds up only if fused
    assert fma32(midpoint, midpoint, F32(-1)) == F32(2.0**-22 + 2.0**-46)


@pytest.mark.parametrize("weight", [0.05, 0.95, 0.3, 0.5, 0.7, 1.0, 0.0])
def test_lerp_matches_the_authority(weight):
    rng = np.random.default_rng(3)
    start, end = spread(rng, 500, -45, 3), spread(rng, 500, -45, 3)
    start[:20] = 0.0
    start[20:40] = -0.0
    w = F32(weight)
    expected = [MA.lerp(float(s), float(e), float(w)) for s, e in zip(start, end)]
    assert np.array_equal(bits(lerp32(start, end, w)), bits(expected))


# ---- the phases against the authority ----
def random_state(rng, fmt, shape, scale_low=-45, scale_high=2):
    m = spread(rng, math.prod(shape), scale_low, scale_high).reshape(shape)
    if fmt.mode == "fp32":
        return m
    if fmt.mode == "bf16":
        return bf16_bits(m)
    return fmt.code.encode(m)


@pytest.mark.parametrize("mode, bias", [("packed", 31), ("packed", 36), ("bf16", 31), ("fp32", 31)])
@pytest.mark.parametrize("nesterov, maximize", [(True, False), (False, False), (True, True)])
def test_momentum_phase_matches_the_authority(mode, bias, nesterov, maximize):
    rng = np.random.default_rng(11)
    fmt = StateFormat(mode, bias)
    shape = (13, 17)  # 221 elements: vector bodies and a scalar tail
    for momentum in (0.95, 0.3):
        state = random_state(rng, fmt, shape)
        grad = spread(rng, 221, -50, 4).reshape(shape)  # saturating and subnormal momenta
        grad.flat[:5] = [0.0, -0.0, 1e-45, -3e-39, 4.0]
        before = state.copy()
        scalars = step_scalar_row((0.02, momentum, 0.1, 1e-7), shape)
        ns_in = momentum_phase(grad, state, scalars, fmt=fmt, nesterov=nesterov, maximize=maximize)
        assert ns_in is not None
        for i in range(221):
            st = before.flat[i].item()
            new_state, x, ok = MA.momentum_element(float(grad.flat[i]), st, momentum=momentum, mode=mode,
                                                   mu_bias=bias, nesterov=nesterov, maximize=maximize)
            assert ok
            got_state = state.flat[i].item()
            if mode == "fp32":
                assert A.f32_bits(got_state) == A.f32_bits(new_state), i
            else:
                assert got_state == new_state, i
            assert A.f32_bits(float(bf16_values_of(ns_in.flat[i]))) == A.f32_bits(x), i


def bf16_values_of(b):
    return np.uint32(int(b) << 16).view(F32)


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
def test_a_non_finite_gradient_refuses_the_whole_matrix(mode):
    rng = np.random.default_rng(5)
    fmt = StateFormat(mode)
    for bad in (np.nan, np.inf, -np.inf):
        state = random_state(rng, fmt, (4, 6))
        before = state.copy()
        grad = spread(rng, 24, -20, 0).reshape(4, 6)
        grad[2, 3] = bad
        assert momentum_phase(grad, state, step_scalar_row((0.02, 0.95, 0.1, 1e-7), (4, 6)), fmt=fmt) is None
        assert np.array_equal(state.view(np.uint8), before.view(np.uint8))
        assert not MA.momentum_element(float(bad), 0, momentum=0.95, mode=mode)[2]


def test_state_of_the_wrong_dtype_is_refused_and_int16_views_are_read_as_bits():
    scalars = step_scalar_row((0.02, 0.95, 0.1, 1e-7), (1, 3))
    grad = np.array([[1.0, -2.0, 0.5]], F32)
    with pytest.raises(TypeError, match="momentum_code"):
        momentum_phase(grad, np.zeros((1, 3), F32), scalars, fmt=StateFormat())
    with pytest.raises(TypeError, match="momentum_buffer"):
        momentum_phase(grad, np.zeros((1, 3), np.uint16), scalars, fmt=StateFormat("fp32"))
    codes = StateFormat().code.encode(np.array([[-0.5, 1.5, -1e-3]], F32))
    as_int16 = codes.view(np.int16).copy()
    momentum_phase(grad, codes, scalars, fmt=StateFormat())
    momentum_phase(grad, as_int16, scalars, fmt=StateFormat())
    assert np.array_equal(as_int16.view(np.uint16), codes)


def test_overflowing_momenta_refuse_the_matrix():
    scalars = step_scalar_row((0.02, 0.5, 0.1, 1e-7), (1, 2))
    state = np.array([[3.0e38, -3.0e38]], F32)  # fp32: g - m overflows
    grad = np.array([[-3.0e38, 3.0e38]], F32)
    assert momentum_phase(grad, state.copy(), scalars, fmt=StateFormat("fp32")) is None
    # bf16 mode: a finite momentum past bf16's range would round to Inf
    state = np.zeros((1, 2), np.uint16)
    grad = np.array([[3.4e38, 1.0]], F32)
    assert momentum_phase(grad, state, step_scalar_row((0.02, 0.0, 0.1, 1e-7), (1, 2)), fmt=StateFormat("bf16"),
                          nesterov=False) is None
    assert not MA.momentum_element(3.4e38, 0, momentum=0.0, mode="bf16", nesterov=False)[2]
    # packed mode saturates instead, and counts it
    counts = np.zeros(3, np.int64)
    state = np.zeros((1, 2), np.uint16)
    assert momentum_phase(grad, state, step_scalar_row((0.02, 0.0, 0.1, 1e-7), (1, 2)), fmt=StateFormat(),
                          nesterov=False, format_counts_out=counts) is None  # the NS input is past bf16
    grad = np.array([[5.0, 2.0**-41, 2.0**-35, -2.0**-45]], F32)
    state = np.zeros((1, 4), np.uint16)
    ns_in = momentum_phase(grad, state, step_scalar_row((0.02, 0.0, 0.1, 1e-7), (1, 4)), fmt=StateFormat(),
                           nesterov=False, format_counts_out=counts)
    assert ns_in is not None and state[0, 0] == 0x7FFF and counts.tolist() == [1, 2, 1]


@pytest.mark.parametrize("ortho_bf16", [False, True])
def test_weight_phase_matches_the_authority(ortho_bf16):
    rng = np.random.default_rng(13)
    shape = (9, 23)
    p = spread(rng, 207, -140, 10).reshape(shape)
    p.flat[:4] = [0.0, -0.0, 3.3e38, -3.4e38]
    o = spread(rng, 207, -20, 1).reshape(shape)
    o_in = bf16_bits(o) if ortho_bf16 else o
    o_used = (bf16_bits(o).astype(U32) << 16).view(F32) if ortho_bf16 else o
    o_used = o_used.reshape(shape)
    for lr, wd, fn in ((0.02, 0.1, None), (3.0, 0.0, "match_rms_adamw"), (1e38, 0.5, None)):
        scalars = step_scalar_row((lr, 0.95, wd, 1e-7), shape, adjust_lr_fn=fn)
        adj = adjusted_lr(lr, shape, fn)
        got = p.copy()
        rejected = weight_phase(got, o_in, scalars)
        expected = [MA.weight_element(float(x), float(y), lr=lr, weight_decay=wd, adjusted_lr=adj)
                    for x, y in zip(p.flat, o_used.flat)]
        assert np.array_equal(bits(got).ravel(), bits([e[0] for e in expected]))
        assert rejected == sum(not e[1] for e in expected)
        # split masters: the same masters, their split written back
        w, lo = split_master(p)
        w_got, lo_got = w.copy(), lo.copy()
        rejected = weight_phase_split(w_got, lo_got, o_in, scalars)
        expected = [MA.weight_split_element(int(a), int(b), float(y), lr=lr, weight_decay=wd, adjusted_lr=adj)
                    for a, b, y in zip(w.flat, lo.flat, o_used.flat)]
        assert w_got.ravel().tolist() == [e[0] for e in expected]
        assert lo_got.ravel().tolist() == [e[1] for e in expected]
        assert rejected == sum(not e[2] for e in expected)
    assert rejected > 0  # lr 1e38 overflows some elements


def test_a_zero_weight_beside_a_negative_low_half_reads_as_zero():
    w = np.array([0x0000, 0x8000], np.uint16)
    lo = np.array([-5, -7], np.int16)
    scalars = step_scalar_row((0.5, 0.95, 0.0, 1e-7), (1, 2))
    assert weight_phase_split(w, lo, np.array([1.0, -1.0], F32), scalars) == 0
    assert bits((w.astype(U32) << 16).view(F32)).tolist() == bits([-0.5, 0.5]).tolist()


# ---- fp32 mode against torch's CPU operations ----
torch = pytest.importorskip("torch")
# torch's CPU lerp and add(alpha=) fuse their multiply-add in the AVX2/AVX512 kernels (vector
# bodies and scalar tails alike); its DEFAULT (no-SIMD) build rounds twice (docs/MUON.md).
fused_torch = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                                 reason="torch's DEFAULT CPU kernels do not fuse lerp's multiply-add")


@fused_torch
@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 31, 33, 1001, 40003])
@pytest.mark.parametrize("weight", [1 - 0.95, 0.95, 0.5, 0.3, 0.7])
def test_lerp_and_weight_update_equal_torch_cpu_ops(n, weight):
    rng = np.random.default_rng(n)
    a, b = spread(rng, n, -40, 4), spread(rng, n, -40, 4)
    assert np.array_equal(bits(torch.from_numpy(a).lerp(torch.from_numpy(b), weight).numpy()),
                          bits(lerp32(a, b, F32(weight))))
    p = spread(rng, n, -20, 2).reshape(1, n)
    o = torch.from_numpy(spread(rng, n, -10, 1).reshape(1, n)).bfloat16()
    expected = torch.from_numpy(p.copy())
    expected.mul_(1 - 0.02 * weight)
    expected.add_(o, alpha=-0.02 * 1.5)
    scalars = (F32(0), F32(0), F32(1 - 0.02 * weight), F32(-0.02 * 1.5))
    got = p.copy()
    weight_phase(got, o.view(torch.int16).numpy(), scalars)
    assert np.array_equal(bits(got), bits(expected.numpy()))


def test_bf16_mode_rounds_as_torchs_bfloat16():
    """Every tie between neighbouring bf16 numbers, its float32 neighbours, the overflow edge,
    signed zeros and random values: the bf16 momentum's bits are torch's `.bfloat16()`'s."""
    finite = np.arange(0x7F80, dtype=U32)
    low, high = (finite[:-1] << 16).view(F32), (finite[1:] << 16).view(F32)
    ties = ((low.astype(np.float64) + high) / 2).astype(F32)
    rng = np.random.default_rng(19)
    values = np.concatenate([ties, np.nextafter(ties, F32(np.inf)), np.nextafter(ties, F32(0)),
                             np.array([0.0, -0.0, 3.3895e38, 3.3961e38, 3.4e38], F32), spread(rng, 5000, -140, 127)])
    values = np.concatenate([values, -values])
    expected = torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(values), expected)
    sample = values[::37]
    got = [MA.encode(float(v), "bf16") for v in sample]
    assert [g for g in got if g is not None] == [int(e) for e, g in zip(expected[::37], got) if g is not None]
    assert [g is None for g in got] == ((expected[::37] & 0x7FFF) == 0x7F80).tolist()


def torch_newton_schulz(ns_bits, ns_coefficients, ns_steps, eps, device="cpu"):
    """torch.optim.Muon's own Newton-Schulz (a private function: the oracle's, not ours), on
    `device`; returns its bf16 output's bits."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    x = torch.from_numpy(ns_bits.view(np.int16)).view(torch.bfloat16).to(device)
    return _zeropower_via_newtonschulz(x, ns_coefficients, ns_steps, eps).view(torch.int16).cpu().numpy()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu", marks=fused_torch), pytest.param("cuda", marks=[pytest.mark.cuda, cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (8, 8)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_fp32_mode_steps_equal_torch_optim_muon(device, shape, nesterov, adjust_lr_fn):
    """Our elementwise phases around torch's Newton-Schulz on the same device give
    torch.optim.Muon's parameters and momentum buffer bit for bit (on CUDA: its lerp and
    add(alpha=) compile to fused multiply-adds, as the contract's)."""
    rng = np.random.default_rng(sum(shape))
    lr, momentum, wd, eps, coefficients, steps = 0.02, 0.95, 0.1, 1e-7, (3.4445, -4.775, 2.0315), 5
    p0 = (rng.standard_normal(shape) * 0.2).astype(F32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()).to(device))
    opt = torch.optim.Muon([param], lr=lr, momentum=momentum, weight_decay=wd, nesterov=nesterov, eps=eps,
                           ns_coefficients=coefficients, ns_steps=steps, adjust_lr_fn=adjust_lr_fn)
    ours, buffer = p0.copy(), np.zeros(shape, F32)
    scalars = step_scalar_row((lr, momentum, wd, eps), shape, adjust_lr_fn=adjust_lr_fn)
    for _ in range(4):
        grad = (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 0, shape)).astype(F32)
        param.grad = torch.from_numpy(grad.copy()).to(device)
        opt.step()
        ns_in = momentum_phase(grad, buffer, scalars, fmt=StateFormat("fp32"), nesterov=nesterov)
        assert weight_phase(ours, torch_newton_schulz(ns_in, coefficients, steps, eps, device), scalars) == 0
        assert np.array_equal(bits(buffer), bits(opt.state[param]["momentum_buffer"].cpu().numpy()))
        assert np.array_equal(bits(ours), bits(param.detach().cpu().numpy()))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("weight", [1 - 0.95, 0.95, 0.3, 0.7])
def test_torch_cuda_lerp_and_add_are_the_contracts_fused_forms(weight):
    rng = np.random.default_rng(17)
    n = 100_003
    a, b = spread(rng, n, -40, 4), spread(rng, n, -40, 4)
    got = torch.from_numpy(a).cuda().lerp(torch.from_numpy(b).cuda(), weight).cpu().numpy()
    assert np.array_equal(bits(got), bits(lerp32(a, b, F32(weight))))
    o = torch.from_numpy(b).bfloat16()
    p = torch.from_numpy(a.copy()).cuda()
    p.add_(o.cuda(), alpha=-weight)
    assert np.array_equal(bits(p.cpu().numpy()), bits(fma32(F32(-weight), o.float().numpy(), a)))


def test_numpy_newton_schulz_reference_is_close_to_torchs():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 10)).astype(F32)
    ours = newton_schulz_reference(x)
    theirs = (torch_newton_schulz(bf16_bits(x), (3.4445, -4.775, 2.0315), 5, 1e-7).astype(np.int16)
              .view(np.uint16).astype(U32) << 16).view(F32)
    assert np.abs(ours - theirs).max() < 0.05  # bf16 against float32: no bits are promised
    singular = np.linalg.svd(ours, compute_uv=False)
    assert (singular > 0.5).all() and (singular < 1.5).all()


# ---- the rule's declarations (core/rule.py), against the host validation above ----
_ROW_EDGES = [0.0, -0.0, -1e-30, 1e-30, float(np.nextafter(F32(1), F32(0))), 1.0, 1 - 1e-9, 2.0,
              1.1754943508222875e-38, 1e-39, 3.4028234663852886e38, 3.5e38, float("inf"), float("nan")]


def test_muon_declares_its_code_group_keys_and_row():
    """Muon's Rule names its one 16-bit code (the packed momentum, biased by mu_bias), its
    group keys (torch.optim.Muon's) and the row they give, as AdamW's does."""
    from packed_adamw.core import launch
    from packed_adamw.core.muon import FORMAT_COUNTS
    from packed_adamw.core.muon import hyperparams as H

    (code,) = RULE.codes
    assert RULE.count_names == FORMAT_COUNTS == ("saturated_mu", "flushed_mu", "subnormal_mu")
    assert len(FORMAT_COUNTS) <= launch.MAX_FORMAT_COUNTS
    fmt = StateFormat("packed", 20)  # the option the code's bias comes from, and its codec
    assert getattr(fmt, code.bias_option) == 20 and fmt.code == momentum_format(20) and fmt.code.bias == 20
    assert RULE.group_keys == ("lr", "momentum", "weight_decay", "eps") == RULE.hyperparam_fields
    assert RULE.group_row(1e-3, 0.95, 0.1, 1e-7) == (1e-3, 0.95, 0.1, 1e-7) == tuple(Hyperparams(1e-3).as_row())
    assert RULE.row_group(*RULE.group_row(0.02, 0.9, 0.0, 1e-7)) == (0.02, 0.9, 0.0, 1e-7)
    assert RULE.group_row("0.5", 0.9, 0, 1, number=lambda x: x) == ("0.5", 0.9, 0, 1)  # values as given
    with pytest.raises(ValueError):
        RULE.group_row("lr", 0.9, 0.0, 1e-7)  # not a number: float() says so
    assert RULE.validate is H.validate_hyperparams
    # One row for every matrix, no mask; the weight phase always reads the weights.
    assert RULE.variant_rows((1e-3, 0.95, 0.1, 1e-7)) == [(1e-3, 0.95, 0.1, 1e-7)]
    assert RULE.param_reading_fields(0) is None
    with pytest.raises(ValueError, match="no masked row variant"):
        RULE.leaf_variant(False)
    # A value known only in a graph is left to rows_valid.
    validate_hyperparams(object(), 0.95, 0.1, 1e-7, allow_arrays=True)


@pytest.mark.parametrize("field", ["lr", "momentum", "weight_decay", "eps"])
def test_muon_rows_valid_refuses_exactly_what_the_host_validation_refuses(field):
    """Rule.rows_valid (the in-graph check, over float32 rows) and validate_hyperparams agree
    at every edge of each field's bounds, and a refused row is explained in the validation's
    words (Rule.refusal_reason)."""
    from packed_adamw.core.muon import HPARAM_BOUNDS

    for value in _ROW_EDGES:
        group = {"lr": 1e-3, "momentum": 0.95, "weight_decay": 0.0, "eps": 1e-7, field: value}
        if field == "weight_decay":
            group["lr"] = 0.0  # lr * weight_decay stays finite: the bound alone decides
        values = [group[key] for key in RULE.group_keys]
        # 3.5e38 is Inf in float32, as the step sees it; Inf * 0 (lr * weight_decay) is NaN: refused
        with np.errstate(over="ignore", invalid="ignore"):
            row = np.array([RULE.group_row(*values)], np.float32)
            valid = bool(HPARAM_BOUNDS[field].holds(float(F32(value))))
            assert RULE.rows_valid(row).tolist() == [valid], (field, value)
            field_index = RULE.hyperparam_fields.index(field) if field in RULE.hyperparam_fields else None
            if field_index is not None:  # the host's check of one changed field: the same verdict
                assert RULE.field_holds(field_index, RULE.group_row(*values)) == valid, (field, value)
            if valid:
                validate_hyperparams(*values)
                continue
            with pytest.raises(ValueError) as raised:
                validate_hyperparams(*values)
            assert RULE.refusal_reason(values) == str(raised.value)


def test_muon_rows_valid_refuses_an_overflowing_decay_product_as_the_host_does():
    from packed_adamw.core.codecs import FLOAT32_MAX

    cases = ((1e19, 1e19, True), (1e20, 1e20, False), (FLOAT32_MAX, 1.0, True), (FLOAT32_MAX, 1.5, False))
    for lr, wd, finite in cases:
        with np.errstate(over="ignore"):  # the float32 product overflows to Inf: refused
            assert RULE.rows_valid(np.array([[lr, 0.95, wd, 1e-7]], np.float32)).tolist() == [finite], (lr, wd)
        assert RULE.field_holds(0, (lr, 0.95, wd, 1e-7)) == finite, (lr, wd)
        if finite:
            validate_hyperparams(lr, 0.95, wd, 1e-7)
        else:
            with pytest.raises(ValueError, match="lr \\* weight_decay finite"):
                validate_hyperparams(lr, 0.95, wd, 1e-7)
