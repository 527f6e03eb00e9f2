"""Train the chat family (chat_model.py: the nanochat-style d12 and its small presets) on packed
documents, with Muon + AdamW on per-step schedule tables and the entire training state in each
checkpoint.

    python -m packed_adamw.torch.gpt.chat_train --preset d4 --data runs/data/small --vocab-size 12095 \\
        --steps 200 --batch 8 --context 256 --out runs/d4 --save-every 50 --device cpu
    python -m packed_adamw.torch.gpt.chat_train --preset d12 --data runs/data/large --steps 1680 \\
        --batch 32 --out runs/d12 --save-every 250 --device cuda            # bf16 weights, FP32 masters
    python -m packed_adamw.torch.gpt.chat_train ... --resume runs/d12/state_step000250.safetensors
    python -m packed_adamw.torch.gpt.chat_train ... --out runs/d12 --resume auto   # its newest state, or a fresh start
    python -m packed_adamw.torch.gpt.chat_train ... --optimizer reference   # torch Muon + AdamW, FP32
    torchrun --nproc_per_node=2 -m packed_adamw.torch.gpt.chat_train --parallel ddp ...   # or fsdp
    python -m packed_adamw.torch.gpt.chat_train ... --batch 8 --grad-accum 4   # 32 rows a step, 8 at a time
    python -m packed_adamw.torch.gpt.chat_train ... --device cuda --compile    # torch.compile (inductor)

--data holds train.tape and val.tape (docs/TAPE.md), whose vocab_size the model's vocabulary
must be. A micro-batch is one packed batch (packed_data.py) of --batch rows of --context tokens
per rank; a step is --grad-accum micro-batches. The run is loop.py's, shared with train.py and
read top to bottom there; `ChatRun` gives it this trainer's pieces: the model from --seed; the
optimizer over muon_adamw_groups (`--optimizer packed`: PackedMuonAdamW with bf16 weights and
exact FP32 masters by default; `reference`: torch.optim.Muon + torch.optim.AdamW over FP32
weights, the baseline); the schedule tables for every step (schedules.py); a step: the schedule's
row, forward and backward of each micro-batch, the optimizer step; its log record, evaluation and
state. The command line and its checks are chat_cli.py's.

docs/D12.md is the manual, the one home of what this module promises: the run directory's rules
(run_directory.py and loop.py, shared with train.py), the log and summary (MFU), --compile, the states and
resuming (--resume, --resume auto, --stop-at, SIGINT/SIGTERM, refusals), divergence and
unwritable files, gradient accumulation, DDP and FSDP2 (the unsharded twin, unsharded_twin.py)
and which resumes are bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from packed_adamw.core.atomic_file import atomic_path
from packed_adamw.tokenizer.tape import TapeExhausted, TapeReader, read_header
from packed_adamw.torch.combined import PackedMuonAdamW

from . import loop
from .chat_model import PRESETS, ChatGPT, chat_parameter_kind, compile_chat_model, compiled_graph_count
from .chat_cli import PARAM_DTYPES, ChatTrainError, check_args
from .chat_cli import parse_args as parse_command_line
from .distributed import Ranks, launched_rank, wrap_model
from .loop import RunDiverged  # noqa: F401 (the error a diverged run ends in, by this module's name too)
from .optimizers import TorchMuonAdamW, optimizer_state_bytes
from .packed_data import PackedBatch, PackedDocumentLoader
from .run_directory import RunFiles, on_main_rank, writing
from .schedules import ScheduleConfig, apply_schedule, build_schedule
from .telemetry import FormatCounts, RunLog, chat_flops_per_token, model_flops_utilization, peak_bf16_flops
from .training_state import TrainingStateError, load_state, save_state, state_file_name
from .unsharded_twin import UnshardedTwin, like_param

# ---- the pieces of a run -------------------------------------------------------------------------
def open_tape(path: Path, vocab_size: int) -> TapeReader:
    """A tape whose vocabulary is the model's (read from its header before it is opened)."""
    if not path.is_file():
        raise ChatTrainError(f"{path} is missing: --data must hold train.tape and val.tape (build them with "
                             "`python -m packed_adamw.tokenizer.tape build --out DIR ...`)")
    header, _ = read_header(path)
    if header.vocab_size != vocab_size:
        raise ChatTrainError(f"{path} has a {header.vocab_size}-token vocabulary, the model {vocab_size}: pass "
                             f"--vocab-size {header.vocab_size}, or tapes built with a {vocab_size}-token tokenizer")
    return TapeReader(path, vocab_size=header.vocab_size)


def run_config(args: argparse.Namespace, model_config, schedule: ScheduleConfig, train_tape: TapeReader,
               world_size: int) -> dict:
    """Everything that decides the run's trajectory: saved in every state and compared on resume.
    (Not in it: where the run writes, how often it logs, evaluates or saves, when it stops, the
    device, and how a step's rows are split between ranks and micro-batches: docs/D12.md, "FSDP2" and "Gradient accumulation".)"""
    return {
        "trainer": "chat_train/2", "preset": args.preset, "model": dataclasses.asdict(model_config),
        "micro_batch_rows": args.batch, "rows_per_step": world_size * args.grad_accum * args.batch,
        "context": args.context,
        "param_dtype": args.param_dtype, "muon_mode": args.muon_mode, "optimizer": args.optimizer,
        "seed": args.seed, "schedule": schedule.to_dict(),
        "lr": {"matrix": args.matrix_lr, "embedding": args.embedding_lr, "unembedding": args.unembedding_lr,
               "scalar": args.scalar_lr},
        "train_tape_header_sha256": train_tape.header.header_sha256,
    }


def build_model(model_config, param_dtype: str, seed: int, device: torch.device):
    """The seeded model, and its FP32 initial values by name when the weights are bf16 (the
    optimizer's masters start there exactly; the weights are their bf16 split)."""
    torch.manual_seed(seed)
    model = ChatGPT(model_config).to(device)
    if param_dtype == "fp32":
        return model, None
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():  # parameters only: the rotary tables stay FP32 buffers
            p.data = p.data.to(PARAM_DTYPES[param_dtype])
    return model, initial


def build_optimizer(model: ChatGPT, args: argparse.Namespace, device: torch.device):
    groups = model.muon_adamw_groups(matrix_lr=args.matrix_lr, embedding_lr=args.embedding_lr,
                                     unembedding_lr=args.unembedding_lr, scalar_lr=args.scalar_lr,
                                     weight_decay=args.weight_decay)
    if args.optimizer == "reference":  # the baseline: torch.optim.Muon + torch.optim.AdamW (fused on CUDA)
        return TorchMuonAdamW(groups, muon={}, adamw={"fused": device.type == "cuda"})
    return PackedMuonAdamW(groups, mode=args.muon_mode, track_format=args.track_format)


def unsharded_twin(model_config, args: argparse.Namespace) -> UnshardedTwin:
    """Rank 0's CPU copy of the run's model and optimizer under FSDP2 (unsharded_twin.py)."""
    def model():
        built = ChatGPT(model_config)
        for p in built.parameters():
            p.data = p.data.to(PARAM_DTYPES[args.param_dtype])
        return built
    return UnshardedTwin(model, lambda m: build_optimizer(m, args, torch.device("cpu")))


def start_masters(optimizer: PackedMuonAdamW, model: ChatGPT, initial: dict[str, torch.Tensor] | None) -> None:
    """A fresh bf16 run: every parameter's FP32 master is its exact initial value (under FSDP2
    laid out like its sharded parameter)."""
    if initial is None:
        return
    names = {id(p): name for name, p in model.named_parameters()}
    for rule in optimizer.rules.values():
        rule.load_master_weights([like_param(initial[names[id(p)]], p) for g in rule.param_groups
                                  for p in g["params"]])


def saved_world_size(path: Path, default: int) -> int:
    """The number of ranks whose loader cursor a state holds, or `default` when the file cannot
    tell (load_state then says what is wrong with it)."""
    try:
        with safe_open(path, framework="pt") as f:
            return int(json.loads(f.metadata()["loader"])["world_size"])
    except (OSError, SafetensorError, KeyError, TypeError, ValueError):
        return default


@contextlib.contextmanager
def gradient_sync(model, parallel: str, sync: bool):
    """The ranks reduce the gradients in this backward only when `sync` (the step's last
    micro-batch); before that each rank accumulates its own."""
    if parallel == "ddp" and not sync:
        with model.no_sync():
            yield
        return
    if parallel == "fsdp":
        model.set_requires_gradient_sync(sync)
    yield


def forward_context(param_dtype: str, device: torch.device):
    """bf16 autocast for FP32 weights on CUDA; bf16 weights (and the CPU) run as they are."""
    if param_dtype == "fp32" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    return PackedBatch(*(t.to(device, non_blocking=True) for t in batch))


@torch.no_grad()
def evaluate(model: ChatGPT, val_tape: TapeReader, batch: int, context: int, batches: int, param_dtype: str,
             device: torch.device) -> dict:
    """Val loss (nats per target token) and bits per byte over the first `batches` packed batches
    of val.tape: summed token losses / (ln 2 * the UTF-8 bytes of the target tokens), the bpb of
    train.validation_bpb, here on packed documents (no token attends across a document, as in
    training). Bytes: the tape's token byte counts (special tokens count 0)."""
    loader = PackedDocumentLoader(val_tape, batch, context)
    nats, tokens, byte_count = 0.0, 0, 0
    was_training = model.training
    model.eval()
    try:
        for _ in range(batches):
            try:
                packed = loader.next_batch()
            except TapeExhausted:
                break
            on_device = to_device(packed, device)
            with forward_context(param_dtype, device):
                _, loss = model(on_device.inputs, on_device.targets, reduction="sum", cu_seqlens=on_device.cu_seqlens)
            nats += loss.item()
            tokens += packed.targets.numel()
            byte_count += int(val_tape.token_byte_counts[packed.targets.numpy()].sum())
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ChatTrainError(f"{val_tape.path} holds no packed batch of {batch} x {context} tokens: pass a smaller "
                             "--batch or --context, or build a larger val.tape")
    return {"val_loss": nats / tokens, "val_bpb": nats / (math.log(2) * byte_count) if byte_count else None,
            "val_tokens": tokens}


def kind_learning_rates(optimizer) -> dict[str, float]:
    """Each group kind's lr this step (the first group of each kind; the others scale alike)."""
    rates = {}
    for g in optimizer.param_groups:
        rates.setdefault(g["kind"], g["lr"])
    return rates


# ---- the run directory (run_directory.py's policies, with this trainer's files) -------------------
STATE_NAME = re.compile(r"state_step(\d+)\.safetensors")


def states_in(out: Path) -> list[Path]:
    """The training states in `out`, oldest first."""
    steps = {path: STATE_NAME.fullmatch(path.name) for path in out.glob("state_step*.safetensors")}
    return sorted((path for path, match in steps.items() if match), key=lambda path: int(steps[path].group(1)))


def state_step(path: Path) -> int | None:
    match = STATE_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


# schedule.safetensors is written before the first step: alone it is no run's work
RUN_FILES = RunFiles(results=("summary.json",), logs=("log.jsonl",), before_first_step=("schedule.safetensors",),
                     states=states_in, state_step=state_step, resume_flag=lambda state: f"--resume {state}",
                     marks={"schedule.safetensors": "schedule"})


def next_step_batches(loader: PackedDocumentLoader, batches: int) -> list[PackedBatch] | None:
    """A step's `batches` micro-batches, consumed, where the tape also holds the batch after them
    (which the state written after the step holds; peeked, so the next step reads it once); None,
    the loader left where it was, where it does not."""
    position = loader.state_dict()
    try:
        step = [loader.next_batch() for _ in range(batches)]
        loader.peek()
        return step
    except TapeExhausted:
        loader.load_state_dict(position)
        return None


def tape_feeds(loader: PackedDocumentLoader, batches: int) -> bool:
    """Whether the tape feeds a step from the loader's position (next_step_batches), which stays."""
    position = loader.state_dict()
    fed = next_step_batches(loader, batches) is not None
    loader.load_state_dict(position)
    return fed


# The schedule's tables hold a row per step (in every state too): a million steps is 24 MB of them.
MAX_SCHEDULE_STEPS = 1_000_000


def check_steps_fit(args: argparse.Namespace, train_tape: TapeReader, rows_per_step: int) -> None:
    """Refuse a run the tape cannot feed, before the schedule is built: the steps this run takes
    (--stop-at's, when it stops early; the schedule may be longer, as the reference documents'
    1,680-step schedule stopped at 250) each take rows_per_step rows of --context new tokens (the
    split rule takes exactly these, the crop rule at least these), and a state after the last
    step holds the next batch. A schedule past MAX_SCHEDULE_STEPS is refused too."""
    if args.steps > MAX_SCHEDULE_STEPS:
        raise ChatTrainError(f"--steps {args.steps}: the schedule's tables hold a row per step, in every state; "
                             f"pass at most {MAX_SCHEDULE_STEPS:,}")
    flag, steps = ("--stop-at", args.stop_at) if args.stop_at and args.stop_at < args.steps else ("--steps", args.steps)
    step_tokens = rows_per_step * args.context
    most = train_tape.num_tokens // step_tokens - 1
    if steps <= most:
        return
    holds = (f"{flag} {steps}: {train_tape.path} holds {train_tape.num_tokens:,} tokens, which feed "
             f"{f'at most {most} steps' if most > 0 else 'no step'} of {rows_per_step} rows x {args.context} tokens "
             "and the next batch that the last state holds")
    if most > 0:
        raise ChatTrainError(f"{holds}: pass {flag} {most} or fewer (--stop-at keeps a longer schedule), or a tape "
                             "with more tokens (tape build --passes)")
    raise ChatTrainError(f"{holds}: pass a smaller --batch or --context, or a tape with more tokens")


def state_info(path: Path) -> dict:
    """A state's step and config, from its metadata alone (no tensor is read)."""
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        return {"step": int(json.loads(metadata["step"])), "config": json.loads(metadata["config"])}
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as error:
        raise TrainingStateError(f"{path} is not a readable training state ({error})") from None


# ---- the run: loop.py's, with this trainer's pieces ------------------------------------------------
def train(args: argparse.Namespace) -> dict:
    """Run (or resume) the run of the command line `args` (parse_args'); returns its summary."""
    return loop.run(ChatRun(args))


class ChatRun(loop.Recipe):
    """The chat family's run for loop.run: packed documents, per-step schedule tables, Muon +
    AdamW, gradient accumulation, and the entire training state in each state file."""

    files = RUN_FILES
    divergence_remedy = ("lower the learning rates (--matrix-lr, --embedding-lr, --unembedding-lr, --scalar-lr) "
                         "or lengthen --warmup-steps")

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def check(self) -> None:
        check_args(self.args)

    @functools.cached_property
    def plan(self) -> loop.Plan:
        args = self.args
        return loop.Plan(
            out=args.out, resume=args.resume, steps=args.steps, stop_at=args.stop_at, save_every=args.save_every,
            eval_every=args.eval_every, device=args.device, deterministic=args.deterministic, parallel=args.parallel,
            end_reasons=("steps", "stop_at"), state_noun="state",
            no_states=None if args.optimizer == "packed" else "the reference optimizer writes no states")

    state_info = staticmethod(state_info)

    # ---- where the run starts ----
    def build(self, device: torch.device, ranks: Ranks) -> None:
        args = self.args
        self.device, self.ranks = device, ranks
        preset = PRESETS[args.preset]
        self.model_config = dataclasses.replace(preset, vocab_size=args.vocab_size or preset.vocab_size)
        args.context = args.context or self.model_config.context
        train_tape = open_tape(args.data / "train.tape", self.model_config.vocab_size)
        self.val_tape = open_tape(args.data / "val.tape", self.model_config.vocab_size)
        check_steps_fit(args, train_tape, ranks.world_size * args.grad_accum * args.batch)  # before the tables exist

        # The model (the same seeded weights on every rank), its wrapper, the optimizer, the tables.
        self.core, self.initial = build_model(self.model_config, args.param_dtype, args.seed, device)
        self.flops_per_token = chat_flops_per_token(self.core, args.context)
        self.peak_flops = peak_bf16_flops(device)  # per device; the ranks are alike
        self.model = wrap_model(self.core, ranks, device)
        self.model.train()
        self.forward = compile_chat_model(self.model, args.compile) if args.compile else self.model
        self.optimizer = build_optimizer(self.core, args, device)
        self.schedule = build_schedule(ScheduleConfig(
            num_steps=args.steps, warmup_steps=args.warmup_steps, warmdown_ratio=args.warmdown_ratio,
            momentum_warmup_steps=args.momentum_warmup_steps, weight_decay=args.weight_decay))
        self.train_tape = train_tape
        self.loader = PackedDocumentLoader(train_tape, args.batch, args.context, ranks.rank, ranks.world_size,
                                           packing=args.packing)
        self.config = run_config(args, self.model_config, self.schedule.config, train_tape, ranks.world_size)
        self.trajectory = json.loads(json.dumps(self.config))  # the config as a state saves it
        self.batch_shape = (args.batch, args.context)
        self.tokens_per_step = self.config["rows_per_step"] * args.context
        self.graphs_at_start, self.graphs_after_first_batch = compiled_graph_count(), None
        # Under FSDP2 the state files are read and written through an unsharded twin (rank 0 keeps
        # one for the saves; a resume builds one on every rank and drops it on the others).
        self.twin = None
        self.step_seconds, self.losses, self.eval_record = [], [], None  # this session's logged steps

    def tape_feeds_a_step(self) -> bool:
        return tape_feeds(self.loader, self.args.grad_accum)  # the crop rule's rows can take more than check_steps_fit's

    def unfed_start(self) -> Exception:
        args = self.args
        return ChatTrainError(f"{args.data / 'train.tape'} cannot feed the first step under --packing {args.packing} "
                              f"({self.config['rows_per_step']} rows x {args.context} tokens and the next batch): "
                              "pass a smaller --batch or --context, or a longer tape")

    def start_fresh(self) -> None:
        if self.args.optimizer == "packed":
            start_masters(self.optimizer, self.core, self.initial)

    def load(self, path: Path) -> int:
        args, ranks = self.args, self.ranks
        # The file holds rank 0's next micro-batch and the cursor between steps, which every rank
        # shares whatever the number of ranks (docs/D12.md, "FSDP2"): every rank loads through a
        # rank-0 view of its tape in the layout that wrote the state (load_state checks the saved
        # batch against it), then takes the cursor into its own loader.
        view = PackedDocumentLoader(self.train_tape, args.batch, args.context, 0,
                                    saved_world_size(path, ranks.world_size), packing=args.packing)
        if ranks.parallel == "fsdp":
            self.twin = unsharded_twin(self.model_config, args)
        target = (self.twin.model, self.twin.optimizer) if self.twin is not None else (self.core, self.optimizer)
        loaded = load_state(path, model=target[0], optimizer=target[1], loader=view, config=self.config,
                            schedule=self.schedule, allow_code_change=args.allow_code_change)
        if self.twin is not None:
            self.twin.scatter(self.core, self.optimizer)
            if not ranks.main:
                self.twin = None
        self.loader.load_state_dict({**view.state_dict(), "world_size": ranks.world_size})
        if loaded.t_step != loaded.step:
            raise TrainingStateError(f"{path}: t_step {loaded.t_step} differs from step {loaded.step}; "
                                     "chat_train runs one schedule row per step")
        return loaded.step

    def start_session(self, step: int) -> None:
        kinds = sorted({chat_parameter_kind(name) for name, _ in self.core.named_parameters()})
        self.format_counts = FormatCounts(self.optimizer if self.args.track_format else None, kinds, step + 1,
                                          self.ranks, self.device, chat_parameter_kind, logs=self.logs)

        def write_schedule() -> None:
            """This run's tables, written by every session (a resume into a new --out, or over a stale
            file of a start that failed before its first step, leaves none of another run's)."""
            path = self.plan.out / "schedule.safetensors"
            with writing(path), atomic_path(path) as written:
                save_file(self.schedule.to_tensors(prefix=""), str(written),
                          metadata={"schedule": json.dumps(self.schedule.config.to_dict())})
        on_main_rank(self.ranks, self.device, write_schedule)

    def describe(self, step: int) -> str:
        args, ranks = self.args, self.ranks
        return (f"{args.preset}: {self.core.num_parameters():,} parameters, {args.param_dtype} weights, optimizer "
                f"{args.optimizer}{' (Muon ' + args.muon_mode + ')' if args.optimizer == 'packed' else ''}, "
                f"{self.tokens_per_step:,} tokens a step"
                + (f" in {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
                + f", steps {step} to {self.plan.last} of {args.steps}"
                + (f", {ranks.parallel} on {ranks.world_size} ranks" if ranks.distributed else ""))

    # ---- a step ----
    def next_batch(self) -> list[PackedBatch]:
        args = self.args
        self.started = time.perf_counter()
        # The packing of the crop rule can waste tokens: a run stops where the tape cannot feed
        # the step and the next batch, which the state written here then holds.
        micro_batches = next_step_batches(self.loader, args.grad_accum)  # every rank alike (one cursor)
        if micro_batches is None:
            raise TapeExhausted(f"{args.data / 'train.tape'} cannot feed another step and the next batch under "
                                f"--packing {args.packing}; writing the state and stopping")
        return micro_batches

    def train_step(self, step: int, micro_batches: list[PackedBatch]) -> tuple[dict, torch.Tensor]:
        args, device, optimizer = self.args, self.device, self.optimizer
        row = apply_schedule(optimizer, self.schedule, step)  # t_step: this run's step
        step_loss = None  # the mean of the micro-batches' mean losses
        for micro, packed in enumerate(micro_batches):
            batch = to_device(packed, device)
            with gradient_sync(self.model, self.ranks.parallel, sync=micro == args.grad_accum - 1):
                with forward_context(args.param_dtype, device):
                    _, loss = self.forward(batch.inputs, batch.targets, cu_seqlens=batch.cu_seqlens)
                (loss / args.grad_accum).backward()
            if self.graphs_after_first_batch is None:
                self.graphs_after_first_batch = compiled_graph_count() - self.graphs_at_start
            part = loss.detach().float() / args.grad_accum
            step_loss = part if step_loss is None else step_loss + part
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return row, step_loss

    def logs(self, step: int) -> bool:
        return step % self.args.log_every == 0 or step == self.plan.last

    def after_step(self, step: int, log: RunLog) -> None:
        self.format_counts.after_step(step, log)

    def loss(self, result: tuple[dict, torch.Tensor]) -> float:
        mean_loss = result[1]
        if self.ranks.distributed:
            torch.distributed.all_reduce(mean_loss)
            mean_loss /= self.ranks.world_size
        return mean_loss.item()  # waits for the step

    def step_record(self, step: int, result: tuple[dict, torch.Tensor], loss: float) -> dict:
        seconds = time.perf_counter() - self.started
        self.step_seconds.append(seconds)
        self.losses.append(loss)
        tokens_per_step = self.tokens_per_step
        return {"step": step, "loss": loss, **result[0], "lr": kind_learning_rates(self.optimizer),
                "tokens": step * tokens_per_step, "step_ms": 1e3 * seconds, "tokens_per_s": tokens_per_step / seconds,
                "mfu": model_flops_utilization(tokens_per_step / seconds, self.flops_per_token, self.peak_flops,
                                               self.ranks.world_size)}

    def evaluate(self, step: int) -> dict | None:
        args, ranks = self.args, self.ranks
        values = None
        if ranks.main or ranks.parallel == "fsdp":  # FSDP2's forward gathers the shards: every rank runs it
            values = evaluate(self.core, self.val_tape, args.batch, args.context, args.eval_batches,
                              args.param_dtype, self.device)
            self.eval_record = {"step": step, **values}
            if ranks.parallel == "fsdp":
                # FSDP2's root keeps its parameters gathered after a forward without a backward:
                # put the shards back before the optimizer or a save reads the parameters.
                self.core.reshard()
            if ranks.main:
                print(f"step {step}: val loss {values['val_loss']:.4f}, bpb {values['val_bpb']}")
        ranks.barrier()
        return values

    def save(self, step: int, reason: str) -> Path | None:
        args, ranks = self.args, self.ranks
        saved_model, saved_optimizer = self.core, self.optimizer
        if args.optimizer == "packed" and ranks.parallel == "fsdp":
            if self.twin is None and ranks.main:
                self.twin = unsharded_twin(self.model_config, args)
            UnshardedTwin.gather(self.twin, self.core, self.optimizer)
            if ranks.main:
                saved_model, saved_optimizer = self.twin.model, self.twin.optimizer
        path = self.plan.out / state_file_name(step)

        def write_state() -> None:
            if args.optimizer != "packed":
                return
            try:
                with writing(path):
                    save_state(path, model=saved_model, optimizer=saved_optimizer, loader=self.loader,
                               schedule=self.schedule, config=self.config, step=step, t_step=step)
                print(f"wrote {path}")
            except TapeExhausted:
                # a state holds the next batch; at the end of the tape there is none (tape_feeds
                # stops the run a step early so that this does not happen)
                print(f"no state at step {step}: {args.data / 'train.tape'} has no next batch for it to hold")
        on_main_rank(ranks, self.device, write_state)  # every rank learns whether rank 0 wrote it
        return path if args.optimizer == "packed" else None

    # ---- the end ----
    def end_session(self, step: int, log: RunLog) -> None:
        self.format_counts.finish(step, log)

    def evaluates_at_end(self, reason: str) -> bool:
        return bool(self.args.eval_every) and reason in self.plan.end_reasons  # its last step, not a stop

    def summary(self, step: int, reason: str) -> dict:
        return summarize(self, step, reason, self.step_seconds, self.losses, self.eval_record)

    def summary_from_log(self, records: list[dict], step: int, reason: str) -> dict:
        """The figures the sessions logged; nothing of this session, which trains nothing."""
        steps = [r for r in records if "loss" in r]
        evals = [r for r in records if "val_loss" in r]
        summary = summarize(self, step, reason, [r["step_ms"] / 1e3 for r in steps], [r["loss"] for r in steps],
                            evals[-1] if evals else None)
        for key in ("compile", "compiled_graphs_after_first_batch", "compiled_graphs", "peak_memory_bytes",
                    "peak_memory_bytes_per_parameter"):
            summary.pop(key, None)  # a session's own, not in the log
        return summary


def summarize(run: ChatRun, step: int, stopped_because: str, step_seconds: list[float], losses: list[float],
              eval_record: dict | None) -> dict:
    """summary.json: the first logged steps (compilation, allocator warm-up) are left out of the rate."""
    args, ranks, device, core = run.args, run.ranks, run.device, run.core
    steady = step_seconds[2:] or step_seconds
    tokens_per_step = run.tokens_per_step
    tokens_per_s = tokens_per_step / statistics.median(steady) if steady else None
    parameters = core.num_parameters()
    state_bytes = optimizer_state_bytes(run.optimizer)
    summary = {
        "step": step, "steps": args.steps, "stopped_because": stopped_because,
        "preset": args.preset, "parameters": parameters,
        "param_dtype": args.param_dtype, "optimizer": args.optimizer, "muon_mode": args.muon_mode,
        "parallel": ranks.parallel, "world_size": ranks.world_size, "grad_accum": args.grad_accum,
        "device": str(device), "tokens_per_step": tokens_per_step,
        "final_loss": losses[-1] if losses else None,
        "median_step_ms": 1e3 * statistics.median(steady) if steady else None,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": run.flops_per_token, "peak_flops_per_device": run.peak_flops,
        "mfu": model_flops_utilization(tokens_per_s, run.flops_per_token, run.peak_flops, ranks.world_size),
        "compile": args.compile,
        # this session's graphs (dynamo's count): equal when no batch after the first compiled anything
        "compiled_graphs_after_first_batch": run.graphs_after_first_batch if args.compile else None,
        "compiled_graphs": compiled_graph_count() - run.graphs_at_start if args.compile else None,
        # under FSDP2: rank 0's shard of the state, per parameter of the whole model
        "optimizer_state_bytes": state_bytes, "optimizer_state_bytes_per_parameter": state_bytes / parameters,
        "weight_bytes_per_parameter": sum(p.numel() * p.element_size() for p in core.parameters()) / parameters,
        **({"val_loss": eval_record["val_loss"], "val_bpb": eval_record["val_bpb"]} if eval_record else {}),
    }
    if device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        summary["peak_memory_bytes_per_parameter"] = summary["peak_memory_bytes"] / parameters
    return summary


# ---- the command line (chat_cli.py) ---------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    """The command line's settings, checked (chat_cli.parse_args, with this module's usage as --help)."""
    return parse_command_line(argv, description=__doc__)


def main(argv=None) -> int:
    args = parse_args(argv)  # a bad flag exits 2 here (argparse)
    try:
        summary = train(args)
    except (ChatTrainError, *loop.RUN_ERRORS) as error:
        return loop.report(error, args.parallel)
    if launched_rank() == 0:
        print(json.dumps({k: summary[k] for k in ("step", "final_loss", "tokens_per_s", "val_bpb") if k in summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
