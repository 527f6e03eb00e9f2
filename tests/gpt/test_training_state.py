"""Schedule tables (gpt/schedules.py) and the entire training state (gpt/training_state.py):
bit-exact resume of a tiny packed-document run with PackedMuonAdamW, refusals, the reference export."""
import json
import math
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from packed_adamw.core.codecs import join_master
from packed_adamw.tokenizer.tape import TapeReader, build_tape
from packed_adamw.torch.combined import PackedMuonAdamW, muon_param_groups
from packed_adamw.torch.muon import PackedMuon
from packed_adamw.torch.gpt.packed_data import PackedDocumentLoader
from packed_adamw.torch.gpt.schedules import ScheduleConfig, apply_schedule, build_schedule
from packed_adamw.torch.gpt.training_state import (
    NOT_TRAJECTORY_CODE, SIGN_CONVENTION, TrainingStateError, code_identity, export_reference_layout, load_state,
    param_group_from_json, read_state, save_state, state_file_name,
)

WORDS = "the king and queen of a far country went over hills to see what lay beyond".split()
B, T, VOCAB = 2, 12, 64


# ---- schedules ----------------------------------------------------------------------------------
def test_schedule_tables_follow_nanochat():
    tables = build_schedule(ScheduleConfig(num_steps=1000, weight_decay=0.2)).tables
    lr, mu, wd = tables["lr_multiplier"], tables["muon_momentum"], tables["muon_weight_decay"]
    assert all(t.dtype == np.float64 and t.shape == (1000,) for t in (lr, mu, wd))
    warmdown = 650  # round(0.65 * 1000); the warmdown starts after step 350
    assert lr[0] == 1 / 40 and lr[39] == 1.0 and lr[350] == 1.0
    assert lr[351] == 649 / warmdown + (1 - 649 / warmdown) * 0.05
    assert lr[999] == 1 / warmdown + (1 - 1 / warmdown) * 0.05
    assert mu[0] == 0.85 and mu[100] == 0.75 * 0.85 + 0.25 * 0.97
    assert mu[349] == (1 - 349 / 400) * 0.85 + 349 / 400 * 0.97  # momentum warmup still on
    assert mu[400] == (1 - 50 / warmdown) * 0.97 + 50 / warmdown * 0.90  # in the lr warmdown
    assert wd[0] == 0.2 and wd[500] == 0.2 * 0.5 * (1 + math.cos(math.pi / 2))
    earlier = build_schedule(ScheduleConfig(num_steps=1000, warmdown_ratio=0.5, final_lr_frac=0.0,
                                            momentum_peak=0.95, momentum_warmup_steps=300, momentum_final=None,
                                            weight_decay=0.2, weight_decay_shape="linear")).tables
    assert earlier["muon_momentum"][300] == 0.95 and earlier["muon_momentum"][999] == 0.95
    assert earlier["muon_weight_decay"][250] == 0.2 * 0.75 and earlier["lr_multiplier"][999] == 1 / 500
    with pytest.raises(ValueError, match="weight_decay_shape"):
        ScheduleConfig(num_steps=10, weight_decay_shape="step")


def test_apply_schedule_sets_each_group():
    model = TinyLM()
    optimizer = make_optimizer(model)
    tables = build_schedule(ScheduleConfig(num_steps=10, warmup_steps=4, weight_decay=0.1))
    row = apply_schedule(optimizer, tables, 2)
    muon, adamw = optimizer.param_groups
    assert muon["initial_lr"] == 0.02 and adamw["initial_lr"] == 0.01
    assert muon["lr"] == 0.02 * 0.75 and adamw["lr"] == 0.01 * 0.75
    assert muon["momentum"] == row["muon_momentum"] == tables.tables["muon_momentum"][2]
    assert muon["weight_decay"] == tables.tables["muon_weight_decay"][2] and adamw["weight_decay"] == 0.0
    apply_schedule(optimizer, tables, 3)  # from the base lr, not from the last step's lr
    assert muon["lr"] == 0.02 and "momentum" not in adamw
    with pytest.raises(IndexError, match="outside the schedule's 10 steps"):
        apply_schedule(optimizer, tables, 10)


# ---- a tiny packed-document run -------------------------------------------------------------------
class TinyLM(torch.nn.Module):
    """Embedding, two matrices (Muon), a norm weight, a scalar, a head (AdamW); dropout draws
    from the RNG, so a resume that lost the generator state would not match."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(16))
        self.gate = torch.nn.Parameter(torch.tensor(0.5))
        self.head = torch.nn.Linear(16, VOCAB, bias=False)
        self.register_buffer("scale", torch.tensor(1.25))
        self.to(dtype)

    def forward(self, inputs, targets):
        x = self.embed(inputs % VOCAB)
        x = x + self.gate * self.down(F.dropout(F.relu(self.up(x)).square(), 0.1))
        x = F.rms_norm(x, (16,)) * self.norm * self.scale
        return F.cross_entropy(self.head(x).float().reshape(-1, VOCAB), (targets % VOCAB).reshape(-1))


def make_optimizer(model, **options):
    groups = muon_param_groups(model, exclude=("head",), muon=dict(lr=0.02), adamw=dict(lr=0.01, weight_decay=0.0))
    return PackedMuonAdamW(groups, **options)


@pytest.fixture(scope="module")
def tape(tmp_path_factory):
    rng = random.Random(1)
    documents = [(f"d{i}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))) for i in range(40)]
    path = tmp_path_factory.mktemp("state") / "a.tape"
    build_tape(documents, path)
    return path


class Run:
    def __init__(self, tape, dtype, seed=0, device="cpu", **optimizer_options):
        torch.manual_seed(seed)
        self.device = device
        self.model = TinyLM(dtype).to(device)
        self.optimizer = make_optimizer(self.model, **optimizer_options)
        self.loader = PackedDocumentLoader(TapeReader(tape), B, T)
        self.schedule = build_schedule(ScheduleConfig(num_steps=20, warmup_steps=3, momentum_warmup_steps=5,
                                                      weight_decay=0.05))
        self.config = {"dtype": str(dtype), "batch_size": B, "context": T, "lr": 0.02}
        self.step = self.t_step = 0

    def train(self, steps):
        for _ in range(steps):
            batch = self.loader.next_batch()
            apply_schedule(self.optimizer, self.schedule, self.t_step)
            self.model(batch.inputs.to(self.device), batch.targets.to(self.device)).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.step += 1
            self.t_step += 1

    def save(self, directory):
        return save_state(directory / state_file_name(self.step), model=self.model, optimizer=self.optimizer,
                          loader=self.loader, schedule=self.schedule, config=self.config, step=self.step,
                          t_step=self.t_step)

    def load(self, path, **kwargs):
        loaded = load_state(path, model=self.model, optimizer=self.optimizer, loader=self.loader,
                            config=kwargs.pop("config", self.config), schedule=self.schedule, **kwargs)
        self.step, self.t_step = loaded.step, loaded.t_step
        return loaded


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same_run(a: Run, b: Run):
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert p.dtype == q.dtype and torch.equal(bits(p), bits(q)), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sa["state"].items():
        assert entry.keys() == sb["state"][index].keys()
        for key, value in entry.items():
            other = sb["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and torch.equal(bits(value), bits(other)), (index, key)
            else:
                assert value == other, (index, key)
    assert a.loader.state_dict() == b.loader.state_dict() and (a.step, a.t_step) == (b.step, b.t_step)


def rng_states(device: str) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if device == "cuda" else [])


def check_resume(tape, tmp_path, dtype, device):
    """Train 3 steps, save, train 3 more; versus load into a fresh run (other weights, other RNG)
    and train 3: the same bits everywhere."""
    straight = Run(tape, dtype, device=device)
    straight.train(3)
    path = straight.save(tmp_path)
    assert path.name == "state_step000003.safetensors"
    straight.train(3)
    rng_after = rng_states(device)

    resumed = Run(tape, dtype, seed=1, device=device)  # other initial weights: everything comes from the file
    torch.manual_seed(99)
    loaded = resumed.load(path)
    assert (loaded.step, loaded.t_step) == (3, 3)
    assert torch.equal(loaded.batch.inputs, resumed.loader.peek().inputs)
    resumed.train(3)
    assert all(torch.equal(a, b) for a, b in zip(rng_states(device), rng_after))
    assert_same_run(straight, resumed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-masters", "fp32"])
def test_resume_is_bit_exact(tape, tmp_path, dtype):
    check_resume(tape, tmp_path, dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-masters", "fp32"])
def test_resume_is_bit_exact_on_cuda(tape, tmp_path, dtype):
    """The Triton kernels' steps, the CUDA generator (dropout) and tensors moved to and from the GPU."""
    check_resume(tape, tmp_path, dtype, "cuda")


def test_state_holds_the_layout(tape, tmp_path):
    run = Run(tape, torch.bfloat16)
    run.train(2)
    next_batch = run.loader.peek()
    tensors, metadata = read_state(run.save(tmp_path))
    masters = dict(zip((n for g in run.optimizer.param_groups for n in g["param_names"]),
                       run.optimizer.master_weights()))
    for name, p in run.model.named_parameters():
        assert torch.equal(bits(tensors[f"params/{name}/w"]), bits(p))
        mantissa = tensors[f"params/{name}/mantissa"]
        assert mantissa.dtype == torch.uint16
        # the mantissa is the FP32 master's low 16 bits
        low = masters[name].detach().view(torch.int32) & 0xFFFF
        assert torch.equal(mantissa.view(torch.int16).to(torch.int32) & 0xFFFF, low), name
    assert tensors["params/up.weight/opt/momentum_code"].dtype == torch.int16
    assert tensors["params/head.weight/opt/words"].dtype == torch.uint32
    assert tensors["buffers/scale"].item() == 1.25
    for key, value in zip(("inputs", "targets", "cu_seqlens"), next_batch):
        assert torch.equal(tensors[f"batch/{key}"], value)
    assert tensors["batch/cu_seqlens"].dtype == torch.int32
    assert np.array_equal(tensors["schedule/muon_momentum"].numpy(), run.schedule.tables["muon_momentum"])
    assert tensors["rng/torch_cpu"].dtype == torch.uint8
    assert (metadata["step"], metadata["t_step"]) == (2, 2) and metadata["config"] == run.config
    assert metadata["code"]["files"]["packed_adamw.torch/gpt/training_state.py"]
    entries = {e["name"]: e for e in metadata["optimizer"]["entries"].values()}
    assert entries["head.weight"]["scalars"] == {"step": 2} and entries["head.weight"]["kind"] == "adamw"
    assert entries["up.weight"]["tensors"] == ["lo", "momentum_code", "mu_exponent"]
    assert entries["up.weight"]["kind"] == "muon"


def test_refuses_other_config_code_or_damage(tape, tmp_path):
    run = Run(tape, torch.float32)
    run.train(1)
    path = run.save(tmp_path)
    other = Run(tape, torch.float32, seed=1)
    before = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(TrainingStateError, match="lr=0.02.*lr=0.03"):
        other.load(path, config={**run.config, "lr": 0.03})
    code = code_identity()
    changed = {**code, "sha256": "0" * 64, "files": {**code["files"], "packed_adamw.torch/combined.py": "x"}}
    with pytest.raises(TrainingStateError, match="(?s)combined.py: changed.*pass --allow-code-change"):
        other.load(path, code=changed)
    assert all(torch.equal(a, p) for a, p in zip(before, other.model.parameters()))  # nothing changed
    with pytest.warns(UserWarning, match="combined.py: changed"):
        other.load(path, code=changed, allow_code_change=True)
    assert_same_run(run, other)

    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(TrainingStateError, match="checksum"):
        read_state(damaged)
    pickled = tmp_path / "state.pt"
    torch.save({"params": {}}, pickled)
    with pytest.raises(TrainingStateError, match="pickle"):
        read_state(pickled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-masters", "fp32"])
def test_export_has_reference_signs(tape, tmp_path, dtype):
    """FP32 weights too: their master is the weight itself, a tensor of its own in the file."""
    run = Run(tape, dtype)
    # One step from zero moments: AdamW's m = (1 - beta1) * g, Muon's buffer = (1 - momentum) * g.
    batch = run.loader.next_batch()
    apply_schedule(run.optimizer, run.schedule, run.t_step)
    run.model(batch.inputs, batch.targets).backward()
    grads = {name: p.grad.float().clone() for name, p in run.model.named_parameters()}
    run.optimizer.step()
    run.step += 1
    run.t_step += 1
    out = export_reference_layout(run.save(tmp_path), tmp_path / "export.safetensors")
    tensors, metadata = read_state(out, expected_format="packed-adamw-reference-export/1")
    assert metadata["sign_convention"] == SIGN_CONVENTION
    masters = run.optimizer.master_weights()
    names = [n for g in run.optimizer.param_groups for n in g["param_names"]]
    for name, master in zip(names, masters):
        assert torch.equal(bits(tensors[f"params/{name}/master"]), bits(master)), name
        w = tensors[f"params/{name}/w"]
        if dtype == torch.float32:
            assert torch.equal(bits(w), bits(master)) and f"params/{name}/mantissa" not in tensors, name
            continue
        mantissa = tensors[f"params/{name}/mantissa"]
        joined = join_master(w.view(torch.int16).numpy(), mantissa.numpy())
        assert np.array_equal(joined.view(np.uint32), master.detach().numpy().view(np.uint32))
    # Update directions: every nonzero first moment points against the loss gradient.
    for name in ("up.weight", "down.weight", "head.weight", "embed.weight", "norm", "gate"):
        first, g = tensors[f"params/{name}/first_mntm"].reshape(-1), grads[name].reshape(-1)
        nonzero = first != 0
        assert nonzero.sum() > 0.5 * (g != 0).sum(), name  # (the rows of tokens not in the batch have none)
        assert (torch.sign(first[nonzero]) == -torch.sign(g[nonzero])).all(), name
    assert (tensors["params/head.weight/scnd_mntm"] >= 0).all()
    assert "params/up.weight/scnd_mntm" not in tensors  # Muon keeps one moment
    # Muon's first moment is the momentum's value: its codes times 2**mu_exponent (11 bits kept
    # down to 30 binades below the matrix's largest), here (1 - momentum) * g.
    momentum = next(g["momentum"] for g in run.optimizer.param_groups if g["kind"] == "muon")
    for name in ("up.weight", "down.weight"):
        expected, first = (1 - momentum) * grads[name], -tensors[f"params/{name}/first_mntm"]
        tiny = expected.abs().max() * 2.0**-30
        assert torch.allclose(first, expected, rtol=2.0**-10, atol=float(tiny)), name
    assert not torch.signbit(tensors["params/gate/first_mntm"][tensors["params/gate/first_mntm"] == 0]).any()
    assert json.loads(json.dumps(metadata["config"])) == run.config


def test_export_never_replaces_the_state_and_replaces_an_export_only_when_asked(tape, tmp_path):
    """The state itself, under any spelling (a symlink, a path through '..'), is refused even
    with overwrite=True; an existing export only with overwrite=True (a bool: "no" is refused);
    a path under a file is refused naming the file."""
    run = Run(tape, torch.bfloat16)
    run.train(1)
    state = run.save(tmp_path)
    written = state.read_bytes()
    (tmp_path / "sub").mkdir()
    link = tmp_path / "link.safetensors"
    link.symlink_to(state)
    for spelling in (state, tmp_path / "sub" / ".." / state.name, link):
        for overwrite in (False, True):
            with pytest.raises(ValueError, match=f"(?s){re.escape(str(spelling))}.*is the training state it "
                                                 "exports.*another output path"):
                export_reference_layout(state, spelling, overwrite=overwrite)
    assert state.read_bytes() == written and link.is_symlink()
    run.load(state)  # still resumable

    out = export_reference_layout(state, tmp_path / "export.safetensors")
    exported = out.read_bytes()
    run.train(1)
    later = run.save(tmp_path)
    with pytest.raises(FileExistsError, match=f"{re.escape(str(out))} exists.*overwrite=True"):
        export_reference_layout(later, out)
    assert out.read_bytes() == exported
    with pytest.raises(TypeError, match="overwrite must be True or False, got 'no'"):
        export_reference_layout(later, out, overwrite="no")  # a truthy string is not a yes
    assert out.read_bytes() == exported
    export_reference_layout(later, out, overwrite=True)
    assert read_state(out, expected_format="packed-adamw-reference-export/1")[1]["step"] == 2
    under_a_file = state / "export.safetensors"  # a path under the state file
    with pytest.raises(NotADirectoryError, match=f"{re.escape(str(under_a_file))} lies under {re.escape(str(state))}, "
                                                 "which is not a directory"):
        export_reference_layout(later, under_a_file)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left


def test_export_refuses_nonfinite_weights_and_moments(tape, tmp_path):
    """A NaN weight and an Inf bf16 momentum code are named (the state's tensors) before anything is
    written; Muon's bf16 mode keeps codes that can hold them."""
    run = Run(tape, torch.float32, mode="bf16")
    run.train(1)
    with torch.no_grad():
        run.model.norm[3] = float("nan")
    run.optimizer.state[run.model.down.weight]["momentum_code"].view(-1)[7] = 0x7F80  # bf16 +Inf
    state = run.save(tmp_path)
    out = tmp_path / "export.safetensors"
    with pytest.raises(TrainingStateError, match=f"(?s){re.escape(str(state))}.*params/down.weight/opt/"
                                                 r"momentum_code: 1 of 512 values.*params/norm/w: 1 of 16 values.*"
                                                 "export an earlier state"):
        export_reference_layout(state, out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [state.name]


def test_resume_refuses_nonfinite_weights(tape, tmp_path):
    """An Inf weight (a state written as the run diverged) is refused on load, naming the state's
    tensors as the export does, before anything changes: a resume would only diverge again."""
    run = Run(tape, torch.bfloat16)
    run.train(1)
    with torch.no_grad():
        run.model.norm[2] = float("inf")
    state = run.save(tmp_path)
    other = Run(tape, torch.bfloat16, seed=1)
    other.train(1)
    snapshot = ([p.detach().clone() for p in other.model.parameters()], optimizer_snapshot(other.optimizer))
    cursor = other.loader.state_dict()
    with pytest.raises(TrainingStateError, match=f"(?s)training state {re.escape(str(state))} holds NaN or Inf:.*"
                                                 "params/norm/w: 1 of 16 values.*resume an earlier state"):
        other.load(state)
    assert_snapshot(other, snapshot)
    assert other.loader.state_dict() == cursor


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_resume_refuses_a_nonfinite_momentum(tape, tmp_path, mode):
    """A NaN momentum (bf16 mode: a NaN code) would freeze its matrix for the rest of the run:
    refused on load (check_finite, ahead of PackedMuon's own check in its load_state_dict),
    named with the parameter and the file, before anything changes."""
    run = Run(tape, torch.float32, mode=mode)
    run.train(1)
    momentum = run.optimizer.state[run.model.up.weight][run.optimizer.rules["muon"].state_format.state_key]
    momentum.view(-1)[3] = float("nan") if momentum.is_floating_point() else 0x7FC0  # (a bf16 quiet NaN)
    state = run.save(tmp_path)
    other = Run(tape, torch.float32, seed=1, mode=mode)
    other.train(1)
    snapshot = ([p.detach().clone() for p in other.model.parameters()], optimizer_snapshot(other.optimizer))
    with pytest.raises(TrainingStateError, match=f"(?s)training state {re.escape(str(state))}.*'up.weight'"):
        other.load(state)
    assert_snapshot(other, snapshot)


@pytest.mark.parametrize("exponent", [1000, -300])
def test_resume_and_export_refuse_an_exponent_no_step_stores(tape, tmp_path, exponent):
    """A packed Muon exponent outside the range a step stores (an edited state) is refused by
    core's one check, naming the tensor and the range, on resume and on export, before anything
    changes, instead of a raw error from the decoder."""
    run = Run(tape, torch.float32)
    run.train(1)
    run.optimizer.state[run.model.up.weight]["mu_exponent"].fill_(exponent)
    state = run.save(tmp_path)
    other = Run(tape, torch.float32, seed=1)
    other.train(1)
    snapshot = ([p.detach().clone() for p in other.model.parameters()], optimizer_snapshot(other.optimizer))
    pattern = f"training state {re.escape(str(state))}: params/up.weight/opt/mu_exponent"
    with pytest.raises(TrainingStateError, match=pattern):
        other.load(state)
    assert_snapshot(other, snapshot)
    with pytest.raises(TrainingStateError, match=pattern):
        export_reference_layout(state, tmp_path / "export.safetensors")
    assert not (tmp_path / "export.safetensors").exists()


def optimizer_snapshot(optimizer) -> list:
    """Every tensor of the optimizer's state (bits) and every group entry, for 'nothing changed'."""
    sd = optimizer.state_dict()
    tensors = [(i, k, bits(v).clone()) for i, e in sd["state"].items() for k, v in e.items()
               if isinstance(v, torch.Tensor)]
    return [tensors, json.dumps(sd["param_groups"], sort_keys=True)]


def assert_snapshot(run, snapshot):
    params, optimizer = snapshot
    assert all(torch.equal(bits(a), bits(p)) for a, p in zip(params, run.model.parameters()))
    now = optimizer_snapshot(run.optimizer)
    assert now[1] == optimizer[1] and len(now[0]) == len(optimizer[0])
    assert all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(now[0], optimizer[0]))


def test_a_model_misfit_is_refused_before_anything_loads_and_fewer_devices_are_not(tape, tmp_path, monkeypatch):
    """A buffer of another shape is refused before the optimizer, the model or the loader change
    (not by a raw error midway); more saved CUDA generator states than visible devices are not."""
    run = Run(tape, torch.bfloat16)
    run.train(1)
    with monkeypatch.context() as m:  # a state written where two CUDA devices had generators
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8) for _ in range(2)])
        two_devices = run.save(tmp_path)
    other = Run(tape, torch.bfloat16, seed=1)
    other.train(1)  # optimizer state of its own, which a half-load would overwrite
    snapshot = ([p.detach().clone() for p in other.model.parameters()], optimizer_snapshot(other.optimizer))
    cursor = other.loader.state_dict()

    other.model.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(TrainingStateError, match=r"buffer scale: saved torch.bfloat16 \(\), the model has "
                                                 r"torch.bfloat16 \(3,\)"):
        other.load(two_devices)
    assert_snapshot(other, snapshot)
    other.model.register_buffer("scale", torch.tensor(1.25, dtype=torch.bfloat16))

    assert other.loader.state_dict() == cursor

    # Fewer visible devices than saved generator states (a GPU run resumed on fewer GPUs): the
    # visible devices' states are restored, with a warning.
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    with pytest.warns(UserWarning, match=f"{two_devices}.*2 devices, this process sees 1: restoring those of "
                                         "devices 0 to 0 only"):
        run.load(two_devices)
    assert len(restored) == 1 and torch.equal(restored[0], torch.zeros(16, dtype=torch.uint8))


def test_config_with_tuples_matches_its_json_form(tape, tmp_path):
    """The saved config went through JSON (tuples became lists); the live one compares as JSON
    gives it back."""
    run = Run(tape, torch.float32)
    run.config = {**run.config, "betas": (0.9, 0.95), "model": {"windows": ((128, 1), (256, 2))}}
    run.train(1)
    path = run.save(tmp_path)
    other = Run(tape, torch.float32, seed=1)
    other.load(path, config=run.config)
    assert_same_run(run, other)
    with pytest.raises(TrainingStateError, match=r"model.windows=\[\[128, 1\], \[256, 2\]\], this run has "
                                                 r"model.windows=\[\[128, 1\], \[256, 3\]\]"):
        other.load(path, config={**run.config, "model": {"windows": ((128, 1), (256, 3))}})


def test_code_identity_covers_what_decides_the_trajectory(tape, tmp_path):
    files = code_identity()["files"]
    for kept in ("packed_adamw.core/codecs.py", "packed_adamw.torch/muon.py", "packed_adamw.torch/optimizer.py",
                 "packed_adamw.torch/gpt/chat_model.py", "packed_adamw.torch/gpt/packed_data.py",
                 "packed_adamw.torch/gpt/schedules.py", "packed_adamw.torch/gpt/training_state.py",
                 "packed_adamw.torch/gpt/chat_train.py", "packed_adamw.tokenizer/tape.py",
                 "packed_adamw.torch/gpt/optimizers.py", "packed_adamw.torch/gpt/unsharded_twin.py"):
        assert kept in files, kept
    for name in NOT_TRAJECTORY_CODE:
        assert name not in files, name
    assert "packed_adamw.torch/gpt/walkthrough.py" in NOT_TRAJECTORY_CODE
    assert "packed_adamw.torch/gpt/run_directory.py" in NOT_TRAJECTORY_CODE  # its guards decide no step
    # A state recording another walkthrough (as states did before the narrowing) still loads.
    run = Run(tape, torch.float32)
    run.train(1)
    saved_code = code_identity()
    saved_code["files"]["packed_adamw.torch/gpt/walkthrough.py"] = "0" * 64
    path = save_state(tmp_path / "s.safetensors", model=run.model, optimizer=run.optimizer, loader=run.loader,
                      schedule=run.schedule, config=run.config, step=1, t_step=1, code=saved_code)
    other = Run(tape, torch.float32, seed=1)
    other.load(path)
    assert_same_run(run, other)


def test_single_rule_optimizers_are_named_by_their_rule(tape, tmp_path):
    """PackedMuon's `rule_name` names the rule (a subclass too); groups come back with tuples."""
    class ScaledMuon(PackedMuon):
        pass

    run = Run(tape, torch.float32)
    matrices = [run.model.up.weight, run.model.down.weight]
    run.optimizer = ScaledMuon(matrices, lr=0.02, ns_coefficients=(3.0, -4.0, 2.0))
    tensors, metadata = read_state(run.save(tmp_path))
    assert {e["kind"] for e in metadata["optimizer"]["entries"].values()} == {"muon"}
    assert set(metadata["optimizer"]["formats"]) == {"muon"}
    group = param_group_from_json(metadata["optimizer"]["param_groups"][0])
    assert group["ns_coefficients"] == (3.0, -4.0, 2.0) and isinstance(group["params"], list)
    assert param_group_from_json({"params": [0], "param_names": ["a"], "x": [[1, 2], [3]]}) == {
        "params": [0], "param_names": ["a"], "x": ((1, 2), (3,))}


def own_format_optimizer(model, own: bool = True) -> PackedMuonAdamW:
    """TinyLM's norm and gate (its vector and scalar) in fp32 AdamW state and `down` in fp32 Muon
    state, groups of their own beside packed ones (as chat_model keeps nanochat's scalars)."""
    fp32 = {"mode": "fp32"} if own else {}
    named = dict(model.named_parameters())

    def group(kind, names, **options):
        return {"params": [named[n] for n in names], "param_names": list(names), "kind": kind, **options}

    return PackedMuonAdamW([group("muon", ["up.weight"], lr=0.02), group("muon", ["down.weight"], lr=0.02, **fp32),
                            group("adamw", ["embed.weight", "head.weight"], lr=0.01, weight_decay=0.0),
                            group("adamw", ["norm", "gate"], lr=0.01, weight_decay=0.0, **fp32)])


def own_format_run(tape, seed=0, own=True) -> Run:
    run = Run(tape, torch.bfloat16, seed=seed)
    run.optimizer = own_format_optimizer(run.model, own)
    return run


def rewritten(path, out, change) -> None:
    """The state at `path` with `change(metadata)` applied, checksummed again, written to `out`
    (a state as an earlier release wrote it)."""
    from safetensors.torch import save_file

    from packed_adamw.torch.gpt.checkpoint import _checkpoint_sha256

    tensors, metadata = read_state(path)
    change(metadata)
    metadata["sha256"] = _checkpoint_sha256(tensors, metadata)
    save_file(tensors, str(out), metadata={key: json.dumps(value) for key, value in metadata.items()})


def test_groups_of_their_own_state_format_resume_bit_exact_and_export_in_their_formats(tape, tmp_path):
    """A PackedMuonAdamW whose groups keep different formats of one rule saves each tensor in its
    format, resumes bit for bit, exports each moment decoded by its own format, and is refused by
    an optimizer whose groups keep other formats (naming the group and the file)."""
    straight = own_format_run(tape)
    straight.train(2)
    path = straight.save(tmp_path)
    tensors, metadata = read_state(path)
    formats = metadata["optimizer"]["formats"]
    assert set(formats) == {"muon", "muon:muon-fp32:mu=f32", "adamw", "adamw:fp32:m=f32,v=f32"}
    entries = {e["name"]: e for e in metadata["optimizer"]["entries"].values()}
    assert entries["gate"]["rule"] == "adamw:fp32:m=f32,v=f32" and entries["head.weight"]["rule"] == "adamw"
    assert formats[entries["gate"]["rule"]]["mode"] == "fp32" and tensors["params/gate/opt/moments"].shape == (2,)
    assert tensors["params/down.weight/opt/momentum_buffer"].dtype == torch.float32
    assert tensors["params/head.weight/opt/words"].dtype == torch.uint32
    straight.train(2)

    resumed = own_format_run(tape, seed=1)
    resumed.load(path)
    resumed.train(2)
    assert_same_run(straight, resumed)

    exported, _ = read_state(export_reference_layout(path, tmp_path / "export.safetensors"),
                             expected_format="packed-adamw-reference-export/1")
    moments = tensors["params/norm/opt/moments"]
    assert torch.equal(bits(exported["params/norm/first_mntm"]), bits(0.0 - moments[0]))
    assert torch.equal(bits(exported["params/norm/scnd_mntm"]), bits(moments[1]))
    assert torch.equal(bits(exported["params/down.weight/first_mntm"]),
                       bits(0.0 - tensors["params/down.weight/opt/momentum_buffer"]))

    packed = own_format_run(tape, seed=1, own=False)
    with pytest.raises(TrainingStateError, match=rf"training state {re.escape(str(path))}: load_state_dict: saved "
                                                 r"param_groups\[1\] \(muon\) has format 'muon-fp32:mu=f32'"):
        packed.load(path)


def test_a_state_written_before_entries_named_their_rule_loads_and_exports(tape, tmp_path):
    """A state of one format per kind, its entries naming no rule (as written before groups had
    formats of their own), resumes bit for bit and exports as before."""
    straight = Run(tape, torch.bfloat16)
    straight.train(2)
    path = straight.save(tmp_path)
    old = tmp_path / "old.safetensors"

    def as_written_before(metadata):
        for entry in metadata["optimizer"]["entries"].values():
            assert entry.pop("rule") == entry["kind"]
        assert set(metadata["optimizer"]["formats"]) == {"muon", "adamw"}

    rewritten(path, old, as_written_before)
    straight.train(2)
    resumed = Run(tape, torch.bfloat16, seed=1)
    resumed.load(old)
    resumed.train(2)
    assert_same_run(straight, resumed)
    ours, theirs = (read_state(export_reference_layout(p, tmp_path / f"{p.stem}.export"),
                               expected_format="packed-adamw-reference-export/1")[0] for p in (path, old))
    assert ours.keys() == theirs.keys() and all(torch.equal(bits(ours[k]), bits(theirs[k])) for k in ours)
