"""H200 sweep: the single-tensor kernel's launch shape for counting launches, and the split kernel.

    python benchmarks/sweep_counting.py [--elements N] [--out FILE]
    python benchmarks/sweep_counting.py --chosen [--passes 5] [--out FILE]

For one tensor of N float32 parameters (default 2**28), times `adamw_kernel` with format
counts (`track_format`) or non-finite counts on and off, over block sizes, warps and blocks
per program and the layouts of a program's blocks (`launch.LAYOUT_*`), against the default launch; then
`adamw_split_kernel` (bf16 weights with split
masters, bf16 and float32 gradients). Times are the median of 5 repeats of the mean of 20
back-to-back launches (CUDA events); the step scalars are derived once.

`--chosen` times only the launches the library makes (`launch.single_tensor_constants` and
`single_tensor_warps`, as the launchers call them), each against the uncounted launch of the
same pass: each pass times the uncounted launch again before its rows, so that a drift of the
GPU's speed during the run falls on both sides of each ratio. It reports each row's median
ratio over the passes and their range.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench_step import cuda_time_ms as timed  # same timing as every benchmark row

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.kernel import adamw_kernel, adamw_split_kernel, step_scalars_kernel

CONSECUTIVE, SHIFTED, PREFETCHED = launch.LAYOUT_CONSECUTIVE, launch.LAYOUT_SHIFTED, launch.LAYOUT_PREFETCHED


def scalars_row(device) -> torch.Tensor:
    hparams = torch.tensor([[1e-3, 0.9, 0.95, 1e-8, 0.1]], dtype=torch.float32, device=device)
    counts = torch.tensor([3], dtype=torch.int64, device=device)
    out = torch.empty((1, 8), dtype=torch.float32, device=device)
    step_scalars_kernel[(1,)](hparams, counts, 1, out, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **launch.COMPILE_OPTIONS)
    return out[0]


def chosen_launches(n, fmt, p, g, words, scalars, counters, passes: int) -> str:
    """The launches as the library makes them, each pass against its own uncounted launch."""
    w, lo, g16 = p.to(torch.bfloat16), torch.zeros(n, dtype=torch.int16, device=p.device), g.to(torch.bfloat16)

    def launcher(split, nonfinite, track):
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=nonfinite,
                                                   block=launch.GPU_BLOCK, track_format=track, split=split)
        grid, warps = launch.single_tensor_grid(n, constants), launch.single_tensor_warps(constants)
        if split:
            return lambda: adamw_split_kernel[grid](w, lo, g16, words, scalars, counters, n, w, lo, words,
                                                    num_warps=warps, **constants, **launch.COMPILE_OPTIONS)
        return lambda: adamw_kernel[grid](p, g, words, scalars, counters, n, p, words, num_warps=warps,
                                          **constants, **launch.COMPILE_OPTIONS)

    # (row, the launch, its uncounted launch): FP32 weights against the default launch, bf16
    # split weights (bf16 gradient) against the uncounted split launch
    rows = [("format counts", launcher(False, False, True), "fp32"),
            ("format and non-finite counts", launcher(False, True, True), "fp32"),
            ("non-finite counts", launcher(False, True, False), "fp32"),
            ("bf16 split, format counts", launcher(True, False, True), "split"),
            ("bf16 split, non-finite counts", launcher(True, True, False), "split")]
    uncounted = {"fp32": launcher(False, False, False), "split": launcher(True, False, False)}
    ratios = {row: [] for row, *_ in rows}
    for _ in range(passes):
        base = {kind: timed(fn) for kind, fn in uncounted.items()}
        for row, fn, kind in rows:
            ratios[row].append(timed(fn) / base[kind])
            print(row, f"{ratios[row][-1]:.4f}", flush=True)
    lines = [f"# The library's counting launches, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{n:,} elements, {passes} passes", "",
             f"Counting launches: `launch.COUNTING_LAYOUT` {launch.COUNTING_LAYOUT}, `COUNTING_SPLIT_LAYOUT` "
             f"{launch.COUNTING_SPLIT_LAYOUT}, {launch.LAID_OUT_BLOCKS_PER_PROGRAM} blocks a program laid out; "
             f"non-finite only: {launch.COUNTING_BLOCKS_PER_PROGRAM} blocks.", "",
             "| launch | / its uncounted launch, median of the passes | lowest | highest |", "|---|---|---|---|"]
    for row, values in ratios.items():
        lines.append(f"| {row} | {statistics.median(values):.4f} | {min(values):.4f} | {max(values):.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--out", default=None)
    parser.add_argument("--chosen", action="store_true", help="only the launches the library makes, pass by pass")
    parser.add_argument("--passes", type=int, default=5, help="passes of --chosen")
    args = parser.parse_args()
    n, device = args.elements, torch.device("cuda")
    fmt = StateFormat("packed")
    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.randn(n, device=device, generator=gen) * 0.02
    g = torch.randn(n, device=device, generator=gen) * 1e-3
    words = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device=device, generator=gen) & 0x3C003C00
    scalars = scalars_row(device)
    counters = torch.zeros(launch.COUNTER_ROW, dtype=torch.int64, device=device)
    lines = [f"# Counting-launch sweep, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{n:,} elements", "", "| launch | layout | BLOCK | warps | blocks/program | ms, two passes | / default (best pass) |",
             "|---|---|---|---|---|---|---|"]

    if args.chosen:
        text = chosen_launches(n, fmt, p, g, words, scalars, counters, args.passes)
        print(text)
        if args.out:
            open(args.out, "w").write(text)
        return

    def run(track, nonfinite, block, warps, bpp, layout=launch.LAYOUT_CONSECUTIVE):
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=nonfinite, block=block,
                                                   track_format=track)
        constants["BLOCKS_PER_PROGRAM"], constants["LAYOUT"] = bpp, layout
        grid = launch.single_tensor_grid(n, constants)
        return timed(lambda: adamw_kernel[grid](p, g, words, scalars, counters, n, p, words, num_warps=warps,
                                                **constants, **launch.COMPILE_OPTIONS))

    default = run(False, False, 512, 2, 1)
    lines.append(f"| default | - | 512 | 2 | 1 | {default:.3f} | 1.000 |")
    layouts = {CONSECUTIVE: "consecutive", SHIFTED: "shifted", PREFETCHED: "shifted, prefetched"}
    # (counts, layout, BLOCK, warps, blocks a program); the layouts of kernel._adamw_programs
    configs = [("track_format", CONSECUTIVE, 512, 4, 16), ("track_format", SHIFTED, 512, 4, 8)]
    configs += [("track_format", PREFETCHED, 512, warps, bpp) for warps, bpp in
                ((4, 4), (4, 8), (4, 16), (4, 24), (2, 8), (2, 16), (8, 8))]
    configs += [("track_format", PREFETCHED, 256, 2, 16), ("track_format", PREFETCHED, 1024, 8, 8)]
    configs += [("both counts", CONSECUTIVE, 512, 4, 16), ("both counts", SHIFTED, 512, 4, 8),
                ("both counts", PREFETCHED, 512, 4, 8), ("both counts", PREFETCHED, 512, 4, 16)]
    configs += [("check_nonfinite", CONSECUTIVE, 512, 4, 1), ("check_nonfinite", CONSECUTIVE, 512, 4, 16),
                ("check_nonfinite", PREFETCHED, 512, 4, 8), ("check_nonfinite", PREFETCHED, 512, 4, 16)]
    configs += [("no counts", CONSECUTIVE, 512, 4, 1), ("no counts", SHIFTED, 512, 4, 8),
                ("no counts", PREFETCHED, 512, 4, 8), ("no counts", PREFETCHED, 512, 4, 16)]
    times = {c: [] for c in configs}
    for _ in range(2):  # two passes: the spread between them is the noise
        for config in configs:
            label, layout, block, warps, bpp = config
            times[config].append(run(label in ("track_format", "both counts"), label in ("check_nonfinite", "both counts"),
                                     block, warps, bpp, layout=layout))
            print(config, f"{times[config][-1]:.3f}", flush=True)
    default2 = run(False, False, 512, 2, 1)
    for config in configs:
        label, layout, block, warps, bpp = config
        ms = times[config]
        lines.append(f"| {label} | {layouts[layout]} | {block} | {warps} | {bpp} | {ms[0]:.3f}, {ms[1]:.3f} | "
                     f"{min(ms) / default:.3f} |")
    lines.append(f"| default, again at the end | - | 512 | 2 | 1 | {default2:.3f} | {default2 / default:.3f} |")
    results = []
    # one launch of each layout on the same inputs: the same bits and counts
    for layout, bpp in ((CONSECUTIVE, launch.COUNTING_BLOCKS_PER_PROGRAM), (SHIFTED, launch.LAID_OUT_BLOCKS_PER_PROGRAM),
                         (PREFETCHED, launch.LAID_OUT_BLOCKS_PER_PROGRAM), (PREFETCHED, 16)):
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=True, block=512,
                                                   track_format=True)
        constants["BLOCKS_PER_PROGRAM"], constants["LAYOUT"] = bpp, layout
        p1, words1, counters1 = p.clone(), words.clone(), torch.zeros_like(counters)
        adamw_kernel[launch.single_tensor_grid(n, constants)](p1, g, words1, scalars, counters1, n, p1, words1,
                                                              num_warps=4, **constants, **launch.COMPILE_OPTIONS)
        # the counts, not the row: each program adds to its own slot, and the layouts' programs differ
        totals = torch.cat([counters1[:1], counters1[1:].view(len(launch.FORMAT_COUNTS), -1).sum(1)])
        results.append((p1.view(torch.int32), words1, totals))
    same = all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))
    print("one launch of each layout: the same bits and counts:", same, results[0][2].tolist())
    assert same, "a layout changed a bit or a count"

    # Split masters: bf16 weight + int16 low half, bf16 or float32 gradient.
    w = p.to(torch.bfloat16)
    lo = torch.zeros(n, dtype=torch.int16, device=device)
    lines += ["", "| split launch | gradient | ms | / default FP32 launch |", "|---|---|---|---|"]
    for grad_name, grad in (("bf16", g.to(torch.bfloat16)), ("fp32", g)):
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=False, block=512, split=True)
        grid = launch.single_tensor_grid(n, constants)
        ms = timed(lambda: adamw_split_kernel[grid](w, lo, grad, words, scalars, counters, n, w, lo, words,
                                                    num_warps=2, **constants, **launch.COMPILE_OPTIONS))
        lines.append(f"| split | {grad_name} | {ms:.3f} | {ms / default:.3f} |")
        print(lines[-1], flush=True)
        for layout, bpp in ((CONSECUTIVE, 16), (SHIFTED, 8), (PREFETCHED, 8)):  # format counts on the split launch
            counting = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=False, block=512,
                                                      split=True, track_format=True)
            counting["BLOCKS_PER_PROGRAM"], counting["LAYOUT"] = bpp, layout
            grid = launch.single_tensor_grid(n, counting)
            counted = timed(lambda: adamw_split_kernel[grid](w, lo, grad, words, scalars, counters, n, w, lo, words,
                                                             num_warps=4, **counting, **launch.COMPILE_OPTIONS))
            lines.append(f"| split, format counts, {layouts[layout]}, {bpp} blocks | {grad_name} | {counted:.3f} | "
                         f"{counted / default:.3f} ({counted / ms:.3f} of the uncounted split launch) |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
