"""The run directory (--out) both trainers write into, and how a run keeps it: one run per
directory, one process at a time, a stop asked for by a signal, writes that fail as errors.

- `check_out`: --out must be a directory this process can write, or a path where one can be
  made (checked when the command line is parsed, and again when the run claims it).
- `claim`: for the run's whole life rank 0 (the one process that writes; docs/DISTRIBUTED.md)
  holds an exclusive `fcntl.flock` on `--out/run.lock`, so a second run into the directory is
  refused while the first lives. The kernel releases the lock when its process ends, however it
  ends, so a lock file left by a killed run blocks nothing: what counts is the lock, not the
  file (which stays, empty). A file system without flock (Lustre mounted without `-o flock`,
  some FUSE file systems) cannot hold the lock: the run goes on unlocked, with a
  `RunDirectoryWarning` naming --out and the file system (the refusals below still hold; only
  two runs started into the directory at the same time are no longer kept apart). Inside the
  claim the trainer checks the files already there; then the temporary files that a run killed
  while writing one of its files (SIGKILL during a save) left are removed, said on stderr.
- `RunFiles`: what a trainer writes into --out, and which of those files make it another run's
  (`RunFiles.earlier_run`, the one test both trainers use): its states and summary, its logs
  once they hold a record; files a run writes before its first step (chat_train's schedule)
  only beside those, so a start that failed before its first step blocks nothing. A file that
  no run wrote where a run writes one (a log with a line that is not a run's record, a schedule
  without the metadata the trainer writes) counts on its own: the run would replace it.
- `refuse_earlier_run`: a run that will not continue a state of --out (a fresh start, a
  `--resume auto` that found no state, a resume of a file from elsewhere) is refused where
  --out holds another run's files, naming them and how to continue that run (or that it has
  ended). `refuse_to_replace`: a resume is also refused where it would replace a newer state
  of --out, or one of another configuration (`refuse_to_replace_newer`). A refusal on rank 0 is
  raised on every rank (`on_main_rank`).
- `finished_run_summary`: a resumed run with nothing left to do changes nothing in the
  directory; a summary lost after the final state is rebuilt from log.jsonl.
- `StopRequest`: SIGINT/SIGTERM ask the loop to stop at the next step boundary, where it writes
  its state and exits 0; under torchrun the ranks agree on the step (`StopRequest.agreed`).
- `writing`, `GuardedRunLog`, `write_summary`: an OSError while writing a run's file (a full
  disk) ends the run with one line naming the file (`RunWriteError`, itself an OSError, exit 1),
  never a traceback; states and summaries are written atomically (core/atomic_file.py), so a
  failed write leaves the previous file or none, never a part of one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from packed_adamw.core.atomic_file import atomic_write, temp_target

from .checkpoint import CheckpointError, config_differences
from .distributed import Ranks
from .telemetry import RunLog, run_record

LOCK_NAME = "run.lock"
STOP_SIGNALS = (None, "SIGINT", "SIGTERM")  # agreed between ranks as an index (the largest wins)
NAMES_SHOWN = 6  # of another run's files, in a refusal
# flock's errors on a file system that has no flock (Lustre without -o flock: ENOSYS; NFS without
# a lock manager: ENOLCK; some FUSE file systems: EOPNOTSUPP or EINVAL)
FLOCK_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
# summary.json's stopped_because of a run that has ended: nothing of it is left to continue
ENDED = {"steps": "it took its last step", "max_steps": "it took its last step", "tape_exhausted": "its tape ran out",
         "diverged": "it diverged"}


class RunDirectoryError(ValueError):
    """An --out this run cannot use (the message says what to do instead)."""


class RunDirectoryWarning(UserWarning):
    """--out cannot be locked (its file system has no flock): the run goes on unprotected."""


class RunWriteError(OSError):
    """A file of the run could not be written (the message names it and says why). An OSError,
    as the error it stands for: callers that catch OSError around a write still catch it."""


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
        except OSError as error:
            os.close(fd)
            if error.errno not in FLOCK_UNSUPPORTED:
                raise RunDirectoryError(f"--out {self.out}: cannot lock {self.path} ({error.strerror or error}); "
                                        "pass a directory on a local file system") from None
            # Refusing would make the trainers unusable on such a file system; the refusals of
            # another run's files do not need the lock. What is lost is the guard against two
            # runs started into --out at the same time: said, so that a scheduler can avoid it.
            warnings.warn(f"--out {self.out} is on a file system without flock ({filesystem_of(self.out)}: "
                          f"{error.strerror or error}): the run goes on without the lock on {self.path}, so the "
                          "directory is NOT protected against a second run started into it while this one runs; "
                          "start one run at a time there, or choose an --out on a file system with flock "
                          "(Lustre: mount with -o flock)", RunDirectoryWarning, stacklevel=2)
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the flock
            self.fd = None


@contextlib.contextmanager
def claim(out: Path, ranks: Ranks, device: torch.device, check: Callable[[], None] = lambda: None,
          files: RunFiles | None = None) -> Iterator[None]:
    """Hold --out for the run inside the block: rank 0 takes its lock, then runs `check` (the
    trainer's refusals of the files already there) before anything is written, then removes
    the temporary files of `files`' names that a killed run left (`remove_leftover_temp_files`).
    A refusal on rank 0 is raised on every rank; the lock goes with the block, exception or not."""
    lock = RunLock(out)

    def take() -> None:
        lock.acquire()
        try:
            check()
            if files is not None:
                remove_leftover_temp_files(out, files)
        except BaseException:
            lock.release()
            raise

    on_main_rank(ranks, device, take)
    try:
        yield
    finally:
        lock.release()


def remove_leftover_temp_files(out: Path, files: RunFiles) -> list[Path]:
    """Remove the temporary files of atomic writes (core/atomic_file.py) of the run's own files
    in `out` (`RunFiles.owns`), which a process killed during the write left (a state's is as
    large as the state), saying so in one line on stderr; returns them. Only under the run's
    lock, which no other writer of those files holds."""
    leftovers = sorted(path for path in out.iterdir()
                       if (target := temp_target(path.name)) is not None and files.owns(out / target)
                       and not path.is_dir())
    for path in leftovers:
        with writing(path):
            path.unlink(missing_ok=True)
    if leftovers:
        names = [p.name for p in leftovers[:NAMES_SHOWN]] + ([f"{len(leftovers) - NAMES_SHOWN} more"]
                                                             if len(leftovers) > NAMES_SHOWN else [])
        print(f"removed from --out {out} the temporary files of writes a killed run left unfinished: "
              f"{', '.join(names)}", file=sys.stderr)
    return leftovers


def filesystem_of(path: Path) -> str:
    """"<type> at <mount point>" of the file system holding `path` (Linux's mount table), or
    "its file system" where that cannot be told."""
    try:
        target, best = str(path.resolve()), None
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1].replace("\\040", " ")
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and \
                    (best is None or len(mount) > len(best[0])):
                best = (mount, fields[2])
        return f"{best[1]} at {best[0]}" if best else "its file system"
    except (OSError, IndexError):
        return "its file system"


# ---- another run's files -------------------------------------------------------------------------
def log_records(path: Path, up_to: int | None = None) -> list[dict]:
    """The records of a JSON-lines log (telemetry.run_record: a line a crash cut short is none),
    those of steps up to `up_to` (None: all); [] for a file that is not there."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = (run_record(line) for line in text.splitlines())
    return [r for r in records if r is not None and (up_to is None or r["step"] <= up_to)]


def _present(path: Path) -> bool:
    return path.exists() or path.is_symlink()  # a dangling link is someone's file too


def _holds_anything(log: Path) -> bool:
    """Whether a log holds a line (a record, or a line no run wrote): an empty one, which a
    start that never finished a step opened, is the only one a run may replace."""
    if not _present(log):
        return False
    if not log.exists():  # a dangling link: what it held cannot be told, so it is counted
        return True
    try:
        return any(line.strip() for line in log.read_text().splitlines())
    except (OSError, UnicodeDecodeError):  # unreadable: counted, never replaced
        return True


def _not_a_run_log(log: Path) -> str | None:
    """Why `log` is no run's log, or None (it is a run's, or empty, or cannot be read)."""
    try:
        lines = log.read_text().splitlines()
    except UnicodeDecodeError:
        return "not text"
    except OSError:
        return None
    if any(run_record(line) is not None for line in lines):
        return None  # a run's log, whose last line a crash may have cut short
    return next((f"line {number} is not a run's record" for number, line in enumerate(lines, 1) if line.strip()),
                None)


def _marked(path: Path, key: str) -> bool:
    """Whether `path` is a safetensors file whose metadata holds `key` with a JSON value."""
    try:
        with safe_open(path, framework="pt") as f:
            json.loads((f.metadata() or {})[key])
        return True
    except (OSError, SafetensorError, KeyError, TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """What a trainer writes into --out, for the refusals that keep another run's files.

    `results`: files that make --out another run's whenever they are there (the summary, a
    checkpoint); `logs`: JSON-lines files that do once they hold a record (a log opened by a
    start that never finished a step is empty); `before_first_step`: files a run writes before
    its first step, which count only beside one of the others (so that a start that failed
    early blocks nothing); `states(out)`: the run's states there, oldest first;
    `state_step(path)`: a state's step, where its name tells (None: unknown); `resume_flag(state)`:
    the flag that continues from a state; `marks`: safetensors files among `before_first_step`
    -> the metadata key the trainer writes into them (one without it is no run's, and counts
    on its own)."""
    results: tuple[str, ...]
    logs: tuple[str, ...]
    before_first_step: tuple[str, ...]
    states: Callable[[Path], list[Path]]
    state_step: Callable[[Path], int | None]
    resume_flag: Callable[[Path], str]
    marks: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def earlier_run(self, out: Path) -> list[Path]:
        """The files in `out` that a run must not replace (sorted; [] when it holds none):
        another run's, and files no run wrote where a run writes (`not_a_runs`); the one test
        both trainers' refusals use."""
        found = [out / name for name in self.results if _present(out / name)]
        found += [out / name for name in self.logs if _holds_anything(out / name)]
        found += self.states(out)
        if found:
            found += [out / name for name in self.before_first_step if _present(out / name)]
        found += self.not_a_runs(out)
        return sorted(set(found))

    def not_a_runs(self, out: Path) -> dict[Path, str]:
        """The files of `out` with a run's name that no run wrote -> why: a log holding no record
        but some other line, a marked file (`marks`) without its mark. (A file whose content
        cannot tell, a plot, counts as a run's.)"""
        found = {}
        for name in self.logs:
            why = _not_a_run_log(out / name) if (out / name).exists() else None
            if why is not None:
                found[out / name] = why
        for name, key in self.marks.items():
            if _present(out / name) and not _marked(out / name, key):
                found[out / name] = f"no {key!r} metadata: not a file a run wrote"
        return found

    def owns(self, path: Path) -> bool:
        """Whether `path` has the name of one of the run's files."""
        return path.name in (*self.results, *self.logs, *self.before_first_step) or self.state_step(path) is not None

    def ended(self, out: Path) -> str | None:
        """Why the run of `out` has ended, from its summary (None: it has not, or its summary
        does not say so): its newest state is then its last, and nothing is left to continue."""
        try:
            summary = json.loads((out / "summary.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(summary, dict) or summary.get("stopped_because") not in ENDED:
            return None
        states = self.states(out)
        step = self.state_step(states[-1]) if states else None
        ended_at = summary.get("step")
        # A run that diverged ended after its newest state (the last good one, which a resume would
        # take into the same divergence); the others end at a state. (A state whose name does not
        # tell its step, train.py's checkpoint, is taken for the summary's.)
        if step is not None and (step > ended_at if summary["stopped_because"] == "diverged"
                                 and isinstance(ended_at, int) else step != ended_at):
            return None  # a newer state than the summary's: a later session that did not end
        return f"{ENDED[summary['stopped_because']]} at step {summary.get('step')}"

    def how_to_continue(self, out: Path) -> str:
        """What to say of the run whose files `out` holds: how to continue it, or that it ended."""
        states = self.states(out)
        ended = self.ended(out)
        if ended:
            last = f"; {states[-1].name} is its final state" if states else ""
            return f"that run has ended ({ended}{last}), so nothing of it is left to continue"
        if states:
            return f"continue that run with {self.resume_flag(states[-1])}"
        return "it left nothing to resume from"


def refuse_earlier_run(out: Path, files: RunFiles, resuming: Path | None = None) -> None:
    """A run that will not continue a state of `out` (a fresh start; `resuming`: a resume of a
    file that is not one of out's states) would replace the files another run left there:
    refuse (RunDirectoryError), naming them and what to do."""
    if resuming is not None and any(_same_file(state, resuming) for state in files.states(out)):
        return  # it continues a state of out: that run's own files
    found = files.earlier_run(out)
    if not found:
        return
    foreign = files.not_a_runs(out)
    names = [f"{p.name} ({foreign[p]})" if p in foreign else p.name for p in found[:NAMES_SHOWN]] + (
        [f"{len(found) - NAMES_SHOWN} more"] if len(found) > NAMES_SHOWN else [])
    what = "a new run" if resuming is None else f"resuming {resuming} there"
    instead = "choose another --out" if resuming is None else f"resume {resuming} into another --out"
    if not foreign:
        raise RunDirectoryError(f"--out {out} holds another run's files ({', '.join(names)}); {what} would replace "
                                f"them: {files.how_to_continue(out)}; {instead}, or move its files away")
    continued = f"{files.how_to_continue(out)}; " if files.states(out) else ""
    raise RunDirectoryError(f"--out {out} holds files that are not this run's ({', '.join(names)}); {what} would "
                            f"replace them: {continued}{instead}, or move them away")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def refuse_to_replace(out: Path, files: RunFiles, resume_path: Path, step: int, trajectory: dict, *,
                      read_info: Callable[[Path], dict]) -> None:
    """Before a resume of `resume_path` (at `step`) writes anything in `out` or trims its logs:
    refused where a state there is newer or of another configuration (`refuse_to_replace_newer`,
    CheckpointError), and where `resume_path` is not one of out's states while out holds
    another run's files (`refuse_earlier_run`, RunDirectoryError)."""
    states = files.states(out)
    continued = files.how_to_continue(out) if states else ""
    for existing in states:
        refuse_to_replace_newer(existing, resume_path, step, trajectory, read_info=read_info, continued=continued)
    refuse_earlier_run(out, files, resuming=resume_path)


def refuse_to_replace_newer(existing: Path, resume_path: Path, step: int, trajectory: dict, *,
                            read_info: Callable[[Path], dict], continued: str) -> None:
    """Resuming `resume_path` (at `step`) into an --out whose state `existing` is newer (or of
    another run) would lose it: refuse (CheckpointError), saying how to continue that run or
    that it has ended (`continued`, RunFiles.how_to_continue's words). `read_info(path)` gives a
    state's {"step", "config"}."""
    if not existing.exists() or (resume_path.exists() and existing.samefile(resume_path)):
        return
    what_to_do = f"{continued}; resume {resume_path} into another --out, or move {existing} away first"
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


def finished_run_summary(resume_path: Path, summary_path: Path, log_path: Path, step: int,
                         rebuild: Callable[[list[dict]], dict], *, write: bool, say: Callable) -> dict:
    """A resume of `resume_path` (at `step`) with nothing left to do: the summary the run wrote
    when it ended there, returned as it is (nothing in --out changes). Where that summary is
    missing (a full disk at summary.json, a signal between the final state and the summary, a
    state resumed into a new --out), `rebuild(records)` makes one from the log's records up to
    `step`, written when `write` (rank 0); where the log holds no record of `step` either,
    nothing is written, and the summary returned says so."""
    finished = summary_of_finished(summary_path, step)
    if finished is not None:
        say(f"{resume_path} is a finished run; its summary:")
        return finished
    records = log_records(log_path, step)
    if not any(record.get("step") == step for record in records):
        say(f"{resume_path} is a finished run (step {step}): nothing to do, and {summary_path.parent} holds neither "
            f"its summary nor a log of its last step, so nothing was written")
        return {"step": step, "stopped_because": "nothing_to_do", "summary": None}
    summary = {**rebuild(records), "rebuilt_from": str(log_path)}
    if write:
        write_summary(summary_path, summary)
    say(f"{resume_path} is a finished run whose summary was missing: rebuilt from {log_path} into {summary_path}")
    return summary


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
