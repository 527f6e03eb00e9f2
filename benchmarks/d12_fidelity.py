"""The d12 stack against its FP32 reference on the large corpus, seed by seed (issue 53): each run
is one chat_train process; the record keeps every run, the page tabulates them.

    python benchmarks/d12_fidelity.py --data DIR --stacks packed reference --seeds 0 1 2 \\
        --record docs/results/d12_fidelity.json --page docs/results/D12_FIDELITY_TABLE.md

A run: `chat_train --preset d12 --steps 300 --batch 16 --grad-accum 2 --context 2048 --eval-every
100 --eval-batches 19 --seed S` (issue 53's settings: 65,536 tokens a step, 19.7 M tokens, nanochat's
learning rates and schedule) with `--optimizer packed` (the defaults: bf16 weights with exact FP32
masters, packed Muon momentum, packed AdamW) or `--optimizer reference` (FP32 weights under bf16
autocast, torch.optim.Muon + fused torch.optim.AdamW). `--steps`, `--batch`, `--grad-accum`,
`--context`, `--eval-*` and `--preset` change them (small values for a CPU check).

The record (JSON) is written after every run, so a call cut short keeps what it ran; a run of
the same stack, seed, trainer flags and code (`environment`'s `code`) already in the record is not
run again, and the table takes only runs of the code it is written with, unless `--reuse` names
earlier codes whose runs may stand for it (say why where the page is written: e.g. the reference stack's
code did not change between them). A run recorded by hand from an earlier measurement carries
its `source`. Each entry holds
the run's val bpb at every evaluation, its summary (tokens/s, peak memory, state bytes), the GPU,
versions and the code's commit.

The table's columns are the learning evidence page's: final val bpb (mean over seeds), its sd and
range; paired difference: the mean over seeds of (packed - reference) for the same seed, with its
sd; the reference's range (its seed noise) and whether packed's mean lies inside it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

STACKS = {
    "reference": ("FP32 weights under bf16 autocast; torch.optim.Muon + fused torch.optim.AdamW (baseline)",
                  ["--optimizer", "reference"]),
    "packed": ("bf16 weights + exact FP32 masters; PackedMuonAdamW defaults (packed Muon momentum, packed AdamW; "
               "the ~50 scalars in fp32-mode AdamW)",
               ["--optimizer", "packed"]),
}
BASELINE = "reference"


def trainer_flags(args) -> list[str]:
    return ["--preset", args.preset, "--steps", str(args.steps), "--batch", str(args.batch), "--grad-accum",
            str(args.grad_accum), "--context", str(args.context), "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), *args.extra]


def load_record(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": []}


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def environment() -> dict:
    """The machine, versions and the code: `code` is the first 12 hex digits of the SHA-256 of the
    sources that decide a trajectory (training_state.code_identity, as every state records it), so
    runs are told apart without a git checkout (the GPU machines get the tree without .git)."""
    import torch
    import triton

    from packed_adamw.torch.gpt.training_state import code_identity
    identity = code_identity()
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "code": identity["sha256"][:12],
            "commit": identity["git_commit"], "date": datetime.date.today().isoformat()}


def run_one(args, stack: str, seed: int) -> dict:
    out = args.runs / f"{stack}-seed{seed}"
    argv = [sys.executable, "-m", "packed_adamw.torch.gpt.chat_train", "--data", str(args.data), "--out", str(out),
            "--seed", str(seed), "--device", args.device, *STACKS[stack][1], *trainer_flags(args)]
    started = time.time()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{stack} seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    evals = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()
             if line.strip() and "val_bpb" in line]
    summary = json.loads((out / "summary.json").read_text())
    return {"stack": stack, "seed": seed, "flags": trainer_flags(args), "val_bpb": {str(e["step"]): e["val_bpb"]
            for e in evals}, "seconds": round(time.time() - started, 1),
            **{k: summary.get(k) for k in ("tokens_per_s", "peak_memory_bytes", "optimizer_state_bytes_per_parameter",
                                           "final_loss")}, **environment()}


def final(run: dict) -> float:
    return run["val_bpb"][str(max(int(s) for s in run["val_bpb"]))]


def table(record: dict, flags: list[str], codes: set) -> str:
    """The page's table over the runs made with `flags` by the code of `codes`."""
    runs = {}
    for run in record["runs"]:
        if run["flags"] == flags and run.get("code") in codes:
            runs.setdefault(run["stack"], {})[run["seed"]] = run
    baseline = runs.get(BASELINE, {})
    base_values = [final(r) for r in baseline.values()]
    base_range = (max(base_values) - min(base_values)) if len(base_values) > 1 else None
    lines = ["| stack | seeds | final val bpb | sd | range | paired difference vs reference | reference range "
             "| within reference range | val bpb by evaluation (mean) | tokens/s | peak GiB | optimizer state B/param |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stack, (label, _) in STACKS.items():
        seeds = runs.get(stack)
        if not seeds:
            continue
        values = [final(r) for r in seeds.values()]
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else None
        paired = [final(r) - final(baseline[s]) for s, r in seeds.items() if s in baseline]
        if stack == BASELINE:
            difference, within = "baseline", "-"
        elif paired:
            spread = f", sd {statistics.stdev(paired):.4f}" if len(paired) > 1 else ""
            difference = f"{statistics.fmean(paired):+.4f} (seeds {','.join(str(s) for s in sorted(seeds) if s in baseline)}{spread})"
            within = "yes" if base_values and min(base_values) <= mean <= max(base_values) else "no"
        else:
            difference, within = "no paired seed", "-"
        steps = sorted({int(s) for r in seeds.values() for s in r["val_bpb"]})
        curve = " / ".join(f"{statistics.fmean(r['val_bpb'][str(s)] for r in seeds.values() if str(s) in r['val_bpb']):.4f}"
                           for s in steps)
        tokens = statistics.median(r["tokens_per_s"] for r in seeds.values() if r.get("tokens_per_s"))
        peaks = [r["peak_memory_bytes"] for r in seeds.values() if r.get("peak_memory_bytes")]
        state = seeds[min(seeds)].get("optimizer_state_bytes_per_parameter")
        lines.append(
            f"| {stack}: {label} | {','.join(str(s) for s in sorted(seeds))} | {mean:.4f} | "
            f"{'-' if sd is None else f'{sd:.4f}'} | {min(values):.4f}-{max(values):.4f} | {difference} | "
            f"{'-' if base_range is None else f'{base_range:.4f}'} | {within} | {curve} (steps {', '.join(map(str, steps))}) | "
            f"{tokens:,.0f} | {'-' if not peaks else f'{max(peaks) / 2**30:.1f}'} | "
            f"{'-' if state is None else f'{state:.2f}'} |")
    per_seed = ["", "| seed | " + " | ".join(STACKS) + " |", "|---|" + "---|" * len(STACKS)]
    for seed in sorted({s for stack in runs.values() for s in stack}):
        cells = [f"{final(runs[stack][seed]):.4f} ({runs[stack][seed].get('source') or runs[stack][seed]['code']})"
                 if seed in runs.get(stack, {}) else "-" for stack in STACKS]
        per_seed.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines + per_seed) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a directory holding the large corpus's train.tape and val.tape")
    p.add_argument("--stacks", nargs="+", choices=sorted(STACKS), default=["packed", "reference"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--preset", default="d12")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=19)
    p.add_argument("--device", default="cuda")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further chat_train flags, last")
    p.add_argument("--runs", type=Path, default=Path("runs/d12_fidelity"), help="where the runs' directories go")
    p.add_argument("--record", type=Path, default=Path("docs/results/d12_fidelity.json"))
    p.add_argument("--page", type=Path, default=None, help="write the table (markdown) here")
    p.add_argument("--reuse", nargs="*", default=[], metavar="CODE",
                   help="earlier codes (a run's `code`) whose recorded runs the table may take beside this code's")
    args = p.parse_args(argv)
    record = load_record(args.record)
    flags = trainer_flags(args)
    codes = {environment()["code"], *args.reuse}
    for seed in args.seeds:
        for stack in args.stacks:
            if any(r["stack"] == stack and r["seed"] == seed and r["flags"] == flags and r.get("code") in codes
                   for r in record["runs"]):
                continue
            run = run_one(args, stack, seed)
            record["runs"].append(run)
            write_record(args.record, record)
            print(f"{stack} seed {seed}: val bpb {run['val_bpb']} ({run['seconds']} s)", flush=True)
    text = table(record, flags, codes)
    print(text)
    if args.page:
        args.page.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
