"""The run directory (--out) both trainers write into, and how a run keeps it: one run per
directory, one process at a time, a stop asked for by a signal, writes that fail as errors.

- `check_out`: --out must be a directory this process can write, or a path where one can be
  made (checked when the command line is parsed, and again when the run claims it).
- `claim`: for the run's whole life rank 0 (the one process that writes; docs/DISTRIBUTED.md)
  holds an exclusive `fcntl.flock` on `--out/run.lock`, so a second run into the directory is
  refused while the first lives. The kernel releases the lock when its process ends, however it
  ends, so a lock file left by a killed run blocks nothing: what counts is the lock, not the
  file (which stays, empty). Inside the claim the trainer checks the files already there:
  `refuse_earlier_run` (a fresh start into another run's directory) and
  `refuse_to_replace_newer` (a resume that would replace a newer state, or one of another
  configuration). A refusal on rank 0 is raised on every rank (`on_main_rank`).
- `summary_of_finished`: a resumed run with nothing left to do changes nothing in the directory.
- `StopRequest`: SIGINT/SIGTERM ask the loop to stop at the next step boundary, where it writes
  its state and exits 0; under torchrun the ranks agree on the step (`StopRequest.agreed`).
- `writing`, `GuardedRunLog`, `write_summary`: an OSError while writing a run's file (a full
  disk) ends the run with one line naming the file (`RunWriteError`, exit 1), never a
  traceback; states and summaries are written atomically (core/atomic_file.py), so a failed
  write leaves the previous file or none, never a part of one.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from packed_adamw.core.atomic_file import atomic_write

from .checkpoint import CheckpointError, config_differences
from .distributed import Ranks
from .telemetry import RunLog

LOCK_NAME = "run.lock"
STOP_SIGNALS = (None, "SIGINT", "SIGTERM")  # agreed between ranks as an index (the largest wins)
NAMES_SHOWN = 6  # of another run's files, in a refusal


class RunDirectoryError(ValueError):
    """An --out this run cannot use (the message says what to do instead)."""


class RunWriteError(RuntimeError):
    """A file of the run could not be written (the message names it and says why)."""


# ---- the directory -------------------------------------------------------------------------------
def check_out(out: Path) -> None:
    """Refuse an --out that is a file, or that this process cannot write or make (RunDirectoryError)."""
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(f"--out {out} is a file: pass a directory (a run writes several files there)")
    existing = out.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirectoryError(f"--out {out}: {existing} is a file, so the directory cannot be made; "
                                "pass a path under a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirectoryError(f"--out {out}: {existing} is not writable by this process; pass a directory "
                                "you can write")


def on_main_rank(ranks: Ranks, device: torch.device, action: Callable[[], object]):
    """`action()` on rank 0 alone (the writer), its result returned there (None elsewhere). An
    error it raises is raised on every rank, the others pointing to rank 0's, so that no rank
    waits in a collective for one that gave up. Collective under torchrun (one all-reduce)."""
    error, result = None, None
    if ranks.main:
        try:
            result = action()
        except Exception as raised:  # re-raised below, after the ranks have agreed
            error = raised
    if ranks.agree(int(error is not None), device):
        if error is not None:
            raise error
        raise RunDirectoryError("rank 0 stopped the run: its error says why")
    return result


class RunLock:
    """The exclusive flock on `out/run.lock`: held from `acquire` to `release` (or this
    process's end, when the kernel drops it)."""

    def __init__(self, out: Path):
        self.out, self.path, self.fd = out, out / LOCK_NAME, None

    def acquire(self) -> None:
        check_out(self.out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise RunDirectoryError(f"--out {self.out}: cannot create {self.path} ({error.strerror}); pass a "
                                    "directory you can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirectoryError(f"--out {self.out} is in use by another run: it holds the lock on {self.path} "
                                    "(flock); wait for that run to end, or choose another --out") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock
            self.fd = None


@contextlib.contextmanager
def claim(out: Path, ranks: Ranks, device: torch.device, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold --out for the run inside the block: rank 0 takes its lock, then runs `check` (the
    trainer's refusals of the files already there) before anything is written. A refusal on
    rank 0 is raised on every rank; the lock goes with the block, exception or not."""
    lock = RunLock(out)

    def take() -> None:
        lock.acquire()
        try:
            check()
        except BaseException:
            lock.release()
            raise

    on_main_rank(ranks, device, take)
    try:
        yield
    finally:
        lock.release()


def refuse_earlier_run(out: Path, found: list[Path], resume_with: str | None) -> None:
    """A fresh run into a directory holding another run's files (`found`) would replace them:
    refuse, naming them and how to continue that run (`resume_with`, the flag to pass; None:
    that run left nothing to resume from)."""
    if not found:
        return
    names = [p.name for p in found[:NAMES_SHOWN]] + ([f"{len(found) - NAMES_SHOWN} more"]
                                                     if len(found) > NAMES_SHOWN else [])
    continued = (f"continue that run with {resume_with}, or choose another --out" if resume_with else
                 "it left nothing to resume from: choose another --out, or move its files away")
    raise RunDirectoryError(f"--out {out} holds another run's files ({', '.join(names)}); a new run would replace "
                            f"them: {continued}")


def refuse_to_replace_newer(existing: Path, resume_path: Path, step: int, trajectory: dict, *,
                            read_info: Callable[[Path], dict], resume_with: str) -> None:
    """Resuming `resume_path` (at `step`) into an --out whose state `existing` is newer (or of
    another run) would lose it: refuse (CheckpointError), saying how to continue that one
    (`resume_with`, a flag). `read_info(path)` gives a state's {"step", "config"}."""
    if not existing.exists() or (resume_path.exists() and existing.samefile(resume_path)):
        return
    what_to_do = (f"continue it with {resume_with}, resume {resume_path} into another --out, or move "
                  f"{existing} away first")
    try:
        info = read_info(existing)
    except CheckpointError as error:
        raise CheckpointError(f"--out already holds {existing}, which resuming {resume_path} would replace, "
                              f"and it cannot be read ({error}); move it away first, or resume into another "
                              "--out") from None
    if info["step"] > step:
        raise CheckpointError(f"{existing} (step {info['step']}) is newer than {resume_path} (step {step}): "
                              f"resuming here would replace it; {what_to_do}")
    if config_differences(info["config"], trajectory):
        raise CheckpointError(f"{existing} belongs to another configuration than {resume_path}: resuming "
                              f"here would replace it; {what_to_do}")


def summary_of_finished(summary_path: Path, step: int) -> dict | None:
    """The summary a finished run wrote when it ended at `step`, which a resume with nothing
    left to do returns as it is (None: no summary of that step here)."""
    if not summary_path.is_file():
        return None
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("step") == step else None


# ---- stopping ------------------------------------------------------------------------------------
class StopRequest:
    """SIGINT/SIGTERM set a flag that the loop checks between steps (handlers restored on exit)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal_name = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        # Only set the flag: printing here could re-enter a stream the loop is writing to.
        self.signal_name = signal.Signals(signum).name

    def agreed(self, ranks: Ranks, device: torch.device) -> str | None:
        """The signal any rank received (None: go on); every rank stops at the same step
        (torchrun forwards a signal to every worker, but not at the same moment). Collective."""
        return STOP_SIGNALS[ranks.agree(STOP_SIGNALS.index(self.signal_name), device)]


# ---- writing -------------------------------------------------------------------------------------
@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """An OSError inside the block (a full disk, a directory gone read-only) becomes a
    RunWriteError naming `path`."""
    try:
        yield
    except OSError as error:
        raise RunWriteError(f"could not write {path}: {error.strerror or error}") from None


class GuardedRunLog(RunLog):
    """telemetry.RunLog whose failed writes are RunWriteErrors naming the file."""

    def __enter__(self) -> "GuardedRunLog":
        with writing(self.path):
            return super().__enter__()

    def write(self, record: dict) -> None:
        with writing(self.path):
            super().write(record)

    def append_to(self, path: Path, record: dict) -> None:
        with writing(path):
            super().append_to(path, record)


def write_summary(path: Path, summary: dict) -> None:
    """summary.json, atomically (a reader finds the old summary or the whole new one)."""
    with writing(path):
        atomic_write(path, (json.dumps(summary, indent=2) + "\n").encode())
