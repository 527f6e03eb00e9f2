"""Muon on the GPU, Newton-Schulz by cuBLAS (torch's matmuls) or by core/muon's Triton kernels,
in torch and JAX: step times against torch.optim.Muon and optax.contrib.muon.

    python benchmarks/muon_ns_timing.py --out docs/results/MUON_NS.md

The matrix lists are bench_muon.py's (the reference GPT's 32, GPT-2 124M's 48, d12's 72, the
1.3B list's 96; FP32 parameters, random gradients). Rows:
- torch.optim.Muon; PackedMuon (packed momentum) with ns_impl "cublas" / "triton", per matrix
  and `batch_ns` ("triton" with `batch_ns` is what PackedMuon's defaults choose on CUDA);
- Newton-Schulz alone over the list's shape batches: `newton_schulz_stacked` (cuBLAS bmm) and
  `newton_schulz_triton_stacked` (the kernels), no elementwise phase;
- JAX under jax.jit (with --jax): packed_muon (the GPU path: jax-triton kernels, Triton
  Newton-Schulz) and optax.contrib.muon, each `update` + `optax.apply_updates`, on [in, out]
  leaves (torch's shapes reversed), donated.
Torch times are CUDA-event means of `--steps` back-to-back steps, median of `--repeats`; JAX
times are wall-clock means of `--steps` jitted steps ended by block_until_ready, median of
`--repeats`. Ratios: torch rows against torch.optim.Muon, JAX rows against optax.contrib.muon.

Each list's floor row: Newton-Schulz's GEMM FLOPs (`ns_gemm_flops`: the full products torch
computes, five quintic iterations) at the bf16 GEMM rate measured in the same run (a large
batched matmul), plus the elementwise phases' bytes (`ELEMENTWISE_BYTES` per parameter) at the
device-to-device copy bandwidth measured in the same run. The Triton Newton-Schulz computes
the two symmetric products on and above the diagonal only, fewer FLOPs than that count.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_muon import LISTS, matrices  # noqa: E402
from bench_step import copy_bandwidth  # noqa: E402

from packed_adamw.torch import PackedMuon  # noqa: E402
from packed_adamw.torch.muon import newton_schulz_stacked, newton_schulz_triton_stacked  # noqa: E402

TORCH_KINDS = ("torch.optim.Muon", "cublas", "cublas batch_ns", "triton", "triton batch_ns")
DEFAULT_KIND = "triton batch_ns"  # PackedMuon() on CUDA: ns_impl="auto", batch_ns=None
# A packed-momentum step on float32 weights, in place: read the gradient (4) and the momentum
# code (2), write the new code (2) and the bf16 Newton-Schulz input (2); read its bf16 result
# (2), read and write the weight (4 + 4).
ELEMENTWISE_BYTES = 20
NS_STEPS = 5


def ns_gemm_flops(shapes, steps: int = NS_STEPS) -> int:
    """Newton-Schulz's GEMM FLOPs over `shapes` (k <= n after the transpose a tall matrix
    takes): per iteration the Gram matrix (2 k^2 n), its square (2 k^3) and the product with
    the iterate (2 k^2 n)."""
    total = 0
    for rows, cols in shapes:
        k, n = min(rows, cols), max(rows, cols)
        total += steps * (4 * k * k * n + 2 * k ** 3)
    return total


def bf16_gemm_flops_per_ms() -> float:
    """The bf16 GEMM rate of a large batched matmul ([8, 4096, 4096] @ [8, 4096, 4096]), FLOPs/ms."""
    a = torch.randn((8, 4096, 4096), device="cuda").bfloat16()
    b = torch.randn((8, 4096, 4096), device="cuda").bfloat16()
    ms = statistics.median(cuda_ms(lambda: torch.bmm(a, b), 10) for _ in range(3))
    return 2 * 8 * 4096 ** 3 / ms


def make_torch(shapes, kind: str):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    if kind == "torch.optim.Muon":
        return torch.optim.Muon(params, lr=0.02, momentum=0.95)
    if kind == "defaults":  # PackedMuon's own choice (investigations/muon_batch_memory.py)
        return PackedMuon(params, lr=0.02, momentum=0.95)
    impl, _, batched = kind.partition(" ")
    return PackedMuon(params, lr=0.02, momentum=0.95, ns_impl=impl, batch_ns=batched == "batch_ns")


def cuda_ms(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def ns_batches(shapes):
    """One bf16 [B, k, n] stack per wide shape of the list."""
    counts: dict[tuple, int] = {}
    for rows, cols in shapes:
        key = (min(rows, cols), max(rows, cols))
        counts[key] = counts.get(key, 0) + 1
    return [torch.randn((b, k, n), device="cuda").bfloat16() for (k, n), b in counts.items()]


def jax_problem(shapes):
    """The list's [in, out] float32 leaves (torch's shapes reversed) and random gradients."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {f"m{i:03d}": jnp.asarray((rng.standard_normal((c, r)) * 0.02).astype(np.float32))
              for i, (r, c) in enumerate(shapes)}
    grads = {k: jnp.asarray((rng.standard_normal(v.shape) * 1e-3).astype(np.float32)) for k, v in params.items()}
    return params, grads


def jax_train_step(tx):
    """`tx.update` + `optax.apply_updates`, jitted with the parameters and state donated."""
    import jax
    import optax

    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    return jax.jit(step, donate_argnums=(0, 1))


def jax_step_ms(tx, params, grads, steps: int, repeats: int) -> float:
    """Median over `repeats` of the wall-clock mean of `steps` chained donated steps."""
    import jax
    import jax.numpy as jnp

    step = jax_train_step(tx)
    p, s = jax.tree.map(jnp.copy, params), tx.init(params)
    p, s = step(p, s, grads)
    jax.block_until_ready(p)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(steps):
            p, s = step(p, s, grads)
        jax.block_until_ready(p)
        times.append((time.perf_counter() - begin) * 1e3 / steps)
    return statistics.median(times)


def jax_optimizers():
    import optax

    from packed_adamw.jax import packed_muon

    return {"optax.contrib.muon": optax.contrib.muon(0.02, beta=0.95),
            "packed_muon (GPU, Triton NS)": packed_muon(0.02, beta=0.95)}


def jax_rows(shapes, steps: int, repeats: int) -> dict[str, float]:
    params, grads = jax_problem(shapes)
    return {name: jax_step_ms(tx, params, grads, steps, repeats) for name, tx in jax_optimizers().items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lists", nargs="+", default=list(LISTS), choices=LISTS)
    parser.add_argument("--jax", action="store_true", help="also time packed_muon and optax.contrib.muon")
    args = parser.parse_args(argv)
    gemm_rate, bandwidth = bf16_gemm_flops_per_ms(), copy_bandwidth()
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}; measured in this run: bf16 GEMM "
             f"{gemm_rate / 1e9:.0f} TFLOP/s, copy bandwidth {bandwidth / 1e9:.2f} TB/s (read + write)", "",
             "| list | matrices | parameters | row | ms/step | ratio |", "|---|---|---|---|---|---|"]

    def row(name, shapes, label, ms, ratio):
        n = sum(a * b for a, b in shapes)
        lines.append(f"| {name} | {len(shapes)} | {n:,} | {label} | {ms:.3f} | {ratio} |")
        print(lines[-1], flush=True)

    for name in args.lists:
        shapes = matrices(name)
        opts = {kind: make_torch(shapes, kind) for kind in TORCH_KINDS}
        times = {kind: [] for kind in TORCH_KINDS}
        for _ in range(args.repeats):
            for kind in TORCH_KINDS:
                times[kind].append(cuda_ms(opts[kind].step, args.steps))
        base = statistics.median(times["torch.optim.Muon"])
        for kind in TORCH_KINDS:
            ms = statistics.median(times[kind])
            label = kind if kind == "torch.optim.Muon" else f"PackedMuon packed, ns_impl={kind}"
            if kind == DEFAULT_KIND:
                label += " (the CUDA default)"
            row(name, shapes, label, ms, f"{ms / base:.2f}x torch.optim.Muon")
        del opts
        stacks = ns_batches(shapes)
        for label, fn in (("Newton-Schulz only, cuBLAS bmm", newton_schulz_stacked),
                          ("Newton-Schulz only, Triton kernels", newton_schulz_triton_stacked)):
            ms = statistics.median(cuda_ms(lambda fn=fn: [fn(y) for y in stacks], args.steps)
                                   for _ in range(args.repeats))
            row(name, shapes, label, ms, f"{ms / base:.2f}x torch.optim.Muon")
        del stacks
        torch.cuda.empty_cache()
        n_params = sum(a * b for a, b in shapes)
        floor = ns_gemm_flops(shapes) / gemm_rate + ELEMENTWISE_BYTES * n_params / bandwidth
        row(name, shapes, f"floor: {ns_gemm_flops(shapes) / 1e12:.2f} TFLOP + {ELEMENTWISE_BYTES} B/param", floor,
            f"{floor / base:.2f}x torch.optim.Muon")
        if args.jax:
            jax_times = jax_rows(shapes, args.steps, args.repeats)
            base = jax_times["optax.contrib.muon"]
            for label, ms in jax_times.items():
                row(name, shapes, f"JAX jit: {label}", ms, f"{ms / base:.2f}x optax.contrib.muon")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
