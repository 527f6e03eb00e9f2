"""`PackedAdamW` on CUDA: the compiled kernel against the CPU step, bit for bit.

Skipped unless torch sees a CUDA device. The CPU optimizer (numpy step) is itself checked
against the scalar authority in test_torch_optimizer.py, so CUDA == CPU on every bit here
carries that result over to the kernel, in every mode, one launch per tensor and multi-tensor.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_helpers as H
from packed_adamw.core import StateFormat
from packed_adamw.torch import NonFiniteGradientError, PackedAdamW, _launch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODES = H.MODES
LAUNCHES = [pytest.param(True, id="multi_tensor"), pytest.param(False, id="per_tensor")]



def _pair(params_cpu):
    """CUDA copies of CPU parameters (same bits)."""
    return [torch.nn.Parameter(p.detach().clone().cuda()) for p in params_cpu]


def _set_same_grads(cpu_params, cuda_params, grads):
    for p, q, g in zip(cpu_params, cuda_params, grads):
        p.grad = g.clone()
        q.grad = g.cuda()


def _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, what):
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(cpu_params, cuda_params)):
        H.assert_same_bits(q, p, f"{what}: param {i}")
        H.assert_same_bits(H.state_tensor(cuda_opt, q), H.state_tensor(cpu_opt, p), f"{what}: state {i}")
        assert int(cuda_opt.state[q]["step"]) == int(cpu_opt.state[p]["step"])


@pytest.mark.parametrize("multi_tensor", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_equals_cpu_bit_for_bit_on_a_small_model(mode, multi_tensor):
    """Ten steps on an MLP's parameters (2 groups, changing lr), gradients of widely varying
    scale fed identically to both devices."""
    cpu_params = list(H.small_mlp(width=96).parameters())
    cuda_params = _pair(cpu_params)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]  # noqa: E731
    cpu_opt = PackedAdamW(groups(cpu_params), lr=1e-2, mode=mode)
    cuda_opt = PackedAdamW(groups(cuda_params), lr=1e-2, mode=mode, multi_tensor=multi_tensor)
    rng = np.random.default_rng(0)
    for step in range(10):
        grads = [torch.from_numpy(H.spanning_values(rng, p.numel(), -40, 8)).reshape(p.shape) for p in cpu_params]
        _set_same_grads(cpu_params, cuda_params, grads)
        for opt in (cpu_opt, cuda_opt):
            opt.param_groups[0]["lr"] = 1e-2 / (1 + step)
            opt.step()
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, f"{mode} small model")
    if multi_tensor and _launch._triton_version() in _launch._Relaunch.CHECKED_TRITON:
        # The later steps went through the plan's kept launches (StepPlan.launches), not launch_step.
        assert any(cuda_opt._plan.launches.values())


def test_cuda_kept_launches_give_way_to_unaligned_gradients_and_format_counts_like_cpu(monkeypatch):
    """A plan keeps its launches per staging slot (`StepPlan.launches`; 4 slots: kept at steps 0
    to 3, taken at step 4). A step that must not take them launches through `launch_step`: a
    gradient 4 bytes off the 16-byte alignment the kept launch of its slot was compiled for
    (step 5), format counts switched on (step 8: a new plan, which keeps its counters). Counts off
    again, that plan keeps launches too (steps 9 to 12) and takes them at step 13. The CUDA run
    equals the CPU run throughout."""
    launches_made = []
    real_launch_step = _launch.launch_step

    def counted_launch_step(*args, **kwargs):
        launches_made.append(len(launches_made))
        return real_launch_step(*args, **kwargs)

    monkeypatch.setattr(_launch, "launch_step", counted_launch_step)
    cpu_params = list(H.small_mlp(width=40).parameters())
    cuda_params = _pair(cpu_params)
    cpu_opt, cuda_opt = PackedAdamW(cpu_params, lr=1e-2), PackedAdamW(cuda_params, lr=1e-2)
    rng = np.random.default_rng(5)
    kept = _launch._triton_version() in _launch._Relaunch.CHECKED_TRITON  # else every step launches anew
    for step in range(14):
        grads = [torch.from_numpy(H.spanning_values(rng, p.numel(), -30, 4)).reshape(p.shape) for p in cpu_params]
        _set_same_grads(cpu_params, cuda_params, grads)
        if step == 5:  # the first gradient at an address 4 bytes past a 16-byte boundary
            g = grads[0].cuda()
            cuda_params[0].grad = torch.empty(g.numel() + 1, device="cuda")[1:].view(g.shape).copy_(g)
            assert cuda_params[0].grad.data_ptr() % 16
        before = len(launches_made)
        for opt in (cpu_opt, cuda_opt):
            opt.track_format = step == 8
            opt.step()
        if kept and step in (4, 5, 13):  # step 13: the counters' plan, counts off, takes its kept launch
            assert len(launches_made) - before == (1 if step == 5 else 0), f"step {step}"
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, "kept launches and the steps beside them")


@pytest.mark.parametrize("mode", MODES)
def test_cuda_tensors_launched_on_their_own_beside_the_shared_launch_equal_cpu(mode, monkeypatch):
    """Tensors of at least launch.SOLO_ELEMENTS get their own launch; lowered here so that a
    small model mixes both kinds in every step, with check_nonfinite's counters on."""
    from packed_adamw.core import launch

    monkeypatch.setattr(launch, "SOLO_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(3)
    cpu_params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5000,), (300,), (3001,), (17, 13), ()]]
    cuda_params = _pair(cpu_params)
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}]  # noqa: E731
    cpu_opt = PackedAdamW(groups(cpu_params), lr=1e-2, mode=mode)
    cuda_opt = PackedAdamW(groups(cuda_params), lr=1e-2, mode=mode, check_nonfinite=True)
    rng = np.random.default_rng(1)
    for _ in range(6):
        grads = [torch.from_numpy(H.spanning_values(rng, p.numel(), -40, 8)).reshape(p.shape) for p in cpu_params]
        _set_same_grads(cpu_params, cuda_params, grads)
        cpu_opt.step()
        cuda_opt.step()
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, f"{mode} solo and shared launches")


@pytest.mark.parametrize("mode", MODES)
def test_cuda_steps_that_reuse_the_plan_follow_every_change_like_cpu(mode):
    """Parameter storage swapped, gradients dropped, state cleared, a group added, a state_dict
    loaded: the CUDA run, whose later steps reuse a plan of addresses, equals the CPU run."""
    from test_torch_optimizer import make_params, plan_events

    runs = []
    for device in ("cpu", "cuda"):
        params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(0)]
        extra = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(5, shapes=((40,), (3, 3)))]
        opt = PackedAdamW(params, lr=1e-3, mode=mode)
        plan_events(opt, params, extra)
        torch.cuda.synchronize()
        runs.append(H.snapshot(opt, params + extra))
    H.assert_same_snapshot(runs[1], runs[0], "CUDA vs CPU through plan changes")


def test_cuda_planned_steps_on_changing_streams_with_more_groups_than_stepping_params_equal_cpu():
    """The plan's staging buffers are reused in turn (more steps than buffers, each step on
    another stream, none synchronized) and hold one scalar row per group: five groups with
    different learning rates, of which two parameters have gradients."""
    rng = np.random.default_rng(31)
    values = [H.spanning_values(rng, n, -20, 2) for n in (5000, 300, 70, 1, 9)]
    cpu_params = [torch.nn.Parameter(torch.from_numpy(v)) for v in values]
    cuda_params = _pair(cpu_params)
    groups = lambda ps: [{"params": [p], "lr": 1e-3 * (i + 1)} for i, p in enumerate(ps)]  # noqa: E731
    cpu_opt, cuda_opt = PackedAdamW(groups(cpu_params)), PackedAdamW(groups(cuda_params))
    streams = [torch.cuda.Stream() for _ in range(3)]
    for step in range(11):
        stepping = [0, 3] if step else [0, 1, 2, 3, 4]  # every state exists; then two of five step
        for i in range(5):
            cpu_params[i].grad = cuda_params[i].grad = None
        grads = {i: torch.from_numpy(H.spanning_values(rng, values[i].size, -30, 0)) for i in stepping}
        _set_same_grads([cpu_params[i] for i in stepping], [cuda_params[i] for i in stepping], list(grads.values()))
        cpu_opt.step()
        stream = streams[step % 3]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            cuda_opt.step()
        torch.cuda.current_stream().wait_stream(stream)
    assert cuda_opt._plan is not None
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, "planned steps on changing streams")


@pytest.mark.parametrize("mode", MODES)
def test_cuda_equals_cpu_bit_for_bit_on_a_10m_element_tensor(mode):
    n = 10_000_019  # not a multiple of any block size
    rng = np.random.default_rng(1)
    values = H.spanning_values(rng, n, -30, 8)
    cpu_params = [torch.nn.Parameter(torch.from_numpy(values))]
    cuda_params = _pair(cpu_params)
    cpu_opt = PackedAdamW(cpu_params, lr=1e-2, mode=mode)
    cuda_opt = PackedAdamW(cuda_params, lr=1e-2, mode=mode)
    grads = [torch.from_numpy(H.spanning_values(rng, n, -45, 20)) for _ in range(3)]
    for step in range(10):
        _set_same_grads(cpu_params, cuda_params, [grads[step % 3]])
        cpu_opt.step()
        cuda_opt.step()
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, f"{mode} 10M elements")


@pytest.mark.parametrize("mode", MODES)
def test_cuda_keeps_a_negative_zero_parameter_whose_update_is_zero(mode):
    cpu_params = [torch.nn.Parameter(torch.full((1024,), -0.0))]
    cuda_params = _pair(cpu_params)
    cpu_opt = PackedAdamW(cpu_params, mode=mode)
    cuda_opt = PackedAdamW(cuda_params, mode=mode)
    _set_same_grads(cpu_params, cuda_params, [torch.zeros(1024)])
    cpu_opt.step()
    cuda_opt.step()
    assert (H.bits(cpu_params[0]) == 0x80000000).all()  # the authority's answer (test_torch_optimizer)
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, f"{mode} -0.0 params")


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_saved_on_cuda_loads_on_cpu_and_continues_bit_for_bit(mode, tmp_path):
    model = H.small_mlp().cuda()
    opt = PackedAdamW(model.parameters(), lr=1e-2, mode=mode)
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(6)]
    for step in range(3):
        for p, g in zip(model.parameters(), grads[step]):
            p.grad = g.cuda()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "cuda.pt")
    for step in range(3, 6):
        for p, g in zip(model.parameters(), grads[step]):
            p.grad = g.cuda()
        opt.step()

    saved = torch.load(tmp_path / "cuda.pt", weights_only=True, map_location="cpu")
    cpu_model = H.small_mlp()
    cpu_model.load_state_dict(saved["model"])
    cpu_opt = PackedAdamW(cpu_model.parameters(), lr=1e-2, mode=mode)
    cpu_opt.load_state_dict(saved["optimizer"])
    for step in range(3, 6):
        for p, g in zip(cpu_model.parameters(), grads[step]):
            p.grad = g.clone()
        cpu_opt.step()
    _assert_runs_equal(cpu_opt, list(cpu_model.parameters()), opt, list(model.parameters()), "CUDA -> CPU")


@pytest.mark.parametrize("multi_tensor", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_state_bytes_measured_by_the_allocator(mode, multi_tensor):
    """memory_allocated() grows by exactly the state on the first step (4 bytes/param packed
    and fp16, 8 in fp32) and not at all on later steps: the per-step scratch (hparam row,
    counts, rejected counters, pointers) is freed by the end of step(). Every tensor has a
    multiple of 128 elements, so each state tensor is a whole number of the caching
    allocator's 512-byte blocks. The multi-tensor launch keeps a block table per set of sizes
    (lru_cache); a throwaway optimizer over same-sized tensors builds it first. Its step plan
    keeps small staging buffers, counted below."""
    shapes = [(1 << 20,), (384, 128), (128,)]
    n = sum(int(np.prod(s)) for s in shapes)

    def fresh():
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        return params, PackedAdamW(params, mode=mode, multi_tensor=multi_tensor)

    warm_params, warm_opt = fresh()
    warm_opt.step()
    del warm_params, warm_opt
    params, opt = fresh()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    after_first = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    after_second = torch.cuda.memory_allocated()
    per_param = 8 if mode == "fp32" else 4
    # The multi-tensor plan keeps its staging buffers (addresses and scalar rows: a few hundred
    # bytes per step in flight), each a whole number of the allocator's 512-byte blocks.
    staging = sum(-(-b.untyped_storage().nbytes() // 512) * 512 for b in opt._plan.staging.device) if multi_tensor else 0
    assert staging <= 4 * 512
    assert after_first - before == per_param * n + staging, f"first step allocated {after_first - before} bytes for {n} params"
    assert after_second == after_first
    assert sum(H.state_tensor(opt, p).nbytes for p in params) == per_param * n


@pytest.mark.parametrize("multi_tensor", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_non_finite_gradients_raise_and_store_nothing_non_finite(mode, multi_tensor):
    gen = torch.Generator().manual_seed(0)
    cpu_params = [torch.nn.Parameter(torch.randn(4096, generator=gen)), torch.nn.Parameter(torch.randn(7, generator=gen))]
    cuda_params = _pair(cpu_params)
    cpu_opt = PackedAdamW([("w", cpu_params[0]), ("b", cpu_params[1])], mode=mode)
    cuda_opt = PackedAdamW([("w", cuda_params[0]), ("b", cuda_params[1])], mode=mode, multi_tensor=multi_tensor)
    _set_same_grads(cpu_params, cuda_params, [torch.randn(p.shape, generator=gen) for p in cpu_params])
    cpu_opt.step()
    cuda_opt.step()
    bad = torch.tensor([0, 1000, 4095])
    grad = torch.randn(4096, generator=gen)
    grad[bad] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    _set_same_grads(cpu_params, cuda_params, [grad, torch.randn(7, generator=gen)])
    before = H.bits(cuda_params[0])
    for opt in (cpu_opt, cuda_opt):
        opt.check_nonfinite = True
        with pytest.raises(NonFiniteGradientError, match=r"'w' \(3 of 4096 elements\)"):
            opt.step()
    H.assert_state_finite(cuda_opt, cuda_params, "CUDA after NaN/Inf gradients")
    assert np.array_equal(H.bits(cuda_params[0])[bad.numpy()], before[bad.numpy()])
    _assert_runs_equal(cpu_opt, cpu_params, cuda_opt, cuda_params, f"{mode} non-finite step")


def test_cuda_check_nonfinite_false_does_not_raise_but_still_rejects():
    p = torch.nn.Parameter(torch.randn(1000, device="cuda"))
    opt = PackedAdamW([p], check_nonfinite=False)
    p.grad = torch.randn_like(p)
    p.grad[5] = float("nan")
    before = H.bits(p)
    opt.step()
    after = H.bits(p)
    assert after[5] == before[5] and (np.delete(after, 5) != np.delete(before, 5)).all()


@pytest.mark.parametrize("mode", MODES)
def test_cuda_grad_scaler_skips_an_inf_step(mode):
    model = H.small_mlp().cuda()
    x, y = (t.cuda() for t in H.mlp_batch())
    opt = PackedAdamW(model.parameters(), lr=1e-2, mode=mode)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    params = list(model.parameters())
    for step in range(3):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        if step == 1:
            params[0].grad[0, 0] = float("inf")
            before = H.snapshot(opt, params)
        else:
            moved_from = H.bits(params[0])
        scaler.step(opt)
        scaler.update()
        torch.cuda.synchronize()
        if step == 1:
            H.assert_same_snapshot(H.snapshot(opt, params), before, "the scaler's skipped step")
            assert scaler.get_scale() == 2.0**9
        else:
            assert not np.array_equal(H.bits(params[0]), moved_from)
    assert [int(opt.state[p]["step"]) for p in params] == [2] * len(params)


def test_params_on_cpu_and_cuda_are_refused():
    with pytest.raises(ValueError, match="several devices.*one optimizer per device"):
        PackedAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))]},
                     {"params": [torch.nn.Parameter(torch.zeros(3, device="cuda"))]}])


def test_cuda_format_identity_matches_cpu():
    for mode in MODES:
        assert PackedAdamW([torch.nn.Parameter(torch.zeros(1, device="cuda"))], mode=mode).state_dict()[
            "packed_adamw"]["format"] == StateFormat(mode).identity


def test_cuda_state_left_on_another_device_is_refused_before_anything_changes():
    """Moving the model after a CPU step leaves the words on the CPU: the kernel must never see
    a host address."""
    p = torch.nn.Parameter(torch.randn(1000))
    opt = PackedAdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = p.data.cuda()
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="optimizer state is on cpu"):
        opt.step()
    assert opt.state[p]["step"] == 1


@pytest.mark.parametrize("multi_tensor", [True, False])
def test_cuda_empty_parameters_are_stepped_without_a_launch(multi_tensor):
    only_empty = [torch.nn.Parameter(torch.zeros(0, device="cuda"))]
    only_empty[0].grad = torch.zeros(0, device="cuda")
    PackedAdamW(only_empty, multi_tensor=multi_tensor).step()
    mixed = [torch.nn.Parameter(torch.zeros(0, device="cuda")), torch.nn.Parameter(torch.ones(300, device="cuda"))]
    for p in mixed:
        p.grad = torch.ones_like(p)
    PackedAdamW(mixed, multi_tensor=multi_tensor).step()
    assert torch.isfinite(mixed[1]).all() and not torch.equal(mixed[1], torch.ones(300, device="cuda"))
