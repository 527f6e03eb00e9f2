"""Shared pieces of the torch Muon tests: the skip for torch's unfused CPU kernels, gradients
over many binades, a tiny model with every kind of parameter, random states and weights for the
kernels, and the numpy phases as a reference step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from packed_adamw.core.muon import StateFormat, momentum_phase, step_scalar_row, weight_phase, weight_phase_split
from packed_adamw.torch import NonFiniteGradientError

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


def taking_fp32_gradients(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A bf16 parameter that accepts float32 gradients (newer torch checks a gradient's dtype)."""
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None
    return p


def step_refusing(opt, index: int) -> None:
    """A step that must refuse matrix `index` of the first group (NonFiniteGradientError)."""
    with pytest.raises(NonFiniteGradientError, match=rf"\['params'\]\[{index}\] \(refused whole\)"):
        opt.step()


def exponent_of(mode: str, value: int = 0) -> torch.Tensor | None:
    """Packed mode's 0-d int32 exponent of a matrix as the kernels take it (None otherwise)."""
    return torch.tensor(value, dtype=torch.int32) if mode == "packed" else None


def numpy_exponent(exponent: torch.Tensor | None) -> np.ndarray | None:
    """An exponent tensor as the numpy phases take it (a copy)."""
    return None if exponent is None else exponent.numpy().copy()


def random_state(rng: np.random.Generator, mode: str, shape) -> torch.Tensor:
    """A momentum entry of `mode` with random finite values over many binades."""
    if mode == "fp32":
        return gradient(rng, shape, -30, 0)
    codes = rng.integers(0, 2**16, shape).astype(np.uint16)
    if mode == "bf16":
        codes &= np.uint16(0xBFFF)  # finite bf16 codes (exponent below all ones)
    return torch.from_numpy(codes.view(np.int16))


def random_weights(rng: np.random.Generator, shape, split: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights, low half): float32 weights, or bf16 weights' bits as int16 with a random low half."""
    p0 = gradient(rng, shape, -8, 4)
    if not split:
        return p0.clone(), None
    return p0.bfloat16().view(torch.int16).clone(), torch.from_numpy(rng.integers(-2**15, 2**15, shape).astype(np.int16))


class PhasesReference:
    """The numpy phases (core/muon) around a given Newton-Schulz, on host copies of matrices'
    weights, packed momenta and low halves: what a PackedMuon step must equal."""

    def __init__(self, params, shapes, lr: float = 0.03):
        self.split = params[0].dtype is torch.bfloat16
        self.fmt = StateFormat("packed")
        self.weights = [bits(p).cpu().numpy().copy() for p in params]
        if not self.split:
            self.weights = [w.view(np.float32) for w in self.weights]
        self.states = [np.zeros(s, np.uint16) for s in shapes]
        self.exponents = [np.zeros((), np.int32) for _ in shapes]
        self.lows = [np.zeros(s, np.int16) for s in shapes]
        self.scalars = [step_scalar_row((lr, 0.95, 0.1, 1e-7), s) for s in shapes]

    def step(self, grads, batches, newton_schulz_batch) -> None:
        """`batches`: (indices, ns_steps) per Newton-Schulz batch; `newton_schulz_batch(xs,
        indices, steps)` returns the results of the accepted matrices' inputs `xs` (a dict)."""
        xs = {i: momentum_phase(g.numpy(), self.states[i], self.scalars[i], fmt=self.fmt, exponent=self.exponents[i])
              for i, g in enumerate(grads)}
        for batch, steps in batches:
            accepted = {i: torch.from_numpy(xs[i].view(np.int16)).view(torch.bfloat16)
                        for i in batch if xs[i] is not None}
            for i, ortho in newton_schulz_batch(accepted, batch, steps).items():
                ortho = ortho.contiguous().view(torch.int16).cpu().numpy()
                if self.split:
                    weight_phase_split(self.weights[i], self.lows[i], ortho, self.scalars[i])
                else:
                    weight_phase(self.weights[i], ortho, self.scalars[i])

    def assert_equals(self, params, opt) -> None:
        for i, p in enumerate(params):
            assert np.array_equal(bits(p).cpu().numpy(), self.weights[i].view(np.int16 if self.split else np.int32))
            assert np.array_equal(opt.state[p]["momentum_code"].cpu().numpy().view(np.uint16), self.states[i])
            assert opt.state[p]["mu_exponent"].dtype == torch.int32 and opt.state[p]["mu_exponent"].dim() == 0
            assert int(opt.state[p]["mu_exponent"]) == int(self.exponents[i])
            if self.split:
                assert np.array_equal(opt.state[p]["lo"].cpu().numpy(), self.lows[i])
