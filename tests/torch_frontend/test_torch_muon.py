"""PackedMuon, its kernels and the combined PackedMuonAdamW (docs/MUON.md, "PyTorch")."""
from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from muon_helpers import (PhasesReference, TinyModel, bits, cuda_only, exponent_of, fused_torch, gradient,
                          numpy_exponent, random_state, random_weights, set_gradients, step_refusing,
                          taking_fp32_gradients)
from packed_adamw.core import launch
from packed_adamw.core.muon import (StateFormat, bf16_bits, momentum_phase, ns_kernel, step_scalar_row, weight_phase,
                                    weight_phase_split)
from packed_adamw.torch import NonFiniteGradientError, PackedAdamW, PackedMuon, PackedMuonAdamW, muon_param_groups
from packed_adamw.torch import muon as torch_muon
from packed_adamw.torch import _muon_ns as torch_muon_ns
from packed_adamw.torch.muon import newton_schulz, newton_schulz_batched, newton_schulz_triton

SHAPES = [(12, 5), (5, 12), (8, 8)]


# ---- against torch.optim.Muon ----------------------------------------------------------------
def torch_muon_pair(p0, *, device="cpu", **kwargs):
    theirs = torch.nn.Parameter(p0.clone().to(device))
    ours = torch.nn.Parameter(p0.clone().to(device))
    # torch's matmuls per matrix, as torch.optim.Muon runs Newton-Schulz (the default on the CPU;
    # on CUDA the default is the Triton kernels).
    return theirs, ours, torch.optim.Muon([theirs], **kwargs), PackedMuon([ours], mode="fp32", ns_impl="cublas",
                                                                          batch_ns=False, **kwargs)


@fused_torch
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_fp32_mode_equals_torch_optim_muon_with_a_scheduler(shape, nesterov, adjust_lr_fn):
    rng = np.random.default_rng(sum(shape))
    theirs, ours, opt_t, opt_o = torch_muon_pair(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * 0.2,
                                                 lr=0.02, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    sched_t, sched_o = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in (opt_t, opt_o))
    for _ in range(4):
        g = gradient(rng, shape)
        theirs.grad, ours.grad = g.clone(), g.clone()
        opt_t.step()
        opt_o.step()
        sched_t.step()
        sched_o.step()
        assert torch.equal(bits(theirs), bits(ours))
        assert torch.equal(bits(opt_t.state[theirs]["momentum_buffer"]), bits(opt_o.state[ours]["momentum_buffer"]))


@fused_torch
def test_a_changed_momentum_takes_effect_the_next_step():
    rng = np.random.default_rng(3)
    theirs, ours, opt_t, opt_o = torch_muon_pair(torch.zeros(6, 4), lr=0.01)
    for step in range(3):
        for opt in (opt_t, opt_o):
            opt.param_groups[0]["momentum"] = (0.95, 0.5, 0.9)[step]
        g = gradient(rng, (6, 4))
        theirs.grad, ours.grad = g.clone(), g.clone()
        opt_t.step()
        opt_o.step()
        assert torch.equal(bits(theirs), bits(ours))


def test_our_newton_schulz_is_torchs():
    """Ours follows the contract; torch's private function is only the oracle here."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    rng = np.random.default_rng(5)
    for shape in SHAPES + [(1, 7), (16, 3)]:
        x = gradient(rng, shape).bfloat16()
        expected = _zeropower_via_newtonschulz(x.clone(), (3.4445, -4.775, 2.0315), 5, 1e-7)  # it divides in place
        assert torch.equal(bits(newton_schulz(x)), bits(expected))


# ---- Newton-Schulz batched over matrices of one shape -----------------------------------------
def assert_batched_equals_per_matrix(shape_lists, device, seed):
    """Every listed batch checked; the failure names each batch whose results differ, with its
    differing matrices and elements (one GPU run tells the whole story)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    differing = []
    for shapes in shape_lists:
        xs = [(torch.randn(s, generator=gen, device=device)
               * torch.exp2(torch.randint(-6, 2, s, generator=gen, device=device).float())).bfloat16() for s in shapes]
        results = newton_schulz_batched(xs)
        diffs = []
        for x, y in zip(xs, results):
            assert y.shape == x.shape and y.is_contiguous()
            diffs.append(int((bits(y) != bits(newton_schulz(x).contiguous())).sum()))
        if any(diffs):
            differing.append(f"{len(shapes)} x {sorted(set(shapes))}: {sum(map(bool, diffs))} matrices differ, "
                             f"{sum(diffs)} elements")
    assert not differing, "batched Newton-Schulz differs from per-matrix: " + "; ".join(differing)


# Batches of 1, 2, 3 and 8 matrices, wide, tall, square, and tall with wide in one batch.
BATCHES = [[s] * b for s in [(12, 5), (5, 12), (8, 8), (48, 64)] for b in (1, 2, 3, 8)] + [
    [(12, 5), (5, 12), (12, 5)], [(64, 48), (48, 64)], [(96, 200)] * 3, [(200, 96), (96, 200)]]


@pytest.mark.parametrize("on", ["cpu"])
def test_a_matrix_gets_the_same_batched_bits_in_any_batch(on):
    """On the CPU a matrix's batched result does not depend on its batch-mates, their number or
    order. (Equal to the per-matrix bits they are not on the CPU: there torch's bf16 addmm and
    baddbmm round differently in rare elements. On the H200 a batch of one differed from the same
    matrix in a batch of twelve (12x5), so this holds on the CPU only; MUON.md.)"""
    gen = torch.Generator(device=on).manual_seed(20)
    for shapes in BATCHES:
        xs = [(torch.randn(s, generator=gen, device=on) * 2.0 ** -3).bfloat16() for s in shapes]
        together, reversed_ = newton_schulz_batched(xs), newton_schulz_batched(xs[::-1])[::-1]
        for x, a, b in zip(xs, together, reversed_):
            alone = newton_schulz_batched([x])[0]
            assert a.shape == x.shape and a.is_contiguous()
            assert torch.equal(bits(a), bits(alone)) and torch.equal(bits(b), bits(alone)), shapes


@triton.jit
def _rounds_by_instruction(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rounded = ns_kernel._bf16_by_instruction(tl.load(x_ptr + offsets, mask=offsets < n))
    tl.store(out_ptr + offsets, rounded.to(tl.int16, bitcast=True), mask=offsets < n)


@pytest.mark.cuda
@cuda_only
def test_the_gpu_epilogue_rounding_is_the_contracts_on_every_kind_of_float():
    """The Newton-Schulz GEMM epilogue on a GPU rounds to bf16 by the conversion instruction
    (core/muon/ns_kernel.py `_bf16_by_instruction`); the contract is numpy's `bf16_bits`. Ties
    both ways, the carry into the exponent, overflow to Inf, subnormals, signed zeros, NaN
    payloads (the GPU's own 0x7FFFFFFF among them), and a million random bit patterns."""
    edges = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3FFFFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000,
             0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00000000, 0x80000000, 0x807FFFFF, 0xFF7FFFFF,
             0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0xFFC00001]
    patterns = np.concatenate([np.array(edges, np.uint32),
                               np.random.default_rng(31).integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    x = torch.from_numpy(patterns.view(np.float32)).cuda()
    out = torch.empty(len(patterns), dtype=torch.int16, device="cuda")
    _rounds_by_instruction[(triton.cdiv(len(patterns), 1024),)](x, out, len(patterns), BLOCK=1024)
    assert np.array_equal(out.cpu().numpy().view(np.uint16), bf16_bits(patterns.view(np.float32)))


@pytest.mark.cuda
@cuda_only
def test_batched_newton_schulz_equals_per_matrix_on_cuda():
    """Decides `batch_ns`'s default (MUON.md, "Batched Newton-Schulz"): cuBLAS may pick another
    algorithm (another split of the sum) for a batched GEMM than for the solo one. The model
    lists of benchmarks/bench_muon.py are here, each shape at its list's batch size. (On the
    CPU, torch 2.13 with oneDNN, rare elements differ: a 1-ulp rounding of the last baddbmm
    against addmm's, spreading through the later iterations; MUON.md.)"""
    model_batches = [[(864, 288)] * 8, [(288, 288)] * 8, [(1152, 288), (288, 1152)] * 8, [(2304, 768)] * 12,
                     [(768, 768)] * 12, [(3072, 768), (768, 3072)] * 12, [(768, 768)] * 48,
                     [(6144, 2048)] * 24, [(2048, 2048)] * 24, [(8192, 2048), (2048, 8192)] * 24]
    assert_batched_equals_per_matrix(BATCHES + model_batches, "cuda", 21)


# Shapes that batch (two wide with one tall), a square pair, a lone shape; a last matrix in a
# group of its own Newton-Schulz settings stays out of its shape's batch.
BATCH_NS_SHAPES = [(6, 10), (10, 6), (6, 10), (7, 7), (7, 7), (3, 5), (6, 10)]


def batch_ns_optimizer(p0, device, batch_ns, dtype):
    params = [taking_fp32_gradients(torch.nn.Parameter(p.to(dtype).to(device).clone())) for p in p0]  # never p0
    groups = [{"params": params[:-1]}, {"params": params[-1:], "ns_steps": 3}]
    return params, PackedMuon(groups, lr=0.03, batch_ns=batch_ns, ns_impl="cublas", check_nonfinite=True)


def step_and_compare(rng, runs, steps=3, bad_at=(1, 1)):
    """Steps each (params, optimizer) of `runs` on the same gradients; at step bad_at[0] the
    gradient of matrix bad_at[1] holds a NaN (its matrix is refused). All end equal bit for bit."""
    for step in range(steps):
        grads = [gradient(rng, tuple(p.shape)) for p in runs[0][0]]
        if step == bad_at[0]:
            grads[bad_at[1]][0, 0] = float("nan")
        for params, opt in runs:
            for p, g in zip(params, grads):
                p.grad = g.to(p.device)
            step_refusing(opt, bad_at[1]) if step == bad_at[0] else opt.step()
        (a, opt_a), *others = runs
        for b, opt_b in others:
            for p, q in zip(a, b):
                assert torch.equal(bits(p.cpu()), bits(q.cpu()))
                assert opt_a.state[p].keys() == opt_b.state[q].keys()
                for key, value in opt_a.state[p].items():
                    assert torch.equal(bits(value.cpu()), bits(opt_b.state[q][key].cpu()))


def p0_for_batch_ns(rng):
    return [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in BATCH_NS_SHAPES]


# The Newton-Schulz batches of a BATCH_NS_SHAPES step with batch_ns: (indices, ns_steps).
NS_BATCHES = (([0, 1, 2], 5), ([3, 4], 5), ([5], 5), ([6], 3))


def step_batch_ns_against_the_phases(opt, params, device, newton_schulz_batch, rng, ns_batches=NS_BATCHES):
    """Three steps of `opt` (the second with a NaN refusing matrix 1) against the numpy phases
    around `newton_schulz_batch` of `ns_batches` (PhasesReference.step)."""
    reference = PhasesReference(params, BATCH_NS_SHAPES)
    for step in range(3):
        grads = [gradient(rng, s) for s in BATCH_NS_SHAPES]
        if step == 1:
            grads[1][0, 0] = float("nan")
        for p, g in zip(params, grads):
            p.grad = g.to(device)
        step_refusing(opt, 1) if step == 1 else opt.step()
        reference.step(grads, ns_batches, newton_schulz_batch)
        reference.assert_equals(params, opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_ns_steps_as_the_core_phases_around_the_batched_newton_schulz(dtype, monkeypatch):
    """Also with the batch limit lowered to 120 elements: the three (6, 10)-wide matrices
    (60 elements each) run as two parts, [0, 1] and [2]; the (7, 7) pair stays whole."""
    for limit, ns_batches, want in ((None, NS_BATCHES, None),
                                    (120, (([0, 1], 5), ([2], 5), ([3, 4], 5), ([5], 5), ([6], 3)),
                                     [[(6, 10), (10, 6)], [(6, 10)], [(7, 7), (7, 7)], [(3, 5)], [(6, 10)]])):
        if limit is not None:
            monkeypatch.setattr(torch_muon_ns, "NS_BATCH_ELEMENTS", limit)
        batches = run_batch_ns_against_the_phases(dtype, monkeypatch, ns_batches)
        if want is not None:
            assert batches[:5] == want and batches[-5:] == want


def run_batch_ns_against_the_phases(dtype, monkeypatch, ns_batches):
    batches = []
    monkeypatch.setattr(torch_muon_ns, "newton_schulz_batched",
                        lambda xs, *a: batches.append([tuple(x.shape) for x in xs]) or newton_schulz_batched(xs, *a))
    rng = np.random.default_rng(22)
    params, opt = batch_ns_optimizer(p0_for_batch_ns(rng), "cpu", True, dtype)

    def accepted_only(xs, batch, steps):  # a lone matrix runs batched too
        return dict(zip(xs, newton_schulz_batched(list(xs.values()), steps=steps))) if xs else {}

    step_batch_ns_against_the_phases(opt, params, "cpu", accepted_only, rng, ns_batches)
    if ns_batches is NS_BATCHES:
        # Each step batches the three (6, 10)-wide matrices and the (7, 7) pair; the lone (3, 5) and
        # the ns_steps=3 group's matrix are batches of one. At the NaN step the refused (10, 6) is left out.
        full = [[(6, 10), (10, 6), (6, 10)], [(7, 7), (7, 7)], [(3, 5)], [(6, 10)]]
        assert batches == full + [[(6, 10), (6, 10)], [(7, 7), (7, 7)], [(3, 5)], [(6, 10)]] + full
    return batches


def test_split_batch_keeps_parts_under_the_limit():
    split = torch_muon_ns.split_batch
    assert split(list(range(24)), 2048 * 8192, 1 << 26) == [list(range(i, i + 4)) for i in range(0, 24, 4)]
    assert split(list(range(24)), 768 * 3072, 1 << 26) == [list(range(24))]  # d12's largest batch: whole
    assert split(list(range(10)), 100, 400) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split(list(range(3)), 1000, 400) == [[0], [1], [2]]  # over the limit: alone
    assert split([7], 0, 400) == [[7]]
    assert [len(part) for part in split(list(range(70000)), 4, 1 << 26)] == [35000, 35000]  # grid axis y
    assert torch_muon_ns.NS_BATCH_ELEMENTS == 1 << 26


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("combined", [False, True])
def test_cuda_defaults_take_the_batched_triton_step(combined, monkeypatch):
    """PackedMuon's and PackedMuonAdamW's defaults on CUDA: the table kernels (one launch per
    phase and batch) around the Triton Newton-Schulz, whose bits are the explicit setting's."""
    rng = np.random.default_rng(26)
    p0 = p0_for_batch_ns(rng)
    runs = []
    for options in (dict(), dict(ns_impl="triton", batch_ns=True)):
        params = [taking_fp32_gradients(torch.nn.Parameter(p.cuda().clone())) for p in p0]
        groups = [{"params": params[:-1]}, {"params": params[-1:], "ns_steps": 3}]
        if combined:
            groups = [{**g, "kind": "muon"} for g in groups]
        runs.append((params, (PackedMuonAdamW if combined else PackedMuon)(groups, lr=0.03, **options)))
    ns_calls = []
    real = torch_muon_ns.newton_schulz_triton_stacked
    monkeypatch.setattr(torch_muon_ns, "newton_schulz_triton_stacked", lambda *a: ns_calls.append(1) or real(*a))
    launches = count_launches(monkeypatch)
    step_and_compare(rng, runs, steps=2, bad_at=(-1, 0))
    # Two runs, two steps, four batches (BATCH_NS_SHAPES), the first of them holding a tall matrix
    # beside wide ones: five table launches a phase and step (tall and wide matrices launch
    # apart), four Newton-Schulz. A per-matrix step would launch the per-matrix kernels
    # (count_launches refuses a mix) and cuBLAS.
    assert launches == {"momentum": 20, "weight": 20, "table": True} and len(ns_calls) == 16


@pytest.mark.cuda
@cuda_only
def test_cuda_defaults_on_a_gpu_before_sm80_take_the_per_matrix_cublas_step(monkeypatch):
    """On a GPU of compute capability below 8.0 (made to look so here) the defaults step per
    matrix with torch's matmuls: the per-matrix kernels, no Triton Newton-Schulz, and the bits of
    ns_impl="cublas", batch_ns=False."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    monkeypatch.setattr(torch_muon_ns, "_TRITON_NS_DEVICES", {})
    rng = np.random.default_rng(27)
    p0 = p0_for_batch_ns(rng)
    runs = []
    for options in (dict(), dict(ns_impl="cublas", batch_ns=False)):
        params = [taking_fp32_gradients(torch.nn.Parameter(p.cuda().clone())) for p in p0]
        runs.append((params, PackedMuon(params, lr=0.03, **options)))
    monkeypatch.setattr(torch_muon_ns, "newton_schulz_triton_stacked", lambda *a: pytest.fail("Triton Newton-Schulz"))
    launches = count_launches(monkeypatch)
    step_and_compare(rng, runs, steps=2, bad_at=(-1, 0))
    per_phase = 2 * 2 * len(BATCH_NS_SHAPES)  # two runs, two steps, one launch a matrix
    assert launches == {"momentum": per_phase, "weight": per_phase, "table": False}


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_batch_ns_step_equals_the_cpu_phases_around_the_cuda_batched_newton_schulz(dtype):
    """The compiled table kernels (one launch per phase and batch) against the numpy phases
    around CUDA's `newton_schulz_batched` of the same batches. The refused matrix's X stays in
    its batch on CUDA (nothing waits for the GPU), so the reference batch keeps a zero matrix in
    its place: cuBLAS may choose its algorithm by the batch's size."""
    rng = np.random.default_rng(24)
    params, opt = batch_ns_optimizer(p0_for_batch_ns(rng), "cuda", True, dtype)

    def refused_kept_as_zeros(xs, batch, steps):
        inputs = [xs.get(i, torch.zeros(BATCH_NS_SHAPES[i], dtype=torch.bfloat16)).cuda() for i in batch]
        return {i: y for i, y in zip(batch, newton_schulz_batched(inputs, steps=steps)) if i in xs}

    step_batch_ns_against_the_phases(opt, params, "cuda", refused_kept_as_zeros, rng)


@pytest.mark.parametrize(("batch_ns", "limit"), [(False, None), (True, None), (True, 120)],
                         ids=["per_matrix", "batch_ns", "batch_ns_split"])
def test_kernel_step_equals_the_numpy_step(batch_ns, limit, is_interpreting, monkeypatch):
    """The CUDA step's code (both kernels around per-matrix or batched Newton-Schulz) against
    the numpy phases, on CPU tensors: the kernels in Triton's interpreter, Newton-Schulz on the
    CPU for both (on a GPU the CUDA tests compare the compiled step). With the batch limit at
    120 elements the three (6, 10)-wide matrices run as two parts: five batches a step."""
    if not is_interpreting:
        pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
    if limit is not None:
        monkeypatch.setattr(torch_muon_ns, "NS_BATCH_ELEMENTS", limit)
    rng = np.random.default_rng(23)
    p0 = p0_for_batch_ns(rng)
    numpy_run, kernel_run = (batch_ns_optimizer(p0, "cpu", batch_ns, torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: opt is kernel_run[1])
    launches = count_launches(monkeypatch)
    step_and_compare(rng, [numpy_run, kernel_run], steps=2, bad_at=(1, 4))
    # Per step: with batch_ns one launch of each phase per batch and orientation (four batches, five
    # split; the (6, 10) batch's tall matrix launches apart, as does the split's first part's; the
    # refused matrix's batch too), else one per matrix.
    per_phase = 2 * (6 if limit else 5) if batch_ns else 2 * len(BATCH_NS_SHAPES)
    assert launches == {"momentum": per_phase, "weight": per_phase, "table": batch_ns}


def test_batched_kernel_step_equals_the_per_matrix_kernel_step(is_interpreting, monkeypatch):
    """The table kernels' step against the per-matrix kernels' where both get the same
    Newton-Schulz bits: the per-matrix step's Newton-Schulz is the batched function on a batch
    of one (on the CPU a matrix's batched bits do not depend on its batch-mates; tested above)."""
    if not is_interpreting:
        pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
    rng = np.random.default_rng(25)
    p0 = p0_for_batch_ns(rng)
    per_matrix, batched = (batch_ns_optimizer(p0, "cpu", batch_ns, torch.float32) for batch_ns in (False, True))
    monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: True)
    monkeypatch.setattr(torch_muon_ns, "newton_schulz", lambda x, *settings: newton_schulz_batched([x], *settings)[0])
    step_and_compare(rng, [per_matrix, batched], steps=2, bad_at=(1, 1))


def count_launches(monkeypatch) -> dict:
    """Counts the launches of Muon's phase kernels (per-matrix or table) from here on."""
    from packed_adamw.core.muon import kernel

    launches = {"momentum": 0, "weight": 0, "table": None}

    class Counted:
        def __init__(self, kernel_fn, phase, table):
            self.kernel_fn, self.phase, self.table = kernel_fn, phase, table

        def __getitem__(self, grid):
            launches[self.phase] += 1
            assert launches["table"] in (None, self.table)  # one path per step
            launches["table"] = self.table
            return self.kernel_fn[grid]

    for name in ("muon_momentum_kernel", "muon_weight_kernel", "muon_momentum_table_kernel",
                 "muon_weight_table_kernel"):
        monkeypatch.setattr(kernel, name, Counted(getattr(kernel, name), name.split("_")[1], "table" in name))
    return launches


def test_batch_ns_is_a_checked_bool_or_none_that_a_pickle_keeps():
    with pytest.raises(TypeError, match="batch_ns must be None .*True or False"):
        PackedMuon([torch.nn.Parameter(torch.ones(2, 2))], batch_ns=1)
    assert PackedMuon([torch.nn.Parameter(torch.ones(2, 2))]).batch_ns is None
    opt = PackedMuon([torch.nn.Parameter(torch.ones(2, 2))], batch_ns=True)
    assert pickle.loads(pickle.dumps(opt)).batch_ns is True


@pytest.mark.parametrize(("options", "on_cuda", "on_cpu"), [
    ({}, ("triton", True), ("cublas", False)),  # the defaults: batched only where it changes no bit
    ({"ns_impl": "cublas"}, ("cublas", False), ("cublas", False)),
    ({"ns_impl": "cublas", "batch_ns": True}, ("cublas", True), ("cublas", True)),
    ({"batch_ns": False}, ("triton", False), ("cublas", False)),
    ({"ns_impl": "triton"}, ("triton", True), ("triton", True)),
    (None, ("cublas", False), ("cublas", False)),  # pickled before either option existed
])
def test_newton_schulz_defaults_resolve_per_device(options, on_cuda, on_cpu, monkeypatch):
    """ns_impl="auto" is the Triton kernels on CUDA devices of compute capability 8.0 or later
    (JAX's bits) and torch's matmuls elsewhere (the CPU, older GPUs, ROCm); batch_ns=None batches
    with the Triton kernels only, whose bits do not depend on the batch."""
    opt = PackedMuon([torch.nn.Parameter(torch.ones(2, 2))], **(options or {}))
    if options is None:
        del opt.ns_impl, opt.batch_ns
    capability = {0: (9, 0), 1: (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    monkeypatch.setattr(torch_muon_ns, "_TRITON_NS_DEVICES", {})
    auto_fallback = on_cpu if options in (None, {}, {"batch_ns": False}) else on_cuda
    for device, want in ((torch.device("cuda", 0), on_cuda), (torch.device("cpu"), on_cpu),
                         (torch.device("cuda", 1), auto_fallback)):
        assert (torch_muon_ns._ns_impl(opt, device), torch_muon_ns._batches_ns(opt, device)) == want, device
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch_muon_ns, "_TRITON_NS_DEVICES", {})
    assert torch_muon_ns._ns_impl(opt, torch.device("cuda", 0)) == auto_fallback[0]


# ---- scale invariance (issue 53) ----------------------------------------------------------------
# torch.optim.Muon's step is unchanged by a power-of-two scale of the gradients (power-of-two
# scaling commutes with rounding, and Newton-Schulz divides by the norm); packed mode's
# per-matrix exponent makes PackedMuon's so too: the same codes, the exponent shifted.
INVARIANCE_SCALES = (0, -12, 12, 20)
INVARIANCE_SHAPES = [(6, 10), (10, 6)]


def weights_after_scaled_steps(make_optimizer, device, dtype, scale, steps=6):
    """Each matrix's weight bits after `steps` steps on the same gradients times 2**scale."""
    rng = np.random.default_rng(61)
    params = [taking_fp32_gradients(torch.nn.Parameter(
        torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 0.3).to(dtype).to(device)))
        for s in INVARIANCE_SHAPES]
    opt = make_optimizer(params)
    for _ in range(steps):
        for p in params:
            p.grad = (gradient(rng, tuple(p.shape)) * 2.0 ** scale).to(device)
        opt.step()
    return [bits(p).cpu().clone() for p in params]


def assert_scale_invariant(make_optimizer, device="cpu", dtype=torch.float32) -> None:
    unscaled, *scaled = (weights_after_scaled_steps(make_optimizer, device, dtype, scale)
                         for scale in INVARIANCE_SCALES)
    for scale, weights in zip(INVARIANCE_SCALES[1:], scaled):
        for a, b in zip(unscaled, weights):
            assert torch.equal(a, b), f"gradients times 2**{scale}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["numpy", "kernels", "table-kernels"])
def test_weights_are_the_same_for_power_of_two_scaled_gradients_as_torch_optim_muons(dtype, path, is_interpreting,
                                                                                      monkeypatch):
    """The issue's acceptance test: weights after 6 steps bit for bit the same for gradients
    times 2**-12, 2**12 and 2**20 as unscaled, as torch.optim.Muon's are (the control); the
    numpy step and the CUDA step's kernels (per matrix and per batch, in Triton's interpreter),
    float32 and bf16 weights. With bias 31's fixed window 2**12 saturated the momenta."""
    if path != "numpy":
        if not is_interpreting:
            pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
        monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: True)
    if dtype is torch.float32 and path == "numpy":
        assert_scale_invariant(lambda params: torch.optim.Muon(params, lr=0.02))
    assert_scale_invariant(lambda params: PackedMuon(params, lr=0.02, ns_impl="cublas",
                                                     batch_ns=path == "table-kernels"), dtype=dtype)


def test_mu_bias_no_longer_moves_the_trajectory():
    """With the per-matrix exponent the codes are the same for every bias and the exponent
    shifts by it: two biases give the same weights and codes (mu_bias stays an option, for the
    API and the states saved under it)."""
    runs = {}
    for bias in (31, 40):
        def make(params, bias=bias):
            runs[bias] = PackedMuon(params, lr=0.02, mu_bias=bias)
            return runs[bias]
        runs[f"weights{bias}"] = weights_after_scaled_steps(make, "cpu", torch.float32, -30)
    assert all(torch.equal(a, b) for a, b in zip(runs["weights31"], runs["weights40"]))
    for p31, p40 in zip(*(runs[bias].param_groups[0]["params"] for bias in (31, 40))):
        s31, s40 = runs[31].state[p31], runs[40].state[p40]
        assert torch.equal(s31["momentum_code"], s40["momentum_code"]) and s40["mu_exponent"] == s31["mu_exponent"] + 9


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"ns_impl": "cublas", "batch_ns": False}], ids=["defaults", "cublas"])
def test_cuda_weights_are_the_same_for_power_of_two_scaled_gradients(dtype, options):
    """The acceptance test compiled on a GPU: the defaults (Triton Newton-Schulz, table kernels)
    and per-matrix cuBLAS, against torch.optim.Muon's own invariance on CUDA."""
    if dtype is torch.float32 and not options:
        assert_scale_invariant(lambda params: torch.optim.Muon(params, lr=0.02), "cuda")
    assert_scale_invariant(lambda params: PackedMuon(params, lr=0.02, **options), "cuda", dtype)


# ---- the state and the modes ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["packed", "bf16"])
def test_two_byte_modes_step_as_the_core_phases(mode):
    rng = np.random.default_rng(7)
    fmt = StateFormat(mode)
    p0 = rng.standard_normal((6, 10)).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = PackedMuon([param], lr=0.03, mode=mode, nesterov=False, maximize=True)
    weights, state, exponent = p0.copy(), np.zeros((6, 10), np.uint16), numpy_exponent(exponent_of(mode))
    scalars = step_scalar_row((0.03, 0.95, 0.1, 1e-7), (6, 10))
    for _ in range(3):
        g = gradient(rng, (6, 10))
        param.grad = g.clone()
        opt.step()
        x = momentum_phase(g.numpy(), state, scalars, fmt=fmt, exponent=exponent, nesterov=False, maximize=True)
        ortho = newton_schulz(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)).contiguous()
        weight_phase(weights, ortho.view(torch.int16).numpy(), scalars)
        stored = opt.state[param]["momentum_code"]
        assert stored.dtype == torch.int16 and stored.shape == param.shape
        assert np.array_equal(stored.numpy().view(np.uint16), state)
        if mode == "packed":  # one int32 exponent for the matrix
            stored_exponent = opt.state[param]["mu_exponent"]
            assert stored_exponent.dtype == torch.int32 and int(stored_exponent) == exponent
        else:
            assert "mu_exponent" not in opt.state[param]
        assert np.array_equal(param.detach().numpy().view(np.uint32), weights.view(np.uint32))


def test_maximize_is_a_step_on_the_negated_gradient():
    rng = np.random.default_rng(8)
    a, b = (torch.nn.Parameter(torch.ones(5, 7)) for _ in range(2))
    opt_a, opt_b = PackedMuon([a], lr=0.1, maximize=True), PackedMuon([b], lr=0.1)
    for _ in range(2):
        g = gradient(rng, (5, 7))
        a.grad, b.grad = g.clone(), -g
        opt_a.step()
        opt_b.step()
    assert torch.equal(bits(a), bits(b))
    assert torch.equal(opt_a.state[a]["momentum_code"], opt_b.state[b]["momentum_code"])


def test_bf16_parameters_keep_the_fp32_trajectory_in_their_masters():
    """Newton-Schulz reads only the gradients' momentum: a bf16 parameter's master follows an
    FP32 parameter's bits, and its weight is that master rounded."""
    rng = np.random.default_rng(9)
    p0 = torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32)).bfloat16().float()
    fp32, bf16 = torch.nn.Parameter(p0.clone()), taking_fp32_gradients(torch.nn.Parameter(p0.bfloat16()))
    opt_f, opt_b = PackedMuon([fp32], lr=0.05), PackedMuon([bf16], lr=0.05)
    for grad_dtype in (torch.float32, torch.bfloat16, torch.float32):
        g = gradient(rng, (8, 6)).to(grad_dtype).float()
        fp32.grad, bf16.grad = g.clone(), g.to(grad_dtype)
        opt_f.step()
        opt_b.step()
        (master,) = opt_b.master_weights()
        assert torch.equal(bits(master), bits(fp32))
        assert torch.equal(bits(bf16), bits(fp32.detach().to(torch.bfloat16)))
    assert opt_b.state[bf16]["lo"].dtype == torch.int16
    fresh = torch.nn.Parameter(torch.zeros(8, 6, dtype=torch.bfloat16))
    opt_fresh = PackedMuon([fresh])
    opt_fresh.load_master_weights([fp32.detach().clone()])
    assert torch.equal(bits(opt_fresh.master_weights()[0]), bits(fp32))


def test_a_non_finite_gradient_refuses_its_whole_matrix():
    rng = np.random.default_rng(10)
    bad, good = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4))
    opt = PackedMuon([bad, good], lr=0.1, check_nonfinite=True)
    bad.grad, good.grad = gradient(rng, (4, 4)), gradient(rng, (4, 4))
    opt.step()
    before, state_before = bad.detach().clone(), opt.state[bad]["momentum_code"].clone()
    good_before = good.detach().clone()
    bad.grad[1, 2] = float("nan")
    step_refusing(opt, 0)
    assert torch.equal(bits(bad), bits(before))
    assert torch.equal(opt.state[bad]["momentum_code"], state_before)
    assert not torch.equal(bits(good), bits(good_before))


def test_refusals_name_the_combined_optimizer_and_what_is_not_offered():
    with pytest.raises(ValueError, match="shape \\(5,\\).*PackedMuonAdamW.*kind='adamw'"):
        PackedMuon([torch.nn.Parameter(torch.ones(5))])
    with pytest.raises(ValueError, match="4, 2, 2.*2-D"):
        PackedMuon([torch.nn.Parameter(torch.ones(4, 2, 2))])
    with pytest.raises(TypeError, match="float16"):
        PackedMuon([torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float16))])
    with pytest.raises(ValueError, match="capturable"):
        PackedMuon([torch.nn.Parameter(torch.ones(2, 2))], capturable=True)
    with pytest.raises(ValueError, match="momentum should be below 1"):
        PackedMuon([torch.nn.Parameter(torch.ones(2, 2))], momentum=1.0)
    with pytest.raises(ValueError, match="param_groups\\[0\\].*ns_steps"):
        PackedMuon([{"params": [torch.nn.Parameter(torch.ones(2, 2))], "ns_steps": 0}])


def test_a_one_element_tensor_hyperparameter_of_any_shape_steps_as_its_number():
    # torch.optim.Muon takes one; the rule's validation must see the number, not a 1-tuple.
    rng = np.random.default_rng(5)
    w0, g = gradient(rng, (6, 4)), gradient(rng, (6, 4))
    params = [torch.nn.Parameter(w0.clone()) for _ in range(2)]
    opts = [PackedMuon([params[0]], lr=0.02, momentum=0.9),
            PackedMuon([params[1]], lr=torch.tensor([0.02]), momentum=torch.tensor([[0.9]]))]
    for p, opt in zip(params, opts):
        p.grad = g.clone()
        opt.step()
    assert torch.equal(bits(params[0]), bits(params[1]))
    with pytest.raises(ValueError, match="defaults: Invalid lr: a tensor lr must have one element, got shape \\(2,\\)"):
        PackedMuon([torch.nn.Parameter(w0.clone())], lr=torch.tensor([0.02, 0.01]))


def test_step_takes_a_closure():
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = PackedMuon([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 12.0
    assert not torch.equal(p.detach(), torch.ones(3, 4))


# ---- saving and loading ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_for_bit(dtype):
    rng = np.random.default_rng(11)
    params = [torch.nn.Parameter(torch.randn(6, 4).to(dtype)) for _ in range(2)]
    opt = PackedMuon(params, lr=0.05, mu_bias=33)
    grads = [[gradient(rng, (6, 4)).to(dtype) for _ in params] for _ in range(4)]
    for step in range(2):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["packed_adamw"]["format"] == "muon-packed:mu=SE5M10b33:scale=pow2/matrix"
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = PackedMuon(twins, lr=0.05, mu_bias=33)
    other.load_state_dict(saved)
    for a, b in zip(params, twins):
        for key, value in opt.state[a].items():
            assert other.state[b][key].dtype == value.dtype and torch.equal(other.state[b][key], value)
    for step in range(2, 4):
        for p, q, g in zip(params, twins, grads[step]):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        other.step()
        for a, b in zip(params, twins):
            assert torch.equal(bits(a), bits(b))


def test_a_foreign_identity_is_refused_before_anything_changes():
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = PackedMuon([p], mu_bias=31)
    p.grad = torch.full((4, 3), 0.25)
    opt.step()
    before = opt.state[p]["momentum_code"].clone()
    for foreign, message in ((PackedMuon([torch.nn.Parameter(torch.ones(4, 3))], mu_bias=36), "SE5M10b36"),
                             (PackedMuon([torch.nn.Parameter(torch.ones(4, 3))], mode="bf16"), "muon-bf16"),
                             (PackedAdamW([torch.nn.Parameter(torch.ones(4, 3))]), "packed:m=")):
        foreign.param_groups[0]["params"][0].grad = torch.ones(4, 3)
        foreign.step()
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(foreign.state_dict())
        assert torch.equal(opt.state[p]["momentum_code"], before) and opt.param_groups[0]["lr"] == 1e-3
    torchs = torch.optim.Muon([torch.nn.Parameter(torch.ones(4, 3))], lr=0.5)
    with pytest.raises(ValueError, match="not saved by PackedMuon"):
        opt.load_state_dict(torchs.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3


def as_saved_before_the_exponents(state_dict: dict) -> dict:
    """A packed state_dict as PackedMuon (or PackedMuonAdamW) saved it before the per-matrix
    exponents: the identity without them, the codes alone."""
    old = copy.deepcopy(state_dict)
    fmt = StateFormat()
    legacy = lambda identity: fmt.legacy_identity if identity == fmt.identity else identity  # noqa: E731
    meta = old["packed_adamw"]
    meta["format"] = {k: legacy(v) for k, v in meta["format"].items()} if isinstance(meta["format"], dict) \
        else legacy(meta["format"])
    for group in old["param_groups"]:
        group["packed_adamw_format"] = legacy(group["packed_adamw_format"])
    for entry in old["state"].values():
        entry.pop("mu_exponent", None)
    return old


@pytest.mark.parametrize("combined", [False, True])
def test_a_packed_state_saved_before_the_exponents_loads_exactly_with_exponent_zero(combined):
    """A state of the fixed-window format (identity "muon-packed:mu=SE5M10b31", codes, no
    exponents) loads into today's optimizer: exponent 0, the codes as saved, so each momentum
    is the value it had; the next step is the numpy phases' from those codes at exponent 0.
    An old pickle likewise. A state of today's identity without its exponent is refused."""
    rng = np.random.default_rng(62)
    shape = (6, 10)
    codes = torch.from_numpy(StateFormat().code.encode(
        (rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 0, shape)).astype(np.float32)).view(np.int16))
    make = (lambda ps: PackedMuonAdamW([{"params": ps, "kind": "muon"}], lr=0.02)) if combined else \
        (lambda ps: PackedMuon(ps, lr=0.02))
    p0 = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    source = torch.nn.Parameter(p0.clone())
    saver = make([source])
    source.grad = torch.zeros(shape)
    saver.step()  # makes the state; then its codes are replaced by the old run's
    saver.state[source]["momentum_code"].copy_(codes)
    old = as_saved_before_the_exponents(saver.state_dict())
    assert "mu_exponent" not in old["state"][0]
    twin = torch.nn.Parameter(p0.clone())
    opt = make([twin])
    opt.load_state_dict(old)
    state = opt.state[twin]
    assert torch.equal(state["momentum_code"], codes) and state["mu_exponent"].dtype == torch.int32
    assert state["mu_exponent"].dim() == 0 and int(state["mu_exponent"]) == 0
    g = gradient(rng, shape)
    twin.grad = g.clone()
    opt.step()
    weights, reference, exponent = p0.numpy().copy(), codes.numpy().copy(), np.zeros((), np.int32)
    scalars = step_scalar_row((0.02, 0.95, 0.1, 1e-7), shape)
    x = momentum_phase(g.numpy(), reference, scalars, fmt=StateFormat(), exponent=exponent)
    weight_phase(weights, newton_schulz(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)).contiguous()
                 .view(torch.int16).numpy(), scalars)
    assert np.array_equal(bits(twin).numpy(), weights.view(np.int32))
    assert np.array_equal(state["momentum_code"].numpy(), reference.view(np.int16)) and state["mu_exponent"] == exponent
    # An optimizer pickled before the exponents: its codes, exponent 0.
    source.grad = torch.zeros(shape)
    saver.step()
    saver.state[source]["momentum_code"].copy_(codes)
    del saver.state[source]["mu_exponent"]
    unpickled = pickle.loads(pickle.dumps(saver))
    p = unpickled.param_groups[0]["params"][0]
    assert torch.equal(unpickled.state[p]["momentum_code"], codes) and int(unpickled.state[p]["mu_exponent"]) == 0
    p.grad = g.clone()
    unpickled.step()
    assert torch.equal(unpickled.state[p]["momentum_code"], state["momentum_code"])
    # Today's identity without the exponent, or the old one with one, is damaged: refused, naming it.
    damaged = copy.deepcopy(opt.state_dict())
    del damaged["state"][0]["mu_exponent"]
    with pytest.raises(ValueError, match="'mu_exponent' must be a 0-d torch.int32 tensor"):
        opt.load_state_dict(damaged)
    damaged = as_saved_before_the_exponents(opt.state_dict())
    damaged["state"][0]["mu_exponent"] = torch.tensor(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="keeps no 'mu_exponent', yet it holds one"):
        opt.load_state_dict(damaged)


@pytest.mark.parametrize("exponent, message", [
    (torch.tensor(129, dtype=torch.int32), r"'mu_exponent' is 129, outside the \[-148, 128\]"),
    (torch.tensor(-300, dtype=torch.int32), r"^load_state_dict: state of saved parameter 0 \(for .*\): 'mu_exponent' "
                                            r"is -300, outside the \[-148, 128\] a step stores with mu_bias 31"),
    (torch.tensor(3.0), "'mu_exponent' must be a 0-d torch.int32 tensor"),
    (torch.tensor([3], dtype=torch.int32), "'mu_exponent' must be a 0-d torch.int32 tensor"),
    (torch.tensor(128, dtype=torch.int32), "the momentum holds NaN or Inf")])
def test_a_damaged_exponent_is_refused_on_load_before_anything_changes(exponent, message):
    """An exponent a step never stores (outside the range, or one under which the largest code
    decodes past float32's range) or of another layout refuses the load, naming the entry."""
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = PackedMuon([p])
    p.grad = torch.full((4, 3), 0.25)
    opt.step()
    before = [v.clone() for v in opt.state[p].values()]
    damaged = copy.deepcopy(opt.state_dict())
    damaged["state"][0]["momentum_code"] = torch.full((4, 3), 0x7C00, dtype=torch.int16)  # 1.0: times 2**128, Inf
    damaged["state"][0]["mu_exponent"] = exponent
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(damaged)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.state[p].values()))


# ---- the kernels, interpreted on CPU tensors ------------------------------------------------------
def run_kernels(fmt, grad, state, exponent, weights, low, scalars, *, nesterov, maximize):
    """Both phase kernels around our Newton-Schulz, in place on `state`, `exponent` (packed
    mode; None otherwise), `weights` and `low`, on their device: CPU tensors run in the Triton
    interpreter, CUDA ones compiled. Returns X, the Newton-Schulz result and the counters row."""
    from packed_adamw.core.muon.kernel import MATRIX_COUNTERS, muon_momentum_kernel, muon_weight_kernel

    c = fmt.kernel_constexprs(track_format=False)
    n, block = grad.numel(), 64  # several programs per matrix
    grid = launch.grid(n, block)
    counters = torch.zeros(MATRIX_COUNTERS, dtype=torch.int32, device=grad.device)
    x = torch.empty(grad.shape, dtype=torch.int16, device=grad.device)
    scalar_row = torch.tensor(np.array(scalars, np.float32), device=grad.device)
    grad_bf16 = grad.dtype is torch.bfloat16
    grad_bits = grad.view(torch.int16) if grad_bf16 else grad
    exponent = counters if exponent is None else exponent  # unread outside packed mode
    muon_momentum_kernel[grid](grad_bits, state, exponent, x, scalar_row, counters, n, **c, NESTEROV=nesterov,
                               MAXIMIZE=maximize, GRAD_BF16=grad_bf16, BLOCK=block, **launch.COMPILE_OPTIONS)
    ortho = newton_schulz(x.view(torch.bfloat16)).contiguous().view(torch.int16)
    split = weights.dtype is torch.int16
    muon_weight_kernel[grid](weights, low if split else weights, ortho, grad_bits, state, exponent, scalar_row,
                             counters, n, **c, MAXIMIZE=maximize, GRAD_BF16=grad_bf16, SPLIT=split, BLOCK=block,
                             **launch.COMPILE_OPTIONS)
    return x, ortho, counters


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
@pytest.mark.parametrize("nesterov, maximize, split", [(True, False, False), (False, True, True),
                                                       (True, True, True), (False, False, False)])
def test_kernels_equal_the_numpy_phases(mode, nesterov, maximize, split, device):
    """Packed mode from an exponent that puts the decoded momenta far below the gradients'
    scale (the new exponent comes from the new largest |m'|), the exponent too."""
    rng = np.random.default_rng(12)
    fmt, shape = StateFormat(mode, 33), (9, 17)
    scalars = step_scalar_row((0.02, 0.9, 0.1, 1e-7), shape, adjust_lr_fn="match_rms_adamw")
    grad = gradient(rng, shape, -40, 1)
    if split:
        grad = grad.bfloat16()
    state, exponent = random_state(rng, mode, shape), exponent_of(mode, -29)
    weights, low = random_weights(rng, shape, split)
    ref_state, ref_w, ref_exponent = state.numpy().copy(), weights.numpy().copy(), numpy_exponent(exponent)
    ref_low = None if low is None else low.numpy().copy()
    grad_np = grad.view(torch.int16).numpy() if split else grad.numpy()
    x_ref = momentum_phase(grad_np, ref_state, scalars, fmt=fmt, exponent=ref_exponent, nesterov=nesterov,
                           maximize=maximize)
    on_device = [None if t is None else t.to(device) for t in (grad, state, exponent, weights, low)]
    x, ortho, counters = run_kernels(fmt, *on_device, scalars, nesterov=nesterov, maximize=maximize)
    state, exponent, weights, low = (None if t is None else t.cpu() for t in on_device[1:])
    assert x_ref is not None and int(counters[0]) == 0
    assert np.array_equal(x.cpu().numpy().view(np.uint16), x_ref)
    ortho = ortho.cpu().numpy()
    rejected = weight_phase_split(ref_w, ref_low, ortho, scalars) if split else weight_phase(ref_w, ortho, scalars)
    assert int(counters[1]) == rejected
    assert np.array_equal(state.numpy().view(np.uint8), ref_state.view(np.uint8))
    if mode == "packed":
        assert int(exponent) == int(ref_exponent) != -29
    assert np.array_equal(weights.numpy().view(np.uint8), ref_w.view(np.uint8))
    if split:
        assert np.array_equal(low.numpy(), ref_low)


@pytest.mark.parametrize("grad_scale, old_exponent, new_exponents", [
    (-140, -148, (-148, -126)), (-60, -148, (-70, -50)), (100, 90, (90, 110)), (0, 128, (120, 128))],
    ids=["subnormal-amax", "subnormal-momenta", "large", "top-exponent"])
def test_kernels_take_the_exponent_as_the_numpy_phase_at_float32s_edges(grad_scale, old_exponent, new_exponents,
                                                                       device):
    """The exponent's edges in the kernels: a subnormal largest |m'| (the exponent from its
    highest set bit), stored codes whose values at the old exponent are subnormal float32s (the
    second product of ldexp32 rounds), large momenta, and the largest exponent a step stores
    (bias 31: 128); codes and exponents as the numpy phase's, two steps."""
    rng = np.random.default_rng(17)
    fmt, shape = StateFormat("packed"), (5, 13)
    scalars = step_scalar_row((0.02, 0.9, 0.1, 1e-7), shape)
    state = torch.from_numpy(rng.integers(0, 2**15, shape).astype(np.int16) & 0x7BFF)  # below 2**(31 - 31)
    exponent = exponent_of("packed", old_exponent)
    weights, _ = random_weights(rng, shape, False)
    ref_state, ref_exponent = state.numpy().copy(), numpy_exponent(exponent)
    on_device = [t.to(device) for t in (state, exponent, weights)]
    for _ in range(2):
        grad = gradient(rng, shape, -8, 0) * 2.0 ** grad_scale
        x_ref = momentum_phase(grad.numpy(), ref_state, scalars, fmt=fmt, exponent=ref_exponent)
        x, _, counters = run_kernels(fmt, grad.to(device), *on_device, None, scalars, nesterov=True, maximize=False)
        assert x_ref is not None and int(counters[0]) == 0
        assert np.array_equal(x.cpu().numpy().view(np.uint16), x_ref)
        assert np.array_equal(on_device[0].cpu().numpy(), ref_state.view(np.int16))
        assert int(on_device[1]) == int(ref_exponent) and new_exponents[0] <= int(ref_exponent) <= new_exponents[1]


def test_kernels_refuse_a_matrix_with_a_non_finite_gradient(device):
    rng = np.random.default_rng(13)
    fmt, shape = StateFormat("packed"), (5, 6)
    grad = gradient(rng, shape)
    grad[4, 5] = float("inf")
    grad = grad.to(device)
    state = torch.from_numpy(rng.integers(0, 2**15, shape).astype(np.int16)).to(device)
    exponent = exponent_of("packed", 7).to(device)
    weights = gradient(rng, shape).to(device)
    state_before, weights_before = state.clone(), weights.clone()
    _, _, counters = run_kernels(fmt, grad, state, exponent, weights, None,
                                 step_scalar_row((0.1, 0.9, 0.1, 1e-7), shape), nesterov=True, maximize=False)
    assert int(counters[0]) > 0 and int(exponent) == 7
    assert torch.equal(state, state_before) and torch.equal(bits(weights), bits(weights_before))


# A batch for the table kernels: the tall matrix first (as newton_schulz_batched stacks it), each
# matrix's counters and scalar row at an index other than its slot.
TABLE_SHAPES, TABLE_INDICES = [(20, 12), (12, 20), (12, 20)], [2, 0, 1]


def run_table_kernels(fmt, grads, states, exponents, weights, lows, scalar_rows, *, nesterov, maximize):
    """Both table kernels around the batched Newton-Schulz of their [B, m, n] buffer, one launch
    each per orientation (the tall matrices' tiles, TALL, apart from the wide ones'), as
    `_cuda_step_batched` launches them; in place on `states`, `exponents`, `weights` and `lows`.
    Returns the X and result buffers and the [n, MATRIX_COUNTERS] counters."""
    from packed_adamw.core.muon.kernel import (MATRIX_COUNTERS, matrix_programs, muon_momentum_table_kernel,
                                               muon_weight_table_kernel, tall_tile)

    c, device = fmt.kernel_constexprs(track_format=False), grads[0].device
    rows, cols = sorted(grads[0].shape)
    block, tile, n = 64, tall_tile(), len(TABLE_INDICES)  # several programs (or tiles) per matrix
    split = weights[0].dtype is torch.int16
    grad_bf16 = grads[0].dtype is torch.bfloat16
    scalars = torch.tensor(np.array(scalar_rows, np.float32), device=device)
    counters = torch.zeros((n, MATRIX_COUNTERS), dtype=torch.int32, device=device)
    x = torch.empty((n, rows, cols), dtype=torch.int16, device=device)
    launches = {}
    for slot, (g, s, e, w, lo, i) in enumerate(zip(grads, states, exponents, weights, lows, TABLE_INDICES)):
        e = (s if e is None else e).data_ptr()
        momentum_rows, weight_rows = launches.setdefault(g.size(0) > g.size(1), ([], []))
        momentum_rows.append([g.data_ptr(), s.data_ptr(), e, i, slot])
        weight_rows.append([w.data_ptr(), (lo if split else w).data_ptr(), g.data_ptr(), s.data_ptr(), e, i, slot])
    tables = {tall: [torch.tensor(t, device=device) for t in both] for tall, both in launches.items()}
    for tall, (momentum_table, _) in tables.items():
        muon_momentum_table_kernel[(matrix_programs(rows, cols, tall, block, tile), len(momentum_table))](
            momentum_table, x, scalars, counters, rows, cols, **c, NESTEROV=nesterov, MAXIMIZE=maximize,
            GRAD_BF16=grad_bf16, TALL=tall, BLOCK=block, TILE=tile, **launch.COMPILE_OPTIONS)
    ortho = torch_muon_ns.newton_schulz_stacked(x.view(torch.bfloat16)).view(torch.int16)
    for tall, (_, weight_table) in tables.items():
        muon_weight_table_kernel[(matrix_programs(rows, cols, tall, block, tile), len(weight_table))](
            weight_table, ortho, scalars, counters, rows, cols, **c, MAXIMIZE=maximize, GRAD_BF16=grad_bf16,
            SPLIT=split, TALL=tall, BLOCK=block, TILE=tile, **launch.COMPILE_OPTIONS)
    return x, ortho, counters


@pytest.mark.parametrize("mode", ["packed", "bf16", "fp32"])
@pytest.mark.parametrize("nesterov, maximize, split", [(True, False, False), (False, True, True),
                                                       (True, True, True), (False, False, False)])
def test_table_kernels_equal_the_numpy_phases(mode, nesterov, maximize, split, device):
    """One launch per phase for a batch, a tall matrix's X and result in its slot transposed, and
    a refused matrix (slot 1) that keeps everything while its batch-mates step; each matrix's
    exponent its own."""
    rng = np.random.default_rng(16)
    fmt = StateFormat(mode, 33)
    scalar_rows = [None] * len(TABLE_SHAPES)
    for lr, shape, i in zip((0.02, 0.03, 0.05), TABLE_SHAPES, TABLE_INDICES):
        scalar_rows[i] = step_scalar_row((lr, 0.9, 0.1, 1e-7), shape, adjust_lr_fn="match_rms_adamw")
    grads, states, exponents, weights, lows = [], [], [], [], []
    for slot, shape in enumerate(TABLE_SHAPES):
        grad = gradient(rng, shape, -40, 1 + 9 * slot)
        if slot == 1:
            grad[3, 7] = float("nan")
        grads.append(grad.bfloat16() if split else grad)
        states.append(random_state(rng, mode, shape))
        exponents.append(exponent_of(mode, 5 * slot - 3))
        w, low = random_weights(rng, shape, split)
        weights.append(w)
        lows.append(low)
    refs = [(s.numpy().copy(), numpy_exponent(e), w.numpy().copy(), None if lo is None else lo.numpy().copy())
            for s, e, w, lo in zip(states, exponents, weights, lows)]
    on_device = [[None if t is None else t.to(device) for t in ts] for ts in (grads, states, exponents, weights, lows)]
    x, ortho, counters = run_table_kernels(fmt, *on_device, scalar_rows, nesterov=nesterov, maximize=maximize)
    x, ortho, counters = x.cpu().numpy(), ortho.cpu().numpy(), counters.cpu().numpy()
    for slot, (grad, (ref_state, ref_exponent, ref_w, ref_low), i) in enumerate(zip(grads, refs, TABLE_INDICES)):
        state, w = on_device[1][slot].cpu().numpy(), on_device[3][slot].cpu().numpy()
        grad_np = grad.view(torch.int16).numpy() if split else grad.numpy()
        x_ref = momentum_phase(grad_np, ref_state, scalar_rows[i], fmt=fmt, exponent=ref_exponent, nesterov=nesterov,
                               maximize=maximize)
        tall = grad.size(0) > grad.size(1)
        if slot == 1:
            assert x_ref is None and counters[i, 0] > 0 and counters[i, 1] == 0
        else:
            assert x_ref is not None and counters[i, 0] == 0
            assert np.array_equal((x[slot].T if tall else x[slot]).view(np.uint16), x_ref)
            result = np.ascontiguousarray(ortho[slot].T if tall else ortho[slot])
            rejected = (weight_phase_split(ref_w, ref_low, result, scalar_rows[i]) if split
                        else weight_phase(ref_w, result, scalar_rows[i]))
            assert counters[i, 1] == rejected
        assert np.array_equal(state.view(np.uint8), ref_state.view(np.uint8))
        if mode == "packed":
            assert int(on_device[2][slot].cpu()) == int(ref_exponent)
        assert np.array_equal(w.view(np.uint8), ref_w.view(np.uint8))
        if split:
            assert np.array_equal(on_device[4][slot].cpu().numpy(), ref_low)


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_the_refusal_kernel_refuses_only_the_matrix_whose_output_is_not_finite(bad, device):
    """`muon_refuse_nonfinite_table_kernel` over several blocks a matrix (the step's launches use
    one block a matrix in the interpreter): a non-finite value only in the last, partial block of
    one slot refuses that matrix (its counters row, at an index other than its slot) and no
    batch-mate; a finite O refuses nothing."""
    from packed_adamw.core.muon.kernel import MATRIX_COUNTERS, muon_refuse_nonfinite_table_kernel

    rows, cols, block = 5, 13, 16  # 65 elements: five blocks, the last of one element
    ortho = torch.randn((3, rows, cols)).bfloat16().to(device)
    table = torch.tensor([[0, 0, 0, 4, 0], [0, 0, 0, 1, 1], [0, 0, 0, 2, 2]], device=device)
    counters = torch.zeros((5, MATRIX_COUNTERS), dtype=torch.int32, device=device)
    grid = (launch.grid(rows * cols, block)[0], len(table))
    muon_refuse_nonfinite_table_kernel[grid](table, ortho.view(torch.int16), counters, rows, cols, BLOCK=block)
    assert counters[:, 0].tolist() == [0] * 5
    ortho[2, -1, -1] = float(bad)
    muon_refuse_nonfinite_table_kernel[grid](table, ortho.view(torch.int16), counters, rows, cols, BLOCK=block)
    assert counters[:, 0].tolist() == [0, 0, 1, 0, 0] and not counters[:, 1:].any()


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("shape", SHAPES + [(96, 200)])
def test_cuda_fp32_mode_equals_torch_optim_muon_on_cuda(shape):
    """On CUDA the phases are our kernels; torch's CUDA lerp and add(alpha=) fuse as the
    contract (docs/MUON.md) and both run torch's bf16 GEMMs for Newton-Schulz on the device."""
    rng = np.random.default_rng(14)
    theirs, ours, opt_t, opt_o = torch_muon_pair(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)),
                                                 device="cuda", lr=0.02)
    for _ in range(3):
        g = gradient(rng, shape).cuda()
        theirs.grad, ours.grad = g.clone(), g.clone()
        opt_t.step()
        opt_o.step()
        assert torch.equal(bits(opt_t.state[theirs]["momentum_buffer"]), bits(opt_o.state[ours]["momentum_buffer"]))
        assert torch.equal(bits(theirs), bits(ours))


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("mode", ["packed", "bf16"])
@pytest.mark.parametrize("ns_impl", ["auto", "cublas"])
def test_cuda_step_equals_the_cpu_phases_around_the_cuda_newton_schulz(mode, ns_impl):
    """The default (ns_impl="auto": the Triton kernels on CUDA) and torch's matmuls."""
    rng = np.random.default_rng(15)
    shape, fmt = (40, 24), StateFormat(mode)
    param = taking_fp32_gradients(
        torch.nn.Parameter(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda().bfloat16()))
    opt = PackedMuon([param], lr=0.02, mode=mode, check_nonfinite=True, ns_impl=ns_impl)
    ns = newton_schulz_triton if ns_impl == "auto" else newton_schulz
    state, exponent = np.zeros(shape, np.uint16), numpy_exponent(exponent_of(mode))
    scalars = step_scalar_row((0.02, 0.95, 0.1, 1e-7), shape)
    weights = param.detach().cpu().view(torch.int16).numpy().copy()
    low = np.zeros(shape, np.int16)
    for _ in range(3):
        g = gradient(rng, shape)
        param.grad = g.cuda()
        opt.step()
        x = momentum_phase(g.numpy(), state, scalars, fmt=fmt, exponent=exponent)
        ortho = ns(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()).contiguous()
        weight_phase_split(weights, low, ortho.view(torch.int16).cpu().numpy(), scalars)
        assert np.array_equal(opt.state[param]["momentum_code"].cpu().numpy().view(np.uint16), state)
        if mode == "packed":
            assert int(opt.state[param]["mu_exponent"]) == int(exponent)
        assert np.array_equal(param.detach().cpu().view(torch.int16).numpy(), weights)
        assert np.array_equal(opt.state[param]["lo"].cpu().numpy(), low)


# ---- the combined optimizer -------------------------------------------------------------------
MUON_OPTIONS, ADAMW_OPTIONS = dict(lr=0.02, momentum=0.9), dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.0)


def test_muon_param_groups_split_blocks_from_embeddings_head_and_vectors():
    groups = muon_param_groups(TinyModel(), exclude=("head",), muon=dict(lr=0.02))
    assert [(g["kind"], g["param_names"]) for g in groups] == [
        ("muon", ["up.weight", "down.weight"]),
        ("adamw", ["embed.weight", "up.bias", "norm.weight", "norm.bias", "head.weight"])]
    assert groups[0]["lr"] == 0.02 and "lr" not in groups[1]


def combined_and_separate(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = TinyModel().to(dtype)
    twin = copy.deepcopy(model)
    combined = PackedMuonAdamW(muon_param_groups(model, exclude=("head",), muon=MUON_OPTIONS, adamw=ADAMW_OPTIONS))
    muon_group, adamw_group = muon_param_groups(twin, exclude=("head",))
    separate = [PackedMuon(muon_group["params"], **MUON_OPTIONS), PackedAdamW(adamw_group["params"], **ADAMW_OPTIONS)]
    return model, twin, combined, separate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combined_equals_the_two_optimizers_stepped_separately_under_one_scheduler(dtype):
    rng = np.random.default_rng(16)
    model, twin, combined, separate = combined_and_separate(dtype=dtype)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t)) for o in [combined, *separate]]
    for _ in range(3):
        set_gradients(rng, model, twin)
        combined.step()
        for opt in separate:
            opt.step()
        for s in schedulers:
            s.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(bits(a), bits(b))
    assert combined.param_groups[0]["lr"] == MUON_OPTIONS["lr"] / 4


def test_combined_state_dict_round_trip_and_identity_checks():
    rng = np.random.default_rng(17)
    model, twin, combined, _ = combined_and_separate()
    for _ in range(2):
        set_gradients(rng, model)
        combined.step()
    saved = copy.deepcopy(combined.state_dict())
    assert saved["packed_adamw"]["format"] == {"muon": "muon-packed:mu=SE5M10b31:scale=pow2/matrix",
                                               "adamw": combined.rules["adamw"].state_format.identity}
    twin.load_state_dict(model.state_dict())
    other = PackedMuonAdamW(muon_param_groups(twin, exclude=("head",), muon=MUON_OPTIONS, adamw=ADAMW_OPTIONS))
    other.load_state_dict(copy.deepcopy(saved))
    for a, b in zip(model.parameters(), twin.parameters()):
        for key, value in combined.state[a].items():
            loaded = other.state[b][key]
            assert (loaded.dtype == value.dtype and torch.equal(loaded, value)) if torch.is_tensor(value) \
                else loaded == value
    for _ in range(2):
        set_gradients(rng, model, twin)
        combined.step()
        other.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(bits(a), bits(b))
    bf16_momentum = PackedMuonAdamW(muon_param_groups(twin, exclude=("head",)), mode="bf16")
    with pytest.raises(ValueError, match="muon-bf16"):
        bf16_momentum.load_state_dict(copy.deepcopy(saved))
    assert not bf16_momentum.state


def test_combined_refuses_groups_without_a_rule_or_shared_between_rules():
    model = TinyModel()
    with pytest.raises(ValueError, match="kind='muon' or kind='adamw'"):
        PackedMuonAdamW([{"params": [model.up.weight]}])
    with pytest.raises(ValueError, match="belongs to one rule"):
        PackedMuonAdamW([{"params": [model.up.weight], "kind": "muon"},
                         {"params": [model.up.weight], "kind": "adamw"}])
    with pytest.raises(ValueError, match="PackedMuonAdamW"):
        PackedMuonAdamW([{"params": [model.up.bias], "kind": "muon"}])
    # a set's order is not the model's: the state_dict saves parameters by position (torch.optim refuses it too)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\] is a set: .*pass a list"):
        PackedMuonAdamW([{"params": {model.up.weight, model.down.weight}, "kind": "muon"}])
    # the AdamW groups' defaults are checked when built, as Muon's are, before any AdamW group comes
    for bad in (dict(adamw_lr=-1.0), dict(adamw_betas=(1.0, 0.9)), dict(adamw_eps=float("nan")),
                dict(adamw_mode="fp8")):
        with pytest.raises(ValueError, match="^PackedMuonAdamW: the AdamW groups' defaults .* refused: "):
            PackedMuonAdamW([{"params": [model.up.weight], "kind": "muon"}], **bad)


def test_bad_gradients_are_refused_naming_the_parameter_and_nothing_steps():
    a, b = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(3, 4))
    opt = PackedMuon([{"params": [a, b], "param_names": ["a", "b"]}], lr=0.1)
    if hasattr(b, "grad_dtype"):
        b.grad_dtype = None  # let torch assign a float64 gradient
    a.grad = torch.ones(3, 4)
    b.grad = torch.ones(3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="'b': gradient dtype torch.float64"):
        opt.step()
    b.grad = torch.ones(4, 3).T
    with pytest.raises(ValueError, match="'b': gradient is not contiguous"):
        opt.step()
    b.grad = torch.ones(3, 4).to_sparse()
    with pytest.raises(RuntimeError, match="'b' has a sparse gradient: PackedMuon"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(3, 4)) and not opt.state


@pytest.mark.parametrize("bad, words", [("up.weight", "'up.weight' \\(refused whole\\)"),
                                        ("head.weight", "'head.weight' \\(1 of 66 elements\\)")])
def test_combined_check_nonfinite_steps_both_rules_before_raising(bad, words):
    """The step's errors name PackedMuonAdamW, the optimizer the user built and steps, not the
    rule class stepping the parameter (Muon's matrix, the AdamW head)."""
    rng = np.random.default_rng(18)
    model = TinyModel()
    opt = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)), check_nonfinite=True)
    model, opt = pickle.loads(pickle.dumps((model, opt)))  # an unpickled optimizer's rules say so too
    set_gradients(rng, model)
    model.get_parameter(bad).grad[0, 0] = float("nan")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(NonFiniteGradientError, match=f"^PackedMuonAdamW.step: non-finite values .*{words}"):
        opt.step()
    changed = {name for name, p in model.named_parameters() if not torch.equal(bits(p), bits(before[name]))}
    assert changed == set(before) - ({bad} & {"up.weight"})  # a Muon matrix is refused whole, an AdamW element alone
    assert bits(model.get_parameter(bad))[0, 0] == bits(before[bad])[0, 0]
    model.get_parameter(bad).grad = model.get_parameter(bad).grad.to_sparse()
    with pytest.raises(RuntimeError, match=f"'{bad}' has a sparse gradient: PackedMuonAdamW does not"):
        opt.step()


@fused_torch
def test_groups_with_their_own_settings_equal_torch_optim_muon():
    rng = np.random.default_rng(19)
    shapes = [(6, 4), (4, 9), (5, 5)]
    settings = [dict(lr=0.03, weight_decay=0.0, nesterov=False), dict(lr=0.01, adjust_lr_fn="match_rms_adamw"),
                dict(momentum=0.8, ns_steps=3, eps=1e-3)]
    theirs = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s).astype(np.float32))) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt_t = torch.optim.Muon([{"params": [p], **kw} for p, kw in zip(theirs, settings)], lr=0.02)
    opt_o = PackedMuon([{"params": [p], **kw} for p, kw in zip(ours, settings)], lr=0.02, mode="fp32")
    for _ in range(3):
        for p, q in zip(theirs, ours):
            p.grad = gradient(rng, tuple(p.shape))
            q.grad = p.grad.clone()
        opt_t.step()
        opt_o.step()
        for p, q in zip(theirs, ours):
            assert torch.equal(bits(p), bits(q))


def test_dtensor_parameters_that_no_rank_holds_a_part_of_are_refused():
    """Sharded and replicated DTensors are stepped (tests/torch_frontend/test_muon_distributed.py); a Partial one
    says no rank's part of the matrix: refused (one fake rank of two)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        partial = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 3), init_device_mesh("cpu", (2,)), [Partial()]))
        with pytest.raises(ValueError, match="sharded or replicated"):
            PackedMuon([partial])
        with pytest.raises(ValueError, match="sharded or replicated"):
            PackedMuonAdamW([{"params": [partial], "kind": "muon"}])
    finally:
        dist.destroy_process_group()


@fused_torch
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_zero_size_matrices_are_skipped_with_an_empty_state(adjust_lr_fn):
    """torch.optim.Muon steps a (0, 5) matrix as a no-op with an empty buffer, but divides by zero
    on a (5, 0) one with the default adjustment; here every zero-size matrix is a no-op, and its
    neighbours step as torch's."""
    rng = np.random.default_rng(26)
    empties = [torch.nn.Parameter(torch.zeros(s)) for s in ((5, 0), (0, 5), (0, 0))]
    theirs, ours, opt_t, _ = torch_muon_pair(gradient(rng, (6, 4)), lr=0.02, adjust_lr_fn=adjust_lr_fn)
    opt_o = PackedMuon([*empties, ours], lr=0.02, mode="fp32", adjust_lr_fn=adjust_lr_fn)
    for _ in range(2):
        for p in empties:
            p.grad = torch.zeros(p.shape)
        theirs.grad = gradient(rng, (6, 4))
        ours.grad = theirs.grad.clone()
        opt_t.step()
        opt_o.step()
        assert torch.equal(bits(theirs), bits(ours))
    for p in empties:
        assert opt_o.state[p]["momentum_buffer"].shape == p.shape


def test_a_group_changed_to_bad_values_is_refused_at_the_next_step():
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = PackedMuon([p], lr=0.1)
    p.grad = torch.ones(3, 4)
    opt.step()
    after_one = p.detach().clone()
    for key, value, message in (("momentum", 1.5, "momentum should be below 1"), ("lr", -1.0, "Learning rate"),
                                ("ns_steps", 100, "ns_steps"), ("adjust_lr_fn", "cubic", "adjust_lr_fn")):
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=message):
            opt.step()
        opt.param_groups[0][key] = good
    assert torch.equal(p.detach(), after_one)


# ---- PackedMuonAdamW's Newton-Schulz options ----------------------------------------------------
def test_combined_takes_batch_ns_and_ns_impl_checks_them_and_keeps_them_in_copies(monkeypatch):
    model = TinyModel()
    opt = PackedMuonAdamW(muon_param_groups(model, exclude=("head",), muon=MUON_OPTIONS, adamw=ADAMW_OPTIONS),
                          batch_ns=True, ns_impl="triton")
    assert (opt.rules["muon"].batch_ns, opt.rules["muon"].ns_impl) == (True, "triton")
    defaults = PackedMuonAdamW(muon_param_groups(TinyModel()))
    assert (defaults.rules["muon"].batch_ns, defaults.rules["muon"].ns_impl) == (None, "auto")
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert (copied.rules["muon"].batch_ns, copied.rules["muon"].ns_impl) == (True, "triton")
    adamw_only = [{"params": [model.norm.weight], "kind": "adamw"}]  # checked before any Muon group exists
    with pytest.raises(TypeError, match=r"PackedMuonAdamW\(batch_ns=1\).*True or False"):
        PackedMuonAdamW(adamw_only, batch_ns=1)
    with pytest.raises(ValueError, match=r"PackedMuonAdamW\(ns_impl='fast'\).*'cublas'.*'triton'"):
        PackedMuonAdamW(adamw_only, ns_impl="fast")
    with pytest.raises(ValueError, match=r"PackedMuonAdamW\(capturable=True\)"):
        PackedMuonAdamW(adamw_only, capturable=True)
    # batch_ns reaches the step: up (9x6) and down (6x9) orthogonalise as one batch
    batches = []
    monkeypatch.setattr(torch_muon_ns, "newton_schulz_batched",
                        lambda xs, *args, **kwargs: batches.append(len(xs)) or [x.bfloat16() for x in xs])
    batched = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)), batch_ns=True)
    set_gradients(np.random.default_rng(18), model)
    batched.step()
    assert batches == [2]


# ---- a combined step that raises changes nothing -------------------------------------------------
def three_groups(seed):
    """AdamW, Muon, AdamW groups (no param_names: messages name positions), so that each rule's
    own group indices differ from the combined optimizer's: Muon's group 0 is the combined 1,
    AdamW's group 1 the combined 2."""
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s)) for s in ((5,), (6, 4), (3,))]


def combined_over(params, third_group: dict | None = None):
    return PackedMuonAdamW([{"params": [params[0]], "kind": "adamw"}, {"params": [params[1]], "kind": "muon"},
                            {"params": [params[2]], "kind": "adamw", **(third_group or {})}], lr=0.02, adamw_lr=3e-3)


def snapshot(opt, params) -> list[torch.Tensor]:
    """Every parameter's and state entry's bits (step counts as tensors), in a fixed order."""
    out = [bits(p).clone() for p in params]
    for p in params:
        for key, value in sorted(opt.state[p].items()):
            value = torch.as_tensor(value)
            out.append(value.view(torch.int32).clone() if value.dtype is torch.float32 else value.clone())
    return out


def wrong_dtype_gradient(params, i):
    if hasattr(params[i], "grad_dtype"):
        params[i].grad_dtype = None  # let torch assign a float64 gradient
    params[i].grad = params[i].grad.double()


@pytest.mark.parametrize("break_step, error, message", [
    (lambda opt, params: opt.param_groups[2].__setitem__("lr", -1.0), ValueError,
     r"^param_groups\[2\]: Invalid learning rate"),
    (lambda opt, params: opt.param_groups[1].__setitem__("lr", -1.0), ValueError,
     r"^param_groups\[1\]: Learning rate should be >= 0"),
    (lambda opt, params: wrong_dtype_gradient(params, 2), TypeError,
     r"^param_groups\[2\]\['params'\]\[0\]: gradient dtype torch.float64"),
    (lambda opt, params: wrong_dtype_gradient(params, 1), TypeError,
     r"^param_groups\[1\]\['params'\]\[0\]: gradient dtype torch.float64"),
], ids=["adamw-lr", "muon-lr", "adamw-grad-dtype", "muon-grad-dtype"])
@pytest.mark.parametrize("third_group", [{}, {"mode": "fp32"}], ids=["one-adamw-format", "fp32-third-group"])
def test_a_combined_step_that_raises_changes_neither_rule_and_names_the_combined_group(break_step, error, message,
                                                                                       third_group):
    """Whichever rule refuses (a bad lr a scheduler set, a gradient of a wrong dtype), neither
    rule's parameters or state change, and the message names the group as the user numbers it.
    Repaired, the optimizer steps as a twin that never failed. With the third group in fp32 mode
    its own AdamW rule steps after the first group's: it refuses before the first steps."""
    rng = np.random.default_rng(40)
    params, twin_params = three_groups(1), three_groups(1)
    opt, twin = combined_over(params, third_group), combined_over(twin_params, third_group)
    for _ in range(2):  # the second step runs AdamW's plan
        for p, q in zip(params, twin_params):
            p.grad = gradient(rng, tuple(p.shape))
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    before = snapshot(opt, params)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    break_step(opt, params)
    with pytest.raises(error) as raised:
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt, params)))
    raised.match(message)
    for group, saved in zip(opt.param_groups, groups_before):  # repair it
        group.update(saved)
    for p, q in zip(params, twin_params):
        p.grad = q.grad.clone()
    opt.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(opt, params), snapshot(twin, twin_params)))


def test_rule_messages_name_the_combined_group_when_groups_are_added_and_loaded():
    params = three_groups(2)
    with pytest.raises(ValueError, match=r"^param_groups\[1\]: Learning rate should be >= 0"):
        PackedMuonAdamW([{"params": [params[0]], "kind": "adamw"}, {"params": [params[1]], "kind": "muon", "lr": -1}])
    opt = combined_over(params)
    with pytest.raises(ValueError, match=r"^param_groups\[3\]: Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "kind": "adamw", "lr": -1.0})
    with pytest.raises(ValueError, match=r"^param_groups\[3\]\['params'\]\[0\] has shape \(2,\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "kind": "muon"})
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, 2))], "kind": "muon"})
    assert opt.rules["muon"]._shown_group_indices == [1, 3]
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        copied.param_groups[2]["lr"] = -1.0
        for p in copied.param_groups[2]["params"]:
            p.grad = torch.ones(p.shape)
        with pytest.raises(ValueError, match=r"^param_groups\[2\]: Invalid learning rate"):
            copied.step()


# ---- the remembered verdict on a group's values ----------------------------------------------
@pytest.mark.parametrize("key, value, error, message", [
    ("ns_steps", 5.0, ValueError, "ns_steps=5.0"), ("nesterov", 1, TypeError, "nesterov must be a bool")])
def test_a_remembered_muon_verdict_does_not_pass_an_equal_value_of_a_refused_type(key, value, error, message):
    """5.0 == 5 and 1 == True: after a valid step, what a fresh optimizer refuses is still refused."""
    with pytest.raises(error, match=message):
        PackedMuon([torch.nn.Parameter(torch.ones(3, 4))], **{key: value})
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = PackedMuon([p], lr=0.1)
    p.grad = torch.ones(3, 4)
    opt.step()
    after_one = bits(p).clone()
    opt.param_groups[0][key] = value
    with pytest.raises(error, match=rf"param_groups\[0\]: .*{message}"):
        opt.step()
    assert torch.equal(bits(p), after_one)


def test_a_tensor_lr_equal_to_a_checked_float_is_checked_again(monkeypatch):
    calls = []
    real = torch_muon.validate_group
    monkeypatch.setattr(torch_muon, "validate_group", lambda *args: calls.append(args) or real(*args))
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = PackedMuon([p], lr=0.25)
    after_init = len(calls)
    p.grad = torch.ones(3, 4)
    for _ in range(2):
        opt.step()
    assert len(calls) - after_init == 1  # the first step's row; the second reuses its verdict
    opt.param_groups[0]["lr"] = torch.tensor(0.25, dtype=torch.float64)  # == 0.25, a tensor: checked afresh
    opt.step()
    assert len(calls) - after_init == 2


def test_a_scheduled_lr_is_checked_by_its_own_bounds_and_an_invalid_one_still_refused(monkeypatch):
    """Rows differing from a validated one in their lr alone take the lr's own checks
    (Rule.field_holds), not the whole validation: a scheduler costs none a step, and a bad lr
    (out of bounds, or lr * weight_decay past float32) is still refused in the validation's words."""
    calls = []
    real = torch_muon.validate_group
    monkeypatch.setattr(torch_muon, "validate_group", lambda *args: calls.append(args) or real(*args))
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = PackedMuon([p], lr=0.25, weight_decay=1e2)
    after_init = len(calls)
    for step in range(4):
        opt.param_groups[0]["lr"] = 0.25 / (step + 1)
        p.grad = torch.ones(3, 4)
        opt.step()
    assert len(calls) - after_init == 1  # the first step's row only
    after_steps = bits(p).clone()
    for bad, message in ((float("nan"), "Learning rate should be >= 0 but is: nan"),
                         (-0.5, "Learning rate should be >= 0 but is: -0.5"), (1e37, "lr \\* weight_decay"),
                         (10**400, "Learning rate should be >= 0 but is: 1000")):  # past a float: no bare OverflowError
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match=rf"^param_groups\[0\]: .*{message}"):
            opt.step()
        assert torch.equal(bits(p), after_steps)


# ---- loading refuses momenta no step stores ------------------------------------------------------
@pytest.mark.parametrize("combined", [False, True], ids=["PackedMuon", "PackedMuonAdamW"])
@pytest.mark.parametrize("bad_code", [0x7F80, 0xFFC1], ids=["inf", "nan"])
def test_a_bf16_momentum_code_that_is_not_finite_is_refused_on_load_naming_the_parameter(combined, bad_code):
    """Such a matrix would be refused at every step and never train again; fp32 mode and
    import_state refuse the same state."""
    rng = np.random.default_rng(50)
    model = TinyModel()
    muon_group = muon_param_groups(model, exclude=("head",))[0]
    opt = (PackedMuonAdamW(muon_param_groups(model, exclude=("head",)), mode="bf16") if combined else
           PackedMuon([{"params": muon_group["params"], "param_names": muon_group["param_names"]}], mode="bf16"))
    set_gradients(rng, model)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["momentum_code"].view(-1)[3] = np.int16(np.uint16(bad_code))  # down.weight's
    params = [p for g in opt.param_groups for p in g["params"]]
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"saved parameter 1 \(for 'down.weight'\): the momentum holds NaN or Inf"):
        opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt, params)))


# ---- muon_param_groups' exclude ------------------------------------------------------------------
def test_muon_param_groups_takes_one_name_as_a_string_and_refuses_an_entry_that_matches_nothing():
    """A string is one name (not its characters, which matched every parameter: Muon never ran);
    an entry that matches no parameter's name (a typo would send the head to Muon) is refused.
    A tied head matches under its own name, though named_parameters lists it once."""
    model = TinyModel()
    as_string, as_tuple = muon_param_groups(model, exclude="head"), muon_param_groups(model, exclude=("head",))
    assert [(g["kind"], g["param_names"]) for g in as_string] == [(g["kind"], g["param_names"]) for g in as_tuple]
    assert as_string[0]["param_names"] == ["up.weight", "down.weight"]
    with pytest.raises(ValueError, match=r"exclude entry 'haed' matches no parameter name of TinyModel"):
        muon_param_groups(model, exclude=("haed",))
    with pytest.raises(ValueError, match=r"exclude entry '' matches every parameter"):
        muon_param_groups(model, exclude=("head", ""))
    with pytest.raises(TypeError, match=r"exclude=\[3\]: pass a parameter name"):
        muon_param_groups(model, exclude=[3])
    model.head.weight = model.embed.weight
    assert muon_param_groups(model, exclude="head")[0]["param_names"] == ["up.weight", "down.weight"]


@pytest.mark.parametrize("exclude, named", [("weight", "entry 'weight'"), (".", "entry '.'"), ("w", "entry 'w'"),
                                            (("head", "up", "down"), "entries 'head', 'up', 'down'")])
def test_muon_param_groups_refuses_an_exclude_that_leaves_muon_no_matrix(exclude, named):
    """Entries match as parts of names: exclude="weight" (or ".") matched every matrix, so every
    parameter went to AdamW and Muon never ran, silently. Refused naming the entry (or the
    entries that together match them all); a model with no matrix for Muon is not refused."""
    model = TinyModel()
    with pytest.raises(ValueError, match=rf"^muon_param_groups: exclude {named} (matches|together match) every matrix "
                                         "Muon would step in TinyModel") as raised:
        muon_param_groups(model, exclude=exclude)
    assert "'up.weight', 'down.weight', 'head.weight'" in str(raised.value) and "PackedAdamW" in str(raised.value)
    no_matrices = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.LayerNorm(3))
    assert [g["kind"] for g in muon_param_groups(no_matrices, exclude="weight")] == ["adamw"]


# ---- a group's own state format; what a group cannot set ------------------------------------------
@pytest.mark.parametrize("kind, key, value, message", [
    ("muon", "batch_ns", True, r"cannot have its own step switches.*PackedMuonAdamW\(\.\.\., batch_ns=\.\.\.\)"),
    ("adamw", "multi_tensor", False, r"PackedMuonAdamW\(\.\.\., multi_tensor=\.\.\.\)"),
    ("adamw", "track_format", True, r"PackedMuonAdamW\(\.\.\., track_format=\.\.\.\)"),
    ("adamw", "adamw_mode", "fp32", r"the constructor's default for AdamW groups; a group's own AdamW setting is "
                                    "'mode'"),
    ("adamw", "adamw_lr", 1e-3, r"a group's own AdamW setting is 'lr'"),
    ("adamw", "momentum", 0.9, r"an option of Muon groups, which this AdamW group would ignore"),
    ("adamw", "mu_bias", 30, r"an option of Muon groups, which this AdamW group would ignore"),
    ("muon", "betas", (0.9, 0.95), r"an option of AdamW groups, which this Muon group would ignore"),
    ("muon", "m_bias", 5, r"an option of AdamW groups, which this Muon group would ignore"),
    ("muon", "mode", "fp16", r"mode='fp16' is not one of \('packed', 'bf16', 'fp32'\)"),
    ("adamw", "mode", "bf16", r"mode='bf16' is not one of \('packed', 'fp16', 'fp32'\)"),
    ("adamw", "rms_bias", 101, r"rms_bias=101 is outside"),
    ("muon", "mu_bias", -1, r"mu_bias=-1 is outside"),
])
def test_a_group_option_the_combined_optimizer_would_ignore_is_refused_naming_it(kind, key, value, message):
    """A group's own state format is its rule's options (`mode` and biases: the other rule's
    are refused), checked as the rule checks them; the step's switches stay the optimizer's, and
    another rule's option would be ignored: refused, naming the group and the key."""
    model = TinyModel()
    groups = muon_param_groups(model, exclude=("head",))
    index = [g["kind"] for g in groups].index(kind)
    groups[index][key] = value
    full = rf"^param_groups\[{index}\] \(kind='{kind}'\) sets {key!r}: .*{message}"
    with pytest.raises(ValueError, match=full):
        PackedMuonAdamW(groups)
    opt = PackedMuonAdamW([groups[1 - index]])
    with pytest.raises(ValueError, match=full.replace(rf"\[{index}\]", r"\[1\]")):
        opt.add_param_group(groups[index])
    assert len(opt.param_groups) == 1 and list(opt.rules) == [groups[1 - index]["kind"]]


@pytest.mark.parametrize("key, value, message", [
    ("mode", "fp32", r" sets 'mode': a group cannot have its own state format.*PackedMuon\(\.\.\., mode=\.\.\.\)"),
    ("mu_bias", 30, r" sets 'mu_bias': .*PackedMuon\(\.\.\., mu_bias=\.\.\.\)"),
    ("ns_impl", "triton", r" sets 'ns_impl': .*PackedMuon\(\.\.\., ns_impl=\.\.\.\)"),
    ("m_bias", 5, r" sets 'm_bias': PackedMuon has no such option"),
    ("amsgrad", True, r": amsgrad=True is not supported"),
])
def test_a_group_option_packed_muon_would_ignore_is_refused_in_a_group_and_on_load(key, value, message):
    """PackedMuon keeps one state format and one set of switches: a group's own (fp32 momentum,
    say) would step packed codes, silently; refused naming the group and the key, given with the
    group or brought by a loaded state_dict (which then changes nothing)."""
    p, q = torch.nn.Parameter(torch.ones(4, 6)), torch.nn.Parameter(torch.ones(6, 4))
    with pytest.raises(ValueError, match=rf"^param_groups\[1\]{message}"):
        PackedMuon([{"params": [p]}, {"params": [q], key: value}])
    opt = PackedMuon([{"params": [p]}])
    with pytest.raises(ValueError, match=rf"^param_groups\[1\]{message}"):
        opt.add_param_group({"params": [q], key: value})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q]})
    p.grad, q.grad = torch.ones(4, 6), torch.ones(6, 4)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][1][key] = value
    before = snapshot(opt, [p, q])
    with pytest.raises(ValueError, match=rf"^load_state_dict: saved param_groups\[1\]{message}"):
        opt.load_state_dict(saved)
    assert key not in opt.param_groups[1]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt, [p, q])))


# torch.optim.AdamW's group keys at their defaults (what its param_groups and state_dict hold).
TORCH_ADAMW_GROUP_DEFAULTS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                                  fused=None, decoupled_weight_decay=True)


@pytest.mark.parametrize("key, value", [("amsgrad", True), ("decoupled_weight_decay", False), ("fused", True),
                                        ("foreach", True), ("differentiable", True)])
def test_a_combined_adamw_group_asking_for_an_unsupported_torch_option_is_refused(key, value):
    """torch.optim.AdamW's options that PackedAdamW refuses as keywords are refused in a
    combined optimizer's AdamW group too (and on load), instead of stepping plain packed AdamW;
    at torch's defaults they are accepted and change no bit."""
    model = TinyModel()
    groups = muon_param_groups(model, exclude=("head",))
    index = [g["kind"] for g in groups].index("adamw")
    with pytest.raises(ValueError, match=rf"^param_groups\[{index}\] \(kind='adamw'\): {key}={value!r} is not "
                                         "supported"):
        PackedMuonAdamW([{**g, key: value} if i == index else g for i, g in enumerate(groups)])
    with_defaults = PackedMuonAdamW([{**g, **TORCH_ADAMW_GROUP_DEFAULTS} if i == index else g
                                     for i, g in enumerate(groups)])
    twin = TinyModel()
    twin.load_state_dict(model.state_dict())
    plain = PackedMuonAdamW(muon_param_groups(twin, exclude=("head",)))
    rng = np.random.default_rng(50)
    for _ in range(2):
        set_gradients(rng, model, twin)
        with_defaults.step()
        plain.step()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(model.parameters(), twin.parameters()))
    saved = with_defaults.state_dict()
    saved["param_groups"][index][key] = value
    with pytest.raises(ValueError, match=rf"^load_state_dict: saved param_groups\[{index}\] \(kind='adamw'\): "
                                         rf"{key}={value!r} is not supported"):
        with_defaults.load_state_dict(saved)
    assert with_defaults.param_groups[index][key] == TORCH_ADAMW_GROUP_DEFAULTS[key]


@pytest.mark.parametrize("kind, key, value", [("muon", "mode", "fp32"), ("adamw", "m_bias", 5),
                                              ("adamw", "mode", "fp32")])
def test_a_combined_state_dict_whose_group_sets_a_state_format_is_refused_on_load(kind, key, value):
    """A saved group whose own state-format key is not the format its state was saved in (the
    identity it records) was edited: refused naming the saved group and the key; nothing changes."""
    rng = np.random.default_rng(56)
    model = TinyModel()
    opt = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)))
    set_gradients(rng, model)
    opt.step()
    saved = opt.state_dict()
    index = [g["kind"] for g in opt.param_groups].index(kind)
    saved["param_groups"][index][key] = value
    params = list(model.parameters())
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=rf"^load_state_dict: saved param_groups\[{index}\] \(kind='{kind}'\) sets "
                                         rf"{key!r}={value!r}, but its state was saved in format "):
        opt.load_state_dict(saved)
    assert key not in opt.param_groups[index]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt, params)))


# ---- groups of their own state format --------------------------------------------------------------
FP32_ADAMW, FP32_MUON = "adamw:fp32:m=f32,v=f32", "muon:muon-fp32:mu=f32"


def own_format_groups(model, own: bool = True) -> list[dict]:
    """TinyModel's parameters in four groups: a packed and (`own`) an fp32 one of each rule, the
    fp32 groups saying so themselves (nanochat's scalars in fp32 AdamW state, say)."""
    fp32 = {"mode": "fp32"} if own else {}
    names = dict((id(p), n) for n, p in model.named_parameters())

    def group(kind, params, **options):
        return {"params": params, "param_names": [names[id(p)] for p in params], "kind": kind, **options}

    return [group("muon", [model.up.weight], **MUON_OPTIONS),
            group("muon", [model.down.weight], **MUON_OPTIONS, **fp32),
            group("adamw", [model.embed.weight, model.head.weight], **ADAMW_OPTIONS),
            group("adamw", [model.up.bias, model.norm.weight, model.norm.bias], **ADAMW_OPTIONS, **fp32)]


def each_format_alone(model) -> list:
    """PackedMuon and PackedAdamW of each format over own_format_groups(model)'s groups."""
    up, down, packed, fp32 = (g["params"] for g in own_format_groups(model))
    return [PackedMuon(up, **MUON_OPTIONS), PackedMuon(down, **MUON_OPTIONS, mode="fp32"),
            PackedAdamW(packed, **ADAMW_OPTIONS), PackedAdamW(fp32, **ADAMW_OPTIONS, mode="fp32")]


def assert_same_state(a_opt, a_params, b_opts, b_params) -> None:
    """Parameters and every state entry bit for bit (one optimizer against one or several)."""
    for p, q in zip(a_params, b_params):
        b_state = next(opt.state[q] for opt in b_opts if q in opt.state)
        assert torch.equal(bits(p), bits(q)) and a_opt.state[p].keys() == b_state.keys()
        for key, value in a_opt.state[p].items():
            other = b_state[key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), key
            assert not torch.is_tensor(value) or (value.dtype == other.dtype and torch.equal(bits(value), bits(other)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_groups_of_their_own_state_format_step_as_each_format_alone(dtype):
    """An fp32 AdamW group beside a packed one, and an fp32 Muon group beside a packed one, each
    step as the optimizer of that format alone does, bit for bit (state included), one rule
    optimizer per (kind, format); the constructor's formats keep their rules' keys."""
    rng = np.random.default_rng(59)
    torch.manual_seed(59)
    model = TinyModel().to(dtype)
    twin = copy.deepcopy(model)
    for m in (model, twin):
        for p in m.parameters():
            taking_fp32_gradients(p)
    combined, alone = PackedMuonAdamW(own_format_groups(model), track_format=True), each_format_alone(twin)
    assert list(combined.rules) == ["muon", FP32_MUON, "adamw", FP32_ADAMW]
    assert [combined.rules[combined.rule_key(g)].state_format.mode for g in combined.param_groups] == \
        ["packed", "fp32", "packed", "fp32"]
    assert [g.get("mode") for g in combined.param_groups] == [None, "fp32", None, "fp32"]  # as given
    for _ in range(3):
        set_gradients(rng, model, twin)
        combined.step()
        for opt in alone:
            opt.step()
        assert_same_state(combined, list(model.parameters()), alone, list(twin.parameters()))
    assert combined.state[model.norm.weight]["moments"].shape == (2, 6)
    assert combined.state[model.down.weight]["momentum_buffer"].dtype is torch.float32
    # Each rule counts what it counts alone: fp32 AdamW has no codes, Muon its refusals in every mode.
    assert set(combined.format_stats()) == {"up.weight", "down.weight", "embed.weight", "head.weight"}


def test_groups_of_their_own_state_format_round_trip_state_dict_pickle_and_deepcopy():
    rng = np.random.default_rng(60)
    torch.manual_seed(60)
    model = TinyModel()
    opt = PackedMuonAdamW(own_format_groups(model))
    for _ in range(2):
        set_gradients(rng, model)
        opt.step()
    saved = opt.state_dict()
    assert [g["packed_adamw_format"] for g in saved["param_groups"]] == [
        "muon-packed:mu=SE5M10b31:scale=pow2/matrix", "muon-fp32:mu=f32", "packed:m=SE4M11b15,rms=UE4M12b15",
        "fp32:m=f32,v=f32"]
    assert saved["packed_adamw"]["format"] == {key: rule.state_format.identity for key, rule in opt.rules.items()}
    twin = TinyModel()
    twin.load_state_dict(model.state_dict())
    loaded = PackedMuonAdamW(own_format_groups(twin))
    loaded.load_state_dict(copy.deepcopy(saved))
    assert [g.get("mode") for g in loaded.param_groups] == [None, "fp32", None, "fp32"]
    params = [p for g in opt.param_groups for p in g["params"]]
    copies = [(loaded, [p for g in loaded.param_groups for p in g["params"]])]
    for copied in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        assert list(copied.rules) == list(opt.rules) and all(r.state is copied.state for r in copied.rules.values())
        copies.append((copied, [p for g in copied.param_groups for p in g["params"]]))
    for copied, copied_params in copies:
        assert_same_state(opt, params, [copied], copied_params)
        assert copied.state[copied_params[0]]["momentum_code"].dtype is torch.int16
        assert copied.state[copied_params[3]]["words"].dtype is torch.uint32  # head.weight's, as pickled too
        assert copied.state[copied_params[-1]]["moments"].dtype is torch.float32
    for _ in range(2):
        grads = [gradient(rng, tuple(p.shape)) for p in params]
        for optimizer, ps in [(opt, params), *copies]:
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            optimizer.step()
        for copied, copied_params in copies:
            assert_same_state(opt, params, [copied], copied_params)


def test_a_group_format_changed_after_the_group_was_added_is_refused_when_saved_or_loaded():
    """A group's format is read when it is added: an entry changed since would be saved beside a
    state of the other format. Refused, naming the group, its entry and the state's format."""
    opt = PackedMuonAdamW(own_format_groups(TinyModel()))
    opt.param_groups[3]["mode"] = "packed"
    message = r"^param_groups\[3\] sets mode='packed' since it was added, but its state is kept in 'fp32:m=f32,v=f32'"
    with pytest.raises(ValueError, match=message):
        opt.state_dict()
    opt.param_groups[3]["mode"] = "fp32"
    saved = opt.state_dict()
    opt.param_groups[1]["mode"] = "fp16"  # no Muon mode at all
    with pytest.raises(ValueError, match=r"^param_groups\[1\] sets mode='fp16' since it was added"):
        opt.load_state_dict(saved)


def test_a_compiled_step_over_groups_of_their_own_state_format_gives_the_eager_bits():
    """fullgraph=True: one custom op steps every rule (two formats of each kind); aot_eager hands
    the op copies of the parameters, which each rule steps (the later AdamW rule checked first)."""
    rng = np.random.default_rng(62)
    torch.manual_seed(62)
    model = TinyModel()
    twin = copy.deepcopy(model)
    eager, compiled = PackedMuonAdamW(own_format_groups(model)), PackedMuonAdamW(own_format_groups(twin))
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        set_gradients(rng, model, twin)
        eager.step()
        step()
        assert_same_state(eager, list(model.parameters()), [compiled], list(twin.parameters()))


@pytest.mark.parametrize("saved_own, loading_own", [(True, False), (False, True)])
def test_a_state_dict_of_another_group_format_is_refused_naming_the_group(saved_own, loading_own):
    """A group's state loads only into a group of its format: the first group whose saved format
    differs is named (the Muon one, param_groups[1]), and nothing changes."""
    rng = np.random.default_rng(61)
    model, twin = TinyModel(), TinyModel()
    opt = PackedMuonAdamW(own_format_groups(model, saved_own))
    other = PackedMuonAdamW(own_format_groups(twin, loading_own))
    for optimizer, m in ((opt, model), (other, twin)):
        set_gradients(rng, m)
        optimizer.step()
    saved = opt.state_dict()
    params = list(twin.parameters())
    before = snapshot(other, params)
    theirs, ours = ("muon-fp32:mu=f32", "muon-packed") if saved_own else ("muon-packed", "muon-fp32:mu=f32")
    with pytest.raises(ValueError, match=rf"^load_state_dict: saved param_groups\[1\] \(muon\) has format '{theirs}.* "
                                         rf"but this optimizer's param_groups\[1\] uses '{ours}"):
        other.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(other, params)))
    # A saved group that does not set its format (saved before groups could) loads into a group
    # that sets the same format itself.
    explicit = own_format_groups(twin, False)
    explicit[0]["mode"] = "packed"
    plain = PackedMuonAdamW(own_format_groups(model, False))
    set_gradients(rng, model)
    plain.step()
    spelled_out = PackedMuonAdamW(explicit)
    spelled_out.load_state_dict(plain.state_dict())
    twin.load_state_dict(model.state_dict())
    assert list(spelled_out.rules) == ["muon", "adamw"] and spelled_out.param_groups[0]["mode"] == "packed"
    assert_same_state(plain, list(model.parameters()), [spelled_out], list(twin.parameters()))


# ---- pickling a combined optimizer ---------------------------------------------------------------
def test_a_pickled_combined_optimizer_with_adamw_state_unpickles_bit_for_bit_and_steps_alike():
    """AdamW's uint32 words, which torch cannot unpickle, travel as their int32 bits."""
    rng = np.random.default_rng(51)
    model = TinyModel()
    opt = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)))
    for _ in range(2):
        set_gradients(rng, model)
        opt.step()
    copied = pickle.loads(pickle.dumps(opt))
    params = [p for g in opt.param_groups for p in g["params"]]
    copied_params = [p for g in copied.param_groups for p in g["params"]]
    words_key = opt.rules["adamw"].state_format.state_key
    assert copied.state[copied_params[-1]][words_key].dtype == torch.uint32
    assert all(rule.state is copied.state for rule in copied.rules.values())
    for before, after in zip(snapshot(opt, params), snapshot(copied, copied_params)):
        assert before.dtype == after.dtype and torch.equal(before, after)
    for _ in range(2):
        for p, q in zip(params, copied_params):
            p.grad = gradient(rng, tuple(p.shape))
            q.grad = p.grad.clone()
        opt.step()
        copied.step()
        assert all(torch.equal(a, b) for a, b in zip(snapshot(opt, params), snapshot(copied, copied_params)))


# ---- a parameter listed twice ---------------------------------------------------------------------
def test_a_parameter_listed_twice_is_refused_naming_the_torch_optimizer_of_its_rule():
    p, q = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(3))
    for make, twin in ((lambda: PackedMuon([p, p]), "torch.optim.Muon"),
                       (lambda: PackedMuonAdamW([{"params": [p, p], "kind": "muon"}]), "torch.optim.Muon"),
                       (lambda: PackedMuonAdamW([{"params": [q, q], "kind": "adamw"}]), "torch.optim.AdamW")):
        with pytest.raises(ValueError, match=r"\['params'\]\[1\] is the same tensor as .*") as raised:
            make()
        assert f"({twin} would step it twice" in str(raised.value)


# ---- format counts and refused matrices (track_format) ---------------------------------------------
# Gradients over 58 binades: the first momenta (0.05 g) saturate the default E5M10 code (|m| > 2),
# go subnormal (below 2**-30) and flush (below 2**-41).
TRACKED_SHAPES = [(8, 12), (12, 8), (8, 12)]


def tracked_pair(mode, batch_ns):
    """An optimizer with track_format and an untracked twin over copies of the same matrices."""
    torch.manual_seed(52)
    p0 = [torch.randn(s) for s in TRACKED_SHAPES]
    names = [f"w{i}" for i in range(len(p0))]
    pairs = []
    for track in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in p0]
        opt = PackedMuon([{"params": params, "param_names": names}], mode=mode, track_format=track,
                         batch_ns=batch_ns, ns_impl="cublas")
        pairs.append((params, opt))
    return pairs


def expected_stats(opt, params, grads, stats) -> None:
    """Adds one step's counts to `stats` as MUON.md defines them, replaying the momentum phase on
    copies of the state before the step: a refused matrix counts as refused, an accepted one its
    elements and its codes' format events."""
    group = opt.param_groups[0]
    fmt = opt.state_format
    for name, p, g in zip(group["param_names"], params, grads):
        entry = stats.setdefault(name, {"elements": 0, "refused": 0})
        state = opt.state[p][fmt.state_key].numpy().copy() if p in opt.state else \
            np.zeros(p.shape, np.float32 if fmt.mode == "fp32" else np.uint16)
        exponent = None if fmt.mode != "packed" else \
            opt.state[p]["mu_exponent"].numpy().copy() if p in opt.state else np.zeros((), np.int32)
        counts = np.zeros(3, np.int64)
        scalars = step_scalar_row((group["lr"], group["momentum"], group["weight_decay"], group["eps"]), tuple(p.shape))
        if momentum_phase(g.numpy(), state, scalars, fmt=fmt, exponent=exponent, format_counts_out=counts) is None:
            entry["refused"] += 1
            continue
        entry["elements"] += p.numel()
        if fmt.mode == "packed":
            for key, count in zip(("saturated_mu", "flushed_mu", "subnormal_mu"), counts.tolist()):
                entry[key] = entry.get(key, 0) + count


@pytest.mark.parametrize("mode, kernels, batch_ns", [
    ("packed", False, False), ("fp32", False, True), ("packed", True, False), ("packed", True, True),
    ("bf16", True, True)], ids=["numpy", "numpy-fp32", "kernels", "table-kernels", "table-kernels-bf16"])
def test_track_format_counts_refused_matrices_and_format_events_and_changes_no_bit(mode, kernels, batch_ns,
                                                                                    is_interpreting, monkeypatch):
    """Over three steps, the second refusing w1 (a NaN gradient): format_stats gives each matrix's
    refused steps, the element-steps of its accepted ones and (packed mode) their format events,
    as MUON.md defines them; the steps' bits are the untracked twin's. The kernels (CUDA's step)
    run in Triton's interpreter on CPU tensors, Newton-Schulz on the CPU."""
    if kernels and not is_interpreting:
        pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
    if kernels:
        monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: True)
    rng = np.random.default_rng(53)
    (params, opt), (twin_params, twin) = tracked_pair(mode, batch_ns)
    want = {}
    for step in range(3):
        grads = [gradient(rng, s, -50, 9) for s in TRACKED_SHAPES]
        if step == 1:
            grads[1][2, 3] = float("nan")
        expected_stats(opt, params, grads, want)
        for ps, o in ((params, opt), (twin_params, twin)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(snapshot(opt, params), snapshot(twin, twin_params)))
    assert want["w1"]["refused"] == 1 and want["w0"]["refused"] == 0
    assert set(opt.format_count_names) == set(want["w0"]) - {"elements"}  # what a trainer logs
    if mode == "packed":
        # Each matrix's exponent puts its largest |m'| one binade below the top code: nothing
        # saturates (so the shared saturation warning stays silent); the momenta 30 and 40
        # binades below the largest go subnormal and flush.
        assert want["w0"]["saturated_mu"] == 0 and all(want["w0"][key] > 0 for key in ("flushed_mu", "subnormal_mu"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert opt.format_stats() == want
    else:
        assert opt.format_stats() == want
    with pytest.raises(ValueError, match=r"PackedMuon\(\.\.\., track_format=True\)"):
        twin.format_stats()


def test_track_format_is_a_checked_switch_that_a_pickle_keeps_and_a_load_restarts():
    p = torch.nn.Parameter(torch.ones(4, 6))
    with pytest.raises(TypeError, match="track_format=1: pass True or False"):
        PackedMuon([p], track_format=1)
    with pytest.raises(ValueError, match="track_format=True with capturable=True"):
        PackedMuon([p], lr=torch.tensor(0.02), capturable=True, track_format=True)
    opt = PackedMuon([p])
    assert not opt.track_format
    opt.track_format = True
    assert pickle.loads(pickle.dumps(opt)).track_format
    p.grad = torch.ones(4, 6)
    opt.step()
    saved = opt.state_dict()
    opt.step()
    opt.load_state_dict(saved)  # a loaded state starts the counts afresh
    assert opt.format_stats() == {}
    opt.step()
    opt.import_state(opt.export_state())  # so does an imported one
    assert opt.format_stats() == {}
    opt.track_format = False
    opt.step()
    with pytest.raises(ValueError, match="track_format"):
        opt.format_stats()


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda opt: pickle.loads(pickle.dumps(opt))],
                         ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("combined", [False, True], ids=["PackedMuon", "PackedMuonAdamW"])
def test_a_copy_keeps_the_muon_counts_not_read_yet(combined, copy_of):
    """Pending counts travel with a copy, as the switch does (they were dropped: the copy read
    {}, or raised once the switch was off); the copy and the original each read them once."""
    rng = np.random.default_rng(58)
    model = TinyModel()
    groups = muon_param_groups(model, exclude=("head",))
    opt = PackedMuonAdamW(groups, track_format=True) if combined else \
        PackedMuon([{k: v for k, v in groups[0].items() if k != "kind"}], track_format=True)
    for step in range(2):
        set_gradients(rng, model)
        if step == 1:
            model.up.weight.grad[1, 2] = float("inf")
        opt.step()
    opt.track_format = False
    copied = copy_of(opt)
    want = opt.format_stats()
    assert want["up.weight"]["refused"] == 1 and want["down.weight"]["elements"] == 2 * model.down.weight.numel()
    assert ("head.weight" in want) is combined
    assert copied.format_stats() == want
    with pytest.raises(ValueError, match="none was made since the last read"):
        copied.format_stats()


def test_combined_track_format_reports_both_rules():
    rng = np.random.default_rng(54)
    model = TinyModel()
    opt = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)), track_format=True)
    set_gradients(rng, model)
    model.up.weight.grad[0, 0] = float("inf")
    opt.step()
    stats = opt.format_stats()
    assert set(stats) == {name for name, _ in model.named_parameters()}
    assert stats["up.weight"] == {"elements": 0, "refused": 1, "saturated_mu": 0, "flushed_mu": 0, "subnormal_mu": 0}
    assert stats["down.weight"]["elements"] == model.down.weight.numel() and stats["down.weight"]["refused"] == 0
    assert set(stats["head.weight"]) == {"elements", "saturated_m", "saturated_rms", "flushed_m", "flushed_rms",
                                         "subnormal_m", "subnormal_rms"}
    untracked = PackedMuonAdamW(muon_param_groups(model, exclude=("head",)))
    with pytest.raises(ValueError, match=r"PackedMuonAdamW\(\.\.\., track_format=True\)"):
        untracked.format_stats()


@pytest.mark.parametrize("switched", [False, True], ids=["built_on", "switched_on"])
def test_combined_track_format_with_fp32_adamw_counts_muon_and_leaves_adamw_out(switched):
    """AdamW's fp32 mode stores float32 moments, no codes to count; Muon counts its refusals in
    every mode: each rule counts what it can (it was refused whole). The AdamW rule alone still
    refuses the switch in fp32 mode."""
    rng = np.random.default_rng(57)
    model = TinyModel()
    groups = muon_param_groups(model, exclude=("head",))
    opt = PackedMuonAdamW(groups, adamw_mode="fp32", track_format=not switched)
    if switched:
        assert not opt.track_format
    else:
        assert opt.format_stats() == {}  # counting on, nothing counted yet
    opt.track_format = True
    assert opt.track_format and opt.rules["muon"].track_format and not opt.rules["adamw"].track_format
    set_gradients(rng, model)
    model.up.weight.grad[0, 0] = float("nan")
    opt.step()
    stats = opt.format_stats()
    assert set(stats) == {"up.weight", "down.weight"}
    assert stats["up.weight"] == {"elements": 0, "refused": 1, "saturated_mu": 0, "flushed_mu": 0, "subnormal_mu": 0}
    assert stats["down.weight"]["elements"] == model.down.weight.numel() and stats["down.weight"]["refused"] == 0
    with pytest.raises(ValueError, match=r"fp32 mode stores float32 moments"):
        opt.rules["adamw"].track_format = True
    adamw_only = PackedMuonAdamW([g for g in groups if g["kind"] == "adamw"], adamw_mode="fp32", track_format=True)
    assert adamw_only.track_format and adamw_only.format_stats() == {}  # counting on, nothing counted


# ---- FP32 masters of a combined optimizer -----------------------------------------------------------
def test_combined_load_master_weights_starts_a_bf16_run_on_the_fp32_run_bit_for_bit():
    """A bf16 model given an FP32 model's weights as masters follows its trajectory exactly (both
    rules' split masters), fed the same float32 gradients; its weights are the masters rounded."""
    rng = np.random.default_rng(55)
    torch.manual_seed(55)
    fp32_model = TinyModel()
    bf16_model = copy.deepcopy(fp32_model).to(torch.bfloat16)
    for p in bf16_model.parameters():
        taking_fp32_gradients(p)
    fp32_opt, bf16_opt = (PackedMuonAdamW(muon_param_groups(m, exclude=("head",))) for m in (fp32_model, bf16_model))
    bf16_opt.load_master_weights([m.detach().clone() for m in fp32_opt.master_weights()])
    for step in range(3):
        masters = bf16_opt.master_weights()
        for a, b in zip(fp32_opt.master_weights(), masters):
            assert torch.equal(bits(a), bits(b))
        for p, q in zip(fp32_model.parameters(), bf16_model.parameters()):
            assert torch.equal(bits(q), bits(p.detach().bfloat16()))
            p.grad = gradient(rng, tuple(p.shape), -10, -2)
            q.grad = p.grad.clone()
        fp32_opt.step()
        bf16_opt.step()


@pytest.mark.parametrize("path", ["numpy", "kernels per matrix", "kernels batched",
                                  *(pytest.param(p, marks=[pytest.mark.cuda, cuda_only]) for p in ("cuda per matrix",
                                                                                                    "cuda batched"))])
def test_a_newton_schulz_output_that_is_not_finite_refuses_the_matrix_whole(path, is_interpreting, monkeypatch):
    """Coefficients that pass `validate_ns` but overflow (1e20 each) make Newton-Schulz's output
    Inf/NaN from finite inputs: each such matrix is refused whole, as a NaN gradient refuses it
    (its weights, momentum codes and exponent kept; counted refused; named by check_nonfinite),
    while the group of ordinary coefficients steps. Before, the momentum advanced, every weight
    element was rejected alone and format_stats counted the step as accepted. On the numpy step
    and on the CUDA step's code (kernels interpreted on CPU tensors; compiled on a GPU), per matrix
    and batched."""
    device = "cuda" if path.startswith("cuda") else "cpu"
    if path.startswith("kernels"):
        if not is_interpreting:
            pytest.skip("runs the kernels on CPU tensors: needs TRITON_INTERPRET=1")
        monkeypatch.setattr(torch_muon, "_runs_kernels", lambda opt, on: True)
    torch.manual_seed(3)
    ordinary, overflowing = torch.nn.Parameter(torch.randn(6, 10, device=device)), [
        torch.nn.Parameter(torch.randn(*s, device=device)) for s in ((6, 10), (10, 6))]

    def optimizer(check_nonfinite):
        return PackedMuon([{"params": [ordinary]}, {"params": overflowing, "ns_coefficients": (1e20, 1e20, 1e20)}],
                          lr=0.02, batch_ns=path.endswith("batched"), track_format=not check_nonfinite,
                          check_nonfinite=check_nonfinite)

    opt = optimizer(check_nonfinite=False)
    for step in range(2):
        before = [p.detach().clone() for p in (ordinary, *overflowing)]
        states = [{k: v.clone() for k, v in opt.state[p].items()} for p in overflowing] if step else None
        for p in (ordinary, *overflowing):
            p.grad = torch.randn_like(p)
        opt.step()
        assert not torch.equal(ordinary, before[0])  # the ordinary group steps
        for p, old in zip(overflowing, before[1:]):
            assert torch.equal(p.view(torch.int32), old.view(torch.int32))
        if states:  # the refused matrices' momentum codes and exponents as they were
            for p, old in zip(overflowing, states):
                assert all(torch.equal(opt.state[p][k], v) for k, v in old.items())
    stats = opt.format_stats()
    assert stats[(1, 0)]["refused"] == stats[(1, 1)]["refused"] == 2 and stats[(0, 0)]["refused"] == 0
    opt = optimizer(check_nonfinite=True)
    with pytest.raises(NonFiniteGradientError, match="Newton-Schulz input or output"):
        opt.step()
