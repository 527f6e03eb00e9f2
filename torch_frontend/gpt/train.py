"""Train the reference GPT from a finite token tape, with exact-resume checkpoints.

    python -m packed_adamw.torch.gpt.train --demo                # tiny GPT on the embedded corpus, CPU
    python -m packed_adamw.torch.gpt.train --config reference --mode packed --device cuda \\
        --data runs/data/shakespeare --max-steps 5000 --batch-size 64
    python -m packed_adamw.torch.gpt.train ... --resume auto     # continue from <out>/checkpoint.safetensors
    python -m packed_adamw.torch.gpt.train ... --param-dtype bf16   # bf16 weights, PackedAdamW's split FP32 masters
    python -m packed_adamw.torch.gpt.train ... --optimizer torchao-adamw8bit --autocast bf16 --no-checkpoints
    python -m packed_adamw.torch.gpt.train --synthetic           # one update on random tokens (smoke test)
    torchrun --nproc_per_node=2 -m packed_adamw.torch.gpt.train --parallel fsdp ...   # or --parallel ddp

The tape is read front to back once (docs/TAPE.md); training ends when it runs out or after
--max-steps. The learning rate is a pure function of the step, there is no dropout, and the
checkpoint holds everything else (model, optimizer, tape cursor, RNG), so a resumed run
ends bit-identical to an uninterrupted one. SIGINT/SIGTERM finish the current step, write a
checkpoint and exit with code 0. One run at a time uses an --out (a lock), and a run that does
not continue the checkpoint there never replaces an earlier run's files (run_directory.py); a
file that cannot be written (a full disk) ends the run naming it (exit 1). Under torchrun,
rank r of W reads every W-th batch window of the tape (a step reads the tokens a single
process with W times the batch would); DDP checkpoints are one file, FSDP2 ones a
torch.distributed.checkpoint directory. See docs/TRAINING.md and docs/DISTRIBUTED.md.
"""
# The loop is here, read top to bottom; around it: config.py and cli.py (settings, their
# checks, the command line), families.py (what --config builds), optimizers.py (what
# --optimizer builds, and what each kind offers), data.py (the tapes), distributed.py
# (ranks, DDP, FSDP2), telemetry.py (log records, statistics, plots), checkpoint.py (files),
# run_directory.py (--out: its lock, the refusals that keep its files, signals, failed writes).
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from packed_adamw.core import codecs as formats
from packed_adamw.tokenizer.corpus import CorpusNotInstalledError
from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader

from . import cli
from .checkpoint import (
    CHECKPOINT_NAME, MANIFEST_NAME, SHARDED_CHECKPOINT_NAME, CheckpointError, checkpoint_info,
    load_run_state, save_run_state,
)
from .cli import check_config, moment_stats_biases
from .config import AUTOCAST, PARAM_DTYPES, ConfigError, TrainConfig, model_config
from .data import TapeShard, open_tapes
from .distributed import Ranks, ddp_rebuild_buckets, full, launched_rank, resolve_device, start_ranks, wrap_model
from .families import family_of
from .optimizers import optimizer_kind, set_learning_rate
from .run_directory import (
    GuardedRunLog, RunDirectoryError, RunFiles, RunWriteError, StopRequest, claim, finished_run_summary,
    refuse_earlier_run, refuse_to_replace, write_summary, writing,
)
from .telemetry import (
    FormatCounts, LossWatch, StepTimes, is_log_step, keep_records_up_to, moment_stats, plot_format_log, plot_log,
)

# benchmarks/peers.py reads these through this module, with the ones above
from .optimizers import PEERS, peer_class  # noqa: F401
from .telemetry import LOSS_SPIKE  # noqa: F401


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at max_steps (step counts from 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_model(config: TrainConfig, device: torch.device,
                vocab_size: int | None = None) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]:
    """The --config model initialised from `config.seed`, its parameters in `config.param_dtype`,
    its vocabulary `vocab_size` (the tapes'; None: the preset's).

    The initialisation is always drawn in FP32 (the same values for every run of a seed). With
    `--param-dtype bf16` each parameter then becomes its FP32 value rounded to the nearest bf16
    by the split rule (ties away from zero; FORMAT.md, "Split masters"), the same live weights
    for PackedAdamW and torch AdamW, and the FP32 values are returned by parameter name (None
    for an FP32 run) for PackedAdamW to take as its masters (`OptimizerKind.start_masters`).
    """
    torch.manual_seed(config.seed)
    model = family_of(config.config).build(model_config(config.config, vocab_size)).to(device)
    if config.param_dtype == "fp32":
        return model, None
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.to(PARAM_DTYPES[config.param_dtype])
    with torch.no_grad():
        for name, p in model.named_parameters():
            weight_bits, _ = formats.split_master(initial[name].cpu().numpy())
            p.copy_(torch.from_numpy(weight_bits.view(np.int16)).view(torch.bfloat16))
    return model, initial


def gradient_norm_(parameters, max_norm: float | None, param_dtype: str) -> torch.Tensor:
    """The global gradient norm, after clipping the gradients to `max_norm` (None: no clipping).

    FP32 gradients go through torch's clip_grad_norm_ / get_total_norm. bf16 gradients' norm
    is accumulated in float32 (torch's would be rounded to bf16, 8 significant bits); torch's
    clip_grads_with_norm_ then multiplies the float32 clipping factor into the bf16 gradients,
    each product computed in float32 and rounded once to bf16.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if param_dtype == "fp32":
        if max_norm is None:
            return torch.nn.utils.get_total_norm(grads)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def autocast_context(config: TrainConfig, device: torch.device):
    """--autocast bf16: torch.autocast around the forward and loss; otherwise nothing."""
    dtype = AUTOCAST[config.autocast]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def validation_bpb(model, tape: TapeReader, batch_size: int, max_batches: int, device) -> float | None:
    """Bits per byte: summed token losses (nats) / (ln 2 * UTF-8 bytes of the target tokens).

    The model runs with the weights it trains with: under --param-dtype bf16 the bf16 live
    weights, not PackedAdamW's FP32 masters."""
    context = model.config.context
    nats, byte_count = 0.0, 0
    for index, (x, y) in enumerate(tape.iter_eval_batches(batch_size, context)):
        if index == max_batches > 0:
            break
        _, loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device), reduction="sum")
        nats += loss.item()
        byte_count += int(tape.token_byte_counts[y].sum())
    return nats / (math.log(2) * byte_count) if byte_count else None


def evaluate(core, val_tape: TapeReader, config: TrainConfig, device: torch.device, ranks: Ranks) -> float | None:
    """Validation bpb of the model as it trains (under --autocast too)."""
    with autocast_context(config, device):
        bpb = validation_bpb(core, val_tape, config.batch_size, config.eval_batches, device)
    if ranks.parallel == "fsdp":
        # FSDP2's root keeps its parameters gathered after a forward (until the next
        # backward) and registers those: put the shards back before the statistics,
        # checkpoints and optimizer see the module's parameters again.
        core.reshard()
    return bpb


def finished(step: int, tape: TapeReader | TapeShard, config: TrainConfig, context: int) -> bool:
    """Whether a resumed run has nothing left to do (its summary then stands)."""
    return (step >= config.max_steps or 0 < config.stop_at_step <= step
            or tape.remaining_batches(config.batch_size, context) == 0)


RUN_FILES = RunFiles(
    results=(CHECKPOINT_NAME, SHARDED_CHECKPOINT_NAME, "summary.json"), logs=("log.jsonl", "moment_stats.jsonl"),
    before_first_step=(),  # the log is opened before the first step, and counts only once it holds a record
    states=lambda out: [out / name for name in (CHECKPOINT_NAME, SHARDED_CHECKPOINT_NAME)
                        if (out / name).exists() or (out / name).is_symlink()],
    state_step=lambda path: None, resume_flag=lambda path: "--resume auto")


def resume_source(config: TrainConfig, checkpoint_path: Path) -> Path | None:
    """The checkpoint to resume from: None (fresh start: refused by refuse_earlier_run where --out
    holds another run's files), out's own, a file, or a run directory's."""
    other = checkpoint_path.with_name(CHECKPOINT_NAME if config.parallel == "fsdp" else SHARDED_CHECKPOINT_NAME)
    if other.exists():  # logs and summary of one run per --out
        kind = "a --parallel fsdp run" if config.parallel != "fsdp" else "a run without --parallel fsdp"
        raise CheckpointError(f"--out {checkpoint_path.parent} holds {other}, the checkpoint of {kind}; this run "
                              f"writes {checkpoint_path.name}: choose another --out")
    if config.resume == "":
        return None
    if config.resume == "auto":
        return checkpoint_path if checkpoint_path.exists() else None
    path = Path(config.resume)
    if path.is_dir() and not ((path / MANIFEST_NAME).is_file() or (path / ".metadata").is_file()):
        # a run directory (not a DCP checkpoint directory): its checkpoint has one name
        name = config.checkpoint_name
        if not (path / name).exists():
            raise CheckpointError(f"--resume {path} is a directory without {name} (looked for {path / name}); "
                                  "pass a checkpoint or a run's --out directory")
        path = path / name
    return path


# ---- the training run -----------------------------------------------------------------------

def train(config: TrainConfig) -> dict:
    """Run (or resume) training; returns the summary that is also written to summary.json.

    With --parallel ddp or fsdp every rank of the torchrun launch runs this; rank 0 alone
    prints, writes the log, the plot and the summary, and every rank returns the summary.
    """
    check_config(config)
    device = resolve_device(config.device, config.deterministic, config.parallel)
    ranks = start_ranks(config.parallel, device)
    out = config.out_dir

    def refuse_fresh_start_over_another_run() -> None:
        if resume_source(config, out / config.checkpoint_name) is None:
            refuse_earlier_run(out, RUN_FILES)

    try:
        with claim(out, ranks, device, refuse_fresh_start_over_another_run):
            return _train(config, device, ranks)
    finally:
        ranks.close()


def _train(config: TrainConfig, device: torch.device, ranks: Ranks) -> dict:
    say = print if ranks.main else (lambda *args, **kwargs: None)
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path, log_path = out / config.checkpoint_name, out / "log.jsonl"
    train_tape, val_tape = open_tapes(config, ranks)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the summary's peak_memory_bytes covers this session

    kind, family = optimizer_kind(config.optimizer), family_of(config.config)
    vocab_size = train_tape.header.vocab_size  # the model's embedding follows the tapes' tokenizer
    core, initial = build_model(config, device, vocab_size)  # the same weights on every rank
    # DDP wraps the model; fully_shard turns its parameters into DTensors in place (model is core)
    model = wrap_model(core, ranks, device)
    optimizer = kind.build(core, config)
    trajectory = config.trajectory(vocab_size)
    context = core.config.context
    if ranks.distributed:
        train_tape = TapeShard(train_tape, ranks.rank, ranks.world_size, config.batch_size, context)
    tokens_per_step = ranks.world_size * config.batch_size * context
    run_state = dict(model=core, optimizer=optimizer, tape=train_tape, config=trajectory)

    resume_path = resume_source(config, checkpoint_path)
    step = 0
    if resume_path is None:
        kind.start_masters(optimizer, core, initial)
    else:
        step = load_run_state(resume_path, ranks.parallel, ranks.rank if ranks.distributed else None,
                              **run_state)["step"]
        # before anything in --out is written or its logs trimmed: no newer checkpoint, none of
        # another configuration, and no other run's files under a checkpoint from elsewhere
        refuse_to_replace(out, RUN_FILES, resume_path, step, trajectory, read_info=checkpoint_info)
        say(f"resumed from {resume_path} at step {step}")
    summary_path = out / "summary.json"

    def summarize(reason: str, losses: LossWatch, times: StepTimes, val_bpb: float | None) -> dict:
        summary = {
            "stopped_because": reason,
            "step": step,
            "steps_this_session": len(times.step),
            "parameters": core.num_parameters(),
            "final_train_loss_mean_last_50": losses.recent_mean(),
            "val_bpb": val_bpb,
            **times.summary(tokens_per_step),
            "optimizer_state_bytes": kind.state_bytes(optimizer),  # this rank's (an FSDP2 shard's)
            **losses.summary(),
            "log": str(log_path), "plot": str(out / "loss.png"),
            "checkpoint": str(checkpoint_path) if config.checkpoints else None,
            "config": dataclasses.asdict(config),
        }
        if config.track_format:
            summary["format_plot"] = str(out / "format.png")
        if ranks.distributed:
            summary["world_size"] = ranks.world_size
        return summary

    def summary_from_log(records: list[dict]) -> dict:
        """A finished run's summary from its log (its summary.json was lost after the final
        checkpoint): the logged steps' losses, gradient norms and times, the last val_bpb."""
        losses, times = LossWatch(config), StepTimes()
        for record in records:
            if {"loss", "grad_norm", "fwd_bwd_ms", "optimizer_ms"} <= record.keys():  # a logged step
                losses.observe(record["step"], record["loss"], record["grad_norm"])
                fwd_bwd, optimizer_s = record["fwd_bwd_ms"] / 1e3, record["optimizer_ms"] / 1e3
                times.add(0.0, fwd_bwd, fwd_bwd + optimizer_s)
        val = [record["val_bpb"] for record in records if "val_bpb" in record]
        reason = ("max_steps" if step >= config.max_steps else
                  "stop_at_step" if 0 < config.stop_at_step <= step else "tape_exhausted")
        return {**summarize(reason, losses, times, val[-1] if val else None), "steps_this_session": 0}

    if resume_path is not None and finished(step, train_tape, config, context):
        # nothing left to do, and nothing in --out changes (but a summary lost after the final checkpoint)
        return finished_run_summary(resume_path, summary_path, log_path, step, summary_from_log,
                                    write=ranks.main, say=say)
    # The logs cover steps up to the resume point; later lines came from a session that died
    # (the last of them possibly cut short by the crash).
    if ranks.main:
        for path in (log_path, out / "moment_stats.jsonl"):
            with writing(path):
                keep_records_up_to(path, step if resume_path else 0)

    def save(reason: str) -> None:
        # A failed write (a full disk) ends the run naming the file (RunWriteError, an OSError);
        # the write is atomic, so the previous checkpoint stands.
        if config.checkpoints:
            with writing(checkpoint_path):
                save_run_state(checkpoint_path, ranks.parallel, **run_state, trainer={"step": step, "reason": reason})

    parallel = f"; {ranks.parallel} on {ranks.world_size} ranks" if ranks.distributed else ""
    masters = " with split FP32 masters" if kind.split_masters else ""
    dtype = "" if config.param_dtype == "fp32" else f"; {config.param_dtype} parameters{masters}"
    say(f"model {config.config}: {core.num_parameters():,} parameters{dtype}; {kind.describe(config)}; "
        f"device {device}{parallel}; "
        f"{train_tape.remaining_batches(config.batch_size, context)} batches left on {train_tape.path}")
    if ranks.parallel == "ddp" and step < config.max_steps:
        ddp_rebuild_buckets(model, config.batch_size, context, device)
    moment_biases = moment_stats_biases(config)
    format_kinds = sorted({family.parameter_kind(name) for name, _ in core.named_parameters()})
    format_counts = FormatCounts(config, optimizer, format_kinds, step + 1, ranks, device, family.parameter_kind)
    losses, times = LossWatch(config), StepTimes()
    val_bpb = None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bar = tqdm(total=config.max_steps, initial=step, disable=not (config.progress and ranks.main), unit="step")

    with StopRequest() as stop, GuardedRunLog(log_path, ranks) as log:
        while True:
            if step >= config.max_steps:
                reason = "max_steps"
                break
            if 0 < config.stop_at_step <= step:
                reason = "stop_at_step"
                break
            signal_name = stop.agreed(ranks, device)
            if signal_name:
                reason = signal_name
                if ranks.main:
                    print(f"\n{reason} received: {'writing a checkpoint and ' if config.checkpoints else ''}"
                          "stopping", file=sys.stderr)
                break
            try:
                x, y = train_tape.next_batch(config.batch_size, context)
            except TapeExhausted as exhausted:  # on every rank at the same step (TapeShard)
                reason = "tape_exhausted"
                say(f"\ntraining tape exhausted at step {step}: {exhausted}")
                break

            start = time.perf_counter()
            set_learning_rate(optimizer, learning_rate(step, config))
            with autocast_context(config, device):
                _, loss = model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces, FSDP2 reduce-scatters the gradients: the mean over ranks
            grad_norm = gradient_norm_(model.parameters(), config.grad_clip, config.param_dtype)
            sync()
            after_backward = time.perf_counter()
            format_counts.before_step(step)
            optimizer.step()
            sync()
            end = time.perf_counter()
            step += 1

            losses.observe(step, loss.item(), float(full(grad_norm)))  # this rank's loss (its windows)
            times.add(start, after_backward, end)
            record = None
            if is_log_step(step, config):
                record = {"step": step, "loss": losses.last, "lr": float(optimizer.param_groups[0]["lr"]),
                          "grad_norm": float(full(grad_norm)), "tokens_per_s": tokens_per_step / (end - start),
                          "fwd_bwd_ms": 1e3 * times.fwd_bwd[-1], "optimizer_ms": 1e3 * times.optimizer[-1]}
            if config.eval_every and step % config.eval_every == 0:
                val_bpb = evaluate(core, val_tape, config, device, ranks)
                record = {**(record or {"step": step}), "val_bpb": val_bpb}
            if record:
                log.write(record)
            format_counts.after_step(step, log)
            if config.log_moment_stats and step % config.moment_stats_every == 0:
                stats = moment_stats(core, optimizer, step, moment_biases, family.parameter_kind)  # FSDP2 gathers
                log.append_to(out / "moment_stats.jsonl", stats)
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save("periodic")
            bar.update(1)
            bar.set_postfix(loss=f"{losses.last:.3f}", val_bpb=f"{val_bpb:.3f}" if val_bpb else "-")
        bar.close()

        save(reason)  # first: a signal's grace period may not outlast a validation pass
        if times.step and not (config.eval_every and step % config.eval_every == 0):
            val_bpb = evaluate(core, val_tape, config, device, ranks)
            log.write({"step": step, "val_bpb": val_bpb})
        format_counts.finish(step, log)

    summary = summarize(reason, losses, times, val_bpb)
    if device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if ranks.main:
        plot_log(log_path, out / "loss.png")
        if config.track_format:
            plot_format_log(log_path, out / "format.png")
        write_summary(summary_path, summary)
    ranks.barrier()  # the summary is in place before any rank returns
    return summary


def synthetic_smoke(config: TrainConfig) -> dict:
    """One update on random tokens: checks the plumbing, not learning."""
    check_config(config)
    device = resolve_device(config.device, config.deterministic)
    kind = optimizer_kind(config.optimizer)
    model, initial = build_model(config, device)
    optimizer = kind.build(model, config)
    kind.start_masters(optimizer, model, initial)
    tokens = torch.randint(0, model.config.vocab_size, (config.batch_size, model.config.context + 1), device=device)
    before = kind.trained_values(optimizer, model, config.param_dtype)
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    after = kind.trained_values(optimizer, model, config.param_dtype)
    changed = sum(not torch.equal(a, b) for a, b in zip(before, after))
    # torch AdamW on bf16 weights drops every update below half a bf16 ulp (the baseline's
    # inexactness: a LayerNorm weight of 1.0 moves only for an update beyond 2**-9), so some
    # tensors may keep their weights; it must move at least one.
    inexact = config.param_dtype != "fp32" and not kind.split_masters
    return {"loss": loss.item(), "loss_finite": math.isfinite(loss.item()),
            "tensors_changed": changed, "tensors": len(before), "tensors_required": 1 if inexact else len(before)}


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv=None) -> tuple[TrainConfig, object]:
    """The command line's settings, checked (cli.parse_args, with this module's usage as --help)."""
    return cli.parse_args(argv, description=__doc__)


def main(argv=None) -> int:
    config, args = parse_args(argv)
    try:
        if args.synthetic:
            result = synthetic_smoke(config)
            print("SYNTHETIC SMOKE TEST (random tokens, one update): checks that the code runs, "
                  "NOT evidence of learning")
            print(json.dumps(result))
            return 0 if result["loss_finite"] and result["tensors_changed"] >= result["tensors_required"] else 1
        summary = train(config)
    except (CheckpointError, ConfigError, RunDirectoryError, RunWriteError, TapeError,
            CorpusNotInstalledError) as error:
        where = f" (rank {launched_rank()})" if config.parallel != "none" else ""
        print(f"error{where}: {error}", file=sys.stderr)
        return 1 if isinstance(error, RunWriteError) else 2
    if launched_rank() != 0:
        return 0
    print(f"\nstopped because: {summary['stopped_because']} at step {summary['step']}")
    for key in ("final_train_loss_mean_last_50", "val_bpb", "tokens_per_s", "median_fwd_bwd_ms",
                "median_optimizer_ms", "log", "plot", "format_plot", "checkpoint"):
        if key not in summary:
            continue
        value = summary[key]
        print(f"  {key:30s} {value:.4f}" if isinstance(value, float) else f"  {key:30s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
