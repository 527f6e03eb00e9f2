"""What format counting costs a training loop that counts only some steps (CUDA).

    python benchmarks/investigations/format_sampling.py [--elements 268435456] [--every 10] [--rounds 40] [--out FILE]

Three `PackedAdamW` optimizers step one FP32 tensor each, in rounds: one never counts, one
counts every step (`track_format=True`), one counts every `--every`-th step by switching
`opt.track_format` between steps, as the trainer's `--format-steps logged` does. Each round
times `2 * --every` steps of each optimizer, back to back, with CUDA events (the counts are
read after the timings, as a loop reads them when it logs). The ratios are each round's time
against the uncounted optimizer's in the same round; the table gives their medians and
ranges. The SM clock moves under the power cap, and the counting launch's cost rose as it fell
in docs/results/SWEEP.md's launch timings, so only ratios within one run compare.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from packed_adamw.torch import PackedAdamW

CASES = ("uncounted", "every step", "sampled")


def timed_steps(opt: PackedAdamW, steps: int, every: int | None) -> float:
    """Milliseconds for `steps` steps; `every`: count only every every-th (None: leave the switch)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        if every is not None:
            opt.track_format = i % every == 0
        opt.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 28, help="elements of the tensor (default 2**28)")
    parser.add_argument("--every", type=int, default=10, help="the sampled optimizer counts every N-th step")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.every < 2 or args.rounds < 1 or args.elements < 1:
        parser.error("--every must be at least 2, --rounds and --elements at least 1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    optimizers = {}
    for case in CASES:
        p = torch.nn.Parameter(torch.randn(args.elements, device="cuda", generator=gen))
        p.grad = torch.randn(args.elements, device="cuda", generator=gen) * 1e-3
        optimizers[case] = PackedAdamW([p], lr=1e-4, track_format=case != "uncounted")
    steps, every = 2 * args.every, {"uncounted": None, "every step": None, "sampled": args.every}
    for case, opt in optimizers.items():  # warm-up: compile every launch, build the plans
        timed_steps(opt, steps, every[case])
    ratios = {case: [] for case in CASES[1:]}
    for _ in range(args.rounds):
        times = {case: timed_steps(opt, steps, every[case]) for case, opt in optimizers.items()}
        for case in ratios:
            ratios[case].append(times[case] / times["uncounted"])
        for case in CASES[1:]:
            optimizers[case].format_stats()  # the loop's read, outside the timings
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.elements:,} FP32 elements, "
             f"{args.rounds} rounds of {steps} steps; the sampled optimizer counts every {args.every}th step", "",
             "| optimizer | median time / uncounted | min | max |", "|---|---|---|---|"]
    for case, values in ratios.items():
        label = f"counting every {args.every}th step" if case == "sampled" else "counting every step"
        lines.append(f"| {label} | {statistics.median(values):.3f}x | {min(values):.3f}x | {max(values):.3f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
