"""`PackedAdamW(capturable=True)` on CUDA: step counts and the learning rate stay on the
device, so a training step captured in a CUDA graph replays with the eager step's bits."""
from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch

import torch_helpers as H
from packed_adamw.torch import PackedAdamW

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODES = H.MODES


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64)).cuda()


def groups(m, lr):
    first, *rest = list(m.parameters())
    return [{"params": [first], "maximize": True}, {"params": rest}] if isinstance(lr, float) else \
        [{"params": [first], "maximize": True, "lr": lr}, {"params": rest, "lr": lr}]


def assert_same(params_a, opt_a, params_b, opt_b, what):
    for pa, pb in zip(params_a, params_b):
        H.assert_same_bits(pa, pb, f"{what}: params")
        H.assert_same_bits(H.state_tensor(opt_a, pa), H.state_tensor(opt_b, pb), f"{what}: state")
        assert int(opt_a.state[pa]["step"]) == int(opt_b.state[pb]["step"]), what


@pytest.mark.parametrize("mode", MODES)
def test_capturable_steps_equal_the_plain_cuda_steps_as_the_lr_changes(mode):
    a, b = model(), model()
    plain = PackedAdamW(groups(a, 1e-2), lr=1e-2, weight_decay=0.1, mode=mode)
    lr = torch.tensor(1e-2, device="cuda")
    cap = PackedAdamW(groups(b, lr), lr=lr, weight_decay=0.1, mode=mode, capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for step, value in enumerate([1e-2, 1e-2, 3e-3, 7e-4, 2e-2]):
        for group in plain.param_groups:
            group["lr"] = value
        lr.fill_(value)
        for p, q in zip(a.parameters(), b.parameters()):
            g = torch.randn(p.shape, device="cuda", generator=gen) * 10.0 ** (step - 3)
            p.grad, q.grad = g.clone(), g.clone()
        plain.step()
        cap.step()
    assert_same(list(a.parameters()), plain, list(b.parameters()), cap, "capturable vs plain")
    assert isinstance(cap.state[next(b.parameters())]["step"], torch.Tensor)


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_training_step_replays_with_the_bits_of_eager_steps_and_follows_a_scheduler(mode):
    m = model()
    lr = torch.tensor(1e-2, device="cuda")
    opt = PackedAdamW(groups(m, lr), lr=lr, weight_decay=0.1, mode=mode, capturable=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    static_x = torch.randn(32, 64, device="cuda")
    start = [p.detach().clone() for p in m.parameters()]

    def train_step():
        loss = m(static_x).pow(2).mean()
        loss.backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warmup_grads = []
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            train_step()
            warmup_grads.append([p.grad.clone() for p in m.parameters()])
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    replay_grads, lrs = [], []
    gen = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(6):
        static_x.copy_(torch.randn(32, 64, device="cuda", generator=gen))
        graph.replay()
        replay_grads.append([p.grad.clone() for p in m.parameters()])
        lrs.append(float(lr))
        sched.step()
    assert lrs == pytest.approx([1e-2 * 0.5 ** (i // 2) for i in range(6)], rel=1e-6)  # the scheduler reached the graph

    # The same gradients, and the same lr tensor values, through eager capturable steps.
    eager_params = [torch.nn.Parameter(p.clone()) for p in start]
    eager_lr = torch.tensor(1e-2, device="cuda")
    eager = PackedAdamW([{"params": eager_params[:1], "maximize": True, "lr": eager_lr},
                         {"params": eager_params[1:], "lr": eager_lr}],
                        lr=eager_lr, weight_decay=0.1, mode=mode, capturable=True)
    eager_sched = torch.optim.lr_scheduler.StepLR(eager, step_size=2, gamma=0.5)
    for grads in warmup_grads:
        for p, g in zip(eager_params, grads):
            p.grad = g.clone()
        eager.step()
    for grads in replay_grads:
        for p, g in zip(eager_params, grads):
            p.grad = g.clone()
        eager.step()
        eager_sched.step()
    torch.cuda.synchronize()
    assert_same(list(m.parameters()), opt, eager_params, eager, "captured replays vs eager")
    assert int(opt.state[next(m.parameters())]["step"]) == 9


def test_an_invalid_lr_tensor_refuses_the_step_on_the_device_and_counts_nothing():
    m = model()
    lr = torch.tensor(1e-2, device="cuda")
    opt = PackedAdamW(m.parameters(), lr=lr, capturable=True)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    before = H.snapshot(opt, list(m.parameters()))
    for bad in (-1e-3, float("nan"), float("inf")):
        lr.fill_(bad)
        opt.step()
        H.assert_same_snapshot(H.snapshot(opt, list(m.parameters())), before, f"after a step with lr={bad}")
    lr.fill_(1e-3)
    opt.step()
    assert int(opt.state[next(m.parameters())]["step"]) == 2


def test_capturable_state_dict_round_trips_into_a_plain_optimizer():
    m, n = model(), model()
    lr = torch.tensor(1e-2, device="cuda")
    cap = PackedAdamW(m.parameters(), lr=lr, capturable=True)
    plain = PackedAdamW(n.parameters(), lr=1e-2)
    for _ in range(2):
        for p, q in zip(m.parameters(), n.parameters()):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
        cap.step()
        plain.step()
    sd = cap.state_dict()
    fresh = model()
    fresh.load_state_dict(m.state_dict())
    loaded = PackedAdamW(fresh.parameters(), lr=1e-2)
    sd["param_groups"][0]["lr"] = 1e-2
    loaded.load_state_dict(sd)
    assert all(type(loaded.state[p]["step"]) is int for p in fresh.parameters())
    assert_same(list(fresh.parameters()), loaded, list(n.parameters()), plain, "loaded capturable state")


def test_lr_tensors_of_other_dtypes_devices_and_shapes_and_replaced_lrs_step_like_float_lrs():
    """The scalar kernel reads a float32 CUDA lr where it is and copies any other lr tensor
    (float64, bf16, on the CPU, shape (1,)) into a float32 slot first: each gives the bits of a
    plain optimizer at that lr rounded to float32. An lr tensor replaced between eager steps, or
    whose data moved (`lr.data = ...`), is followed."""
    values = [1e-2, 3e-3, 7e-4, 2e-2]
    for make in (lambda v: torch.tensor(v, dtype=torch.float64, device="cuda"),
                 lambda v: torch.tensor(v, dtype=torch.bfloat16, device="cuda"),
                 lambda v: torch.tensor(v),
                 lambda v: torch.tensor([v], device="cuda")):
        a, b = model(), model()
        lr = make(values[0])
        plain = PackedAdamW(groups(a, float(lr.float())), lr=float(lr.float()), weight_decay=0.1)
        cap = PackedAdamW(groups(b, lr), lr=lr, weight_decay=0.1, capturable=True)
        gen = torch.Generator(device="cuda").manual_seed(5)
        for step, value in enumerate(values):
            new = make(value)
            if step == 1:  # a new tensor in every group
                for group in cap.param_groups:
                    group["lr"] = new
            elif step == 2:  # the same object, its data moved
                for group in cap.param_groups:
                    group["lr"].data = new
            else:
                for group in cap.param_groups:
                    group["lr"].copy_(new)
            for group in plain.param_groups:
                group["lr"] = float(new.float())
            for p, q in zip(a.parameters(), b.parameters()):
                g = torch.randn(p.shape, device="cuda", generator=gen)
                p.grad, q.grad = g.clone(), g.clone()
            plain.step()
            cap.step()
        assert_same(list(a.parameters()), plain, list(b.parameters()), cap, f"lr {lr.dtype} on {lr.device}")


def test_a_capture_right_after_an_lr_tensor_was_replaced_is_refused():
    m = model()
    lr = torch.tensor(1e-2, device="cuda")
    opt = PackedAdamW(groups(m, lr), lr=lr, weight_decay=0.1, capturable=True)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    for group in opt.param_groups:
        group["lr"] = torch.tensor(5e-3, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="lr tensor was replaced"):
        with torch.cuda.graph(graph):
            opt.step()


def warm_up_and_capture(step, graph, before_capture=lambda: None):
    """torch.cuda.graph's recipe: `step` twice on a side stream, then `step` captured in `graph`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    before_capture()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_capturing_the_step_of_an_optimizer_built_without_capturable_is_refused_naming_it():
    m = model()
    opt = PackedAdamW(m.parameters(), lr=1e-2)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"built without capturable=True"):
        warm_up_and_capture(opt.step, torch.cuda.CUDAGraph())
    assert all(opt.state[p]["step"] == 2 for p in m.parameters())  # the warm-up's steps only
    opt.step()  # the stream and the optimizer are usable: nothing was launched in the capture
    torch.cuda.synchronize()
    assert all(opt.state[p]["step"] == 3 for p in m.parameters())


def test_eager_steps_after_a_capture_leave_its_replays_on_the_captured_gradients():
    """A capture of the buffers its warm-up stepped reads their address table in place (no copy
    in the graph); eager steps afterwards, on gradients elsewhere, must upload into another
    table, and replays still step the captured gradients: bits against a plain optimizer given
    the same sequence of gradients."""
    a, b = model(), model()
    plain = PackedAdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    cap = PackedAdamW(b.parameters(), lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1, capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(6)
    captured = [torch.randn(p.shape, device="cuda", generator=gen) for p in b.parameters()]
    for q, g in zip(b.parameters(), captured):
        q.grad = g

    def plain_step(grads):
        for p, g in zip(a.parameters(), grads):
            p.grad = g.clone()
        plain.step()

    graph = warm_up_and_capture(cap.step, torch.cuda.CUDAGraph())
    plain_step(captured)
    plain_step(captured)
    for _ in range(2):
        moved = [torch.randn(p.shape, device="cuda", generator=gen) for p in b.parameters()]
        for q, g in zip(b.parameters(), moved):
            q.grad = g
        cap.step()
        plain_step(moved)
        graph.replay()
        plain_step(captured)
    torch.cuda.synchronize()
    assert_same(list(a.parameters()), plain, list(b.parameters()), cap, "eager steps and replays after a capture")
    assert int(cap.state[next(b.parameters())]["step"]) == 6


def test_a_capture_of_the_warmed_up_buffers_holds_no_copy_and_one_of_moved_ones_does(tmp_path):
    """The captured step's graph: the scalar kernel and the update kernel, and a copy of the
    address table only when the capture's buffers differ from the last eager step's (the
    control, which shows that the graph's dump names its copies)."""
    dumps = {}
    for case in ("same buffers", "moved gradients"):
        m = model()
        opt = PackedAdamW(m.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True)

        def new_gradients():  # each allocated while the one it replaces still lives: a new address
            for p in m.parameters():
                p.grad = torch.ones_like(p)

        new_gradients()
        # A graph not kept (keep_graph=False) has nothing left to dump.
        graph = warm_up_and_capture(opt.step, torch.cuda.CUDAGraph(keep_graph=True),
                                    new_gradients if case == "moved gradients" else lambda: None)
        path = tmp_path / f"{case.replace(' ', '_')}.dot"
        graph.debug_dump(str(path))
        dumps[case] = path.read_text()
    # The dump's records start with the node's kind: label="{KERNEL ..." or label="{\nMEMCPY ...".
    nodes = {case: re.findall(r'label="\{\s*([A-Z_]+)', dump) for case, dump in dumps.items()}
    for case, kinds in nodes.items():  # an empty or unreadable dump must not pass for "no copy"
        assert kinds.count("KERNEL") == 2, (case, kinds, dumps[case][:2000])
    assert "MEMCPY" not in nodes["same buffers"], dumps["same buffers"][:3000]
    assert nodes["moved gradients"].count("MEMCPY") == 1, dumps["moved gradients"][:3000]


def test_a_plan_rebuilt_after_a_capture_keeps_what_the_graph_reads_and_its_captured_hyperparameters():
    """After a capture, an eager weight_decay change and a replaced lr tensor write new device
    tensors (the graph keeps the values it captured), and a plan rebuilt by a new group leaves
    the captured plan alive (its tensors are read at every replay): replays and eager steps
    interleaved give a plain optimizer's bits at the captured wd and lr for the replays, the new
    ones for the eager steps. A graph replayed after its plan was rebuilt steps the state and
    counts it captured (README, "CUDA graphs": capture again after adding a group or loading a
    state); here the state tensors are the same, the counts are not."""
    a, b = model(), model()
    plain = PackedAdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    lr = torch.tensor(1e-2, device="cuda")
    cap = PackedAdamW(b.parameters(), lr=lr, weight_decay=0.1, capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(8)
    grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in b.parameters()]
    for q, g in zip(b.parameters(), grads):
        q.grad = g

    def plain_step(wd, lr_value):
        for group in plain.param_groups:
            group["weight_decay"], group["lr"] = wd, lr_value
        for p, g in zip(a.parameters(), grads):
            p.grad = g.clone()
        plain.step()

    graph = warm_up_and_capture(cap.step, torch.cuda.CUDAGraph())
    for _ in range(2):
        plain_step(0.1, 1e-2)
    captured_plan = weakref.ref(cap._plan)
    cap.param_groups[0]["weight_decay"] = 0.5
    cap.param_groups[0]["lr"] = torch.tensor(3e-3, device="cuda")  # the graph still reads `lr`
    cap.step()
    plain_step(0.5, 3e-3)
    graph.replay()
    plain_step(0.1, 1e-2)
    extra = torch.nn.Parameter(torch.zeros(5, device="cuda"))
    cap.add_param_group({"params": [extra], "weight_decay": 0.0})  # the next step builds a new plan
    cap.step()
    plain_step(0.5, 3e-3)
    gc.collect()
    assert captured_plan() is not None and captured_plan() is not cap._plan
    # Memory freed by mistake would be handed out again: small blocks, where the plan's tensors live.
    litter = [torch.full((64,), -1.0, device="cuda") for _ in range(4096)]
    graph.replay()
    del litter
    # The graph advances the counts it captured (4 steps so far), not the new plan's (5).
    for p in a.parameters():
        plain.state[p]["step"] = 4
    plain_step(0.1, 1e-2)
    torch.cuda.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        H.assert_same_bits(q, p, "replays and eager steps after a capture")
        H.assert_same_bits(H.state_tensor(cap, q), H.state_tensor(plain, p), "state after a capture")


def test_captures_of_moved_gradients_in_a_row_each_replay_their_own():
    """Each capture of gradients the eager steps did not step takes a spare address table: two
    in a row are prepared for, a third is refused naming the eager step that prepares more (it
    pins no memory under the capture, which would invalidate it). Each graph then replays on
    its own gradients: bits against a plain optimizer."""
    a, b = model(), model()
    plain = PackedAdamW(a.parameters(), lr=1e-2)
    cap = PackedAdamW(b.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(9)

    def new_gradients():
        grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in b.parameters()]
        for q, g in zip(b.parameters(), grads):
            q.grad = g
        return grads

    def plain_step(grads):
        for p, g in zip(a.parameters(), grads):
            p.grad = g.clone()
        plain.step()

    warm = new_gradients()
    graphs = [(warm_up_and_capture(cap.step, torch.cuda.CUDAGraph()), warm)]  # reads the eager table in place
    plain_step(warm)
    plain_step(warm)
    for _ in range(2):
        grads = new_gradients()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cap.step()
        graphs.append((graph, grads))
    grads = new_gradients()
    with pytest.raises(RuntimeError, match=r"took the 2 spares an eager step prepares since the last eager step"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            cap.step()
    cap.step()  # prepares spares again, and steps these gradients
    plain_step(grads)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap.step()
    graphs.append((graph, grads))
    for graph, grads in graphs[::-1] + graphs:
        graph.replay()
        plain_step(grads)
    torch.cuda.synchronize()
    assert_same(list(a.parameters()), plain, list(b.parameters()), cap, "replays of four captures")
