"""Packaging and hygiene: each frontend imports without the other framework, the extras say
so, the one atomic-write helper keeps its rule, and no file names a path of one machine.

The import checks run in a fresh interpreter in which the other framework cannot be imported
(`sys.modules[name] = None`, so `import name` raises ImportError and `find_spec` finds nothing),
as on a machine where it is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())

# Only in the `train` extra: neither frontend may need them.
TRAIN_ONLY = ["tokenizers", "tqdm", "matplotlib", "pyarrow"]
TORCH_SIDE = ["torch", "triton"]
JAX_SIDE = ["jax", "jaxlib", "optax", "jax_triton"]


def run_without(blocked: list[str], code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
    return subprocess.run(
        [sys.executable, "-I", "-c", prelude + textwrap.dedent(code)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK"), result.stdout


# ----------------------------------------------------------------------------
# one framework at a time
# ----------------------------------------------------------------------------


def test_core_needs_neither_framework_nor_triton():
    assert_ok(run_without(TORCH_SIDE + JAX_SIDE + TRAIN_ONLY, """
        import packed_adamw.core, packed_adamw.core.portable, packed_adamw.core.atomic_file
        import packed_adamw.core.authority, packed_adamw.core.launch, packed_adamw.core.rule
        import packed_adamw.core.adamw, packed_adamw.core.adamw.authority, packed_adamw.core.format_health
        print("OK")
    """))


def test_jax_frontend_without_torch():
    # Triton too: the `jax` extra does not install it (the CPU path is numpy).
    assert_ok(run_without(TORCH_SIDE + TRAIN_ONLY + ["jax_triton"], """
        import jax, jax.numpy as jnp, optax
        import packed_adamw.core
        from packed_adamw.jax import packed_adamw, export_state
        params = {"w": jnp.ones((4, 3), jnp.float32)}
        tx = packed_adamw(1e-3, weight_decay=1e-2)
        state = tx.init(params)
        updates, state = jax.jit(tx.update)(params, state, params)
        assert float(optax.apply_updates(params, updates)["w"][0, 0]) < 1.0
        print("OK")
    """))


def test_torch_frontend_without_jax():
    assert_ok(run_without(JAX_SIDE + TRAIN_ONLY, """
        import torch
        import packed_adamw.core
        from packed_adamw.torch import PackedAdamW
        model = torch.nn.Linear(3, 2)
        opt = PackedAdamW(model.parameters(), lr=1e-3)
        model(torch.ones(1, 3)).sum().backward()
        before = model.weight.detach().clone()
        opt.step()
        assert not torch.equal(before, model.weight)
        opt.export_state()
        print("OK")
    """))


# ----------------------------------------------------------------------------
# what pyproject.toml declares
# ----------------------------------------------------------------------------


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def extra_names(extra: str, seen: frozenset = frozenset()) -> set[str]:
    """Distribution names an extra pulls in, following `packed-adamw[...]` self-references."""
    names = set()
    for requirement in PYPROJECT["project"]["optional-dependencies"][extra]:
        self_reference = re.fullmatch(r"packed-adamw\[([^\]]+)\]", requirement.replace(" ", ""))
        if self_reference:
            for inner in self_reference.group(1).split(","):
                if inner not in seen:
                    names |= extra_names(inner, seen | {extra})
        else:
            names |= requirement_names([requirement])
    return names


def test_base_dependencies_are_what_core_needs():
    assert requirement_names(PYPROJECT["project"]["dependencies"]) == {"numpy", "safetensors"}


@pytest.mark.parametrize("extra, wanted, unwanted", [
    ("torch", {"torch", "triton"}, {"jax", "optax", "jax-triton"}),
    ("jax", {"jax", "optax"}, {"torch", "triton"}),
    ("jax-cuda", {"jax-triton", "triton"}, {"torch"}),
    ("train", {"torch", "triton", "tokenizers", "tqdm", "matplotlib", "pyarrow"}, {"jax", "optax"}),
    ("dev", {"pytest", "build", "torch", "jax", "optax", "tokenizers"}, set()),
])
def test_extras(extra, wanted, unwanted):
    names = extra_names(extra)
    assert wanted <= names, wanted - names
    assert not names & unwanted, names & unwanted


def test_license_is_an_spdx_string_and_the_version_is_read_from_core():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "packed_adamw.core.__version__"}
    minimum = re.fullmatch(r"setuptools>=(\d+)", PYPROJECT["build-system"]["requires"][0])
    assert minimum and int(minimum.group(1)) >= 77  # SPDX license strings


# ----------------------------------------------------------------------------
# core/atomic_file.py
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def atomic_file():
    """Loaded by path, as tools/release.py does: the module must need only the standard library."""
    spec = importlib.util.spec_from_file_location("atomic_file_under_test", REPO_ROOT / "core" / "atomic_file.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_atomic_file_imports_only_the_standard_library():
    probe = f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("af", {str(REPO_ROOT / "core" / "atomic_file.py")!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print("OK")
    """
    assert_ok(run_without(["numpy", "safetensors", *TORCH_SIDE, *JAX_SIDE], probe))


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_atomic_write_creates_and_replaces(atomic_file, tmp_path):
    target = tmp_path / "out.bin"
    atomic_file.atomic_write(target, b"first")
    atomic_file.atomic_write(target, b"second")
    assert target.read_bytes() == b"second"
    assert leftovers(tmp_path) == []
    # Permissions as `open` would give a new file (not mkstemp's 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_open_supports_seek_and_text(atomic_file, tmp_path):
    target = tmp_path / "tape"
    with atomic_file.atomic_open(target, "wb") as f:
        f.seek(4)
        f.write(b"body")
        f.seek(0)
        f.write(b"head")
    assert target.read_bytes() == b"headbody"
    with atomic_file.atomic_open(tmp_path / "note.txt", "w", encoding="utf-8") as f:
        f.write("é\n")
    assert (tmp_path / "note.txt").read_text(encoding="utf-8") == "é\n"
    with pytest.raises(ValueError, match="mode"):
        with atomic_file.atomic_open(target, "ab"):
            pass


def test_failed_write_keeps_the_old_file_and_no_temp(atomic_file, tmp_path):
    target = tmp_path / "checkpoint.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"):
        with atomic_file.atomic_open(target) as f:
            f.write(b"half a new fi")
            raise OSError("disk full")
    with pytest.raises(RuntimeError):
        with atomic_file.atomic_path(target) as tmp:
            tmp.write_bytes(b"written by name")
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_atomic_path_for_writers_that_take_a_name(atomic_file, tmp_path):
    target = tmp_path / "state.safetensors"
    with atomic_file.atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.exists() and not target.exists()
        tmp.write_bytes(b"by name")
    assert target.read_bytes() == b"by name"
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------------
# hygiene
# ----------------------------------------------------------------------------

# Built from pieces so that this file does not match itself.
MACHINE_PATHS = re.compile("|".join(["ENGINEERING" + "_NOTES", "/" + "work/", "/" + "root/", "/" + "farm/"]))


def test_no_file_names_a_path_of_one_machine():
    """Cite the fact itself, not a notes file or a directory that exists on one machine only."""
    listed = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    hits = []
    for relative in filter(None, listed.stdout.decode().split("\0")):
        path = REPO_ROOT / relative
        if not path.is_file() or path.stat().st_size > 1_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATHS.search(line):
                hits.append(f"{relative}:{number}: {line.strip()}")
    assert hits == [], "\n".join(hits)
