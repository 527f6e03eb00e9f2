"""The chat family's training script (torch_frontend/gpt/chat_train.py) on the CPU: a run and its
files, bit-exact resume, refusals, the reference optimizer, gradient accumulation against one
step of all the rows, and DDP and FSDP2 on 2 gloo ranks against one process with the same
global batch, FSDP2 resumed resharded 1 -> 2 -> 1 ranks. The model is the chat-tiny preset on
tapes of a 320-entry tokenizer trained for the test (tokenizer/train_tokenizer.py), so a step
takes a fraction of a second."""
import collections
import errno
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from packed_adamw.tokenizer.tape import build_split
from packed_adamw.tokenizer.train_tokenizer import train_tokenizer
from packed_adamw.torch.gpt.chat_train import main
from packed_adamw.torch.gpt.training_state import state_file_name

from gpt_helpers import WORDS, poison_weights_after_step
from torchrun_helpers import free_port, torchrun

VOCAB = 320
MOST_STEPS = 76  # of 2 rows x 64 tokens the test tape feeds (9,964 tokens: 77 steps, less the last state's next batch)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """train.tape and val.tape of short documents (3 to 60 words) and the tokenizer they use."""
    rng = random.Random(0)
    documents = [(f"d{i}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))) for i in range(200)]
    directory = tmp_path_factory.mktemp("chat_data")
    train_tokenizer(documents, vocab_size=VOCAB).save(str(directory / "tokenizer.json"))
    build_split(documents, directory, val_fraction=0.1, tokenizer=directory / "tokenizer.json", vocab_size=VOCAB)
    return directory


def arguments(data, out, *extra, steps=4, batch=2):
    return ["--preset", "chat-tiny", "--data", str(data), "--vocab-size", str(VOCAB), "--steps", str(steps),
            "--batch", str(batch), "--context", "64", "--warmup-steps", "2", "--out", str(out), *map(str, extra)]


def read(path):
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}, f.metadata()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(bits(a[key]), bits(b[key])), key


def log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def trajectory(records) -> list[tuple]:
    """The log without its timings."""
    return [tuple((k, v) for k, v in r.items() if k not in ("step_ms", "tokens_per_s")) for r in records]


def refused_flag(capsys, argv) -> str:
    """The error line of a command line refused at parse time: argparse's exit 2, a usage line
    and one line naming the flag, before anything is read or written."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(map(str, argv)))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: "), lines
    assert lines[1].startswith("python -m packed_adamw.torch.gpt.chat_train: error: --"), lines
    return lines[1]


def files_of(directory) -> dict:
    """Every file's bytes, by name (to show that a refused run changed nothing), but the run lock
    (an empty file that any run into the directory opens)."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != "run.lock"}


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """4 steps in one session, bf16 weights, evaluating every 2 steps, a state after steps 2 and 4."""
    out = tmp_path_factory.mktemp("straight")
    assert main(arguments(data, out, "--eval-every", 2, "--eval-batches", 1, "--save-every", 2)) == 0
    return out


def test_run_writes_log_schedule_summary_and_state(straight):
    records = log(straight)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_bpb" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert 0 < evals[-1]["val_bpb"] < evals[0]["val_bpb"]
    schedule, _ = read(straight / "schedule.safetensors")
    assert [r["lr_multiplier"] for r in steps] == schedule["lr_multiplier"].tolist()
    tensors, metadata = read(straight / "state_step000004.safetensors")
    assert json.loads(metadata["step"]) == json.loads(metadata["t_step"]) == 4
    assert tensors["params/lm_head.weight/w"].dtype == torch.bfloat16
    assert tensors["params/lm_head.weight/mantissa"].dtype == torch.uint16
    assert tensors["batch/inputs"].shape == (2, 64) and tensors["batch/cu_seqlens"].dtype == torch.int32
    config = json.loads(metadata["config"])
    assert config["preset"] == "chat-tiny" and config["model"]["vocab_size"] == VOCAB
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["step"] == 4 and summary["weight_bytes_per_parameter"] == 2.0


def test_track_format_logs_each_rules_counts_per_kind_and_changes_no_bit(data, straight, tmp_path, monkeypatch):
    """--track-format: after each logged step a "format" record per kind of tensor, the optimizer's
    reads summed by kind, each share over the element-steps of the parameters that count it: Muon's
    momentum code's over the block matrices, AdamW's over the embeddings and head, none over the
    scalars (fp32 state: shares null). The states and step records are the untracked run's, bit for bit."""
    from packed_adamw.torch import PackedMuonAdamW
    from packed_adamw.torch.gpt.chat_model import chat_parameter_kind

    reads, real = [], PackedMuonAdamW.format_stats

    def recording(self):
        reads.append(real(self))
        return reads[-1]

    monkeypatch.setattr(PackedMuonAdamW, "format_stats", recording)
    assert main(arguments(data, tmp_path, "--eval-every", 2, "--eval-batches", 1, "--save-every", 2,
                          "--track-format")) == 0
    for step in (2, 4):
        assert_same_bits(read(tmp_path / state_file_name(step))[0], read(straight / state_file_name(step))[0])
    records = log(tmp_path)
    formats = [r for r in records if r.get("record") == "format"]
    assert trajectory([r for r in records if r not in formats]) == trajectory(log(straight))
    assert [(r["first_step"], r["step"]) for r in formats] == [(1, 1), (2, 2), (3, 3), (4, 4)] and len(reads) == 4
    shares = collections.defaultdict(set)  # count name -> the kinds with a share of it
    for record, stats in zip(formats, reads):
        totals, over = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
        for name, entry in stats.items():
            kind = chat_parameter_kind(name)
            totals[kind].update(entry)
            over[kind].update({k: entry["elements"] for k in entry if k != "elements"})
        for kind, entry in record["kinds"].items():
            assert entry["element_steps"] == totals[kind]["elements"], kind
            assert entry["counts"] == {k: totals[kind][k] for k in entry["counts"]}, kind
            for k in entry["counts"]:
                if k != "refused":
                    assert entry[k] == (totals[kind][k] / over[kind][k] if over[kind][k] else None), (kind, k)
                    if entry[k] is not None:
                        shares[k].add(kind)
    assert shares["subnormal_mu"] >= {"mlp", "attention_q"} and shares["subnormal_m"] >= {"embedding", "head"}
    assert "scalar" not in shares["subnormal_mu"] | shares["subnormal_m"]


def test_resume_is_bit_exact(data, straight, tmp_path):
    """Stop after step 2 (the schedule still 4 steps long), resume from its state: the step-4
    state equals the uninterrupted run's bit for bit (weights, low halves, moments, RNG, next
    batch, tables, metadata), and so does the log."""
    assert main(arguments(data, tmp_path, "--eval-every", 2, "--eval-batches", 1, "--stop-at", 2)) == 0
    assert not (tmp_path / "state_step000004.safetensors").exists()
    assert main(arguments(data, tmp_path, "--eval-every", 2, "--eval-batches", 1,
                          "--resume", tmp_path / "state_step000002.safetensors")) == 0
    resumed, resumed_metadata = read(tmp_path / "state_step000004.safetensors")
    uninterrupted, metadata = read(straight / "state_step000004.safetensors")
    assert_same_bits(resumed, uninterrupted)
    assert resumed_metadata == metadata
    assert trajectory(log(tmp_path)) == trajectory(log(straight))


def test_resume_under_the_crop_rule_with_accumulation_is_bit_exact(data, tmp_path):
    """The same under --packing bos-greedy-crop/1 and --grad-accum 2: the resume reads its tape
    through a loader of the state's packing rule (a loader of the default rule would not give the
    saved next batch, and the resume would be refused)."""
    crop = ("--packing", "bos-greedy-crop/1", "--grad-accum", 2, "--batch", 1)
    assert main(arguments(data, tmp_path / "straight", *crop)) == 0
    assert main(arguments(data, tmp_path / "resumed", *crop, "--stop-at", 2)) == 0
    assert main(arguments(data, tmp_path / "resumed", *crop,
                          "--resume", tmp_path / "resumed" / "state_step000002.safetensors")) == 0
    assert_same_bits(read(tmp_path / "resumed" / "state_step000004.safetensors")[0],
                     read(tmp_path / "straight" / "state_step000004.safetensors")[0])
    assert trajectory(log(tmp_path / "resumed")) == trajectory(log(tmp_path / "straight"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resume_is_bit_exact_on_cuda(data, tmp_path):
    """The same on the GPU: varlen attention on bf16 weights, the Triton optimizer kernels, the
    CUDA generator; deterministic kernels (an embedding's backward otherwise adds with atomics)."""
    cuda = ("--device", "cuda", "--deterministic")
    assert main(arguments(data, tmp_path / "straight", *cuda)) == 0
    assert main(arguments(data, tmp_path / "stopped", *cuda, "--stop-at", 2)) == 0
    assert main(arguments(data, tmp_path / "stopped", *cuda,
                          "--resume", tmp_path / "stopped" / "state_step000002.safetensors")) == 0
    resumed, _ = read(tmp_path / "stopped" / "state_step000004.safetensors")
    assert_same_bits(resumed, read(tmp_path / "straight" / "state_step000004.safetensors")[0])
    assert "rng/cuda/0" in resumed


def test_a_compiled_run_compiles_once_and_resumes_eagerly_bit_for_bit(data, straight, tmp_path):
    """--compile aot_eager (AOT autograd's graphs run eagerly: on the CPU the bits of the eager
    model) on batches of different document counts: the model compiles in the first micro-batch
    and never again (summary.json's graph counts), and its step-2 state equals the eager run's;
    resumed without --compile (compile is not in the run's configuration: a compiled and an eager
    run resume each other), the step-4 state and the log equal the eager run's bit for bit."""
    from packed_adamw.tokenizer.tape import TapeReader
    from packed_adamw.torch.gpt.packed_data import PackedDocumentLoader

    loader = PackedDocumentLoader(TapeReader(data / "train.tape", vocab_size=VOCAB), 2, 64)
    assert len({loader.next_batch().cu_seqlens.numel() for _ in range(2)}) == 2  # the two steps' counts differ
    flags = ("--eval-every", 2, "--eval-batches", 1)
    assert main(arguments(data, tmp_path, *flags, "--compile", "aot_eager", "--stop-at", 2)) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compile"] == "aot_eager"
    assert summary["compiled_graphs"] == summary["compiled_graphs_after_first_batch"] > 0
    assert_same_bits(read(tmp_path / "state_step000002.safetensors")[0],
                     read(straight / "state_step000002.safetensors")[0])
    assert main(arguments(data, tmp_path, *flags, "--resume", tmp_path / "state_step000002.safetensors")) == 0
    resumed, resumed_metadata = read(tmp_path / "state_step000004.safetensors")
    uninterrupted, metadata = read(straight / "state_step000004.safetensors")
    assert_same_bits(resumed, uninterrupted)
    assert resumed_metadata == metadata
    assert trajectory(log(tmp_path)) == trajectory(log(straight))
    assert json.loads((tmp_path / "summary.json").read_text())["compile"] is None


def test_flops_per_token_are_reported_and_the_cpu_reports_no_mfu(straight, monkeypatch):
    """summary.json and every step's log line: nanochat's FLOPs per token of chat-tiny at
    --context 64, counted by hand, and MFU null on the CPU (no peak is known for it); the peak
    is looked up by the GPU's name (H100 SXM and H200: 989 TFLOP/s dense bf16; other GPUs null)."""
    from packed_adamw.torch.gpt import telemetry

    # 2 blocks of 4 x 64^2 attention + 2 x 4 x 64^2 MLP weights, layer 1's value gate (12 x 1
    # head), the smear gate (24), the head (64 x 320); both layers span the 64-token row (the
    # short window is 128): 12 x 1 head x 64 x (64 + 64)
    flops = 6 * (2 * 12 * 64 * 64 + 12 + 24 + 64 * VOCAB) + 12 * 1 * 64 * (64 + 64)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["flops_per_token"] == flops == 811_224
    assert summary["peak_flops_per_device"] is None and summary["mfu"] is None and summary["compile"] is None
    assert all(r["mfu"] is None for r in log(straight) if "loss" in r)

    assert telemetry.peak_bf16_flops(torch.device("cpu")) is None
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", None),
                       ("NVIDIA A100-SXM4-80GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert telemetry.peak_bf16_flops(torch.device("cuda:0")) == peak, name
    assert telemetry.model_flops_utilization(309_537, 759_696_048, 989e12) == 309_537 * 759_696_048 / 989e12
    assert telemetry.model_flops_utilization(309_537, 759_696_048, 989e12, devices=2) == \
        309_537 * 759_696_048 / (2 * 989e12)
    assert telemetry.model_flops_utilization(309_537, 759_696_048, None) is None


def test_refusals(data, straight, tmp_path, capsys):
    state = straight / "state_step000004.safetensors"
    assert main(arguments(data, tmp_path, "--matrix-lr", 0.03, "--resume", state)) == 2
    assert "another configuration" in capsys.readouterr().err
    assert main(arguments(data, tmp_path, "--param-dtype", "fp32", "--resume", state)) == 2
    assert "param_dtype" in capsys.readouterr().err
    assert main(arguments(data, tmp_path, "--packing", "bos-greedy-crop/1", "--resume", state)) == 2
    assert "written under packing 'bos-greedy-split/1'" in capsys.readouterr().err  # the default rule's state
    with pytest.raises(SystemExit):  # argparse: no such preset
        main(["--preset", "d5", *arguments(data, tmp_path)[2:]])
    preset_vocabulary = arguments(data, tmp_path)
    del preset_vocabulary[4:6]  # --vocab-size: the preset's 32,768 entries are not the tapes'
    assert main(preset_vocabulary) == 2
    assert f"--vocab-size {VOCAB}" in capsys.readouterr().err
    # refused at parse time (parser.error: exit 2)
    assert "no training states" in refused_flag(capsys, arguments(data, tmp_path, "--optimizer", "reference",
                                                                   "--save-every", 1))
    assert "--muon-mode fp32: PackedMuon's momentum storage" in refused_flag(
        capsys, arguments(data, tmp_path, "--optimizer", "reference", "--muon-mode", "fp32"))
    assert "--track-format counts the packed optimizer's formats" in refused_flag(
        capsys, arguments(data, tmp_path, "--optimizer", "reference", "--track-format"))
    assert "start with torchrun --nproc_per_node=N" in refused_flag(capsys, arguments(data, tmp_path, "--parallel",
                                                                                      "fsdp"))
    assert "--grad-accum 0" in refused_flag(capsys, arguments(data, tmp_path, "--grad-accum", 0))
    assert "--vocab-size 0" in refused_flag(capsys, arguments(data, tmp_path, "--vocab-size", 0))  # not the preset's
    # an evaluation reads at least one batch: the flag at fault is named, not --batch or --context
    assert "--eval-batches 0 with --eval-every 2" in refused_flag(capsys, arguments(data, tmp_path, "--eval-batches", 0,
                                                                                     "--eval-every", 2))
    assert "cannot step FSDP2's shards" in refused_flag(capsys, arguments(data, tmp_path, "--optimizer", "reference",
                                                                          "--parallel", "fsdp"))
    assert "--compile with --parallel ddp" in refused_flag(capsys, arguments(data, tmp_path, "--compile",
                                                                             "--parallel", "ddp"))
    # 2 micro-batches of 2 rows: a step of 4 rows, not the state's 2
    assert main(arguments(data, tmp_path, "--grad-accum", 2, "--resume", state)) == 2
    assert "rows_per_step" in capsys.readouterr().err


def test_a_run_directory_of_another_run_is_never_replaced(data, straight, four_rows, tmp_path, capsys):
    """Without --resume, a directory holding another run's files is refused, naming them and the
    state to resume; so is a resume into a directory whose states are newer than the resumed
    one or of another configuration. Nothing in the directory changes."""
    finished = tmp_path / "finished"
    shutil.copytree(straight, finished)
    before = files_of(finished)
    assert main(arguments(data, finished, "--eval-every", 2, "--eval-batches", 1)) == 2
    error = capsys.readouterr().err
    assert f"--out {finished} holds another run's files" in error
    assert "log.jsonl" in error and "summary.json" in error and "state_step000004.safetensors" in error
    # that run has ended: nothing of it is left to continue, so no --resume is offered
    assert ("that run has ended (it took its last step at step 4; state_step000004.safetensors is its final "
            "state)") in error
    assert "--resume" not in error and "choose another --out" in error

    newer = f"{finished / 'state_step000004.safetensors'} (step 4) is newer than"
    assert main(arguments(data, finished, "--resume", finished / "state_step000002.safetensors")) == 2
    assert newer in capsys.readouterr().err
    assert files_of(finished) == before

    started = tmp_path / "started"  # a run that died before its first state
    started.mkdir()
    (started / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert main(arguments(data, started)) == 2
    assert "log.jsonl" in capsys.readouterr().err
    assert files_of(started) == {"log.jsonl": b'{"step": 1, "loss": 5.0}\n'}

    other = tmp_path / "other"  # a state of another configuration (FP32 weights, 4 rows a step)
    other.mkdir()
    shutil.copy(four_rows / "state_step000001.safetensors", other)
    assert main(arguments(data, other, "--resume", straight / "state_step000002.safetensors")) == 2
    assert "belongs to another configuration" in capsys.readouterr().err
    assert [p.name for p in other.iterdir() if p.name != "run.lock"] == ["state_step000001.safetensors"]


def test_resuming_a_finished_run_changes_nothing(data, straight, tmp_path, capsys):
    """The final state of a finished run: nothing is left to do; its summary is printed and
    returned, and summary.json, log.jsonl and the states stay as they were."""
    finished = tmp_path / "finished"
    shutil.copytree(straight, finished)
    before = files_of(finished)
    capsys.readouterr()
    assert main(arguments(data, finished, "--eval-every", 2, "--eval-batches", 1,
                          "--resume", finished / "state_step000004.safetensors")) == 0
    output = capsys.readouterr().out
    assert "is a finished run" in output
    assert json.loads(output.splitlines()[-1])["final_loss"] == json.loads(before["summary.json"])["final_loss"]
    assert files_of(finished) == before


def test_a_resume_from_elsewhere_never_replaces_another_runs_files(data, straight, tmp_path, capsys):
    """A run that does not continue a state of its --out is refused where --out holds another
    run's files: a resume of another directory's state, and a fresh start (--resume auto finding
    no state there), into a reference run's directory (log and summary, no state), a run's that
    died before its first state, and one whose log.jsonl is a dangling link (counted as train.py
    counts it: one test for both trainers). Nothing there changes."""
    reference, started, dangling = tmp_path / "reference", tmp_path / "started", tmp_path / "dangling"
    assert main(arguments(data, reference, "--optimizer", "reference", steps=2)) == 0
    started.mkdir()
    (started / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    dangling.mkdir()
    (dangling / "log.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    state = straight / "state_step000002.safetensors"
    capsys.readouterr()
    for out in (reference, started, dangling):
        before = files_of(out)
        assert main(arguments(data, out, "--resume", state)) == 2
        error = capsys.readouterr().err
        assert f"--out {out} holds another run's files (log.jsonl" in error, error
        assert f"resuming {state} there would replace them" in error and f"resume {state} into another --out" in error
        for fresh in ((), ("--resume", "auto")):
            assert main(arguments(data, out, *fresh)) == 2
            assert f"--out {out} holds another run's files (log.jsonl" in capsys.readouterr().err
        assert files_of(out) == before
    assert (dangling / "log.jsonl").is_symlink() and not (tmp_path / "nowhere.jsonl").exists()


def test_every_session_writes_its_schedule(data, straight, tmp_path):
    """A resume writes the run's schedule.safetensors too: into a new --out, and over a stale one
    left by a start that failed before its first step (no other run's tables beside its states)."""
    state = straight / "state_step000002.safetensors"
    for out in (tmp_path / "new", tmp_path / "stale"):
        if out.name == "stale":
            out.mkdir()
            # a failed start's: the tables (of another schedule) chat_train writes before the first step
            save_file({"lr": torch.zeros(3)}, str(out / "schedule.safetensors"), metadata={"schedule": "{}"})
        assert main(arguments(data, out, "--resume", state)) == 0
        ours, theirs = read(out / "schedule.safetensors"), read(straight / "schedule.safetensors")
        assert ours[1] == theirs[1] and ours[0].keys() == theirs[0].keys()
        assert all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0])


def test_resume_auto_continues_the_newest_state_or_starts_fresh(data, straight, tmp_path, capsys):
    """--resume auto into an absent --out starts fresh; into the --out of a run stopped at step 2
    it continues from the newest state there, and the step-4 state and the log equal the
    uninterrupted run's bit for bit. A fresh start into the stopped run's directory is refused,
    offering that state (the run has not ended)."""
    out = tmp_path / "auto"
    flags = ("--eval-every", 2, "--eval-batches", 1)
    assert main(arguments(data, out, *flags, "--stop-at", 2, "--resume", "auto")) == 0
    # a stop before the state's step would take no step and call the run finished: refused, naming it
    assert main(arguments(data, out, *flags, "--stop-at", 1, "--resume", "auto")) == 2
    error = capsys.readouterr().err
    assert "--stop-at 1: " in error and "is already at step 2" in error, error
    assert main(arguments(data, out, *flags)) == 2
    assert f"continue that run with --resume {out / 'state_step000002.safetensors'}" in capsys.readouterr().err
    assert main(arguments(data, out, *flags, "--resume", "auto")) == 0
    assert f"resumed from {out / 'state_step000002.safetensors'} at step 2" in capsys.readouterr().out
    assert_same_bits(read(out / "state_step000004.safetensors")[0], read(straight / "state_step000004.safetensors")[0])
    assert trajectory(log(out)) == trajectory(log(straight))


def test_a_finished_run_whose_summary_is_missing_rebuilds_it_from_its_log(data, straight, tmp_path, capsys):
    """A summary lost after the final state (a full disk at summary.json, a signal between the
    two): resuming the final state rebuilds it from log.jsonl (the logged losses, step times
    and evaluation), changing nothing else; into an --out without its log there is nothing to
    do, and nothing is written."""
    finished = tmp_path / "finished"
    shutil.copytree(straight, finished)
    original = json.loads((finished / "summary.json").read_text())
    (finished / "summary.json").unlink()
    before = files_of(finished)
    state = finished / "state_step000004.safetensors"
    assert main(arguments(data, finished, "--eval-every", 2, "--eval-batches", 1, "--resume", state)) == 0
    rebuilt = json.loads((finished / "summary.json").read_text())
    for key in ("step", "steps", "stopped_because", "final_loss", "val_loss", "val_bpb", "parameters",
                "optimizer_state_bytes", "flops_per_token"):
        assert rebuilt[key] == original[key], key
    for key in ("median_step_ms", "tokens_per_s"):  # from the log's milliseconds
        assert rebuilt[key] == pytest.approx(original[key], rel=1e-9), key
    assert rebuilt["rebuilt_from"] == str(finished / "log.jsonl")
    assert {name: b for name, b in files_of(finished).items() if name != "summary.json"} == before
    elsewhere = tmp_path / "elsewhere"
    capsys.readouterr()
    assert main(arguments(data, elsewhere, "--resume", state)) == 0
    assert "nothing to do" in capsys.readouterr().out and files_of(elsewhere) == {}


def test_a_start_that_failed_before_its_first_step_does_not_block_the_rerun(data, tmp_path, capsys, monkeypatch):
    """A full disk at the first state, before any step was logged, leaves an empty log.jsonl and
    schedule.safetensors: files a run writes before its first completed step, which are no run's
    work; the rerun goes ahead."""
    from packed_adamw.torch.gpt import checkpoint

    out = tmp_path / "out"
    flags = ("--log-every", 2, "--save-every", 1)
    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, "save_file", no_space)
        assert main(arguments(data, out, *flags, steps=2)) == 1
    assert f"could not write {out / 'state_step000001.safetensors'}" in capsys.readouterr().err
    assert files_of(out).keys() == {"log.jsonl", "schedule.safetensors"} and (out / "log.jsonl").read_text() == ""
    assert main(arguments(data, out, *flags, steps=2)) == 0
    assert [r["step"] for r in log(out)] == [2] and (out / "state_step000002.safetensors").exists()


def test_a_diverging_run_ends_in_one_line_keeping_its_last_good_state(data, tmp_path, capsys, monkeypatch):
    """Weights that turn NaN in step 3 (a poisoned optimizer step; the loss is checked only every
    4 steps): the run ends with exit 1 and one line naming the step and the state that stays its
    last; no state holds NaN (none after step 2), and the summary says why it stopped. Learning
    rates of 1e30 end the same way, before the first state."""
    from packed_adamw.torch.gpt import chat_train

    out = tmp_path / "poisoned"
    with monkeypatch.context() as patched:
        poison_weights_after_step(patched, chat_train.PackedMuonAdamW, 3)
        assert main(arguments(data, out, "--save-every", 1, "--log-every", 4)) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: the run diverged: NaN or Inf in the weights after step 3")
    assert f"{out / 'state_step000002.safetensors'} stays its last state" in error[0] and "another --out" in error[0]
    assert sorted(p.name for p in out.glob("state_step*")) == ["state_step000001.safetensors",
                                                                "state_step000002.safetensors"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_because"] == "diverged" and summary["step"] == 3
    # It has ended: --resume auto (which would take step 2 into the same divergence) and a fresh
    # start are refused, saying so, and change nothing.
    before = files_of(out)
    for again in (("--resume", "auto"), ()):
        assert main(arguments(data, out, "--save-every", 1, "--log-every", 4, *again)) == 2
        error = capsys.readouterr().err
        assert "has ended (it diverged at step 3" in error and "--resume" not in error.split("ended")[1], error
    assert files_of(out) == before

    out = tmp_path / "huge_rates"
    assert main(arguments(data, out, "--matrix-lr", 1e30, "--embedding-lr", 1e30, steps=3)) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: the run diverged: ") and "before its first state" in error[0]
    assert not list(out.glob("state_step*"))


def test_steps_the_tape_cannot_feed_are_refused_and_a_wasteful_packing_ends_with_a_state(data, tmp_path, capsys):
    """The test tape's 9,964 tokens feed 8 steps of 16 rows x 64 tokens and the batch after them
    (which the last state holds): --steps 9 is refused at start naming 8, and so is --steps
    10**11 (before a schedule of that length is built), writing nothing but the lock; --steps 8
    runs to the end. The crop rule drops cropped tails, so its rows take more tokens and the
    tape runs out earlier: the run ends there with exit 0, its state at the last step and a
    summary saying why (as train.py's does); resuming that state changes nothing."""
    for steps in (9, 10**11):
        out = tmp_path / f"steps{steps}"
        assert main(arguments(data, out, steps=steps, batch=16)) == 2
        error = capsys.readouterr().err
        if steps == 9:
            assert f"--steps {steps}: " in error and "feed at most 8 steps of 16 rows x 64 tokens" in error, error
            assert "pass --steps 8 or fewer" in error
        else:  # never built: a schedule's tables hold a row per step
            assert f"--steps {steps}: " in error and "pass at most 1,000,000" in error, error
        assert [p.name for p in out.iterdir()] == ["run.lock"]
    # A longer schedule stopped early is a run of --stop-at steps (the reference documents' 1,680-step
    # schedule stopped at 250): it runs where the tape feeds --stop-at, and is refused naming it where not.
    assert main(arguments(data, tmp_path / "stop9", "--stop-at", 9, steps=200, batch=16)) == 2
    assert "--stop-at 9: " in capsys.readouterr().err
    assert main(arguments(data, tmp_path / "stop3", "--stop-at", 3, steps=200, batch=16)) == 0
    assert json.loads((tmp_path / "stop3" / "summary.json").read_text())["stopped_because"] == "stop_at"
    assert main(arguments(data, tmp_path / "eight", steps=8, batch=16)) == 0
    assert json.loads((tmp_path / "eight" / "summary.json").read_text())["stopped_because"] == "steps"
    assert (tmp_path / "eight" / "state_step000008.safetensors").exists()

    crop = tmp_path / "crop"
    assert main(arguments(data, crop, "--packing", "bos-greedy-crop/1", steps=8, batch=16)) == 0
    assert "training tape exhausted at step" in capsys.readouterr().out
    summary = json.loads((crop / "summary.json").read_text())
    assert summary["stopped_because"] == "tape_exhausted" and 0 < summary["step"] < 8
    state = crop / state_file_name(summary["step"])
    assert sorted(p.name for p in crop.glob("state_step*")) == [state.name]
    before = files_of(crop)
    assert main(arguments(data, crop, "--packing", "bos-greedy-crop/1", "--resume", state, steps=8, batch=16)) == 0
    assert "is a finished run" in capsys.readouterr().out and files_of(crop) == before


def test_an_out_on_a_file_system_without_flock_runs_unlocked_with_a_warning(data, tmp_path, monkeypatch):
    """flock refused as a file system without it refuses it (Lustre without -o flock: ENOSYS;
    ENOLCK, EOPNOTSUPP, EINVAL elsewhere): the run goes on, warning that --out is not protected
    against a second run (the refusals of another run's files still hold); another flock error is
    refused naming --out."""
    from packed_adamw.torch.gpt import run_directory

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(run_directory.fcntl, "flock", no_flock)
    out = tmp_path / "out"
    with pytest.warns(run_directory.RunDirectoryWarning, match=f"--out {out} is on a file system without flock "
                      r"\(.*\): the run goes on without the lock .* NOT protected against a second run"):
        assert main(arguments(data, out, steps=1)) == 0
    assert (out / "state_step000001.safetensors").exists()
    with pytest.warns(run_directory.RunDirectoryWarning):
        assert main(arguments(data, out, steps=1)) == 2  # another run's files: refused without the lock too

    def bad_descriptor(fd, operation):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(run_directory.fcntl, "flock", bad_descriptor)
    with pytest.raises(run_directory.RunDirectoryError, match=f"--out {out}: cannot lock {out / 'run.lock'}"):
        run_directory.RunLock(out).acquire()


def hold_lock(path):
    """Another process holding `path`'s flock, as a running trainer does (killed by the caller)."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\nsys.stdin.read()",
                               str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_directory_claimed_by_a_running_run_is_refused(data, tmp_path, capsys):
    """A second run into a directory whose lock another process holds is refused, naming the
    directory and the lock, and writes nothing; once that process is gone (killed: its lock
    file stays behind) a run goes ahead."""
    from packed_adamw.torch.gpt.run_directory import LOCK_NAME

    out = tmp_path / "out"
    out.mkdir()
    holder = hold_lock(out / LOCK_NAME)
    try:
        assert main(arguments(data, out, steps=1)) == 2
    finally:
        holder.kill()
        holder.wait()
    error = capsys.readouterr().err
    assert f"--out {out} is in use by another run" in error and str(out / LOCK_NAME) in error
    assert [p.name for p in out.iterdir()] == [LOCK_NAME]
    assert main(arguments(data, out, steps=1)) == 0
    assert (out / "state_step000001.safetensors").exists()


def test_sigterm_writes_a_state_at_the_step_boundary(data, tmp_path):
    """SIGTERM finishes the step, writes its state (the one --stop-at writes there, bit for bit)
    and exits 0; the summary says why the run stopped."""
    out = tmp_path / "signalled"
    process = subprocess.Popen([sys.executable, "-m", "packed_adamw.torch.gpt.chat_train",
                                *map(str, arguments(data, out, steps=MOST_STEPS))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((out / "log.jsonl").exists() and len((out / "log.jsonl").read_text().splitlines()) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "SIGTERM received" in stderr and "Traceback" not in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_because"] == "SIGTERM" and summary["step"] >= 2
    step = summary["step"]
    assert [r["step"] for r in log(out)] == list(range(1, step + 1))
    assert main(arguments(data, tmp_path / "stopped", "--stop-at", step, steps=MOST_STEPS)) == 0
    name = f"state_step{step:06d}.safetensors"
    signalled, signalled_metadata = read(out / name)
    stopped, stopped_metadata = read(tmp_path / "stopped" / name)
    assert_same_bits(signalled, stopped)
    assert signalled_metadata == stopped_metadata


@pytest.mark.parametrize("flag, value, says", [
    ("--device", "bogus", "not a device"), ("--matrix-lr", "nan", "--matrix-lr nan"),
    ("--embedding-lr", "-1", "--embedding-lr -1.0"), ("--unembedding-lr", "inf", "--unembedding-lr inf"),
    ("--scalar-lr", "nan", "--scalar-lr nan"), ("--weight-decay", "-0.1", "--weight-decay -0.1"),
    ("--weight-decay", "nan", "--weight-decay nan"), ("--warmdown-ratio", "1.5", "[0, 1]"),
    ("--warmup-steps", "-3", "--warmup-steps -3"), ("--momentum-warmup-steps", "-1", "--momentum-warmup-steps -1"),
    ("--seed", "-1", "[0, 2**64)"), ("--seed", str(2**64), "[0, 2**64)"),
    ("--matrix-lr", "0", "--matrix-lr 0.0: the peak learning rate must be above 0"),
    ("--scalar-lr", "0", "--scalar-lr 0.0: the peak"), ("--stop-at", "4", "--stop-at 4: the run ends at step 4"),
    ("--stop-at", "10", "--stop-at 10: the run ends at step 4"),
    ("--allow-code-change", None, "--allow-code-change lets a resume continue"),  # a flag this run would not read
])
def test_invalid_flags_exit_2_naming_the_flag(data, tmp_path, capsys, flag, value, says):
    out = tmp_path / "out"
    assert says in refused_flag(capsys, arguments(data, out, flag, *([] if value is None else [value])))
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_refused_at_parse_time(data, tmp_path, capsys):
    assert "CUDA is not available" in refused_flag(capsys, arguments(data, tmp_path / "out", "--device", "cuda"))


def test_a_run_started_from_code_checks_its_settings(data, tmp_path):
    """train() checks the settings as the command line does (the shared loop's first step, as
    train.py's train() did), before --out is made: a Namespace edited after parse_args is
    refused naming the flag, rather than failing inside the loop."""
    from packed_adamw.torch.gpt import chat_train
    from packed_adamw.torch.gpt.config import ConfigError

    out = tmp_path / "out"
    args = chat_train.parse_args(list(map(str, arguments(data, out))))
    args.log_every = 0
    with pytest.raises(ConfigError, match="--log-every 0: must be at least 1"):
        chat_train.train(args)
    assert not out.exists()


def test_an_out_that_cannot_hold_a_run_is_refused_at_parse_time(data, tmp_path, capsys, monkeypatch):
    """--out a file, or in a directory this process cannot write (os.access says so: as root a
    mode bit would not stop the write, a read-only file system would)."""
    from packed_adamw.torch.gpt import run_directory

    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    assert f"--out {a_file} is a file" in refused_flag(capsys, arguments(data, a_file))
    assert a_file.read_text() == "mine"
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    monkeypatch.setattr(run_directory.os, "access", lambda path, mode: Path(path) != read_only)
    assert f"{read_only} is not writable" in refused_flag(capsys, arguments(data, read_only / "run"))
    assert not (read_only / "run").exists()


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_ends_the_run_with_an_error_naming_the_file(data, tmp_path, capsys, monkeypatch):
    """An OSError while writing the state, the log or the summary ends the run with one line,
    exit 1, naming the file; a state cut short by it never appears (states are written to a
    temporary file and renamed), and the run's lock is released."""
    from packed_adamw.torch.gpt import checkpoint, run_directory, telemetry

    def half_a_state(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a state")
        no_space()

    for name, target, attribute, fault in (
            ("state_step000001.safetensors", checkpoint, "save_file", half_a_state),
            ("log.jsonl", telemetry.RunLog, "write", no_space),
            ("summary.json", run_directory, "atomic_write", no_space)):
        out = tmp_path / name.split(".")[0]
        with monkeypatch.context() as patched:
            patched.setattr(target, attribute, fault)
            assert main(arguments(data, out, steps=1)) == 1, name
        error = capsys.readouterr().err
        assert error.startswith(f"error: could not write {out / name}: No space left on device"), error
        assert not (out / "summary.json").exists()
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
        if name.startswith("state"):
            assert not (out / name).exists()
        lock = os.open(out / "run.lock", os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
        finally:
            os.close(lock)


def test_resume_under_changed_code_needs_allow_code_change(data, straight, tmp_path, capsys, monkeypatch):
    """A state written by other trajectory code is refused, naming the file that differs and the
    flag; --allow-code-change continues, with a warning."""
    from packed_adamw.torch.gpt import training_state

    identity = training_state.code_identity

    def edited(*args, **kwargs):
        code = identity(*args, **kwargs)
        return {**code, "files": {**code["files"], "packed_adamw.torch/combined.py": "0" * 64}}

    monkeypatch.setattr(training_state, "code_identity", edited)
    state = straight / "state_step000004.safetensors"
    assert main(arguments(data, tmp_path / "refused", "--resume", state)) == 2
    err = capsys.readouterr().err
    assert "combined.py" in err and "--allow-code-change" in err
    with pytest.warns(UserWarning, match="continuing with this code"):
        assert main(arguments(data, tmp_path / "allowed", "--resume", state, "--allow-code-change")) == 0


def test_reference_optimizer_holds_more_state(data, straight, tmp_path):
    """torch.optim.Muon + AdamW over FP32 weights: the run trains and holds more bytes of
    optimizer state per parameter than the packed stack."""
    assert main(arguments(data, tmp_path, "--optimizer", "reference")) == 0
    steps = [r for r in log(tmp_path) if "loss" in r]
    assert steps[-1]["loss"] < steps[0]["loss"]
    reference = json.loads((tmp_path / "summary.json").read_text())
    packed = json.loads((straight / "summary.json").read_text())
    assert reference["weight_bytes_per_parameter"] == 4.0
    assert packed["optimizer_state_bytes_per_parameter"] < reference["optimizer_state_bytes_per_parameter"]
    assert not list(tmp_path.glob("state_step*"))


# Scalars whose gradient is exactly zero at nanochat's initialisation (the projections start at
# zero, so each block passes x through and the final RMS norm cancels every scale): the computed
# gradient is rounding noise, and AdamW (eps 1e-10) turns noise into a step of about +-lr. Any
# other order of summation, such as DDP's average of two ranks' means, moves them differently.
SCALE_INVARIANT_AT_INIT = ("resid_lambdas", "x0_lambdas", "backout_lambda", "smear_lambda")
FP32 = ("--param-dtype", "fp32", "--save-every", 1)


@pytest.fixture(scope="module")
def four_rows(data, tmp_path_factory):
    """One process, 4 rows a step in one batch, FP32 weights, 2 steps, a state after each."""
    out = tmp_path_factory.mktemp("four_rows")
    assert main(arguments(data, out, *FP32, steps=2, batch=4)) == 0
    return out


@pytest.fixture(scope="module")
def accumulated(data, tmp_path_factory):
    """One process, the same 4 rows a step as 2 micro-batches of 2 rows (--grad-accum 2)."""
    out = tmp_path_factory.mktemp("accumulated")
    assert main(arguments(data, out, *FP32, "--grad-accum", 2, steps=2)) == 0
    return out


def assert_first_step_close(out, four_rows_out) -> None:
    """A first step over the 4 rows of `four_rows` summed in another order (two 2-row means
    averaged, against one mean): the next batch is four_rows' first 2 rows at the same cursor;
    the loss agrees to float32 rounding (1e-6 relative) and every weight within 1e-6 absolute
    (most bit for bit), except the scalars above."""
    ours, our_metadata = read(out / "state_step000001.safetensors")
    single, single_metadata = read(four_rows_out / "state_step000001.safetensors")
    assert torch.equal(ours["batch/inputs"], single["batch/inputs"][:2])
    assert json.loads(our_metadata["loader"])["cursor"] == json.loads(single_metadata["loader"])["cursor"]
    for key, value in ours.items():
        if key.endswith("/w") and not any(name in key for name in SCALE_INVARIANT_AT_INIT):
            assert value.shape == single[key].shape and (value - single[key]).abs().max() <= 1e-6, key
    our_loss, single_loss = (next(r["loss"] for r in log(o) if r["step"] == 1) for o in (out, four_rows_out))
    assert abs(our_loss - single_loss) <= 1e-6 * single_loss


def test_grad_accum_matches_one_step_of_all_rows_and_resumes_exactly(data, four_rows, accumulated, tmp_path):
    """2 micro-batches of 2 rows against one batch of 4 rows: the same rows, close as
    assert_first_step_close says (not bitwise: the order of the sums differs). The state's next
    batch is the next step's first micro-batch, and a resume from step 1 gives the step-2 state
    and log record bit for bit."""
    assert_first_step_close(accumulated, four_rows)
    assert main(arguments(data, tmp_path, *FP32, "--grad-accum", 2, "--resume",
                          accumulated / "state_step000001.safetensors", steps=2)) == 0
    assert_same_bits(read(tmp_path / "state_step000002.safetensors")[0],
                     read(accumulated / "state_step000002.safetensors")[0])
    assert trajectory(log(tmp_path)) == trajectory([r for r in log(accumulated) if r["step"] == 2])


def session_script(tmp_path, timeout_s: int):
    """A script running chat_train's main on the argv of its JSON argument, for torchrun: one
    session per launch, as users run them (a second session in the same processes, after the
    first ended its process group, sometimes hung or lost its peer while joining the new group
    on gloo, torch 2.13). A worker still running after `timeout_s` prints every thread's stack
    and exits (torchrun's workers run in sessions of their own, which the launcher's time limit
    may not reach). A session that succeeded ends without the interpreter's finalisation, where a
    gloo rank sometimes aborted after every file was written (distributed_scenarios.py's
    exit_after_success says why); a failing one raises through the interpreter as before."""
    script = tmp_path / "session.py"
    script.write_text(f"import faulthandler, json, os, sys\nfaulthandler.dump_traceback_later({timeout_s}, exit=True)\n"
                      "from packed_adamw.torch.gpt.chat_train import main\n"
                      "assert main(json.loads(sys.argv[1])) == 0\n"
                      "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n")
    return script


def test_ddp_two_ranks_match_one_process(data, four_rows, accumulated, tmp_path):
    """2 gloo ranks x 2 rows, FP32 weights: the ranks read the one process's rows (rank 0 the
    first two). Against one process with 4-row batches: close (assert_first_step_close).
    Against one process accumulating the same two 2-row micro-batches: bit for bit after both
    steps (the same two means, halved and added: with two terms the order cannot matter, and
    halving is exact). Then a DDP resume from step 1 gives the DDP step-2 state bit for bit."""
    ddp_out, resumed_out = tmp_path / "ddp", tmp_path / "resumed"
    ddp_args = arguments(data, ddp_out, *FP32, "--parallel", "ddp", steps=2)
    resume_args = arguments(data, resumed_out, *FP32, "--parallel", "ddp", "--resume",
                            ddp_out / "state_step000001.safetensors", steps=2)
    for argv in (ddp_args, resume_args):
        torchrun(2, session_script(tmp_path, 100), json.dumps(argv), timeout_s=120)

    assert_first_step_close(ddp_out, four_rows)
    ddp = read(ddp_out / "state_step000002.safetensors")[0]
    assert_same_bits(ddp, read(accumulated / "state_step000002.safetensors")[0])
    assert_same_bits(read(resumed_out / "state_step000002.safetensors")[0], ddp)


def test_fsdp2_matches_one_process_and_resumes_resharded(data, straight, four_rows, tmp_path, monkeypatch):
    """FSDP2 (bf16 weights, packed Muon and AdamW state as DTensor shards), 4 steps evaluated
    every 2, on 1 rank with 2 micro-batches of 2 rows a step ("one") and on 2 gloo ranks x 2 rows
    ("two"): the same rows a step, and the states (whole tensors, of the single process's
    layout), logs and val losses are equal bit for bit. A 2-rank resume from step 2 equals
    "two" bit for bit, metadata included. Resharding: "one"'s step-1 state resumed on 2 ranks
    to step 3, that state resumed on 1 rank to step 4: "one"'s step-4 state bit for bit. FP32
    weights on 2 ranks against one process with 4-row batches: close (assert_first_step_close)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)

    def one_rank(*argv):  # rank 0 of 1 in this process, as torchrun would start it
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        assert main(arguments(data, *argv)) == 0

    fsdp = ("--parallel", "fsdp", "--save-every", 1, "--eval-every", 2, "--eval-batches", 1)
    one, two, resumed, there, back = (tmp_path / n for n in ("one", "two", "resumed", "there", "back"))
    one_rank(one, *fsdp, "--grad-accum", 2)
    for argv in (arguments(data, two, *fsdp),
                 arguments(data, resumed, *fsdp, "--resume", two / "state_step000002.safetensors"),
                 arguments(data, there, *fsdp, "--resume", one / "state_step000001.safetensors", "--stop-at", 3),
                 arguments(data, tmp_path / "fp32", *FP32, "--parallel", "fsdp", "--stop-at", 1, steps=2)):
        torchrun(2, session_script(tmp_path, 100), json.dumps(argv), timeout_s=120)
    one_rank(back, *fsdp, "--grad-accum", 2, "--resume", there / "state_step000003.safetensors")

    final = read(two / "state_step000004.safetensors")
    layout = read(straight / "state_step000004.safetensors")[0]  # one process, no FSDP2
    assert {k: (t.dtype, t.shape) for k, t in final[0].items()} == {k: (t.dtype, t.shape) for k, t in layout.items()}
    assert_same_bits(final[0], read(one / "state_step000004.safetensors")[0])
    assert trajectory(log(two)) == trajectory(log(one)) and any("val_bpb" in r for r in log(two))
    resumed_tensors, resumed_metadata = read(resumed / "state_step000004.safetensors")
    assert_same_bits(resumed_tensors, final[0])
    assert resumed_metadata == final[1]
    assert_same_bits(read(back / "state_step000004.safetensors")[0], final[0])
    assert_first_step_close(tmp_path / "fp32", four_rows)


def test_no_rank_returns_before_the_summary_is_written_and_errors_name_their_rank(data, tmp_path, monkeypatch,
                                                                                  capsys):
    """Under torchrun rank 0 writes summary.json, and every rank returns only once it is there (the
    shared loop's barrier, as train.py's): rank 0's write is slowed here by 3 s, and rank 1 looks
    for the file as soon as its main returns. An error under torchrun names the rank that
    printed it (here one rank, in this process, whose summary cannot be written). The same holds
    for a resume of a finished run whose summary rank 0 rebuilds."""
    script = tmp_path / "slow_summary.py"
    script.write_text("import json, os, sys, time\n"
                      "from packed_adamw.torch.gpt import run_directory\n"
                      "from packed_adamw.torch.gpt.chat_train import main\n"
                      "write = run_directory.atomic_write\n"
                      "def slow(path, data):\n    time.sleep(3)\n    write(path, data)\n"
                      "if os.environ['RANK'] == '0':\n    run_directory.atomic_write = slow\n"
                      "argv = json.loads(sys.argv[1])\n"
                      "assert main(argv) == 0\n"
                      "summary = os.path.join(argv[argv.index('--out') + 1], 'summary.json')\n"
                      "assert os.path.exists(summary), f\"rank {os.environ['RANK']} returned before {summary}\"\n"
                      "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n")
    torchrun(2, script, json.dumps(arguments(data, tmp_path / "ddp", "--parallel", "ddp", steps=1)), timeout_s=120)
    # A resume of the finished run whose summary was lost: rank 0 rebuilds it from the log, and
    # no rank returns before it is there either.
    (tmp_path / "ddp" / "summary.json").unlink()
    torchrun(2, script, json.dumps(arguments(data, tmp_path / "ddp", "--parallel", "ddp", "--resume", "auto",
                                             steps=1)), timeout_s=120)
    assert "rebuilt_from" in json.loads((tmp_path / "ddp" / "summary.json").read_text())

    from packed_adamw.torch.gpt import run_directory

    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("GLOO_SOCKET_IFNAME", "lo"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(run_directory, "atomic_write", no_space)
    out = tmp_path / "one_rank"
    assert main(arguments(data, out, "--parallel", "ddp", steps=1)) == 1
    assert f"error (rank 0): could not write {out / 'summary.json'}" in capsys.readouterr().err


def test_the_reference_optimizer_is_torch_muon_and_adamw_stepped_side_by_side():
    """`--optimizer reference` is optimizers.TorchMuonAdamW over the model's groups (their own
    lr, betas, weight decay, and keys torch keeps unread, such as the scalar groups' `mode`):
    bit for bit torch.optim.Muon over the Muon groups and torch.optim.AdamW over the rest."""
    import argparse
    import copy
    import dataclasses

    from packed_adamw.torch.gpt.chat_model import PRESETS, ChatGPT
    from packed_adamw.torch.gpt.chat_train import build_optimizer
    from packed_adamw.torch.gpt.schedules import ScheduleConfig, apply_schedule, build_schedule

    torch.manual_seed(0)
    ours = ChatGPT(dataclasses.replace(PRESETS["chat-tiny"], vocab_size=97, d_model=64, n_layers=2, n_heads=2))
    theirs, start = copy.deepcopy(ours), copy.deepcopy(ours)
    args = argparse.Namespace(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.008, scalar_lr=0.5, weight_decay=0.28,
                              optimizer="reference", muon_mode="packed")
    reference = build_optimizer(ours, args, torch.device("cpu"))
    groups = theirs.muon_adamw_groups(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.008, scalar_lr=0.5,
                                      weight_decay=0.28)
    muon = torch.optim.Muon([g for g in groups if g["kind"] == "muon"])
    adamw = torch.optim.AdamW([g for g in groups if g["kind"] == "adamw"])
    schedule = build_schedule(ScheduleConfig(num_steps=4, warmup_steps=1))
    rng = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randint(0, 97, (2, 32), generator=rng), torch.randint(0, 97, (2, 32), generator=rng)
        cu = torch.tensor([0, 20, 32, 50, 64], dtype=torch.int32)
        apply_schedule(reference, schedule, step)
        apply_schedule(muon, schedule, step)
        apply_schedule(adamw, schedule, step)
        ours(x, y, cu_seqlens=cu)[1].backward()
        theirs(x, y, cu_seqlens=cu)[1].backward()
        reference.step()
        muon.step()
        adamw.step()
        for opt in (reference, muon, adamw):
            opt.zero_grad()
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(bits(p), bits(q)), name
    moved = [n for (n, p), (_, q) in zip(ours.named_parameters(), start.named_parameters()) if not torch.equal(p, q)]
    assert len(moved) == len(list(start.parameters())), "every parameter trained"
