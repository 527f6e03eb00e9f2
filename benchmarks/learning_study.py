"""Learning study: the reference GPT on the embedded tape, one run per optimizer mode and seed.

    python benchmarks/learning_study.py --out-doc docs/results/LEARNING_STUDY.md
    python benchmarks/learning_study.py --runs-only packed-bf16 torch-adamw-bf16 --merge   # some rows
    python benchmarks/learning_study.py --seeds 0 1 2 --runs-only fp32 packed packed-bf16 torch-adamw-bf16 --merge

Same data order and schedule for every run; `--seeds` trains each row once per seed (the
trainer's `--seed`, which draws the initialisation), and the table gives each row's mean over
its seeds and their spread. The fp32 run also records the moment statistics (fraction of |m|
and RMS that E4M11/E4M12 would saturate or flush at each bias).
The bf16 rows train bf16 parameters (forward and backward in bf16, no autocast): with
PackedAdamW's split masters (exact FP32 masters, started at the FP32 initialisation), and
with torch.optim.AdamW on the bf16 weights alone, the inexact baseline (docs/TRAINING.md,
"bf16 parameters"). `--runs-only` runs some rows; `--merge` keeps, from the report's JSON of an
earlier session, the other rows and the other seeds of the rows run now (the page says which).
Run directories: `<runs>/<row>` for seed 0, `<runs>/<row>-seed<K>` for seed K.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from packed_adamw.torch.gpt import train as trainer  # noqa: E402

REFERENCE = "fp32 AdamW (PackedAdamW fp32)"  # the "vs fp32" column's baseline
RUNS = {  # name -> (run directory under --runs, also the name --runs-only takes; trainer flags)
    REFERENCE: ("fp32", ["--mode", "fp32", "--log-moment-stats", "--moment-stats-every", "30"]),
    "packed (E4M11 + E4M12)": ("packed", ["--mode", "packed"]),
    "fp16/fp16": ("fp16-fp16", ["--mode", "fp16"]),
    "torch.optim.AdamW": ("torch-optim-AdamW", ["--optimizer", "torch-adamw"]),
    "packed, bf16 weights + split masters": ("packed-bf16", ["--param-dtype", "bf16", "--mode", "packed"]),
    "torch.optim.AdamW, bf16 weights": ("torch-adamw-bf16", ["--param-dtype", "bf16", "--optimizer", "torch-adamw"]),
}
# bf16-parameter rows and the FP32-parameter row with the same optimizer and state
BF16_PAIRS = {"packed, bf16 weights + split masters": "packed (E4M11 + E4M12)",
              "torch.optim.AdamW, bf16 weights": "torch.optim.AdamW"}


def session() -> dict:
    import triton
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__}


def run_directory(runs: str, directory: str, seed: int) -> Path:
    """Seed 0 keeps the single-seed study's paths, so its runs stay where they were."""
    return Path(runs) / (directory if seed == 0 else f"{directory}-seed{seed}")


def run_all(args, names: list[str]) -> dict:
    """{row name: {seed: run}} for the rows `names` and the seeds `args.seeds`."""
    results = {}
    for name in names:
        directory, flags = RUNS[name]
        for seed in args.seeds:
            out = run_directory(args.runs, directory, seed)
            argv = ["--config", "reference", "--data", args.data, "--out", str(out), "--max-steps", str(args.steps),
                    "--batch-size", "32", "--eval-every", "30", "--eval-batches", "0", "--no-progress",
                    "--seed", str(seed), *flags]
            summary = trainer.train(trainer.parse_args(argv)[0])
            log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
            stats_path = out / "moment_stats.jsonl"
            stats = [json.loads(line) for line in stats_path.read_text().splitlines()] if stats_path.exists() else []
            results.setdefault(name, {})[seed] = {"summary": summary, "log": log, "moment_stats": stats,
                                                  "session": session()}
            print(name, f"seed {seed}", json.dumps({k: summary[k] for k in ("val_bpb", "tokens_per_s",
                                                                            "median_optimizer_ms")}), flush=True)
    return results


def earlier_runs(json_path: Path, skip: set[tuple[str, int]]) -> dict:
    """Runs of an earlier report's JSON, as run_all returns them (the curve stands for the log),
    less the (row, seed) pairs in `skip`. A row without `seeds` (the single-seed study's JSON) is seed 0."""
    if not json_path.exists():
        return {}
    saved = json.loads(json_path.read_text())
    kept = {}
    for name, row in saved.items():
        if name not in RUNS:
            continue
        for seed, r in (row["seeds"].items() if "seeds" in row else [(0, row)]):
            if (name, int(seed)) not in skip:
                kept.setdefault(name, {})[int(seed)] = {
                    "summary": r["summary"], "log": r["val_curve"], "moment_stats": r["moment_stats"],
                    "session": r.get("session"), "kept": True}
    return kept


def merged(earlier: dict, now: dict) -> dict:
    """Rows in table order, each row's seeds in order; a seed run now replaces the earlier one."""
    rows = {name: {**earlier.get(name, {}), **now.get(name, {})} for name in RUNS}
    return {name: dict(sorted(seeds.items())) for name, seeds in rows.items() if seeds}


def final(seeds: dict, key: str) -> list[float]:
    return [r["summary"][key] for r in seeds.values()]


def spread(values: list[float]) -> str:
    return f"{min(values):.4f}-{max(values):.4f}" if len(values) > 1 else "-"


def val_curve(name: str, seeds: dict) -> tuple[list[int], list[float], list[float], list[float]]:
    """The evaluation steps and, at each, the mean, lowest and highest val bpb over the row's seeds
    (which must share the steps)."""
    curves = {seed: [(e["step"], e["val_bpb"]) for e in r["log"] if "val_bpb" in e] for seed, r in seeds.items()}
    steps = {seed: [step for step, _ in points] for seed, points in curves.items()}
    first = next(iter(steps.values()))
    if any(s != first for s in steps.values()):
        raise ValueError(f"row {name!r}: seeds {sorted(steps)} were evaluated at different steps "
                         "(runs with different --steps?); run all its seeds again with the same --steps")
    by_step = list(zip(*([bpb for _, bpb in points] for points in curves.values())))
    return first, [statistics.fmean(v) for v in by_step], [min(v) for v in by_step], [max(v) for v in by_step]


def plot_curves(results: dict, plot: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, seeds in results.items():
        steps, mean, low, high = val_curve(name, seeds)
        line, = ax.plot(steps, mean, marker="o",
                        label=name if len(seeds) == 1 else f"{name} (mean of {len(seeds)} seeds)")
        if len(seeds) > 1:  # the band: lowest to highest over the seeds
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)


def seeds_sentence(results: dict) -> str:
    """How many seeds, and how far apart runs differing only in the seed land (the noise)."""
    seed_sets = {tuple(seeds) for seeds in results.values()}
    if len(seed_sets) == 1:
        (seeds,) = seed_sets
        count = "one seed" if len(seeds) == 1 else f"{len(seeds)} seeds ({', '.join(map(str, seeds))})"
    else:
        counts = sorted(len(s) for s in seed_sets)
        count = f"{counts[0]} to {counts[-1]} seeds per row (the seeds column)"
    reference = final(results[REFERENCE], "val_bpb") if REFERENCE in results else []
    if len(reference) > 1:
        mean, width = statistics.fmean(reference), max(reference) - min(reference)
        noise = (f"The fp32 row's {len(reference)} seeds span {width:.4f} bpb ({100 * width / mean:.2f}% of their "
                 "mean): differences between means smaller than that are within noise.")
    else:
        noise = "One seed and a short run: differences below about 1% are within noise."
    return (f"{count}, warmup then cosine decay, clipping at 1.0, weight decay 0.1, betas (0.9, 0.95). "
            "The seed draws the initialisation only: data order and schedule are the same for every seed. " + noise)


def kept_lines(results: dict) -> list[str]:
    """One line per row and earlier session whose seeds `--merge` kept."""
    lines = []
    for name, seeds in results.items():
        by_session = {}
        for seed, r in seeds.items():
            if r.get("kept"):
                by_session.setdefault(json.dumps(r["session"], sort_keys=True), []).append(seed)
        for when, kept in by_session.items():
            when = json.loads(when)
            lines.append(f"- Row `{name}`, seed{'s' if len(kept) > 1 else ''} {', '.join(map(str, kept))}: kept "
                         "from an earlier session "
                         + (f"({when['date']}, {when['gpu']}, torch {when['torch']})" if when else "(not recorded)")
                         + " by `--merge`.")
    return lines


def write_report(results: dict, doc: Path, plot: Path, command: str) -> None:
    """`results`: {row name: {seed: run}} as run_all and earlier_runs return them, in table order."""
    write_results(results, doc)
    plot_curves(results, plot)
    mean = {name: statistics.fmean(final(seeds, "val_bpb")) for name, seeds in results.items()}
    reference = mean.get(REFERENCE)
    this = session()

    lines = [
        "# Learning study",
        "",
        f"- Date: {this['date']}; GPU: {this['gpu']}; torch {this['torch']}, triton {this['triton']}",
        f"- Command: `{command}`",
        "- Model: `reference` preset (11,550,240 parameters), batch 32 x 256 tokens, the embedded "
        "Shakespeare tape in order, " + seeds_sentence(results),
        "- bf16 rows: bf16 parameters, forward and backward in bf16 without autocast, bf16 gradients "
        "(norm for clipping in float32), validation with the bf16 weights. \"split masters\": PackedAdamW keeps "
        "each weight's exact FP32 master (bf16 weight + int16 low half), started at the FP32 initialisation. "
        "\"torch.optim.AdamW, bf16 weights\": bf16 weights and bf16 moments, no master: the inexact baseline.",
        *kept_lines(results),
        "",
        f"![validation bpb]({plot.name})",
        "",
        "Per row: the mean over its seeds of the final val bpb, tokens/s and optimizer step; the spread is the "
        "lowest and highest final val bpb of its seeds; vs fp32 compares means.",
        "",
        "| run | final val bpb (mean) | spread (min-max) | seeds | vs fp32 | tokens/s | optimizer step (median ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, seeds in results.items():
        versus = f"{100 * (mean[name] / reference - 1):+.2f}%" if reference else "n/a"
        lines.append(f"| {name} | {mean[name]:.4f} | {spread(final(seeds, 'val_bpb'))} | {len(seeds)} | {versus} | "
                     f"{statistics.fmean(final(seeds, 'tokens_per_s')):,.0f} | "
                     f"{statistics.fmean(final(seeds, 'median_optimizer_ms')):.2f} |")
    pairs = [(bf16, fp32) for bf16, fp32 in BF16_PAIRS.items() if bf16 in results and fp32 in results]
    if pairs:
        lines += ["", "bf16 parameters against FP32 parameters with the same optimizer (final val bpb, "
                  "mean over seeds, spread in brackets):", ""]
        for bf16, fp32 in pairs:
            a, b = mean[bf16], mean[fp32]
            lines.append(f"- {bf16}: {a:.4f} [{spread(final(results[bf16], 'val_bpb'))}] vs {fp32}: {b:.4f} "
                         f"[{spread(final(results[fp32], 'val_bpb'))}] ({100 * (a / b - 1):+.2f}%)")
    stats_seed = min(results[REFERENCE]) if REFERENCE in results else None
    stats = results[REFERENCE][stats_seed]["moment_stats"] if stats_seed is not None else []
    if stats:
        lines += ["", "## Moment ranges under FP32 AdamW", "",
                  "Fractions of elements whose |m| (E4M11) or RMS (E4M12) would saturate or flush to zero "
                  f"at each exponent bias, per kind of tensor, at the first and last recorded steps of seed "
                  f"{stats_seed} (its raw records: moment_stats in the JSON next to this page; other seeds' in their "
                  "run directories).", ""]
        for record in (stats[0], stats[-1]):
            lines.append(f"### step {record.get('step')}")
            lines.append("")
            lines.append("```")
            lines.append(json.dumps({k: v for k, v in record.items() if k != "step"}, indent=1)[:6000])
            lines.append("```")
            lines.append("")
    doc.write_text("\n".join(lines) + "\n")


def write_results(results: dict, doc: Path) -> None:
    """The JSON next to the page: written before the page and the plot, so that the runs are
    kept (and `--merge` finds them) even if a report step fails. Compact, and with the moment
    statistics of the page's seed only (each run directory keeps its own): it ships in the
    source release, whose text files stay under tools/release.py's size limit."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    stats_seed = min(results[REFERENCE]) if REFERENCE in results else None
    (doc.with_suffix(".json")).write_text(json.dumps(
        {name: {"seeds": {str(seed): {"summary": r["summary"], "val_curve": [e for e in r["log"] if "val_bpb" in e],
                                      "moment_stats": r["moment_stats"] if (name, seed) == (REFERENCE, stats_seed)
                                      else [],
                                      "session": r.get("session")}
                          for seed, r in seeds.items()}}
         for name, seeds in results.items()},
        separators=(",", ":")) + "\n")


def main(argv=None):
    by_directory = {directory: name for name, (directory, _) in RUNS.items()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/data/study", help="tapes of 3 passes over the embedded corpus: python -m packed_adamw.tokenizer.tape build --out runs/data/study --passes 3")
    parser.add_argument("--runs", default="runs/study")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--out-doc", default="docs/results/LEARNING_STUDY.md")
    parser.add_argument("--runs-only", nargs="+", choices=list(by_directory), metavar="RUN",
                        help=f"run only these rows (by run directory: {', '.join(by_directory)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], metavar="K",
                        help="train each row once per seed (the trainer's --seed: the initialisation); "
                             "seed K > 0 runs in <run directory>-seed<K>")
    parser.add_argument("--merge", action="store_true",
                        help="keep, from the JSON next to --out-doc (an earlier session), the rows not run now "
                             "and the seeds of the rows run now that are not run now")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: give distinct seeds >= 0")
    names = [by_directory[d] for d in args.runs_only] if args.runs_only else list(RUNS)
    doc = Path(args.out_doc)
    run_now = {(name, seed) for name in names for seed in args.seeds}
    kept = earlier_runs(doc.with_suffix(".json"), skip=run_now) if args.merge else {}
    results = merged(kept, run_all(args, names))
    command = " ".join(["python", *sys.argv] if argv is None else ["python", "benchmarks/learning_study.py", *argv])
    write_report(results, doc, doc.with_name("learning_study.png"), command)
    print(doc.read_text())


if __name__ == "__main__":
    main()
