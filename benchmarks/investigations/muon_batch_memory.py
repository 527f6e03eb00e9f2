"""On a GPU, what PackedMuon's batched Newton-Schulz (its CUDA default) costs in memory and what
the batch limit (`torch_frontend/_muon_ns.py`, NS_BATCH_ELEMENTS) does to it and to the step time.

    python benchmarks/investigations/muon_batch_memory.py --out runs/muon_batch_memory.md

For each of bench_muon.py's lists and each limit (`--limits`, elements; 0 for none), a PackedMuon
with its defaults (packed momentum; on CUDA the Triton Newton-Schulz, batched) over the list's
FP32 matrices with random gradients, beside torch.optim.Muon: the step's transient memory is
torch.cuda.max_memory_allocated during one step minus memory_allocated before it (after two
warm steps, so state and compiled kernels exist); the step time is bench_muon's, the median of
`--repeats` CUDA-event means of `--steps` chained steps. One optimizer lives at a time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_muon import LISTS, matrices  # noqa: E402
from muon_ns_timing import cuda_ms, make_torch  # noqa: E402

from packed_adamw.torch import _muon_ns as torch_muon_ns  # noqa: E402


def measure(shapes, kind: str, steps: int, repeats: int) -> tuple[float, float]:
    """(transient MiB of one step, ms per step)."""
    opt = make_torch(shapes, "torch.optim.Muon" if kind == "torch.optim.Muon" else "defaults")
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    transient = (torch.cuda.max_memory_allocated() - before) / 2**20
    ms = statistics.median(cuda_ms(opt.step, steps) for _ in range(repeats))
    del opt
    torch.cuda.empty_cache()
    return transient, ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lists", nargs="+", default=["d12", "1.3B"], choices=LISTS)
    parser.add_argument("--limits", nargs="+", type=int, default=[0, 1 << 26, 1 << 25])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}", "",
             "| list | optimizer | batch limit (elements) | step transient MiB | ms/step |", "|---|---|---:|---:|---:|"]
    for name in args.lists:
        shapes = matrices(name)
        runs = [("torch.optim.Muon", None)] + [("PackedMuon defaults", limit) for limit in args.limits]
        for kind, limit in runs:
            if limit is not None:
                torch_muon_ns.NS_BATCH_ELEMENTS = limit or 1 << 62
            transient, ms = measure(shapes, kind, args.steps, args.repeats)
            shown = "" if limit is None else ("none" if not limit else f"{limit:,}")
            lines.append(f"| {name} | {kind} | {shown} | {transient:,.0f} | {ms:.3f} |")
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
