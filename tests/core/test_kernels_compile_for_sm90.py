"""The Muon GPU kernels, AdamW's multi-tensor and leaf-group kernels and the launch skeleton's entry
points over another rule's block step compile for an H100/H200 (sm_90) on a machine without a GPU
(tests/sm90_compile.py, in a process without TRITON_INTERPRET). The other CPU tests run the
kernels in Triton's interpreter, which never meets the compiler's frontend or lowering; this
catches what only a GPU run would otherwise (an operation on a type the compiler refuses, a
constexpr branch that does not type-check) in every variant the JAX and torch launchers make. It
does not check what the compiled code computes."""
import os
import subprocess
import sys

import pytest
from layout import TESTS

pytest.importorskip("jax")


def test_the_muon_and_adamw_launch_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TESTS / "sm90_compile.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    if "has no NVIDIA backend" in done.stderr:
        pytest.skip("this Triton build has no NVIDIA backend")
    assert done.returncode == 0, done.stderr[-4000:]
    # JAX's group kernels: 24 momentum and 24 weight variants; torch's kernels: 72 momentum (per matrix, and
    # table in both orientations) and 72 weight ones (their counting twins in packed mode), 2 that refuse a
    # non-finite Newton-Schulz output; 8 of the step scalars (JAX's 7, torch's capturable rows), 5 of
    # Newton-Schulz; AdamW's multi-tensor and leaf-group kernels, 6 each; the skeleton's, 14
    # (tests/test_custom_rule.py's rule)
    assert done.stdout.strip().splitlines()[-1] == "compiled 233", done.stdout[-2000:]
