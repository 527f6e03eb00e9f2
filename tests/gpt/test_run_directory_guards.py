"""The run directory's guards (torch_frontend/gpt/run_directory.py) against what a hostile
review found: a user's files in --out that a run would replace, log lines that are not a
run's records, temporary files a killed save left, and states only their owner could read.
Unit-level calls on the functions both trainers' starts go through (loop.run's claim and
refusals), with each trainer's RunFiles."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from packed_adamw.core.atomic_file import atomic_path, atomic_write
from packed_adamw.torch.gpt import chat_train, telemetry, train
from packed_adamw.torch.gpt.distributed import Ranks
from packed_adamw.torch.gpt.run_directory import RunDirectoryError, claim, log_records, refuse_earlier_run

ODD_LINES = '[1, 2]\n"hello"\n{"step": null}\n{"step": "a"}\n{"step": true}\n'


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "run.lock"}


def refusal(out, files) -> str:
    """The message of the refusal of a fresh start into `out`; fails the test where it starts."""
    with pytest.raises(RunDirectoryError) as refused:
        refuse_earlier_run(out, files)
    return str(refused.value)


def test_a_users_files_where_train_writes_are_refused_and_kept(tmp_path):
    """Files a user keeps in an --out where train.py writes its plots and log are refused, named
    (the log with why it is no run's), and left as they were: a start never replaces them."""
    out = tmp_path / "u1"
    out.mkdir()
    for name in ("loss.png", "format.png", "log.jsonl"):
        (out / name).write_text("notes\n")
    before = files_of(out)
    error = refusal(out, train.RUN_FILES)
    assert f"--out {out} holds files that are not this run's" in error, error
    assert "format.png" in error and "loss.png" in error and "log.jsonl (line 1 is not a run's record)" in error
    assert "choose another --out, or move them away" in error
    for name in ("format.png", "log.jsonl"):  # each counts on its own
        alone = tmp_path / f"only-{name}"
        alone.mkdir()
        (alone / name).write_text("notes\n")
        assert name in refusal(alone, train.RUN_FILES)
    assert files_of(out) == before


def test_a_users_log_and_schedule_where_chat_train_writes_are_refused(tmp_path):
    """chat_train's schedule.safetensors counts on its own unless it is one a run wrote (with
    the "schedule" metadata): a user's file there, or an unreadable one, is refused; a run's
    schedule alone (a start that failed before its first step) blocks nothing."""
    out = tmp_path / "u2"
    out.mkdir()
    (out / "log.jsonl").write_text("notes\n")
    (out / "schedule.safetensors").write_text("x\n")
    error = refusal(out, chat_train.RUN_FILES)
    assert "log.jsonl (line 1 is not a run's record)" in error, error
    assert "schedule.safetensors (no 'schedule' metadata: not a file a run wrote)" in error
    other_metadata = tmp_path / "other"
    other_metadata.mkdir()
    save_file({"t": torch.zeros(2)}, str(other_metadata / "schedule.safetensors"), metadata={"note": "mine"})
    assert "schedule.safetensors (no 'schedule' metadata" in refusal(other_metadata, chat_train.RUN_FILES)

    started = tmp_path / "started"  # what chat_train writes before its first step: nobody's run yet
    started.mkdir()
    save_file({"lr": torch.zeros(2)}, str(started / "schedule.safetensors"), metadata={"schedule": json.dumps({})})
    (started / "log.jsonl").write_text("")
    refuse_earlier_run(started, chat_train.RUN_FILES)
    assert chat_train.RUN_FILES.earlier_run(started) == []


def test_log_lines_that_are_not_records_are_refused_and_never_crash(tmp_path):
    """A log whose lines are JSON but no run's records (a list, a string, a step that is not an
    integer) is refused as no run's log; both parsers of the log (run_directory.log_records,
    telemetry.keep_records_up_to) read it without an error, keeping only the records."""
    out = tmp_path / "j1"
    out.mkdir()
    (out / "log.jsonl").write_text(ODD_LINES)
    for files in (train.RUN_FILES, chat_train.RUN_FILES):
        assert "log.jsonl (line 1 is not a run's record)" in refusal(out, files)
    assert log_records(out / "log.jsonl") == []

    resumed = out / "log.jsonl"  # a run's own log, resumed at step 2, with odd lines in it
    resumed.write_text('{"step": 1, "loss": 5.0}\n' + ODD_LINES + '{"step": 3, "loss": 4.0}\n{"step": 2, "lo')
    assert [r["step"] for r in log_records(resumed)] == [1, 3]
    assert telemetry.log_records(resumed) == [{"step": 1, "loss": 5.0}, {"step": 3, "loss": 4.0}]
    telemetry.keep_records_up_to(resumed, 2)
    assert resumed.read_text() == '{"step": 1, "loss": 5.0}\n'
    assert "another run's files (log.jsonl)" in refusal(out, train.RUN_FILES)  # now a run's log alone


def test_claim_removes_the_temporary_files_a_killed_save_left(tmp_path, capsys):
    """A save killed before its rename (SIGKILL) leaves atomic_path's temporary file: the next
    run's claim removes those of the run's own files (its states, schedule, summary), saying so
    on stderr, and leaves any other file; a claim refused by its check removes nothing."""
    out = tmp_path / "killed"
    out.mkdir()
    leftovers = [".state_step000002.safetensors.0123456789ab.tmp", ".schedule.safetensors.abcdef012345.tmp",
                 ".summary.json.00000000ffff.tmp"]
    kept = [".notes.txt.0123456789ab.tmp", ".state_step000002.safetensors.tmp", "state_step000002.safetensors"]
    for name in leftovers + kept:
        (out / name).write_bytes(b"\0" * 8)

    def refuse() -> None:
        raise RunDirectoryError("refused")

    with pytest.raises(RunDirectoryError):
        with claim(out, Ranks(), torch.device("cpu"), refuse, files=chat_train.RUN_FILES):
            pass
    assert sorted(p.name for p in out.iterdir() if p.name != "run.lock") == sorted(leftovers + kept)
    capsys.readouterr()
    with claim(out, Ranks(), torch.device("cpu"), files=chat_train.RUN_FILES):
        assert sorted(p.name for p in out.iterdir() if p.name != "run.lock") == sorted(kept)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"--out {out}" in err and all(name in err for name in leftovers), err

    train_out = tmp_path / "train"  # train.py's names: checkpoint.safetensors
    train_out.mkdir()
    (train_out / ".checkpoint.safetensors.0123456789ab.tmp").write_bytes(b"\0")
    with claim(train_out, Ranks(), torch.device("cpu"), files=train.RUN_FILES):
        pass
    assert [p.name for p in train_out.iterdir()] == ["run.lock"]


def test_atomic_files_get_the_mode_of_a_new_file(tmp_path):
    """A file written through atomic_path gets 0o666 less the umask, as `open` gives a new file,
    though safetensors' save_file makes it 0o600: a team sharing a run directory can read its
    states. atomic_write's files too."""
    previous = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "state.safetensors") as written:
            save_file({"t": torch.zeros(2)}, str(written))
        atomic_write(tmp_path / "summary.json", b"{}\n")
        os.umask(0o027)
        with atomic_path(tmp_path / "group.safetensors") as written:
            save_file({"t": torch.zeros(2)}, str(written))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "state.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "summary.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "group.safetensors").stat().st_mode) == 0o640
