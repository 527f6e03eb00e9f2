"""The compiled kernel on a CUDA GPU: bit parity at scale, 64-bit indexing, no recompiles.

Skipped without a GPU (and when TRITON_INTERPRET=1 forces the interpreter). The references
run on the CPU from the same inputs: core.adamw.numpy_step on every element (or on slices, for the
tensor past 2**31 elements) and the scalar authority on a strided subset.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernel_harness as H
from conftest import interpreting
from packed_adamw.core import Hyperparams, StateFormat

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                       reason="needs a CUDA GPU and compiled (not interpreted) Triton kernels"),
    # Huge gradients overflow g*g in the CPU references on purpose.
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

F32 = np.float32
U32 = np.uint32
MODES = ["packed", "fp16", "fp32"]
AUTHORITY_SAMPLE = 20_000  # elements per step: the pure-Python authority is ~22 us each


def compare(k, p, g, state, *, count, hp, fmt, write_update, what):
    out, new_state, rejected = H.numpy_reference(p, g, state, count=count, hp=hp, fmt=fmt, write_update=write_update)
    H.assert_same_bits(k.out, out, f"compiled vs numpy, out [{what}]")
    H.assert_same_bits(k.state, new_state, f"compiled vs numpy, state [{what}]")
    assert k.nonfinite == rejected, what
    stride = max(1, len(p) // AUTHORITY_SAMPLE)
    index = H.checkable_by_authority(g, fmt, np.r_[np.arange(0, len(p), stride), len(p) - 1])
    a = H.authority_reference(p, g, state, count=count, hp=hp, fmt=fmt, index=index)
    H.assert_same_bits(k.out[index], a.update if write_update else a.p, f"compiled vs authority, out [{what}]")
    H.assert_same_bits(H.state_at(k.state, index, fmt), a.state, f"compiled vs authority, state [{what}]")


@pytest.mark.parametrize("mode", MODES)
def test_compiled_kernel_matches_references_on_10m_elements(mode):
    fmt = StateFormat(mode)
    n = 10_000_019  # not a multiple of the block
    rng = np.random.default_rng(2026)
    p, state = H.random_params(rng, n), H.random_state(rng, n, fmt)
    steps = [(1, Hyperparams(lr=1e-3, weight_decay=0.01), False),
             (2, Hyperparams(lr=3e-2, weight_decay=0.0), False),
             (10_000, Hyperparams(lr=1e-4, weight_decay=0.05), True)]
    for count, hp, write_update in steps:
        g = H.random_grads(rng, n, fmt)
        H.inject_nonfinite(rng, g, fraction=1e-4)
        k = H.run_kernel(p, g, state, count=count, hp=hp, fmt=fmt, write_update=write_update, device="cuda")
        compare(k, p, g, state, count=count, hp=hp, fmt=fmt, write_update=write_update,
                what=f"{fmt.identity} count={count}")
        if write_update:
            H.assert_same_bits(k.param_buffer, p, "param buffer untouched by write_update")
            H.assert_same_bits(k.state_buffer, state, "state buffer untouched by write_update")
        p, state = (p + k.out if write_update else k.out), k.state


def test_tensor_past_2_31_elements_uses_64_bit_offsets():
    """2**31 + 5 elements, packed, in place (about 26 GB on the GPU). numpy checks slices at
    the start, the middle, and across index 2**31 to the end; the nonfinite count checks all."""
    n = 2**31 + 5
    fmt = StateFormat("packed")
    hp = Hyperparams(lr=1e-3, weight_decay=0.1)
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs about 40 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    g.mul_(torch.exp2(torch.empty(n, device="cuda").uniform_(-30.0, 0.0, generator=gen)))
    words = torch.randint(-2**31, 2**31, (n,), dtype=torch.int32, device="cuda", generator=gen)
    nonfinite_at = torch.tensor([3, 2**30, 2**31 - 1, 2**31, 2**31 + 2, n - 1], device="cuda")
    g[nonfinite_at] = torch.tensor([float("nan"), float("inf"), float("-inf")] * 2, device="cuda")
    mib = 1 << 20
    slices = [slice(0, mib), slice(2**30 - mib // 2, 2**30 + mib // 2), slice(n - mib, n)]
    before = [(p[s].cpu().numpy(), g[s].cpu().numpy(), words[s].cpu().numpy().view(U32)) for s in slices]

    _, _, nonfinite = H.launch_kernel(p, g, words, count=3, hp=hp, fmt=fmt)
    torch.cuda.synchronize()
    assert int(nonfinite[0, 0]) == nonfinite_at.numel()  # the only non-finite gradients
    for s, (p0, g0, w0) in zip(slices, before):
        expected_p, expected_w, rejected = H.numpy_reference(p0, g0, w0, count=3, hp=hp, fmt=fmt)
        what = f"elements [{s.start}, {s.stop})"
        H.assert_same_bits(p[s].cpu().numpy(), expected_p, f"params {what}")
        H.assert_same_bits(words[s].cpu().numpy().view(U32), expected_w, f"words {what}")
    assert not np.array_equal(H.bits(p[-mib:].cpu().numpy()), H.bits(before[-1][0]))  # the tail was written


def compiled_kernels(fn, device_index: int) -> dict:
    """The compiled variants Triton holds for `fn` on one device: `device_caches[dev][0]` in
    triton 3.x (3.6-3.9 included), `cache[dev]` in older releases."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        entry = caches.get(device_index)  # .get: do not create an entry in the defaultdict
        return {} if entry is None else dict(entry[0])
    cache = getattr(fn, "cache", None)
    if isinstance(cache, dict):
        return dict(cache.get(device_index, {}))
    pytest.fail("cannot find the kernel cache of this triton version; update compiled_kernels()")


def test_new_learning_rate_and_count_do_not_recompile():
    from packed_adamw.core.adamw.kernel import adamw_kernel, step_scalars_kernel

    fmt = StateFormat("packed")
    n = 100_000
    rng = np.random.default_rng(1)
    p, state = H.random_params(rng, n), H.random_state(rng, n, fmt)
    g = H.random_grads(rng, n, fmt)
    device_index = torch.cuda.current_device()
    kernels = {"adamw_kernel": adamw_kernel, "step_scalars_kernel": step_scalars_kernel}
    snapshot = lambda: {name: set(compiled_kernels(fn, device_index)) for name, fn in kernels.items()}  # noqa: E731
    before = snapshot()
    H.run_kernel(p, g, state, count=1, hp=Hyperparams(lr=1e-3, weight_decay=0.0), fmt=fmt, device="cuda")
    after_first = snapshot()
    for name in kernels:
        assert after_first[name], f"{name}: no compiled variant found; compiled_kernels() looks in the wrong place"
        assert len(after_first[name] - before[name]) <= 1  # at most this signature's one variant
    for count, hp in [(2, Hyperparams(lr=5e-2, weight_decay=0.1)), (123_456, Hyperparams(lr=7.0, b1=0.5, b2=0.9))]:
        H.run_kernel(p, g, state, count=count, hp=hp, fmt=fmt, device="cuda")
        assert snapshot() == after_first, f"recompiled for count={count}, {hp}"
