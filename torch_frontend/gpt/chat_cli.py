"""chat_train.py's command line and the checks every flag passes before anything runs (the
checks both trainers share are cli.py's: the device, the seed, --parallel, a count's minimum, a
value by packed_adamw.core's rules; --out's is run_directory.check_out)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from packed_adamw.core import validate_hyperparams as validate_adamw
from packed_adamw.core.muon import validate_hyperparams as validate_muon

from .chat_model import PRESETS
from .cli import (check_at_least, check_device, check_option, check_parallel, check_peak_rates, check_seed,
                  check_stop_at)
from .config import ConfigError
from .packed_data import DEFAULT_PACKING, PACKING_RULES
from .run_directory import RunDirectoryError, check_out
from .schedules import ScheduleConfig

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MUON_MODES = ("packed", "bf16", "fp32")
OPTIMIZERS = ("packed", "reference")
PARALLEL = ("none", "ddp", "fsdp")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


class ChatTrainError(ValueError):
    """A run that cannot start as asked (the message says which option to change)."""


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The settings of the command line `argv` (sys.argv's by default), checked; an invalid one
    exits 2 with one line naming it. `description` heads --help."""
    p = argparse.ArgumentParser(prog="python -m packed_adamw.torch.gpt.chat_train", description=description,
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
    p.add_argument("--track-format", action="store_true",
                   help="count where the packed optimizer's codes saturate, flush or go subnormal, and Muon's refused "
                        "matrices; log.jsonl gets a \"format\" record per kind of tensor at every logged step")
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
    checks this shares with train.py's command line: cli.py). The run checks them again when it
    starts (loop.run), so a run started from code passes them too."""
    check_at_least(args, {"steps": 1, "batch": 1, "grad_accum": 1, "save_every": 0, "stop_at": 0, "eval_every": 0,
                          "eval_batches": 0, "log_every": 1})
    check_stop_at("--stop-at", args.stop_at, "--steps", args.steps)
    if args.eval_every and args.eval_batches == 0:
        raise ChatTrainError(f"--eval-batches 0 with --eval-every {args.eval_every}: an evaluation reads at least one "
                             "packed batch of val.tape; pass --eval-batches 1 or more, or leave out --eval-every")
    if args.vocab_size is not None and args.vocab_size < 1:  # 0 would silently mean the preset's
        raise ChatTrainError(f"--vocab-size {args.vocab_size}: give the tapes' vocabulary size (>= 1), or leave "
                             "the flag out for the preset's")
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
        if args.muon_mode != "packed":
            raise ChatTrainError(f"--muon-mode {args.muon_mode}: PackedMuon's momentum storage, and --optimizer "
                                 "reference steps with torch.optim.Muon: leave --muon-mode out")
        if args.track_format:
            raise ChatTrainError("--track-format counts the packed optimizer's formats, and --optimizer reference "
                                 "keeps float32 state: leave out --track-format, or use --optimizer packed")
    if args.allow_code_change and not args.resume:
        raise ChatTrainError("--allow-code-change lets a resume continue a state written by other trajectory code; "
                             "this run resumes nothing: leave it out, or add --resume")
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
    """--resume: a state file, or `auto` (loop.resume_source: --out's newest state, else a fresh start)."""
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
    check_peak_rates({flag: getattr(args, flag[2:].replace("-", "_"))
                      for flag in ("--matrix-lr", "--embedding-lr", "--unembedding-lr", "--scalar-lr")})


