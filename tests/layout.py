"""Where the tests live: one folder per source folder they test (core/, torch_frontend/,
jax_frontend/, gpt/, tokenizer/, benchmarks/; not torch/ or jax/, which would shadow the real
packages as namespace packages where one is not installed); the shared helpers and the scripts
run in child processes stay here.

A test module may import a helper or another test module by its name wherever it lives (names
are unique across the folders), as it could when the tests were one folder: conftest.py puts
IMPORT_DIRS on sys.path, and a child process gets them through `child_env`."""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
IMPORT_DIRS = [TESTS, *sorted(d for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))]


def child_env(env: dict | None = None) -> dict:
    """`env` (default os.environ) with IMPORT_DIRS ahead on PYTHONPATH, for a test file or a
    helper script run as a child process."""
    env = dict(os.environ if env is None else env)
    paths = [str(d) for d in IMPORT_DIRS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
