#!/usr/bin/env python3
"""Cut a deterministic source release of packed-adamw from a git commit.

    python tools/release.py --out dist/release [--ref HEAD]
    python tools/release.py --verify dist/release/packed-adamw-1.0.0.tar.gz

A release is three files in --out:

    packed-adamw-<version>.tar.gz                the source tree of the commit
    packed-adamw-<version>.tar.gz.sha256         `sha256sum -c` checks the archive
    packed-adamw-<version>.manifest.json         SHA-256 and size of every file

The archive is built from git objects, never from the working tree, so the
same commit always gives the same bytes: members sorted by path, every mtime
set to the commit time, uid/gid 0, no user names, modes normalised to
0644/0755, gzip header with mtime 0 and no file name.

The version is `__version__` in core/__init__.py at that commit (the one place it is
written; pyproject.toml reads it from there). Before anything is written, the file
list goes through `find_forbidden`, which refuses corpus text, tapes, checkpoints,
weights, caches and oversized files. Files are written with core/atomic_file.py.
Only the standard library and the `git` executable are used.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.util
import io
import json
import re
import subprocess
import sys
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable

PROJECT = "packed-adamw"
# Where `__version__` is written, relative to the repository root.
VERSION_FILE = "core/__init__.py"
VERSION_PATTERN = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]*")  # it becomes part of file names


def _load_atomic_file():
    """core/atomic_file.py of this checkout, loaded by path: it needs only the standard
    library, so the tool runs without installing the package (or its numpy)."""
    path = Path(__file__).resolve().parents[1] / "core" / "atomic_file.py"
    spec = importlib.util.spec_from_file_location("_packed_adamw_atomic_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


atomic_write = _load_atomic_file().atomic_write

# Any file above this is refused: a source file or document this large is more likely
# data (a corpus dump, weights) than source.
MAX_TEXT_BYTES = 256 * 1024
# Files allowed past MAX_TEXT_BYTES, each with its own ceiling.
LARGE_FILE_ALLOWANCE = {  # in the source tree, and where the wheel installs it
    "tokenizer/bpe-12095.json": 8 * 1024 * 1024,
    "packed_adamw/tokenizer/bpe-12095.json": 8 * 1024 * 1024,
    "tokenizer/bpe-32768.json": 8 * 1024 * 1024,
    "packed_adamw/tokenizer/bpe-32768.json": 8 * 1024 * 1024,
}

FORBIDDEN_SUFFIXES = {
    ".tape": "token tape",
    ".pt": "checkpoint",
    ".pth": "checkpoint",
    ".ckpt": "checkpoint",
    ".safetensors": "model weights",
    ".bin": "model weights",
    ".npz": "model weights",
    ".npy": "array dump",
    ".onnx": "model weights",
    ".parquet": "dataset",
    ".arrow": "dataset",
    ".pyc": "python cache",
    ".pyo": "python cache",
    ".whl": "build output",
}
# Directory names that only ever hold generated or private data.
FORBIDDEN_DIRS = {
    "runs": "training run output",
    "checkpoints": "checkpoint directory",
    "checkpoint": "checkpoint directory",
    "ckpt": "checkpoint directory",
    "ckpts": "checkpoint directory",
    "__pycache__": "python cache",
    ".pytest_cache": "pytest cache",
    ".mypy_cache": "mypy cache",
    ".ruff_cache": "ruff cache",
    ".triton": "triton cache",
    ".venv": "virtual environment",
    "venv": "virtual environment",
}


# ----------------------------------------------------------------------------
# Content check
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Violation:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def classify_path(path: str, size: int) -> str | None:
    """Why `path` (relative to the repo root, POSIX) must not ship, or None."""
    parts = PurePosixPath(path).parts
    name = parts[-1].lower()
    for directory in (part.lower() for part in parts[:-1]):
        if directory in FORBIDDEN_DIRS:
            return f"{FORBIDDEN_DIRS[directory]} (under {directory}/)"
        if directory.endswith(".egg-info"):
            return "build output (egg-info)"
    # Every suffix counts: model.safetensors.tmp123 and train.tape.bak are still what they are.
    for suffix in PurePosixPath(name).suffixes:
        if suffix in FORBIDDEN_SUFFIXES:
            return f"{FORBIDDEN_SUFFIXES[suffix]} (*{suffix})"
    if "_gut" in name and ".txt" in name:
        return "corpus text (*_gut*.txt)"
    if path in LARGE_FILE_ALLOWANCE:
        limit = LARGE_FILE_ALLOWANCE[path]
        return f"{size} bytes > limit of {limit}" if size > limit else None
    # Whatever the extension, a large file is more likely data than source or docs.
    if size > MAX_TEXT_BYTES:
        return f"{size} bytes > {MAX_TEXT_BYTES} (data or corpus text?)"
    return None


def find_forbidden(entries: Iterable[tuple[str, int]]) -> list[Violation]:
    """Check (path, size) pairs; return every offending path, sorted."""
    found = []
    for path, size in entries:
        reason = classify_path(path, size)
        if reason is not None:
            found.append(Violation(path, reason))
    return sorted(found, key=lambda v: v.path)


# ----------------------------------------------------------------------------
# Reading a commit out of git
# ----------------------------------------------------------------------------


class ReleaseError(Exception):
    """A release cannot be made or verified; the message says why."""


@dataclass(frozen=True)
class TreeEntry:
    path: str
    git_mode: str  # "100644", "100755", "120000" (symlink) or "160000" (submodule)
    object_id: str
    size: int


def git(repo: Path, *args: str, input: bytes | None = None) -> bytes:
    result = subprocess.run(
        ["git", "-C", str(repo), *args], input=input, capture_output=True
    )
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise ReleaseError(f"git {' '.join(args)} failed: {message}")
    return result.stdout


def resolve_commit(repo: Path, ref: str) -> str:
    return git(repo, "rev-parse", "--verify", f"{ref}^{{commit}}").decode().strip()


def commit_time(repo: Path, commit: str) -> int:
    return int(git(repo, "show", "-s", "--format=%ct", commit).decode().strip())


def read_version(repo: Path, commit: str) -> str:
    """`__version__` in core/__init__.py as of `commit` (not the working tree), read
    without importing it."""
    source = git(repo, "show", f"{commit}:{VERSION_FILE}").decode()
    for node in ast.parse(source, filename=VERSION_FILE).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == "__version__" for target in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            version = node.value.value
            if not VERSION_PATTERN.fullmatch(version):
                raise ReleaseError(f"{VERSION_FILE} at {commit[:12]}: unusable version {version!r}")
            return version
    raise ReleaseError(f"{VERSION_FILE} at {commit[:12]} assigns no string to __version__")


def list_tree(repo: Path, commit: str) -> list[TreeEntry]:
    raw = git(repo, "ls-tree", "-r", "-l", "-z", "--full-tree", commit)
    entries = []
    for record in raw.split(b"\0"):
        if not record:
            continue
        header, path = record.split(b"\t", 1)
        mode, _type, object_id, size = header.decode().split()
        entries.append(
            TreeEntry(
                path=path.decode("utf-8", errors="surrogateescape"),
                git_mode=mode,
                object_id=object_id,
                size=0 if size == "-" else int(size),
            )
        )
    return sorted(entries, key=lambda e: e.path)


def read_blobs(repo: Path, object_ids: list[str]) -> dict[str, bytes]:
    """Contents of many blobs through one `git cat-file --batch` call."""
    if not object_ids:
        return {}
    request = "".join(f"{oid}\n" for oid in object_ids).encode()
    out = git(repo, "cat-file", "--batch", input=request)
    blobs, pos = {}, 0
    for _ in object_ids:
        end = out.index(b"\n", pos)
        oid, _type, size = out[pos:end].decode().split()
        start = end + 1
        blobs[oid] = out[start : start + int(size)]
        pos = start + int(size) + 1  # content is followed by a newline
    return blobs


def working_tree_is_dirty(repo: Path) -> bool:
    return bool(git(repo, "status", "--porcelain", "--untracked-files=no").strip())


# ----------------------------------------------------------------------------
# Writing the archive
# ----------------------------------------------------------------------------


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parent_dirs(paths: Iterable[str]) -> set[str]:
    dirs = set()
    for path in paths:
        for parent in PurePosixPath(path).parents:
            if str(parent) != ".":
                dirs.add(str(parent))
    return dirs


def tar_member(name: str, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime = mtime
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


# Why tarfile and not `git archive`: git archive is deterministic for a commit, but not in the
# form this release promises (and tests/test_release.py checks). It names every member's owner
# and group "root" (no option blanks them); its modes depend on the user's `tar.umask` (default
# 0664/0775, not 0644/0755); its members come in git's tree order, where `core.py` precedes
# `core/`, not in sorted path order; it applies export-ignore/export-subst attributes, so the
# archive could differ from the blobs the manifest hashes; and its byte layout is git's to change
# between versions. Rewriting its output would need tarfile anyway.
def build_tar(prefix: str, entries: list[TreeEntry], blobs: dict[str, bytes], mtime: int) -> bytes:
    """An uncompressed, byte-reproducible tar of `entries` under `prefix/`."""
    members: list[tuple[str, tarfile.TarInfo, bytes | None]] = []
    for directory in parent_dirs(e.path for e in entries) | {""}:
        info = tar_member(f"{prefix}/{directory}".rstrip("/"), mtime)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        members.append((info.name, info, None))
    for entry in entries:
        data = blobs[entry.object_id]
        info = tar_member(f"{prefix}/{entry.path}", mtime)
        if entry.git_mode == "120000":
            info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, data.decode()
            data = None
        else:
            info.mode = 0o755 if entry.git_mode == "100755" else 0o644
            info.size = len(data)
        members.append((info.name, info, data))

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for _name, info, data in sorted(members, key=lambda m: m[0]):
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def gzip_deterministic(data: bytes) -> bytes:
    # mtime=0 and an empty file name keep the gzip header free of local state.
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buffer.getvalue()


def release_names(version: str) -> tuple[str, str, str]:
    archive = f"{PROJECT}-{version}.tar.gz"
    return archive, f"{archive}.sha256", f"{PROJECT}-{version}.manifest.json"


def manifest_path_for(archive: Path) -> Path:
    stem = archive.name.removesuffix(".tar.gz")
    return archive.with_name(f"{stem}.manifest.json")


@dataclass(frozen=True)
class Release:
    archive: Path
    checksum: Path
    manifest: Path
    archive_sha256: str
    commit: str


def make_release(repo: Path, ref: str, out_dir: Path) -> Release:
    """Check, archive and checksum `ref`; raise ReleaseError on any problem."""
    repo = Path(repo)
    commit = resolve_commit(repo, ref)
    version = read_version(repo, commit)
    entries = list_tree(repo, commit)

    submodules = [e.path for e in entries if e.git_mode == "160000"]
    if submodules:
        raise ReleaseError("submodules cannot be archived:\n  " + "\n  ".join(submodules))
    violations = find_forbidden((e.path, e.size) for e in entries)
    violations += [Violation(e.path, "symbolic link (a release holds plain files only)")
                   for e in entries if e.git_mode == "120000"]
    if violations:
        raise ReleaseError(
            f"refusing to release {commit[:12]}: {len(violations)} forbidden file(s)\n  "
            + "\n  ".join(str(v) for v in violations)
        )

    blobs = read_blobs(repo, sorted({e.object_id for e in entries}))
    archive_name, checksum_name, manifest_name = release_names(version)
    prefix = f"{PROJECT}-{version}"
    mtime = commit_time(repo, commit)
    archive_bytes = gzip_deterministic(build_tar(prefix, entries, blobs, mtime))
    archive_sha256 = sha256_hex(archive_bytes)

    manifest = {
        "project": PROJECT,
        "version": version,
        "commit": commit,
        "commit_time": mtime,
        "prefix": prefix,
        "archive": {"name": archive_name, "sha256": archive_sha256, "size": len(archive_bytes)},
        "files": [
            {"path": e.path, "sha256": sha256_hex(blobs[e.object_id]), "size": len(blobs[e.object_id])}
            for e in entries
        ],
    }

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / archive_name, archive_bytes)
    atomic_write(out_dir / checksum_name, f"{archive_sha256}  {archive_name}\n".encode())
    atomic_write(
        out_dir / manifest_name, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    )
    return Release(
        archive=out_dir / archive_name,
        checksum=out_dir / checksum_name,
        manifest=out_dir / manifest_name,
        archive_sha256=archive_sha256,
        commit=commit,
    )


# ----------------------------------------------------------------------------
# Verifying an archive
# ----------------------------------------------------------------------------


def check_checksum_file(archive: Path, archive_sha256: str) -> list[str]:
    checksum = archive.with_name(archive.name + ".sha256")
    if not checksum.exists():
        return [f"missing {checksum.name}"]
    fields = checksum.read_text().split()
    if len(fields) != 2:
        return [f"{checksum.name}: expected '<sha256>  <file name>'"]
    digest, name = fields[0], fields[1].lstrip("*")
    problems = []
    if name != archive.name:
        problems.append(f"{checksum.name} names {name!r}, not {archive.name!r}")
    if digest != archive_sha256:
        problems.append(f"archive SHA-256 {archive_sha256} does not match {checksum.name} ({digest})")
    return problems


def read_archive_files(archive_bytes: bytes, prefix: str) -> tuple[dict[str, tuple[str, int]], list[str]]:
    """{path below prefix: (sha256, size)} for the files, plus problems."""
    files, problems = {}, []
    with tarfile.open(fileobj=io.BytesIO(archive_bytes), mode="r:gz") as tar:
        for member in tar.getmembers():
            name = PurePosixPath(member.name)
            if name.is_absolute() or ".." in name.parts or name.parts[0] != prefix:
                problems.append(f"unsafe or unexpected member path {member.name!r}")
                continue
            relative = "/".join(name.parts[1:])
            if member.isdir():
                continue
            if member.issym():
                problems.append(f"{member.name}: symbolic link (a release holds plain files only)")
                continue
            if member.isfile():
                data = tar.extractfile(member).read()
            else:
                problems.append(f"{member.name}: unsupported member type {member.type!r}")
                continue
            files[relative] = (sha256_hex(data), len(data))
    return files, problems


def compare_with_manifest(files: dict[str, tuple[str, int]], manifest: dict) -> list[str]:
    expected = {f["path"]: (f["sha256"], f["size"]) for f in manifest["files"]}
    problems = [f"{p}: listed in manifest but not in archive" for p in sorted(expected.keys() - files.keys())]
    problems += [f"{p}: in archive but not in manifest" for p in sorted(files.keys() - expected.keys())]
    for path in sorted(expected.keys() & files.keys()):
        (want_sha, want_size), (got_sha, got_size) = expected[path], files[path]
        if want_size != got_size:
            problems.append(f"{path}: size {got_size}, manifest says {want_size}")
        elif want_sha != got_sha:
            problems.append(f"{path}: SHA-256 differs from manifest")
    return problems


def verify_release(archive: Path, manifest_path: Path | None = None) -> list[str]:
    """Every problem with `archive`, its .sha256 and its manifest; empty means OK."""
    archive = Path(archive)
    manifest_path = Path(manifest_path) if manifest_path else manifest_path_for(archive)
    if not archive.exists():
        return [f"no such archive: {archive}"]
    if not manifest_path.exists():
        return [f"no manifest: {manifest_path}"]

    archive_bytes = archive.read_bytes()
    archive_sha256 = sha256_hex(archive_bytes)
    problems = check_checksum_file(archive, archive_sha256)
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest["archive"]["sha256"] != archive_sha256:
            problems.append("archive SHA-256 does not match the manifest's")
        prefix = manifest["prefix"]
    except (ValueError, KeyError, TypeError) as error:
        return problems + [f"unreadable manifest {manifest_path}: {error!r}"]
    try:
        files, member_problems = read_archive_files(archive_bytes, prefix)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        return problems + [f"cannot read archive: {error}"]
    problems += member_problems
    problems += compare_with_manifest(files, manifest)
    problems += [str(v) for v in find_forbidden((p, size) for p, (_sha, size) in files.items())]
    return problems


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Make (default) or verify a deterministic source release of packed-adamw."
    )
    parser.add_argument("--out", type=Path, default=Path("dist/release"),
                        help="directory for the archive, .sha256 and manifest (default: dist/release)")
    parser.add_argument("--ref", default="HEAD", help="commit, tag or branch to release (default: HEAD)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="git repository (default: the checkout holding this script)")
    parser.add_argument("--verify", type=Path, metavar="ARCHIVE",
                        help="verify ARCHIVE against ARCHIVE.sha256 and its manifest instead of releasing")
    parser.add_argument("--manifest", type=Path,
                        help="with --verify: manifest path (default: <name>.manifest.json next to ARCHIVE)")
    return parser.parse_args(argv)


def run_verify(archive: Path, manifest: Path | None) -> int:
    problems = verify_release(archive, manifest)
    if problems:
        print(f"FAILED: {archive}", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"OK: {archive}")
    return 0


def run_release(repo: Path, ref: str, out: Path) -> int:
    try:
        release = make_release(repo, ref, out)
    except ReleaseError as error:
        print(f"release failed: {error}", file=sys.stderr)
        return 1
    if ref == "HEAD" and working_tree_is_dirty(repo):
        print("note: uncommitted changes are not in the archive (it is built from the commit)",
              file=sys.stderr)
    print(f"commit   {release.commit}")
    print(f"archive  {release.archive}")
    print(f"sha256   {release.archive_sha256}")
    print(f"checksum {release.checksum}")
    print(f"manifest {release.manifest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify is not None:
        return run_verify(args.verify, args.manifest)
    return run_release(args.repo, args.ref, args.out)


if __name__ == "__main__":
    sys.exit(main())
