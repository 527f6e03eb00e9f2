"""H200 sweep: the single-tensor kernel's launch shape for counting launches, and the split kernel.

    python benchmarks/sweep_counting.py [--elements N] [--out FILE]

For one tensor of N float32 parameters (default 2**28), times `adamw_kernel` with format
counts (`track_format`) or non-finite counts on and off, over block sizes, warps and blocks
per program, against the default launch, and the SHIFTED layout (`launch.COUNTING_SHIFTED`); then
`adamw_split_kernel` (bf16 weights with split
masters, bf16 and float32 gradients). Times are the median of 5 repeats of the mean of 20
back-to-back launches (CUDA events); the step scalars are derived once.
"""
from __future__ import annotations

import argparse

import torch

from bench_step import cuda_time_ms as timed  # same timing as every benchmark row

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.kernel import adamw_kernel, adamw_split_kernel, step_scalars_kernel


def scalars_row(device) -> torch.Tensor:
    hparams = torch.tensor([[1e-3, 0.9, 0.95, 1e-8, 0.1]], dtype=torch.float32, device=device)
    counts = torch.tensor([3], dtype=torch.int64, device=device)
    out = torch.empty((1, 8), dtype=torch.float32, device=device)
    step_scalars_kernel[(1,)](hparams, counts, 1, out, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **launch.COMPILE_OPTIONS)
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--out", default=None)
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
             f"{n:,} elements", "", "| launch | BLOCK | warps | blocks/program | ms | / default |", "|---|---|---|---|---|---|"]

    def run(track, nonfinite, block, warps, bpp, shifted=False):
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=nonfinite, block=block,
                                                   track_format=track)
        constants["BLOCKS_PER_PROGRAM"], constants["SHIFTED"] = bpp, shifted
        grid = launch.single_tensor_grid(n, constants)
        return timed(lambda: adamw_kernel[grid](p, g, words, scalars, counters, n, p, words, num_warps=warps,
                                                **constants, **launch.COMPILE_OPTIONS))

    default = run(False, False, 512, 2, 1)
    lines.append(f"| default | 512 | 2 | 1 | {default:.3f} | 1.000 |")
    configs = [(512, 2, 1), (512, 2, 16), (512, 4, 1), (512, 4, 8), (512, 4, 16), (512, 4, 24),
               (512, 8, 16), (1024, 4, 16), (1024, 8, 16), (256, 2, 16)]
    for label, track, nonfinite in (("track_format", True, False), ("check_nonfinite", False, True),
                                    ("no counts", False, False)):
        for block, warps, bpp in configs:
            if label == "no counts" and bpp != 1:
                continue
            ms = run(track, nonfinite, block, warps, bpp)
            lines.append(f"| {label} | {block} | {warps} | {bpp} | {ms:.3f} | {ms / default:.3f} |")
            print(lines[-1], flush=True)
    # The SHIFTED layout (launch.COUNTING_SHIFTED, off by default), timed in the same run.
    for block, warps, bpp in ((512, 4, 2), (512, 4, 4), (512, 4, 8), (512, 8, 4), (256, 4, 4), (1024, 4, 4)):
        ms = run(True, False, block, warps, bpp, shifted=True)
        lines.append(f"| track_format, shifted | {block} | {warps} | {bpp} | {ms:.3f} | {ms / default:.3f} |")
        print(lines[-1], flush=True)
    results = []
    for shifted, bpp in ((False, launch.COUNTING_BLOCKS_PER_PROGRAM), (True, launch.SHIFTED_BLOCKS_PER_PROGRAM)):  # one launch of each on the same inputs: the same bits and counts
        constants = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=True, block=512,
                                                   track_format=True)
        constants["BLOCKS_PER_PROGRAM"], constants["SHIFTED"] = bpp, shifted
        p1, words1, counters1 = p.clone(), words.clone(), torch.zeros_like(counters)
        adamw_kernel[launch.single_tensor_grid(n, constants)](p1, g, words1, scalars, counters1, n, p1, words1,
                                                              num_warps=4, **constants, **launch.COMPILE_OPTIONS)
        # the counts, not the row: each program adds to its own slot, and the layouts' programs differ
        totals = torch.cat([counters1[:1], counters1[1:].view(len(launch.FORMAT_COUNTS), -1).sum(1)])
        results.append((p1.view(torch.int32), words1, totals))
    same = all(torch.equal(a, b) for a, b in zip(*results))
    print("one launch, consecutive and shifted: the same bits and counts:", same, results[0][2].tolist())
    assert same, "the shifted layout changed a bit or a count"

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
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
