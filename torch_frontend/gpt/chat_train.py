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
per rank; a step is --grad-accum micro-batches. The run, top to bottom in `_train`: the model
from --seed; the optimizer over muon_adamw_groups (`--optimizer packed`: PackedMuonAdamW with
bf16 weights and exact FP32 masters by default; `reference`: torch.optim.Muon + torch.optim.AdamW
over FP32 weights, the baseline); the schedule tables for every step (schedules.py); then per
step: the schedule's row, forward and backward of each micro-batch, the optimizer step; logs,
evaluations and states on their steps.

docs/D12.md is the manual, the one home of what this module promises: the run directory's rules
(run_directory.py, shared with train.py), the log and summary (MFU), --compile, the states and
resuming (--resume, --resume auto, --stop-at, SIGINT/SIGTERM, refusals), divergence and
unwritable files, gradient accumulation, DDP and FSDP2 (the unsharded twin, unsharded_twin.py)
and which resumes are bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from packed_adamw.core import validate_hyperparams as validate_adamw
from packed_adamw.core.atomic_file import atomic_path
from packed_adamw.core.muon import validate_hyperparams as validate_muon
from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader, read_header
from packed_adamw.torch.combined import PackedMuonAdamW

from .chat_model import PRESETS, ChatGPT, compile_chat_model, compiled_graph_count
from .checkpoint import CheckpointError
from .cli import check_device, check_option, check_parallel, check_seed
from .config import ConfigError
from .distributed import Ranks, ddp_rebuild_buckets, launched_rank, resolve_device, start_ranks, wrap_model
from .optimizers import TorchMuonAdamW, optimizer_state_bytes
from .packed_data import DEFAULT_PACKING, PACKING_RULES, PackedBatch, PackedDocumentLoader
from .run_directory import (
    ENDED, GuardedRunLog, RunDirectoryError, RunFiles, RunWriteError, StopRequest, check_out, claim, finished_run_summary,
    on_main_rank, refuse_earlier_run, refuse_to_replace, write_summary, writing,
)
from .schedules import ScheduleConfig, apply_schedule, build_schedule
from .telemetry import chat_flops_per_token, keep_records_up_to, model_flops_utilization, peak_bf16_flops
from .training_state import TrainingStateError, load_state, save_state, state_file_name
from .unsharded_twin import UnshardedTwin, is_dtensor, like_param

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MUON_MODES = ("packed", "bf16", "fp32")
OPTIMIZERS = ("packed", "reference")
PARALLEL = ("none", "ddp", "fsdp")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


class ChatTrainError(ValueError):
    """A run that cannot start as asked (the message says which option to change)."""


class RunDiverged(FloatingPointError):
    """The run diverged (a non-finite loss or weight): it ends with exit status 1, its summary
    saying so (`stopped_because: "diverged"`), no state written after the divergence."""


class Diverged(Exception):
    """Inside the loop: what diverged, caught to end the run (RunDiverged says it to the user)."""


# ---- the command line --------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m packed_adamw.torch.gpt.chat_train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s --preset P --data DIR --steps N --batch B --out DIR [options]  "
                                      "(--help lists them)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="the model (chat_model.PRESETS)")
    p.add_argument("--data", required=True, type=Path, help="a directory holding train.tape and val.tape")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the model's vocabulary instead of the preset's (it must equal the tapes' vocab_size)")
    p.add_argument("--steps", required=True, type=int, help="steps of the run (the schedule's length)")
    p.add_argument("--batch", required=True, type=int, help="rows per micro-batch and rank")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step (gradients accumulated; the ranks reduce in the last one's backward)")
    p.add_argument("--context", type=int, default=None, help="tokens per row (default: the preset's context)")
    p.add_argument("--packing", choices=PACKING_RULES, default=DEFAULT_PACKING,
                   help="how documents fill the rows (packed_data.py); val.tape is always packed by the default")
    p.add_argument("--out", required=True, type=Path,
                   help="the run directory (log, summary, states): one run's, locked while it runs")
    p.add_argument("--save-every", type=int, default=0, help="write a state every K steps (0: only at the end)")
    p.add_argument("--resume", type=resume_argument, default=None, metavar="FILE|auto",
                   help="a state_stepNNNNNN.safetensors to continue from, or auto: --out's newest state, or a fresh "
                        "start where --out holds no run's files")
    p.add_argument("--allow-code-change", action="store_true",
                   help="resume a state written by other trajectory code (warns, listing the files that differ)")
    p.add_argument("--stop-at", type=int, default=0, help="end after this step (0: after --steps), state written")
    p.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default=None,
                   help="live weights (default: bf16 for --optimizer packed, fp32 for reference)")
    p.add_argument("--muon-mode", choices=MUON_MODES, default="packed", help="PackedMuon's momentum storage")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="packed")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every K steps and at the end (0: never)")
    p.add_argument("--eval-batches", type=int, default=8, help="packed batches of val.tape per evaluation")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (under torchrun: cpu, cuda or auto, "
                   "each rank taking cuda:LOCAL_RANK)")
    p.add_argument("--parallel", choices=PARALLEL, default="none", help="ddp or fsdp (FSDP2) under torchrun")
    p.add_argument("--deterministic", action="store_true",
                   help="CUDA: deterministic kernels (embedding backward, cuBLAS), for bit-exact resume on a GPU")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, choices=COMPILE_BACKENDS,
                   metavar="BACKEND", help="torch.compile the model, once for every document count (BACKEND: "
                   "inductor, the default, or aot_eager / eager, which run the captured graphs eagerly)")
    # nanochat's base_train settings (muon_adamw_groups; the weight decay is used as given, unscaled)
    p.add_argument("--matrix-lr", type=float, default=0.02)
    p.add_argument("--embedding-lr", type=float, default=0.3)
    p.add_argument("--unembedding-lr", type=float, default=0.008)
    p.add_argument("--scalar-lr", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.28, help="Muon's weight decay before its schedule")
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--warmdown-ratio", type=float, default=0.65)
    p.add_argument("--momentum-warmup-steps", type=int, default=400)
    args = p.parse_args(argv)
    if args.param_dtype is None:
        args.param_dtype = "bf16" if args.optimizer == "packed" else "fp32"
    try:
        check_args(args)
    except (ChatTrainError, ConfigError, RunDirectoryError) as error:
        p.error(str(error))  # one line on stderr, exit status 2
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags that cannot work, naming the flag (ChatTrainError, or ConfigError from the
    checks this shares with train.py's command line: cli.py)."""
    for name in ("steps", "batch", "grad_accum"):
        if getattr(args, name) < 1:
            raise ChatTrainError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    for name in ("save_every", "stop_at", "eval_every", "eval_batches"):
        if getattr(args, name) < 0:
            raise ChatTrainError(f"--{name.replace('_', '-')} {getattr(args, name)}: give 0 or a positive number")
    if args.log_every < 1:
        raise ChatTrainError(f"--log-every {args.log_every}: give a positive number")
    if args.eval_every and args.eval_batches == 0:
        raise ChatTrainError(f"--eval-batches 0 with --eval-every {args.eval_every}: an evaluation reads at least one "
                             "packed batch of val.tape; pass --eval-batches 1 or more, or leave out --eval-every")
    preset = PRESETS[args.preset]
    context = args.context if args.context is not None else preset.context
    if not 1 <= context <= preset.context:
        raise ChatTrainError(f"--context {context}: the {args.preset} model takes 1 to {preset.context} tokens")
    if args.optimizer == "reference":
        if args.param_dtype != "fp32":
            raise ChatTrainError("--optimizer reference runs FP32 weights (torch's Muon and AdamW keep no masters): "
                                 "leave out --param-dtype or pass --param-dtype fp32")
        if args.save_every or args.resume or args.stop_at:
            raise ChatTrainError("--optimizer reference writes and reads no training states (training_state.py "
                                 "stores the packed optimizers): leave out --save-every, --resume and --stop-at")
    if args.compile and args.parallel != "none":
        raise ChatTrainError(f"--compile with --parallel {args.parallel}: compiling a DDP or FSDP2 model is not "
                             "tested yet; leave out --compile, or run one process")
    if args.parallel == "fsdp" and args.optimizer == "reference":
        raise ChatTrainError("--optimizer reference with --parallel fsdp: torch.optim.Muon orthogonalises whole "
                             "matrices and cannot step FSDP2's shards; use --parallel ddp for the baseline")
    check_parallel(args.parallel, args.device, module="packed_adamw.torch.gpt.chat_train")
    check_device(args.device)
    check_seed(args.seed)
    check_rates(args)
    # each schedule setting alone, the others at values the schedule's own checks accept
    for option, name in (("--warmup-steps", "warmup_steps"), ("--warmdown-ratio", "warmdown_ratio"),
                         ("--momentum-warmup-steps", "momentum_warmup_steps")):
        value = getattr(args, name)
        check_option(option, value, lambda: ScheduleConfig(num_steps=args.steps, **{name: value}))
    check_out(args.out)


def resume_argument(text: str) -> Path | str:
    """--resume: a state file, or `auto` (resume_source: --out's newest state, else a fresh start)."""
    return "auto" if text == "auto" else Path(text)


def check_rates(args: argparse.Namespace) -> None:
    """Each learning rate and the weight decay by its rule's own validation (packed_adamw.core:
    Muon's for --matrix-lr and --weight-decay, AdamW's for the others), the other values held
    at ones the rule accepts, so the error names the flag at fault. (The reference optimizer's
    torch Muon and AdamW get the same values.)"""
    momentum, eps = 0.95, 1e-7  # values Muon's rule accepts
    check_option("--matrix-lr", args.matrix_lr, lambda: validate_muon(args.matrix_lr, momentum, 0.0, eps))
    check_option("--weight-decay", args.weight_decay, lambda: validate_muon(0.0, momentum, args.weight_decay, eps))
    check_option(f"--matrix-lr {args.matrix_lr} with --weight-decay", args.weight_decay,
                 lambda: validate_muon(args.matrix_lr, momentum, args.weight_decay, eps))
    for option in ("--embedding-lr", "--unembedding-lr", "--scalar-lr"):
        lr = getattr(args, option[2:].replace("-", "_"))
        check_option(option, lr, lambda: validate_adamw(lr, (0.9, 0.95), 1e-10, 0.0))


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
    return PackedMuonAdamW(groups, mode=args.muon_mode)


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
                     states=states_in, state_step=state_step, resume_flag=lambda state: f"--resume {state}")


def resume_source(out: Path, resume: Path | str | None) -> Path | None:
    """The state this run continues from: --resume's file, or with `auto` --out's newest state
    (None: a fresh start, refused by refuse_earlier_run where --out holds another run's files)."""
    if resume == "auto":
        states = states_in(out)
        ended = RUN_FILES.ended(out)
        if ended and states and ended.startswith(ENDED["diverged"]):  # its newest state would diverge again
            raise RunDirectoryError(f"--resume auto: --out {out} holds a run that has ended ({ended}); start "
                                    "again into another --out (with other settings)")
        return states[-1] if states else None
    return resume


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


def nonfinite_weights(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> list[str] | None:
    """The parameters holding NaN or Inf (this rank's shards under FSDP2), or None when every
    rank's are finite (collective: every rank learns whether any rank found one)."""
    bad = [name for name, p in model.named_parameters()
           if not torch.isfinite(p.detach().to_local() if is_dtensor(p) else p.detach()).all()]
    return bad if ranks.agree(int(bool(bad)), device) else None


def state_info(path: Path) -> dict:
    """A state's step and config, from its metadata alone (no tensor is read)."""
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        return {"step": int(json.loads(metadata["step"])), "config": json.loads(metadata["config"])}
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as error:
        raise TrainingStateError(f"{path} is not a readable training state ({error})") from None


# ---- the run ---------------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device, deterministic=args.deterministic, parallel=args.parallel)
    ranks = start_ranks(args.parallel, device)

    def refuse_fresh_start_over_another_run() -> None:
        if resume_source(args.out, args.resume) is None:
            refuse_earlier_run(args.out, RUN_FILES)

    try:
        # --out is this run's alone until it ends (rank 0 holds its lock), and never another run's
        with claim(args.out, ranks, device, refuse_fresh_start_over_another_run):
            # every rank finds the same state: rank 0 writes none before the first step
            return _train(args, device, ranks, resume_source(args.out, args.resume))
    finally:
        ranks.close()


def _train(args: argparse.Namespace, device: torch.device, ranks: Ranks, resume: Path | None) -> dict:
    say = print if ranks.main else (lambda *a, **k: None)
    out: Path = args.out
    log_path, summary_path = out / "log.jsonl", out / "summary.json"
    preset = PRESETS[args.preset]
    model_config = dataclasses.replace(preset, vocab_size=args.vocab_size or preset.vocab_size)
    args.context = args.context or model_config.context
    train_tape = open_tape(args.data / "train.tape", model_config.vocab_size)
    val_tape = open_tape(args.data / "val.tape", model_config.vocab_size)
    check_steps_fit(args, train_tape, ranks.world_size * args.grad_accum * args.batch)  # before the tables are built
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # The model (the same seeded weights on every rank), its wrapper, the optimizer, the tables.
    core, initial = build_model(model_config, args.param_dtype, args.seed, device)
    flops_per_token = chat_flops_per_token(core, args.context)
    peak_flops = peak_bf16_flops(device)  # per device; the ranks are alike
    model = wrap_model(core, ranks, device)
    forward = compile_chat_model(model, args.compile) if args.compile else model
    optimizer = build_optimizer(core, args, device)
    schedule = build_schedule(ScheduleConfig(
        num_steps=args.steps, warmup_steps=args.warmup_steps, warmdown_ratio=args.warmdown_ratio,
        momentum_warmup_steps=args.momentum_warmup_steps, weight_decay=args.weight_decay))
    loader = PackedDocumentLoader(train_tape, args.batch, args.context, ranks.rank, ranks.world_size,
                                  packing=args.packing)
    config = run_config(args, model_config, schedule.config, train_tape, ranks.world_size)
    last = min(args.steps, args.stop_at) if args.stop_at else args.steps
    tokens_per_step = config["rows_per_step"] * args.context

    def summarize(step: int, stopped_because: str, step_seconds: list[float], losses: list[float],
                  eval_record: dict | None) -> dict:
        """summary.json: the first logged steps (compilation, allocator warm-up) are left out of the rate."""
        steady = step_seconds[2:] or step_seconds
        tokens_per_s = tokens_per_step / statistics.median(steady) if steady else None
        parameters = core.num_parameters()
        state_bytes = optimizer_state_bytes(optimizer)
        summary = {
            "step": step, "steps": args.steps, "stopped_because": stopped_because,
            "preset": args.preset, "parameters": parameters,
            "param_dtype": args.param_dtype, "optimizer": args.optimizer, "muon_mode": args.muon_mode,
            "parallel": ranks.parallel, "world_size": ranks.world_size, "grad_accum": args.grad_accum,
            "device": str(device), "tokens_per_step": tokens_per_step,
            "final_loss": losses[-1] if losses else None,
            "median_step_ms": 1e3 * statistics.median(steady) if steady else None,
            "tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token, "peak_flops_per_device": peak_flops,
            "mfu": model_flops_utilization(tokens_per_s, flops_per_token, peak_flops, ranks.world_size),
            "compile": args.compile,
            # this session's graphs (dynamo's count): equal when no batch after the first compiled anything
            "compiled_graphs_after_first_batch": graphs_after_first_batch if args.compile else None,
            "compiled_graphs": compiled_graph_count() - graphs_at_start if args.compile else None,
            # under FSDP2: rank 0's shard of the state, per parameter of the whole model
            "optimizer_state_bytes": state_bytes, "optimizer_state_bytes_per_parameter": state_bytes / parameters,
            "weight_bytes_per_parameter": sum(p.numel() * p.element_size() for p in core.parameters()) / parameters,
            **({"val_loss": eval_record["val_loss"], "val_bpb": eval_record["val_bpb"]} if eval_record else {}),
        }
        if device.type == "cuda":
            summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            summary["peak_memory_bytes_per_parameter"] = summary["peak_memory_bytes"] / parameters
        return summary

    def summary_from_log(records: list[dict]) -> dict:
        """A finished run's summary from its log (its summary.json was lost after the final
        state): the figures the sessions logged; nothing of this session, which trains nothing."""
        steps = [r for r in records if "loss" in r]
        evals = [r for r in records if "val_loss" in r]
        stopped_because = "tape_exhausted" if step < last else "stop_at" if last < args.steps else "steps"
        summary = summarize(step, stopped_because, [r["step_ms"] / 1e3 for r in steps], [r["loss"] for r in steps],
                            evals[-1] if evals else None)
        for key in ("compile", "compiled_graphs_after_first_batch", "compiled_graphs", "peak_memory_bytes",
                    "peak_memory_bytes_per_parameter"):
            summary.pop(key, None)  # a session's own, not in the log
        return summary

    graphs_at_start, graphs_after_first_batch = compiled_graph_count(), None
    # Under FSDP2 the state files are read and written through an unsharded twin (rank 0 keeps
    # one for the saves; a resume builds one on every rank and drops it on the others).
    twin = None
    step = 0
    if resume is None:
        if not tape_feeds(loader, args.grad_accum):  # the crop rule's rows can take more than check_steps_fit's
            raise ChatTrainError(f"{args.data / 'train.tape'} cannot feed the first step under --packing "
                                 f"{args.packing} ({config['rows_per_step']} rows x {args.context} tokens and the "
                                 "next batch): pass a smaller --batch or --context, or a longer tape")
        if args.optimizer == "packed":
            start_masters(optimizer, core, initial)
    else:
        # The file holds rank 0's next micro-batch and the cursor between steps, which every rank
        # shares whatever the number of ranks (docs/D12.md, "FSDP2"): every rank loads through a
        # rank-0 view of its tape in the layout that wrote the state (load_state checks the saved
        # batch against it), then takes the cursor into its own loader.
        view = PackedDocumentLoader(train_tape, args.batch, args.context, 0,
                                    saved_world_size(resume, ranks.world_size),
                                    packing=args.packing)
        if ranks.parallel == "fsdp":
            twin = unsharded_twin(model_config, args)
        target = (twin.model, twin.optimizer) if twin is not None else (core, optimizer)
        loaded = load_state(resume, model=target[0], optimizer=target[1], loader=view, config=config,
                            schedule=schedule, allow_code_change=args.allow_code_change)
        if twin is not None:
            twin.scatter(core, optimizer)
            if not ranks.main:
                twin = None
        loader.load_state_dict({**view.state_dict(), "world_size": ranks.world_size})
        step = loaded.step
        if loaded.t_step != step:
            raise TrainingStateError(f"{resume}: t_step {loaded.t_step} differs from step {step}; "
                                     "chat_train runs one schedule row per step")
        # Before anything in --out is written or its log trimmed: the states there are this run's
        # (none newer than the resumed one, none of another configuration), and a resume of a
        # file from elsewhere goes into a directory without another run's files; or it is refused.
        refuse_to_replace(out, RUN_FILES, resume, step, json.loads(json.dumps(config)),  # the config as saved
                          read_info=state_info)
        if step >= last or not tape_feeds(loader, args.grad_accum):  # nothing to do: nothing in --out changes
            return finished_run_summary(resume, summary_path, log_path, step, summary_from_log,
                                        write=ranks.main, say=say)
        say(f"resumed from {resume} at step {step}")

    def write_schedule() -> None:
        """This run's tables, written by every session (a resume into a new --out, or over a stale
        file of a start that failed before its first step, leaves none of another run's)."""
        path = out / "schedule.safetensors"
        with writing(path), atomic_path(path) as written:
            save_file(schedule.to_tensors(prefix=""), str(written),
                      metadata={"schedule": json.dumps(schedule.config.to_dict())})
    on_main_rank(ranks, device, write_schedule)
    if ranks.main:
        with writing(log_path):
            keep_records_up_to(log_path, step)  # lines after the resume point came from a session that died
    if ranks.parallel == "ddp":
        ddp_rebuild_buckets(model, args.batch, args.context, device)  # every session reduces in the same buckets

    saved_step, last_state = None, resume  # the newest state of the run: the last good one if it diverges

    def save() -> None:
        nonlocal twin, saved_step, last_state
        # No state holds NaN or Inf: the one written last stays the run's last good state.
        bad = nonfinite_weights(core, ranks, device)
        if bad is not None:
            raise Diverged(f"NaN or Inf in the weights after step {step}"
                           + (f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""))
        saved_model, saved_optimizer = core, optimizer
        if args.optimizer == "packed" and ranks.parallel == "fsdp":
            if twin is None and ranks.main:
                twin = unsharded_twin(model_config, args)
            UnshardedTwin.gather(twin, core, optimizer)
            if ranks.main:
                saved_model, saved_optimizer = twin.model, twin.optimizer

        def write_state() -> None:
            if args.optimizer != "packed":
                return
            path = out / state_file_name(step)
            try:
                with writing(path):
                    save_state(path, model=saved_model, optimizer=saved_optimizer, loader=loader, schedule=schedule,
                               config=config, step=step, t_step=step)
                say(f"wrote {path}")
            except TapeExhausted:
                # a state holds the next batch; at the end of the tape there is none (tape_feeds
                # stops the run a step early so that this does not happen)
                say(f"no state at step {step}: {args.data / 'train.tape'} has no next batch for it to hold")
        on_main_rank(ranks, device, write_state)  # every rank learns whether rank 0 wrote it
        saved_step = step
        if args.optimizer == "packed":
            last_state = out / state_file_name(step)

    say(f"{args.preset}: {core.num_parameters():,} parameters, {args.param_dtype} weights, optimizer "
        f"{args.optimizer}{' (Muon ' + args.muon_mode + ')' if args.optimizer == 'packed' else ''}, "
        f"{tokens_per_step:,} tokens a step"
        + (f" in {args.grad_accum} micro-batches" if args.grad_accum > 1 else "")
        + f", steps {step} to {last} of {args.steps}"
        + (f", {ranks.parallel} on {ranks.world_size} ranks" if ranks.distributed else ""))
    step_seconds, losses, eval_record, stopped_by, diverged = [], [], None, None, None
    model.train()
    with StopRequest() as stop, GuardedRunLog(log_path, ranks) as log:
        try:
            while step < last:
                stopped_by = stop.agreed(ranks, device)  # SIGINT or SIGTERM on any rank: stop at this boundary
                if stopped_by:
                    say(f"{stopped_by} received: {'writing a state and ' if args.optimizer == 'packed' else ''}"
                        f"stopping at step {step}", file=sys.stderr)
                    break
                started = time.perf_counter()
                # The packing of the crop rule can waste tokens: a run stops where the tape cannot
                # feed the step and the next batch, which the state written here then holds.
                micro_batches = next_step_batches(loader, args.grad_accum)  # every rank alike (one cursor)
                if micro_batches is None:
                    stopped_by = "tape_exhausted"
                    say(f"training tape exhausted at step {step}: {args.data / 'train.tape'} cannot feed another "
                        f"step and the next batch under --packing {args.packing}; writing the state and stopping")
                    break
                row = apply_schedule(optimizer, schedule, step)  # t_step: this run's step
                step_loss = None  # the mean of the micro-batches' mean losses
                for micro, packed in enumerate(micro_batches):
                    batch = to_device(packed, device)
                    with gradient_sync(model, ranks.parallel, sync=micro == args.grad_accum - 1):
                        with forward_context(args.param_dtype, device):
                            _, loss = forward(batch.inputs, batch.targets, cu_seqlens=batch.cu_seqlens)
                        (loss / args.grad_accum).backward()
                    if graphs_after_first_batch is None:
                        graphs_after_first_batch = compiled_graph_count() - graphs_at_start
                    part = loss.detach().float() / args.grad_accum
                    step_loss = part if step_loss is None else step_loss + part
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                logged = step % args.log_every == 0 or step == last
                saving = (args.save_every and step % args.save_every == 0) or step == last
                if logged or saving:  # a state is written only after a step whose loss was finite
                    mean_loss = step_loss
                    if ranks.distributed:
                        torch.distributed.all_reduce(mean_loss)
                        mean_loss /= ranks.world_size
                    mean_loss = mean_loss.item()  # waits for the step
                    if logged:
                        seconds = time.perf_counter() - started
                        step_seconds.append(seconds)
                        losses.append(mean_loss)
                        log.write({"step": step, "loss": mean_loss, **row, "lr": kind_learning_rates(optimizer),
                                   "tokens": step * tokens_per_step, "step_ms": 1e3 * seconds,
                                   "tokens_per_s": tokens_per_step / seconds,
                                   "mfu": model_flops_utilization(tokens_per_step / seconds, flops_per_token,
                                                                  peak_flops, ranks.world_size)})
                    if not math.isfinite(mean_loss):
                        raise Diverged(f"loss {mean_loss} at step {step}")
                if args.eval_every and (step % args.eval_every == 0 or step == last):
                    if ranks.main or ranks.parallel == "fsdp":  # FSDP2's forward gathers the shards: every rank runs it
                        eval_record = {"step": step, **evaluate(core, val_tape, args.batch, args.context,
                                                                args.eval_batches, args.param_dtype, device)}
                        if ranks.parallel == "fsdp":
                            # FSDP2's root keeps its parameters gathered after a forward without a backward:
                            # put the shards back before the optimizer or a save reads the parameters.
                            core.reshard()
                        log.write(eval_record)
                        say(f"step {step}: val loss {eval_record['val_loss']:.4f}, bpb {eval_record['val_bpb']}")
                    ranks.barrier()
                if saving:
                    save()
            if stopped_by and saved_step != step:
                save()
        except Diverged as error:
            stopped_by, diverged = "diverged", error

    summary = summarize(step, stopped_by or ("stop_at" if last < args.steps else "steps"), step_seconds, losses,
                        eval_record)
    if ranks.main:
        write_summary(summary_path, summary)
    if diverged is not None:
        what = (f"{diverged}; {last_state} stays its last state (none is written after a divergence)"
                if last_state is not None else f"{diverged} (the reference optimizer writes no states)"
                if args.optimizer != "packed" else f"{diverged}, before its first state")
        raise RunDiverged(f"the run diverged: {what}; lower the learning rates (--matrix-lr, --embedding-lr, "
                          "--unembedding-lr, --scalar-lr) or lengthen --warmup-steps, and start again into another "
                          "--out")
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)  # a bad flag exits 2 here (argparse)
    try:
        summary = train(args)
    except (ChatTrainError, CheckpointError, RunDirectoryError, RunWriteError, RunDiverged, TapeError,
            TapeExhausted) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1 if isinstance(error, (RunWriteError, RunDiverged)) else 2
    if launched_rank() == 0:
        print(json.dumps({k: summary[k] for k in ("step", "final_loss", "tokens_per_s", "val_bpb") if k in summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
