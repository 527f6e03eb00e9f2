"""The Triton Newton-Schulz (core/muon/ns_kernel.py) in Triton's CPU interpreter against its
numpy mirror (core/muon/ns_reference.py) bit for bit, and the properties its GPU bits rely on:
a matrix's result does not depend on its batch, a tall matrix is its transpose's. The
interpreter is slow: tiny shapes. On a GPU, torch == JAX is tests/jax_frontend/test_jax_muon.py's CUDA test.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import interpreting
from muon_helpers import PhasesReference, gradient
from packed_adamw.core import launch
from packed_adamw.core.muon import bf16_bits, bf16_values, newton_schulz_reference, ns_kernel
from packed_adamw.core.muon.kernel import _bf16_bits
from packed_adamw.core.muon.ns_reference import newton_schulz_triton_reference
from packed_adamw.torch import PackedMuon
from packed_adamw.torch import muon as torch_muon
from packed_adamw.torch.muon import newton_schulz, newton_schulz_triton, newton_schulz_triton_stacked

pytestmark = pytest.mark.skipif(not interpreting(), reason="mirrors Triton's CPU interpreter (tl.dot as np.matmul)")

# Small tiles put several tiles and K steps into tiny matrices (16 x 40: 1 x 3 tiles, 3 K steps).
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
COEFFICIENTS, STEPS, EPS = (3.4445, -4.775, 2.0315), 5, 1e-7


def _input(shape, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).bfloat16()


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _launch_with(blocks, monkeypatch):
    """Launch `newton_schulz_triton` with other tiles (for the tiling's sake only)."""
    monkeypatch.setattr(ns_kernel, "default_blocks", lambda: dict(blocks))


@pytest.mark.parametrize("shape", [(4, 8), (16, 40), (40, 16), (8, 8)])
def test_kernels_equal_the_numpy_mirror(shape, monkeypatch):
    x = _input(shape, seed=sum(shape))
    got = newton_schulz_triton(x, COEFFICIENTS, STEPS, EPS)
    assert got.shape == shape and got.dtype is torch.bfloat16
    np.testing.assert_array_equal(_bits(got), newton_schulz_triton_reference(_bits(x), COEFFICIENTS, STEPS, EPS))
    if shape == (16, 40):  # several tiles and K steps per product
        _launch_with(SMALL, monkeypatch)
        got = newton_schulz_triton(x, COEFFICIENTS, STEPS, EPS)
        want = newton_schulz_triton_reference(_bits(x), COEFFICIENTS, STEPS, EPS, blocks=SMALL)
        np.testing.assert_array_equal(_bits(got), want)


def test_the_mirrored_products_equal_the_full_ones(monkeypatch):
    # 36 x 48 under 16-element tiles: the 36 x 36 Gram matrix and polynomial are 3 x 3 tiles, a
    # partial row and column among them; the kernel computes the six on or above the diagonal
    # and mirrors three, in each matrix of a batch of three. The numpy mirror computes all nine.
    _launch_with(SMALL, monkeypatch)
    xs = [_input((36, 48), seed=11 + i) for i in range(3)]
    stacked = newton_schulz_triton_stacked(torch.stack(xs), COEFFICIENTS, 2, EPS)  # each its own slot
    for i, x in enumerate(xs):
        want = newton_schulz_triton_reference(_bits(x), COEFFICIENTS, 2, EPS, blocks=SMALL)
        np.testing.assert_array_equal(_bits(stacked[i]), want, err_msg=f"matrix {i} of the batch")
    plan = ns_kernel.launch_plan(1, 36, 48, 1, interpreting=True, blocks=SMALL)
    assert [constants["SYMMETRIC"] for _, _, _, constants, _ in plan[2:]] == [True, True, False]


def test_norm_over_several_partials_and_eps():
    # 64 x 160 = 10240 elements: three partial sums. A zero matrix divides by bf16(eps).
    x = _input((64, 160), seed=3, scale=40.0)
    np.testing.assert_array_equal(_bits(newton_schulz_triton(x, COEFFICIENTS, 1, EPS)),
                                  newton_schulz_triton_reference(_bits(x), COEFFICIENTS, 1, EPS))
    zero = torch.zeros((4, 8), dtype=torch.bfloat16)
    assert not _bits(newton_schulz_triton(zero, COEFFICIENTS, STEPS, EPS)).any()
    tiny = torch.full((4, 8), 2.0 ** -40, dtype=torch.bfloat16)  # its norm is below eps: clamped
    np.testing.assert_array_equal(_bits(newton_schulz_triton(tiny, COEFFICIENTS, 0, EPS)),
                                  newton_schulz_triton_reference(_bits(tiny), COEFFICIENTS, 0, EPS))
    assert bf16_values(_bits(newton_schulz_triton(tiny, COEFFICIENTS, 0, EPS))).max() < 1e-4


def test_a_matrix_has_the_same_bits_alone_and_in_a_batch():
    xs = [_input((12, 20), seed=s) for s in range(3)]
    stacked = newton_schulz_triton_stacked(torch.stack(xs), COEFFICIENTS, STEPS, EPS)
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(_bits(stacked[i]), _bits(newton_schulz_triton(x, COEFFICIENTS, STEPS, EPS)))
    tall = xs[0].T.contiguous()  # a tall matrix is its transpose's Newton-Schulz, transposed
    np.testing.assert_array_equal(_bits(newton_schulz_triton(tall, COEFFICIENTS, STEPS, EPS)), _bits(stacked[0]).T)


def test_close_to_torch_and_float32_newton_schulz():
    # Other implementations, other sums: bf16 roundings land differently now and then and the
    # differences travel through the iterations. The bound is the JAX path's (MUON.md).
    x = _input((16, 40), seed=7)
    got = bf16_values(_bits(newton_schulz_triton(x, COEFFICIENTS, STEPS, EPS)))
    torch_ns = bf16_values(_bits(newton_schulz(x, COEFFICIENTS, STEPS, EPS)))
    assert np.abs(got - torch_ns).max() <= 2.0 ** -6
    assert np.abs(got - newton_schulz_reference(bf16_values(_bits(x)), COEFFICIENTS, STEPS, EPS)).max() <= 2.0 ** -4


@triton.jit
def _rounds(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, _bf16_bits(tl.load(x_ptr + offsets)).to(tl.int32, bitcast=True))


def test_the_kernels_round_every_nan_to_the_quiet_nan():
    """core/muon/kernel.py's `_bf16_bits` (the momentum phase's bf16 roundings, the norm's, and
    the Newton-Schulz GEMM epilogue's in the interpreter; on a GPU the epilogue's twin is
    test_torch_muon.py's CUDA test) on NaN payloads, the GPU's 0x7FFFFFFF among them: 0x7FC0, as numpy's
    `bf16_bits` (test_muon_core.py); before, 0x7FFFFFFF gave -0."""
    payloads = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7F800001, 0x7F800000, 0x7F7FFFFF, 0x3F808000,
                         0x3F818000], np.uint32)
    x = torch.from_numpy(payloads.view(np.float32).copy())
    out = torch.empty(len(payloads), dtype=torch.int32)
    _rounds[(1,)](x, out, BLOCK=len(payloads))
    assert out.tolist() == [0x7FC0] * 4 + bf16_bits(payloads[4:].view(np.float32)).astype(np.int32).tolist()


def test_plan_refuses_a_tall_or_empty_shape():
    with pytest.raises(ValueError, match="wide orientation"):
        ns_kernel.launch_plan(1, 8, 4, STEPS, interpreting=True)
    with pytest.raises(ValueError, match="wide orientation"):
        ns_kernel.launch_plan(1, 0, 4, STEPS, interpreting=True)


def test_scalars_are_rounded_once_to_float32():
    row = ns_kernel.ns_scalars(COEFFICIENTS, EPS)
    assert row.dtype == np.float32
    assert list(row) == [np.float32(v) for v in (*COEFFICIENTS, EPS)]
    assert bf16_bits(row[3:]).tolist() == bf16_bits(np.float32([1e-7])).tolist()


# ---- PackedMuon(ns_impl="triton") -------------------------------------------------------------
STEP_SHAPES = [(8, 4), (4, 8), (4, 8), (6, 6)]  # a tall matrix batched with its transpose's shape


@pytest.mark.parametrize("batch_ns, kernels", [(False, False), (True, True)])
def test_packed_muon_triton_equals_the_phases_around_the_triton_newton_schulz(batch_ns, kernels, monkeypatch):
    """With ns_impl="triton" the step (numpy phases, or the CUDA step's kernels in the
    interpreter; per matrix or batched) is core's phases around `newton_schulz_triton` per
    matrix: batching does not change a matrix's bits."""
    rng = np.random.default_rng(5)
    p0 = [gradient(rng, s, -4, 0) for s in STEP_SHAPES]
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = PackedMuon(params, lr=0.03, ns_steps=2, ns_impl="triton", batch_ns=batch_ns)  # 2: the interpreter is slow
    monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: kernels)
    reference = PhasesReference(params, STEP_SHAPES, lr=0.03)
    one_by_one = lambda xs, batch, steps: {i: newton_schulz_triton(x, COEFFICIENTS, steps, EPS)  # noqa: E731
                                           for i, x in xs.items()}
    for _ in range(2):
        grads = [gradient(rng, s) for s in STEP_SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        reference.step(grads, [([i], 2) for i in range(len(STEP_SHAPES))], one_by_one)
        reference.assert_equals(params, opt)


def test_ns_impl_is_checked(monkeypatch):
    p = torch.nn.Parameter(torch.ones(4, 8))
    with pytest.raises(ValueError, match="ns_impl='fast'.*'auto'.*'cublas'.*'triton'"):
        PackedMuon([p], ns_impl="fast")
    opt = PackedMuon([p], ns_impl="triton")
    assert opt.__getstate__()["ns_impl"] == "triton"
    p.grad = torch.ones(4, 8)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="ns_impl='triton'.*CUDA.*ns_impl='cublas'"):
        opt.step()


def test_the_benchmarks_floor_counts_the_plans_gemm_work():
    # benchmarks/muon_ns_timing.py's floor row: its FLOP count is the launch plan's full products
    # (2 M N K each), for a wide and a tall matrix; d12's 72 matrices come to about 1.6 TFLOP.
    from script_helpers import BENCHMARKS, import_script

    timing = import_script(BENCHMARKS / "muon_ns_timing.py", "muon_ns_timing")
    for rows, cols in ((48, 80), (80, 48)):
        plan = ns_kernel.launch_plan(1, 48, 80, timing.NS_STEPS, interpreting=True)
        gemms = [constants for kernel, _, _, constants, _ in plan if kernel is ns_kernel.ns_gemm_kernel]
        assert timing.ns_gemm_flops([(rows, cols)]) == sum(2 * c["M"] * c["N"] * c["K"] for c in gemms)
    assert 1.55e12 < timing.ns_gemm_flops(timing.matrices("d12")) < 1.7e12
