"""The trainer's "optimizer step ms" taken apart: host time of `optimizer.step()` and the wait
for its kernels after it, per optimizer, in one process (the same GPU, the same data).

    python benchmarks/investigations/trainer_step_parts.py --optimizers torch-adamw-fused packed-adamw \
        -- --config reference --data runs/data/shakespeare --batch-size 32 --max-steps 150 --autocast bf16

The trainer times its optimizer phase from a `torch.cuda.synchronize()` after the backward
pass to one after `optimizer.step()` (train.py). This runs the trainer (its arguments after
`--`, plus `--optimizer`, `--out`, `--no-checkpoints --no-progress --eval-every 0`) with
`torch.cuda.synchronize` wrapped to note when each call starts and returns. Of the step's two
synchronisations, the time from the first's return to the second's start is the host time of
the step (`format_counts.before_step` and `optimizer.step()`), and the second's own duration
the wait for the kernels still queued. Medians from step 6 on, in ms, beside the trainer's own
`median_optimizer_ms`. For PackedAdamW it also counts full steps (a step whose plan did not
hold: every tensor checked again).

Two diagnostics of why the step's host time in the trainer is a multiple of the isolated one
(they change what is measured, so their rows are not the trainer's figures):
`--repeat-step` runs a second `optimizer.step()` right after each timed one, the GPU idle and the
learning rates set again as new float objects (the trainer's lr-changed path), and reports its
host time as "repeat host ms": the same step with the CPU caches warm from the first (the repeat
takes a second optimizer step, so the run trains differently). `--gc off` runs the trainer with
Python's garbage collector disabled.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from packed_adamw.torch import _engine
from packed_adamw.torch.gpt import train


def run(optimizer: str, trainer_args: list[str], repeat_step: bool = False) -> dict:
    calls: list[tuple[float, float]] = []
    host, wait, repeat_host = [], [], []
    real_sync, real_full, real_add = torch.cuda.synchronize, _engine.full_step, train.StepTimes.add
    real_zero_grad = torch.optim.Optimizer.zero_grad
    full_steps = [0]
    optimizers: list[torch.optim.Optimizer] = []

    def noted_zero_grad(self, *args, **kwargs):  # the trainer's optimizer, whatever its class
        if not optimizers:
            optimizers.append(self)
        return real_zero_grad(self, *args, **kwargs)

    def noted_sync(*args, **kwargs):
        t0 = time.perf_counter()
        real_sync(*args, **kwargs)
        calls.append((t0, time.perf_counter()))

    def counted_full_step(*args, **kwargs):
        full_steps[0] += 1
        return real_full(*args, **kwargs)

    def noted_add(self, start, after_backward, end):  # once a step, after its two synchronisations
        (_, first_returned), (second_started, second_returned) = calls[-2:]
        host.append(second_started - first_returned)
        wait.append(second_returned - second_started)
        if repeat_step:
            optimizer = optimizers[0]
            for group in optimizer.param_groups:
                if not isinstance(group["lr"], torch.Tensor):  # (a tensor lr is left as it is)
                    group["lr"] = group["lr"] * 1.0 + 0.0  # a new float object: the lr-changed path
            t0 = time.perf_counter()
            optimizer.step()
            repeat_host.append(time.perf_counter() - t0)
            real_sync()
        real_add(self, start, after_backward, end)

    torch.cuda.synchronize, _engine.full_step, train.StepTimes.add = noted_sync, counted_full_step, noted_add
    torch.optim.Optimizer.zero_grad = noted_zero_grad
    try:
        with tempfile.TemporaryDirectory() as out:
            train.main([*trainer_args, "--optimizer", optimizer, "--out", out, "--no-checkpoints",
                        "--no-progress", "--eval-every", "0"])
            summary = json.loads((Path(out) / "summary.json").read_text())
    finally:
        torch.cuda.synchronize, _engine.full_step, train.StepTimes.add = real_sync, real_full, real_add
        torch.optim.Optimizer.zero_grad = real_zero_grad
    host, wait = host[5:], wait[5:]
    repeat = {"repeat host ms": 1e3 * statistics.median(repeat_host[5:])} if repeat_step else {}
    return {"steps timed": len(host), "host ms": 1e3 * statistics.median(host),
            "wait ms": 1e3 * statistics.median(wait), "host + wait ms": 1e3 * statistics.median(
                [h + w for h, w in zip(host, wait)]),
            "trainer median_optimizer_ms": summary["median_optimizer_ms"], "full steps": full_steps[0],
            **repeat}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", nargs="+", default=["torch-adamw-fused", "packed-adamw"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each optimizer, alternating, the order reversed every other round")
    parser.add_argument("--out", type=Path, help="also write the rounds' results to this JSON file")
    parser.add_argument("--repeat-step", action="store_true",
                        help="diagnostic: time a second step right after each timed one (warm caches)")
    parser.add_argument("--gc", choices=["on", "off"], default="on",
                        help="diagnostic: off runs the trainer with Python's garbage collector disabled")
    args = parser.parse_args(argv[:split])
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if len(set(args.optimizers)) != len(args.optimizers):
        parser.error(f"--optimizers names one twice ({' '.join(args.optimizers)}): each is timed in its own "
                     "rounds, so a name given twice would be paired with itself")
    trainer_args = argv[split + 1:]
    if not torch.cuda.is_available():
        print("trainer_step_parts.py needs a CUDA GPU", file=sys.stderr)
        return 2
    results = {}
    if args.gc == "off":
        gc.disable()
    try:
        for i in range(args.rounds):  # ABBA...: a drift of the machine over the call falls on both
            for name in (args.optimizers if i % 2 == 0 else args.optimizers[::-1]):
                results.setdefault(name, []).append(run(name, trainer_args, args.repeat_step))
                if args.out:  # after every run: a timeout or a crash keeps the rounds before it
                    write(args.out, trainer_args, args, results, summary=None)
    finally:
        gc.enable()
    print(f"trainer arguments: {' '.join(trainer_args)}; gc {args.gc}"
          + ("; a repeated step after each" if args.repeat_step else ""))
    for name, rounds in results.items():
        for i, result in enumerate(rounds):
            print(f"{name} (round {i + 1}): " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    summary = summarise(results, args.optimizers)
    for line in summary["lines"]:
        print(line)
    if args.out:
        write(args.out, trainer_args, args, results, summary)
    return 0


def write(path: Path, trainer_args: list[str], args, results: dict, summary: dict | None) -> None:
    """The rounds so far (and the summary once all have run) as JSON, replaced whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"trainer arguments": trainer_args, "gc": args.gc, "repeat step": args.repeat_step,
                                   "rounds": results, "summary": summary}, indent=1) + "\n")
    partial.replace(path)


def summarise(results: dict[str, list[dict]], optimizers: list[str]) -> dict:
    """Per optimizer the median over rounds of the trainer's `median_optimizer_ms`; per later
    optimizer its ratio to the first's round by round (each optimizer runs once a round, so
    round i of each is the same stretch of the call), with the median and range of those
    ratios."""
    key = "trainer median_optimizer_ms"
    first = [r[key] for r in results[optimizers[0]]]
    out = {"median ms": {name: statistics.median(r[key] for r in results[name]) for name in optimizers},
           "paired ratios": {}, "lines": []}
    for name in optimizers:
        out["lines"].append(f"{name}: median over {len(results[name])} rounds of the trainer's median_optimizer_ms "
                            f"{out['median ms'][name]:.3f}")
    for name in optimizers[1:]:
        ratios = [r[key] / f for r, f in zip(results[name], first)]
        out["paired ratios"][name] = ratios
        out["lines"].append(
            f"{name} / {optimizers[0]}, round by round: median {statistics.median(ratios):.3f}, range "
            f"{min(ratios):.3f}-{max(ratios):.3f}, {sum(r <= 1.0 for r in ratios)} of {len(ratios)} rounds at most 1.0")
    return out


if __name__ == "__main__":
    sys.exit(main())
