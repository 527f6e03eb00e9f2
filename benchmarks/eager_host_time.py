"""Host time of one eager `step()` on one CUDA GPU: PackedAdamW against torch.optim.AdamW(fused=True).

    python benchmarks/eager_host_time.py --out docs/results/EAGER_HOST.md

A small list of tensors makes an eager step host bound: what the Python side of `step()`
costs decides its time, not the kernels. Each optimizer steps the reference GPT's list (100
tensors) and GPT-2 124M's (148), in two groups as a trainer makes them (weight decay 0.1 on
matrices, 0 on the rest), every parameter with a gradient. Measured per optimizer and list:

- host: `time.perf_counter()` around `step()` alone, with the GPU kept busy by queued
  matmuls, so the host never waits for the step's kernels. The queue is drained every
  `--queue` steps (default: PackedAdamW's staging ring, `_launch.StagingRing.DEPTH`), since a
  plan that steps further ahead of the GPU waits for the launch `DEPTH` steps back, and a
  fused AdamW given the same budget is measured the same way.
- host, lr changed: the same with every group's lr changed before each step (a scheduler),
  outside the timed call.
- device: CUDA events around `--queue` steps queued behind the matmuls, so the events time
  the steps' kernels back to back, not the host.
- loop: wall time per iteration of `clip_grad_norm_(params, 1.0)`, an lr change and `step()`,
  run back to back (what a training loop's optimizer phase costs; the slower of host and
  device decides it).

Times are medians over `--rounds` rounds; ratios are PackedAdamW over fused AdamW in the
same run (below 1: PackedAdamW is faster).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import torch

from bench_step import SHAPE_LISTS
from packed_adamw.torch import PackedAdamW
from packed_adamw.torch._launch import StagingRing

LISTS = {  # the two host-bound lists of bench_step.py
    "reference GPT (100 tensors)": SHAPE_LISTS["reference GPT (d 288, 8 layers, tied head)"],
    "GPT-2 124M (148 tensors)": SHAPE_LISTS["GPT-2 124M"],
}
OPTIMIZERS = {
    "torch fused AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-3, fused=True),
    "PackedAdamW packed": lambda groups: PackedAdamW(groups, lr=1e-3),
}
BUSY_SIZE = 8192  # the matmul that keeps the GPU busy: 8192^3 bf16 multiply-adds


def make_groups(shapes, seed=0) -> tuple[list, list[dict]]:
    """Parameters with gradients on the GPU, in a trainer's two groups."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return params, groups


class Busy:
    """Queues matmuls that keep the GPU busy for at least `ms` milliseconds."""

    def __init__(self, ms: float):
        self.a = torch.randn(BUSY_SIZE, BUSY_SIZE, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        torch.matmul(self.a, self.a, out=self.out)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            torch.matmul(self.a, self.a, out=self.out)
        end.record()
        torch.cuda.synchronize()
        self.count = max(1, int(ms / (start.elapsed_time(end) / 5)) + 1)

    def queue(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.a, out=self.out)


def set_lr(opt, step: int) -> None:
    for group in opt.param_groups:
        group["lr"] = 1e-3 * (1.0 + 0.01 * (step % 50))


def host_ms(opt, busy: Busy, steps: int, queue: int, change_lr: bool) -> float:
    """Median host time of one step() (ms), the GPU busy with matmuls queued before each
    `queue` steps."""
    samples = []
    for i in range(steps):
        if i % queue == 0:
            torch.cuda.synchronize()
            busy.queue()
        if change_lr:
            set_lr(opt, i)
        t0 = time.perf_counter()
        opt.step()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e3


def device_ms(opt, busy: Busy, samples: int, queue: int) -> float:
    """Median device time of one step (ms): events around `queue` steps queued behind busy work."""
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        busy.queue()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(queue):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / queue)
    return statistics.median(times)


def loop_ms(opt, params, steps: int, clip: bool = True, change_lr: bool = True, step: bool = True) -> float:
    """Wall time per iteration of clip_grad_norm_, an lr change and step(), back to back (the
    parts left out as asked: benchmarks/investigations/eager_loop_parts.py)."""
    def iteration(i):
        if clip:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        if change_lr:
            set_lr(opt, i)
        if step:
            opt.step()

    for i in range(10):
        iteration(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        iteration(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def measure(shapes, make_opt, busy: Busy, args) -> dict:
    params, groups = make_groups(shapes)
    opt = make_opt(groups)
    for _ in range(5):  # state, plan, compiled kernels
        opt.step()
    torch.cuda.synchronize()
    result = {
        "host": host_ms(opt, busy, args.steps, args.queue, change_lr=False),
        "host, lr changed": host_ms(opt, busy, args.steps, args.queue, change_lr=True),
        "device": device_ms(opt, busy, max(5, args.steps // (4 * args.queue)), args.queue),
        "loop": loop_ms(opt, params, args.steps),
    }
    del opt, params, groups
    torch.cuda.empty_cache()
    return result


METRICS = ("host", "host, lr changed", "device", "loop")


def render(results: dict, args) -> str:
    lines = [
        "# Eager step host time: PackedAdamW against torch fused AdamW",
        "",
        f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}; `python benchmarks/eager_host_time.py "
        f"--steps {args.steps} --rounds {args.rounds} --queue {args.queue}`.",
        "",
        "Times in ms per step, medians over rounds; ratio: PackedAdamW / fused AdamW (below 1: faster).",
        "",
        "| list | measure | torch fused AdamW | PackedAdamW packed | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for list_name, by_opt in results.items():
        for metric in METRICS:
            fused = statistics.median(r[metric] for r in by_opt["torch fused AdamW"])
            packed = statistics.median(r[metric] for r in by_opt["PackedAdamW packed"])
            lines.append(f"| {list_name} | {metric} | {fused:.4f} | {packed:.4f} | {packed / fused:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per measurement (default 400)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, optimizers interleaved (default 3)")
    parser.add_argument("--queue", type=int, default=StagingRing.DEPTH,
                        help="steps queued behind the busy GPU before draining it (default: the staging ring's "
                             f"depth, {StagingRing.DEPTH})")
    parser.add_argument("--busy-ms", type=float, default=5.0,
                        help="GPU time the queued matmuls take each time (default 5 ms; it must outlast --queue "
                             "steps' host time)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("eager_host_time.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.queue < 1 or args.steps < args.queue or args.rounds < 1:
        parser.error("--queue must be at least 1, --steps at least --queue, --rounds at least 1")
    busy = Busy(args.busy_ms)
    results = {name: {opt: [] for opt in OPTIMIZERS} for name in LISTS}
    for r in range(args.rounds):
        for list_name, shapes in LISTS.items():
            for opt_name, make_opt in OPTIMIZERS.items():
                result = measure(shapes, make_opt, busy, args)
                results[list_name][opt_name].append(result)
                print(f"round {r} | {list_name} | {opt_name} | "
                      + ", ".join(f"{k} {v:.4f} ms" for k, v in result.items()), flush=True)
    table = render(results, args)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
