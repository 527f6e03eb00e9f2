"""Shared helpers for the GPT trainer tests: a small real-tokenizer tape and run launchers."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from packed_adamw.tokenizer.tape import build_split

WORDS = ("the king and queen of a far country went over hills to see what lay beyond the sea "
         "where old ships sail under grey skies while young sailors sing songs of home").split()

MICRO = ["--config", "micro", "--batch-size", "4", "--log-every", "1", "--eval-every", "5",
         "--eval-batches", "2", "--checkpoint-every", "0", "--no-progress"]


def make_documents(count: int = 40, words: int = 400, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"doc{i:02d}", " ".join(rng.choice(WORDS) for _ in range(words))) for i in range(count)]


def build_data(directory: Path, count: int = 40, words: int = 400) -> Path:
    """train.tape and val.tape of synthetic English-like documents, with the real tokenizer."""
    build_split(make_documents(count, words), directory, val_fraction=0.1)
    return directory


def train_command(*args) -> list[str]:
    return [sys.executable, "-m", "packed_adamw.torch.gpt.train", *map(str, args)]


def run_train(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the trainer in a new process; fails the test with its output if it exits non-zero."""
    result = subprocess.run(train_command(*args), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"trainer failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def assert_bitwise_equal(path_a: Path, path_b: Path, prefixes=("model/", "optimizer/")) -> None:
    """Every model and optimizer tensor of two checkpoints has identical bits (no tolerance)."""
    a, b = checkpoint_tensors(path_a), checkpoint_tensors(path_b)
    keys = sorted(k for k in a if k.startswith(prefixes))
    assert keys and keys == sorted(k for k in b if k.startswith(prefixes))
    for key in keys:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        # Compare raw bytes: NaN-safe and -0.0 != +0.0.
        assert torch.equal(a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)), key


def poison_weights_after_step(monkeypatch, optimizer_class, step: int) -> None:
    """Make `optimizer_class.step` write a NaN into its first parameter after its `step`-th call
    (for the duration of `monkeypatch`): weights that diverge at a known step."""
    real_step, calls = optimizer_class.step, []

    def poisoned_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == step:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(optimizer_class, "step", poisoned_step)
