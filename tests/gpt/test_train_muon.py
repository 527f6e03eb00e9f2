"""The trainer's Muon + AdamW kinds (`--optimizer muon`, `packed-muon`) and tapes of the
32,768-entry tokenizer, on the CPU with the micro preset."""
import json

import pytest
import torch

from gpt_helpers import MICRO, assert_bitwise_equal, build_data, make_documents
from packed_adamw.tokenizer import LARGE_VOCAB_SIZE, VOCAB_SIZE
from packed_adamw.tokenizer.tape import build_split
from packed_adamw.torch.gpt.checkpoint import read_checkpoint
from packed_adamw.torch.gpt.model import GPT, PRESETS
from packed_adamw.torch.gpt.optimizers import muon_groups, optimizer_kind, set_learning_rate
from packed_adamw.torch.gpt.train import ConfigError, TrainConfig, main


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_data(tmp_path_factory.mktemp("data"), count=12, words=200)


@pytest.fixture(scope="module")
def large_vocab_dir(tmp_path_factory):
    """Tapes of the large corpus's 32,768-entry tokenizer (the text is the small synthetic one)."""
    directory = tmp_path_factory.mktemp("large-vocab")
    build_split(make_documents(12, 200), directory, val_fraction=0.1, vocab_size=LARGE_VOCAB_SIZE)
    return directory


def run(*args) -> None:
    assert main(list(map(str, args))) == 0


def stop_and_resume_equals_the_uninterrupted_run(tmp_path, data_dir, kind):
    common = [*MICRO, "--data", data_dir, "--max-steps", 6, "--optimizer", *kind]
    run(*common, "--out", tmp_path / "whole")
    run(*common, "--out", tmp_path / "split", "--stop-at-step", 3)
    run(*common, "--out", tmp_path / "split", "--resume", "auto")
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["steps_this_session"] == 3
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", tmp_path / "split" / "checkpoint.safetensors")
    _, metadata = read_checkpoint(tmp_path / "whole" / "checkpoint.safetensors")
    assert metadata["config"]["muon_lr"] == 0.02 and metadata["config"]["muon_momentum"] == 0.95
    assert {g["kind"] for g in metadata["optimizer"]["param_groups"]} == {"muon", "adamw"}


@pytest.mark.parametrize("kind", [["packed-muon"], ["packed-muon", "--param-dtype", "bf16", "--muon-mode", "bf16"],
                                  ["muon"]], ids=["packed", "bf16-weights-bf16-momentum", "torch-muon"])
def test_stop_and_resume_equals_the_uninterrupted_run_bitwise(tmp_path, data_dir, kind):
    stop_and_resume_equals_the_uninterrupted_run(tmp_path, data_dir, kind)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", [["packed-muon"], ["muon"]], ids=["packed", "torch-muon-fused-adamw"])
def test_stop_and_resume_on_cuda_under_autocast_is_bitwise(tmp_path, data_dir, kind):
    """The evidence's FP32-weight rows: PackedMuon's CUDA kernels, torch's fused AdamW (its step
    count a CUDA tensor in the checkpoint), bf16 autocast."""
    stop_and_resume_equals_the_uninterrupted_run(tmp_path, data_dir, [*kind, "--device", "cuda", "--autocast", "bf16"])


def test_a_resume_with_other_muon_settings_is_refused(tmp_path, data_dir, capsys):
    common = [*MICRO, "--data", data_dir, "--max-steps", 4, "--optimizer", "packed-muon", "--out", tmp_path]
    run(*common, "--stop-at-step", 2)
    assert main(list(map(str, [*common, "--resume", "auto", "--muon-mode", "fp32"]))) == 2
    assert "muon_mode='packed', this run has muon_mode='fp32'" in capsys.readouterr().err


def test_muon_groups_split_the_model_and_scale_the_schedule():
    torch.manual_seed(0)
    model = GPT(PRESETS["micro"])
    config = TrainConfig(config="micro", optimizer="muon", lr=1e-3, muon_lr=0.02)
    groups = muon_groups(model, config)
    names = {g["kind"]: [] for g in groups}
    for g in groups:
        names[g["kind"]] += g["param_names"]
    # the block matrices to Muon; the tied embedding (the head), position embedding, biases, norms to AdamW
    assert sorted(names["muon"]) == sorted(n for n, p in model.named_parameters() if p.dim() == 2 and "emb" not in n)
    assert [g["kind"] for g in groups][0] == "adamw"  # the logged lr is AdamW's
    decay = {n: g["weight_decay"] for g in groups for n in g["param_names"]}
    assert decay["tok_emb.weight"] == decay["blocks.0.mlp.fc.weight"] == 0.1 and decay["ln_final.weight"] == 0.0
    optimizer = optimizer_kind("muon").build(model, config)
    set_learning_rate(optimizer, 5e-4)
    assert {g["kind"]: g["lr"] for g in optimizer.param_groups} == {"adamw": 5e-4, "muon": 5e-4 * 0.02 / 1e-3}


def test_the_models_own_split_is_used_and_checked():
    class SplitByModel(GPT):
        def optimizer_groups(self, config):
            matrices = [p for n, p in self.named_parameters() if n.endswith("fc.weight")]
            rest = [p for n, p in self.named_parameters() if not n.endswith("fc.weight")]
            return [{"params": matrices, "kind": "muon"}, {"params": rest, "kind": "adamw", "weight_decay": 0.0}]

    model = SplitByModel(PRESETS["micro"])
    config = TrainConfig(config="micro", optimizer="packed-muon")
    optimizer = optimizer_kind("packed-muon").build(model, config)
    fc = {id(p) for n, p in model.named_parameters() if n.endswith("fc.weight")}
    assert {id(p) for p in optimizer.rules["muon"].param_groups[0]["params"]} == fc
    model.optimizer_groups = lambda config: [{"params": list(model.parameters())[:3], "kind": "muon"}]
    with pytest.raises(ConfigError, match="must list every trained parameter once"):
        muon_groups(model, config)


def test_a_large_vocabulary_tape_sizes_the_model_and_a_resume_on_other_tapes_is_refused(
        tmp_path, data_dir, large_vocab_dir, capsys):
    out = tmp_path / "out"
    common = [*MICRO, "--max-steps", 3, "--optimizer", "packed-muon", "--out", out]
    run(*common, "--data", large_vocab_dir, "--stop-at-step", 2)
    tensors, metadata = read_checkpoint(out / "checkpoint.safetensors")
    assert metadata["config"]["model"]["vocab_size"] == LARGE_VOCAB_SIZE
    assert tensors["model/tok_emb.weight"].shape == (LARGE_VOCAB_SIZE, PRESETS["micro"].d_model)
    assert main(list(map(str, [*common, "--data", data_dir, "--resume", "auto"]))) == 2
    error = capsys.readouterr().err
    assert f"model.vocab_size={LARGE_VOCAB_SIZE}, this run has model.vocab_size={VOCAB_SIZE}" in error
