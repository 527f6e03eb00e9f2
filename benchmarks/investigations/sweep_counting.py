"""H200 sweep: the single-tensor kernel's launch shape for counting launches, and the split kernel.

    python benchmarks/investigations/sweep_counting.py [--elements N] [--out FILE]
    python benchmarks/investigations/sweep_counting.py --chosen [--passes 5] [--candidates] [--out FILE]
    python benchmarks/investigations/sweep_counting.py --chosen --profile [--candidates] [--out LAUNCHES.json]  # under ncu
    python benchmarks/investigations/sweep_counting.py --ncu-table LOG --launches LAUNCHES.json [--out FILE]
    python benchmarks/investigations/sweep_counting.py --clock-table SMI_CSV --progress CHOSEN_OUTPUT [--out FILE]

For one tensor of N float32 parameters (default 2**28), times `adamw_kernel` with format
counts (`track_format`) or non-finite counts on and off, over block sizes, warps and blocks
per program and the layouts of a program's blocks (`launch.LAYOUT_*`), against the default launch; then
`adamw_split_kernel` (bf16 weights with split
masters, bf16 and float32 gradients). Times are the median of 5 repeats of the mean of 20
back-to-back launches (CUDA events); the step scalars are derived once.

`--chosen` times only the launches the library makes (`launch.single_tensor_constants` and
`single_tensor_warps`, as the launchers call them) on three data profiles (`data_profiles`):
the random codes above read out of place, the state after 30 synthetic steps read out of place,
and that state stepped on in place.
Each ratio is a timing of the row over the mean of its uncounted launch timed just before and
after it: the H200 runs these launches at its power cap, where its clocks move. It reports each
row's median ratio over the passes and their range; `--candidates` adds other launch shapes
(CANDIDATES) and the uncounted launch against itself, whose ratio is the noise.

`--chosen --profile` launches the uncounted launches and each row once on the stepped state, for
Nsight Compute, which reads what the timings cannot: the SM clock, DRAM throughput and the
instructions each launch executes :

    ncu --clock-control none --profile-from-start off --csv --print-units base --log-file LOG \
        --metrics $(python benchmarks/investigations/sweep_counting.py --ncu-metrics) \
        python benchmarks/investigations/sweep_counting.py --chosen --profile --candidates --out LAUNCHES.json
    python benchmarks/investigations/sweep_counting.py --ncu-table LOG --launches LAUNCHES.json --out NCU_COUNTING.md

`--clock-control none` leaves the clocks to the GPU, as in the timings. Nsight Compute replays
each launch alone, so the power cap that slows back-to-back launches does not show there.

`--chosen` prints each ratio with the UTC span of its timings; `--clock-table` reads those lines
against an `nvidia-smi` log taken meanwhile (the session script took one with `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 100`) and
gives each row's ratios against the SM clock while it was timed.
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import json
import pathlib
import re
import statistics
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/, for bench_step
from bench_step import cuda_time_ms as timed  # noqa: E402 (same timing as every benchmark row)

from packed_adamw.core import StateFormat, launch
from packed_adamw.core.adamw.kernel import adamw_kernel, adamw_split_kernel, step_scalars_kernel
from packed_adamw.core.adamw.rule import FORMAT_COUNTS

CONSECUTIVE, SHIFTED, PREFETCHED = launch.LAYOUT_CONSECUTIVE, launch.LAYOUT_SHIFTED, launch.LAYOUT_PREFETCHED


def scalars_row(device) -> torch.Tensor:
    hparams = torch.tensor([[1e-3, 0.9, 0.95, 1e-8, 0.1]], dtype=torch.float32, device=device)
    counts = torch.tensor([3], dtype=torch.int64, device=device)
    out = torch.empty((1, 8), dtype=torch.float32, device=device)
    step_scalars_kernel[(1,)](hparams, counts, 1, out, BLOCK_ROWS=launch.SCALAR_BLOCK_ROWS, **launch.COMPILE_OPTIONS)
    return out[0]


# `--chosen --candidates`: FP32-weight launches the library does not make, timed in the same
# passes as its own: (row, track_format, count_nonfinite, BLOCK, warps, blocks a program, layout).
CANDIDATES = [
    ("no counts, prefetched, 8 blocks (the cost of a loop of blocks)", False, False, 512, 4, 8, PREFETCHED),
    ("non-finite counts, consecutive, 16 blocks (their launch before launch.NONFINITE_LAYOUT)", False, True, 512, 4,
     16, CONSECUTIVE),
    ("non-finite counts, 1 block a program, 4 warps", False, True, 512, 4, 1, CONSECUTIVE),
    ("format counts, prefetched, 16 blocks", True, False, 512, 4, 16, PREFETCHED),
    ("format counts, prefetched, BLOCK 256, 2 warps, 16 blocks", True, False, 256, 2, 16, PREFETCHED),
]
TRAINED_STEPS = 30  # synthetic steps from zero moments before the second and third profiles


def gradient(n, device, gen) -> torch.Tensor:
    """Synthetic gradients: normal draws scaled by 2**-6 to 2**-18, log-uniformly."""
    return torch.randn(n, device=device, generator=gen) * torch.exp2(torch.rand(n, device=device, generator=gen) * -12 - 6)


class Profile:
    """The inputs of the timed launches. Out of place (`in_place=False`) every launch reads the
    same inputs; in place, each steps the state the last one wrote, with `grads` in turn, and the
    step scalars of step 3 throughout. In place the state moves on over a run (5 passes of
    `--chosen --candidates` step it about 16,000 times): the moments stay those of the four
    gradients, while weight decay shrinks the weights."""

    def __init__(self, p, words, grads, in_place: bool):
        self.p, self.words, self.grads, self.turn = p, words, grads, 0
        self.p_out, self.words_out = (p, words) if in_place else (torch.empty_like(p), torch.empty_like(words))
        # bf16 weights with split masters (a zero low half) and bf16 gradients, the same way
        self.w, self.lo = p.to(torch.bfloat16), torch.zeros(p.shape, dtype=torch.int16, device=p.device)
        self.grads16 = [g.to(torch.bfloat16) for g in grads]
        self.w_out, self.lo_out = (self.w, self.lo) if in_place else (torch.empty_like(self.w), torch.empty_like(self.lo))
        self.split_words = words.clone() if in_place else words  # in place: a state of their own
        self.split_words_out = self.split_words if in_place else self.words_out

    def launcher(self, constants: dict, warps: int, scalars, counters, split: bool = False):
        n, grid = self.p.numel(), launch.single_tensor_grid(self.p.numel(), constants)

        def run():
            k, self.turn = self.turn % len(self.grads), self.turn + 1
            if split:
                adamw_split_kernel[grid](self.w, self.lo, self.grads16[k], self.split_words, scalars, counters, n,
                                         self.w_out, self.lo_out, self.split_words_out, num_warps=warps, **constants,
                                         **launch.COMPILE_OPTIONS)
            else:
                adamw_kernel[grid](self.p, self.grads[k], self.words, scalars, counters, n, self.p_out, self.words_out,
                                   num_warps=warps, **constants, **launch.COMPILE_OPTIONS)
        return run


def data_profiles(p, random_words, g, scalars, counters) -> dict:
    """Three inputs: the sweep's random codes; the state after TRAINED_STEPS steps from zero
    moments, a fresh `gradient` each (about 8% of its first moments subnormal, almost none of its
    RMS), read as it is; and that state stepped on in place with four gradients in turn."""
    n, gen = p.numel(), torch.Generator(device=p.device).manual_seed(1)
    fmt = StateFormat("packed")
    p_trained, words_trained = p.clone(), torch.zeros_like(random_words)
    uncounted = launch.single_tensor_constants(fmt, write_update=False, count_nonfinite=False, block=launch.GPU_BLOCK)
    for _ in range(TRAINED_STEPS):
        adamw_kernel[launch.single_tensor_grid(n, uncounted)](
            p_trained, gradient(n, p.device, gen), words_trained, scalars, counters, n, p_trained, words_trained,
            num_warps=launch.single_tensor_warps(uncounted), **uncounted, **launch.COMPILE_OPTIONS)
    grads = [gradient(n, p.device, gen) for _ in range(4)]
    return {"random codes, the same inputs every launch": Profile(p, random_words, [g], in_place=False),
            f"after {TRAINED_STEPS} synthetic steps, the same inputs every launch": Profile(
                p_trained, words_trained, grads[:1], in_place=False),
            f"after {TRAINED_STEPS} synthetic steps, stepped in place, four gradients in turn": Profile(
                p_trained.clone(), words_trained.clone(), grads, in_place=True)}


def _library(split: bool, nonfinite: bool, track: bool) -> tuple:
    """(constants, warps, split) of the launch the library makes for these counts."""
    constants = launch.single_tensor_constants(StateFormat("packed"), write_update=False, count_nonfinite=nonfinite,
                                               block=launch.GPU_BLOCK, track_format=track, split=split)
    return constants, launch.single_tensor_warps(constants), split


def launch_rows(candidates: bool = False) -> list:
    """(row, (constants, warps, split)) of `--chosen`: FP32 weights, each against the default
    launch, and bf16 split weights (bf16 gradient), against the uncounted split launch;
    `candidates` adds CANDIDATES and the uncounted launch itself."""
    rows = [("format counts", _library(False, False, True)),
            ("format and non-finite counts", _library(False, True, True)),
            ("non-finite counts", _library(False, True, False)),
            ("bf16 split, format counts", _library(True, False, True)),
            ("bf16 split, non-finite counts", _library(True, True, False))]
    if candidates:
        rows.append(("candidate: the uncounted launch itself (the noise)", _library(False, False, False)))
        for row, track, nonfinite, block, warps, bpp, layout in CANDIDATES:
            constants = launch.single_tensor_constants(StateFormat("packed"), write_update=False,
                                                       count_nonfinite=nonfinite, block=block, track_format=track)
            constants["BLOCKS_PER_PROGRAM"], constants["LAYOUT"] = bpp, layout
            rows.append((f"candidate: {row}", (constants, warps, False)))
    return rows


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def progress_line(profile: str, row: str, ratio: float, started: str, ended: str) -> str:
    """`--chosen`'s line for one ratio, with the UTC span of its three timings (nvidia-smi's time
    format), which `--clock-table` reads against a clock log (`_PROGRESS`)."""
    return f"{profile} | {row} {ratio:.4f} | {started} {ended}"


def chosen_launches(profiles: dict, scalars, counters, passes: int, candidates: bool = False) -> str:
    """The launches as the library makes them, on each data profile. Each ratio is one timing of
    the row over the mean of the uncounted launch of its kind timed just before and just after
    it, so that the GPU's clocks, which its power cap moves, fall on both sides of the ratio;
    `candidates` adds CANDIDATES to the same passes."""
    rows = launch_rows(candidates)
    lines = [f"# The library's counting launches, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{next(iter(profiles.values())).p.numel():,} elements, {passes} passes", "",
             f"Counting launches: format counts {PREFETCHED} with FP32 weights, {SHIFTED} with bf16 split weights, "
             f"{launch.LAID_OUT_BLOCKS_PER_PROGRAM} blocks a program laid out; "
             f"non-finite only: {PREFETCHED} with FP32 weights, "
             f"{launch.COUNTING_BLOCKS_PER_PROGRAM} blocks consecutive on split weights. Each ratio: the row over the mean of "
             "its uncounted launch timed just before and after it.", ""]
    for name, profile in profiles.items():
        counters.zero_()
        Profile(profile.p, profile.words, profile.grads[:1], in_place=False).launcher(*rows[0][1][:2], scalars,
                                                                                       counters)()
        counts = dict(zip(FORMAT_COUNTS, launch.sum_counter_slots(counters.cpu().numpy()[None])[0].tolist()))
        uncounted = {split: profile.launcher(*_library(split, False, False)[:2], scalars, counters, split)
                     for split in (False, True)}
        ratios = {row: [] for row, _ in rows}
        for _ in range(passes):
            for row, (constants, warps, split) in rows:
                started = _utc_now()
                before = timed(uncounted[split])
                counted = timed(profile.launcher(constants, warps, scalars, counters, split))
                ratios[row].append(2 * counted / (before + timed(uncounted[split])))
                print(progress_line(name, row, ratios[row][-1], started, _utc_now()), flush=True)
        lines += [f"## {name}", "", f"Format counts of one launch, before the timings: {counts}", "",
                  "| launch | / its uncounted launch, median of the passes | lowest | highest |", "|---|---|---|---|"]
        lines += [f"| {row} | {statistics.median(v):.4f} | {min(v):.4f} | {max(v):.4f} |" for row, v in ratios.items()]
        lines.append("")
    return "\n".join(lines)


_PROGRESS = re.compile(r"^(?P<profile>.*?) \| (?P<row>.*) (?P<ratio>\d+\.\d{4}) \| (?P<start>\S+ \S+) (?P<end>\S+ \S+)$")
_SMI_TIME = "%Y/%m/%d %H:%M:%S.%f"


def clock_table(progress: str, smi_log: str, busy_watts: float = 500.0) -> str:
    """`--clock-table`: each row's ratios of `--chosen` against the SM clock while it was timed.
    `progress` is `--chosen`'s output, a line per ratio with the UTC span of its three timings;
    `smi_log` is `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100`
    (further columns are ignored). A ratio's clock is the mean of the samples in its span that
    drew more than `busy_watts` (the GPU at work); a ratio with no such sample is left out."""
    samples = []
    for record in list(csv.reader(smi_log.splitlines(), skipinitialspace=True))[1:]:
        if len(record) >= 3 and record[1].endswith("MHz") and record[2].endswith("W"):
            samples.append((datetime.datetime.strptime(record[0], _SMI_TIME), float(record[1].split()[0]),
                            float(record[2].split()[0])))
    if not samples:
        raise ValueError("no clock samples: the log must start with nvidia-smi's columns timestamp, clocks.sm, "
                         "power.draw (--format=csv)")
    timed: dict = {}  # row -> [(mean clock, ratio)] over its passes, in the order of the log
    unsampled: collections.Counter = collections.Counter()
    for line in progress.splitlines():
        match = _PROGRESS.match(line)
        if not match:
            continue
        start, end = (datetime.datetime.strptime(match[k], _SMI_TIME) for k in ("start", "end"))
        clocks = [mhz for t, mhz, watts in samples if start <= t <= end and watts > busy_watts]
        pairs = timed.setdefault(match["row"], [])
        if clocks:
            pairs.append((statistics.mean(clocks), float(match["ratio"])))
        else:
            unsampled[match["row"]] += 1
    table = ["| launch | passes with samples (without) | SM clock while timed, MHz | ratio | correlation of ratio and clock |",
             "|---|---|---|---|---|"]
    for row, pairs in timed.items():
        without = unsampled[row]
        clocks, ratios = [c for c, _ in pairs], [r for _, r in pairs]
        correlation = (f"{statistics.correlation(clocks, ratios):+.2f}"
                       if len(pairs) > 2 and len(set(clocks)) > 1 and len(set(ratios)) > 1 else "-")
        spans = (f"{min(clocks):,.0f} to {max(clocks):,.0f}", f"{min(ratios):.4f} to {max(ratios):.4f}") if pairs else ("-", "-")
        table.append(f"| {row} | {len(pairs)} ({without}) | {spans[0]} | {spans[1]} | {correlation} |")
    return "\n".join(table) + "\n"


class NcuColumn(NamedTuple):
    """A column of `--ncu-table`: its heading, the metric's unit in ncu's base units
    (`--print-units base`), the factor from that unit to the column's, whether the value is per
    element of the tensor, and its format."""
    heading: str
    unit: str
    factor: float
    per_element: bool
    spec: str


# `--profile` under Nsight Compute: each metric it reads. Instructions are warp instructions,
# 32 threads' worth.
NCU_METRICS = {
    "gpu__time_duration.sum": NcuColumn("ms", "ns", 1e-6, False, ".3f"),
    "sm__cycles_elapsed.avg.per_second": NcuColumn("SM clock, MHz", "hz", 1e-6, False, ".0f"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": NcuColumn("DRAM, % of peak", "%", 1.0, False, ".1f"),
    "sm__inst_executed.sum": NcuColumn("instructions an element", "inst", 32.0, True, ".1f"),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": NcuColumn("issue slots busy, %", "%", 1.0, False, ".1f"),
    "launch__registers_per_thread": NcuColumn("registers a thread", "register/thread", 1.0, False, ".0f"),
}


def profiled_launches(profile: Profile, scalars, counters, candidates: bool = False) -> list:
    """`--profile`: the uncounted launches, then each launch of `--chosen`, once each on `profile`
    inside a CUDA profiler range (Nsight Compute's `--profile-from-start off` sees only those),
    each compiled before it. Returns the launches' names in launch order."""
    rows = [("the uncounted launch", _library(False, False, False)),
            ("the uncounted split launch", _library(True, False, False))] + launch_rows(candidates)
    runs = [(row, profile.launcher(constants, warps, scalars, counters, split)) for row, (constants, warps, split) in rows]
    for _, run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return [row for row, _ in runs]


def ncu_table(log_text: str, launches: list, n_elements: int) -> str:
    """Nsight Compute's `--csv --print-units base` log of `--profile` as a table: a row per
    launch, in launch order, with NCU_METRICS's columns (instructions per element of the tensor)."""
    lines = log_text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        raise ValueError("no CSV header (\"ID\",...) in the Nsight Compute log: was it run with --csv?")
    values: dict = {}
    for record in csv.DictReader(lines[header:]):
        metric = record.get("Metric Name")
        if metric in NCU_METRICS:
            unit = NCU_METRICS[metric].unit
            if record["Metric Unit"].lower() != unit:
                raise ValueError(f"{metric} of launch {record['ID']} is in {record['Metric Unit']!r}, not {unit!r}: "
                                 "run ncu with --print-units base")
            values.setdefault(int(record["ID"]), {})[metric] = float(record["Metric Value"].replace(",", ""))
    if len(values) != len(launches):
        raise ValueError(f"the log holds {len(values)} profiled launches, the launch list {len(launches)}")
    for launch_id, metrics in values.items():
        missing = sorted(set(NCU_METRICS) - set(metrics))
        if missing:
            raise ValueError(f"launch {launch_id} of the log lacks {missing}: run ncu with --metrics "
                             "$(python benchmarks/investigations/sweep_counting.py --ncu-metrics)")
    table = ["| launch | " + " | ".join(c.heading for c in NCU_METRICS.values()) + " |",
             "|---|" + "---|" * len(NCU_METRICS)]
    for (_, metrics), name in zip(sorted(values.items()), launches):
        cells = [format(metrics[metric] * c.factor / (n_elements if c.per_element else 1), c.spec)
                 for metric, c in NCU_METRICS.items()]
        table.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(table) + "\n"


def _report(text: str, out: str | None) -> None:
    print(text)
    if out:
        open(out, "w").write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--out", default=None)
    parser.add_argument("--chosen", action="store_true", help="only the launches the library makes, pass by pass")
    parser.add_argument("--passes", type=int, default=5, help="passes of --chosen")
    parser.add_argument("--candidates", action="store_true", help="with --chosen: CANDIDATES too, in the same passes")
    parser.add_argument("--profile", action="store_true",
                        help="with --chosen: launch each row once on the stepped state, for Nsight Compute; --out "
                             "gets the launch list (JSON)")
    parser.add_argument("--ncu-metrics", action="store_true", help="print NCU_METRICS for ncu --metrics, and exit")
    parser.add_argument("--ncu-table", metavar="LOG", help="the table of an ncu --csv --print-units base log of "
                                                           "--profile; --launches names its launch list")
    parser.add_argument("--launches", metavar="JSON", help="with --ncu-table: the launch list --profile wrote")
    parser.add_argument("--clock-table", metavar="SMI_CSV", help="each --chosen row's ratios against the SM clock "
                                                                 "of an nvidia-smi log; --progress names --chosen's output")
    parser.add_argument("--progress", metavar="TXT", help="with --clock-table: what --chosen printed")
    args = parser.parse_args()
    if args.profile and not args.chosen:
        parser.error("--profile profiles the launches of --chosen: give both")
    if bool(args.ncu_table) != bool(args.launches):
        parser.error("--ncu-table LOG and --launches JSON (the launch list --profile wrote) go together")
    if bool(args.clock_table) != bool(args.progress):
        parser.error("--clock-table SMI_CSV and --progress TXT go together")
    if args.ncu_metrics:
        print(",".join(NCU_METRICS))
        return
    if args.clock_table:
        _report(clock_table(open(args.progress).read(), open(args.clock_table).read()), args.out)
        return
    if args.ncu_table:
        record = json.load(open(args.launches))
        _report(ncu_table(open(args.ncu_table).read(), record["launches"], record["elements"]), args.out)
        return
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

    if args.chosen and args.profile:
        name, profile = list(data_profiles(p, words, g, scalars, counters).items())[-1]  # stepped in place
        record = {"elements": n, "profile": name,
                  "launches": profiled_launches(profile, scalars, counters, args.candidates)}
        print("\n".join(f"{i}: {name}" for i, name in enumerate(record["launches"])))
        if args.out:
            open(args.out, "w").write(json.dumps(record, indent=1) + "\n")
        return
    if args.chosen:
        _report(chosen_launches(data_profiles(p, words, g, scalars, counters), scalars, counters, args.passes,
                                args.candidates), args.out)
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
    # (counts, layout, BLOCK, warps, blocks a program); the layouts of adamw_programs (core/adamw/kernel.py)
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
        totals = torch.cat([counters1[:1], counters1[1:].view(len(FORMAT_COUNTS), -1).sum(1)])
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
    _report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
