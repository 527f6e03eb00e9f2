"""Helpers shared by the kernel tests: launch the Triton kernel, run the references, make inputs.

Not a test module. `run_kernel` launches `core.adamw.kernel.adamw_kernel` exactly as a frontend
would (launch.py's constants, compile options when compiled) on torch tensors, interpreted on
CPU or compiled on CUDA, and hands back numpy arrays. `numpy_reference` and
`authority_reference` compute the same step with `core.adamw.numpy_step` and with the scalar
authority, so a test can demand equal bits from all three.

State words travel as a torch.int32 view of the uint32 words: both int32 and uint32 views work
in the interpreter (test_kernel checks that), but int32 is what every torch version and CUDA
op supports fully, and what the kernel is written for (it bitcasts to uint32 after loading).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.core import Hyperparams, StateFormat, adamw_step
from packed_adamw.core.adamw import authority as A
from packed_adamw.core import launch
from packed_adamw.core.codecs import CODE_MASK
from packed_adamw.core.adamw.rule import FORMAT_COUNTS

F32 = np.float32
U32 = np.uint32
NEG_ZERO_BITS = 0x80000000
SCALAR_ROW = 8  # step_scalars_kernel's row: the eight values of numpy_step.step_scalars, in order


# ---------------------------------------------------------------- the kernel ----

def _state_to_torch(state: np.ndarray, fmt: StateFormat, device) -> torch.Tensor:
    if fmt.mode == "fp32":
        return torch.from_numpy(np.ascontiguousarray(state, dtype=F32).copy()).to(device)
    words = np.ascontiguousarray(state, dtype=U32).copy()
    return torch.from_numpy(words.view(np.int32)).to(device)


def _state_to_numpy(state: torch.Tensor, fmt: StateFormat) -> np.ndarray:
    array = state.detach().cpu().numpy()
    return array if fmt.mode == "fp32" else array.view(U32)


def kernel_step_scalars(hp: Hyperparams, count: int, device) -> torch.Tensor:
    """One row of device step scalars from `step_scalars_kernel`, as the launchers compute them
    (order: numpy_step.step_scalars' keys)."""
    from packed_adamw.core.adamw.kernel import step_scalars_kernel  # after conftest chose interpreter or not

    hparams = torch.tensor([hp.as_float32_list()], dtype=torch.float32, device=device)
    counts = torch.tensor([count], dtype=torch.int32, device=device)
    scalars = torch.empty((1, SCALAR_ROW), dtype=torch.float32, device=device)
    step_scalars_kernel[launch.grid(1, launch.SCALAR_BLOCK_ROWS)](
        hparams_ptr=hparams, counts_ptr=counts, scalars_ptr=scalars, n_rows=1,
        BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **_compile_options(num_warps=False),
    )
    return scalars[0]


def _compile_options(num_warps=True) -> dict:
    if launch.interpreting():
        return {}
    options = dict(launch.COMPILE_OPTIONS)
    if num_warps:
        options["num_warps"] = launch.GPU_NUM_WARPS
    return options


def new_counters(n_tensors: int, device) -> torch.Tensor:
    """The kernels' per-tensor counter rows (launch.COUNTER_ROW int64 each), zeroed."""
    return torch.zeros((n_tensors, launch.COUNTER_ROW), dtype=torch.int64, device=device)


def launch_kernel(param, grad, state, *, count: int, hp: Hyperparams, fmt: StateFormat, write_update=False,
                  out=None, new_state=None, nonfinite=None, block=None, track_format=False,
                  blocks_per_program=None, layout=None):
    """Launch on torch tensors (all on one device): step_scalars_kernel, then adamw_kernel.
    Returns (out, new_state, counters): one counter row, the non-finite count first.
    `blocks_per_program` and `layout` override the launch's (launch.single_tensor_constants).

    In place (write_update=False): `out` is `param` and `new_state` is `state`.
    Functional (write_update=True): `out` receives the update, `new_state` a fresh state;
    `param` and `state` are only read.
    """
    from packed_adamw.core.adamw.kernel import adamw_kernel

    device = param.device
    if write_update:
        out = torch.empty_like(param) if out is None else out
        new_state = torch.empty_like(state) if new_state is None else new_state
    else:
        out, new_state = param, state
    if nonfinite is None:
        nonfinite = new_counters(1, device)
    scalars = kernel_step_scalars(hp, count, device)
    n = param.numel()
    block = launch.block_size() if block is None else block
    # By name: robust to the order of the kernel's parameters (jax-triton puts outputs last).
    constants = launch.single_tensor_constants(fmt, write_update=write_update, count_nonfinite=True, block=block,
                                               track_format=track_format)
    if blocks_per_program is not None:
        constants["BLOCKS_PER_PROGRAM"] = blocks_per_program
    if layout is not None:
        constants["LAYOUT"] = layout
    adamw_kernel[launch.single_tensor_grid(n, constants)](
        param_ptr=param, grad_ptr=grad, state_ptr=state, scalars_ptr=scalars, counters_ptr=nonfinite,
        n_elements=n, out_ptr=out, new_state_ptr=new_state, **constants, **_compile_options(),
    )
    return out, new_state, nonfinite


class KernelResult(NamedTuple):
    out: np.ndarray  # the new parameters (in place) or the update u (write_update)
    state: np.ndarray  # uint32 words [n], or float32 [2, n] in fp32 mode
    nonfinite: int  # elements rejected, as counted by the kernel
    param_buffer: np.ndarray  # the input parameter buffer after the launch
    state_buffer: np.ndarray  # the input state buffer after the launch
    format_counts: np.ndarray  # FORMAT_COUNTS (zeros unless track_format)


def run_kernel(p, g, state, *, count, hp, fmt, write_update=False, device="cpu", block=None,
               track_format=False, blocks_per_program=None, layout=None) -> KernelResult:
    """Copies the numpy inputs to `device`, launches, and copies everything back."""
    tp = torch.from_numpy(np.array(p, dtype=F32, copy=True)).to(device)
    tg = torch.from_numpy(np.array(g, dtype=F32, copy=True)).to(device)
    ts = _state_to_torch(state, fmt, device)
    out, new_state, counters = launch_kernel(tp, tg, ts, count=count, hp=hp, fmt=fmt,
                                             write_update=write_update, block=block, track_format=track_format,
                                             blocks_per_program=blocks_per_program, layout=layout)
    if device != "cpu":
        torch.cuda.synchronize()
    return KernelResult(
        out=out.cpu().numpy().copy(),
        state=_state_to_numpy(new_state, fmt).copy(),
        nonfinite=int(counters[0, 0]),
        param_buffer=tp.cpu().numpy().copy(),
        state_buffer=_state_to_numpy(ts, fmt).copy(),
        format_counts=launch.sum_counter_slots(counters.cpu().numpy())[0],
    )


# ------------------------------------------------------------- the references ----

def numpy_reference(p, g, state, *, count, hp, fmt, write_update=False):
    """core.adamw.numpy_step on copies: returns (out, new_state, rejected) like run_kernel."""
    p = np.array(p, dtype=F32, copy=True)
    state = np.array(state, copy=True)
    if write_update:
        update = np.empty_like(p)
        rejected = adamw_step(p, np.asarray(g, F32), state, count=count, hp=hp, fmt=fmt, update_out=update)
        return update, state, rejected
    rejected = adamw_step(p, np.asarray(g, F32), state, count=count, hp=hp, fmt=fmt)
    return p, state, rejected


class AuthorityResult(NamedTuple):
    index: np.ndarray  # which elements were checked
    p: np.ndarray
    update: np.ndarray
    state: np.ndarray  # uint32 words, or float32 [2, len(index)]
    accepted: np.ndarray


def authority_reference(p, g, state, *, count, hp, fmt, index=None) -> AuthorityResult:
    """The scalar authority, one Python call per element (about 22 us each on this machine:
    100,000 elements x 5 steps x 3 modes is about 35 s, so the big tests run it on every
    element; side tests pass a strided `index`)."""
    n = len(p)
    index = np.arange(n) if index is None else np.asarray(index)
    kw = dict(count=count, lr=hp.lr, b1=hp.b1, b2=hp.b2, eps=hp.eps, weight_decay=hp.weight_decay,
              mode=fmt.mode, m_bias=fmt.m_bias, rms_bias=fmt.rms_bias)
    ps, gs = np.asarray(p, F32)[index].tolist(), np.asarray(g, F32)[index].tolist()
    if fmt.mode == "fp32":
        states = list(zip(np.asarray(state)[0, index].tolist(), np.asarray(state)[1, index].tolist()))
    else:
        states = np.asarray(state, U32)[index].tolist()
    out_p, out_u, out_s, out_a = [], [], [], []
    element = A.adamw_element
    for pi, gi, si in zip(ps, gs, states):
        pn, u, sn, ok = element(pi, gi, si, **kw)
        out_p.append(pn)
        out_u.append(u)
        out_s.append(sn)
        out_a.append(ok)
    if fmt.mode == "fp32":
        new_state = np.array(out_s, dtype=np.float64).T.astype(F32) if out_s else np.zeros((2, 0), F32)
    else:
        new_state = np.array(out_s, dtype=np.uint64).astype(U32)
    # float64 -> float32 is exact here: the authority rounds every value to binary32.
    return AuthorityResult(index, np.array(out_p, np.float64).astype(F32), np.array(out_u, np.float64).astype(F32),
                           new_state, np.array(out_a, bool))


def authority_scalars(count: int, hp: Hyperparams) -> dict[str, float]:
    """The step scalars derived with the authority's arithmetic (FORMAT.md, "Step scalars")."""
    f32 = A.f32
    lr, b1, b2, eps, wd = (f32(x) for x in hp.as_float32_list())
    return {
        "b1": b1,
        "one_minus_b1": f32(1.0 - b1),
        "b2": b2,
        "one_minus_b2": f32(1.0 - b2),
        "step_size": f32(lr / f32(1.0 - A.power(b1, count))),
        "inv_sqrt_bias_correction2": f32(1.0 / f32(math.sqrt(f32(1.0 - A.power(b2, count))))),
        "eps": eps,
        "lr_wd": f32(lr * wd),
    }


# ----------------------------------------------------------------- comparing ----

def bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=F32)).view(U32)


def assert_same_bits(actual, expected, what: str, context=None):
    """Equal float32/uint32 bits; on failure name the first differing elements."""
    a = np.asarray(actual)
    e = np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    a = a.view(U32) if a.dtype == F32 else a.astype(U32)
    e = e.view(U32) if e.dtype == F32 else e.astype(U32)
    diff = np.flatnonzero((a != e).ravel())
    if diff.size:
        af, ef = a.ravel(), e.ravel()
        lines = [f"  flat index {i}: got 0x{int(af[i]):08x}, expected 0x{int(ef[i]):08x}" for i in diff[:5]]
        if context is not None:
            lines.append(f"  context: {context(diff[:5])}")
        raise AssertionError(f"{what}: {diff.size} of {a.size} differ\n" + "\n".join(lines))


def state_at(state, index, fmt):
    return state[:, index] if fmt.mode == "fp32" else state[index]


# ------------------------------------------------------------------- inputs ----

def _log_uniform(rng, n, lo, hi):
    """Signed magnitudes 2**U(lo, hi) with random float32 mantissas."""
    mags = np.exp2(rng.uniform(lo, hi, n)) * rng.uniform(1.0, 2.0, n)
    return (mags * rng.choice([-1.0, 1.0], n)).astype(F32)


def _format_range(fmt: StateFormat):
    """log2 of (below the smallest subnormal, above the largest value) of the moment formats."""
    if fmt.mode == "fp32":
        return -60.0, 4.0
    m_fmt, r_fmt = fmt.formats
    lo = min(math.log2(m_fmt.min_subnormal), math.log2(r_fmt.min_subnormal)) - 3
    hi = max(math.log2(m_fmt.max_value), math.log2(r_fmt.max_value)) + 3
    return lo, hi


def random_params(rng, n) -> np.ndarray:
    p = _log_uniform(rng, n, -40, 20)
    pick = rng.random(n)
    p[pick < 0.03] = 0.0
    p[(pick >= 0.03) & (pick < 0.05)] = -0.0
    return p


def random_grads(rng, n, fmt: StateFormat) -> np.ndarray:
    """Gradients whose moments land everywhere in the formats: below the smallest subnormal,
    subnormal, normal, saturating; plus exact zeros, float32 subnormals and huge values."""
    lo, hi = _format_range(fmt)
    g = _log_uniform(rng, n, lo - 2, hi + 4)
    pick = rng.random(n)
    g[pick < 0.10] = 0.0
    g[(pick >= 0.10) & (pick < 0.12)] = _log_uniform(rng, int(((pick >= 0.10) & (pick < 0.12)).sum()), -149, -126)
    g[(pick >= 0.12) & (pick < 0.13)] = _log_uniform(rng, int(((pick >= 0.12) & (pick < 0.13)).sum()), 60, 127)
    return g


def _fix_fp16_halves(words: np.ndarray) -> np.ndarray:
    """fp16 state holds no Inf/NaN code, and the RMS half has sign bit 0 (FORMAT.md)."""
    hi, lo = words >> U32(16), words & U32(CODE_MASK)
    hi = np.where((hi & U32(0x7C00)) == U32(0x7C00), hi ^ U32(0x4000), hi)
    lo = lo & U32(0x7FFF)
    lo = np.where((lo & U32(0x7C00)) == U32(0x7C00), lo ^ U32(0x4000), lo)
    return (hi << U32(16)) | lo


def random_state(rng, n, fmt: StateFormat) -> np.ndarray:
    """State with every kind of word: random bits, zero, RMS code 0 beside a nonzero m (not
    producible by a step, but a step must still handle it), saturated codes, subnormal codes."""
    if fmt.mode == "fp32":
        lo, hi = -50.0, 3.0
        m = _log_uniform(rng, n, lo, hi)
        v = np.square(_log_uniform(rng, n, lo, hi).astype(np.float64)).astype(F32)
        pick = rng.random(n)
        m[pick < 0.1] = 0.0
        v[pick < 0.15] = 0.0
        return np.stack([m, v])
    words = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(U32)
    pick = rng.random(n)
    words[pick < 0.08] = 0  # zero state (first step)
    rms_zero = (pick >= 0.08) & (pick < 0.16)
    words[rms_zero] &= U32(0xFFFF0000)  # RMS code 0 beside a random m code
    m_fmt, r_fmt = fmt.formats
    saturated = (pick >= 0.16) & (pick < 0.20)
    sat_word = U32((m_fmt.max_magnitude_code << 16) | r_fmt.max_magnitude_code)
    words[saturated] = sat_word | (words[saturated] & U32(0x80000000))
    subnormal = (pick >= 0.20) & (pick < 0.28)  # both exponents 0
    m_mask = (1 << m_fmt.fraction_bits) - 1
    r_mask = (1 << r_fmt.fraction_bits) - 1
    words[subnormal] &= U32((m_fmt.sign_bit | m_mask) << 16 | r_mask)
    if fmt.mode == "fp16":
        words = _fix_fp16_halves(words)
    return words


def inject_nonfinite(rng, g, fraction=0.002):
    """NaN, +Inf and -Inf at random places; returns the positions."""
    n = len(g)
    where = rng.choice(n, size=max(3, int(n * fraction)) if n >= 3 else n, replace=False)
    values = np.array([np.nan, np.inf, -np.inf], F32)
    g[where] = values[np.arange(where.size) % 3]
    return where


def checkable_by_authority(g, fmt: StateFormat, index=None) -> np.ndarray:
    index = np.arange(len(g)) if index is None else np.asarray(index)
    return index
