"""Helpers shared by the PackedAdamW tests (CPU and CUDA): bits, inputs, references.

Not a test module. Every "equal" here means equal bits: float32 and uint32 tensors are
compared as uint32 integers, never with a tolerance.
"""
from __future__ import annotations

import numpy as np
import torch

from packed_adamw.core import Hyperparams, StateFormat, adamw_step
from packed_adamw.core.adamw import authority as A
from packed_adamw.core.codecs import CODE_MASK
from packed_adamw.core.adamw.state_format import MOMENT_SHIFT

F32 = np.float32
U32 = np.uint32
MODES = ["packed", "fp16", "fp32"]


# ---------------------------------------------------------------------- bits ----

def bits(t) -> np.ndarray:
    """A float32 or uint32 tensor (any device) or numpy array as a flat numpy uint32 copy."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        if t.dtype == torch.uint32:
            t = t.view(torch.int32)
        if t.dtype not in (torch.float32, torch.int32):
            raise TypeError(f"bits(): expected a float32 or uint32 tensor, got {t.dtype}")
        return t.contiguous().reshape(-1).numpy().view(U32).copy()
    a = np.ascontiguousarray(t)
    if a.dtype not in (np.float32, np.uint32, np.int32):
        raise TypeError(f"bits(): expected float32 or uint32 data, got {a.dtype}")
    return a.reshape(-1).view(U32).copy()


def assert_same_bits(actual, expected, what: str) -> None:
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, f"{what}: {a.size} values vs {e.size} expected"
    bad = np.flatnonzero(a != e)
    if bad.size:
        show = ", ".join(f"[{i}] {a[i]:#010x} != {e[i]:#010x}" for i in bad[:5])
        raise AssertionError(f"{what}: {bad.size} of {a.size} values differ in their bits: {show}")


def state_key(mode: str) -> str:
    return "moments" if mode == "fp32" else "words"


def state_tensor(opt, p) -> torch.Tensor:
    return opt.state[p][state_key(opt.state_format.mode)]


def snapshot(opt, params) -> dict:
    """Bits of every parameter, every state tensor and every step count, for 'unchanged' checks."""
    snap = {}
    for i, p in enumerate(params):
        snap[f"param {i}"] = bits(p)
        st = opt.state.get(p) or {}
        for key, value in st.items():
            snap[f"param {i} {key}"] = int(value) if key == "step" else bits(value)
    return snap


def assert_same_snapshot(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: state entries {sorted(actual)} != {sorted(expected)}"
    for key in expected:
        if isinstance(expected[key], int):
            assert actual[key] == expected[key], f"{what}: {key} is {actual[key]}, expected {expected[key]}"
        else:
            assert_same_bits(actual[key], expected[key], f"{what}: {key}")


def has_nonfinite_code(words: np.ndarray) -> bool:
    """True if a packed fp16-mode word holds an IEEE Inf/NaN code in either half."""
    halves = [(words >> U32(MOMENT_SHIFT)) & U32(CODE_MASK), words & U32(CODE_MASK)]
    return any(bool(np.any((h & U32(0x7C00)) == U32(0x7C00))) for h in halves)


def assert_state_finite(opt, params, what: str) -> None:
    mode = opt.state_format.mode
    for i, p in enumerate(params):
        assert torch.isfinite(p).all(), f"{what}: param {i} holds NaN/Inf"
        if p not in opt.state:
            continue
        s = state_tensor(opt, p)
        if mode == "fp32":
            assert torch.isfinite(s).all(), f"{what}: param {i} moments hold NaN/Inf"
        elif mode == "fp16":
            assert not has_nonfinite_code(bits(s)), f"{what}: param {i} words hold an FP16 Inf/NaN code"
        # packed: every E4M11/E4M12 code is a finite number (FORMAT.md), nothing to check


# -------------------------------------------------------------------- inputs ----

def spanning_values(rng: np.random.Generator, n: int, lo_exp: int, hi_exp: int, zeros=0.02) -> np.ndarray:
    """float32 values whose magnitudes are spread over 2**lo_exp .. 2**hi_exp (both signs),
    with a share of exact +0.0 and -0.0."""
    exponents = rng.integers(lo_exp, hi_exp + 1, size=n)
    mantissas = rng.uniform(1.0, 2.0, size=n)
    signs = rng.choice([-1.0, 1.0], size=n)
    values = (signs * np.ldexp(mantissas, exponents)).astype(F32)
    zero = rng.random(n) < zeros
    values[zero] = np.where(rng.random(int(zero.sum())) < 0.5, F32(0.0), F32(-0.0))
    return values


def small_mlp(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 4))


def mlp_batch(seed: int = 1, n: int = 64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


# ---------------------------------------------------------------- references ----

def authority_step(p: np.ndarray, g: np.ndarray, state: np.ndarray, *, count: int, hp: dict, fmt: StateFormat):
    """The scalar authority over every element of flat float32 `p`, `g` and the flat state
    (uint32 words, or float32 [2, n] in fp32 mode). Returns (p_new, state_new, accepted)."""
    kw = dict(count=count, lr=hp["lr"], b1=hp["betas"][0], b2=hp["betas"][1], eps=hp["eps"],
              weight_decay=hp["weight_decay"], mode=fmt.mode, m_bias=fmt.m_bias, rms_bias=fmt.rms_bias)
    if fmt.mode == "fp32":
        states = list(zip(state[0].tolist(), state[1].tolist()))
    else:
        states = state.astype(np.uint64).tolist()
    out_p, out_s, out_ok = [], [], []
    for pi, gi, si in zip(p.tolist(), g.tolist(), states):
        pn, _u, sn, ok = A.adamw_element(pi, gi, si, **kw)
        out_p.append(pn)
        out_s.append(sn)
        out_ok.append(ok)
    p_new = np.array(out_p, dtype=np.float64).astype(F32)
    if fmt.mode == "fp32":
        s_new = np.array(out_s, dtype=np.float64).reshape(-1, 2).T.astype(F32)
    else:
        s_new = np.array(out_s, dtype=np.uint64).astype(U32)
    return p_new, s_new, np.array(out_ok, dtype=bool)


def state_as_numpy(t: torch.Tensor, mode: str) -> np.ndarray:
    """A state tensor as numpy: flat uint32 words, or float32 [2, n] in fp32 mode."""
    t = t.detach().cpu()
    if mode == "fp32":
        return t.reshape(2, -1).numpy().copy()
    return bits(t)


def numpy_reference_step(p: np.ndarray, g: np.ndarray, state: np.ndarray, *, count: int, group: dict,
                         fmt: StateFormat) -> int:
    """core.adamw.numpy_step in place on flat numpy copies, with a param group's hyperparameters."""
    hp = Hyperparams(lr=float(group["lr"]), b1=float(group["betas"][0]), b2=float(group["betas"][1]),
                     eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
    return adamw_step(p, g, state, count=count, hp=hp, fmt=fmt)


def train_mlp(opt_factory, steps: int, seed: int = 0):
    """Train small_mlp on a fixed batch; returns (model, optimizer, last loss)."""
    model = small_mlp(seed)
    x, y = mlp_batch()
    opt = opt_factory(model.parameters())
    loss = None
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return model, opt, loss.item()
