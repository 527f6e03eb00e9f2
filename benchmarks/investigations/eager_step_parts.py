"""Where the host time of one eager PackedAdamW step goes, part by part, beside torch fused
AdamW's whole step (benchmarks/eager_host_time.py's "host" measure, the same lists).

    python benchmarks/investigations/eager_step_parts.py [--calls 400] [--rounds 3]

Each part of the planned step (`_engine.step` -> `StepPlan.step`) is called on its own, again
and again, with the GPU kept busy by queued matmuls (eager_host_time's `Busy`), and timed by
`time.perf_counter()` around each call: the hyperparameter rows (`checked_row` per group), the
plan's gradient checks (`StepPlan._gradients`), the run (`StepPlan.run`: scalars, staging,
launches), and inside the run the staging copy and the launches alone. A few torch calls the
run makes are timed too, to say what a host operation costs on this machine. Medians over
rounds, in microseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from eager_host_time import LISTS, Busy, make_groups  # noqa: E402

from packed_adamw.torch import PackedAdamW  # noqa: E402
from packed_adamw.torch import _engine, _launch  # noqa: E402


def host_us(fn, busy: Busy, calls: int, queue: int) -> float:
    """Median host time of fn() (us), the GPU kept busy (drained and refilled every `queue` calls)."""
    samples = []
    for i in range(calls):
        if i % queue == 0:
            torch.cuda.synchronize()
            busy.queue()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def parts(shapes) -> dict:
    """name -> callable, for one fresh PackedAdamW (planned) and one fused AdamW."""
    _, groups = make_groups(shapes)
    fused = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    fused.step()
    _, groups = make_groups(shapes)
    opt = PackedAdamW(groups, lr=1e-3)
    opt.step()
    opt.step()
    plan = opt._plan
    rows = [_engine.checked_row(opt, group, i) for i, group in enumerate(opt.param_groups)]
    found = plan._gradients(opt)
    assert found is not None, "the plan does not hold after two steps"
    grads, grad_pointers, _ = found
    scalars = np.asarray([plan.rule.row_scalars(1, row) for row in rows], dtype=np.float32)
    staging = plan.staging

    def stage_and_send():
        pointers = staging.stage(scalars)
        pointers[:] = plan.static_pointers
        pointers[plan.grad_slots] = np.array(grad_pointers, dtype=np.int64)
        table = staging.send()
        staging.launched()
        return table

    table = stage_and_send()
    torch.cuda.synchronize()
    fmt, _, count_nonfinite = plan.options

    def launches():
        _launch.launch_step(plan.rule, table, plan.kernel_params, grads, plan.moments, plan.group_layout, fmt,
                            count_nonfinite, plan.aligned, plan.relaunch, plan.counters, False, lows=plan.lows)

    planned = [launches for launches in plan.launches.values() if launches]

    def planned_launches():
        for fast, grid, args in planned[0]:
            fast(grid, args)

    def record_function():
        with torch.autograd.profiler.record_function("Optimizer.step#PackedAdamW.step"):
            pass

    small = torch.empty(64, device="cuda")
    event = torch.cuda.Event()
    return {
        "fused AdamW: step()": fused.step,
        "PackedAdamW: step()": opt.step,
        "PackedAdamW: opt._update() (step() less torch.optim's hook wrapper)": opt._update,
        "PackedAdamW: _engine.step(opt) (less torch.compiler.disable)": lambda: _engine.step(opt),
        "torch.optim's wrapper: record_function alone": record_function,
        "rows (checked_row per group)": lambda: [_engine.checked_row(opt, g, i)
                                                 for i, g in enumerate(opt.param_groups)],
        "plan._gradients": lambda: plan._gradients(opt),
        "plan.run": lambda: plan.run(opt, grads, grad_pointers, opt.state[opt._plan.params[0]]["step"] + 1, rows),
        "run: stage, fill, send, event": stage_and_send,
        "run: launch_step": launches,
        **({"run: a plan's kept launches": planned_launches} if planned else {}),
        "torch: a slice of a CUDA tensor": lambda: small[8:],
        "torch: Event.record": event.record,
        "torch: current_stream()": torch.cuda.current_stream,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queue", type=int, default=_launch.StagingRing.DEPTH)
    parser.add_argument("--profile", action="store_true",
                        help="also print cProfile's top functions (internal time) over PackedAdamW's steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("eager_step_parts.py needs a CUDA GPU", file=sys.stderr)
        return 2
    busy = Busy(2.0)
    for list_name, shapes in LISTS.items():
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, fn in parts(shapes).items():
                times.setdefault(name, []).append(host_us(fn, busy, args.calls, args.queue))
        print(f"\n{list_name}: host us per call, median of {args.rounds} rounds of {args.calls}")
        print("| part | us |\n|---|---:|")
        for name, samples in times.items():
            print(f"| {name} | {statistics.median(samples):.1f} |")
        if args.profile:
            import cProfile
            import pstats
            step = parts(shapes)["PackedAdamW: step()"]
            profiler = cProfile.Profile()
            profiler.runcall(host_us, step, busy, args.calls, args.queue)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
