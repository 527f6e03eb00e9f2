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
# The loop is loop.py's, shared with chat_train.py, read top to bottom; this module gives it
# GPTRun, the pieces of this trainer's run. Around them: config.py and cli.py (settings, their
# checks, the command line), families.py (what --config builds), optimizers.py (what
# --optimizer builds, and what each kind offers), data.py (the tapes), distributed.py
# (ranks, DDP, FSDP2), telemetry.py (log records, statistics, plots), checkpoint.py (files),
# run_directory.py (--out: its lock, the refusals that keep its files, signals, failed writes).
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.core import codecs as formats
from packed_adamw.tokenizer.tape import TapeError, TapeReader

from . import cli, loop
from .checkpoint import (
    CHECKPOINT_NAME, MANIFEST_NAME, SHARDED_CHECKPOINT_NAME, CheckpointError, checkpoint_info,
    load_run_state, save_run_state,
)
from .cli import check_config, moment_stats_biases
from .config import AUTOCAST, PARAM_DTYPES, TrainConfig, model_config
from .data import TapeShard, open_tapes
from .distributed import Ranks, full, launched_rank, resolve_device, wrap_model
from .families import family_of
from .optimizers import optimizer_kind, set_learning_rate
from .run_directory import RunFiles, writing
from .run_identity import out_dir, trajectory
from .telemetry import (
    FormatCounts, LossWatch, RunLog, StepTimes, is_log_step, moment_stats, plot_format_log, plot_log,
)

# benchmarks/peers.py (and the tests) read these through this module, with the ones above
from .config import ConfigError  # noqa: F401
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


RUN_FILES = RunFiles(
    results=(CHECKPOINT_NAME, SHARDED_CHECKPOINT_NAME, "summary.json", "loss.png", "format.png"),  # plots: at the end
    logs=("log.jsonl", "moment_stats.jsonl"),
    before_first_step=(),  # the log is opened before the first step, and counts only once it holds a line
    states=lambda out: [out / name for name in (CHECKPOINT_NAME, SHARDED_CHECKPOINT_NAME)
                        if (out / name).exists() or (out / name).is_symlink()],
    state_step=lambda path: None, resume_flag=lambda path: "--resume auto")


class Step(NamedTuple):
    """What a step leaves for its log record."""
    grad_norm: float
    seconds: float  # forward, backward and the optimizer's step


# ---- the training run: loop.py's, with this trainer's pieces ------------------------------------

def train(config: TrainConfig) -> dict:
    """Run (or resume) training; returns the summary that is also written to summary.json.

    With --parallel ddp or fsdp every rank of the torchrun launch runs this; rank 0 alone
    prints, writes the log, the plot and the summary, and every rank returns the summary.
    """
    return loop.run(GPTRun(config))


class GPTRun(loop.Recipe):
    """The reference GPT's run for loop.run: a tape read front to back, one checkpoint file (or
    DCP directory) rewritten on its steps, the learning rate a function of the step."""

    files = RUN_FILES
    divergence_remedy = "lower --lr (and --muon-lr, with Muon) or lengthen --warmup-steps"

    def __init__(self, config: TrainConfig):
        self.config = config

    def check(self) -> None:
        check_config(self.config)

    @functools.cached_property
    def plan(self) -> loop.Plan:
        config = self.config
        return loop.Plan(
            out=out_dir(config), resume=config.resume or None, steps=config.max_steps, stop_at=config.stop_at_step,
            save_every=config.checkpoint_every, eval_every=config.eval_every, device=config.device,
            deterministic=config.deterministic, parallel=config.parallel, end_reasons=("max_steps", "stop_at_step"),
            state_noun="checkpoint", no_states=None if config.checkpoints else "--no-checkpoints writes none",
            states_record_reason=True, progress=config.progress, evaluation_in_step_record=True)

    def refuse_foreign_states(self) -> None:
        """One kind of checkpoint per --out (its logs and summary are one run's)."""
        config, out = self.config, self.plan.out
        other = out / (CHECKPOINT_NAME if config.parallel == "fsdp" else SHARDED_CHECKPOINT_NAME)
        if other.exists():
            kind = "a --parallel fsdp run" if config.parallel != "fsdp" else "a run without --parallel fsdp"
            raise CheckpointError(f"--out {out} holds {other}, the checkpoint of {kind}; this run writes "
                                  f"{config.checkpoint_name}: choose another --out")

    def state_to_resume(self, path: Path) -> Path:
        """A checkpoint, or a run directory's (not a DCP checkpoint directory)."""
        if path.is_dir() and not ((path / MANIFEST_NAME).is_file() or (path / ".metadata").is_file()):
            name = self.config.checkpoint_name
            if not (path / name).exists():
                raise CheckpointError(f"--resume {path} is a directory without {name} (looked for {path / name}); "
                                      "pass a checkpoint or a run's --out directory")
            path = path / name
        return path

    state_info = staticmethod(checkpoint_info)

    # ---- where the run starts ----
    def build(self, device: torch.device, ranks: Ranks) -> None:
        config, out = self.config, self.plan.out
        self.device, self.ranks = device, ranks
        out.mkdir(parents=True, exist_ok=True)
        self.checkpoint_path, self.log_path = out / config.checkpoint_name, out / "log.jsonl"
        self.train_tape, self.val_tape = open_tapes(config, ranks)
        self.kind, self.family = optimizer_kind(config.optimizer), family_of(config.config)
        vocab_size = self.train_tape.header.vocab_size  # the model's embedding follows the tapes' tokenizer
        self.core, self.initial = build_model(config, device, vocab_size)  # the same weights on every rank
        # DDP wraps the model; fully_shard turns its parameters into DTensors in place (model is core)
        self.model = wrap_model(self.core, ranks, device)
        self.optimizer = self.kind.build(self.core, config)
        self.trajectory = trajectory(config, vocab_size)
        self.context = self.core.config.context
        self.batch_shape = (config.batch_size, self.context)
        if ranks.distributed:
            self.train_tape = TapeShard(self.train_tape, ranks.rank, ranks.world_size, config.batch_size, self.context)
        self.tokens_per_step = ranks.world_size * config.batch_size * self.context
        self.run_state = dict(model=self.core, optimizer=self.optimizer, tape=self.train_tape, config=self.trajectory)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def tape_feeds_a_step(self) -> bool:
        return self.train_tape.remaining_batches(self.config.batch_size, self.context) > 0

    def unfed_start(self) -> Exception:
        ranks = self.ranks
        return TapeError(f"{self.train_tape.path} cannot feed the first step ({ranks.world_size} x "
                         f"{self.config.batch_size} rows of {self.context} tokens, and the token after them): "
                         "pass a smaller --batch-size, or a longer tape (`python -m packed_adamw.tokenizer.tape "
                         "build --passes N`)")

    def start_fresh(self) -> None:
        self.kind.start_masters(self.optimizer, self.core, self.initial)

    def load(self, path: Path) -> int:
        ranks = self.ranks
        return load_run_state(path, ranks.parallel, ranks.rank if ranks.distributed else None, **self.run_state)["step"]

    def start_session(self, step: int) -> None:
        config = self.config
        self.moment_biases = moment_stats_biases(config)
        format_kinds = sorted({self.family.parameter_kind(name) for name, _ in self.core.named_parameters()})
        self.format_counts = FormatCounts(
            self.optimizer if config.track_format else None, format_kinds, step + 1, self.ranks, self.device,
            self.family.parameter_kind, logs=lambda s: is_log_step(s, config),
            logged_only=config.format_steps == "logged")
        self.losses, self.times, self.val_bpb = LossWatch(config), StepTimes(), None

    def describe(self, step: int) -> str:
        config, ranks, kind = self.config, self.ranks, self.kind
        parallel = f"; {ranks.parallel} on {ranks.world_size} ranks" if ranks.distributed else ""
        masters = " with split FP32 masters" if kind.split_masters else ""
        dtype = "" if config.param_dtype == "fp32" else f"; {config.param_dtype} parameters{masters}"
        return (f"model {config.config}: {self.core.num_parameters():,} parameters{dtype}; {kind.describe(config)}; "
                f"device {self.device}{parallel}; "
                f"{self.train_tape.remaining_batches(config.batch_size, self.context)} batches left on "
                f"{self.train_tape.path}")

    # ---- a step ----
    def next_batch(self):
        return self.train_tape.next_batch(self.config.batch_size, self.context)  # every rank at the same step

    def train_step(self, step: int, batch) -> Step:
        config, device, optimizer = self.config, self.device, self.optimizer
        x, y = batch
        start = time.perf_counter()
        set_learning_rate(optimizer, learning_rate(step, config))
        with autocast_context(config, device):
            _, loss = self.model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces, FSDP2 reduce-scatters the gradients: the mean over ranks
        grad_norm = gradient_norm_(self.model.parameters(), config.grad_clip, config.param_dtype)
        self.sync()
        after_backward = time.perf_counter()
        self.format_counts.before_step(step)
        optimizer.step()
        self.sync()
        end = time.perf_counter()
        grad_norm = float(full(grad_norm))
        self.losses.observe(step + 1, loss.item(), grad_norm)  # this rank's loss (its windows)
        self.times.add(start, after_backward, end)
        return Step(grad_norm, end - start)

    def logs(self, step: int) -> bool:
        return is_log_step(step, self.config)

    def loss(self, result: Step) -> float:
        return self.losses.last

    def step_record(self, step: int, result: Step, loss: float) -> dict:
        return {"step": step, "loss": loss, "lr": float(self.optimizer.param_groups[0]["lr"]),
                "grad_norm": result.grad_norm, "tokens_per_s": self.tokens_per_step / result.seconds,
                "fwd_bwd_ms": 1e3 * self.times.fwd_bwd[-1], "optimizer_ms": 1e3 * self.times.optimizer[-1]}

    def evaluate(self, step: int) -> dict:
        self.val_bpb = evaluate(self.core, self.val_tape, self.config, self.device, self.ranks)
        return {"val_bpb": self.val_bpb}

    def after_step(self, step: int, log: RunLog) -> None:
        config = self.config
        self.format_counts.after_step(step, log)
        if config.log_moment_stats and step % config.moment_stats_every == 0:
            stats = moment_stats(self.core, self.optimizer, step, self.moment_biases,
                                 self.family.parameter_kind)  # FSDP2 gathers
            log.append_to(self.plan.out / "moment_stats.jsonl", stats)

    def progress(self) -> dict:
        return {"loss": f"{self.losses.last:.3f}", "val_bpb": f"{self.val_bpb:.3f}" if self.val_bpb else "-"}

    def save(self, step: int, reason: str) -> Path | None:
        # A failed write (a full disk) ends the run naming the file (RunWriteError, an OSError);
        # the write is atomic, so the previous checkpoint stands.
        if not self.config.checkpoints:
            return None
        with writing(self.checkpoint_path):
            save_run_state(self.checkpoint_path, self.ranks.parallel, **self.run_state,
                           trainer={"step": step, "reason": reason})
        return self.checkpoint_path

    # ---- the end ----
    def evaluates_at_end(self, reason: str) -> bool:
        return True  # a session that took a step ends with a validation, whatever ended it

    def end_session(self, step: int, log: RunLog) -> None:
        self.format_counts.finish(step, log)

    def summary(self, step: int, reason: str) -> dict:
        summary = self._summary(step, reason, self.losses, self.times, self.val_bpb)
        if self.device.type == "cuda":
            summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return summary

    def _summary(self, step: int, reason: str, losses: LossWatch, times: StepTimes, val_bpb: float | None) -> dict:
        config, out = self.config, self.plan.out
        summary = {
            "stopped_because": reason,
            "step": step,
            "steps_this_session": len(times.step),
            "parameters": self.core.num_parameters(),
            "final_train_loss_mean_last_50": losses.recent_mean(),
            "val_bpb": val_bpb,
            **times.summary(self.tokens_per_step),
            "optimizer_state_bytes": self.kind.state_bytes(self.optimizer),  # this rank's (an FSDP2 shard's)
            **losses.summary(),
            "log": str(self.log_path), "plot": str(out / "loss.png"),
            "checkpoint": str(self.checkpoint_path) if config.checkpoints else None,
            "config": dataclasses.asdict(config),
        }
        if config.track_format:
            summary["format_plot"] = str(out / "format.png")
        if self.ranks.distributed:
            summary["world_size"] = self.ranks.world_size
        return summary

    def summary_from_log(self, records: list[dict], step: int, reason: str) -> dict:
        """The logged steps' losses, gradient norms and times, the last val_bpb."""
        losses, times = LossWatch(self.config), StepTimes()
        for record in records:
            if {"loss", "grad_norm", "fwd_bwd_ms", "optimizer_ms"} <= record.keys():  # a logged step
                losses.observe(record["step"], record["loss"], record["grad_norm"])
                fwd_bwd, optimizer_s = record["fwd_bwd_ms"] / 1e3, record["optimizer_ms"] / 1e3
                times.add(0.0, fwd_bwd, fwd_bwd + optimizer_s)
        val = [record["val_bpb"] for record in records if "val_bpb" in record]
        return {**self._summary(step, reason, losses, times, val[-1] if val else None), "steps_this_session": 0}

    def figures(self) -> None:
        out = self.plan.out
        plot_log(self.log_path, out / "loss.png")
        if self.config.track_format:
            plot_format_log(self.log_path, out / "format.png")


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
    except loop.RUN_ERRORS as error:
        return loop.report(error, config.parallel)
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
