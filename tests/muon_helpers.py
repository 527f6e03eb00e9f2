"""Shared pieces of the torch Muon tests: the skip for torch's unfused CPU kernels, gradients
over many binades, and a tiny model with every kind of parameter."""
from __future__ import annotations

import numpy as np
import pytest
import torch

# torch's AVX2/AVX512 CPU kernels fuse lerp's and add(alpha=)'s multiply-add as the contract
# does; its DEFAULT (no-SIMD) build rounds twice (docs/MUON.md, "lerp").
fused_torch = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                                 reason="torch's DEFAULT CPU kernels do not fuse lerp's multiply-add")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns (exact comparison: -0 differs from 0, NaNs by payload)."""
    t = t.detach()
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def gradient(rng: np.random.Generator, shape, low: int = -12, high: int = 0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * 2.0 ** rng.integers(low, high, shape)).astype(np.float32))


class TinyModel(torch.nn.Module):
    """An embedding, two block matrices (one with a bias), a norm and a head."""

    def __init__(self, vocab: int = 11, width: int = 6, hidden: int = 9):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width, bias=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)


def set_gradients(rng: np.random.Generator, *models) -> None:
    """The same gradients (float32, of each parameter's dtype) on each model's parameters."""
    for params in zip(*(m.parameters() for m in models)):
        g = gradient(rng, tuple(params[0].shape), -10, -2)
        for p in params:
            p.grad = g.to(p.dtype).clone()
