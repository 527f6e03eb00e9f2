"""The Triton kernel (interpreted on CPU, compiled on CUDA) against core.adamw.numpy_step and the
scalar authority, bit for bit, in every mode (docs/FORMAT.md, "The step").

Every comparison is on float32/uint32 bits, never allclose. Kernel == numpy is checked on every
element; the authority (pure Python, ~22 us per element) on every element of the main
multi-step test and on strided subsets elsewhere.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernel_harness as H
from packed_adamw.core import Hyperparams, StateFormat, step_scalars
from packed_adamw.core import launch
from packed_adamw.core.codecs import CODE_MASK
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT

F32 = np.float32
U32 = np.uint32
MODES = ["packed", "fp16", "fp32"]
# Huge and non-finite inputs are deliberate; numpy and the interpreter warn on their overflow.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
BLOCK = launch.block_size()


def rms_and_m_codes(state):
    return (state & U32(CODE_MASK)), (state >> U32(MOMENT_SHIFT))


def assert_no_zero_rms_beside_nonzero_m(state, fmt, what, written):
    """Among the words a step wrote (`written`: a rejected element keeps its old word, and the
    random input state holds such words on purpose), none has RMS 0 beside a nonzero m."""
    if fmt.mode == "fp32":
        return
    rms, m = rms_and_m_codes(state)
    bad = np.flatnonzero((rms == 0) & (m != 0) & written)
    assert bad.size == 0, f"{what}: {bad.size} words with RMS code 0 and m code != 0, e.g. {state[bad[:3]]}"


def check_step(p, g, state, *, count, hp, fmt, device, write_update=False, authority_index=None, what=""):
    """One step three ways; asserts equal bits and returns the kernel's result."""
    k = H.run_kernel(p, g, state, count=count, hp=hp, fmt=fmt, write_update=write_update, device=device)
    out, new_state, rejected = H.numpy_reference(p, g, state, count=count, hp=hp, fmt=fmt, write_update=write_update)
    tag = f"{fmt.identity} count={count} write_update={write_update} {what}"
    ctx = lambda i: dict(p=p[i], g=g[i], state=H.state_at(state, i, fmt))  # noqa: E731
    H.assert_same_bits(k.out, out, f"kernel vs numpy, {'update' if write_update else 'param'} [{tag}]", ctx)
    H.assert_same_bits(k.state, new_state, f"kernel vs numpy, state [{tag}]", ctx)
    assert k.nonfinite == rejected, f"nonfinite count [{tag}]"

    index = H.checkable_by_authority(g, fmt, authority_index)
    a = H.authority_reference(p, g, state, count=count, hp=hp, fmt=fmt, index=index)
    H.assert_same_bits(k.out[index], a.update if write_update else a.p, f"kernel vs authority, out [{tag}]",
                       lambda i: ctx(index[i]))
    H.assert_same_bits(H.state_at(k.state, index, fmt), a.state, f"kernel vs authority, state [{tag}]",
                       lambda i: ctx(index[i]))
    if authority_index is None and index.size == len(g):
        assert k.nonfinite == int((~a.accepted).sum())
    return k


def fresh_inputs(seed, n, fmt):
    rng = np.random.default_rng(seed)
    return rng, H.random_params(rng, n), H.random_state(rng, n, fmt)


# Learning rate and weight decay change between steps: they travel in the hparam row.
STEPS = [
    (1, Hyperparams(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)),
    (2, Hyperparams(lr=3e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)),
    (3, Hyperparams(lr=0.5, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)),
    (10_000, Hyperparams(lr=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05)),
    (2**31 - 1, Hyperparams(lr=2e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)),
]


# ------------------------------------------------------------- the main test ----

@pytest.mark.parametrize("mode", MODES)
def test_consecutive_steps_match_numpy_and_authority_everywhere(mode, device):
    """40,009 elements (more than one interpreter block, launch.INTERPRETER_BLOCK = 32,768)
    spanning the whole format range, five steps fed back, the authority on every element of
    every step."""
    fmt = StateFormat(mode)
    n = 40_009
    rng, p, state = fresh_inputs(7, n, fmt)
    for step, (count, hp) in enumerate(STEPS):
        g = H.random_grads(rng, n, fmt)
        H.inject_nonfinite(rng, g)
        k = check_step(p, g, state, count=count, hp=hp, fmt=fmt, device=device, what=f"step {step}")
        assert_no_zero_rms_beside_nonzero_m(k.state, fmt, f"step {step}", written=np.isfinite(g))
        p, state = k.out, k.state


@pytest.mark.parametrize("m_bias,rms_bias", [(18, 18), (12, 21), (21, 12)])
def test_non_default_biases(m_bias, rms_bias, device):
    fmt = StateFormat("packed", m_bias=m_bias, rms_bias=rms_bias)
    n = 30_011
    rng, p, state = fresh_inputs(m_bias * 100 + rms_bias, n, fmt)
    for step, (count, hp) in enumerate(STEPS[:3] + STEPS[3:4]):
        g = H.random_grads(rng, n, fmt)
        H.inject_nonfinite(rng, g)
        k = check_step(p, g, state, count=count, hp=hp, fmt=fmt, device=device, what=f"step {step}")
        assert_no_zero_rms_beside_nonzero_m(k.state, fmt, f"step {step}", written=np.isfinite(g))
        p, state = k.out, k.state


# ------------------------------------------------------- sizes and write modes ----

SIZES = sorted({1, 7, BLOCK - 1, BLOCK, BLOCK + 1})


@pytest.mark.parametrize("write_update", [False, True], ids=["in_place", "write_update"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_sizes_around_the_block(mode, n, write_update, device):
    fmt = StateFormat(mode)
    rng, p, state = fresh_inputs(n, n, fmt)
    g = H.random_grads(rng, n, fmt)
    # The edges of the tensor and of the blocks, plus a spread in between.
    edges = [i for i in (0, 1, n - 2, n - 1, BLOCK - 1, BLOCK) if 0 <= i < n]
    index = np.unique(np.r_[np.arange(0, n, max(1, n // 1500)), edges])
    check_step(p, g, state, count=4, hp=STEPS[2][1], fmt=fmt, device=device, write_update=write_update,
               authority_index=index)


@pytest.mark.parametrize("mode", MODES)
def test_write_update_lands_on_the_in_place_bits_and_reads_only(mode, device):
    """optax path: p + u must equal the torch in-place result bit for bit, the new state must
    equal the in-place state, and the input buffers must be left alone."""
    fmt = StateFormat(mode)
    n = BLOCK + 12_345
    rng, p, state = fresh_inputs(11, n, fmt)
    g = H.random_grads(rng, n, fmt)
    nonfinite_at = H.inject_nonfinite(rng, g)
    hp = STEPS[1][1]
    in_place = H.run_kernel(p, g, state, count=5, hp=hp, fmt=fmt, device=device)
    functional = check_step(p, g, state, count=5, hp=hp, fmt=fmt, device=device, write_update=True,
                            authority_index=np.arange(0, n, 7))
    H.assert_same_bits(p + functional.out, in_place.out, "p + u vs in-place p")
    H.assert_same_bits(functional.state, in_place.state, "functional vs in-place state")
    H.assert_same_bits(functional.param_buffer, p, "param buffer after a write_update launch")
    H.assert_same_bits(functional.state_buffer, state, "state buffer after a write_update launch")
    assert functional.nonfinite == in_place.nonfinite >= len(nonfinite_at)
    assert np.all(H.bits(functional.out[nonfinite_at]) == H.NEG_ZERO_BITS)


# ------------------------------------------------------------- non-finite input ----

@pytest.mark.parametrize("write_update", [False, True], ids=["in_place", "write_update"])
@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_gradients_leave_param_and_word_alone(mode, write_update, device):
    fmt = StateFormat(mode)
    n = 3_000
    rng, p, state = fresh_inputs(3, n, fmt)
    p = (rng.standard_normal(n)).astype(F32)
    p[:6] = [0.0, -0.0, 1.0, -1.0, 3e38, -1e-45]
    g = (rng.standard_normal(n) * 1e-3).astype(F32)
    bad = np.r_[np.arange(6), rng.choice(np.arange(6, n), 300, replace=False)]
    g[bad] = np.array([np.nan, np.inf, -np.inf], F32)[np.arange(bad.size) % 3]
    hp = Hyperparams(lr=1e-2, weight_decay=0.1)
    k = check_step(p, g, state, count=2, hp=hp, fmt=fmt, device=device, write_update=write_update,
                   authority_index=np.r_[bad[:50], np.arange(6, n, 10)])
    assert k.nonfinite == bad.size  # the finite elements are tame, so only these are rejected
    H.assert_same_bits(H.state_at(k.state, bad, fmt), H.state_at(state, bad, fmt), "rejected words")
    if write_update:
        assert np.all(H.bits(k.out[bad]) == H.NEG_ZERO_BITS)
        H.assert_same_bits(p[bad] + k.out[bad], p[bad], "p + (-0.0) == p")
    else:
        H.assert_same_bits(k.out[bad], p[bad], "rejected params")
    accepted = np.setdiff1d(np.arange(n), bad)
    assert not np.array_equal(H.bits(k.out[accepted]), H.bits(p[accepted]))  # the others did move


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_results_are_rejected(mode, device):
    """Finite gradient, overflowing result: p' = p + u past FLT_MAX (all modes); in fp32 mode
    also v' overflowing from a huge gradient (the packed modes saturate the RMS instead)."""
    fmt = StateFormat(mode)
    hp = Hyperparams(lr=3e37, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)  # step size 3e38 at count 1
    p = np.array([3.3e38, -3.3e38, 1.0, 3.3e38], F32)
    g = np.array([-1.0, 1.0, 1.0, 1.0], F32)  # u ~ +lr, -lr, -lr, -lr
    state = H.random_state(np.random.default_rng(0), 4, fmt) * 0  # zero state
    k = check_step(p, g, state, count=1, hp=hp, fmt=fmt, device=device)
    assert k.nonfinite == 2
    H.assert_same_bits(k.out[:2], p[:2], "overflowing params kept")
    assert np.all(np.isfinite(k.out))

    huge_g = np.array([1e20, -1e20, 1.0], F32)  # g*g overflows float32
    p = np.ones(3, F32)
    state = H.random_state(np.random.default_rng(0), 3, fmt) * 0
    k = check_step(p, huge_g, state, count=1, hp=Hyperparams(lr=1e-3), fmt=fmt, device=device)
    if mode == "fp32":
        assert k.nonfinite == 2
        H.assert_same_bits(k.state[:, :2], state[:, :2], "fp32 state kept when v' overflows")
    else:
        assert k.nonfinite == 0
        rms, _ = rms_and_m_codes(k.state[:2])
        assert np.all(rms == fmt.formats[1].max_magnitude_code)  # Inf RMS saturates


@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_authority_saturates_an_infinite_rms(mode):
    fmt = StateFormat(mode)
    p, g, state = np.ones(1, F32), np.array([1e20], F32), np.zeros(1, U32)
    _, expected_state, _ = H.numpy_reference(p, g, state, count=1, hp=Hyperparams(), fmt=fmt)
    a = H.authority_reference(p, g, state, count=1, hp=Hyperparams(), fmt=fmt)
    H.assert_same_bits(a.state, expected_state, "authority state")


# ------------------------------------------------------------- the zero-RMS rule ----

ZERO_RMS_FORMATS = [StateFormat("packed"), StateFormat("packed", 18, 18), StateFormat("packed", 15, 12),
                    StateFormat("fp16")]


@pytest.mark.parametrize("write_update", [False, True], ids=["in_place", "write_update"])
@pytest.mark.parametrize("fmt", ZERO_RMS_FORMATS, ids=lambda f: f.identity)
def test_zero_rms_rule_clears_the_first_moment(fmt, write_update, device):
    m_fmt, r_fmt = fmt.formats
    # Case 1: a word with a large m beside RMS code 0 meets a zero gradient: r' = 0, m' = b1*m.
    m_codes = m_fmt.encode(np.array([1.0, -0.5, 1e-3], F32)).astype(U32)
    words_1 = m_codes << U32(16)
    g_1 = np.zeros(3, F32)
    # Case 2: from zero state with b1 = 0, m' = g survives while r' = sqrt(1-b2)|g| rounds to 0.
    g_2 = np.array([2, -2, 3], F32) * F32(m_fmt.min_subnormal)
    words_2 = np.zeros(3, U32)
    p = np.linspace(-1, 1, 6).astype(F32)
    g, words = np.r_[g_1, g_2], np.r_[words_1, words_2]
    hp_by_case = [Hyperparams(lr=1e-3, b1=0.9, b2=0.999), Hyperparams(lr=1e-3, b1=0.0, b2=0.999)]
    for case, (sl, hp) in enumerate(zip([slice(0, 3), slice(3, 6)], hp_by_case)):
        # Precondition: without the rule these words would hold RMS 0 beside a nonzero m.
        s = step_scalars(1, hp)
        m, r = m_fmt.decode(words[sl] >> U32(16)), r_fmt.decode(words[sl] & U32(CODE_MASK))
        m_next = s["b1"] * m + s["one_minus_b1"] * g[sl]
        r_next = np.sqrt(s["b2"] * (r * r) + s["one_minus_b2"] * (g[sl] * g[sl]))
        assert np.all(r_fmt.encode(r_next) == 0) and np.all(m_fmt.encode(m_next) != 0), f"case {case}"
        k = check_step(p[sl], g[sl], words[sl], count=1, hp=hp, fmt=fmt, device=device, write_update=write_update)
        assert np.all(k.state == 0), f"case {case}: stored words {k.state}"
        assert k.nonfinite == 0


@pytest.mark.parametrize("fmt", ZERO_RMS_FORMATS, ids=lambda f: f.identity)
def test_no_stored_word_has_zero_rms_beside_nonzero_m(fmt, device):
    """Many steps of tiny, often zero gradients near the RMS format's underflow: the hazard is
    provoked often (precondition counted) and never stored."""
    m_fmt, r_fmt = fmt.formats
    n, steps = 20_000, 12
    rng = np.random.default_rng(5)
    p = H.random_params(rng, n)
    state = np.zeros(n, U32)
    hp = Hyperparams(lr=1e-3, b1=0.9, b2=0.999)
    scale = np.log2(r_fmt.min_subnormal)
    provoked = 0
    for step in range(steps):
        g = H._log_uniform(rng, n, scale - 2, scale + 8)
        g[rng.random(n) < 0.3] = 0.0
        count = step + 1
        s = step_scalars(count, hp)
        m, r = m_fmt.decode(state >> U32(16)), r_fmt.decode(state & U32(CODE_MASK))
        r_next = np.sqrt(s["b2"] * (r * r) + s["one_minus_b2"] * (g * g))
        m_next = s["b1"] * m + s["one_minus_b1"] * g
        provoked += int(np.sum((r_fmt.encode(r_next) == 0) & (m_fmt.encode(m_next) != 0)))
        k = check_step(p, g, state, count=count, hp=hp, fmt=fmt, device=device,
                       authority_index=np.arange(step, n, 97), what=f"step {step}")
        assert_no_zero_rms_beside_nonzero_m(k.state, fmt, f"step {step}", written=np.isfinite(g))
        p, state = k.out, k.state
    assert provoked > 100, "the test did not provoke the hazard; tune the gradient scale"


# ------------------------------------------------------------- step scalars ----

COUNTS = sorted(set(range(1, 101)) | {2**k for k in range(31)} | {1023, 1025, 3071, 5000} | {2**31 - 1, 2**31 - 2, 12_345_678})
BETAS = [(0.9, 0.999), (0.9, 0.95), (0.0, 0.0), (0.5, 0.99999), (0.999999, 0.9999999), (0.95, 0.98)]


@pytest.mark.parametrize("b1,b2", BETAS)
def test_numpy_step_scalars_match_the_authority(b1, b2):
    hp = Hyperparams(lr=3e-4, b1=b1, b2=b2, eps=1e-8, weight_decay=0.1)
    for count in COUNTS:
        got, expected = step_scalars(count, hp), H.authority_scalars(count, hp)
        assert got.keys() == expected.keys()
        for name in expected:
            assert got[name].dtype == F32, name
            assert H.bits(got[name]) == H.bits(expected[name]), f"{name} at count={count}: {got[name]!r} vs {expected[name]!r}"


@pytest.mark.parametrize("b1,b2", BETAS)
def test_device_step_scalars_match_numpy(b1, b2, device):
    """step_scalars_kernel (the one place the device derives them) against numpy_step."""
    hp = Hyperparams(lr=3e-4, b1=b1, b2=b2, eps=1e-8, weight_decay=0.1)
    for count in [1, 2, 3, 7, 64, 100, 1000, 10_000, 1 << 20, 12_345_678, 2**31 - 2, 2**31 - 1]:
        got = H.kernel_step_scalars(hp, count, device).cpu().numpy()
        expected = np.array(list(step_scalars(count, hp).values()), F32)
        H.assert_same_bits(got, expected, f"device step scalars, count={count}")


def test_capturable_step_scalars_read_and_check_each_groups_lr_and_advance_the_counts(device):
    """capturable_step_scalars_kernel (torch capturable=True): each row's lr read through its
    group's address, an lr the host would refuse turned into NaN with the count left, the
    other rows' counts advanced and their scalars those of numpy_step at the new count;
    maximizing rows get 1 - b1 negated."""
    from packed_adamw.core.adamw.kernel import capturable_step_scalars_kernel

    lrs = [3e-4, float("nan"), -1e-3, float("inf"), 1e38, 0.0, 1e-2]
    decays = [0.1, 0.1, 0.1, 0.1, 10.0, 0.0, 0.0]  # 1e38 * 10 overflows float32
    betas = [(0.9, 0.999), (0.9, 0.95), (0.5, 0.99), (0.9, 0.999), (0.9, 0.999), (0.0, 0.0), (0.95, 0.98)]
    lr_tensors = [torch.tensor(lr, dtype=torch.float32, device=device) for lr in lrs]
    hps = [Hyperparams(lr=1.0, b1=b1, b2=b2, eps=1e-8, weight_decay=wd) for (b1, b2), wd in zip(betas, decays)]
    hparams = torch.tensor([hp.as_float32_list() for hp in hps], dtype=torch.float32, device=device)
    hparams[:, 0] = float("nan")  # the lr column is not read
    group_of = [6, 0, 1, 2, 3, 4, 5, 0, 6]
    counts_before = [0, 1, 5, 7, 2**31 - 2, 3, 0, 99, 12_345]
    signs = [1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0]
    n = len(group_of)
    counts = torch.tensor(counts_before, dtype=torch.int32, device=device)
    scalars = torch.empty((n, H.SCALAR_ROW), dtype=torch.float32, device=device)
    capturable_step_scalars_kernel[launch.grid(n, launch.SCALAR_BLOCK_ROWS)](
        torch.tensor([t.data_ptr() for t in lr_tensors], dtype=torch.int64, device=device), hparams,
        torch.tensor(group_of, dtype=torch.int64, device=device), torch.tensor(signs, device=device), counts, n,
        scalars, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **H._compile_options(num_warps=False))
    accepted = [0 <= lrs[g] <= 3.4e38 and F32(lrs[g]) * F32(decays[g]) <= 3.4e38 for g in group_of]
    assert accepted == [True, True, False, False, False, False, True, True, True]
    expected_counts = [c + a for c, a in zip(counts_before, accepted)]
    assert counts.cpu().tolist() == expected_counts
    names = list(step_scalars(1, Hyperparams()).keys())
    for i, g in enumerate(group_of):
        hp = Hyperparams(lr=lrs[g] if accepted[i] else 0.0, b1=betas[g][0], b2=betas[g][1], eps=1e-8,
                         weight_decay=decays[g] if accepted[i] else 0.0)
        expected = step_scalars(expected_counts[i], hp)
        expected["one_minus_b1"] = F32(expected["one_minus_b1"] * F32(signs[i]))
        got = dict(zip(names, scalars[i].cpu().numpy()))
        if not accepted[i]:  # the refused lr is NaN, and so is every scalar made from it
            assert np.isnan(got.pop("step_size")) and np.isnan(got.pop("lr_wd")), f"row {i}"
            expected = {k: v for k, v in expected.items() if k in got}
        H.assert_same_bits(np.array(list(got.values()), F32), np.array(list(expected.values()), F32),
                           f"row {i} (group {g})")


@pytest.mark.parametrize("b1,b2", BETAS[:4])
def test_kernel_derives_the_step_scalars_for_many_counts(b1, b2, device):
    """End to end from the int32 count: a small tensor per count makes any difference in the
    derived scalars visible in the parameters."""
    fmt = StateFormat("fp32")
    n = 64
    rng = np.random.default_rng(2)
    p = rng.standard_normal(n).astype(F32)
    g = rng.standard_normal(n).astype(F32)
    state = H.random_state(rng, n, fmt)
    hp = Hyperparams(lr=1e-2, b1=b1, b2=b2, weight_decay=0.1)
    for count in [1, 2, 3, 5, 8, 13, 31, 100, 1 << 20, 12_345_678, 2**31 - 1]:
        check_step(p, g, state, count=count, hp=hp, fmt=fmt, device=device, what=f"b1={b1} b2={b2}")


# --------------------------------------------------------------- the harness ----

def test_uint32_state_view_gives_the_same_bits(device, is_interpreting):
    """The harness passes words as an int32 view; a uint32 view must be equivalent (interpreter)."""
    if not is_interpreting:
        pytest.skip("torch.uint32 CUDA support is partial; the int32 view is what launchers use")
    fmt = StateFormat("packed")
    rng, p, state = fresh_inputs(9, 5_000, fmt)
    g = H.random_grads(rng, 5_000, fmt)
    tp, tg = torch.from_numpy(p.copy()), torch.from_numpy(g)
    ts = torch.from_numpy(state.copy()).view(torch.uint32)
    H.launch_kernel(tp, tg, ts, count=2, hp=Hyperparams(), fmt=fmt)
    expected = H.run_kernel(p, g, state, count=2, hp=Hyperparams(), fmt=fmt, device=device)
    H.assert_same_bits(tp.numpy(), expected.out, "params")
    H.assert_same_bits(ts.view(torch.int32).numpy().view(U32), expected.state, "words")


def test_fp16_reserved_codes_decode_finitely_in_every_backend(device):
    """Encoding never writes FP16's Inf/NaN codes, but a foreign word may hold them: kernel,
    numpy and authority all read them with the finite formula (FORMAT.md)."""
    fmt = StateFormat("fp16")
    rng = np.random.default_rng(21)
    n = 4_000
    reserved = (0x7C00 | rng.integers(0, 1 << 10, n)) | (rng.integers(0, 2, n) << 15)  # sign, exponent 31
    rms = 0x7C00 | rng.integers(0, 1 << 10, n)
    state = ((reserved.astype(U32) << 16) | rms.astype(U32)).astype(U32)
    state[::2] = (state[::2] & 0xFFFF0000) | 0x3C00  # half of them: an ordinary RMS of 1.0
    p = rng.standard_normal(n).astype(F32)
    g = (rng.standard_normal(n) * 1e-3).astype(F32)
    check_step(p, g, state, count=3, hp=Hyperparams(lr=1e-3), fmt=fmt, device=device,
               authority_index=np.arange(0, n, 7))


def test_this_process_keeps_float32_subnormals():
    # The kernel decodes subnormal codes through float32 subnormals (kernel.py, `_decode`); an
    # interpreted run in a process that flushes them (torch.set_flush_denormal(True)) would
    # decode those codes as 0, and every bit comparison here would fail for that reason.
    smallest = np.float32(2.0**-149)
    assert smallest * np.float32(2.0) == np.float32(2.0**-148)
    assert torch.tensor(smallest) * 2 == torch.tensor(np.float32(2.0**-148))
