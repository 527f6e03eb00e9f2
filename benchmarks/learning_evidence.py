"""The learning evidence of issue 39: AdamW and Muon + AdamW rows, 3 seeds each, on the large
corpus (docs/CORPUS.md, 32,768-entry tokenizer), trained by the trainer on ONE GPU with several
runs at once, then docs/results/LEARNING_EVIDENCE.md with its curves.

    python benchmarks/learning_evidence.py --jobs 8 --time-budget 540
    python benchmarks/learning_evidence.py --models reference --rows adamw-fused packed --seeds 0
    python benchmarks/learning_evidence.py --report-only          # the page from the record

Every run is `python -m packed_adamw.torch.gpt.train` in a subprocess of its own (its own CUDA
context and peak memory), `--jobs` of them at once: the small models do not fill an H200. Runs
read the training tape in order from its start (the same tokens for every row and seed; the seed
draws the initialisation), with warmup then cosine decay, clipping at 1.0, weight decay 0.1 and
no checkpoints (torchao's state cannot go into them); FP32-weight rows run the forward under bf16
autocast, bf16-weight rows in bf16. Each finished run goes into the record (`--record`, default
docs/results/learning_evidence.json, beside the page), and a run the record holds with the same
trainer flags is not run again, so the matrix fills over several calls; a run cut short by the
budget starts again next time. `--time-budget S` starts a run only when its model's longest
finished run still fits (an unknown one only in the budget's first half) and stops what still runs
at S seconds. The `packed-suggested` row's biases come from `suggest_biases` on the FP32 moments
of a probe (the fp32 row of PackedAdamW, seed 0, stopped after a quarter of the steps), as the
peers table's "suggested biases" (docs/results/PEERS.md), or from `--suggested-biases M RMS`.

Length. With the defaults, a reference run is 600 steps of 32 x 256 tokens (4.9 M tokens) and a
gpt2-small run 400 steps of 8 x 1,024 (3.3 M): 19 % and 13 % of the 25.4 M-token training tape,
read once, so no run sees a token twice (the peers table's runs, 6 passes over 1.37 M tokens,
memorised their tape). The whole matrix (2 models x 10 rows x 3 seeds = 60 runs, plus 2 probes)
reads 246 M training tokens (and about a fifth of that again in evaluations); on the H200, 8 runs
at once, that is estimated (not yet measured) at about 10 minutes: the peers table measured
225 k tokens/s for the reference model alone and 171 k for gpt2-small (12,095-entry vocabulary),
and 8 reference runs at once at 1.36x the time of one. Those are early-training runs, far short
of a compute-optimal budget (about 20 tokens per parameter): they show whether a row trains like
its baseline over the first few million tokens, not where it ends.

On the GPU machine (no registry there). Here, once: the tapes (`python -m
packed_adamw.tokenizer.large_corpus build --cache CACHE --out DIR --tapes`, then DIR's tapes
compressed as docs/CORPUS.md says) copied into an ignored folder of the repository, and the
peers' wheels:

    echo /.whl/ >> .git/info/exclude      # runs/ is ignored already
    mkdir -p runs/carry && cp DIR/large-corpus-tapes.* runs/carry/
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
        -d .whl bitsandbytes==0.50.2 torchao==0.18.0

The tapes (22 MB) and the wheels (46.5 MB, bitsandbytes' 43 MB of it) exceed the 64 MiB one call
carries together, so the first call (carry `runs/carry`) unpacks the tapes, which stay on the warm
machine, and the next ones (carry `.whl`) install the wheels and run:

    cd runs/carry && sha256sum -c large-corpus-tapes.sha256 && mkdir -p ../data/large-corpus \\
        && cat large-corpus-tapes.tar.xz.part-* | xz -d | tar -xf - -C ../data/large-corpus
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site && python3 -m pip install -q -e . --no-deps \\
        --no-build-isolation && cp docs/results/learning_evidence.json $OUT/ 2>/dev/null; \\
        PYTHONUNBUFFERED=1 timeout 580 python3 benchmarks/learning_evidence.py --jobs 8 --time-budget 500 \\
        --record $OUT/learning_evidence.json --out-dir $OUT

(the record of the runs made so far travels in docs/results and is continued in $OUT), then copy
$OUT's LEARNING_EVIDENCE.md, learning_evidence.json and learning_evidence.png into docs/results.
A row whose package is missing is shown as not installed. On an H100 (78 GiB) 8 gpt2-small runs
at once may not fit: pass fewer --jobs.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from packed_adamw.core.atomic_file import atomic_write  # noqa: E402
from packed_adamw.core.format_health import suggest_biases  # noqa: E402
from packed_adamw.inspect.files import load_state_file  # noqa: E402
from packed_adamw.tokenizer import LARGE_VOCAB_SIZE  # noqa: E402
from packed_adamw.tokenizer.tape import read_header  # noqa: E402
from packed_adamw.torch.gpt.checkpoint import CHECKPOINT_NAME  # noqa: E402
from packed_adamw.torch.gpt.model import PRESETS  # noqa: E402
from packed_adamw.torch.gpt.optimizers import PEERS  # noqa: E402

AUTOCAST = ["--autocast", "bf16"]
# name -> (what the page calls it, its group, trainer flags). A group's first row is its baseline.
ROWS = {
    "adamw-fused": ("torch AdamW(fused=True), FP32 weights (baseline)", "adamw",
                    ["--optimizer", "torch-adamw-fused", *AUTOCAST]),
    "packed": ("PackedAdamW packed, biases 15/15", "adamw", ["--optimizer", "packed-adamw", "--mode", "packed",
                                                             *AUTOCAST]),
    "packed-suggested": ("PackedAdamW packed, suggested biases", "adamw",
                         ["--optimizer", "packed-adamw", "--mode", "packed", *AUTOCAST]),
    "packed-bf16": ("PackedAdamW packed, bf16 weights + split masters", "adamw",
                    ["--optimizer", "packed-adamw", "--mode", "packed", "--param-dtype", "bf16"]),
    "bnb-adamw8bit": ("bitsandbytes AdamW8bit", "adamw", ["--optimizer", "bnb-adamw8bit", *AUTOCAST]),
    "torchao-adamw8bit": ("torchao AdamW8bit", "adamw", ["--optimizer", "torchao-adamw8bit", *AUTOCAST]),
    "muon": ("torch Muon (FP32 momentum) + fused AdamW (baseline)", "muon", ["--optimizer", "muon", *AUTOCAST]),
    "packed-muon": ("PackedMuonAdamW, packed momentum", "muon",
                    ["--optimizer", "packed-muon", "--muon-mode", "packed", *AUTOCAST]),
    "packed-muon-bf16-momentum": ("PackedMuonAdamW, bf16 momentum", "muon",
                                  ["--optimizer", "packed-muon", "--muon-mode", "bf16", *AUTOCAST]),
    "packed-muon-bf16-weights": ("PackedMuonAdamW, packed momentum, bf16 weights + split masters", "muon",
                                 ["--optimizer", "packed-muon", "--muon-mode", "packed", "--param-dtype", "bf16"]),
}
BASELINES = {"adamw": "adamw-fused", "muon": "muon"}
# PackedMuonAdamW's Newton-Schulz, which no trainer flag names (its defaults choose by device): a
# run of a packed-muon row is reused only if it ran the same. Runs recorded before the key existed
# ran torch's matmuls one matrix at a time, the default until 2026-12-06; since then, on GPUs of
# compute capability 8.0 or later, the Triton kernels, batched.
MUON_NS = "Triton batched"
MUON_NS_BEFORE = "torch matmuls per matrix"
SUGGESTED = "packed-suggested"
DEFAULT_BIASES = (15, 15)
PROBE_FLAGS = ["--optimizer", "packed-adamw", "--mode", "fp32", *AUTOCAST]  # FP32 moments to suggest from
# name -> trainer flags, batch and steps. gpt2-small takes GPT-2's peak learning rate (the trainer's
# 3e-3 is tuned for the reference model); Muon's (--muon-lr 0.02) is the same for both.
MODELS = {
    "reference": {"flags": ["--config", "reference"], "batch_size": 32, "steps": 600},
    "gpt2-small": {"flags": ["--config", "gpt2-small", "--lr", "6e-4", "--min-lr", "6e-5"], "batch_size": 8,
                   "steps": 400},
    "micro": {"flags": ["--config", "micro"], "batch_size": 2, "steps": 2},  # tests only
}
DEFAULT_MODELS = ["reference", "gpt2-small"]
PACKAGES = ("torch", "triton", "bitsandbytes", "torchao", "packed_adamw")
SUMMARY_KEYS = ("step", "stopped_because", "parameters", "val_bpb", "final_train_loss_mean_last_50",
                "optimizer_state_bytes", "peak_memory_bytes", "median_fwd_bwd_ms", "median_optimizer_ms",
                "tokens_per_s", "steady_tokens_per_s", "loss_event_count")
UNKNOWN_RUN_SHARE = 0.5  # a model with no finished run starts runs only in this share of the budget


def write_json(path: Path, record: dict) -> None:
    """The record, one run (or probe) a line: a diff shows which runs a call added, and the file
    stays about 2.7 kB a run (tools/release.py caps a text file in the source tree)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    def lines(value) -> str:  # "runs" is a list of runs, "probes" a dict of them by model
        if isinstance(value, dict):
            return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()) + "\n}"
        return "[\n" + ",\n".join(json.dumps(item) for item in value) + "\n]"

    text = "{\n" + ",\n".join(f"{json.dumps(key)}: {lines(value)}" for key, value in record.items()) + "\n}\n"
    atomic_write(path, text.encode())


def flag_items(argv: list[str]) -> list[str]:
    """A trainer command line as "--flag value" items, without --out (where a run lives is not how it ran)."""
    items = []
    for token in argv:
        if token.startswith("--") or not items:
            items.append(token)
        else:
            items[-1] += f" {token}"
    return [item for item in items if not item.startswith("--out ")]


# ---- what a call runs -----------------------------------------------------------------------

def preset(model: str) -> str:
    return MODELS[model]["flags"][1]


def steps(args, model: str) -> int:
    return args.steps or MODELS[model]["steps"]


def batch_size(args, model: str) -> int:
    return args.batch_size or MODELS[model]["batch_size"]


def common_flags(args, model: str, seed: int, out: Path) -> list[str]:
    """What every run of the model shares: its batch, length, schedule, evaluations and seed."""
    n = steps(args, model)
    return [*MODELS[model]["flags"], "--batch-size", str(batch_size(args, model)), "--data", str(args.data),
            "--out", str(out), "--max-steps", str(n), "--warmup-steps", str(max(1, n // 10)),
            "--eval-every", str(max(1, n // args.evals)), "--eval-batches", str(args.eval_batches),
            "--log-every", "10", "--seed", str(seed), "--no-progress"]


def suggested_biases(args, record: dict, model: str) -> tuple[int, int] | None:
    if args.suggested_biases:
        return tuple(args.suggested_biases)
    probe = record["probes"].get(model)
    return tuple(probe["biases"]) if probe and flag_items(probe["argv"]) == flag_items(probe_argv(args, model)) \
        else None


def run_argv(args, record: dict, model: str, row: str, seed: int) -> list[str] | None:
    """The trainer flags of one run; None for the suggested-biases row until its probe has run."""
    flags = list(ROWS[row][2])
    if row == SUGGESTED:
        biases = suggested_biases(args, record, model)
        if biases is None:
            return None
        flags += ["--m-bias", str(biases[0]), "--rms-bias", str(biases[1])]
    return [*common_flags(args, model, seed, run_directory(args, model, row, seed)), *flags, "--no-checkpoints"]


def probe_steps(args, model: str) -> int:
    return max(1, steps(args, model) // 4)


def probe_argv(args, model: str) -> list[str]:
    """The fp32 row, seed 0, stopped after a quarter of the schedule with a checkpoint to read."""
    return [*common_flags(args, model, 0, Path(args.runs) / model / "bias-probe"), *PROBE_FLAGS,
            "--stop-at-step", str(probe_steps(args, model)), "--checkpoint-every", "0", "--eval-every", "0"]


def run_directory(args, model: str, row: str, seed: int) -> Path:
    return Path(args.runs) / model / row / f"seed{seed}"


def missing_package(row: str) -> str | None:
    """"not installed: <pip command>" when the row's peer package is absent (looked up, not
    imported: importing bitsandbytes would start CUDA in this process)."""
    optimizer = ROWS[row][2][1]
    if optimizer not in PEERS:
        return None
    return None if importlib.util.find_spec(PEERS[optimizer].module.split(".")[0]) else (
        f"not installed: {PEERS[optimizer].pip}")


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_name() -> str:
    import torch  # here: the runs' processes use the GPU, this one only names it

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"


def session() -> dict:
    return {"date": datetime.date.today().isoformat(), "gpu": gpu_name(), "versions": versions()}


def load_record(path: Path) -> dict:
    if not path.exists():
        return {"runs": [], "probes": {}}
    record = json.loads(path.read_text())
    if not (isinstance(record, dict) and isinstance(record.get("runs"), list)):
        raise SystemExit(f"{path} is not a learning-evidence record (a JSON object with 'runs'): pass another "
                         "--record, or move it away")
    record.setdefault("probes", {})
    return record


def recorded_run(record: dict, model: str, row: str, seed: int, argv: list[str] | None,
                 newton_schulz: str | None = None) -> dict | None:
    """The record's run of (model, row, seed) with these trainer flags (--out aside) and, for a
    packed-muon row, `newton_schulz` (default: the one it runs now), or None."""
    if argv is None:
        return None
    wanted = newton_schulz or muon_ns_of(row)
    for run in record["runs"]:
        if (run["model"], run["row"], run["seed"]) == (model, row, seed) and \
                flag_items(run["argv"]) == flag_items(argv) and muon_ns_of(row, run) == wanted:
            return run
    return None


def muon_ns_of(row: str, run: dict | None = None) -> str | None:
    """The Newton-Schulz a packed-muon row runs now, or the recorded `run` of it took; None for
    other rows. Part of a run's key."""
    if "packed-muon" not in ROWS[row][2]:
        return None
    return muon_ns_now() if run is None else run.get("muon_ns", MUON_NS_BEFORE)


@functools.cache
def muon_ns_now() -> str:
    """What PackedMuonAdamW's defaults run on this machine's first GPU, the runs' device."""
    import torch  # here: as gpu_name()

    from packed_adamw.torch import _muon_ns as torch_muon_ns

    on_gpu = torch.cuda.is_available() and torch_muon_ns._auto_takes_triton(torch.device("cuda", 0))
    return MUON_NS if on_gpu else MUON_NS_BEFORE


def check_tapes(args) -> dict:
    """The training tape's identity, and a refusal (naming the fix) when it is not of the
    32,768-entry tokenizer or the longest run needs more tokens than it holds."""
    train = Path(args.data) / "train.tape"
    if not train.exists():
        raise SystemExit(f"no {train}: build the large corpus's tapes with `python -m "
                         "packed_adamw.tokenizer.large_corpus build --cache CACHE --out DIR --tapes` (docs/CORPUS.md) "
                         "and pass --data DIR")
    header, _ = read_header(train)
    if header.vocab_size != LARGE_VOCAB_SIZE:
        raise SystemExit(f"{train} has a {header.vocab_size:,}-token vocabulary; the evidence runs on tapes of the "
                         f"large corpus's {LARGE_VOCAB_SIZE:,}-entry tokenizer (docs/CORPUS.md)")
    need = max(steps(args, m) * batch_size(args, m) * PRESETS[preset(m)].context for m in args.models)
    if header.token_count <= need:
        raise SystemExit(f"{train} holds {header.token_count:,} tokens, the longest run reads {need + 1:,}: pass "
                         "fewer --steps or a smaller --batch-size")
    return {"path": str(train), "tokens": header.token_count, "vocab_size": header.vocab_size,
            "corpus_sha256": header.corpus_sha256, "header_sha256": header.header_sha256}


# ---- the runs -------------------------------------------------------------------------------

class Job:
    """One trainer subprocess: a run of the matrix or a model's bias probe."""

    def __init__(self, model: str, row: str, seed: int, argv: list[str], out: Path):
        self.model, self.row, self.seed, self.argv, self.out = model, row, seed, argv, out
        self.process, self.started, self.most_at_once = None, None, 1

    @property
    def name(self) -> str:
        return f"{self.model} {self.row}" + ("" if self.row == "bias-probe" else f" seed {self.seed}")

    def start(self) -> None:
        if self.out.exists():  # a run cut short: it has no checkpoint to go on from
            import shutil

            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        log = open(self.out / "train.log", "w")
        command = [sys.executable, "-m", "packed_adamw.torch.gpt.train", *self.argv]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.started = time.perf_counter()

    def stop(self) -> None:
        """SIGTERM: the trainer finishes its step and exits (it writes no checkpoint here)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def tail(self) -> str:
        lines = (self.out / "train.log").read_text(errors="replace").splitlines()
        return " | ".join(lines[-3:])


def finish_run(job: Job, record: dict, args) -> str:
    """The run's entry in the record, or why it has none."""
    wall_s = time.perf_counter() - job.started
    summary_path = job.out / "summary.json"
    if job.process.returncode != 0 or not summary_path.exists():
        return f"exit code {job.process.returncode}: {job.tail()}"
    summary = json.loads(summary_path.read_text())
    if summary["stopped_because"] != "max_steps":
        return f"stopped at step {summary['step']}: {summary['stopped_because']}"
    log = [json.loads(line) for line in (job.out / "log.jsonl").read_text().splitlines()]
    record["runs"] = [r for r in record["runs"] if (r["model"], r["row"], r["seed"]) != (job.model, job.row, job.seed)]
    record["runs"].append({
        "model": job.model, "row": job.row, "seed": job.seed, "argv": job.argv, "wall_s": round(wall_s, 1),
        "runs_sharing_the_gpu": job.most_at_once, "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        "val_curve": [[r["step"], r["val_bpb"]] for r in log if r.get("val_bpb") is not None],
        "train_curve": [[r["step"], r["loss"]] for r in log if "loss" in r], "session": session(),
        **({"muon_ns": muon_ns_now()} if muon_ns_of(job.row) else {})})
    write_json(Path(args.record), record)
    return f"val bpb {summary['val_bpb']:.4f}, {wall_s:.0f} s"


def finish_probe(job: Job, record: dict, args) -> str:
    """The biases suggest_biases reads off the probe's FP32 moments, into the record."""
    checkpoint = job.out / CHECKPOINT_NAME
    if job.process.returncode != 0 or not checkpoint.exists():
        return f"exit code {job.process.returncode}: {job.tail()}"
    state = load_state_file(checkpoint)
    values = [state.values(t) for t in state.tensors]
    suggestion = suggest_biases([m for m, _ in values], [rms for _, rms in values])
    checkpoint.unlink()  # 12 bytes a parameter, read now
    record["probes"][job.model] = {"biases": [suggestion.m_bias, suggestion.rms_bias], "argv": job.argv,
                                   "probe_steps": probe_steps(args, job.model), "suggestion": suggestion.as_dict(),
                                   "session": session()}
    write_json(Path(args.record), record)
    return f"suggested biases {suggestion.m_bias}/{suggestion.rms_bias}"


def plan(args, record: dict) -> tuple[list[tuple[str, str, int]], dict[str, str]]:
    """The runs this call asks for that the record lacks, seed by seed (a call cut short has every
    row's first seeds), and the rows that cannot run (a missing package), with the reason."""
    skipped = {row: reason for row in args.rows if (reason := missing_package(row))}
    wanted = [(m, row, s) for s in args.seeds for m in args.models for row in args.rows if row not in skipped]
    return [(m, row, s) for m, row, s in wanted
            if not recorded_run(record, m, row, s, run_argv(args, record, m, row, s))
            and not same_as_packed(args, record, m, row)], skipped


def same_as_packed(args, record: dict, model: str, row: str) -> bool:
    """The suggested-biases row whose suggestion is the default biases is the packed row itself."""
    return row == SUGGESTED and suggested_biases(args, record, model) == DEFAULT_BIASES


def run_all(args, record: dict) -> list[str]:
    """Run the pending runs --jobs at a time within the budget; returns what was left undone."""
    pending, _ = plan(args, record)
    probes = [Job(m, "bias-probe", 0, probe_argv(args, m), Path(args.runs) / m / "bias-probe")
              for m in args.models if SUGGESTED in args.rows and suggested_biases(args, record, m) is None
              and missing_package(SUGGESTED) is None]
    started, running, longest = time.perf_counter(), [], {}

    def fits(model: str) -> bool:
        if args.time_budget is None:
            return True
        spent = time.perf_counter() - started
        guess = longest.get(model)
        return spent <= UNKNOWN_RUN_SHARE * args.time_budget if guess is None else spent + guess <= args.time_budget

    def next_job() -> Job | None:
        if probes and fits(probes[0].model):
            return probes.pop(0)
        for index, (model, row, seed) in enumerate(pending):
            if same_as_packed(args, record, model, row):  # its probe suggested 15/15: nothing to run
                pending.pop(index)
                return next_job()
            argv = run_argv(args, record, model, row, seed)
            if argv is not None and fits(model):  # (the suggested row waits for its probe)
                pending.pop(index)
                return Job(model, row, seed, argv, run_directory(args, model, row, seed))
        return None

    def over_budget() -> bool:
        return args.time_budget is not None and time.perf_counter() - started > args.time_budget

    def terminated(signum, frame):  # `timeout` sends SIGTERM: stop the runs too (the finally below)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        while True:
            while len(running) < args.jobs and (job := next_job()):
                job.start()
                running.append(job)
                for other in running:
                    other.most_at_once = max(other.most_at_once, len(running))
                print(f"start {job.name} ({len(running)} running)", flush=True)
            if not running:
                break
            if over_budget():
                print(f"time budget of {args.time_budget:.0f} s spent: stopping {len(running)} runs", flush=True)
                for job in running:
                    job.stop()
                    if job.row == "bias-probe":
                        probes.append(job)
                    else:
                        pending.append((job.model, job.row, job.seed))
                running.clear()
                break
            time.sleep(1.0)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                outcome = (finish_probe if job.row == "bias-probe" else finish_run)(job, record, args)
                if job.row != "bias-probe" and (job.out / "summary.json").exists():
                    longest[job.model] = max(longest.get(job.model, 0.0), time.perf_counter() - job.started)
                print(f"done {job.name}: {outcome}", flush=True)
    finally:  # an interrupted call stops its runs (they start again next time)
        signal.signal(signal.SIGTERM, previous)
        for job in running:
            job.stop()
    left = [f"{m} {row} seed {s}" for m, row, s in pending] + [f"{j.model} bias-probe" for j in probes]
    for line in left:
        print(f"left: {line}", flush=True)
    return left


# ---- the page -------------------------------------------------------------------------------

def seeds_of(record: dict, args, model: str, row: str) -> dict[int, dict]:
    """The record's runs of the row with this call's flags, by seed. A packed-muon row with no run
    of today's Newton-Schulz shows its runs of the one before (MUON_NS_BEFORE; the page says so)
    until a call reruns them: never a mix of the two."""
    for newton_schulz in dict.fromkeys([muon_ns_of(row), muon_ns_of(row, {})]):
        found = {}
        for run in record["runs"]:
            if run["model"] == model and run["row"] == row and recorded_run(
                    record, model, row, run["seed"], run_argv(args, record, model, row, run["seed"]), newton_schulz):
                found[run["seed"]] = run
        if found:
            return found
    return {}


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def fmt(value, digits=4, sign=False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def mean_curve(runs: dict[int, dict]) -> tuple[list[int], list[float]]:
    """The seeds' mean validation curve at the steps every seed evaluated."""
    curves = [dict(map(tuple, run["val_curve"])) for run in runs.values()]
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return common, [statistics.fmean(c[s] for c in curves) for s in common]


def still_falling(runs: dict[int, dict]) -> str:
    """Whether the mean validation bpb fell over the last evaluation interval."""
    steps_, values = mean_curve(runs)
    if len(values) < 2:
        return "- (fewer than 2 evaluations)"
    change = values[-1] - values[-2]
    return f"{'yes' if change < 0 else 'no'} ({change:+.4f} bpb from step {steps_[-2]} to {steps_[-1]})"


def row_line(row: str, runs: dict, baseline: dict, label: str) -> str:
    bpbs = [run["summary"]["val_bpb"] for run in runs.values()]
    mean, sd = mean_sd(bpbs)
    common = sorted(set(runs) & set(baseline))
    base_bpbs = [run["summary"]["val_bpb"] for run in baseline.values()]
    base_spread = f"{max(base_bpbs) - min(base_bpbs):.4f}" if len(base_bpbs) > 1 else "-"
    if row in BASELINES.values() or not common:
        paired, within = ("baseline", "-") if row in BASELINES.values() else ("-", "-")
    else:
        differences = [runs[s]["summary"]["val_bpb"] - baseline[s]["summary"]["val_bpb"] for s in common]
        d_mean, d_sd = mean_sd(differences)
        paired = f"{d_mean:+.4f} (sd {fmt(d_sd)}, seeds {','.join(map(str, common))})"
        # the target: the row's mean inside the range the baseline's seeds span
        within = ("yes" if min(base_bpbs) <= mean <= max(base_bpbs) else "no") if len(base_bpbs) > 1 else "-"

    def per_param(key):
        values = [run["summary"][key] / run["summary"]["parameters"] for run in runs.values()
                  if run["summary"].get(key) is not None]
        return statistics.fmean(values) if values else None

    step_ms = [run["summary"]["median_fwd_bwd_ms"] + run["summary"]["median_optimizer_ms"] for run in runs.values()
               if run["summary"].get("median_optimizer_ms") is not None]
    opt_ms = [run["summary"]["median_optimizer_ms"] for run in runs.values()
              if run["summary"].get("median_optimizer_ms") is not None]
    sharing = sorted({run["runs_sharing_the_gpu"] for run in runs.values()})
    peak = [run["summary"]["peak_memory_bytes"] for run in runs.values() if run["summary"].get("peak_memory_bytes")]
    spikes = sum(run["summary"].get("loss_event_count") or 0 for run in runs.values())
    return (f"| {label} | {len(runs)} | {mean:.4f} | {fmt(sd)} | {min(bpbs):.4f}-{max(bpbs):.4f} | {paired} | "
            f"{base_spread} | {within} | {fmt(per_param('optimizer_state_bytes'), 2)} | "
            f"{fmt(statistics.fmean(peak) / 2**30 if peak else None, 2)} | "
            f"{fmt(statistics.median(step_ms) if step_ms else None, 1)} | "
            f"{fmt(statistics.median(opt_ms) if opt_ms else None, 2)} | {'/'.join(map(str, sharing))} | {spikes} |")


def plot(record: dict, args, models: list[str], png: Path) -> None:
    groups = list(BASELINES)
    figure, axes = plt.subplots(len(models), len(groups), figsize=(6 * len(groups), 4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, group in enumerate(groups):
            axis = axes[i][j]
            for row in (r for r in ROWS if ROWS[r][1] == group):
                runs = seeds_of(record, args, model, row)
                if runs:
                    xs, ys = mean_curve(runs)
                    axis.plot(xs, ys, label=f"{row} ({len(runs)} seeds)", lw=2 if row in BASELINES.values() else 1)
            axis.set_title(f"{model}: {group} rows")
            axis.set_xlabel("step")
            axis.set_ylabel("validation bpb (mean over seeds)")
            if axis.lines:
                axis.legend(fontsize=7)
                ys = [y for line in axis.lines for y in line.get_ydata()]
                axis.set_ylim(min(ys) - 0.02, min(max(ys), min(ys) + 1.0))  # the late curve, not the first drop
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)


def write_page(args, record: dict, skipped: dict, left: list[str], tapes: dict | None) -> Path:
    out = Path(args.out_dir)
    page, png = out / "LEARNING_EVIDENCE.md", out / "learning_evidence.png"
    models = [m for m in MODELS if m in args.models or any(r["model"] == m for r in record["runs"])]
    sessions = [r["session"] for r in record["runs"]]
    dates = sorted({s["date"] for s in sessions})
    lines = ["# Learning evidence: AdamW and Muon + AdamW rows on the large corpus", "",
             f"- Page written {datetime.date.today().isoformat()}; runs "
             + (f"from {dates[0]} to {dates[-1]}" if dates else "none yet"),
             "- GPU: " + ", ".join(sorted({s['gpu'] for s in sessions}) or [gpu_name()]) + "; " + ", ".join(
                 sorted({f"{k} {v}" for s in sessions for k, v in s["versions"].items() if v})),
             f"- This page's call: `{args.invocation}`. The record ({Path(args.record).name}) keeps the runs of "
             "every call with the same trainer flags, so the tables can hold runs of earlier calls (other seeds or "
             "rows); each run's GPU, versions and runs sharing the GPU are in its record entry",
             "- Tapes: " + (f"`{tapes['path']}`, {tapes['tokens']:,} training tokens, vocabulary "
                            f"{tapes['vocab_size']:,}, corpus SHA-256 `{tapes['corpus_sha256'][:16]}...`" if tapes
                            else "(report only)"),
             "- Each run: the trainer on the training tape read in order from its start (the same tokens for every "
             "row and seed; the seed draws the initialisation), warmup over a tenth of the steps then cosine decay, "
             "clipping at 1.0, weight decay 0.1 (AdamW: matrices and embeddings; Muon: its matrices), AdamW betas "
             "(0.9, 0.95), eps 1e-8; Muon lr 0.02 (scaled by the schedule as AdamW's), momentum 0.95, Nesterov; "
             f"FP32-weight rows under bf16 autocast; validation on the first {args.eval_batches} batches of the "
             "validation tape (the same tokens for every run) at every evaluation.",
             "- Columns: final val bpb, mean over the seeds, its standard deviation and range; paired difference: "
             "the mean over seeds of (row - its group's baseline) for the same seed, with that difference's sd "
             "across seeds beside it; baseline range: the baseline's max - min over seeds (its seed noise); within: "
             "whether the row's mean lies inside the baseline's range (the issue's target for the packed rows); "
             "optimizer state: bytes of optimizer.state per parameter (with bf16 weights, the masters' low halves "
             "included); peak memory: torch.cuda.max_memory_allocated of the run's process; step and optimizer ms: "
             "medians from step 6 on, of runs that shared the GPU with the number of runs in 'at once' (so they "
             "are slower than alone); spikes: steps whose training loss exceeded 1.5x the lowest so far.", "",
             f"![validation bpb]({png.name})", ""]
    for model in models:
        config = PRESETS[preset(model)]
        n, batch = steps(args, model), batch_size(args, model)
        tokens = n * batch * config.context
        share = f", {tokens / tapes['tokens']:.0%} of the training tape" if tapes else ""
        lines += [f"## {model}", "",
                  f"Preset `{preset(model)}` (d_model {config.d_model}, {config.n_layers} layers, context {config.context}) "
                  f"with the tapes' vocabulary; {n} steps of batch {batch}: {tokens:,} tokens a run{share}; "
                  f"trainer flags `{' '.join(MODELS[model]['flags'])}`.", ""]
        for group, baseline_row in BASELINES.items():
            baseline = seeds_of(record, args, model, baseline_row)
            lines += [f"### {group} rows", "",
                      "| row | seeds | final val bpb | sd | range | paired difference vs baseline | baseline range "
                      "| within baseline range | optimizer state B/param | peak memory GiB | step ms | optimizer ms "
                      "| at once | spikes |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for row in (r for r in ROWS if ROWS[r][1] == group and (r in args.rows or seeds_of(record, args, model, r))):
                label = ROWS[row][0]
                runs = seeds_of(record, args, model, row)
                if any(muon_ns_of(row, run) == MUON_NS_BEFORE for run in runs.values()):
                    label += f" (Newton-Schulz: {MUON_NS_BEFORE}, the default before 2026-12-06)"
                if row == SUGGESTED and (biases := suggested_biases(args, record, model)):
                    label += f" {biases[0]}/{biases[1]}"
                if runs:
                    lines.append(row_line(row, runs, baseline, label))
                else:
                    why = skipped.get(row) or ("the suggestion is the default 15/15: the packed row"
                                               if same_as_packed(args, record, model, row) else "not run yet")
                    lines.append(f"| {label} | 0 | {why} |" + " |" * 11)
            if baseline:
                lines += ["", f"- Baseline's mean val bpb still falling at the last evaluation: "
                              f"{still_falling(baseline)}"]
            lines.append("")
        adamw, muon = (seeds_of(record, args, model, BASELINES[g]) for g in ("adamw", "muon"))
        common = sorted(set(adamw) & set(muon))
        if common:
            d_mean, d_sd = mean_sd([muon[s]["summary"]["val_bpb"] - adamw[s]["summary"]["val_bpb"] for s in common])
            lines += [f"- Muon + AdamW baseline against the AdamW baseline at equal tokens: {d_mean:+.4f} bpb "
                      f"(sd {fmt(d_sd)} over seeds {','.join(map(str, common))}).", ""]
        probe = record["probes"].get(model)
        if probe and not args.suggested_biases:
            lines += [f"- Suggested biases {probe['biases'][0]}/{probe['biases'][1]}: suggest_biases on the FP32 "
                      f"moments of PackedAdamW fp32, seed 0, after {probe['probe_steps']} steps.", ""]
    if left:
        lines += ["## Left for a later call", "", *[f"- {line}" for line in left], ""]
    lines += ["## Rows", ""] + [f"- `{row}`: {label}; `{' '.join(flags)}`" for row, (label, _, flags) in ROWS.items()]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(page, ("\n".join(lines) + "\n").encode())
    plot(record, args, models, png)
    return page


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=8, help="runs at once on the GPU (default 8)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="start no run that would end after S seconds, and stop those running at S")
    parser.add_argument("--steps", type=int, default=None, help="every model's steps (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=None, help="every model's batch (default: the model's)")
    parser.add_argument("--evals", type=int, default=8, help="evaluations a run (default 8)")
    parser.add_argument("--eval-batches", type=int, default=40,
                        help="validation batches an evaluation (default 40; 0: the whole validation tape)")
    parser.add_argument("--suggested-biases", nargs=2, type=int, metavar=("M", "RMS"),
                        help="the packed-suggested row's biases (default: a probe suggests them per model)")
    parser.add_argument("--data", default="runs/data/large-corpus", help="directory with train.tape and val.tape")
    parser.add_argument("--runs", default="runs/evidence", help="the runs' scratch directories")
    parser.add_argument("--record", default="docs/results/learning_evidence.json",
                        help="the finished runs (read, and written after each run)")
    parser.add_argument("--out-dir", default="docs/results", help="where the page and its PNG go")
    parser.add_argument("--report-only", action="store_true", help="write the page from the record, run nothing")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.evals < 1 or args.eval_batches < 0:
        parser.error("--jobs and --evals must be at least 1, --eval-batches at least 0")
    # How it ran, not where its outputs went (on the GPU machine, a directory of that machine)
    given = [item for item in flag_items(sys.argv[1:] if argv is None else argv)
             if item.split()[0] not in ("--out-dir", "--record")]
    args.invocation = " ".join(["python benchmarks/learning_evidence.py", *given])
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    record = load_record(Path(args.record))
    _, skipped = plan(args, record)
    tapes, left = None, []
    if not args.report_only:
        tapes = check_tapes(args)
        left = run_all(args, record)
    page = write_page(args, record, skipped, left, tapes)
    print(f"wrote {page}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
