"""Muon step times on the GPU: PackedMuon (packed, bf16, fp32 momentum; per-matrix and batched
Newton-Schulz) against torch.optim.Muon.

    python benchmarks/bench_muon.py --out docs/results/MUON_STEP.md

Each list is the Muon matrices of a model (FP32 parameters, random gradients): the reference
GPT's 32, GPT-2 124M's 48, a nanochat d12's 72 (q, k, v, proj, fc, mlp proj per layer), a 1.3B
list's 96. Times are CUDA-event medians of `--repeats` means of `--steps` back-to-back steps,
the optimizers alternating by round; state bytes are torch.cuda.memory_allocated around the
first step, per parameter. Rows with `batch_ns` run Newton-Schulz batched over the matrices of
one shape; their last column says whether, after all the timed steps, their weights and momentum
equal the per-matrix run's of the same mode bit for bit (both start equal and step on equal
gradients). Newton-Schulz runs with torch's matmuls here (`ns_impl="cublas"`, torch.optim.Muon's);
benchmarks/muon_ns_timing.py times the Triton kernels, the CUDA default.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from packed_adamw.torch import PackedMuon


def matrices(name: str) -> list[tuple[int, int]]:
    if name == "reference GPT":  # d 288, 8 layers: qkv (864x288), proj, fc (1152x288), mlp proj
        return [(864, 288), (288, 288), (1152, 288), (288, 1152)] * 8
    if name == "GPT-2 124M":
        return [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
    if name == "d12":
        return [(768, 768)] * 4 * 12 + [(3072, 768), (768, 3072)] * 12
    if name == "1.3B":
        return [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)] * 24
    raise ValueError(name)


LISTS = ("reference GPT", "GPT-2 124M", "d12", "1.3B")


KINDS = ("torch.optim.Muon", "packed", "bf16", "fp32", "packed batch_ns", "fp32 batch_ns")


def make(shapes, kind: str):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    if kind == "torch.optim.Muon":
        return params, torch.optim.Muon(params, lr=0.02, momentum=0.95)
    mode, _, batched = kind.partition(" ")
    return params, PackedMuon(params, lr=0.02, momentum=0.95, mode=mode, batch_ns=batched == "batch_ns",
                              ns_impl="cublas")


def same_bits(a, b) -> str:
    """Whether two PackedMuon runs hold equal weights and state, bit for bit."""
    (params_a, opt_a), (params_b, opt_b) = a, b
    for p, q in zip(params_a, params_b):
        tensors = [(p, q)] + [(opt_a.state[p][k], opt_b.state[q][k]) for k in opt_a.state[p]]
        if not all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in tensors):
            return "no"
    return "yes"


def time_steps(opt, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lists", nargs="+", default=list(LISTS), choices=LISTS)
    args = parser.parse_args(argv)
    lines = ["| list | matrices | parameters | optimizer | ms/step | vs torch.optim.Muon | state B/param | "
             "bits = per-matrix |", "|---|---|---|---|---|---|---|---|"]
    for name in args.lists:
        shapes = matrices(name)
        n = sum(a * b for a, b in shapes)
        built, state_bytes = {}, {}
        for kind in KINDS:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            params, opt = make(shapes, kind)
            after_params = torch.cuda.memory_allocated()
            opt.step()
            torch.cuda.synchronize()
            state_bytes[kind] = (torch.cuda.memory_allocated() - after_params) / n
            built[kind] = (params, opt)
            del before
        times = {kind: [] for kind in KINDS}
        for _ in range(args.repeats):
            for kind in KINDS:
                time_steps(built[kind][1], 2)
                times[kind].append(time_steps(built[kind][1], args.steps))
        base = statistics.median(times["torch.optim.Muon"])
        for kind in KINDS:
            t = statistics.median(times[kind])
            label = kind if kind == "torch.optim.Muon" else f"PackedMuon {kind}"
            mode, _, batched = kind.partition(" ")
            equal = same_bits(built[mode], built[kind]) if batched else ""
            lines.append(f"| {name} | {len(shapes)} | {n:,} | {label} | {t:.3f} | {t / base:.2f}x | "
                         f"{state_bytes[kind]:.3f} | {equal} |")
            print(lines[-1], flush=True)
        del built
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
