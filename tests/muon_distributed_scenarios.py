"""Multi-process scenarios for tests/torch_frontend/test_muon_distributed.py: PackedMuonAdamW under FSDP2
(gloo, CPU), run under torchrun as tests/distributed_scenarios.py's are.

    python -m torch.distributed.run --nproc_per_node=N tests/muon_distributed_scenarios.py SCENARIO DIR [WORLD]

Every rank sees the same data, so a sharded run must give the bits of a single-process run.
A scenario fails by raising (non-zero exit); rank 0 writes what later launches compare with.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from distributed_scenarios import exit_after_success, load_checkpoint, save_checkpoint, shard
from packed_adamw.torch import NonFiniteGradientError, PackedMuonAdamW, muon_param_groups
from packed_adamw.torch import muon as torch_muon
from packed_adamw.torch import _muon_ns as torch_muon_ns

MODES = ("packed", "bf16", "fp32")
STEPS, SAVE_AT = 4, 2
OPTIONS = dict(lr=0.02, momentum=0.9, adamw_lr=1e-2, adamw_weight_decay=0.1)
# The runs each launch makes: (name, parameter dtype, momentum mode, batch_ns).
RUNS = [(f"fp32-{mode}", torch.float32, mode, False) for mode in MODES] + [
    ("bf16-packed", torch.bfloat16, "packed", False), ("fp32-packed-batch_ns", torch.float32, "packed", True)]


def make_model(seed: int = 0, dtype=torch.float32, same_shapes: bool = False) -> torch.nn.Sequential:
    """Muon matrices wide (7 x 18), tall (10 x 7) and of one row (1 x 10: on 2 ranks one local
    shard is empty); AdamW's embedding and biases. Odd sizes shard unevenly. `same_shapes`: two
    7 x 7 matrices before the tall one (a Newton-Schulz batch of two)."""
    torch.manual_seed(seed)
    twins = [torch.nn.Linear(7, 7), torch.nn.Tanh(), torch.nn.Linear(7, 7), torch.nn.Tanh()] if same_shapes else []
    return torch.nn.Sequential(
        torch.nn.Embedding(11, 6), torch.nn.Flatten(), torch.nn.Linear(18, 7), torch.nn.Tanh(),
        *twins, torch.nn.Linear(7, 10), torch.nn.Tanh(), torch.nn.Linear(10, 1)).to(dtype)


def make_optimizer(model, mode: str, batch_ns: bool) -> PackedMuonAdamW:
    return PackedMuonAdamW(muon_param_groups(model), mode=mode, batch_ns=batch_ns, **OPTIONS)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 11, (8, 3), generator=torch.Generator().manual_seed(200 + step))


def train(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        model(batch(step)).float().pow(2).mean().backward()
        opt.step()


def bits(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor's bits: a DTensor gathered, sharded int8 pairs (16-bit codes, low halves)
    read back as int16, sharded int32 words and float32 values as int32."""
    t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
    if t.dtype == torch.int8 and t.dim() and t.size(-1) == 2:
        return t.view(torch.int16).squeeze(-1)
    if t.dtype in (torch.uint32, torch.float32):
        return t.view(torch.int32)
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def snapshot(model, opt) -> dict:
    """Per parameter: its bits, its FP32 master's, and every state entry's (decoded to the plain
    layout's bits)."""
    masters = dict(zip((name for name, _ in model.named_parameters()), opt.master_weights()))
    return {name: {"param": bits(p), "master": bits(masters[name]),
                   **{key: bits(v) if torch.is_tensor(v) else v for key, v in opt.state[p].items()}}
            for name, p in model.named_parameters()}


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert a[name].keys() == b[name].keys(), f"{what}: {name} state keys {a[name].keys()} != {b[name].keys()}"
        for key, x in a[name].items():
            y = b[name][key]
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) if torch.is_tensor(x) else x == y
            assert same, f"{what}: {name} {key} differs"


def reference(dtype, mode, batch_ns) -> dict:
    model = make_model(dtype=dtype)
    opt = make_optimizer(model, mode, batch_ns)
    train(model, opt, range(STEPS))
    return snapshot(model, opt)


# ---- scenarios ---------------------------------------------------------------------------------
def muon_fsdp_train(out: Path) -> None:
    """FSDP2 steps equal a single-process run bit for bit (every momentum mode, bf16 parameters
    with their masters, batch_ns, the Triton kernels' path); the Muon state is DTensors on the
    parameters' mesh; a DCP checkpoint at SAVE_AT; a NaN in one rank's shard refuses the matrix
    on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, dtype, mode, batch_ns in RUNS:
        model = shard(make_model(dtype=dtype))
        opt = make_optimizer(model, mode, batch_ns)
        train(model, opt, range(SAVE_AT))
        for group in opt.param_groups:
            for p in group["params"] if group["kind"] == "muon" else ():
                for key, entry in opt.state[p].items():
                    # packed mode's exponent: one value per matrix, the same on every rank
                    placements = (Replicate(),) * p.device_mesh.ndim if key == "mu_exponent" else p.placements
                    assert isinstance(entry, DTensor) and entry.device_mesh == p.device_mesh \
                        and entry.placements == placements, f"{name}: the Muon state {key!r} is not laid out like {p}"
                assert ("mu_exponent" in opt.state[p]) == (mode == "packed"), name
        save_checkpoint(model, opt, out / f"ckpt-{name}-world{world}")
        train(model, opt, range(SAVE_AT, STEPS))
        got = snapshot(model, opt)
        if rank == 0:
            assert_same(got, reference(dtype, mode, batch_ns), f"FSDP2 vs single process [{name}]")
            torch.save(got, out / f"final-{name}.pt")
        if name == "fp32-packed":
            expected = got

    # The CUDA step's code (Triton kernels, in the interpreter on these CPU tensors): the same bits.
    with kernel_step():
        model = shard(make_model())
        opt = make_optimizer(model, "packed", False)
        train(model, opt, range(STEPS))
    assert_same(snapshot(model, opt), expected, "FSDP2, kernel step vs numpy step")

    # PackedMuon's default on CUDA, the Triton Newton-Schulz batched (here in the interpreter): the
    # gathered Xs of two matrices of one shape run as one batch, with one process's bits.
    batch_sizes = []
    real = torch_muon_ns.newton_schulz_batched
    torch_muon_ns.newton_schulz_batched = lambda xs, *a, **k: batch_sizes.append(len(xs)) or real(xs, *a, **k)
    try:
        with kernel_step():
            runs = []
            for sharded in (True, False):
                model = shard(make_model(same_shapes=True)) if sharded else make_model(same_shapes=True)
                opt = PackedMuonAdamW(muon_param_groups(model), mode="packed", ns_impl="triton", **OPTIONS)
                train(model, opt, range(STEPS))
                runs.append(snapshot(model, opt))
    finally:
        torch_muon_ns.newton_schulz_batched = real
    assert max(batch_sizes) == 2, batch_sizes  # the sharded run's batches (one process stacks on its own)
    assert_same(*runs, "FSDP2 vs one process, the Triton Newton-Schulz batched")

    # A NaN in one rank's part of a matrix: every rank refuses that matrix and raises (both steps).
    for kernels in (False, True):
        with kernel_step(kernels):
            refuse_a_nan_in_one_shard(rank, world)


class kernel_step:
    """Within it, PackedMuon runs its CUDA step's code (the Triton kernels; interpreted on CPU
    tensors) when `on`."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        self.saved = torch_muon._runs_kernels
        if self.on:
            torch_muon._runs_kernels = lambda opt, device: True

    def __exit__(self, *exc):
        torch_muon._runs_kernels = self.saved


def refuse_a_nan_in_one_shard(rank: int, world: int) -> None:
    model = shard(make_model())
    opt = make_optimizer(model, "packed", False)
    opt.rules["muon"].check_nonfinite = True
    train(model, opt, range(1))
    before = snapshot(model, opt)
    opt.zero_grad()
    model(batch(1)).pow(2).mean().backward()
    if rank == world - 1:
        model[4].weight.grad.to_local()[-1, -1] = float("nan")
    try:
        opt.step()
    except NonFiniteGradientError as e:
        assert "'4.weight' (refused whole)" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: a NaN in the last rank's shard was not refused")
    after = snapshot(model, opt)
    changed = {name for name in before if not torch.equal(before[name]["param"], after[name]["param"])}
    assert "4.weight" not in changed and len(changed) == len(before) - 1, changed
    assert torch.equal(before["4.weight"]["momentum_code"], after["4.weight"]["momentum_code"])


def muon_fsdp_resume(out: Path, source_world: str) -> None:
    """Load the checkpoint saved at SAVE_AT by `source_world` ranks into this world (resharded
    when they differ), continue, and compare with the uninterrupted run; on one rank, save again
    for the way back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, dtype, mode, batch_ns in RUNS:
        model = shard(make_model(seed=1, dtype=dtype))  # other weights: the checkpoint must bring them back
        opt = make_optimizer(model, mode, batch_ns)
        load_checkpoint(model, opt, out / f"ckpt-{name}-world{source_world}")
        if world == 1 and source_world != "1":
            save_checkpoint(model, opt, out / f"ckpt-{name}-world1")
        train(model, opt, range(SAVE_AT, STEPS))
        got = snapshot(model, opt)
        if rank == 0:
            assert_same(got, torch.load(out / f"final-{name}.pt"), f"resumed on {world} from {source_world} [{name}]")


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        if scenario == "muon_fsdp_train":
            muon_fsdp_train(out)
        elif scenario == "muon_fsdp_resume":
            muon_fsdp_resume(out, sys.argv[3])
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_after_success()


if __name__ == "__main__":
    main()
