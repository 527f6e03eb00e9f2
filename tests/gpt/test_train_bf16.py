"""The trainer with --param-dtype bf16: bf16 live weights, PackedAdamW's split FP32 masters (or
the torch AdamW baseline on bf16 weights), checkpoints holding weights, low halves and words,
bit-exact resume (one process, DDP, FSDP2), and the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gpt_helpers import MICRO, assert_bitwise_equal, build_data, checkpoint_tensors, run_train
from packed_adamw.core import codecs as formats
from packed_adamw.inspect import load_state_file
from packed_adamw.inspect.__main__ import main as inspect_main
from packed_adamw.torch.gpt import checkpoint
from packed_adamw.torch.gpt.optimizers import optimizer_kind
from packed_adamw.torch.gpt.run_identity import out_dir, trajectory
from packed_adamw.torch.gpt.train import TrainConfig, build_model, gradient_norm_, main
from layout import TESTS

BF16 = ["--param-dtype", "bf16"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_data(tmp_path_factory.mktemp("data"))


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def train_in_process(*args) -> None:
    assert main(list(map(str, args))) == 0


def bits16(t: torch.Tensor) -> np.ndarray:
    """A bf16 or int16 tensor's 16-bit patterns."""
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def bits32(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int32).numpy().view(np.uint32)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, data_dir) -> Path:
    """A finished 20-step micro run with bf16 weights and split masters."""
    out = tmp_path_factory.mktemp("bf16") / "out"
    train_in_process(*MICRO, *BF16, "--data", data_dir, "--out", out, "--max-steps", 20)
    return out


def test_bf16_run_trains_bf16_weights_with_split_masters(bf16_run):
    result = summary(bf16_run)
    assert result["stopped_because"] == "max_steps" and result["config"]["param_dtype"] == "bf16"
    losses = [r["loss"] for r in map(json.loads, (bf16_run / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 20 and np.mean(losses[-5:]) < losses[0] - 0.1  # it learns
    tensors, metadata = checkpoint.read_checkpoint(bf16_run / "checkpoint.safetensors")
    assert metadata["config"]["param_dtype"] == "bf16"
    weights = {k: t for k, t in tensors.items() if k.startswith("model/")}
    assert len(weights) == 28 and all(t.dtype == torch.bfloat16 for t in weights.values())
    # Every parameter's state: its word and its low half, of the parameter's shape.
    names = [n for group in metadata["optimizer"]["param_groups"] for n in group["param_names"]]
    lows = []
    for index, name in enumerate(names):
        word, lo = tensors[f"optimizer/state/{index}/words"], tensors[f"optimizer/state/{index}/lo"]
        assert word.dtype == torch.uint32 and lo.dtype == torch.int16
        assert word.shape == lo.shape == weights[f"model/{name}"].shape, name
        lows.append(lo)
    # The masters hold more than the weights: most low halves are nonzero.
    assert np.mean([bool(lo.any()) for lo in lows]) > 0.9


def trainer_pieces(config: TrainConfig):
    """Model and optimizer as the trainer builds them for a fresh run (CPU)."""
    model, initial = build_model(config, torch.device("cpu"))
    kind = optimizer_kind(config.optimizer)
    optimizer = kind.build(model, config)
    kind.start_masters(optimizer, model, initial)
    return model, optimizer


def optimizer_names(model, optimizer) -> list[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def test_masters_start_at_the_fp32_initialisation_and_weights_at_its_split():
    """A fresh split run's masters are the FP32 run's initial parameters bit for bit; its
    weights, and the torch AdamW baseline's, are their split weights (nearest bf16)."""
    fp32_model, _ = trainer_pieces(TrainConfig(config="micro"))
    fp32 = dict(fp32_model.named_parameters())
    model, optimizer = trainer_pieces(TrainConfig(config="micro", param_dtype="bf16"))
    baseline, _ = trainer_pieces(TrainConfig(config="micro", param_dtype="bf16", optimizer="torch-adamw"))
    names = optimizer_names(model, optimizer)
    masters = optimizer.master_weights()
    assert len(masters) == len(fp32) == 28
    some_low_bits = False
    for name, master in zip(names, masters):
        assert np.array_equal(bits32(master), bits32(fp32[name])), name
        weight_bits, lo = formats.split_master(fp32[name].detach().numpy())
        assert np.array_equal(bits16(dict(model.named_parameters())[name]), weight_bits), name
        assert np.array_equal(bits16(dict(baseline.named_parameters())[name]), weight_bits), name
        some_low_bits |= bool(lo.any())
    assert some_low_bits  # the normal initialisation is not bf16-exact: the low halves matter


def test_a_loaded_checkpoint_gives_back_its_weights_low_halves_and_masters(bf16_run):
    """Loading restores w and lo bit for bit: the optimizer's masters are the join of the
    file's halves, and the split rule applied to them gives the model's live weights."""
    config = TrainConfig(config="micro", param_dtype="bf16", batch_size=4, max_steps=20)
    model, optimizer = trainer_pieces(config)

    class NoTape:
        def load_state_dict(self, state):
            pass

    entry = checkpoint.load_training_state(bf16_run / "checkpoint.safetensors", model=model, optimizer=optimizer,
                                           tape=NoTape(), config=trajectory(config))
    assert entry["step"] == 20
    tensors = checkpoint_tensors(bf16_run / "checkpoint.safetensors")
    params = dict(model.named_parameters())
    for index, (name, master) in enumerate(zip(optimizer_names(model, optimizer), optimizer.master_weights())):
        weight, lo = tensors[f"model/{name}"], tensors[f"optimizer/state/{index}/lo"]
        assert np.array_equal(bits32(master), formats.join_master(bits16(weight), bits16(lo)).view(np.uint32)), name
        weight_bits, low_half = formats.split_master(master.detach().numpy())
        assert np.array_equal(weight_bits, bits16(params[name])), name
        assert np.array_equal(low_half.view(np.uint16), bits16(optimizer.state[params[name]]["lo"])), name


def test_bf16_split_run_resumed_in_a_new_process_is_bit_exact(tmp_path, data_dir):
    common = [*MICRO, *BF16, "--data", data_dir, "--max-steps", 16]
    train_in_process(*common, "--out", tmp_path / "whole")
    train_in_process(*common, "--out", tmp_path / "split", "--stop-at-step", 7)
    run_train(*common, "--out", tmp_path / "split", "--resume", "auto")
    assert summary(tmp_path / "split")["steps_this_session"] == 9
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", tmp_path / "split" / "checkpoint.safetensors")
    assert any(k.endswith("/lo") for k in checkpoint_tensors(tmp_path / "split" / "checkpoint.safetensors"))


def test_torch_adamw_on_bf16_weights_trains_and_resumes_exactly(tmp_path, data_dir):
    """The inexact baseline: torch.optim.AdamW on bf16 parameters, bf16 moments, no masters."""
    common = [*MICRO, *BF16, "--optimizer", "torch-adamw", "--data", data_dir, "--max-steps", 8]
    train_in_process(*common, "--out", tmp_path / "whole")
    train_in_process(*common, "--out", tmp_path / "split", "--stop-at-step", 3)
    train_in_process(*common, "--out", tmp_path / "split", "--resume", "auto")
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", tmp_path / "split" / "checkpoint.safetensors")
    tensors = checkpoint_tensors(tmp_path / "whole" / "checkpoint.safetensors")
    assert tensors["model/tok_emb.weight"].dtype == torch.bfloat16
    assert tensors["optimizer/state/0/exp_avg"].dtype == torch.bfloat16
    assert not any(k.endswith(("/lo", "/words")) for k in tensors)
    assert summary(tmp_path / "whole")["config"]["param_dtype"] == "bf16"
    # The inspect tool reads its bf16 moments and weights, widened to float32 exactly.
    state_file = load_state_file(tmp_path / "whole" / "checkpoint.safetensors")
    first = state_file.tensors[0]
    assert first.moments.dtype == np.float32 and first.param.dtype == np.float32
    assert torch.equal(torch.from_numpy(first.moments[0]), tensors["optimizer/state/0/exp_avg"].float())
    assert torch.equal(torch.from_numpy(first.param), tensors[f"model/{first.name}"].float())


@pytest.fixture(scope="module")
def bf16_fp32_mode_run(tmp_path_factory, data_dir) -> Path:
    out = tmp_path_factory.mktemp("bf16-fp32") / "out"
    train_in_process(*MICRO, *BF16, "--mode", "fp32", "--data", data_dir, "--out", out, "--max-steps", 3)
    return out


@pytest.mark.parametrize("run", ["bf16_run", "bf16_fp32_mode_run"])
def test_inspect_reads_a_bf16_run_checkpoint_with_its_masters_as_the_parameters(run, request, capsys):
    """bf16 weights are no numpy dtype: the inspect tool joins each with its low half into the
    FP32 master, the value --explain steps from, in packed and fp32 mode alike."""
    path = request.getfixturevalue(run) / "checkpoint.safetensors"
    capsys.readouterr()  # the trainer's output, when the run is made here
    assert inspect_main([str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kind"] == "trainer checkpoint" and len(report["tensors"]) == 28
    tensors = checkpoint_tensors(path)
    state_file = load_state_file(path)
    for tensor in state_file.tensors:
        weight, lo = tensors[f"model/{tensor.name}"], tensors[f"optimizer/state/{tensor.index}/lo"]
        master = formats.read_master(bits16(weight), bits16(lo))
        assert np.array_equal(tensor.param.view(np.uint32), master.view(np.uint32)), tensor.name
    assert inspect_main([str(path), "--explain", "blocks.0.mlp.fc.weight[1,2]", "--grad", "0.01", "--json"]) == 0
    walk = json.loads(capsys.readouterr().out)
    assert walk["sources"]["p"] == "the checkpoint's model weights"
    assert walk["p"] == float(state_file.find("blocks.0.mlp.fc.weight").param[1, 2])


def test_default_out_directories_name_the_param_dtype():
    assert out_dir(TrainConfig(config="micro", param_dtype="bf16")).name == "micro-packed-bf16"
    assert out_dir(TrainConfig(config="micro", param_dtype="bf16", optimizer="torch-adamw")).name == \
        "micro-torch-adamw-bf16"
    assert out_dir(TrainConfig(config="micro")).name == "micro-packed"  # FP32 runs keep their directories


def test_bf16_gradient_norm_is_accumulated_in_float32_and_clipping_rounds_once():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)) for shape in ((300, 7), (5,), (1000,))]
    for p in params:
        p.grad = (torch.randn(p.shape) * 3).bfloat16()
    grads = [p.grad.clone() for p in params]
    exact = torch.cat([g.double().flatten() for g in grads]).norm().item()
    norm = gradient_norm_(params, None, "bf16")
    assert norm.dtype == torch.float32 and abs(norm.item() / exact - 1) < 1e-6  # bf16 would be ~1e-3 off
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # None: no clipping
    norm = gradient_norm_(params, 1.0, "bf16")
    factor = 1.0 / (norm + 1e-6)  # torch's clipping factor, float32
    for p, g in zip(params, grads):
        assert torch.equal(p.grad.view(torch.int16), (g.float() * factor).bfloat16().view(torch.int16))


@pytest.mark.parametrize("optimizer", ["packed-adamw", "torch-adamw"])
def test_synthetic_smoke_with_bf16_weights(capsys, optimizer):
    assert main(["--synthetic", "--config", "micro", "--batch-size", "2", *BF16, "--optimizer", optimizer]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["loss_finite"] and result["tensors_changed"] >= result["tensors_required"] >= 1
    if optimizer == "packed-adamw":  # every master moves, even where the bf16 weight does not
        assert result["tensors_changed"] == result["tensors"] == 28


def test_invalid_param_dtype_exits_2_naming_the_option(tmp_path, data_dir, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([*MICRO, "--data", str(data_dir), "--out", str(out), "--param-dtype", "fp16"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m packed_adamw.torch.gpt.train: error: "
                            "--param-dtype fp16: choose one of fp32, bf16")
    assert not out.exists()


def test_resume_with_another_param_dtype_is_refused(bf16_run, data_dir, capsys):
    argv = [*MICRO, "--data", data_dir, "--out", bf16_run, "--max-steps", 20, "--resume", "auto"]
    assert main(list(map(str, argv))) == 2
    error = capsys.readouterr().err
    assert "checkpoint was made with param_dtype='bf16', this run has param_dtype='fp32'" in error


def rewrite_without_param_dtype(path: Path) -> None:
    """The checkpoint as code from before --param-dtype wrote it: no param_dtype in its config."""
    tensors, metadata = checkpoint.read_checkpoint(path)
    del metadata["config"]["param_dtype"]
    metadata["sha256"] = checkpoint._checkpoint_sha256(tensors, metadata)
    checkpoint._atomic_save(tensors, {key: json.dumps(value) for key, value in metadata.items()}, path)


def test_older_checkpoint_without_param_dtype_resumes_as_fp32(tmp_path, data_dir, capsys):
    common = [*MICRO, "--data", data_dir, "--max-steps", 4]
    train_in_process(*common, "--out", tmp_path / "whole")
    old = tmp_path / "old"
    train_in_process(*common, "--out", old, "--stop-at-step", 2)
    rewrite_without_param_dtype(old / "checkpoint.safetensors")
    assert "param_dtype" not in checkpoint.read_checkpoint(old / "checkpoint.safetensors")[1]["config"]
    assert checkpoint.checkpoint_info(old / "checkpoint.safetensors")["config"]["param_dtype"] == "fp32"
    capsys.readouterr()
    assert main(list(map(str, [*common, *BF16, "--out", tmp_path / "other", "--resume", old]))) == 2
    assert "param_dtype='fp32', this run has param_dtype='bf16'" in capsys.readouterr().err
    train_in_process(*common, "--out", old, "--resume", "auto")
    assert summary(old)["step"] == 4
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", old / "checkpoint.safetensors")


# ---- under torchrun (gloo, two ranks) ------------------------------------------------------

SESSIONS = TESTS / "train_sessions.py"
STEPS, STOP_AT = 6, 3


def torchrun_sessions(*sessions: list[str]) -> str:
    from torchrun_helpers import torchrun
    return torchrun(2, SESSIONS, *[arg for args in sessions for arg in ["--then", *args]][1:], timeout_s=300)


def run_args(data: Path, out: Path, parallel: str, *extra) -> list[str]:
    return [*MICRO, *BF16, "--data", str(data), "--max-steps", str(STEPS), "--parallel", parallel, "--out", str(out),
            *map(str, extra)]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_and_fsdp2_bf16_runs_resumed_in_new_processes_are_bit_exact(tmp_path, data_dir):
    root = tmp_path
    torchrun_sessions(*(run_args(data_dir, root / f"{kind}-{run}", kind, *extra)
                        for kind in ("ddp", "fsdp")
                        for run, extra in (("whole", ()), ("split", ("--stop-at-step", STOP_AT)))))
    torchrun_sessions(*(run_args(data_dir, root / f"{kind}-split", kind, "--resume", "auto")
                        for kind in ("ddp", "fsdp")))
    for kind in ("ddp", "fsdp"):
        assert summary(root / f"{kind}-split")["steps_this_session"] == STEPS - STOP_AT
    assert_bitwise_equal(root / "ddp-whole" / "checkpoint.safetensors", root / "ddp-split" / "checkpoint.safetensors")
    ddp = checkpoint_tensors(root / "ddp-whole" / "checkpoint.safetensors")
    assert ddp["model/tok_emb.weight"].dtype == torch.bfloat16 and any(k.endswith("/lo") for k in ddp)

    from test_train_distributed import assert_same_contents, dcp_contents
    whole = dcp_contents(root / "fsdp-whole" / "checkpoint.dcp", tmp_path)
    assert_same_contents(whole, dcp_contents(root / "fsdp-split" / "checkpoint.dcp", tmp_path))
    # The low halves, in the layout PackedAdamW gives a DTensor parameter's: 2 bytes per element.
    weights = {k: t for k, t in whole.items() if k.startswith("model/")}
    lows = [t for k, t in whole.items() if k.endswith("/lo")]
    assert len(lows) == len(weights) == 28 and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert sum(t.numel() * t.element_size() for t in lows) == 2 * sum(t.numel() for t in weights.values())
    assert all(t.any() for t in lows)


# ---- CUDA ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("optimizer", ["packed-adamw", "torch-adamw"])
def test_cuda_bf16_run_resumed_in_a_new_process_is_bit_exact(tmp_path, data_dir, optimizer):
    """The compiled split kernel (bf16 gradients) and bf16 cuBLAS, deterministic mode."""
    common = [*MICRO, *BF16, "--optimizer", optimizer, "--device", "cuda", "--data", data_dir, "--max-steps", 16]
    run_train(*common, "--out", tmp_path / "whole")
    run_train(*common, "--out", tmp_path / "split", "--stop-at-step", 7)
    run_train(*common, "--out", tmp_path / "split", "--resume", "auto")
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", tmp_path / "split" / "checkpoint.safetensors")
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "whole" / "log.jsonl").read_text().splitlines())
              if "loss" in r]
    assert np.mean(losses[-5:]) < losses[0] - 0.1
