"""Atomic file writes: a reader finds the old file or the complete new one, never a part.

Every file this project rewrites in place (checkpoints, tapes, the tokenizer artifact,
release archives, portable states) goes through one rule:

1. write to a new temporary file in the target's directory (same file system, so the
   rename below is atomic), named `.<name>.<random>.tmp`;
2. flush it and `os.fsync` it, so its bytes are on disk before it gets the real name;
3. `os.replace` it over the target;
4. `os.fsync` the directory, so the rename itself survives a crash (POSIX only: other
   systems cannot open a directory).

If anything fails before the rename, the temporary file is removed and the old file (if
any) is left as it was; a process killed before it (SIGKILL) leaves the temporary file,
which `temp_target` tells from other names (a run directory's claim removes its own). The
new file has the mode `open` gives a new file (0o666 less the umask), whatever mode the
writer created its file with (safetensors' `save_file`: 0o600), so that a shared directory's
readers can read it. Standard library only: no numpy, torch or jax.

    atomic_write(path, data)                    # bytes in memory
    with atomic_open(path, "wb") as f: ...      # a file object (seek and write freely)
    with atomic_path(path) as tmp: ...          # a writer that takes a file name
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "atomic_path", "atomic_write", "temp_target"]

_WRITE_MODES = {"w", "wb", "w+", "w+b", "wb+"}
_RANDOM_BYTES = 6
_TEMP_NAME = re.compile(rf"\.(?P<target>.+)\.[0-9a-f]{{{2 * _RANDOM_BYTES}}}\.tmp")


def temp_target(name: str) -> str | None:
    """The name of the file that a temporary file named `name` (`.<name>.<random>.tmp`) was
    written to replace; None for a name this module does not give."""
    match = _TEMP_NAME.fullmatch(name)
    return match["target"] if match else None


def _new_temp_path(path: Path, mode: str = "wb", **open_kwargs) -> tuple[Path, IO]:
    """Create a temp file beside `path`: exclusively ("x" for "w"), with the permissions
    `open` gives a new file."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(_RANDOM_BYTES)}.tmp")
        try:
            return tmp, open(tmp, mode.replace("w", "x"), **open_kwargs)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {path}")


def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    """The mode `open` gives a new file: 0o666 less the process's umask (which can only be read
    by setting it: set back at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _commit(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    _fsync_directory(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **open_kwargs) -> Iterator[IO]:
    """Yield a file object (`mode`: "wb", "w+b", "w" or "w+") whose content replaces `path`
    atomically when the block ends without an exception; `open_kwargs` (e.g. `encoding`)
    go to `open`. On an exception the temporary file is removed and `path` is untouched."""
    if mode not in _WRITE_MODES:
        raise ValueError(f"atomic_open writes a new file: mode must be one of {sorted(_WRITE_MODES)}, got {mode!r}")
    path = Path(path)
    tmp, file = _new_temp_path(path, mode, **open_kwargs)
    try:
        with file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` for a writer that takes a file name (e.g.
    safetensors' `save_file`); when the block ends without an exception, that file is
    fsynced and replaces `path`. On an exception it is removed and `path` is untouched."""
    path = Path(path)
    tmp, file = _new_temp_path(path)
    file.close()  # the name is reserved; the writer opens it again
    try:
        yield tmp
        os.chmod(tmp, _new_file_mode())  # the writer may have made its own file, private (save_file: 0o600)
        with open(tmp, "r+b") as written:
            os.fsync(written.fileno())
        _commit(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` atomically by `data`."""
    with atomic_open(path, "wb") as file:
        file.write(data)
