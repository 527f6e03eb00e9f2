"""`PackedAdamW` over bf16 parameters with exact FP32 masters (docs/FORMAT.md, "Split masters").

A bf16 parameter is the live weight w; its optimizer state adds the int16 low half lo, and the
step runs on the FP32 master join(w, lo). Fed the same gradient values, the masters of a bf16
run equal an FP32-parameter run's parameters bit for bit (and its words, counts and
rejections), in every mode, and w is always the master rounded to nearest bf16 (checked against
torch's own rounding). CPU tests run the numpy step, and the CUDA launch layer (`_launch`)
through the Triton interpreter on CPU tensors; the CUDA-marked ones compile the split kernels
(single-tensor, and each launch kind of the multi-tensor launch) and compare them with the CPU
and with FP32 runs on the GPU.

Bits are compared as integers: bf16 and int16 tensors as their 16-bit patterns, float32 and
uint32 as uint32 (`torch_helpers.bits`), never with a tolerance.
"""
from __future__ import annotations

import contextlib
import copy
import math

import numpy as np
import pytest
import torch

import torch_helpers as H
from conftest import interpreting
from packed_adamw.core import StateFormat, codecs as formats
from packed_adamw.core.portable import PortableState
from packed_adamw.torch import NonFiniteGradientError, PackedAdamW, adamw_step_, new_state
from layout import TESTS

MODES = H.MODES
LOW = formats.LOW_HALF_KEY
BF16, F32 = torch.bfloat16, torch.float32
GRAD_DTYPES = [pytest.param(BF16, id="bf16_grads"), pytest.param(F32, id="fp32_grads")]
SHAPES = ((3001,), (37, 41), (), (0, 3))
CUDA = torch.cuda.is_available()
# Huge and non-finite inputs are deliberate; numpy warns on their overflow.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


# ------------------------------------------------------------------------------ helpers ----

def bits16(t: torch.Tensor) -> np.ndarray:
    """A bf16 or int16 tensor's patterns as a flat uint16 numpy copy."""
    return t.detach().cpu().contiguous().view(torch.int16).reshape(-1).numpy().view(np.uint16).copy()


def low_half(opt, p) -> torch.Tensor:
    return opt.state[p][LOW]


def joined(opt, p) -> np.ndarray:
    """The master join(w, lo) of bf16 `p` as flat uint32 bits (lo = 0 before any state)."""
    lo = bits16(low_half(opt, p)) if p in opt.state else np.zeros(p.numel(), np.uint16)
    return formats.join_master(bits16(p), lo).reshape(-1).view(np.uint32).copy()


def assert_same16(actual, expected, what: str) -> None:
    a, e = bits16(actual) if isinstance(actual, torch.Tensor) else actual, \
        bits16(expected) if isinstance(expected, torch.Tensor) else expected
    assert a.shape == e.shape, f"{what}: {a.size} values vs {e.size}"
    bad = np.flatnonzero(a != e)
    assert not bad.size, f"{what}: {bad.size} of {a.size} differ: " + ", ".join(
        f"[{i}] {a[i]:#06x} != {e[i]:#06x}" for i in bad[:5])


def assert_nearest_bf16(p, master_bits: np.ndarray, what: str) -> None:
    """w is the master rounded to the nearest bf16, ties away from zero: checked against torch's
    own rounding (to nearest, ties to even), which differs only at exact ties, where |w| > |M|."""
    master = torch.from_numpy(np.ascontiguousarray(master_bits).view(np.float32).copy())
    w = bits16(p)
    tie = (master_bits & 0xFFFF) == 0x8000
    assert_same16(w[~tie], bits16(master.to(BF16))[~tie], f"{what}: w is not the nearest bf16 of the master")
    w_values = (w.astype(np.uint32) << np.uint32(16)).view(np.float32)
    assert (np.abs(w_values[tie]) > np.abs(master.numpy()[tie])).all(), f"{what}: a tie not rounded away from zero"


def bf16_values(rng, n: int, lo_exp: int, hi_exp: int) -> torch.Tensor:
    return torch.from_numpy(H.spanning_values(rng, n, lo_exp, hi_exp)).to(BF16)


def make_pair(seed: int = 0, shapes=SHAPES, device="cpu"):
    """bf16 parameters and FP32 parameters holding the same values."""
    rng = np.random.default_rng(seed)
    bf16 = [torch.nn.Parameter(bf16_values(rng, math.prod(s), -12, 3).reshape(s).to(device)) for s in shapes]
    fp32 = [torch.nn.Parameter(p.detach().float().clone()) for p in bf16]
    return bf16, fp32


def set_grad(p: torch.nn.Parameter, g: torch.Tensor) -> None:
    """p.grad = g, also where g's dtype differs from p's (torch's setter refuses that; autograd
    gives FP32 gradients of bf16 parameters under `p.grad_dtype = torch.float32`)."""
    g = g.to(p.device)
    if g.dtype == p.dtype:
        p.grad = g
    else:
        p.grad = torch.zeros_like(p)
        p.grad.data = g


def feed(rng, bf16_params, fp32_params, grad_dtype, lo_exp=-40, hi_exp=6) -> None:
    """The same gradient values to both runs: bf16 ones (bf16 parameters only) for bf16 gradients."""
    for p, q in zip(bf16_params, fp32_params):
        g = torch.from_numpy(H.spanning_values(rng, p.numel(), lo_exp, hi_exp)).reshape(p.shape)
        if grad_dtype is BF16 and p.dtype is BF16:
            g = g.to(BF16)
        set_grad(p, g.clone())
        set_grad(q, g.float())


def assert_matches_fp32_run(opt, params, ref, ref_params, what: str) -> None:
    """Every bf16 parameter's master equals the FP32 run's parameter, its state the FP32 run's
    state; FP32 parameters in `opt` equal theirs directly; w is the rule of M."""
    if params and params[0].is_cuda:
        torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params, ref_params)):
        if p.dtype is BF16:
            H.assert_same_bits(joined(opt, p), H.bits(q), f"{what}: master {i}")
            assert_nearest_bf16(p, H.bits(q), f"{what}: param {i}")
        else:
            H.assert_same_bits(p, q, f"{what}: fp32 param {i}")
        if q in ref.state:
            H.assert_same_bits(H.state_tensor(opt, p), H.state_tensor(ref, q), f"{what}: state {i}")
            assert int(opt.state[p]["step"]) == int(ref.state[q]["step"]), f"{what}: step {i}"
        else:
            assert p not in opt.state, f"{what}: param {i} has state the FP32 run has not"


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.7 * s))


def run_both(opt, params, ref, ref_params, grad_dtype, steps, seed, check_each_step=True, what=""):
    """`steps` steps of both runs under an lr schedule, identical gradient values."""
    rng = np.random.default_rng(seed)
    scheds = [schedule(opt), schedule(ref)]
    lrs = []
    for step in range(steps):
        feed(rng, params, ref_params, grad_dtype)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        if check_each_step:
            assert_matches_fp32_run(opt, params, ref, ref_params, f"{what} step {step + 1}")
    assert len(set(lrs)) == steps, f"the schedule did not move lr: {lrs}"


def moved(params, before) -> None:
    """The test is not vacuous: the live weights changed and some low halves are nonzero."""
    assert any((bits16(p) != b).any() for p, b in zip(params, before)), "no live weight moved"


# =============================================================== trajectories (CPU) ====

@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_masters_follow_an_fp32_run_bit_for_bit_every_step(mode, grad_dtype):
    """Six steps under a changing lr, gradients spanning 2**-40 .. 2**6 (subnormal and
    saturated moments); 1-D, 2-D, 0-d and empty parameters."""
    params, ref_params = make_pair(0)
    opt = PackedAdamW(params, lr=1e-2, weight_decay=0.1, mode=mode)
    ref = PackedAdamW(ref_params, lr=1e-2, weight_decay=0.1, mode=mode)
    before = [bits16(p) for p in params]
    run_both(opt, params, ref, ref_params, grad_dtype, 6, seed=1, what=f"{mode}")
    moved(params, before)
    assert any(bits16(low_half(opt, p)).any() for p in params), "every low half is zero"
    for p in params:
        lo = low_half(opt, p)
        assert lo.dtype == torch.int16 and lo.shape == p.shape and p.dtype is BF16


@pytest.mark.parametrize("mode", MODES)
def test_mixed_bf16_and_fp32_parameters_in_one_group_and_across_groups(mode):
    """FP32 parameters, bf16 ones with bf16 gradients and bf16 ones with FP32 gradients,
    interleaved in two groups of different hyperparameters: each equals its FP32 run."""
    rng = np.random.default_rng(5)
    shapes = [(300,), (13, 17), (), (40,), (7, 9), (5,)]
    bf16_first = [bf16_values(rng, math.prod(s), -8, 2).reshape(s) for s in shapes]
    params = [torch.nn.Parameter(v if i % 3 else v.float()) for i, v in enumerate(bf16_first)]  # 0, 3: FP32
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "betas": (0.8, 0.99)}]  # noqa: E731
    opt = PackedAdamW(groups(params), lr=1e-2, mode=mode, weight_decay=0.05)
    ref = PackedAdamW(groups(ref_params), lr=1e-2, mode=mode, weight_decay=0.05)
    for step in range(5):
        for i, (p, q) in enumerate(zip(params, ref_params)):
            g = torch.from_numpy(H.spanning_values(rng, p.numel(), -30, 4)).reshape(p.shape)
            if i % 3 == 1:  # bf16 gradients of bf16 parameters 1 and 4; 2 and 5 get FP32 ones
                g = g.to(BF16)
            set_grad(p, g.clone())
            set_grad(q, g.float())
        for o in (opt, ref):
            o.param_groups[0]["lr"] = 1e-2 / (1 + step)
            o.step()
        assert_matches_fp32_run(opt, params, ref, ref_params, f"{mode} mixed step {step + 1}")
    assert [p.dtype for p in params] == [F32, BF16, BF16, F32, BF16, BF16]
    assert LOW not in opt.state[params[0]] and LOW in opt.state[params[1]]


def test_a_gradient_dtype_change_between_steps_keeps_the_trajectory():
    """bf16 gradients, then FP32 ones, then bf16 again (the step plan is rebuilt each time)."""
    params, ref_params = make_pair(2)
    opt, ref = PackedAdamW(params, lr=1e-2), PackedAdamW(ref_params, lr=1e-2)
    rng = np.random.default_rng(3)
    for step, grad_dtype in enumerate([BF16, BF16, F32, F32, BF16]):
        feed(rng, params, ref_params, grad_dtype)
        opt.step()
        ref.step()
        assert_matches_fp32_run(opt, params, ref, ref_params, f"step {step + 1} ({grad_dtype})")


@pytest.mark.filterwarnings("ignore:PackedAdamW.*saturated:RuntimeWarning")  # gradients up to 2**6 saturate
@pytest.mark.parametrize("mode", ["packed", "fp16"])
def test_format_counts_of_a_bf16_run_equal_the_fp32_run(mode):
    params, ref_params = make_pair(4)
    opt = PackedAdamW(params, lr=1e-2, mode=mode, track_format=True)
    ref = PackedAdamW(ref_params, lr=1e-2, mode=mode, track_format=True)
    run_both(opt, params, ref, ref_params, BF16, 5, seed=6, check_each_step=False)
    stats, ref_stats = opt.format_stats(), ref.format_stats()
    assert stats == ref_stats and stats
    assert any(v for entry in stats.values() for k, v in entry.items() if k != "elements"), stats


def test_the_functional_step_takes_low_halves_and_refuses_a_bf16_param_without_one():
    fmt = StateFormat("packed")
    w = torch.tensor([1.0, -2.5, 3e-3], dtype=BF16)
    lo = torch.zeros(3, dtype=torch.int16)
    words = new_state(w, fmt)
    ref = w.float().clone()
    ref_words = new_state(ref, fmt)
    g = torch.tensor([0.5, -1.0, 2.0], dtype=BF16)
    hp = [(1e-2, 0.9, 0.999, 1e-8, 0.0)]
    assert adamw_step_([w], [g], [words], [1], hp, fmt, lows=[lo]) == [0]
    adamw_step_([ref], [g.float()], [ref_words], [1], hp, fmt)
    H.assert_same_bits(formats.join_master(bits16(w), bits16(lo)).view(np.uint32), H.bits(ref), "functional")
    H.assert_same_bits(words, ref_words, "functional words")
    with pytest.raises(ValueError, match="tensor 0: param is not contiguous torch.float32"):
        adamw_step_([w], [g], [words], [1], hp, fmt)
    with pytest.raises(ValueError, match="low half is not a contiguous torch.int16"):
        adamw_step_([w], [g], [words], [1], hp, fmt, lows=[torch.zeros(3, dtype=torch.int32)])


# ========================================================== masters in and out (CPU) ====

def master_values(rng, n: int) -> np.ndarray:
    """FP32 masters with every kind of low half: ties, subnormals, zeros, the domain's edge."""
    values = H.spanning_values(rng, n, -140, 120).view(np.uint32)
    values[:64] = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x00008000, 0x00000001, 0x007FFFFF, 0x80000000,
                            formats.SPLIT_MASTER_MAX_BITS, formats.SPLIT_MASTER_MAX_BITS | 0x80000000,
                            0x7F7F0000, 0x3FFF8000, 0x3FFF7FFF] * 5 + [0, 0, 0, 0], dtype=np.uint32)
    return values.view(np.float32)


def test_load_master_weights_then_master_weights_gives_the_masters_back_bit_for_bit():
    rng = np.random.default_rng(8)
    shapes = [(4001,), (3, 5), ()]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=BF16)) for s in shapes] + [torch.nn.Parameter(torch.zeros(6))]
    opt = PackedAdamW(params, lr=1e-3)
    masters = [torch.from_numpy(master_values(rng, 4001)),
               torch.from_numpy(master_values(rng, 64)[:15].copy()).reshape(3, 5),
               torch.tensor(-1.2345678e-3), torch.randn(6)]
    opt.load_master_weights(masters)
    out = opt.master_weights()
    assert out[3] is params[3]  # an FP32 parameter is its own master
    for i, (m, got) in enumerate(zip(masters, out)):
        assert got.dtype == F32 and got.shape == m.shape
        H.assert_same_bits(got, m, f"master {i}")
    for i, p in enumerate(params[:3]):
        assert_nearest_bf16(p, H.bits(masters[i]), f"loaded param {i}")
        assert int(opt.state[p]["step"]) == 0
    assert bits16(low_half(opt, params[0])).any()


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_run_started_from_fp32_masters_follows_the_fp32_run(mode):
    """load_master_weights of arbitrary FP32 weights into a bf16 model, then training: the
    masters equal an FP32 run started from those weights, bit for bit."""
    rng = np.random.default_rng(9)
    shapes = [(500,), (9, 11), ()]
    ref_params = [torch.nn.Parameter(torch.from_numpy(H.spanning_values(rng, math.prod(s), -10, 2)).reshape(s))
                  for s in shapes]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=BF16)) for s in shapes]
    opt = PackedAdamW(params, lr=1e-2, mode=mode)
    ref = PackedAdamW(ref_params, lr=1e-2, mode=mode)
    opt.load_master_weights([q.detach() for q in ref_params])
    for p, q in zip(params, ref_params):
        H.assert_same_bits(joined(opt, p), H.bits(q), "loaded master")
    run_both(opt, params, ref, ref_params, F32, 5, seed=10, what=f"{mode} from masters")


def test_load_master_weights_after_steps_keeps_the_moments_and_continues_like_fp32():
    params, ref_params = make_pair(11)
    opt, ref = PackedAdamW(params, lr=1e-2), PackedAdamW(ref_params, lr=1e-2)
    run_both(opt, params, ref, ref_params, BF16, 2, seed=12, check_each_step=False)
    with torch.no_grad():
        for q in ref_params:
            q.mul_(1.0009765625)  # new FP32 weights mid-run; the moments stay
    words = [opt.state[p][H.state_key("packed")] for p in params]
    opt.load_master_weights([q.detach() for q in ref_params])
    assert all(opt.state[p][H.state_key("packed")] is w for p, w in zip(params, words))
    run_both(opt, params, ref, ref_params, BF16, 3, seed=13, what="after load_master_weights")


@pytest.mark.parametrize("bad", ["above SPLIT_MASTER_MAX", "nan", "inf"])
def test_load_master_weights_refuses_masters_outside_the_domain_and_changes_nothing(bad):
    params, _ = make_pair(14, shapes=((10,), (4,)))
    opt = PackedAdamW([("enc.weight", params[0]), ("enc.bias", params[1])], lr=1e-2)
    set_grad(params[0], torch.ones(10, dtype=BF16))
    set_grad(params[1], torch.ones(4, dtype=BF16))
    opt.step()
    before = [(bits16(p), bits16(low_half(opt, p))) for p in params]
    value = {"above SPLIT_MASTER_MAX": np.nextafter(np.float32(formats.SPLIT_MASTER_MAX), np.float32(np.inf)),
             "nan": np.float32(np.nan), "inf": np.float32(-np.inf)}[bad]
    masters = [torch.zeros(10), torch.zeros(4)]
    masters[1][2] = float(value)
    with pytest.raises(ValueError) as info:
        opt.load_master_weights(masters)
    message = str(info.value)
    assert "'enc.bias'" in message and "1 of 4 values" in message and "SPLIT_MASTER_MAX" in message, message
    for p, (w, lo) in zip(params, before):
        assert_same16(bits16(p), w, "weight after a refused load")
        assert_same16(bits16(low_half(opt, p)), lo, "low half after a refused load")
    # The domain's last value itself loads.
    masters[1][2] = formats.SPLIT_MASTER_MAX
    opt.load_master_weights(masters)
    assert bits16(params[1])[2] == 0x7F7F and bits16(low_half(opt, params[1]))[2] == 0x7FFF


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_load_master_weights_refuses_a_non_finite_master_of_an_fp32_parameter_too_and_changes_nothing(bad):
    """A bf16 parameter refuses it as outside the split domain; an FP32 one took it and held a
    NaN (or Inf) weight that no step changes."""
    bf16, _ = make_pair(16, shapes=((10,),))
    fp32 = torch.nn.Parameter(torch.linspace(-1, 1, 4))
    opt = PackedAdamW([("enc.weight", bf16[0]), ("enc.bias", fp32)], lr=1e-2)
    masters = [m.detach().clone() for m in opt.master_weights()]
    masters[0] += 0.5  # a valid change, refused with the rest
    masters[1][2] = bad
    before = (bits16(bf16[0]), H.bits(fp32))
    with pytest.raises(ValueError, match=r"'enc.bias' has 1 of 4 values that are NaN or Inf"):
        opt.load_master_weights(masters)
    assert_same16(bits16(bf16[0]), before[0], "bf16 weight after a refused load")
    H.assert_same_bits(fp32, before[1], "FP32 weight after a refused load")
    assert not opt.state  # no low half was written either


def test_load_master_weights_refuses_a_wrong_count_dtype_or_shape():
    params, _ = make_pair(15, shapes=((10,), (4,)))
    opt = PackedAdamW(params)
    for masters, fragment in (([torch.zeros(10)], "got 1 tensors for 2"),
                              ([torch.zeros(10), torch.zeros(4, dtype=torch.float64)], "float32 tensor of shape (4,)"),
                              ([torch.zeros(10), torch.zeros(2, 2)], "float32 tensor of shape (4,)")):
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            opt.load_master_weights(masters)
    assert not opt.state


# ======================================================== the domain, non-finite (CPU) ====

@pytest.mark.parametrize("mode", MODES)
def test_a_master_pushed_past_the_domain_is_rejected_and_named(mode):
    """Element 0 sits at SPLIT_MASTER_MAX and an update of about 1e35 pushes it past (finite
    in FP32: the FP32 run takes it); element 1 moves normally. The bf16 run rejects element 0:
    weight, low half and state stay, check_nonfinite names the parameter."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=BF16))
    opt = PackedAdamW([("big.weight", p)], lr=1e35, weight_decay=0.0, mode=mode, check_nonfinite=True)
    opt.load_master_weights([torch.tensor([formats.SPLIT_MASTER_MAX, 1.0])])
    before_w, before_lo = bits16(p), bits16(low_half(opt, p))
    set_grad(p, torch.tensor([-1.0, 0.0], dtype=BF16))  # a negative gradient raises the master
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    assert "'big.weight' (1 of 2 elements)" in str(info.value) and "bf16 range" in str(info.value)
    assert bits16(p)[0] == before_w[0] == 0x7F7F and bits16(low_half(opt, p))[0] == before_lo[0] == 0x7FFF
    state = H.state_as_numpy(H.state_tensor(opt, p), mode)
    assert not (state[:, 0] if mode == "fp32" else state[0:1]).any(), "a rejected element's state moved"
    assert int(opt.state[p]["step"]) == 1
    # The FP32 run accepts the same step: the domain is the only difference.
    q = torch.nn.Parameter(torch.tensor([formats.SPLIT_MASTER_MAX, 1.0]))
    ref = PackedAdamW([q], lr=1e35, weight_decay=0.0, mode=mode, check_nonfinite=True)
    q.grad = torch.tensor([-1.0, 0.0])
    ref.step()
    assert formats.SPLIT_MASTER_MAX < float(q.detach()[0]) < math.inf
    H.assert_same_bits(joined(opt, p)[1:], H.bits(q)[1:], "the accepted element")


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_gradients_of_a_bf16_param_are_named_and_those_elements_kept(mode):
    params, ref_params = make_pair(16, shapes=((500,), (20,)))
    opt = PackedAdamW([("layer.weight", params[0]), ("layer.bias", params[1])], lr=1e-2, mode=mode,
                      check_nonfinite=True)
    ref = PackedAdamW(ref_params, lr=1e-2, mode=mode)
    rng = np.random.default_rng(17)
    feed(rng, params, ref_params, BF16)
    opt.step()
    ref.step()
    bad = [3, 77, 78, 401]
    feed(rng, params, ref_params, BF16)
    for p in (params[0], ref_params[0]):
        p.grad[bad] = torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan")]).to(p.grad.dtype)
    before_w, before_lo = bits16(params[0]), bits16(low_half(opt, params[0]))
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    ref.step()
    assert "'layer.weight' (4 of 500 elements)" in str(info.value) and "layer.bias" not in str(info.value)
    assert_same16(bits16(params[0])[bad], before_w[bad], "rejected weights")
    assert_same16(bits16(low_half(opt, params[0]))[bad], before_lo[bad], "rejected low halves")
    assert_matches_fp32_run(opt, params, ref, ref_params, "after non-finite gradients")
    assert torch.isfinite(params[0].float()).all()


# ============================================================ saving, loading (CPU) ====

@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trips_the_low_halves_through_torch_save_weights_only(mode, tmp_path):
    params, ref_params = make_pair(18)
    mixed = params[:2] + [torch.nn.Parameter(torch.randn(5))]  # and an FP32 parameter
    ref_mixed = ref_params[:2] + [torch.nn.Parameter(mixed[2].detach().clone())]
    opt, ref = PackedAdamW(mixed, lr=1e-2, mode=mode), PackedAdamW(ref_mixed, lr=1e-2, mode=mode)
    run_both(opt, mixed, ref, ref_mixed, BF16, 3, seed=19, check_each_step=False)
    torch.save({"weights": [p.detach() for p in mixed], "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_params = [torch.nn.Parameter(w.clone()) for w in saved["weights"]]
    resumed = PackedAdamW(resumed_params, lr=1e-2, mode=mode)
    resumed.load_state_dict(saved["optim"])
    for p, q in zip(mixed, resumed_params):
        if p.dtype is BF16:
            lo = low_half(resumed, q)
            assert lo.dtype == torch.int16 and lo.shape == q.shape, "torch's load cast the low half"
            assert_same16(lo, low_half(opt, p), "loaded low half")
        else:
            assert LOW not in resumed.state[q]
    deep = copy.deepcopy(resumed)
    deep_params = [p for g in deep.param_groups for p in g["params"]]
    run_both(opt, mixed, ref, ref_mixed, BF16, 2, seed=20, check_each_step=False)
    for other, other_params in ((resumed, resumed_params), (deep, deep_params)):
        rng = np.random.default_rng(20)  # run_both's gradients and schedule, for one optimizer
        sched = schedule(other)
        for _ in range(2):
            feed(rng, other_params, [torch.nn.Parameter(torch.zeros(p.shape)) for p in other_params], BF16)
            other.step()
            sched.step()
        for i, (p, q) in enumerate(zip(mixed, other_params)):
            if p.dtype is BF16:
                assert_same16(q, p, f"resumed weight {i}")
                assert_same16(low_half(other, q), low_half(opt, p), f"resumed low half {i}")
            else:
                H.assert_same_bits(q, p, f"resumed fp32 param {i}")
            H.assert_same_bits(H.state_tensor(other, q), H.state_tensor(opt, p), f"resumed state {i}")


def test_a_state_of_bf16_params_loaded_into_fp32_params_and_the_reverse_is_refused():
    params, ref_params = make_pair(21, shapes=((10,), (4,)))
    opt, ref = PackedAdamW(params, lr=1e-2), PackedAdamW(ref_params, lr=1e-2)
    run_both(opt, params, ref, ref_params, BF16, 1, seed=22, check_each_step=False)
    into_fp32 = PackedAdamW([torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match=r"holds a low half 'lo'.*saved from a bfloat16 parameter.*torch.float32"):
        into_fp32.load_state_dict(opt.state_dict())
    into_bf16 = PackedAdamW([torch.nn.Parameter(torch.zeros(10, dtype=BF16)),
                             torch.nn.Parameter(torch.zeros(4, dtype=BF16))])
    with pytest.raises(ValueError, match=r"has no low half 'lo'.*saved from a float32 parameter.*bfloat16"):
        into_bf16.load_state_dict(ref.state_dict())
    assert not into_fp32.state and not into_bf16.state
    # A damaged low half (wrong dtype) is refused too.
    sd = opt.state_dict()
    sd["state"][0][LOW] = sd["state"][0][LOW].to(torch.int32)
    with pytest.raises(ValueError, match=r"should hold 'lo' torch.int16 of shape \(10,\)"):
        PackedAdamW(copy.deepcopy(params)).load_state_dict(sd)


def test_a_parameter_converted_to_bf16_after_stepping_is_refused_at_step():
    q = torch.nn.Parameter(torch.randn(6))
    opt = PackedAdamW([("head.weight", q)], lr=1e-2)
    q.grad = torch.randn(6)
    opt.step()
    q.data = q.data.to(BF16)  # what module.to(torch.bfloat16) does to a parameter
    q.grad = None
    set_grad(q, torch.randn(6, dtype=BF16))
    with pytest.raises(ValueError, match=r"'head.weight' is bfloat16 but its optimizer state has no low half"):
        opt.step()
    assert int(opt.state[q]["step"]) == 1


def test_fp16_parameters_are_refused_saying_to_use_bf16_or_fp32():
    with pytest.raises(TypeError) as info:
        PackedAdamW([("enc.weight", torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)))])
    message = str(info.value)
    assert "'enc.weight'" in message and "torch.float16" in message
    assert "bfloat16" in message and "float32" in message, message


def test_a_bf16_gradient_of_an_fp32_parameter_is_refused_naming_it():
    q = torch.nn.Parameter(torch.zeros(4))
    opt = PackedAdamW([("w", q)])
    set_grad(q, torch.zeros(4, dtype=BF16))
    with pytest.raises(TypeError, match=r"'w': gradient dtype torch.bfloat16 .* must be float32"):
        opt.step()


def test_export_and_import_through_a_file_keep_the_low_halves(tmp_path):
    params, ref_params = make_pair(23, shapes=((30,), ()))
    mixed = params + [torch.nn.Parameter(torch.randn(3))]
    opt = PackedAdamW(mixed, lr=1e-2)
    rng = np.random.default_rng(24)
    for _ in range(2):
        feed(rng, mixed, [torch.nn.Parameter(torch.zeros(p.shape)) for p in mixed], BF16)
        opt.step()
    exported = opt.export_state()
    assert exported.low_halves[2] is None and exported.low_halves[0].dtype == np.int16
    exported.save(tmp_path / "s.safetensors")
    loaded = PortableState.load(tmp_path / "s.safetensors")
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in mixed]
    resumed = PackedAdamW(resumed_params, lr=1e-2)
    resumed.import_state(loaded)
    for p, q in zip(mixed, resumed_params):
        H.assert_same_bits(H.state_tensor(resumed, q), H.state_tensor(opt, p), "imported words")
        if p.dtype is BF16:
            assert_same16(low_half(resumed, q), low_half(opt, p), "imported low half")
    # An importer of FP32 parameters only (as the JAX one) refuses low halves instead of dropping them.
    with pytest.raises(ValueError, match="has a low half"):
        loaded.check(StateFormat("packed"), [(30,), (), (3,)])
    with pytest.raises(ValueError, match="has a low half"):
        PackedAdamW([torch.nn.Parameter(p.detach().float()) for p in mixed]).import_state(loaded)


# ============================================================= FSDP2 (gloo, 2 ranks) ====

@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_fsdp2_bf16_params_on_two_ranks_equal_one_process_and_resume_resharded(tmp_path):
    """In the launches (tests/distributed_scenarios.py, `fsdp_bf16`): FSDP2 over a bf16 model,
    every mode: weights, words, low halves (int8-pair DTensors sharded like the parameters) and
    masters equal a single-process bf16 run bit for bit; a DCP checkpoint resumes exactly on 2
    ranks, and resharded on 1 (`fsdp_bf16_resume`); sharded masters load back exactly."""
    from torchrun_helpers import torchrun

    scenarios = TESTS / "distributed_scenarios.py"
    torchrun(2, scenarios, "fsdp_bf16", str(tmp_path), timeout_s=180)
    for mode in MODES:
        assert (tmp_path / f"final-bf16-{mode}.pt").is_file()
    torchrun(1, scenarios, "fsdp_bf16_resume", str(tmp_path), "2", timeout_s=180)


# ============================== the CUDA launch layer, interpreted on CPU tensors ====

LAUNCH_SPECS = [  # (parameter dtype, gradient dtype, elements): three launch kinds, interleaved
    (BF16, BF16, 700), (F32, F32, 513), (BF16, F32, 2000), (F32, F32, 1600), (BF16, BF16, 1), (BF16, F32, 0),
    (BF16, BF16, 1501), (F32, F32, 3), (BF16, F32, 9),
]


def launch_inputs(fmt, seed: int, order):
    """Tensors of LAUNCH_SPECS in `order`: weights, gradients (some NaN), states, low halves."""
    rng = np.random.default_rng(seed)
    params, grads, states, lows = [], [], [], []
    for param_dtype, grad_dtype, n in (LAUNCH_SPECS[i] for i in order):
        p = bf16_values(rng, n, -8, 2).to(param_dtype)
        g = torch.from_numpy(H.spanning_values(rng, n, -40, 6))
        if n > 5:
            g[n // 2] = float("nan")
        params.append(p)
        grads.append(g.to(grad_dtype))
        states.append(new_state(p, fmt))
        lows.append(torch.from_numpy(rng.integers(-2**15, 2**15, n).astype(np.int16)) if param_dtype is BF16 else None)
    return params, grads, states, lows


@pytest.mark.skipif(not interpreting(), reason="interprets the CUDA launch layer on CPU tensors (CUDA tests compile)")
@pytest.mark.parametrize("sorted_kinds", [pytest.param(False, id="interleaved"), pytest.param(True, id="side_by_side")])
@pytest.mark.parametrize("mode", MODES)
def test_interpreted_launch_layer_equals_the_cpu_step(mode, sorted_kinds, monkeypatch):
    """`_launch.launch_step` (what a CUDA step runs) through the Triton interpreter: the three
    launch kinds' multi-tensor launches with their table sections, solo launches of both
    single-tensor kernels (launch.SOLO_ELEMENTS lowered), counter rows as views or gathered and
    added back, several scalar rows; equal to the numpy step, bit for bit, counts included."""
    from packed_adamw.core import launch
    from packed_adamw.torch import _launch, functional

    rule = functional.ADAMW_LAUNCH

    monkeypatch.setattr(launch, "SOLO_ELEMENTS", 1500)
    monkeypatch.setattr(_launch, "on_device", lambda device: contextlib.nullcontext())
    fmt = StateFormat(mode)
    order = list(range(len(LAUNCH_SPECS)))
    if sorted_kinds:
        order.sort(key=lambda i: (LAUNCH_SPECS[i][0] is BF16, LAUNCH_SPECS[i][1] is BF16))
    counts = [1 + (i % 3) for i in range(len(order))]
    hparams = [(1e-2, 0.9, 0.999, 1e-8, 0.01), (3e-3, 0.8, 0.99, 1e-6, 0.0, True)]
    rows_of = [hparams[i % 2] for i in range(len(order))]
    scalars, rows = functional.scalar_table(counts, rows_of)
    track = mode != "fp32"
    results = []
    for use_launch_layer in (True, False):
        params, grads, states, lows = launch_inputs(fmt, 40, order)
        counters = torch.zeros((len(params), launch.COUNTER_ROW), dtype=torch.int64)
        if use_launch_layer:
            kinds = tuple(_launch.LaunchKind(lo is not None, g.dtype is BF16) for lo, g in zip(lows, grads))
            layout = _launch.step_layout(kinds, tuple(p.numel() for p in params), rows, torch.device("cpu"))
            assert [s.span is None for s in layout] == ([False] * 3 if sorted_kinds else [True] * 3)
            n_pointers = _launch.layout_pointers(layout)
            table = torch.zeros(n_pointers + rule.scalar_row_int64_words * len(scalars), dtype=torch.int64)
            table.numpy()[n_pointers:].view(np.float32)[:] = scalars.reshape(-1)
            _launch.fill_addresses(table.numpy()[:n_pointers], layout,
                                   *map(_launch.addresses_of, (params, grads, states, lows)))
            rejected = _launch.launch_step(rule, table, params, grads, states, layout, fmt, True, aligned=False,
                                           counters=counters, track_format=track, lows=lows)
        else:
            rejected = functional.cpu_step_(params, grads, states, scalars, rows, fmt, counters, track, lows)
        results.append((params, states, lows, rejected, launch.sum_counter_slots(counters.numpy())))
    (params, states, lows, rejected, format_counts), cpu_run = results
    cpu_params, cpu_states, cpu_lows, cpu_rejected, cpu_counts = cpu_run
    assert rejected == cpu_rejected and sum(rejected) >= 6, (rejected, cpu_rejected)
    np.testing.assert_array_equal(format_counts, cpu_counts)
    if track:
        assert format_counts.sum() > 0
    for i, (p, q) in enumerate(zip(params, cpu_params)):
        if p.dtype is BF16:
            assert_same16(p, q, f"weight {i}")
            assert_same16(lows[i], cpu_lows[i], f"low half {i}")
        else:
            H.assert_same_bits(p, q, f"param {i}")
        H.assert_same_bits(states[i], cpu_states[i], f"state {i}")


def test_a_plans_fixed_addresses_plus_gradients_are_the_full_table():
    from packed_adamw.torch import _launch

    fmt = StateFormat("packed")
    order = list(range(len(LAUNCH_SPECS)))
    params, grads, states, lows = launch_inputs(fmt, 41, order)
    kinds = tuple(_launch.LaunchKind(lo is not None, g.dtype is BF16) for lo, g in zip(lows, grads))
    layout = _launch.step_layout(kinds, tuple(p.numel() for p in params), (0,) * len(params), torch.device("cpu"))
    full_table = np.zeros(_launch.layout_pointers(layout), dtype=np.int64)
    _launch.fill_addresses(full_table, layout, *map(_launch.addresses_of, (params, grads, states, lows)))
    fixed, grad_slots = _launch.fixed_addresses(layout, _launch.addresses_of(params),
                                                _launch.addresses_of(states), _launch.addresses_of(lows))
    fixed[grad_slots] = _launch.addresses_of(grads)
    np.testing.assert_array_equal(fixed, full_table)
    # Each segment: its parameters, gradients, states (and low halves) as consecutive sections.
    assert [s.kind for s in layout] == sorted(set(kinds)) and len(full_table) == 3 * 3 + 4 * 6
    split_segment = layout[2]
    assert split_segment.kind == _launch.LaunchKind(True, True)
    n = len(split_segment.indices)
    lows_section = full_table[split_segment.offset + 3 * n:split_segment.offset + 4 * n]
    assert lows_section.tolist() == [lows[i].data_ptr() for i in split_segment.indices]


# ====================================================================== CUDA ====

LAUNCHES = [pytest.param(True, id="multi_tensor"), pytest.param(False, id="per_tensor")]


def cuda_copy(params):
    return [torch.nn.Parameter(p.detach().clone().cuda()) for p in params]


@pytest.mark.parametrize("multi_tensor", LAUNCHES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_masters_follow_the_cuda_fp32_run_and_the_cpu_bf16_run(mode, grad_dtype, multi_tensor):
    cpu_params, ref_cpu = make_pair(30)
    params, ref_params = cuda_copy(cpu_params), cuda_copy(ref_cpu)
    kw = dict(lr=1e-2, weight_decay=0.1, mode=mode, multi_tensor=multi_tensor)
    opt, ref, cpu = PackedAdamW(params, **kw), PackedAdamW(ref_params, **kw), PackedAdamW(cpu_params, **kw)
    run_both(opt, params, ref, ref_params, grad_dtype, 6, seed=31, what=f"cuda {mode}")
    run_both(cpu, cpu_params, PackedAdamW(ref_cpu, **kw), ref_cpu, grad_dtype, 6, seed=31, check_each_step=False)
    for i, (p, q) in enumerate(zip(params, cpu_params)):
        assert_same16(p, q, f"cuda vs cpu weight {i}")
        if q in cpu.state:
            assert_same16(low_half(opt, p), low_half(cpu, q), f"cuda vs cpu low half {i}")
            H.assert_same_bits(H.state_tensor(opt, p), H.state_tensor(cpu, q), f"cuda vs cpu state {i}")


@pytest.mark.filterwarnings("ignore:PackedAdamW.*saturated:RuntimeWarning")  # gradients up to 2**6 saturate
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_three_launch_kinds_and_solo_launches_in_one_step_with_counters(mode, monkeypatch):
    """FP32, bf16-with-bf16-gradient and bf16-with-FP32-gradient tensors interleaved in two
    groups, some of them past a lowered launch.SOLO_ELEMENTS (the single-tensor kernels), with
    check_nonfinite's and track_format's counters: every launch equals its FP32 run."""
    from packed_adamw.core import launch

    monkeypatch.setattr(launch, "SOLO_ELEMENTS", 1000)
    rng = np.random.default_rng(32)
    shapes = [(5000,), (300,), (3001,), (17, 13), (), (2000,), (7,), (1200,), (0,)]
    values = [bf16_values(rng, math.prod(s), -8, 2).reshape(s) for s in shapes]
    params = [torch.nn.Parameter((v if i % 3 else v.float()).cuda()) for i, v in enumerate(values)]
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    groups = lambda ps: [{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3, "weight_decay": 0.0}]  # noqa: E731
    track = mode != "fp32"
    opt = PackedAdamW(groups(params), lr=1e-2, mode=mode, check_nonfinite=True, track_format=track)
    ref = PackedAdamW(groups(ref_params), lr=1e-2, mode=mode, check_nonfinite=True, track_format=track)
    for step in range(6):
        for i, (p, q) in enumerate(zip(params, ref_params)):
            g = torch.from_numpy(H.spanning_values(rng, p.numel(), -40, 6)).reshape(p.shape)
            if i % 3 == 1:
                g = g.to(BF16)
            set_grad(p, g.clone())
            set_grad(q, g.float())
        opt.step()
        ref.step()
        assert_matches_fp32_run(opt, params, ref, ref_params, f"{mode} three kinds step {step + 1}")
    if track:
        assert opt.format_stats() == ref.format_stats()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_functional_step_with_interleaved_kinds_adds_counts_to_the_callers_rows(mode):
    """adamw_step_ with launch kinds interleaved (not side by side): the kernel's counter rows
    are gathered per launch and added back to the caller's rows, as the CPU step counts."""
    from packed_adamw.core import launch

    fmt = StateFormat(mode)
    shapes = [(700,), (600,), (800,), (900,), (50,)]
    kinds = ["bf16", "fp32", "bf16", "fp32", "bf16"]
    results = {}
    for device in ("cpu", "cuda"):
        rng = np.random.default_rng(33)
        params, grads, lows = [], [], []
        for s, kind in zip(shapes, kinds):
            v = bf16_values(rng, math.prod(s), -8, 2).reshape(s)
            g = torch.from_numpy(H.spanning_values(rng, math.prod(s), -40, 6)).reshape(s)
            g[0] = float("nan")
            params.append((v if kind == "bf16" else v.float()).to(device))
            grads.append((g.to(BF16) if kind == "bf16" else g).to(device))
            lows.append(torch.full(s, 7, dtype=torch.int16, device=device) if kind == "bf16" else None)
        states = [new_state(p, fmt) for p in params]
        counters = torch.zeros((len(params), launch.COUNTER_ROW), dtype=torch.int64, device=device)
        rejected = adamw_step_(params, grads, states, [1] * 5, [(1e-2, 0.9, 0.999, 1e-8, 0.01)] * 5, fmt,
                               counters=counters, track_format=mode != "fp32", lows=lows)
        counts = launch.sum_counter_slots(counters.cpu().numpy())
        results[device] = (params, lows, states, rejected, counts)
    cpu, gpu = results["cpu"], results["cuda"]
    assert gpu[3] == cpu[3] == [1] * 5
    np.testing.assert_array_equal(gpu[4], cpu[4])
    for i in range(5):
        if kinds[i] == "bf16":
            assert_same16(gpu[0][i], cpu[0][i], f"weight {i}")
            assert_same16(gpu[1][i], cpu[1][i], f"low half {i}")
        else:
            H.assert_same_bits(gpu[0][i], cpu[0][i], f"param {i}")
        H.assert_same_bits(gpu[2][i], cpu[2][i], f"state {i}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_domain_rule_and_non_finite_gradients_are_rejected_like_cpu(mode):
    results = []
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(torch.zeros(3, dtype=BF16, device=device))
        opt = PackedAdamW([("big.weight", p)], lr=1e35, weight_decay=0.0, mode=mode, check_nonfinite=True)
        opt.load_master_weights([torch.tensor([formats.SPLIT_MASTER_MAX, 1.0, 2.0], device=device)])
        set_grad(p, torch.tensor([-1.0, float("nan"), 0.5], dtype=BF16))
        with pytest.raises(NonFiniteGradientError, match=r"'big.weight' \(2 of 3 elements\)"):
            opt.step()
        results.append((bits16(p), bits16(low_half(opt, p)), H.bits(H.state_tensor(opt, p))))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert results[1][0][0] == 0x7F7F


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_planned_steps_follow_swaps_and_dropped_gradients_like_the_fp32_run(mode):
    """Many planned steps (the relaunched kernels), a parameter whose gradient disappears and
    comes back, and a cleared state: the masters stay on the FP32 run."""
    cpu_params, ref_cpu = make_pair(34)
    params, ref_params = cuda_copy(cpu_params), cuda_copy(ref_cpu)
    opt, ref = PackedAdamW(params, lr=1e-2, mode=mode), PackedAdamW(ref_params, lr=1e-2, mode=mode)
    rng = np.random.default_rng(35)
    for step in range(12):
        feed(rng, params, ref_params, BF16 if step % 4 else F32)
        if step in (5, 6):
            params[1].grad = ref_params[1].grad = None
        if step == 9:
            opt.state.pop(params[0])
            ref.state.pop(ref_params[0])
            with torch.no_grad():  # a cleared state restarts the master at the bf16 value
                ref_params[0].copy_(params[0].float())
        opt.step()
        ref.step()
        assert_matches_fp32_run(opt, params, ref, ref_params, f"{mode} planned step {step + 1}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_captured_bf16_training_steps_replay_with_the_bits_of_plain_steps(mode):
    """capturable=True over a bf16 model plus an FP32 parameter (two launch kinds): warm-up
    steps on a side stream, a captured training step, replays under a changing lr tensor; the
    same gradients and lr values through plain (not capturable) steps give the same bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64)).cuda().to(BF16)
    scale = torch.nn.Parameter(torch.ones(64, device="cuda"))
    params = [*model.parameters(), scale]
    start = [p.detach().clone() for p in params]
    lr = torch.tensor(1e-2, device="cuda")
    opt = PackedAdamW(params, lr=lr, weight_decay=0.1, mode=mode, capturable=True)
    static_x = torch.randn(32, 64, device="cuda", dtype=BF16)
    recorded = []  # (gradients, lr) of every step

    def train_step():
        (model(static_x).float() * scale).pow(2).mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            train_step()
            recorded.append(([p.grad.clone() for p in params], float(lr)))
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    gen = torch.Generator(device="cuda").manual_seed(4)
    for value in (1e-2, 3e-3, 7e-4, 2e-3):
        lr.fill_(value)
        static_x.copy_(torch.randn(32, 64, device="cuda", generator=gen).to(BF16))
        graph.replay()
        recorded.append(([p.grad.clone() for p in params], float(lr)))
    plain_params = [torch.nn.Parameter(p.clone()) for p in start]
    plain = PackedAdamW(plain_params, lr=1e-2, weight_decay=0.1, mode=mode)
    for grads, value in recorded:
        for p, g in zip(plain_params, grads):
            p.grad = g.clone()
        plain.param_groups[0]["lr"] = value
        plain.step()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(params, plain_params)):
        if p.dtype is BF16:
            assert_same16(p, q, f"captured vs plain weight {i}")
            assert_same16(low_half(opt, p), low_half(plain, q), f"captured vs plain low half {i}")
        else:
            H.assert_same_bits(p, q, f"captured vs plain fp32 param {i}")
        H.assert_same_bits(H.state_tensor(opt, p), H.state_tensor(plain, q), f"captured vs plain state {i}")
    assert int(opt.state[scale]["step"]) == 7 and (bits16(params[0]) != bits16(start[0])).any()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_master_weights_and_load_master_weights_are_exact():
    rng = np.random.default_rng(36)
    p = torch.nn.Parameter(torch.zeros(4001, dtype=BF16, device="cuda"))
    opt = PackedAdamW([p], lr=1e-2)
    master = torch.from_numpy(master_values(rng, 4001)).cuda()
    opt.load_master_weights([master])
    out = opt.master_weights()[0]
    assert out.is_cuda and out.dtype == F32
    H.assert_same_bits(out, master, "cuda masters")
    set_grad(p, torch.randn(4001, dtype=BF16))
    opt.step()
    assert_nearest_bf16(p, joined(opt, p), "after a cuda step")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_fsdp2_bf16_on_one_rank_equals_the_plain_step_and_resumes(tmp_path):
    """The bf16 DTensor path with the compiled split kernels (NCCL, world size 1)."""
    from torchrun_helpers import torchrun

    scenarios = TESTS / "distributed_scenarios.py"
    torchrun(1, scenarios, "fsdp_bf16", str(tmp_path), timeout_s=300, extra_env={"SCENARIO_DEVICE": "cuda"})
    torchrun(1, scenarios, "fsdp_bf16_resume", str(tmp_path), "1", timeout_s=300,
             extra_env={"SCENARIO_DEVICE": "cuda"})


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_a_bf16_weight_zeroed_outside_the_optimizer_keeps_learning(mode):
    """p.mul_(mask) pruning or p.zero_() after some steps leaves the old low halves beside
    zero weights. Those whose low half is negative would join to NaN masters (rejected
    forever, the weight frozen at zero); they read as the zero instead, and the others as
    masters below 2**-133 (FORMAT.md, "Writes to the weight"). From there the run follows an
    FP32 run started at the masters the zeroed pairs read."""
    torch.manual_seed(3)
    init = torch.randn(4000) * 0.05
    bf16 = torch.nn.Parameter(init.to(torch.bfloat16))
    fp32 = torch.nn.Parameter(bf16.detach().float())
    opts = [PackedAdamW([p], lr=1e-2, weight_decay=0.1, mode=mode, check_nonfinite=True) for p in (bf16, fp32)]
    mask = torch.rand(4000) < 0.5
    for step in range(6):
        grad = torch.randn(4000) * 1e-2
        bf16.grad, fp32.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
        for opt in opts:
            opt.step()
        if step == 2:
            with torch.no_grad():
                bf16.mul_(mask)  # -0.0 on negative weights
                read = opts[0].master_weights()[0]
                assert not read.isnan().any() and (read[~mask].abs() < 2.0**-133).all()
                assert (read[~mask & (opts[0].state[bf16]["lo"] < 0)].view(torch.int32) & 0x7FFFFFFF == 0).all()
                fp32.copy_(read)
            assert (opts[0].state[bf16]["lo"][~mask] < 0).any()
        master = opts[0].master_weights()[0]
        assert not master.isnan().any()
        assert torch.equal(master.view(torch.int32), fp32.detach().view(torch.int32)), f"step {step}"
    assert (bf16.detach()[~mask] != 0).all()  # the zeroed weights moved again
