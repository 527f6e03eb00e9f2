"""`PackedAdamW`, `PackedMuon` and `PackedMuonAdamW` under torch.compile (docs/MULTI_TENSOR.md,
"Compiled steps"; docs/MUON.md, "Compiled steps").

The step is one custom op (`packed_adamw::step_`), so `torch.compile(opt.step)` and a compiled
training step (forward, backward, step) hold with `fullgraph=True`, on CPU (the numpy step) as on
CUDA, and their parameters, words, low halves, step counts and state_dicts equal eager steps'
bit for bit, over steps with a changing learning rate that recompile nothing. Most CPU cases use
the quick "aot_eager" backend (which hands the op copies of the parameters: the copy path);
one uses Inductor (which updates the parameters in place: the plan path). The CUDA-marked tests
compile for the GPU, including `mode="reduce-overhead"` (the step runs between the captured
partitions) and a CUDA-graph capture of a compiled training step.

The Muon optimizers take the same op (torch_frontend/_compiled.py), Newton-Schulz inside it:
Inductor compiling it would fuse away its bf16 roundings. Their tests are few and tiny (the
compile dominates): every momentum mode, bf16 parameters with masters beside FP32 ones, float and
tensor learning rates changed between steps without a recompile, both backends, a resumed state.

Compiled forward and backward passes may round differently from eager ones, so the eager
optimizers are fed the gradients the compiled runs produced. Bits are compared as integers.
"""
from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

import torch_helpers as H
from muon_helpers import TinyModel
from packed_adamw.torch import NonFiniteGradientError, PackedAdamW, PackedMuon, PackedMuonAdamW, muon_param_groups
from packed_adamw.torch.gpt.model import GPT, GPTConfig

MODES = H.MODES
CUDA = torch.cuda.is_available()
# Dynamo traces Tensor.backward() inside a graph only with this flag (torch 2.13; older releases
# lack it and break the graph there).
TRACES_BACKWARD = hasattr(torch._dynamo.config, "trace_autograd_ops")
LRS = [1e-2, 3e-3, 2e-2, 7e-4, 1e-2]


# ------------------------------------------------------------------------------ helpers ----

def patterns(t) -> np.ndarray:
    """A tensor's element bit patterns as a flat numpy array (16-bit for bf16 and int16)."""
    t = t.detach().cpu().contiguous()
    t = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t
    return t.reshape(-1).numpy().copy()


def assert_same_state(params_a, opt_a, params_b, opt_b, what: str) -> None:
    """Parameters, every state entry and step count, and the state_dicts, bit for bit."""
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert a.dtype == b.dtype, what
        np.testing.assert_array_equal(patterns(a), patterns(b), err_msg=f"{what}: param {i}")
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sorted(sa) == sorted(sb), f"{what}: param {i} state keys"
        for key in sa:
            if key == "step":
                assert int(sa[key]) == int(sb[key]), f"{what}: param {i} step"
            else:
                np.testing.assert_array_equal(patterns(sa[key]), patterns(sb[key]), err_msg=f"{what}: param {i} {key}")
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    plain = lambda groups: [{**g, "lr": float(g["lr"])} for g in groups]  # noqa: E731
    assert plain(sd_a["param_groups"]) == plain(sd_b["param_groups"]), what
    assert sd_a.keys() == sd_b.keys() and sd_a["state"].keys() == sd_b["state"].keys(), what
    for key, entry in sd_a["state"].items():
        for name, value in entry.items():
            other = sd_b["state"][key][name]
            assert type(value) is type(other), f"{what}: state_dict {key} {name}"
            if isinstance(value, torch.Tensor):
                np.testing.assert_array_equal(patterns(value), patterns(other), err_msg=f"{what}: state_dict")
            else:
                assert value == other, f"{what}: state_dict {key} {name}"


def mlp(dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(device, dtype)


def two_groups(params, lr, split_at=1):
    """Two groups (the first maximizing), both with `lr` when it is a tensor."""
    params = list(params)
    extra = {"lr": lr} if isinstance(lr, torch.Tensor) else {}
    return [{"params": params[:split_at], "maximize": True, **extra}, {"params": params[split_at:], **extra}]


def set_lr(opt, value) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value



def step_through_lrs(a, eager, b, compiled, step) -> None:
    """One step per value of LRS, the same gradients fed to both models: `eager.step()` on `a`,
    `step()` (the compiled optimizer's step) on `b`."""
    for value, grads in zip(LRS, gradients(list(a.parameters()), len(LRS))):
        set_lr(eager, value)
        set_lr(compiled, value)
        feed(a.parameters(), grads)
        feed(b.parameters(), grads)
        eager.step()
        step()

def gradients(params, steps: int, seed: int = 5, dtype=None):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=gen) * 10.0 ** (s - 2)).to(p.device, dtype or p.dtype) for p in params]
            for s in range(steps)]


def set_grad(p, g) -> None:
    """p.grad = g, also for an FP32 gradient of a bf16 parameter (which the setter refuses)."""
    if g.dtype == p.dtype:
        p.grad = g
    else:
        p.grad = torch.zeros_like(p)
        p.grad.data = g


def feed(params, grads) -> None:
    for p, g in zip(params, grads):
        set_grad(p, g.clone())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo's per-code-object recompile limit (8) counts
    every optimizer a test module compiled a step for."""
    torch._dynamo.reset()
    yield


@contextlib.contextmanager
def no_recompiles():
    """Fails on any recompilation inside (a first compilation is not one)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


@contextlib.contextmanager
def traced_backward():
    with torch._dynamo.config.patch(trace_autograd_ops=True) if TRACES_BACKWARD else contextlib.nullcontext():
        yield


# ------------------------------------------------------------------------ opt.step ----

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
def test_compiled_opt_step_fullgraph_gives_the_eager_bits_as_the_lr_changes(mode, lr_kind):
    make_lr = (lambda: LRS[0]) if lr_kind == "float" else (lambda: torch.tensor(LRS[0]))
    a, b = mlp(), mlp()
    eager = PackedAdamW(two_groups(a.parameters(), make_lr()), lr=make_lr(), weight_decay=0.1, mode=mode)
    compiled = PackedAdamW(two_groups(b.parameters(), make_lr()), lr=make_lr(), weight_decay=0.1, mode=mode)
    with no_recompiles():
        step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
        step_through_lrs(a, eager, b, compiled, step)
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), compiled, f"compiled opt.step, {lr_kind} lr")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16_grads", "fp32_grads"])
def test_compiled_opt_step_of_bf16_split_masters_gives_the_eager_bits(grad_dtype):
    """bf16 weights (split masters) next to an FP32 parameter, through the compiled step. Dynamo
    cannot trace an FP32 gradient of a bf16 parameter ("dtype mismatch between tensor and its
    gradient"): that step breaks the graph and runs the op eagerly, with the same bits."""
    def model():
        m = mlp(torch.bfloat16)
        m[2].bias.data = m[2].bias.data.float()  # one FP32 parameter: two launch kinds
        return m

    a, b = model(), model()
    eager = PackedAdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = PackedAdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    step = torch.compile(compiled.step, fullgraph=grad_dtype is torch.bfloat16, backend="aot_eager")
    for value, grads in zip(LRS[:4], gradients(list(a.parameters()), 4)):
        grads = [g.to(grad_dtype if p.dtype is torch.bfloat16 else torch.float32) for p, g in zip(a.parameters(), grads)]
        set_lr(eager, value)
        set_lr(compiled, value)
        for p, q, g in zip(a.parameters(), b.parameters(), grads):
            set_grad(p, g.clone())
            set_grad(q, g.clone())
        eager.step()
        step()
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), compiled, "bf16 compiled opt.step")
    assert compiled.master_weights()[0].dtype == torch.float32


def test_inductor_steps_the_parameters_in_place_and_reuses_the_step_plan():
    """Inductor hands the op the parameters themselves: the eager step plan holds between
    compiled steps (host time), and a scheduler's float lr recompiles nothing."""
    a, b = mlp(), mlp()
    eager = PackedAdamW(two_groups(a.parameters(), 1e-2), lr=1e-2, weight_decay=0.1)
    compiled = PackedAdamW(two_groups(b.parameters(), 1e-2), lr=1e-2, weight_decay=0.1)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (eager, compiled)]
    plans = []
    with no_recompiles():
        step = torch.compile(compiled.step, fullgraph=True, backend="inductor")
        for grads in gradients(list(a.parameters()), 4):
            feed(a.parameters(), grads)
            feed(b.parameters(), grads)
            eager.step()
            step()
            plans.append(compiled.__dict__.get("_plan"))
            for s in schedulers:
                s.step()
    assert plans[0] is not None and all(plan is plans[0] for plan in plans), "the step plan was rebuilt"
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), compiled, "inductor opt.step")


# ------------------------------------------------------------------------ train steps ----

@pytest.mark.skipif(not TRACES_BACKWARD, reason="this torch cannot trace backward() into a graph")
def test_a_compiled_gpt_training_step_fullgraph_gives_the_eager_bits():
    """The micro GPT: forward, backward and step in one graph; a scheduler changes the tensor lr."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("micro"))
    start = [p.detach().clone() for p in model.parameters()]
    lr = torch.tensor(1e-3)
    opt = PackedAdamW(model.parameters(), lr=lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tokens = torch.randint(0, 500, (4, 2, 16), generator=torch.Generator().manual_seed(1))

    def train_step(idx):
        _, loss = model(idx, idx)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return loss.detach(), grads

    seen = []
    with no_recompiles(), traced_backward():
        step = torch.compile(train_step, fullgraph=True, backend="aot_eager")
        for idx in tokens:
            model.zero_grad(set_to_none=True)
            seen.append(step(idx)[1])
            scheduler.step()
    eager_params = [torch.nn.Parameter(p) for p in start]
    eager = PackedAdamW(eager_params, lr=torch.tensor(1e-3), weight_decay=0.1)
    eager_scheduler = torch.optim.lr_scheduler.StepLR(eager, step_size=1, gamma=0.5)
    for grads in seen:
        feed(eager_params, grads)
        eager.step()
        eager_scheduler.step()
    assert float(lr) == pytest.approx(1e-3 / 16)
    assert_same_state(list(model.parameters()), opt, eager_params, eager, "compiled GPT train step")


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_switching_between_eager_and_compiled_steps_keeps_the_bits(mode):
    """Eager, compiled, eager, compiled: one state throughout (int step counts), so the switch
    is seamless, and a state_dict loaded mid-run resumes under compile."""
    a, b = mlp(), mlp()
    eager = PackedAdamW(a.parameters(), lr=1e-2, mode=mode)
    mixed = PackedAdamW(b.parameters(), lr=1e-2, mode=mode)
    step = torch.compile(mixed.step, fullgraph=True, backend="aot_eager")
    for i, grads in enumerate(gradients(list(a.parameters()), 8)):
        feed(a.parameters(), grads)
        feed(b.parameters(), grads)
        eager.step()
        (step if i % 4 >= 2 else mixed.step)()
        if i == 4:  # resume from a checkpoint in a new optimizer, compiled at once
            state = mixed.state_dict()
            mixed = PackedAdamW(b.parameters(), lr=1e-2, mode=mode)
            mixed.load_state_dict(state)
            step = torch.compile(mixed.step, fullgraph=True, backend="aot_eager")
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), mixed, "eager/compiled switches")
    assert isinstance(mixed.state[next(b.parameters())]["step"], int)


# ------------------------------------------------------------------------ options, errors ----

def test_check_nonfinite_breaks_the_graph_and_still_raises():
    """Raising after a step cannot happen inside a graph: the step runs between graphs, so
    fullgraph=True refuses it (saying why) and a plain compile raises as eager does."""
    m = mlp()
    opt = PackedAdamW(m.parameters(), lr=1e-2, check_nonfinite=True)
    feed(m.parameters(), gradients(list(m.parameters()), 1)[0])
    with pytest.raises(torch._dynamo.exc.Unsupported, match="check_nonfinite"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    assert not opt.state, "a refused compile stepped"
    step = torch.compile(opt.step, backend="aot_eager")
    step()
    m[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"param_groups\[0\]\['params'\]\[0\] \(1 of 128"):
        step()
    assert opt.state[m[0].weight]["step"] == 2


def test_gradients_dynamo_cannot_trace_are_named_by_the_compiled_step():
    """A bf16 parameter's float32 gradient, and a gradient reshaped through .data after a
    compiled step: fullgraph=True refuses them naming the problem (dynamo's own errors blame FSDP
    or say `2 != 1`); a plain compile steps eagerly, refusing the wrong shape as eager does."""
    w = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    opt = PackedAdamW([w], lr=1e-2)
    set_grad(w, torch.ones(4, 3))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="a bfloat16 parameter's float32 gradient"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    assert not opt.state, "a refused compile stepped"
    torch.compile(opt.step, backend="aot_eager")()
    assert opt.state[w]["step"] == 1

    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.zeros(4, 3))
    opt = PackedAdamW([p], lr=1e-2)
    p.grad = torch.ones(4, 3)
    for fullgraph in (True, False):
        step = torch.compile(opt.step, fullgraph=fullgraph, backend="aot_eager")
        step()
        p.grad.data = torch.ones(12)
        with pytest.raises(torch._dynamo.exc.Unsupported if fullgraph else ValueError,
                           match="gradient has another shape" if fullgraph else r"gradient shape \(12,\) differs"):
            step()
        p.grad = torch.ones(4, 3)
    assert opt.state[p]["step"] == 2


def test_track_format_counts_compiled_steps_like_eager_ones():
    a, b = mlp(), mlp()
    eager = PackedAdamW(a.parameters(), lr=1e-2, track_format=True)
    compiled = PackedAdamW(b.parameters(), lr=1e-2, track_format=True)
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    for grads in gradients(list(a.parameters()), 3):
        grads = [g * 1e6 for g in grads]  # some moments saturate
        feed(a.parameters(), grads)
        feed(b.parameters(), grads)
        eager.step()
        step()
    with pytest.warns(RuntimeWarning):
        expected = eager.format_stats()
    with pytest.warns(RuntimeWarning):
        assert compiled.format_stats() == expected
    assert expected[(0, 0)]["elements"] == 3 * 128 and expected[(0, 0)]["saturated_m"] > 0


def test_an_invalid_lr_raises_from_the_compiled_step_and_changes_nothing():
    m = mlp()
    opt = PackedAdamW(m.parameters(), lr=1e-2)
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    feed(m.parameters(), gradients(list(m.parameters()), 1)[0])
    step()
    before = H.snapshot(opt, list(m.parameters()))
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\].*lr"):
        step()
    H.assert_same_snapshot(H.snapshot(opt, list(m.parameters())), before, "after a refused compiled step")


def test_a_replaced_params_list_is_refused_once_then_retraced():
    """Compiled steps iterate the optimizer's noted parameter lists, not the group dicts: a
    group whose list was replaced by hand is not stepped from a stale list."""
    m = mlp()
    opt = PackedAdamW(m.parameters(), lr=1e-2)
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    feed(m.parameters(), gradients(list(m.parameters()), 1)[0])
    step()
    opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])
    before = H.snapshot(opt, list(m.parameters()))
    with pytest.raises(RuntimeError, match=r"param_groups\[i\]\['params'\] list was replaced"):
        step()
    H.assert_same_snapshot(H.snapshot(opt, list(m.parameters())), before, "after the refused step")
    step()
    assert opt.state[m[0].weight]["step"] == 2


def test_a_copied_optimizer_is_stepped_by_its_own_compiled_step():
    """The op finds its optimizer by a token: a deepcopy registers a token of its own."""
    m = mlp()
    opt = PackedAdamW(m.parameters(), lr=1e-2)
    feed(m.parameters(), gradients(list(m.parameters()), 1)[0])
    opt.step()
    twin = copy.deepcopy(opt)
    assert twin._compile_token != opt._compile_token
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    feed(twin_params, gradients(twin_params, 1)[0])
    torch.compile(twin.step, fullgraph=True, backend="aot_eager")()
    assert twin.state[twin_params[0]]["step"] == 2 and opt.state[m[0].weight]["step"] == 1


# ------------------------------------------------------------------------ Muon ----

class Counting:
    """A backend (one of dynamo's, by name) that keeps the graphs dynamo hands it: one graph
    holding the step's op is a step traced whole."""

    def __init__(self, backend: str):
        self.backend, self.graphs = torch._dynamo.lookup_backend(backend), []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.backend(gm, example_inputs)

    def one_graph_calling_the_step_op(self) -> bool:
        return len(self.graphs) == 1 and any("packed_adamw.step_" in str(node.target)
                                             for node in self.graphs[0].graph.nodes)


def mixed_model(seed=0):
    """TinyModel with bf16 parameters (split masters) beside FP32 ones in both rules."""
    torch.manual_seed(seed)
    model = TinyModel()
    model.up.to(torch.bfloat16)
    model.norm.to(torch.bfloat16)
    return model


def combined(model, mode):
    groups = muon_param_groups(model, exclude=("head",), muon=dict(lr=0.02), adamw=dict(lr=3e-3))
    return PackedMuonAdamW(groups, mode=mode, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
def test_compiled_packed_muon_adamw_step_gives_the_eager_bits_and_resumes(mode):
    """fullgraph=True over both rules; a scheduler changes both groups' float lrs every step and
    nothing recompiles; the state_dict of a compiled run resumes in a new optimizer, compiled at once."""
    a, b = mixed_model(), mixed_model()
    eager, compiled = combined(a, mode), combined(b, mode)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (eager, compiled)]
    counter = Counting("aot_eager")
    with no_recompiles():
        step = torch.compile(compiled.step, fullgraph=True, backend=counter)
        for grads in gradients(list(a.parameters()), 3):
            feed(a.parameters(), grads)
            feed(b.parameters(), grads)
            eager.step()
            step()
            for scheduler in schedulers:
                scheduler.step()
    assert compiled.param_groups[0]["lr"] == 0.02 / 4
    assert counter.one_graph_calling_the_step_op()
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), compiled, f"compiled {mode} steps")
    resumed = combined(b, mode)
    resumed.load_state_dict(compiled.state_dict())
    step = torch.compile(resumed.step, fullgraph=True, backend="aot_eager")
    feed(a.parameters(), gradients(list(a.parameters()), 1, seed=9)[0])
    feed(b.parameters(), gradients(list(b.parameters()), 1, seed=9)[0])
    eager.step()
    step()
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), resumed, f"resumed {mode} steps")


def test_inductor_steps_packed_muon_in_place_with_a_tensor_lr_and_batched_newton_schulz():
    """Inductor hands the op the parameters themselves (aot_eager, copies); a tensor lr changed
    in place recompiles nothing; batch_ns's batches form inside the op as in the eager step."""
    def matrices():
        gen = torch.Generator().manual_seed(4)
        shapes = (((6, 10), torch.bfloat16), ((10, 6), torch.float32), ((6, 10), torch.float32),
                  ((7, 7), torch.float32))
        return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape, dtype in shapes]

    a, b = matrices(), matrices()
    eager, compiled = (PackedMuon(ps, lr=torch.tensor(0.02), batch_ns=True) for ps in (a, b))
    counter = Counting("inductor")
    with no_recompiles():
        step = torch.compile(compiled.step, fullgraph=True, backend=counter)
        for i, grads in enumerate(gradients(a, 3)):
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"].fill_(LRS[i])
            feed(a, grads)
            feed(b, grads)
            addresses = [p.data_ptr() for p in b]
            eager.step()
            step()
            assert [p.data_ptr() for p in b] == addresses
    assert counter.one_graph_calling_the_step_op()
    assert_same_state(a, eager, b, compiled, "inductor PackedMuon steps")


def test_muon_check_nonfinite_breaks_the_graph_and_still_raises():
    model = TinyModel()
    opt = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)), check_nonfinite=True)
    feed(model.parameters(), gradients(list(model.parameters()), 1)[0])
    with pytest.raises(torch._dynamo.exc.Unsupported, match="check_nonfinite"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    assert not opt.state, "a refused compile stepped"
    model.up.weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="up.weight.*refused whole"):
        torch.compile(opt.step, backend="aot_eager")()
    assert opt.state[model.down.weight] and opt.state[model.head.weight]["step"] == 1
    opt.check_nonfinite = False
    opt.rules["adamw"].check_nonfinite = True  # a rule's switch, set since, counts too
    torch._dynamo.reset()  # dynamo would reuse the plain compile's cached frame (graph breaks and all)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="check_nonfinite"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()


# ------------------------------------------------------------------------ CUDA ----

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.cuda
@needs_cuda
def test_cuda_compiled_opt_step_equals_the_cpu_step(mode, dtype):
    """Inductor on the GPU against the numpy step on the CPU, as the lr changes."""
    cpu, gpu = mlp(dtype), mlp(dtype, "cuda")
    host = PackedAdamW(two_groups(cpu.parameters(), 1e-2), lr=1e-2, weight_decay=0.1, mode=mode)
    dev = PackedAdamW(two_groups(gpu.parameters(), 1e-2), lr=1e-2, weight_decay=0.1, mode=mode)
    with no_recompiles():
        step = torch.compile(dev.step, fullgraph=True)
        for value, grads in zip(LRS, gradients(list(cpu.parameters()), len(LRS))):
            set_lr(host, value)
            set_lr(dev, value)
            feed(cpu.parameters(), grads)
            feed(gpu.parameters(), [g.cuda() for g in grads])
            host.step()
            step()
    assert_same_state(list(cpu.parameters()), host, list(gpu.parameters()), dev, "CUDA compiled vs CPU")


@pytest.mark.parametrize("mode", ["packed", "fp32"])
@pytest.mark.parametrize("options", [dict(ns_impl="cublas", batch_ns=False), dict(ns_impl="cublas", batch_ns=True),
                                     dict()], ids=["cublas_per_matrix", "cublas_batch_ns", "defaults"])
@pytest.mark.cuda
@needs_cuda
def test_cuda_compiled_packed_muon_adamw_step_equals_its_eager_cuda_step(mode, options):
    """Inductor on the GPU against eager CUDA steps (Newton-Schulz runs on the GPU in both, in
    the op), bf16 and FP32 parameters, the lrs changing, no recompile, one graph."""
    a, b = mixed_model().cuda(), mixed_model().cuda()
    eager, compiled = (PackedMuonAdamW(muon_param_groups(m, exclude=("head",), muon=dict(lr=0.02)), mode=mode,
                                       **options) for m in (a, b))
    counter = Counting("inductor")
    with no_recompiles():
        step = torch.compile(compiled.step, fullgraph=True, backend=counter)
        step_through_lrs(a, eager, b, compiled, step)
    assert counter.one_graph_calling_the_step_op()
    assert_same_state(list(a.parameters()), eager, list(b.parameters()), compiled, "CUDA compiled Muon")


def _cuda_lr(capturable: bool):
    return torch.tensor(1e-2, device="cuda") if capturable else 1e-2


def _cuda_train_run(compile_mode: str | None, steps: int = 6, capturable: bool = True):
    """A compiled training step of an MLP on the GPU with a scheduler; returns (params, opt,
    gradients seen, start)."""
    m = mlp(device="cuda")
    start = [p.detach().clone() for p in m.parameters()]
    lr = _cuda_lr(capturable)
    opt = PackedAdamW(two_groups(m.parameters(), lr), lr=lr, weight_decay=0.1, capturable=capturable)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x = torch.randn(32, 8, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))

    def train_step(x):
        m(x).pow(2).mean().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        return grads

    seen = []
    with traced_backward():
        step = torch.compile(train_step, fullgraph=TRACES_BACKWARD, mode=compile_mode)
        for i in range(steps):
            m.zero_grad(set_to_none=True)
            seen.append([g.clone() for g in step(x * (i + 1))])
            scheduler.step()
    torch.cuda.synchronize()
    return m, opt, seen, start


def _eager_run(start, seen, capturable: bool = True):
    params = [torch.nn.Parameter(p.clone()) for p in start]
    lr = _cuda_lr(capturable)
    opt = PackedAdamW(two_groups(params, lr), lr=lr, weight_decay=0.1, capturable=capturable)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for grads in seen:
        feed(params, grads)
        opt.step()
        scheduler.step()
    torch.cuda.synchronize()
    return params, opt


@pytest.mark.parametrize("capturable", [True, False], ids=["capturable", "plain"])
@pytest.mark.parametrize("compile_mode", [None, "reduce-overhead"])
@pytest.mark.cuda
@needs_cuda
def test_cuda_compiled_training_step_gives_the_eager_bits(compile_mode, capturable):
    """`mode="reduce-overhead"` captures the forward and backward partitions in CUDA graphs
    and runs the step (a cudagraph-unsafe op) between them, capturable or not; the lr follows
    the scheduler with no recompilation."""
    with no_recompiles():
        m, opt, seen, start = _cuda_train_run(compile_mode, capturable=capturable)
    params, eager = _eager_run(start, seen, capturable)
    assert_same_state(list(m.parameters()), opt, params, eager, f"compiled train step, mode={compile_mode}")
    assert int(opt.state[next(m.parameters())]["step"]) == 6


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_capture_of_a_compiled_training_step_replays_the_eager_bits():
    """torch.cuda.graph around a compiled (default mode) training step."""
    m = mlp(device="cuda")
    start = [p.detach().clone() for p in m.parameters()]
    lr = torch.tensor(1e-2, device="cuda")
    opt = PackedAdamW(two_groups(m.parameters(), lr), lr=lr, weight_decay=0.1, capturable=True)
    static_x = torch.randn(32, 8, device="cuda")

    def train_step():
        m(static_x).pow(2).mean().backward()
        opt.step()

    step = torch.compile(train_step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seen = []
    with torch.cuda.stream(side):
        for _ in range(3):
            m.zero_grad(set_to_none=True)
            step()
            seen.append([p.grad.clone() for p in m.parameters()])
    torch.cuda.current_stream().wait_stream(side)
    m.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(4)
    for i in range(4):
        static_x.copy_(torch.randn(32, 8, device="cuda", generator=gen))
        lr.fill_(1e-2 / (i + 1))
        graph.replay()
        seen.append([p.grad.clone() for p in m.parameters()])
    torch.cuda.synchronize()
    params = [torch.nn.Parameter(p.clone()) for p in start]
    eager_lr = torch.tensor(1e-2, device="cuda")
    eager = PackedAdamW(two_groups(params, eager_lr), lr=eager_lr, weight_decay=0.1, capturable=True)
    for i, grads in enumerate(seen):
        eager_lr.fill_(1e-2 if i < 3 else 1e-2 / (i - 2))
        feed(params, grads)
        eager.step()
    torch.cuda.synchronize()
    assert_same_state(list(m.parameters()), opt, params, eager, "captured compiled train step")


def test_a_step_in_a_frame_dynamo_gave_up_on_takes_the_disabled_update(monkeypatch):
    """The eager step() calls `_eager_update` itself only where dynamo hooks no frames
    (`_compiled.eager_update`); in a frame dynamo gave up on (a failing backend, its error
    suppressed) it takes the disabled `_update`, so dynamo never traces the step's internals:
    the eager bits either way."""
    import torch._dynamo.config as dynamo_config

    calls = []
    original = PackedAdamW._update

    @torch.compiler.disable
    def counted(self, live=None):
        calls.append(live)
        return original(self, live)

    def failing_backend(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    monkeypatch.setattr(PackedAdamW, "_update", counted)
    torch._dynamo.reset()
    models = [mlp(), mlp()]
    opts = [PackedAdamW(m.parameters(), lr=1e-2) for m in models]
    params = [list(m.parameters()) for m in models]
    # dynamo's own patch, not monkeypatch: monkeypatch's undo deleted the entry, and torch.compile in a
    # later test of the same process then failed reading `suppress_errors` (torch 2.13)
    with dynamo_config.patch(suppress_errors=True):
        given_up = torch.compile(lambda: opts[1].step(), backend=failing_backend)
        for n, grads in enumerate(gradients(params[0], 2)):
            for ps in params:
                feed(ps, grads)
            opts[0].step()
            assert calls == [None] * n  # eager: `_update` (the disabled twin) not called
            given_up()
            assert calls == [None] * (n + 1)
    assert_same_state(params[0], opts[0], params[1], opts[1], "a step in a frame dynamo gave up on")
    torch._dynamo.reset()
