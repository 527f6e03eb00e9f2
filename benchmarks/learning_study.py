"""Learning study: the reference GPT on the embedded tape, one run per optimizer mode.

    python benchmarks/learning_study.py --out-doc docs/results/LEARNING_STUDY.md

Same seed, data order and schedule for every run; the fp32 run also records the moment
statistics (fraction of |m| and RMS that E4M11/E4M12 would saturate or flush at each bias).
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

RUNS = {  # name -> trainer flags
    "fp32 AdamW (PackedAdamW fp32)": ["--mode", "fp32", "--log-moment-stats", "--moment-stats-every", "30"],
    "packed (E4M11 + E4M12)": ["--mode", "packed"],
    "fp16/fp16": ["--mode", "fp16"],
    "torch.optim.AdamW": ["--optimizer", "torch-adamw"],
}


def run_all(args) -> dict:
    results = {}
    for name, flags in RUNS.items():
        out = Path(args.runs) / name.split()[0].replace("/", "-").replace(".", "-")
        argv = ["--config", "reference", "--data", args.data, "--out", str(out), "--max-steps", str(args.steps),
                "--batch-size", "32", "--eval-every", "30", "--eval-batches", "0", "--no-progress", *flags]
        summary = trainer.train(trainer.parse_args(argv)[0])
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        stats_path = out / "moment_stats.jsonl"
        stats = [json.loads(line) for line in stats_path.read_text().splitlines()] if stats_path.exists() else []
        results[name] = {"summary": summary, "log": log, "moment_stats": stats}
        print(name, json.dumps({k: summary[k] for k in ("val_bpb", "tokens_per_s", "median_optimizer_ms")}), flush=True)
    return results


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

    reference = results["fp32 AdamW (PackedAdamW fp32)"]["summary"]["val_bpb"]
    import triton

    lines = [
        "# Learning study",
        "",
        f"- Date: {datetime.date.today().isoformat()}; GPU: {torch.cuda.get_device_name()}; "
        f"torch {torch.__version__}, triton {triton.__version__}",
        f"- Command: `{command}`",
        "- Model: `reference` preset (11,550,240 parameters), batch 32 x 256 tokens, the embedded "
        "Shakespeare tape in order, one seed, warmup then cosine decay, clipping at 1.0, weight decay 0.1, "
        "betas (0.9, 0.95). One seed and a short run: differences below about 1% are within noise.",
        "",
        f"![validation bpb]({plot.name})",
        "",
        "| run | final val bpb | vs fp32 | tokens/s | optimizer step (median ms) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s = r["summary"]
        lines.append(f"| {name} | {s['val_bpb']:.4f} | {100 * (s['val_bpb'] / reference - 1):+.2f}% | "
                     f"{s['tokens_per_s']:,.0f} | {s['median_optimizer_ms']:.2f} |")
    stats = results["fp32 AdamW (PackedAdamW fp32)"]["moment_stats"]
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
                "moment_stats": r["moment_stats"]} for name, r in results.items()}, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="runs/data/study", help="tapes built with 3 passes over the corpus")
    parser.add_argument("--runs", default="runs/study")
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--out-doc", default="docs/results/LEARNING_STUDY.md")
    args = parser.parse_args(argv)
    results = run_all(args)
    doc = Path(args.out_doc)
    write_report(results, doc, doc.with_name("learning_study.png"), " ".join(["python", *sys.argv]))
    print(doc.read_text())


if __name__ == "__main__":
    main()
