"""Split masters (docs/FORMAT.md, "Split masters"): a bf16 live weight plus an int16 low half
hold an FP32 master exactly.

The numpy codecs (core/codecs.py), the kernel's `split_master` / `join_master` (core/kernel.py;
interpreted on CPU, compiled and exhaustive over all 2**32 patterns on CUDA) and the scalar
authority agree bit for bit; the live weight equals an independent rounding to nearest, ties
away from zero; and the split numpy step follows the FP32-parameter step's master trajectory bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kernel_harness as H
from conftest import CUDA, interpreting
from packed_adamw.core import Hyperparams, StateFormat, launch
from packed_adamw.core import kernel as G
from packed_adamw.core.adamw import authority as A
from packed_adamw.core.adamw import kernel as K
from packed_adamw.core.adamw.numpy_step import CHUNK, apply_split_step, apply_step, step_scalar_row
from packed_adamw.core.codecs import LOW_HALF_KEY, SPLIT_MASTER_MAX, SPLIT_MASTER_MAX_BITS, join_master, split_master
from packed_adamw.core.adamw.rule import FORMAT_COUNTS

F32 = np.float32
U32 = np.uint32
U16 = np.uint16
I16 = np.int16
MODES = ["packed", "fp16", "fp32"]
SIGN = 0x80000000
MAGNITUDE = 0x7FFFFFFF
INF_BITS = 0x7F800000
# Huge and non-finite inputs are deliberate; numpy and the interpreter warn on their overflow.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


def _edge_bits() -> np.ndarray:
    """Every edge of the rule, both signs, each with its two neighbouring patterns."""
    centres = [
        0x00000000,  # zero
        0x00000001, 0x00007FFF, 0x00008000, 0x0000FFFF, 0x00010000, 0x00018000,  # tiny subnormals, ties
        0x007F8000, 0x007FFFFF, 0x00800000,  # largest subnormal, rounding up to the smallest normal
        0x3F800000, 0x3F808000, 0x3F818000, 0x3F7F8000, 0x3FFF8000,  # ties: even/odd neighbour, binade top
        0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # bf16 max, SPLIT_MASTER_MAX, next up, FLT_MAX
        INF_BITS, 0x7FC00000, 0x7FFF7FFF, 0x7FFF8000, 0x7FFFFFFF,  # Inf, NaNs (the last two wrap)
    ]
    centres = np.array(centres, dtype=np.int64)
    around = np.concatenate([centres - 1, centres, centres + 1]) % 2**32
    both_signs = np.concatenate([around, around ^ SIGN])
    return np.unique(both_signs).astype(U32)


EDGE_BITS = _edge_bits()


def sample_bits(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(0, 2**32, n, dtype=np.uint64).astype(U32), EDGE_BITS])


def as_f32(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bits, dtype=U32).view(F32)


def bf16_value(w_bits: np.ndarray) -> np.ndarray:
    return (w_bits.astype(U32) << U32(16)).view(F32)


def nearest_bf16_ties_away(master: np.ndarray) -> np.ndarray:
    """Finite float32 values -> the nearest bf16 value, ties away from zero, in float64
    arithmetic (exact here): bf16 keeps 8 significant bits, down to steps of 2**-133."""
    magnitude = np.abs(master.astype(np.float64))
    _, exponent = np.frexp(magnitude)  # magnitude in [2**(exponent - 1), 2**exponent)
    step = np.ldexp(1.0, np.maximum(exponent, -125) - 8)
    return np.copysign(np.floor(magnitude / step + 0.5) * step, master.astype(np.float64))


def not_nan(bits: np.ndarray) -> np.ndarray:
    return (bits & U32(MAGNITUDE)) <= U32(INF_BITS)


# ------------------------------------------------------------ numpy codecs ----

def test_round_trip_on_a_large_sample_and_every_edge():
    bits = sample_bits(1 << 22, seed=0)
    w, lo = split_master(as_f32(bits))
    assert w.dtype == U16 and lo.dtype == I16
    assert np.array_equal(join_master(w, lo).view(U32), bits)
    # And the other way: every (w, lo) pair is some master.
    rng = np.random.default_rng(1)
    pairs_w = rng.integers(0, 2**16, 1 << 20, dtype=np.uint32).astype(U16)
    pairs_lo = rng.integers(-2**15, 2**15, 1 << 20, dtype=np.int32).astype(I16)
    w2, lo2 = split_master(join_master(pairs_w, pairs_lo))
    assert np.array_equal(w2, pairs_w) and np.array_equal(lo2, pairs_lo)


def test_live_weight_is_the_nearest_bf16_ties_away_and_finite_in_the_domain():
    bits = sample_bits(1 << 22, seed=2)
    master = as_f32(bits)
    w, lo = split_master(master)
    finite = np.isfinite(master)
    expected = nearest_bf16_ties_away(master[finite])  # 2**128 (Inf as bf16) past SPLIT_MASTER_MAX
    with np.errstate(over="ignore"):
        assert np.array_equal(bf16_value(w[finite]).view(U32), expected.astype(F32).view(U32))
    in_domain = np.abs(master) <= F32(SPLIT_MASTER_MAX)
    assert in_domain.sum() > 0.99 * finite.sum() and (finite & ~in_domain).any()  # the edges are there
    assert np.isfinite(bf16_value(w[in_domain])).all()
    assert np.isinf(bf16_value(w[finite & ~in_domain])).all()
    # The low half is the signed remainder in float32 ulps (NaNs aside: their rotation may wrap).
    keep = not_nan(bits)
    remainder = (bits[keep] & U32(MAGNITUDE)).astype(np.int64) - ((w[keep].astype(np.int64) & 0x7FFF) << 16)
    assert np.array_equal(lo[keep].astype(np.int64), remainder)
    assert np.isinf(bf16_value(w[np.isinf(master)])).all() and not lo[np.isinf(master)].any()


def test_live_weight_equals_torch_rounding_except_exact_ties():
    """Round to nearest even (torch's float32 -> bf16) and ties away differ only where the
    low 16 bits are exactly 0x8000 and the upper neighbour is odd."""
    bits = sample_bits(1 << 22, seed=3)
    keep = not_nan(bits)
    master = as_f32(bits[keep])
    w, _ = split_master(master)
    rne = torch.from_numpy(master.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(U16)
    tie = (bits[keep] & U32(0xFFFF)) == U32(0x8000)
    assert tie.sum() > 10  # the edge list holds ties of both parities
    assert np.array_equal(w[~tie], rne[~tie])
    odd_upper = (w & U16(1)) == U16(1)
    assert np.array_equal(w[tie & ~odd_upper], rne[tie & ~odd_upper])
    assert np.array_equal(w[tie & odd_upper], rne[tie & odd_upper] + U16(1))


def test_edge_cases_split_as_the_spec_says():
    def split_one(b):
        w, lo = split_master(as_f32(np.array([b], U32)))
        return int(w[0]), int(lo[0])

    assert split_one(0x00000000) == (0x0000, 0)
    assert split_one(0x80000000) == (0x8000, 0)  # -0.0 stays -0.0
    assert split_one(0x00000001) == (0x0000, 1)  # the smallest subnormal
    assert split_one(0x00008000) == (0x0001, -32768)  # a subnormal tie goes away from zero
    assert split_one(0x007FFFFF) == (0x0080, -1)  # the largest subnormal rounds to 2**-126
    assert split_one(0x3F808000) == (0x3F81, -32768)
    assert split_one(SPLIT_MASTER_MAX_BITS) == (0x7F7F, 32767)
    assert split_one(SPLIT_MASTER_MAX_BITS | SIGN) == (0xFF7F, 32767)
    assert split_one(SPLIT_MASTER_MAX_BITS + 1) == (0x7F80, -32768)  # outside the domain: w is Inf
    assert split_one(INF_BITS) == (0x7F80, 0)
    assert split_one(0xFF800000) == (0xFF80, 0)
    assert split_one(0x7FFF8000) == (0x0000, -32768)  # a NaN whose rotation wraps to +0
    assert split_one(0x7FFFFFFF) == (0x0000, -1)
    assert split_one(0xFFFFFFFF) == (0x8000, -1)
    assert SPLIT_MASTER_MAX == float(np.uint32(SPLIT_MASTER_MAX_BITS).view(F32))


def test_every_bf16_value_has_low_half_zero():
    w_bits = np.arange(1 << 16, dtype=U32).astype(U16)
    w, lo = split_master(bf16_value(w_bits))
    assert np.array_equal(w, w_bits) and not lo.any()
    assert np.array_equal(join_master(w_bits, np.zeros(1 << 16, I16)).view(U32), w_bits.astype(U32) << U32(16))


def test_codecs_read_int16_views_of_torch_bf16_bits():
    weights = torch.tensor([1.0, -2.5, 3.0e38, -1e-40], dtype=torch.bfloat16)
    joined = join_master(weights.view(torch.int16).numpy(), np.zeros(4, I16))
    assert torch.equal(torch.from_numpy(joined.copy()).view(torch.int32), weights.float().view(torch.int32))
    with pytest.raises(TypeError, match="w_bits"):
        join_master(np.zeros(4, F32), np.zeros(4, I16))


def test_authority_codecs_agree_with_numpy():
    bits = sample_bits(20_000, seed=4)
    w, lo = split_master(as_f32(bits))
    for i in range(bits.size):
        assert A.split_master(int(bits[i])) == (int(w[i]), int(lo[i])), hex(int(bits[i]))
        assert A.join_master(int(w[i]), int(lo[i])) == int(bits[i]), hex(int(bits[i]))


def test_state_format_names_the_low_half():
    for mode in MODES:
        fmt = StateFormat(mode)
        assert fmt.low_half_key == LOW_HALF_KEY == "lo" != fmt.state_key
        assert np.dtype(fmt.low_half_dtype) == I16 and fmt.low_half_bytes_per_param == np.dtype(I16).itemsize
        assert fmt.low_half_shape((3, 5)) == (3, 5)
    # FORMAT.md's table: bf16 weight (2) + low half (2) + word (4) = 8 bytes; fp32 mode 2 + 2 + 8.
    assert 2 + StateFormat("packed").split_state_bytes_per_param == 8
    assert 2 + StateFormat("fp32").split_state_bytes_per_param == 12


# ------------------------------------------------------------ Triton codecs ----

@triton.jit
def _split_kernel(master_ptr, w_ptr, lo_ptr, round_trip_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    master = tl.load(master_ptr + offsets, mask=mask).to(tl.float32, bitcast=True)
    w_bits, lo_bits = G.split_master(master)
    tl.store(w_ptr + offsets, w_bits.to(tl.int32, bitcast=True), mask=mask)
    tl.store(lo_ptr + offsets, lo_bits.to(tl.int32, bitcast=True), mask=mask)
    tl.store(round_trip_ptr + offsets, G.join_master(w_bits, lo_bits).to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def _join_kernel(w_ptr, lo_ptr, master_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    w_bits = tl.load(w_ptr + offsets, mask=mask).to(tl.uint32, bitcast=True)
    lo_bits = tl.load(lo_ptr + offsets, mask=mask).to(tl.uint32, bitcast=True)
    tl.store(master_ptr + offsets, G.join_master(w_bits, lo_bits).to(tl.int32, bitcast=True), mask=mask)


def kernel_split(bits: torch.Tensor, block: int):
    """int32 master bits on a device -> (w, lo, join(w, lo)), each int32 (16 bits used in w, lo)."""
    n = bits.numel()
    w, lo, round_trip = (torch.empty_like(bits) for _ in range(3))
    _split_kernel[launch.grid(n, block)](bits, w, lo, round_trip, n, BLOCK=block, **H._compile_options())
    return w, lo, round_trip


def test_kernel_codecs_equal_numpy(device):
    bits = sample_bits(1 << 20, seed=5)
    block = launch.block_size()
    w, lo, round_trip = kernel_split(torch.from_numpy(bits.view(np.int32)).to(device), block)
    w_np, lo_np = split_master(as_f32(bits))
    assert np.array_equal(w.cpu().numpy().view(U32), w_np.astype(U32))
    assert np.array_equal(lo.cpu().numpy().view(U32), lo_np.view(U16).astype(U32))
    assert np.array_equal(round_trip.cpu().numpy().view(U32), bits)

    # join on arbitrary pairs, the 16 bits in uint32 carriers as the kernel takes them
    rng = np.random.default_rng(6)
    pairs_w = rng.integers(0, 2**16, 1 << 20, dtype=np.uint32)
    pairs_lo = rng.integers(0, 2**16, 1 << 20, dtype=np.uint32)
    pairs_w[:4], pairs_lo[:4] = [0x7F7F, 0xFFFF, 0x0000, 0x7FFF], [0x7FFF, 0x8000, 0xFFFF, 0x8000]
    joined = torch.empty(pairs_w.size, dtype=torch.int32, device=device)
    to_device = lambda a: torch.from_numpy(a.view(np.int32)).to(device)  # noqa: E731
    _join_kernel[launch.grid(pairs_w.size, block)](to_device(pairs_w), to_device(pairs_lo), joined, pairs_w.size,
                                                   BLOCK=block, **H._compile_options())
    expected = join_master(pairs_w.astype(U16), pairs_lo.astype(U16).view(I16))
    assert np.array_equal(joined.cpu().numpy().view(U32), expected.view(U32))


def check_every_pattern_in(start: int, count: int, device, block: int):
    """All `count` patterns from int32 `start` on: join(split(x)) == x, w == the nearest bf16
    ties away (float64 arithmetic in torch, exact; 2**128 becomes Inf past the domain), w
    finite exactly in the domain, lo == the remainder (NaNs aside)."""
    bits = torch.arange(start, start + count, dtype=torch.int32, device=device)
    w, lo, round_trip = kernel_split(bits, block)
    where = f"in [{start & 0xFFFFFFFF:#010x}, +{count:#x})"
    assert torch.equal(round_trip, bits), f"round trip {where}"

    magnitude = bits.to(torch.int64) & MAGNITUDE
    sign = (bits.to(torch.int64) >> 31) & 1
    finite = magnitude < INF_BITS
    value = bits.view(torch.float32).to(torch.float64).abs()
    _, exponent = torch.frexp(value)  # value in [2**(exponent - 1), 2**exponent)
    step = ((torch.clamp(exponent.to(torch.int64), min=-125) - 8 + 1023) << 52).view(torch.float64)
    nearest = (torch.floor(value / step + 0.5) * step).to(torch.float32)
    expected_w = (sign << 15) | (nearest.view(torch.int32).to(torch.int64) >> 16)
    w = w.to(torch.int64)
    assert torch.equal(w[finite], expected_w[finite]), f"w {where}"
    w_finite = (w & 0x7F80) != 0x7F80
    assert torch.equal(w_finite[finite], (magnitude <= SPLIT_MASTER_MAX_BITS)[finite]), f"w finite {where}"
    not_nan_ = magnitude <= INF_BITS
    expected_lo = (magnitude - ((w & 0x7FFF) << 16)) & 0xFFFF
    assert torch.equal(lo.to(torch.int64)[not_nan_], expected_lo[not_nan_]), f"lo {where}"


# int32 starts of windows around the edges (both signs): zero and the subnormals, the last
# subnormals, 1.0, the top of the domain through Inf into the NaNs, the NaNs that wrap.
EDGE_WINDOWS = [0, 0x007E0000, 0x3F7E0000, 0x7F7E0000, 0x7FFC0000]
EDGE_WINDOWS += [start - 2**31 for start in EDGE_WINDOWS]


def test_kernel_window_check_on_every_pattern_near_the_edges(device):
    for start in EDGE_WINDOWS:
        check_every_pattern_in(start, 1 << 18, device, launch.block_size())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA or interpreting(), reason="needs a CUDA GPU (compiled kernel)")
def test_kernel_round_trip_over_all_2_32_patterns():
    """`check_every_pattern_in` over every float32 pattern, 2**27 a launch."""
    chunk = 1 << 27
    for start in range(-2**31, 2**31, chunk):
        check_every_pattern_in(start, chunk, "cuda", 1024)


# ------------------------------------------------------------ the split step ----

STEPS = [
    (1, Hyperparams(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)),
    (2, Hyperparams(lr=3e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)),
    (3, Hyperparams(lr=0.5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)),
    (10_000, Hyperparams(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)),
]
N_STEP = CHUNK + 4_099  # more than one chunk


def fresh_masters(rng, n):
    """Random masters, half of them bf16 values (a bf16 parameter starts there: lo = 0)."""
    master = H.random_params(rng, n)
    bf16 = rng.random(n) < 0.5
    master[bf16] = bf16_value(split_master(master[bf16])[0])
    return master


def scalars_of(count, hp):
    return step_scalar_row(count, hp.as_float32_list())


def format_counts():
    return np.zeros(len(FORMAT_COUNTS), np.int64)


@pytest.mark.parametrize("mode", MODES)
def test_split_step_follows_the_fp32_parameter_trajectory(mode):
    fmt = StateFormat(mode)
    rng = np.random.default_rng(10 + MODES.index(mode))
    p = fresh_masters(rng, N_STEP)
    state_fp32 = H.random_state(rng, N_STEP, fmt)
    w, lo = split_master(p)
    state_split = state_fp32.copy()
    assert (lo == 0).mean() > 0.45
    for step, (count, hp) in enumerate(STEPS):
        g = H.random_grads(rng, N_STEP, fmt)
        H.inject_nonfinite(rng, g)
        counts_fp32, counts_split = format_counts(), format_counts()
        rejected_fp32 = apply_step(p, g, state_fp32, scalars_of(count, hp), fmt=fmt, format_counts_out=counts_fp32)
        rejected_split = apply_split_step(w, lo, g, state_split, scalars_of(count, hp), fmt=fmt,
                                          format_counts_out=counts_split)
        assert np.abs(p).max() <= SPLIT_MASTER_MAX  # the condition of the equality
        assert np.array_equal(join_master(w, lo).view(U32), p.view(U32)), f"master, step {step}"
        w_expected, lo_expected = split_master(p)
        assert np.array_equal(w, w_expected) and np.array_equal(lo, lo_expected), f"w, lo, step {step}"
        assert np.array_equal(state_split.view(U32), state_fp32.view(U32)), f"state, step {step}"
        assert rejected_split == rejected_fp32 > 0
        assert np.array_equal(counts_split, counts_fp32)
        if mode != "fp32":
            assert counts_fp32.any()  # the counts are exercised


@pytest.mark.parametrize("mode", MODES)
def test_bf16_gradients_are_upcast_exactly(mode):
    fmt = StateFormat(mode)
    rng = np.random.default_rng(20 + MODES.index(mode))
    p = fresh_masters(rng, N_STEP)
    w, lo = split_master(p)
    state = H.random_state(rng, N_STEP, fmt)
    runs = {kind: (w.copy(), lo.copy(), state.copy()) for kind in ("float32", "uint16", "int16")}
    for count, hp in STEPS[:3]:
        g_bits = (H.random_grads(rng, N_STEP, fmt).view(U32) >> U32(16)).astype(U16)
        g_bits[rng.random(N_STEP) < 0.01] = rng.choice(np.array([0x7F80, 0xFF80, 0x7FC0, 0xFFC1], U16))
        grads = {"float32": bf16_value(g_bits), "uint16": g_bits, "int16": g_bits.view(I16)}
        rejected = {kind: apply_split_step(*runs[kind][:2], grads[kind], runs[kind][2], scalars_of(count, hp), fmt=fmt)
                    for kind in runs}
        assert rejected["uint16"] == rejected["int16"] == rejected["float32"] > 0
        for kind in ("uint16", "int16"):
            for got, want in zip(runs[kind], runs["float32"]):
                assert np.array_equal(got.view(U32 if got.dtype.itemsize == 4 else U16),
                                      want.view(U32 if want.dtype.itemsize == 4 else U16)), kind


def _domain_elements():
    """(master bits, gradient) pairs around the top of the domain. With lr = 2**104 (one float32
    ulp there) and eps tiny, a step moves these masters by one ulp against the gradient's sign."""
    top = SPLIT_MASTER_MAX_BITS
    return [
        (top, -100.0),  # -> 0x7F7F8000: past the domain (and m' saturates: not counted)
        (top | SIGN, 1e-15),  # -> -0x7F7F8000: past the domain (and m' flushes: not counted)
        (top - 1, -1.0),  # -> SPLIT_MASTER_MAX: accepted, w = 0x7F7F, lo = 32767
        (top, 1.0),  # -> one ulp down: accepted
        (INF_BITS, 1.0),  # (bf16 Inf, 0): a non-finite master, rejected
        (0x7FC00000, 1.0),  # a NaN master, rejected
        (0x3F800000, 0.5),  # 1.0: accepted, lands near -2**104
        (0x3F800000, float("nan")),  # non-finite gradient, rejected
        (0x3F800000, 30.0),  # saturates m' (counted)
        (0x3F800000, 1e-15),  # flushes m' and the RMS (counted)
    ]


PAST_THE_DOMAIN = [0, 1]


@pytest.mark.parametrize("mode", MODES)
def test_a_step_past_the_domain_is_rejected_and_counted(mode):
    fmt = StateFormat(mode)
    masters_bits, grads = zip(*_domain_elements())
    master = as_f32(np.array(masters_bits, U32))
    g = np.array(grads, F32)
    n = g.size
    scalars = step_scalar_row(1, (2.0**104, 0.9, 0.999, 1e-30, 0.0))
    zero_state = np.zeros(fmt.flat_state_shape(n), np.dtype(fmt.state_dtype))

    # The FP32-parameter run accepts the two steps past the domain ...
    p = master.copy()
    state_fp32, counts_fp32 = zero_state.copy(), format_counts()
    rejected_fp32 = apply_step(p, g, state_fp32, scalars, fmt=fmt, format_counts_out=counts_fp32)
    assert rejected_fp32 == 3
    assert [int(b) for b in p[PAST_THE_DOMAIN].view(U32)] == [SPLIT_MASTER_MAX_BITS + 1,
                                                              (SPLIT_MASTER_MAX_BITS + 1) | SIGN]
    assert int(p[2:3].view(U32)[0]) == SPLIT_MASTER_MAX_BITS

    # ... the split run rejects them like non-finite results: old weight, low half and state kept.
    w, lo = split_master(master)
    w_before, lo_before = w.copy(), lo.copy()
    state_split, counts_split = zero_state.copy(), format_counts()
    rejected_split = apply_split_step(w, lo, g, state_split, scalars, fmt=fmt, format_counts_out=counts_split)
    assert rejected_split == rejected_fp32 + len(PAST_THE_DOMAIN)
    for i in PAST_THE_DOMAIN + [4, 5, 7]:
        assert (w[i], lo[i]) == (w_before[i], lo_before[i]), i
        assert np.array_equal(H.state_at(state_split, i, fmt), H.state_at(zero_state, i, fmt)), i
    assert (int(w[2]), int(lo[2])) == (0x7F7F, 32767)
    assert np.isfinite(bf16_value(w[np.isfinite(master)])).all()

    # Exactly a non-finite rejection: an FP32 run with NaN gradients there gives the same bits and counts.
    g_nan = g.copy()
    g_nan[PAST_THE_DOMAIN] = np.nan
    p_nan = master.copy()
    state_nan, counts_nan = zero_state.copy(), format_counts()
    assert apply_step(p_nan, g_nan, state_nan, scalars, fmt=fmt, format_counts_out=counts_nan) == rejected_split
    assert np.array_equal(join_master(w, lo).view(U32), p_nan.view(U32))
    assert np.array_equal(state_split.view(U32), state_nan.view(U32))
    assert np.array_equal(counts_split, counts_nan)
    if mode != "fp32":
        assert not np.array_equal(counts_fp32, counts_nan)  # the rejected elements would have counted


def test_split_step_writes_through_torch_views():
    """The torch CPU path's call: numpy views of bf16 weight, int16 low half and bf16 gradient."""
    fmt = StateFormat("packed")
    rng = np.random.default_rng(30)
    p = fresh_masters(rng, 1000)
    w, lo = split_master(p)
    weight = torch.from_numpy(w.view(I16).copy()).view(torch.bfloat16)
    low_half = torch.from_numpy(lo.copy())
    grad = torch.from_numpy(rng.standard_normal(1000).astype(F32)).to(torch.bfloat16)
    state = np.zeros(1000, U32)
    scalars = scalars_of(*STEPS[0])
    rejected = apply_split_step(weight.view(torch.int16).numpy(), low_half.numpy(),
                                grad.view(torch.int16).numpy(), state, scalars, fmt=fmt)
    state_fp32 = np.zeros(1000, U32)
    assert rejected == apply_step(p, grad.float().numpy(), state_fp32, scalars, fmt=fmt) == 0
    assert torch.equal(weight.view(torch.int16), torch.from_numpy(split_master(p)[0].view(I16)))
    assert np.array_equal(join_master(weight.view(torch.int16).numpy(), low_half.numpy()).view(U32), p.view(U32))
    assert np.array_equal(state, state_fp32)


def test_split_step_refuses_bad_arrays():
    fmt = StateFormat("packed")
    scalars = scalars_of(*STEPS[0])
    w, lo, g, state = np.zeros(4, U16), np.zeros(4, I16), np.zeros(4, F32), np.zeros(4, U32)
    with pytest.raises(TypeError, match="weight_bits"):
        apply_split_step(np.zeros(4, F32), lo, g, state, scalars, fmt=fmt)
    with pytest.raises(TypeError, match="low_half"):
        apply_split_step(w, np.zeros(4, np.int32), g, state, scalars, fmt=fmt)
    with pytest.raises(TypeError, match="grad"):
        apply_split_step(w, lo, np.zeros(4, np.float64), state, scalars, fmt=fmt)
    with pytest.raises(ValueError, match="low_half has 3 elements"):
        apply_split_step(w, lo[:3], g, state, scalars, fmt=fmt)
    with pytest.raises(ValueError, match="state has 3 elements"):
        apply_split_step(w, lo, g, state[:3], scalars, fmt=fmt)


@pytest.mark.parametrize("mode", MODES)
def test_authority_split_step_agrees_with_numpy(mode):
    fmt = StateFormat(mode)
    rng = np.random.default_rng(40 + MODES.index(mode))
    n = 400
    master = fresh_masters(rng, n)
    g = H.random_grads(rng, n, fmt)
    H.inject_nonfinite(rng, g)
    domain = _domain_elements()
    master[: len(domain)] = as_f32(np.array([b for b, _ in domain], U32))
    g[: len(domain)] = [x for _, x in domain]
    state = H.random_state(rng, n, fmt)
    state[..., : len(domain)] = 0
    hp = dict(lr=2.0**104, b1=0.9, b2=0.999, eps=1e-30, weight_decay=0.0)
    w, lo = split_master(master)
    w_np, lo_np, state_np = w.copy(), lo.copy(), state.copy()
    rejected = apply_split_step(w_np, lo_np, g, state_np, step_scalar_row(1, list(hp.values())), fmt=fmt)
    rejected_authority = 0
    for i in range(n):
        element_state = (float(state[0, i]), float(state[1, i])) if mode == "fp32" else int(state[i])
        w_a, lo_a, state_a, accepted = A.adamw_split_element(int(w[i]), int(lo[i]), float(g[i]), element_state,
                                                             count=1, mode=mode, **hp)
        rejected_authority += not accepted
        assert (w_a, lo_a) == (int(w_np[i]), int(lo_np[i])), i
        if mode == "fp32":
            assert [A.f32_bits(x) for x in state_a] == [int(b) for b in state_np[:, i].view(U32)], i
        else:
            assert state_a == int(state_np[i]), i
    assert rejected_authority == rejected > len(PAST_THE_DOMAIN)


# ---- a zero written to the weight outside the optimizer (FORMAT.md, "Writes to the weight") ----
@pytest.mark.parametrize("mode", MODES)
def test_a_zero_written_to_the_weight_reads_as_zero_in_numpy_authority_and_kernel(mode, device):
    """p.mul_(0), p.zero_() or a re-initialisation leave a zero weight beside a low half that
    may be negative; joined, such a pair is a NaN. The step reads it as the signed zero, so
    the element keeps learning (it would otherwise be rejected forever, its weight frozen)."""
    fmt = StateFormat(mode)
    rng = np.random.default_rng(77)
    n = 3_000
    w, lo = split_master(H.random_params(rng, n))
    assert (lo < 0).mean() > 0.4
    w[: n // 2] &= np.uint16(0x8000)  # the written zeros keep their sign, as p.mul_(0) does
    g = H.random_grads(rng, n, fmt)
    state = H.random_state(rng, n, fmt)
    hp = Hyperparams(lr=1e-3, weight_decay=0.1)
    scalars = scalars_of(1, hp)
    assert np.isnan(join_master(w[: n // 2], lo[: n // 2])[lo[: n // 2] < 0]).all()  # what a plain join reads

    # numpy: equals an FP32 step from the masters the pairs hold, zeros where the weight was zeroed
    from packed_adamw.core.codecs import read_master
    master = read_master(w, lo)
    assert not np.isnan(master).any()
    negative = lo[: n // 2] < 0  # a non-negative low half beside a zero weight is a tiny master: joined as it is
    assert np.array_equal(master[: n // 2][negative].view(U32), w[: n // 2][negative].astype(U32) << 16)
    assert np.array_equal(master[: n // 2][~negative].view(U32), join_master(w, lo)[: n // 2][~negative].view(U32))
    p_ref, state_ref = master.copy(), state.copy()
    rejected_ref = apply_step(p_ref, g, state_ref, scalars, fmt=fmt)
    w_np, lo_np, state_np = w.copy(), lo.copy(), state.copy()
    assert apply_split_step(w_np, lo_np, g, state_np, scalars, fmt=fmt) == rejected_ref < n // 20
    assert np.array_equal(join_master(w_np, lo_np).view(U32), p_ref.view(U32))
    assert np.array_equal(state_np.view(U32), state_ref.view(U32))
    assert (w_np[: n // 2] & 0x7FFF).any()  # the zeroed weights moved

    # authority, element by element
    for i in list(range(0, 40)) + list(range(n // 2, n // 2 + 10)):
        element_state = (float(state[0, i]), float(state[1, i])) if mode == "fp32" else int(state[i])
        w_a, lo_a, _, _ = A.adamw_split_element(int(w[i]), int(lo[i]), float(g[i]), element_state,
                                                       count=1, mode=mode, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                                       weight_decay=0.1)
        assert (w_a, lo_a) == (int(w_np[i]), int(lo_np[i])), i

    # the kernel (compiled on CUDA, interpreted on CPU)
    to_device = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    weight = to_device(w.view(np.int16)).view(torch.bfloat16)
    low = to_device(lo)
    grad, words = to_device(g), to_device(state if mode == "fp32" else state.view(np.int32))
    counters = H.new_counters(1, device)
    constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=True,
                                               block=launch.block_size(), split=True)
    K.adamw_split_kernel[launch.single_tensor_grid(n, constants)](
        weight, low, grad, words, H.kernel_step_scalars(hp, 1, device), counters, n, weight, low, words,
        **constants, **H._compile_options())
    assert np.array_equal(weight.view(torch.int16).cpu().numpy().view(U16), w_np)
    assert np.array_equal(low.cpu().numpy(), lo_np)
    assert int(counters.reshape(-1)[0]) == rejected_ref
