"""Shared test setup.

TRITON_INTERPRET=1 must be set before any `@triton.jit` decorator runs, or launches fail with
"0 active drivers"; so it is set at conftest import time, before pytest imports any test
module. On a machine with a CUDA GPU the kernels are compiled instead.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from layout import IMPORT_DIRS

# Test modules import helpers and each other by name across the package folders (layout.py).
sys.path[:0] = [str(d) for d in IMPORT_DIRS if str(d) not in sys.path]

CUDA = torch.cuda.is_available()

if not CUDA:
    # setdefault: an explicit TRITON_INTERPRET from the caller wins.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (same test as core.launch)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture(scope="session")
def is_interpreting() -> bool:
    return interpreting()


@pytest.fixture(scope="session")
def device() -> str:
    """Where kernel tensors live: "cuda" when a GPU is present, else "cpu" (interpreted)."""
    return "cuda" if CUDA and not interpreting() else "cpu"


@pytest.fixture(params=["debug callback", "pure callback"])
def refusal_callback(request, monkeypatch) -> bool:
    """Both ways a jitted JAX step's refusal warning is heard (`_hyperparams._report_refusal`): a
    CPU host's `jax.debug.callback`, and an accelerator host's pure callback, forced here on the
    CPU. True for the pure callback, whose jitted steps must have no effect in their jaxpr."""
    from packed_adamw.jax import _hyperparams

    pure = request.param == "pure callback"
    monkeypatch.setattr(_hyperparams, "_effect_free_refusals", lambda: pure)
    return pure
