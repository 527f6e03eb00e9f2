"""`capturable=True` for PackedMuon and PackedMuonAdamW (docs/MUON.md, "Capturable steps (CUDA
graphs)"): the step scalars derived on the device from lr tensors, with the eager step's bits;
on CUDA a captured training step replays with the bits of eager steps.

On the CPU the kernel path runs in Triton's interpreter (the step's code, not a capture); the
`cuda` tests capture."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from muon_helpers import bits, cuda_only, gradient, taking_fp32_gradients
from packed_adamw.torch import PackedMuon, PackedMuonAdamW
from packed_adamw.torch import muon as torch_muon
from packed_adamw.torch import _muon_ns as torch_muon_ns
from test_torch_cuda_graphs import warm_up_and_capture

SHAPES = [(6, 10), (10, 6), (6, 10), (7, 7), (12, 5)]
LRS = [0.03, 0.011, 0.0, 0.07, 0.023]  # one per step; lr 0 too


def matrices(rng, device, dtype=torch.float32):
    p0 = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
    return [taking_fp32_gradients(torch.nn.Parameter(p.to(dtype).to(device).clone())) for p in p0]


def groups(params, lr):
    """Two groups: the second with its own lr (a float64 tensor when `lr` is a tensor), weight
    decay, momentum and lr adjustment."""
    second_lr = lr.double() * 0.5 if isinstance(lr, torch.Tensor) else lr * 0.5
    return [{"params": params[:3], "lr": lr},
            {"params": params[3:], "lr": second_lr, "weight_decay": 0.02, "momentum": 0.9,
             "adjust_lr_fn": "match_rms_adamw", "nesterov": False}]


def assert_same(params_a, opt_a, params_b, opt_b, what: str) -> None:
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        assert torch.equal(bits(p), bits(q)), f"{what}: matrix {i}'s weights"
        assert opt_a.state[p].keys() == opt_b.state[q].keys(), what
        for key, value in opt_a.state[p].items():
            assert torch.equal(bits(value), bits(opt_b.state[q][key])), f"{what}: matrix {i}'s {key!r}"


def step_both(rng, a, opt_a, b, opt_b) -> None:
    """One step of each optimizer, its matrices given the same random gradients."""
    for p, q, g in zip(a, b, [gradient(rng, s, -10, -2) for s in SHAPES]):
        p.grad, q.grad = g.clone(), g.clone()
    opt_a.step()
    opt_b.step()


@pytest.fixture
def kernels_on_cpu(is_interpreting, monkeypatch):
    if not is_interpreting:
        pytest.skip("runs the CUDA step's code on CPU tensors: needs TRITON_INTERPRET=1")
    monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: True)


@pytest.mark.parametrize("batch_ns, dtype, limit", [(False, torch.float32, None), (True, torch.bfloat16, None),
                                                    (True, torch.float32, 120)])
def test_capturable_steps_equal_eager_steps_as_the_lr_changes(batch_ns, dtype, limit, kernels_on_cpu, monkeypatch):
    """The device-derived scalar rows against the host's (float32 and float64 lr tensors, two
    lr adjustments, lr 0), through the kernel path, per matrix and batched (with the batch limit
    at 120 elements the (6, 10)-wide batch of three runs in two parts: the address table's)."""
    if limit is not None:
        monkeypatch.setattr(torch_muon_ns, "NS_BATCH_ELEMENTS", limit)
    rng = np.random.default_rng(5)
    a, b = matrices(rng, "cpu", dtype), matrices(np.random.default_rng(5), "cpu", dtype)
    eager = PackedMuon(groups(a, 0.03), lr=0.03, batch_ns=batch_ns)
    lr = torch.tensor(0.03)
    cap = PackedMuon(groups(b, lr), lr=lr, batch_ns=batch_ns, capturable=True)
    for value in LRS:
        # The eager run takes the tensors' values as floats: the host's rows of the same numbers.
        for group, cap_group in zip(eager.param_groups, cap.param_groups):
            cap_group["lr"].fill_(value if cap_group["lr"].dtype == torch.float32 else value * 0.5)
            group["lr"] = float(cap_group["lr"])
        step_both(rng, a, eager, b, cap)
    assert_same(a, eager, b, cap, "capturable vs eager")


@pytest.mark.parametrize("bad, weight_decay", [(float("nan"), 0.02), (float("inf"), 0.02), (-1e-3, 0.02),
                                               (1e38, 4.0)])
def test_an_invalid_lr_refuses_its_groups_matrices_on_the_device(bad, weight_decay, kernels_on_cpu):
    """An lr the host would refuse (NaN, Inf, negative, or lr * weight_decay past float32's
    range) cannot raise on the device: its group's matrices keep weights and momentum, the
    other group steps as an eager optimizer does."""
    rng = np.random.default_rng(7)
    a, b = matrices(rng, "cpu"), matrices(np.random.default_rng(7), "cpu")
    lr = torch.tensor(0.03)
    eager = PackedMuon(groups(a, float(lr)), lr=float(lr))
    cap = PackedMuon(groups(b, lr), lr=lr, capturable=True)
    for step in range(2):
        grads = [gradient(rng, s, -10, -2) for s in SHAPES]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 1:
            cap.param_groups[1]["lr"].fill_(bad)
            cap.param_groups[1]["weight_decay"] = weight_decay
            before = [(q.detach().clone(), {k: v.clone() for k, v in cap.state[q].items()}) for q in b[3:]]
            for p in a[3:]:
                p.grad = None  # the eager twin steps the first group only
        eager.step()
        cap.step()
    assert_same(a[:3], eager, b[:3], cap, "the group with a valid lr")
    for q, (weights, state) in zip(b[3:], before):
        assert torch.equal(bits(q), bits(weights)), f"lr={bad}: a refused matrix's weights changed"
        for key, value in state.items():
            assert torch.equal(bits(cap.state[q][key]), bits(value)), f"lr={bad}: a refused matrix's {key!r} changed"


def test_capturable_refusals_name_what_to_do(kernels_on_cpu, monkeypatch):
    rng = np.random.default_rng(9)
    params = matrices(rng, "cpu")
    with pytest.raises(ValueError, match=r"lr as a one-element floating tensor"):
        PackedMuon(params, lr=0.02, capturable=True)
    with pytest.raises(ValueError, match=r"check_nonfinite=False"):
        PackedMuon(params, lr=torch.tensor(0.02), capturable=True, check_nonfinite=True)
    with pytest.raises(ValueError, match=r"adamw_lr as a one-element tensor"):
        PackedMuonAdamW([{"params": params, "kind": "muon"}], lr=torch.tensor(0.02), capturable=True)
    opt = PackedMuon([{"params": params[:2]}, {"params": params[2:], "lr": torch.tensor(0.01, dtype=torch.float64)}],
                     lr=torch.tensor(0.02), capturable=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(opt.state) == len(params)
    assert copy.deepcopy(opt).capturable
    combined = PackedMuonAdamW([{"params": params, "kind": "muon"}], lr=torch.tensor(0.02),
                               adamw_lr=torch.tensor(1e-3), capturable=True)
    from packed_adamw.torch import _checks

    with monkeypatch.context() as m:  # a capture before the first step: the refusal names the optimizer built
        m.setattr(_checks, "capturing", lambda: True)
        with pytest.raises(RuntimeError, match=r"^PackedMuonAdamW\(capturable=True\) under a CUDA graph capture: "
                                               r"a matrix has no state yet"):
            combined.step()
    monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: False)  # the real CPU path
    with pytest.raises(ValueError, match=r"runs the step on a CUDA device.*use capturable=False"):
        opt.step()


def test_combined_capturable_steps_equal_eager_steps(kernels_on_cpu):
    """PackedMuonAdamW(capturable=True) on the CPU: Muon's kernel path (interpreted) with device
    rows; AdamW's capturable plan needs CUDA, so its groups stay out of this test (the cuda test
    below has both)."""
    rng = np.random.default_rng(11)
    a, b = matrices(rng, "cpu", torch.bfloat16), matrices(np.random.default_rng(11), "cpu", torch.bfloat16)
    eager = PackedMuonAdamW([{"params": a, "kind": "muon"}], lr=0.02, batch_ns=True)
    lr = torch.tensor(0.02)
    cap = PackedMuonAdamW([{"params": b, "kind": "muon"}], lr=lr, adamw_lr=torch.tensor(1e-3), batch_ns=True,
                          capturable=True)
    assert cap.param_groups[0]["lr"] is lr  # the first group holds the tensor given (later ones: copies)
    for value in (0.02, 0.005):
        cap.param_groups[0]["lr"].fill_(value)
        eager.param_groups[0]["lr"] = float(cap.param_groups[0]["lr"])
        step_both(rng, a, eager, b, cap)
    assert_same(a, eager, b, cap, "combined capturable vs eager")


@pytest.mark.parametrize("where", ["interpreted", pytest.param("cuda", marks=[pytest.mark.cuda, cuda_only])])
def test_device_scalar_rows_are_the_hosts_bit_for_bit(where, is_interpreting, monkeypatch):
    """The rows themselves (a one-ulp error in a scalar rarely changes a float32 weight, so the
    step comparisons above would miss it), from core's scalar kernel in one launch per case,
    each lr a group of every shape: float32, float64, bf16 and fp16 lr tensors, values a float32
    cannot hold, both adjustments, tall and wide shapes, and the validity of each lr as the
    host's validation judges it, the counters' other columns zeroed."""
    from packed_adamw.core.muon import adjusted_lr, step_scalar_row, validate_hyperparams
    from packed_adamw.torch import _muon_capturable

    if where == "interpreted" and not is_interpreting:
        pytest.skip("the kernel on CPU tensors needs TRITON_INTERPRET=1")
    empty = torch.empty

    def poisoned(*args, dtype=None, **kwargs):  # new outputs hold no zeros the kernel could leave
        return empty(*args, dtype=dtype, **kwargs).fill_(-1 if dtype in (torch.int32, torch.int64) else float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)
    device = torch.device("cpu" if where == "interpreted" else "cuda")
    rng = np.random.default_rng(13)
    shapes = [(6, 10), (10, 6), (768, 3072), (3072, 768), (1, 50257)]
    lrs = [0.0, -0.0, 0.02, 1 / 3, 3e-4 * (1 + 2**-40), 1e-38, 3.4e38, 3.5e38, -1e-3, float("nan"), float("inf"),
           *(10.0 ** rng.uniform(-8, 1, 40))]
    group_of = [g for g in range(len(lrs)) for _ in shapes]
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        groups = [{"lr": torch.tensor(value, dtype=dtype, device=device)} for value in lrs]
        for momentum, weight_decay in ((0.95, 0.1), (0.85, 0.0), (1 / 3, 7.7), (0.0, 1e38)):
            for fn in (None, "original", "match_rms_adamw"):
                fixed = [(momentum, weight_decay, adjusted_lr(1.0, shape, fn)) for _ in lrs for shape in shapes]
                plan = _muon_capturable.DevicePlan(None, group_of, fixed, device)
                scalars, counters = (t.cpu() for t in plan.scalars_and_counters(groups))
                assert not counters[:, 1:].any()  # written: the outputs start as -1 and NaN (`poisoned`)
                for g, group in enumerate(groups):
                    lr = float(group["lr"])
                    try:
                        validate_hyperparams(lr, momentum, weight_decay, 1e-7)
                        valid = True
                    except ValueError:
                        valid = False
                    rows = slice(g * len(shapes), (g + 1) * len(shapes))
                    assert counters[rows, 0].tolist() == [0 if valid else 1] * len(shapes), (lr, dtype, weight_decay)
                    if not valid:
                        continue
                    for shape, row in zip(shapes, scalars[rows]):
                        want = np.array(step_scalar_row((lr, momentum, weight_decay, 1e-7), shape,
                                                        adjust_lr_fn=fn), np.float32)
                        assert np.array_equal(row.numpy().view(np.uint32), want.view(np.uint32)), (lr, dtype, shape)


def test_a_capturable_step_checks_every_groups_lr_and_takes_numbers_for_the_rest(kernels_on_cpu):
    """A group without gradients still needs its lr tensor (the rows are derived for every
    group); momentum, weight_decay and eps must be numbers; nothing changes before the refusal.
    Groups that take the default lr get a clone each, so a scheduler sets them apart."""
    rng = np.random.default_rng(17)
    params = matrices(rng, "cpu")
    opt = PackedMuon([{"params": params[:2]}, {"params": params[2:]}], lr=torch.tensor(0.02), capturable=True)
    assert opt.param_groups[0]["lr"] is not opt.param_groups[1]["lr"]
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, [lambda step: 1.0, lambda step: 0.1])
    schedule.step()
    assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([0.02, 0.002])
    opt.param_groups[1]["lr"] = 0.01
    for p in params[:2]:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\] is 0.01: capturable=True needs"):
        opt.step()
    assert not opt.state
    opt.param_groups[1]["lr"] = torch.tensor(0.01)
    opt.param_groups[0]["momentum"] = torch.tensor(0.9)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['momentum'\] is a tensor: capturable=True reads only lr"):
        opt.step()
    assert not opt.state
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert len(opt.state) == 2


# ---- CUDA graphs ---------------------------------------------------------------------------------
class Net(torch.nn.Module):
    """Three block matrices (two of one shape, one tall) between an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 48)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(48, 48, bias=False) for _ in range(2)])
        self.up = torch.nn.Linear(48, 96, bias=False)
        self.down = torch.nn.Linear(96, 48, bias=False)
        self.norm = torch.nn.LayerNorm(48)
        self.head = torch.nn.Linear(48, 32, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(self.norm(x)).float().logsumexp(-1).mean()


def combined(net, capturable: bool, **options):
    muon_params = [*net.blocks.parameters(), net.up.weight, net.down.weight]
    others = [p for p in net.parameters() if all(p is not q for q in muon_params)]
    lr = torch.tensor(0.02, device="cuda") if capturable else 0.02
    adamw_lr = torch.tensor(3e-3, device="cuda") if capturable else 3e-3
    return PackedMuonAdamW([{"params": muon_params, "kind": "muon"}, {"params": others, "kind": "adamw"}],
                           lr=lr, adamw_lr=adamw_lr, capturable=capturable, **options)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [dict(ns_impl="cublas", batch_ns=False), dict(ns_impl="cublas", batch_ns=True),
                                     dict(), dict(mode="fp32")],
                         ids=["cublas-per-matrix", "cublas-batch_ns", "defaults", "fp32"])
def test_cuda_captured_training_steps_replay_with_the_bits_of_eager_steps(dtype, options):
    """A training step (forward, backward, PackedMuonAdamW's step) warmed up, captured, then
    replayed on new tokens while a scheduler changes both rules' lr tensors; an eager
    non-capturable optimizer given the same gradients and lrs ends with the same bits."""
    torch.manual_seed(0)
    net = Net().cuda().to(dtype)
    start = copy.deepcopy(net)
    opt = combined(net, True, **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    tokens = torch.randint(0, 32, (8, 16), device="cuda")

    def train_step():
        net(tokens).backward()
        opt.step()

    seen = []  # (gradients, each group's lr) of every step that ran
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            lrs = [float(g["lr"]) for g in opt.param_groups]
            train_step()
            seen.append(([p.grad.clone() for p in net.parameters()], lrs))
    torch.cuda.current_stream().wait_stream(side)
    # torch's recipe: the capture's backward allocates the gradients anew (another address than
    # the warm-up's, which the batched step's table must follow).
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    for _ in range(4):
        tokens.copy_(torch.randint(0, 32, (8, 16), device="cuda"))
        opt.zero_grad(set_to_none=False)  # outside the graph: the backward accumulates into .grad
        lrs = [float(g["lr"]) for g in opt.param_groups]
        graph.replay()
        seen.append(([p.grad.clone() for p in net.parameters()], lrs))
        schedule.step()
    torch.cuda.synchronize()

    eager = combined(start, False, **options)
    for grads, lrs in seen:
        for p, g in zip(start.parameters(), grads):
            p.grad = g.clone()
        for group, lr in zip(eager.param_groups, lrs):
            group["lr"] = lr
        eager.step()
    torch.cuda.synchronize()
    for (name, p), q in zip(net.named_parameters(), start.parameters()):
        assert torch.equal(bits(p), bits(q)), f"{name}: replayed weights differ from eager ones"
        for key, value in opt.state[p].items():
            if key != "step":
                assert torch.equal(bits(value), bits(eager.state[q][key])), f"{name}: {key!r} differs"
    assert len(seen) == 6 and seen[-1][1][0] < seen[2][1][0]  # the scheduler reached the graph


@pytest.mark.cuda
@cuda_only
def test_cuda_capture_without_an_eager_step_or_after_a_change_is_refused():
    torch.manual_seed(1)
    net = Net().cuda()
    opt = combined(net, True)
    net(torch.randint(0, 32, (4, 8), device="cuda")).backward()
    with pytest.raises(RuntimeError, match=r"take one eager step first|its first step|\(re\)build its plan"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()
    built = PackedMuon([net.up.weight], lr=0.02)
    with pytest.raises(RuntimeError, match=r"built without capturable=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            built.step()


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("options", [dict(ns_impl="cublas", batch_ns=False), dict()],
                         ids=["cublas-per-matrix", "defaults"])
def test_cuda_eager_steps_after_a_capture_leave_its_replays_on_the_captured_gradients(options):
    """A capture of the gradients its warm-up stepped reads the eager address table in place;
    eager steps afterwards on gradients elsewhere (new tables) and an lr changed in place must
    leave the replays stepping the captured gradients at the current lr: bits against a plain
    optimizer given the same sequence."""
    rng = np.random.default_rng(19)
    a, b = matrices(rng, "cuda"), matrices(np.random.default_rng(19), "cuda")
    plain = PackedMuon(a, lr=0.02, **options)
    cap = PackedMuon(b, lr=torch.tensor(0.02, device="cuda"), capturable=True, **options)
    captured = [gradient(rng, s, -10, -2).cuda() for s in SHAPES]
    for q, g in zip(b, captured):
        q.grad = g

    def plain_step(grads, lr):
        plain.param_groups[0]["lr"] = lr
        for p, g in zip(a, grads):
            p.grad = g.clone()
        plain.step()

    graph = warm_up_and_capture(cap.step, torch.cuda.CUDAGraph())
    lr = cap.param_groups[0]["lr"]
    for _ in range(2):
        plain_step(captured, float(lr))
    for value in (0.01, 0.005):
        moved = [gradient(rng, s, -10, -2).cuda() for s in SHAPES]
        for q, g in zip(b, moved):
            q.grad = g
        lr.fill_(value)
        cap.step()
        plain_step(moved, float(lr))
        graph.replay()
        plain_step(captured, float(lr))
    torch.cuda.synchronize()
    assert_same(a, plain, b, cap, "eager steps and replays after a capture")


@pytest.mark.parametrize("batch_ns", [False, True], ids=["per matrix", "batch_ns"])
def test_a_step_through_the_capture_branches_keeps_what_a_graph_reads(batch_ns, kernels_on_cpu, monkeypatch):
    """On the CPU the kernel path's capture branches run for real with `capturing()` forced:
    a "captured" step of the gradients the eager step stepped gives the eager bits, takes the
    eager address table and keeps the plan and the memory of the lr and of every matrix's state;
    one of other gradients finds no spare (none are made off CUDA) and is refused before
    anything changes."""
    from packed_adamw.torch import _checks

    rng = np.random.default_rng(23)
    a, b = matrices(rng, "cpu"), matrices(np.random.default_rng(23), "cpu")
    lr = torch.tensor(0.02)
    eager = PackedMuon(a, lr=float(lr), batch_ns=batch_ns)  # the float32 value the device reads
    cap = PackedMuon(b, lr=lr, batch_ns=batch_ns, capturable=True)
    for p, q, g in zip(a, b, [gradient(rng, s, -10, -2) for s in SHAPES]):
        p.grad, q.grad = g.clone(), g.clone()
    eager.step()
    cap.step()
    eager.step()  # the twin of the next step (it would refuse a capture: capturable=False)
    monkeypatch.setattr(_checks, "capturing", lambda: True)
    cap.step()
    assert_same(a, eager, b, cap, "a step through the capture branches")
    kept = list(cap._captured.values())
    plan = cap._muon_device_plan
    assert any(k is plan for k in kept)
    if batch_ns:
        assert plan.addresses.table is None  # taken by the capture; the next eager step makes another
    addresses = {k.data_ptr() for k in kept if isinstance(k, torch.Tensor)}
    state = [t for q in b for t in cap.state[q].values() if isinstance(t, torch.Tensor) and t.dim()]
    assert lr.data_ptr() in addresses and all(t.data_ptr() in addresses for t in [*b, *state])
    if batch_ns:
        for q in b:
            q.grad = q.grad.clone()  # elsewhere: the capture would need a spare table
        before = [(bits(q).clone(), {k: v.clone() for k, v in cap.state[q].items()}) for q in b]
        with pytest.raises(RuntimeError, match=r"PackedMuon\(capturable=True\) under a CUDA graph capture: .*spares"):
            cap.step()
        for q, (weights, entries) in zip(b, before):
            assert torch.equal(bits(q), weights) and all(torch.equal(cap.state[q][k], v) for k, v in entries.items())
