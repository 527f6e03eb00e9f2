"""Learning study: the reference GPT on the embedded tape, one run per optimizer mode.

    python benchmarks/learning_study.py --out-doc docs/results/LEARNING_STUDY.md
    python benchmarks/learning_study.py --runs-only packed-bf16 torch-adamw-bf16 --merge   # some rows

Same seed, data order and schedule for every run; the fp32 run also records the moment
statistics (fraction of |m| and RMS that E4M11/E4M12 would saturate or flush at each bias).
The bf16 rows train bf16 parameters (forward and backward in bf16, no autocast): with
PackedAdamW's split masters (exact FP32 masters, started at the FP32 initialisation), and
with torch.optim.AdamW on the bf16 weights alone, the inexact baseline (docs/TRAINING.md,
"bf16 parameters"). `--runs-only` runs some rows; `--merge` keeps the other rows of the
report's JSON from an earlier session (the page says which).
"""
from __future__ import annotations

import argparse
import datetime
import json
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


def run_all(args, names: list[str]) -> dict:
    results = {}
    for name in names:
        directory, flags = RUNS[name]
        out = Path(args.runs) / directory
        argv = ["--config", "reference", "--data", args.data, "--out", str(out), "--max-steps", str(args.steps),
                "--batch-size", "32", "--eval-every", "30", "--eval-batches", "0", "--no-progress", *flags]
        summary = trainer.train(trainer.parse_args(argv)[0])
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        stats_path = out / "moment_stats.jsonl"
        stats = [json.loads(line) for line in stats_path.read_text().splitlines()] if stats_path.exists() else []
        results[name] = {"summary": summary, "log": log, "moment_stats": stats, "session": session()}
        print(name, json.dumps({k: summary[k] for k in ("val_bpb", "tokens_per_s", "median_optimizer_ms")}), flush=True)
    return results


def earlier_rows(json_path: Path, skip) -> dict:
    """Rows of an earlier report's JSON, as run_all returns them (the curve stands for the log)."""
    if not json_path.exists():
        return {}
    saved = json.loads(json_path.read_text())
    return {name: {"summary": r["summary"], "log": r["val_curve"], "moment_stats": r["moment_stats"],
                   "session": r.get("session"), "kept": True}
            for name, r in saved.items() if name in RUNS and name not in skip}


def in_table_order(results: dict) -> dict:
    return {name: results[name] for name in RUNS if name in results}


def write_report(results: dict, doc: Path, plot: Path, command: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        points = [(e["step"], e["val_bpb"]) for e in r["log"] if "val_bpb" in e]
        ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)

    reference = results[REFERENCE]["summary"]["val_bpb"] if REFERENCE in results else None
    this = session()
    earlier = {name: r["session"] for name, r in results.items() if r.get("kept")}

    lines = [
        "# Learning study",
        "",
        f"- Date: {this['date']}; GPU: {this['gpu']}; torch {this['torch']}, triton {this['triton']}",
        f"- Command: `{command}`",
        "- Model: `reference` preset (11,550,240 parameters), batch 32 x 256 tokens, the embedded "
        "Shakespeare tape in order, one seed, warmup then cosine decay, clipping at 1.0, weight decay 0.1, "
        "betas (0.9, 0.95). One seed and a short run: differences below about 1% are within noise.",
        "- bf16 rows: bf16 parameters, forward and backward in bf16 without autocast, bf16 gradients "
        "(norm for clipping in float32), validation with the bf16 weights. \"split masters\": PackedAdamW keeps "
        "each weight's exact FP32 master (bf16 weight + int16 low half), started at the FP32 initialisation. "
        "\"torch.optim.AdamW, bf16 weights\": bf16 weights and bf16 moments, no master: the inexact baseline.",
    ]
    for name, when in earlier.items():
        lines.append(f"- Row `{name}` is kept from an earlier session "
                     + (f"({when['date']}, {when['gpu']}, torch {when['torch']})" if when else "(not recorded)")
                     + " by `--merge`.")
    lines += [
        "",
        f"![validation bpb]({plot.name})",
        "",
        "| run | final val bpb | vs fp32 | tokens/s | optimizer step (median ms) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s = r["summary"]
        versus = f"{100 * (s['val_bpb'] / reference - 1):+.2f}%" if reference else "n/a"
        lines.append(f"| {name} | {s['val_bpb']:.4f} | {versus} | "
                     f"{s['tokens_per_s']:,.0f} | {s['median_optimizer_ms']:.2f} |")
    pairs = [(bf16, fp32) for bf16, fp32 in BF16_PAIRS.items() if bf16 in results and fp32 in results]
    if pairs:
        lines += ["", "bf16 parameters against FP32 parameters with the same optimizer (final val bpb):", ""]
        for bf16, fp32 in pairs:
            a, b = results[bf16]["summary"]["val_bpb"], results[fp32]["summary"]["val_bpb"]
            lines.append(f"- {bf16}: {a:.4f} vs {fp32}: {b:.4f} ({100 * (a / b - 1):+.2f}%)")
    stats = results[REFERENCE]["moment_stats"] if REFERENCE in results else []
    if stats:
        lines += ["", "## Moment ranges under FP32 AdamW", "",
                  "Fractions of elements whose |m| (E4M11) or RMS (E4M12) would saturate or flush to zero "
                  "at each exponent bias, per kind of tensor, at the first and last recorded steps "
                  "(raw records: moment_stats in the JSON next to this page).", ""]
        for record in (stats[0], stats[-1]):
            lines.append(f"### step {record.get('step')}")
            lines.append("")
            lines.append("```")
            lines.append(json.dumps({k: v for k, v in record.items() if k != "step"}, indent=1)[:6000])
            lines.append("```")
            lines.append("")
    doc.write_text("\n".join(lines) + "\n")
    (doc.with_suffix(".json")).write_text(json.dumps(
        {name: {"summary": r["summary"], "val_curve": [e for e in r["log"] if "val_bpb" in e],
                "moment_stats": r["moment_stats"], "session": r.get("session")} for name, r in results.items()},
        indent=1))


def main(argv=None):
    by_directory = {directory: name for name, (directory, _) in RUNS.items()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/data/study", help="tapes built with 3 passes over the corpus")
    parser.add_argument("--runs", default="runs/study")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--out-doc", default="docs/results/LEARNING_STUDY.md")
    parser.add_argument("--runs-only", nargs="+", choices=list(by_directory), metavar="RUN",
                        help=f"run only these rows (by run directory: {', '.join(by_directory)})")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows not run now from the JSON next to --out-doc (an earlier session)")
    args = parser.parse_args(argv)
    names = [by_directory[d] for d in args.runs_only] if args.runs_only else list(RUNS)
    doc = Path(args.out_doc)
    kept = earlier_rows(doc.with_suffix(".json"), skip=names) if args.merge else {}
    results = in_table_order({**kept, **run_all(args, names)})
    write_report(results, doc, doc.with_name("learning_study.png"), " ".join(["python", *sys.argv]))
    print(doc.read_text())


if __name__ == "__main__":
    main()
