"""Where the eager loop's time goes: PackedAdamW against torch fused AdamW on the reference
GPT's 100 tensors (benchmarks/eager_host_time.py's "loop", 1.12x on an H100 on 2026-12-05/06).

    python benchmarks/investigations/eager_loop_parts.py [--steps 400] [--profile FILE]

The loop iteration is `clip_grad_norm_`, an lr change and `step()`, back to back with the GPU
otherwise idle. This times each combination of those parts (wall time per iteration, median of
--rounds), so the difference between the optimizers can be placed: in the step itself, in the
step after a clip (the gradients were just written by a kernel), or in the lr change. With
--profile it also writes torch.profiler's table of the full loop's host operations per
optimizer (self CPU time, top 30), to name the calls that make the difference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from eager_host_time import LISTS, OPTIMIZERS, loop_ms, make_groups  # noqa: E402

VARIANTS = {  # name -> which parts run: clip, lr change, step
    "step": dict(clip=False, change_lr=False),
    "lr + step": dict(clip=False),
    "clip + step": dict(change_lr=False),
    "clip + lr + step (the loop)": dict(),
    "clip alone": dict(change_lr=False, step=False),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--list", default="reference GPT (100 tensors)", choices=list(LISTS))
    parser.add_argument("--profile", help="write the profiler tables here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("eager_loop_parts.py needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = LISTS[args.list]
    times = {(o, v): [] for o in OPTIMIZERS for v in VARIANTS}
    for _ in range(args.rounds):
        for opt_name, make_opt in OPTIMIZERS.items():
            params, groups = make_groups(shapes)
            opt = make_opt(groups)
            for variant, parts in VARIANTS.items():
                times[opt_name, variant].append(loop_ms(opt, params, args.steps, **parts))
            del opt, params, groups
    names = list(OPTIMIZERS)
    print(f"{args.list}: ms per iteration, median of {args.rounds} rounds of {args.steps}")
    print(f"| parts | {' | '.join(names)} | difference | ratio |")
    print("|---|" + "---:|" * (len(names) + 2))
    for variant in VARIANTS:
        a, b = (statistics.median(times[o, variant]) for o in names)
        print(f"| {variant} | {a:.4f} | {b:.4f} | {b - a:+.4f} | {b / a:.3f} |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with open(args.profile, "w") as f:
            for opt_name, make_opt in OPTIMIZERS.items():
                params, groups = make_groups(shapes)
                opt = make_opt(groups)
                loop_ms(opt, params, 20)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    loop_ms(opt, params, 100)
                f.write(f"## {opt_name}: 110 loop iterations (10 warm-up)\n\n")
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n")
                del opt, params, groups
    return 0


if __name__ == "__main__":
    sys.exit(main())
