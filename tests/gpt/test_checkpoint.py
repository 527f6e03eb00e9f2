"""Checkpoint files: contents, refusal of foreign or damaged files, atomic writes."""
import json

import pytest
import torch
from safetensors import safe_open

from gpt_helpers import MICRO, build_data
from packed_adamw.core import __version__
from packed_adamw.torch.gpt import checkpoint
from packed_adamw.torch.gpt.checkpoint import CheckpointError, config_differences, read_checkpoint
from packed_adamw.torch.gpt.run_directory import RunWriteError
from packed_adamw.torch.gpt.train import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 3-step micro run: (argv, checkpoint path)."""
    root = tmp_path_factory.mktemp("run")
    argv = [*MICRO, "--data", str(build_data(root / "data")), "--out", str(root / "out"), "--max-steps", "3"]
    assert main(argv) == 0
    return argv, root / "out" / "checkpoint.safetensors"


def test_checkpoint_holds_the_whole_training_state(run):
    _, path = run
    tensors, metadata = read_checkpoint(path)
    words = [t for key, t in tensors.items() if key.endswith("/words")]
    assert len(words) == 28 and all(t.dtype == torch.uint32 for t in words)
    assert {"model/tok_emb.weight", "rng/torch_cpu"} <= tensors.keys()
    assert metadata["trainer"]["step"] == 3 and metadata["code_version"] == __version__
    assert metadata["config"]["model"]["d_model"] == 32 and metadata["config"]["mode"] == "packed"
    assert metadata["tape"]["cursor"] == 3 * 4 * 16
    optimizer = metadata["optimizer"]
    assert optimizer["format_identity"] == optimizer["packed_adamw"]["format"] == "packed:m=SE4M11b15,rms=UE4M12b15"
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [0.1, 0.0]
    assert all(entry["step"] == 3 for entry in optimizer["scalar_state"].values())
    # Plain safetensors: no pickle anywhere, metadata is JSON text.
    with safe_open(path, framework="pt") as f:
        assert json.loads(f.metadata()["trainer"])["step"] == 3


def test_resume_with_another_configuration_lists_every_difference(run, capsys):
    argv, _ = run
    assert main([*argv, "--resume", "auto", "--lr", "0.001", "--mode", "fp32", "--config", "tiny"]) == 2
    error = capsys.readouterr().err
    assert "belongs to another configuration" in error
    for line in ("checkpoint was made with lr=0.003, this run has lr=0.001",
                 "checkpoint was made with mode='packed', this run has mode='fp32'",
                 "checkpoint was made with model.d_model=32, this run has model.d_model=128",
                 "checkpoint was made with model.context=16, this run has model.context=128"):
        assert line in error


def test_config_differences_flattens_nested_fields():
    assert config_differences({"a": 1, "m": {"d": 2}}, {"a": 1, "m": {"d": 3}, "b": 0}) == [
        "checkpoint was made with b=None, this run has b=0",
        "checkpoint was made with m.d=2, this run has m.d=3",
    ]


def test_existing_checkpoint_is_not_overwritten_without_resume(run, capsys):
    """The run took its last step (--max-steps is part of its configuration): the refusal says
    that nothing of it is left to continue, rather than offering --resume auto."""
    argv, path = run
    before = path.read_bytes()
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert ("that run has ended (it took its last step at step 3; checkpoint.safetensors is its final state)"
            in error and "choose another --out" in error)
    assert "--resume" not in error and path.read_bytes() == before


def test_a_finished_run_whose_summary_is_missing_rebuilds_it_from_its_log(run, tmp_path, capsys):
    """summary.json lost after the final checkpoint (a full disk, a signal between the two):
    --resume auto rebuilds it from log.jsonl (the logged losses and the last val_bpb), and the
    checkpoint and log stay as they were."""
    import shutil

    argv, path = run
    out = tmp_path / "out"
    shutil.copytree(path.parent, out)
    original = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()
    checkpoint_bytes, log = (out / "checkpoint.safetensors").read_bytes(), (out / "log.jsonl").read_bytes()
    moved = [str(out) if a == str(path.parent) else a for a in argv]
    assert main([*moved, "--resume", "auto"]) == 0
    assert "summary was missing: rebuilt from" in capsys.readouterr().out
    rebuilt = json.loads((out / "summary.json").read_text())
    for key in ("stopped_because", "step", "final_train_loss_mean_last_50", "val_bpb", "parameters", "loss_events"):
        assert rebuilt[key] == original[key], key
    assert rebuilt["steps_this_session"] == 0 and rebuilt["rebuilt_from"] == str(out / "log.jsonl")
    assert (out / "checkpoint.safetensors").read_bytes() == checkpoint_bytes and (out / "log.jsonl").read_bytes() == log


def test_truncated_checkpoint_is_refused_naming_the_file(run, tmp_path):
    _, path = run
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint {truncated}.*truncated or corrupted"):
        read_checkpoint(truncated)


def test_flipped_bit_is_caught_by_the_checksum(run, tmp_path):
    _, path = run
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the last tensor's bytes
    corrupted = tmp_path / "corrupted.safetensors"
    corrupted.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint {corrupted} fails its checksum"):
        read_checkpoint(corrupted)


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "none.safetensors")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="not a packed-adamw trainer checkpoint"):
        read_checkpoint(tmp_path / "other.safetensors")


def test_resume_from_a_saved_optimizer_state_dict_says_what_the_file_is(run, tmp_path, capsys):
    """torch.save(opt.state_dict()) is a zip archive, which safetensors reads as a huge header."""
    argv, _ = run
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saved = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), saved)
    assert main([*argv, "--out", str(tmp_path / "out"), "--resume", str(saved)]) == 2
    error = capsys.readouterr().err
    assert f"{saved} appears to be an optimizer state_dict saved with torch.save" in error
    assert "checkpoint.safetensors the trainer writes" in error and "corrupted" not in error
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="model.pt appears to be a file saved with torch.save"):
        read_checkpoint(tmp_path / "model.pt")
    torch.save(model.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy.pt appears to be a pickle file"):
        read_checkpoint(tmp_path / "legacy.pt")


def test_a_safetensors_header_length_ending_in_0x80_is_not_a_pickle(tmp_path):
    """A safetensors file starts with its header's length: for 1 in 256 lengths the first byte is
    0x80, a pickle's PROTO opcode (a training state once failed to load so)."""
    from safetensors.torch import save_file
    path = tmp_path / "a.safetensors"
    for padding in range(256):
        save_file({"x": torch.zeros(1)}, str(path), metadata={"pad": "x" * padding})
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80
    assert checkpoint._torch_save_contents(path) is None


@pytest.mark.parametrize("metadata", [{"format": "pt"}, {"format": "pt", "note": "not json"}, {"format": "5"}])
def test_foreign_safetensors_is_named_foreign_not_corrupted(tmp_path, metadata):
    """A valid safetensors file of another program (a Hugging Face model file has {"format": "pt"})."""
    from safetensors.torch import save_file
    foreign = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(2)}, foreign, metadata=metadata)
    with pytest.raises(CheckpointError, match=f"{foreign} is a safetensors file but not a packed-adamw trainer "
                                              "checkpoint") as error:
        read_checkpoint(foreign)
    assert "corrupted" not in str(error.value)


def test_checkpoint_of_another_format_version_says_so(run, tmp_path):
    _, path = run
    data = path.read_bytes()
    old = data.replace(b'packed-adamw-gpt-checkpoint/2', b'packed-adamw-gpt-checkpoint/1', 1)
    assert old != data and len(old) == len(data)
    (tmp_path / "old.safetensors").write_bytes(old)
    with pytest.raises(CheckpointError, match="trainer checkpoint of format 'packed-adamw-gpt-checkpoint/1'"):
        read_checkpoint(tmp_path / "old.safetensors")


def test_resume_accepts_a_run_directory(run, tmp_path, capsys):
    argv, path = run
    assert main([*argv, "--resume", str(path.parent)]) == 0  # the finished run: prints its summary
    assert f"resumed from {path} at step 3" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=f"checkpoint {path.parent} is a directory.*{checkpoint.CHECKPOINT_NAME}"):
        read_checkpoint(path.parent)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*argv, "--out", str(tmp_path / "out"), "--resume", str(empty)]) == 2
    error = capsys.readouterr().err
    assert f"--resume {empty} is a directory without checkpoint.safetensors" in error
    assert f"looked for {empty / 'checkpoint.safetensors'}" in error and "does not exist" not in error


def test_failed_write_leaves_the_previous_checkpoint_untouched(tmp_path, monkeypatch, capsys):
    argv = [*MICRO, "--data", str(build_data(tmp_path / "data")), "--out", str(tmp_path / "out"), "--max-steps", "3"]
    assert main([*argv, "--stop-at-step", "2"]) == 0  # a run with a step still to go
    path = tmp_path / "out" / "checkpoint.safetensors"
    before = path.read_bytes()
    real_save_file = checkpoint.save_file

    def crash_mid_write(tensors, filename, metadata):
        real_save_file(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # leave half a file behind, as a crash would
            f.truncate(len(before) // 2)
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", crash_mid_write)
    assert main([*argv, "--resume", "auto"]) == 1  # one line naming the file, no traceback
    assert f"error: could not write {path}: No space left on device" in capsys.readouterr().err
    assert issubclass(RunWriteError, OSError)  # callers catching the OSError of a write still catch it
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if "tmp" in p.name) == []
    read_checkpoint(path)


def test_edited_metadata_fails_the_checksum(run, tmp_path):
    """The step, tape cursor and optimizer step counts are covered, not only the tensors."""
    _, path = run
    data = path.read_bytes()
    header_size = int.from_bytes(data[:8], "little")
    header = data[8:8 + header_size].decode()
    edited_header = header.replace('\\"step\\": 3', '\\"step\\": 2', 1)
    assert edited_header != header
    edited = tmp_path / "edited.safetensors"
    edited.write_bytes(data[:8] + edited_header.encode() + data[8 + header_size:])
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(edited)


def test_a_log_line_cut_short_by_a_crash_does_not_block_resume(tmp_path):
    argv = [*MICRO, "--data", str(build_data(tmp_path / "data")), "--out", str(tmp_path / "out"), "--max-steps", "3"]
    assert main([*argv, "--stop-at-step", "2", "--log-every", "1"]) == 0
    log = tmp_path / "out" / "log.jsonl"
    log.write_text(log.read_text() + '{"step": 9')
    assert main([*argv, "--resume", "auto", "--log-every", "1"]) == 0
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 3
