"""Release tooling: packaging (sdist + wheel) and tools/release.py.

Everything here runs on CPU. The release-script tests work on a throwaway git
repository in tmp_path so they do not depend on the state of this checkout.
Installing the wheel into a fresh venv is opt-in: PACKED_ADAMW_SLOW_TESTS=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from packed_adamw.core import __version__ as VERSION

REPO_ROOT = Path(__file__).resolve().parents[1]
RELEASE_SCRIPT = REPO_ROOT / "tools" / "release.py"
TOKENIZER_ARTIFACT = "tokenizer/bpe-12095.json"
WHEEL_PACKAGES = ["core", "core/adamw", "torch", "torch/gpt", "jax", "tokenizer"]
SLOW_TESTS = os.environ.get("PACKED_ADAMW_SLOW_TESTS") == "1"

# Isolate the temporary repositories from the user's git config (signing, hooks).
GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Release Test",
    "GIT_AUTHOR_EMAIL": "release-test@example.invalid",
    "GIT_COMMITTER_NAME": "Release Test",
    "GIT_COMMITTER_EMAIL": "release-test@example.invalid",
}


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def release():
    """tools/release.py imported as a module (tools is not a package)."""
    spec = importlib.util.spec_from_file_location("packed_adamw_release", RELEASE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), *args], env=GIT_ENV, check=True, capture_output=True, text=True
    )
    return result.stdout.strip()


def write(repo: Path, relative: str, content: str | bytes, executable: bool = False) -> None:
    path = repo / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    if executable:
        path.chmod(0o755)


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def run_release_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RELEASE_SCRIPT), *args], env=GIT_ENV, capture_output=True, text=True
    )


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    """A small git repository with two commits, shaped like this project."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "-c", "init.defaultBranch=main", "init", "-q")
    # As in this project, the version is written once, in core/__init__.py.
    write(repo, "pyproject.toml", '[project]\nname = "packed-adamw"\ndynamic = ["version"]\n')
    write(repo, "core/__init__.py", 'from .formats import E4M11\n\n__version__ = "0.0.1"\n')
    write(repo, "core/formats.py", "E4M11 = 'signed first moment'\n")
    write(repo, "README.md", "# tiny\n")
    commit_all(repo, "first")
    write(repo, "core/formats.py", "E4M11 = 'signed'\nE4M12 = 'unsigned rms'\n")
    write(repo, "tools/run.sh", "#!/bin/sh\necho hi\n", executable=True)
    write(repo, TOKENIZER_ARTIFACT, json.dumps({"vocab": list(range(1000))}))
    commit_all(repo, "second")
    return repo


def archive_name(version: str = "0.0.1") -> str:
    return f"packed-adamw-{version}.tar.gz"


# ----------------------------------------------------------------------------
# content check
# ----------------------------------------------------------------------------

MB = 1024 * 1024


@pytest.mark.parametrize(
    "path, size",
    [
        ("data/shakespeare_gut.txt", 10),
        ("notes/big.txt", 300 * 1024),
        ("runs/exp1/log.json", 10),
        ("train.tape", 10),
        ("ckpt.pt", 10),
        ("model.pth", 10),
        ("last.ckpt", 10),
        ("out/checkpoints/meta.json", 10),
        ("model.safetensors", 10),
        ("weights.bin", 10),
        ("params.npz", 10),
        ("core/__pycache__/formats.cpython-311.pyc", 10),
        ("stray.pyc", 10),
        (".pytest_cache/v/cache/nodeids", 10),
        ("home/.triton/cache/kernel.cubin", 10),
        (".venv/bin/python", 10),
        ("packed_adamw.egg-info/PKG-INFO", 10),
        ("docs/huge_figure.png", 3 * MB),
        (TOKENIZER_ARTIFACT, 9 * MB),
        ("data/hamlet_gut_f.txt", 10),  # First Folio spellings are corpus text too
        ("notes/corpus.md", 2_000_000),  # a large file is data whatever its extension
        ("model.safetensors.tmp123", 10),  # every suffix counts
        ("Runs/train.tape.bak", 10),  # directory names in any case
    ],
)
def test_content_check_flags_forbidden_path(release, path, size):
    violations = release.find_forbidden([(path, size)])
    assert [v.path for v in violations] == [path]


@pytest.mark.parametrize(
    "path, size",
    [
        ("core/formats.py", 8000),
        ("torch_frontend/gpt/checkpoint.py", 8000),  # code about checkpoints is fine
        ("tokenizer/CORPUS_PROVENANCE.json", 8000),
        ("tokenizer/corpus.py", 8000),
        (TOKENIZER_ARTIFACT, 1 * MB),
        (TOKENIZER_ARTIFACT, 3 * MB),  # the artifact alone may exceed the 2 MB limit
        ("docs/notes.txt", 4000),
        ("tests/test_release.py", 20000),
    ],
)
def test_content_check_allows_sources(release, path, size):
    assert release.find_forbidden([(path, size)]) == []


# ----------------------------------------------------------------------------
# deterministic archive
# ----------------------------------------------------------------------------


def test_release_is_byte_identical_across_runs(tiny_repo, tmp_path):
    first = run_release_cli("--repo", str(tiny_repo), "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    # Working-tree mtimes and the output location must not leak into the bytes.
    for path in tiny_repo.rglob("*"):
        if ".git" not in path.parts:
            os.utime(path, (1, 1))
    second = run_release_cli("--repo", str(tiny_repo), "--out", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr

    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted([archive_name(), archive_name() + ".sha256", "packed-adamw-0.0.1.manifest.json"])
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_archive_members_are_normalised(release, tiny_repo, tmp_path):
    made = release.make_release(tiny_repo, "HEAD", tmp_path / "out")
    commit_time = int(git(tiny_repo, "show", "-s", "--format=%ct", "HEAD"))
    header = made.archive.read_bytes()[:10]
    assert header[3] == 0, "gzip header must carry no file name or other optional fields"
    assert header[4:8] == b"\0\0\0\0", "gzip header mtime must be 0"
    with tarfile.open(made.archive) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert all(n == "packed-adamw-0.0.1" or n.startswith("packed-adamw-0.0.1/") for n in names)
    for member in members:
        assert (member.uid, member.gid, member.uname, member.gname) == (0, 0, "", "")
        assert member.mtime == commit_time
        assert member.mode in (0o644, 0o755)
    modes = {m.name.split("/", 1)[-1]: m.mode for m in members if m.isfile()}
    assert modes["tools/run.sh"] == 0o755
    assert modes["core/formats.py"] == 0o644


def test_release_of_older_ref_has_that_commits_files(release, tiny_repo, tmp_path):
    first_commit = git(tiny_repo, "rev-parse", "HEAD~1")
    old = release.make_release(tiny_repo, "HEAD~1", tmp_path / "old")
    new = release.make_release(tiny_repo, "HEAD", tmp_path / "new")
    manifest = json.loads(old.manifest.read_text())
    assert manifest["commit"] == first_commit
    assert [f["path"] for f in manifest["files"]] == [
        "README.md", "core/__init__.py", "core/formats.py", "pyproject.toml"
    ]
    assert old.archive_sha256 != new.archive_sha256


def test_version_comes_from_core_init(release, tiny_repo, tmp_path):
    write(tiny_repo, "core/__init__.py", '"""core."""\n__version__ = "0.0.2"\n')
    commit_all(tiny_repo, "bump")
    made = release.make_release(tiny_repo, "HEAD", tmp_path / "out")
    assert made.archive.name == archive_name("0.0.2")
    assert json.loads(made.manifest.read_text())["version"] == "0.0.2"


def test_release_refuses_a_commit_without_version(release, tiny_repo, tmp_path):
    write(tiny_repo, "core/__init__.py", "VERSION = '0.0.3'\n")
    commit_all(tiny_repo, "no __version__")
    with pytest.raises(release.ReleaseError, match="__version__"):
        release.make_release(tiny_repo, "HEAD", tmp_path / "out")


def test_release_tool_and_setuptools_read_the_same_version(release):
    """pyproject.toml's dynamic version is the attribute the release tool reads."""
    setuptools_config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    module, attribute = setuptools_config["dynamic"]["version"]["attr"].rsplit(".", 1)
    assert attribute == "__version__"
    assert f"{setuptools_config['package-dir'][module]}/__init__.py" == release.VERSION_FILE
    # and the tool parses this checkout's committed file
    assert release.VERSION_PATTERN.fullmatch(release.read_version(REPO_ROOT, "HEAD"))


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="sha256sum not installed")
def test_checksum_file_is_sha256sum_format(release, tiny_repo, tmp_path):
    made = release.make_release(tiny_repo, "HEAD", tmp_path / "out")
    check = subprocess.run(
        ["sha256sum", "-c", made.checksum.name], cwd=made.checksum.parent, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


# ----------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------


def test_verify_accepts_a_fresh_release(release, tiny_repo, tmp_path):
    made = release.make_release(tiny_repo, "HEAD", tmp_path / "out")
    result = run_release_cli("--verify", str(made.archive))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_verify_rejects_a_modified_archive(release, tiny_repo, tmp_path):
    made = release.make_release(tiny_repo, "HEAD", tmp_path / "out")
    data = bytearray(made.archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    made.archive.write_bytes(bytes(data))
    result = run_release_cli("--verify", str(made.archive))
    assert result.returncode == 1
    assert "does not match" in result.stderr


def test_verify_rejects_a_file_that_disagrees_with_the_manifest(release, tiny_repo, tmp_path):
    made = release.make_release(tiny_repo, "HEAD", tmp_path / "out")
    manifest = json.loads(made.manifest.read_text())
    for entry in manifest["files"]:
        if entry["path"] == "core/formats.py":
            entry["sha256"] = "0" * 64
    made.manifest.write_text(json.dumps(manifest))
    problems = release.verify_release(made.archive)
    assert problems == ["core/formats.py: SHA-256 differs from manifest"]


# ----------------------------------------------------------------------------
# refusing forbidden content
# ----------------------------------------------------------------------------


def test_release_refuses_planted_forbidden_files(tiny_repo, tmp_path):
    planted = ["ckpt.pt", "x.tape", "runs/exp/log.txt", "data/hamlet_gut.txt", "big/blob.dat"]
    for path in planted[:-1]:
        write(tiny_repo, path, b"not for release")
    write(tiny_repo, planted[-1], b"\0" * (2 * 1024 * 1024 + 1))
    commit_all(tiny_repo, "oops")

    out = tmp_path / "out"
    result = run_release_cli("--repo", str(tiny_repo), "--out", str(out))
    assert result.returncode == 1
    assert "forbidden" in result.stderr
    for path in planted:
        assert path in result.stderr
    assert "core/formats.py" not in result.stderr
    assert not out.exists() or not any(out.iterdir()), "nothing may be written on refusal"


def test_release_refuses_symbolic_links(tiny_repo, tmp_path):
    (tiny_repo / "evil").symlink_to("../../../../etc/passwd")
    commit_all(tiny_repo, "link")
    result = run_release_cli("--repo", str(tiny_repo), "--out", str(tmp_path / "out"))
    assert result.returncode == 1 and "evil: symbolic link" in result.stderr


# ----------------------------------------------------------------------------
# sdist and wheel of this checkout
# ----------------------------------------------------------------------------


def snapshot_checkout(destination: Path) -> None:
    """Copy the files git would track (committed or not) so builds do not touch the checkout."""
    listed = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout.decode().split("\0")
    for relative in filter(None, listed):
        source = REPO_ROOT / relative
        if source.is_file():  # listed but deleted in the working tree: skip
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def python_build(source: Path, outdir: Path, *flags: str) -> None:
    # --no-isolation: build with this venv's setuptools, offline and fast.
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", *flags, "--outdir", str(outdir), str(source)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    if not (REPO_ROOT / "README.md").is_file():
        pytest.skip("README.md is not written yet; pyproject.toml's `readme` needs it to build")
    source = tmp_path_factory.mktemp("checkout")
    snapshot_checkout(source)
    return source


@pytest.fixture(scope="module")
def built_dists(snapshot, tmp_path_factory) -> dict[str, Path]:
    """Default `python -m build`: the sdist, then the wheel built *from the sdist*."""
    outdir = tmp_path_factory.mktemp("dist")
    python_build(snapshot, outdir)
    (sdist,) = outdir.glob("*.tar.gz")
    (wheel,) = outdir.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def sdist_files(sdist: Path) -> dict[str, int]:
    with tarfile.open(sdist) as tar:
        return {m.name.split("/", 1)[1]: m.size for m in tar.getmembers() if m.isfile()}


def wheel_files(wheel: Path) -> dict[str, int]:
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename: i.file_size for i in zf.infolist() if not i.is_dir()}


def test_build_sdist_and_wheel_from_tree(snapshot, tmp_path):
    # The file names carry the version setuptools read from core/__init__.py.
    python_build(snapshot, tmp_path, "--sdist", "--wheel")
    assert len(list(tmp_path.glob(f"packed_adamw-{VERSION}.tar.gz"))) == 1
    assert len(list(tmp_path.glob(f"packed_adamw-{VERSION}-py3-none-any.whl"))) == 1


def test_sdist_has_what_a_rebuild_needs(release, built_dists, snapshot):
    files = sdist_files(built_dists["sdist"])
    for needed in ["pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in",
                   "docs/RELEASE.md", "tests/test_release.py", "tools/release.py"]:
        assert needed in files, needed
    for tokenizer_file in sorted(snapshot.glob("tokenizer/*.json")) + sorted(snapshot.glob("tokenizer/*.md")):
        assert f"tokenizer/{tokenizer_file.name}" in files
    # setuptools writes its own egg-info into every sdist; anything else is ours.
    ours = {p: size for p, size in files.items() if not p.startswith("packed_adamw.egg-info/")}
    offenders = release.find_forbidden(ours.items())
    assert offenders == [], [str(v) for v in offenders]


def test_wheel_has_packages_and_no_tests_or_corpus(release, built_dists):
    files = wheel_files(built_dists["wheel"])
    for package in WHEEL_PACKAGES:
        assert f"packed_adamw/{package}/__init__.py" in files, package
    top_levels = {name.split("/", 1)[0] for name in files}
    assert top_levels == {"packed_adamw", f"packed_adamw-{VERSION}.dist-info"}
    assert not [n for n in files if "/tests/" in n or n.split("/")[-1].startswith("test_")]
    offenders = release.find_forbidden(files.items())
    assert offenders == [], [str(v) for v in offenders]


def test_wheel_carries_tokenizer_artifact(built_dists):
    if not (REPO_ROOT / TOKENIZER_ARTIFACT).is_file():
        pytest.skip(f"{TOKENIZER_ARTIFACT} is not in the repository yet")
    files = wheel_files(built_dists["wheel"])
    assert files.get(f"packed_adamw/{TOKENIZER_ARTIFACT}", 0) > 0


@pytest.mark.skipif(not SLOW_TESTS, reason="slow: set PACKED_ADAMW_SLOW_TESTS=1 to install the wheel in a fresh venv")
def test_wheel_installs_and_imports_in_fresh_venv(built_dists, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(built_dists["wheel"])],
        check=True,
    )
    # Reuse this environment's torch/numpy/... rather than downloading them: a
    # .pth line appends our site-packages *after* the venv's own. (Its .pth
    # files, e.g. the editable install of this checkout, are not processed.)
    venv_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    import site
    (Path(venv_site) / "_outer_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    probe = (
        "import importlib.resources as r, packed_adamw.torch, packed_adamw.tokenizer;"
        "print(packed_adamw.torch.__file__);"
        f"print(r.files('packed_adamw.tokenizer').joinpath('{Path(TOKENIZER_ARTIFACT).name}').is_file())"
    )
    result = subprocess.run([str(python), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    module_file, has_artifact = result.stdout.split()
    assert Path(module_file).is_relative_to(venv), module_file
    if (REPO_ROOT / TOKENIZER_ARTIFACT).is_file():
        assert has_artifact == "True"
