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
    commit_momentum,
    decode_momentum,
    fma32,
    lerp32,
    momentum_format,
    momentum_phase,
    momentum_update,
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
    # The packed identity names the per-matrix power-of-two exponent; the one before it (the codes
    # alone) is still read, with every exponent 0 (the values those codes had).
    assert StateFormat().identity == "muon-packed:mu=SE5M10b31:scale=pow2/matrix"
    assert StateFormat(mu_bias=36).identity == "muon-packed:mu=SE5M10b36:scale=pow2/matrix"
    assert StateFormat("bf16").identity == "muon-bf16:mu=bf16" and StateFormat("fp32").identity == "muon-fp32:mu=f32"
    with pytest.raises(ValueError, match="muon-packed:mu=SE5M10b36"):
        StateFormat().check_identity("muon-packed:mu=SE5M10b36")
    for bad in ("muon-packed:mu=SE5M10b36:scale=pow2/matrix", "muon-packed:mu=SE5M10b31:scale=pow2", None):
        with pytest.raises(ValueError, match="construct the optimizer with the saved state's mode and mu_bias"):
            StateFormat().check_identity(bad)
    assert StateFormat(mu_bias=36).check_identity("muon-packed:mu=SE5M10b36:scale=pow2/matrix") is False
    assert StateFormat(mu_bias=36).check_identity("muon-packed:mu=SE5M10b36") is True  # saved without exponents
    assert StateFormat("bf16").check_identity("muon-bf16:mu=bf16") is False
    assert StateFormat("bf16").legacy_identity is None
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
    # packed mode's exponent: one int32 a matrix, whole on every shard; the other modes have none
    entry = StateFormat().exponent_entry
    assert (entry.key, entry.dtype, entry.shape((3, 5)), entry.bytes_per_param, entry.sharding(("data", None))) == \
        ("mu_exponent", "int32", (), 0, ())
    assert formats["bf16"].exponent_entry is None and formats["fp32"].exponent_entry is None
    assert StateFormat().exponent_range == (-148, 128) and StateFormat(mu_bias=0).exponent_range == (-179, 97)
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
    with pytest.raises(ValueError, match="Number of steps must be at least 1: ns_steps=0"):  # not "less than 100"
        validate_ns((1.0, 2.0, 3.0), 0, None)
    with pytest.raises(ValueError, match="^ns_steps=2.5 is not an int"):  # not a bound it keeps
        validate_ns((1.0, 2.0, 3.0), 2.5, None)
    with pytest.raises(ValueError, match=r"^a coefficient is not finite: ns_coefficients=\(nan, 1.0, 1.0\)"):
        validate_ns((float("nan"), 1.0, 1.0), 5, None)
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


def exponent_of(fmt, value=0):
    """Packed mode's per-matrix exponent as the numpy phase takes it (None in the other modes)."""
    return np.array(value, np.int32) if fmt.mode == "packed" else None


@pytest.mark.parametrize("mode, bias", [("packed", 31), ("packed", 36), ("bf16", 31), ("fp32", 31)])
@pytest.mark.parametrize("nesterov, maximize", [(True, False), (False, False), (True, True)])
def test_momentum_phase_matches_the_authority(mode, bias, nesterov, maximize):
    """Packed mode over exponents that put the stored momenta high, low (their decoded values
    subnormal in float32) and at 0 (a state saved before the exponents); the new exponent too."""
    rng = np.random.default_rng(11)
    fmt = StateFormat(mode, bias)
    shape = (13, 17)  # 221 elements: vector bodies and a scalar tail
    for momentum, old_exponent, grad_scale in ((0.95, 0, 0), (0.3, -40, -70), (0.95, 60, 50), (0.3, -120, -125)):
        state = random_state(rng, fmt, shape)
        grad = spread(rng, 221, -50 + grad_scale, 4 + grad_scale).reshape(shape)  # many binades below the largest
        grad.flat[:5] = [0.0, -0.0, 1e-45, -3e-39, 4.0 * 2.0**grad_scale]
        before = state.copy()
        exponent = exponent_of(fmt, old_exponent)
        scalars = step_scalar_row((0.02, momentum, 0.1, 1e-7), shape)
        ns_in = momentum_phase(grad, state, scalars, fmt=fmt, exponent=exponent, nesterov=nesterov, maximize=maximize)
        assert ns_in is not None
        new_states, new_exponent, xs, ok = MA.momentum_matrix(
            [float(g) for g in grad.flat], [s.item() for s in before.flat], momentum=momentum,
            exponent=old_exponent, mode=mode, mu_bias=bias, nesterov=nesterov, maximize=maximize)
        assert ok
        if mode == "packed":
            assert int(exponent) == new_exponent
        for i in range(221):
            got_state = state.flat[i].item()
            if mode == "fp32":
                assert A.f32_bits(got_state) == A.f32_bits(new_states[i]), i
            else:
                assert got_state == new_states[i], i
            assert A.f32_bits(float(bf16_values_of(ns_in.flat[i]))) == A.f32_bits(xs[i]), i


def bf16_values_of(b):
    return np.uint32(int(b) << 16).view(F32)


# ---- packed mode's per-matrix power-of-two exponent ----
def test_ldexp_and_the_exponent_from_amax_match_the_authority():
    """MUON.md's ldexp32 (two float32 products by powers of two; a subnormal result rounded at
    the second) and the exponent chosen from a matrix's largest |m'| (normal and subnormal
    float32 amaxes, every bias's window) against the authority."""
    from packed_adamw.core.muon.float32 import floor_log2, ldexp32
    from packed_adamw.core.muon.numpy_step import matrix_exponent

    rng = np.random.default_rng(21)
    x = spread(rng, 4000, -149, 127)
    x[:6] = [0.0, -0.0, 1e-45, -1e-45, 3.4e38, -1.17e-38]
    n = rng.integers(-252, 255, 4000)
    got = np.array([ldexp32(v, k) for v, k in zip(x, n)], F32)
    assert np.array_equal(bits(got), bits([MA.ldexp(float(v), int(k)) for v, k in zip(x, n)]))
    assert np.array_equal(bits(ldexp32(x, 0)), bits(x))  # a state saved before the exponents reads as it was
    amax = np.abs(spread(rng, 2000, -149, 128))
    amax[:4] = [1e-45, 2.0**-149 * 3, 2.0**-126, np.finfo(F32).max]
    for bias in BIASES:
        fmt = StateFormat(mu_bias=bias)
        for a in amax:
            s = matrix_exponent(a, 5, fmt)
            assert s == MA.matrix_exponent(float(a), 5, bias) and s - bias + 30 == floor_log2(a)
            assert fmt.exponent_range[0] <= s <= fmt.exponent_range[1]
            assert 2.0 ** (30 - bias) <= float(a) * 2.0 ** -s < 2.0 ** (31 - bias)  # exponent field 30
        assert matrix_exponent(F32(0), 5, fmt) == MA.matrix_exponent(0.0, 5, bias) == 5  # amax 0: kept


def packed_run(grads, bias=31, momentum=0.95, nesterov=True):
    """The numpy momentum phase (packed) over the gradients from a fresh state: the codes, the
    exponents and the Newton-Schulz inputs' values after each step."""
    fmt = StateFormat("packed", bias)
    state, exponent = np.zeros(grads[0].shape, np.uint16), np.zeros((), np.int32)
    scalars = step_scalar_row((0.02, momentum, 0.1, 1e-7), grads[0].shape)
    out = []
    for g in grads:
        x = momentum_phase(g, state, scalars, fmt=fmt, exponent=exponent, nesterov=nesterov)
        out.append((state.copy(), int(exponent), (x.astype(U32) << 16).view(F32)))
    return out


@pytest.mark.parametrize("scale", [-12, 12, 20, -100, 100])
def test_packed_momentum_is_invariant_to_a_power_of_two_scale_of_the_gradients(scale):
    """Gradients times 2**scale give the same codes at every step, exponents `scale` higher and
    Newton-Schulz inputs times 2**scale exactly (power-of-two scaling commutes with rounding
    while values stay normal): as torch.optim.Muon's step is, the packed step is unchanged.
    With the fixed window of bias 31 alone, 2**12 already saturated and 2**-100 flushed."""
    rng = np.random.default_rng(31)
    grads = [(rng.standard_normal((6, 9)) * 2.0 ** rng.integers(-12, 0, (6, 9))).astype(F32) for _ in range(6)]
    for (codes, exponent, x), (codes_s, exponent_s, x_s) in zip(
            packed_run(grads), packed_run([(g * F32(2.0 ** scale)).astype(F32) for g in grads])):
        assert np.array_equal(codes, codes_s) and exponent_s == exponent + scale
        assert np.array_equal(bits(x_s), bits((x * F32(2.0 ** scale)).astype(F32)))


def test_the_codes_are_the_same_for_every_bias_and_the_exponent_shifts_by_it():
    """mu_bias no longer moves the trajectory: its codes are bit for bit the same, its exponent
    is bias - 31 higher, so every decoded momentum and Newton-Schulz input is the same."""
    rng = np.random.default_rng(32)
    grads = [(rng.standard_normal((7, 5)) * 2.0 ** rng.integers(-30, 0, (7, 5))).astype(F32) for _ in range(4)]
    reference = packed_run(grads)
    for bias in (0, 36, 100):
        for (codes, exponent, x), (codes_b, exponent_b, x_b) in zip(reference, packed_run(grads, bias)):
            assert np.array_equal(codes, codes_b) and exponent_b == exponent + bias - 31
            assert np.array_equal(bits(x), bits(x_b))
            assert np.array_equal(bits(decode_momentum(codes, StateFormat(), exponent)),
                                  bits(decode_momentum(codes_b, StateFormat(mu_bias=bias), exponent_b)))


def test_a_state_saved_before_the_exponents_reads_with_exponent_zero():
    """Codes of the fixed-window format (bias 31, no exponent) decode, with s = 0, to the very
    values the format had: every code of every bias. A sharded matrix's shards take the whole
    matrix's amax (`commit_momentum`): each shard's codes are then the whole matrix's."""
    for bias in BIASES:
        fmt = StateFormat(mu_bias=bias)
        assert np.array_equal(bits(decode_momentum(ALL_CODES.astype(np.uint16), fmt, 0)),
                              bits(momentum_format(bias).decode_table))
    rng = np.random.default_rng(33)
    fmt, shape = StateFormat(), (6, 8)
    state = fmt.code.encode(spread(rng, 48, -20, 0).reshape(shape))
    grad = spread(rng, 48, -25, -3).reshape(shape)
    scalars = step_scalar_row((0.02, 0.95, 0.1, 1e-7), shape)
    whole_state, whole_exponent = state.copy(), np.array(-3, np.int32)
    momentum_phase(grad, whole_state, scalars, fmt=fmt, exponent=whole_exponent)
    updates = [momentum_update(grad[rows], state[rows], scalars, fmt=fmt, exponent=np.array(-3, np.int32))
               for rows in (slice(0, 2), slice(2, 6))]
    amax = max(u.amax for u in updates)
    for rows, update in zip((slice(0, 2), slice(2, 6)), updates):
        part, exponent = state[rows].copy(), np.array(-3, np.int32)
        commit_momentum(update, part, fmt=fmt, exponent=exponent, amax=amax)
        assert np.array_equal(part, whole_state[rows]) and exponent == whole_exponent


def test_an_exponent_no_step_stores_is_refused_by_the_one_check_and_by_decode_momentum():
    """`StateFormat.check_exponent`, which every reader of a saved state calls: the format's int32
    of one exponent per matrix, inside `exponent_range`, and (given the codes) none under which a
    matrix's largest code decodes past float32's range; each refusal names the exponent, its
    value and the range. decode_momentum refuses one outside the range in the same words,
    instead of ldexp32's halves of it."""
    fmt = StateFormat(mu_bias=40)  # exponent_range (-139, 137)
    codes = np.zeros((2, 3, 4), np.uint16)
    codes[1, 2, 3] = 0x7C00  # 1.0 * 2**(31 - 40): times 2**137, past float32's largest value
    for value in (1000, -300, 200, 138, -140):
        with pytest.raises(ValueError, match=rf"^decode_momentum: the exponent is {value}, outside the \[-139, 137\] a "
                                             r"step stores with mu_bias 40"):
            decode_momentum(codes[0], fmt, value)
        with pytest.raises(ValueError, match=rf"^params/w/opt/mu_exponent is {value}, outside the \[-139, 137\]"):
            fmt.check_exponent(np.array(value, np.int32), "params/w/opt/mu_exponent")
    with pytest.raises(ValueError, match=r"^exponent\.0 is \[3, 1000\], outside the \[-139, 137\].*export it again"):
        fmt.check_exponent(np.array([3, 1000], np.int32), "exponent.0", shape=(2,), remedy="export it again")
    for bad, got in ((np.array(3, np.int64), "int64 ()"), (np.array([3], np.int32), r"int32 \(1,\)"), (3.0, "float")):
        with pytest.raises(ValueError, match=rf"^e must be the matrices' int32 exponents of shape \(\) .*got {got}"):
            fmt.check_exponent(bad, "e")
    edge = np.array([137, 137], np.int32)
    with pytest.raises(ValueError, match=r"^e is \[137, 137\], under which the momentum holds NaN or Inf"):
        fmt.check_exponent(edge, "e", shape=(2,), codes=codes)
    codes[1, 2, 3] = 0x7BFF  # the code below: finite at 2**137, and the other matrix is all zeros
    checked = fmt.check_exponent(edge, "e", shape=(2,), codes=codes.view(np.int16))  # torch's int16 view too
    assert checked.dtype == np.int32 and checked.tolist() == [137, 137]
    assert np.isfinite(decode_momentum(codes[1], fmt, 137)).all()
    assert fmt.check_exponent(-139, "e").dtype == np.int32  # a Python int is one matrix's


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
def test_a_non_finite_gradient_refuses_the_whole_matrix(mode):
    rng = np.random.default_rng(5)
    fmt = StateFormat(mode)
    for bad in (np.nan, np.inf, -np.inf):
        state = random_state(rng, fmt, (4, 6))
        before = state.copy()
        grad = spread(rng, 24, -20, 0).reshape(4, 6)
        grad[2, 3] = bad
        exponent = exponent_of(fmt, -7)
        assert momentum_phase(grad, state, step_scalar_row((0.02, 0.95, 0.1, 1e-7), (4, 6)), fmt=fmt,
                              exponent=exponent) is None
        assert np.array_equal(state.view(np.uint8), before.view(np.uint8))
        assert exponent is None or int(exponent) == -7
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
    exponents = [np.zeros((), np.int32), np.zeros(1, np.int32)]  # a 0-d tensor's array, or one element of a batch
    momentum_phase(grad, codes, scalars, fmt=StateFormat(), exponent=exponents[0])
    momentum_phase(grad, as_int16, scalars, fmt=StateFormat(), exponent=exponents[1])
    assert np.array_equal(as_int16.view(np.uint16), codes) and exponents[0] == exponents[1] == 1
    # packed mode keeps one exponent per matrix, the others none: each refused naming it
    for exponent in (None, 0, np.zeros((), np.int64), np.zeros(2, np.int32)):
        with pytest.raises(TypeError, match="exponent must be the matrix's int32 exponent"):
            momentum_phase(grad, codes, scalars, fmt=StateFormat(), exponent=exponent)
    with pytest.raises(TypeError, match="exponent: muon-fp32:mu=f32 keeps no exponent"):
        momentum_phase(grad, np.zeros((1, 3), F32), scalars, fmt=StateFormat("fp32"), exponent=np.zeros((), np.int32))


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
    # packed mode scales the matrix instead (its largest |m'| in exponent field 30): nothing
    # saturates, and the values 40 binades and more below the largest flush
    counts = np.zeros(3, np.int64)
    state = np.zeros((1, 2), np.uint16)
    assert momentum_phase(grad, state, step_scalar_row((0.02, 0.0, 0.1, 1e-7), (1, 2)), fmt=StateFormat(),
                          exponent=np.zeros((), np.int32), nesterov=False,
                          format_counts_out=counts) is None  # the NS input is past bf16
    grad = np.array([[5.0, 2.0**-41, 2.0**-35, -2.0**-45]], F32)
    state, exponent = np.zeros((1, 4), np.uint16), np.zeros((), np.int32)
    ns_in = momentum_phase(grad, state, step_scalar_row((0.02, 0.0, 0.1, 1e-7), (1, 4)), fmt=StateFormat(),
                           exponent=exponent, nesterov=False, format_counts_out=counts)
    # 5 = 0.625 * 2**3: exponent 3, code exponent field 30, fraction 0.25; 2**-35 * 2**-3 subnormal
    assert ns_in is not None and int(exponent) == 3 and state[0, 0] == (30 << 10 | 256)
    assert counts.tolist() == [0, 2, 1]


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


NAN_PAYLOADS = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7F800001, 0xFFC00000, 0x7FC00000], U32)  # 0x7FFFFFFF: a GPU's NaN


def test_every_nan_rounds_to_the_quiet_nan():
    """A NaN is no number to round: its bits plus the rounding carry could reach the sign bit
    (0x7FFFFFFF, the NaN an NVIDIA GPU makes, became -0: an overflowing Newton-Schulz gave a zero
    update on the GPU and the step was accepted). Every NaN gives 0x7FC0; Inf and the largest
    finite values keep theirs."""
    assert (bf16_bits(NAN_PAYLOADS.view(F32)) == 0x7FC0).all()
    edges = np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F7FFF], U32).view(F32)
    assert bf16_bits(edges).tolist() == [0x7F80, 0xFF80, 0x7F80, 0x7F7F]


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
