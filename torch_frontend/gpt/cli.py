"""The trainer's command line and the checks every setting passes before anything runs."""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch

from packed_adamw.core import StateFormat, validate_hyperparams

from .config import AUTOCAST, DEMO, FORMAT_STEPS, PARALLEL, PARAM_DTYPES, ConfigError, TrainConfig
from .distributed import distributed_ready, launched_world_size, under_torchrun
from .families import MODEL_PRESETS
from .optimizers import OPTIMIZERS, optimizer_kind
from .run_directory import RunDirectoryError, check_out
from .run_identity import out_dir


def check_option(option: str, value, check) -> None:
    """Run a check of packed_adamw.core (which raises ValueError) and name the option on failure."""
    try:
        check()
    except ValueError as error:
        raise ConfigError(f"{option} {value}: {error}") from None


def check_config(config: TrainConfig) -> None:
    """Refuse settings that cannot work, naming the option (ConfigError; the CLI exits 2).

    The optimizer's rules live in packed_adamw.core (validate_hyperparams, StateFormat): each
    value is checked there on its own, the others held at values those rules accept, so the
    error names the one option at fault. The same rules apply to the torch-adamw baseline.
    """
    if config.config not in MODEL_PRESETS:
        raise ConfigError(f"--config {config.config}: unknown model preset; choose one of {sorted(MODEL_PRESETS)}")
    kind = optimizer_kind(config.optimizer)
    if config.param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"--param-dtype {config.param_dtype}: choose one of {', '.join(PARAM_DTYPES)} "
                          "(bf16: bf16 weights, with PackedAdamW keeping exact FP32 masters)")
    if config.autocast not in AUTOCAST:
        raise ConfigError(f"--autocast {config.autocast}: choose one of {', '.join(AUTOCAST)}")
    if config.autocast != "none" and config.param_dtype != "fp32":
        raise ConfigError(f"--autocast {config.autocast} runs the forward of FP32 parameters in {config.autocast}; "
                          f"--param-dtype {config.param_dtype} parameters already run in {config.param_dtype}: "
                          "leave out one of the two")
    kind.check(config)
    lr_ok, betas_ok, eps_ok = 1e-3, (0.9, 0.95), 1e-8  # values the rules accept
    for option, value in (("--lr", config.lr), ("--min-lr", config.min_lr)):
        check_option(option, value, lambda v=value: validate_hyperparams(v, betas_ok, eps_ok, 0.0))
    check_option("--beta1", config.beta1, lambda: validate_hyperparams(lr_ok, (config.beta1, 0.95), eps_ok, 0.0))
    check_option("--beta2", config.beta2, lambda: validate_hyperparams(lr_ok, (0.9, config.beta2), eps_ok, 0.0))
    check_option("--eps", config.eps, lambda: validate_hyperparams(lr_ok, betas_ok, config.eps, 0.0))
    check_option("--weight-decay", config.weight_decay,
           lambda: validate_hyperparams(lr_ok, betas_ok, eps_ok, config.weight_decay))
    for option, value in (("--lr", config.lr), ("--min-lr", config.min_lr)):  # lr * weight_decay
        check_option(f"{option} {value} with --weight-decay", config.weight_decay,
               lambda v=value: validate_hyperparams(v, betas_ok, eps_ok, config.weight_decay))
    check_option("--mode", config.mode, lambda: StateFormat(mode=config.mode))
    check_option("--m-bias", config.m_bias, lambda: StateFormat(m_bias=config.m_bias))
    check_option("--rms-bias", config.rms_bias, lambda: StateFormat(rms_bias=config.rms_bias))
    moment_stats_biases(config)
    if config.grad_clip is not None and not (math.isfinite(config.grad_clip) and config.grad_clip > 0):
        raise ConfigError(f"--grad-clip {config.grad_clip}: the clipping norm must be a finite number > 0 "
                          "(a negative one reverses the gradient, 0 zeroes it); pass --grad-clip none "
                          "to train without clipping")
    check_at_least(config, {"batch_size": 1, "max_steps": 1, "warmup_steps": 0, "log_every": 1,
                            "moment_stats_every": 1, "checkpoint_every": 0, "stop_at_step": 0, "eval_every": 0,
                            "eval_batches": 0})
    check_peak_rates({"--lr": config.lr})
    if config.min_lr > config.lr:
        raise ConfigError(f"--min-lr {config.min_lr}: above --lr {config.lr}, the schedule would rise as it decays; "
                          "pass a --min-lr at most --lr")
    check_stop_at("--stop-at-step", config.stop_at_step, "--max-steps", config.max_steps)
    if not config.checkpoints and config.stop_at_step:
        raise ConfigError(f"--stop-at-step {config.stop_at_step} stops to continue from its checkpoint, and "
                          "--no-checkpoints writes none: leave out one of the two")
    check_seed(config.seed)
    check_device(config.device)
    check_read(config, kind)
    kind.check_telemetry(config)
    if config.format_steps not in FORMAT_STEPS:
        raise ConfigError(f"--format-steps {config.format_steps}: one of {', '.join(FORMAT_STEPS)}")
    if config.format_steps != "all" and not config.track_format:
        raise ConfigError(f"--format-steps {config.format_steps} says which steps --track-format counts: "
                          "add --track-format, or leave --format-steps out")
    check_parallel(config.parallel, config.device)


def check_read(config: TrainConfig, kind) -> None:
    """Refuse a setting given away from its default that this run would not read (it would be
    ignored silently): another optimizer kind's own settings, PackedAdamW's format for a kind that
    does not step with it, checkpoint and moment-statistics settings with those files off."""
    from .optimizers import KINDS

    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    defaults = TrainConfig()
    changed = lambda name: getattr(config, name) != getattr(defaults, name)  # noqa: E731
    readers = {}
    for other in KINDS:
        for name in other.own_settings:
            readers.setdefault(name, []).append(other.name)
    for name, kinds in readers.items():
        if name not in kind.own_settings and changed(name):
            raise ConfigError(f"{flag(name)} {getattr(config, name)}: --optimizer {kind.name} does not read it (only "
                              f"{', '.join(kinds)}); leave it out")
    if not kind.packed_format:
        for name in ("mode", "m_bias", "rms_bias"):
            if changed(name):
                raise ConfigError(f"{flag(name)} {getattr(config, name)}: PackedAdamW's state format, which "
                                  f"--optimizer {kind.name} does not use; leave it out")
    if not config.checkpoints and config.checkpoint_every and changed("checkpoint_every"):
        raise ConfigError(f"--checkpoint-every {config.checkpoint_every} with --no-checkpoints, which writes none: "
                          "leave out one of the two")
    if not config.log_moment_stats:
        for name in ("moment_stats_every", "moment_stats_biases"):
            if changed(name):
                raise ConfigError(f"{flag(name)} {getattr(config, name)}: moment statistics are written only with "
                                  "--log-moment-stats; add it, or leave this out")


# The checks below serve both trainers (chat_cli.py, chat_train.py's command line, calls them too).
def check_peak_rates(rates: dict[str, float]) -> None:
    """Each peak learning rate (flag -> value) above 0: the optimizers accept lr 0 (a step that
    changes nothing), but a run whose peak lr is 0 trains those parameters not at all, silently."""
    for flag, value in rates.items():
        if not value > 0:  # (NaN fails too; the rules' own checks name it first)
            raise ConfigError(f"{flag} {value}: the peak learning rate must be above 0 (at 0 those parameters would "
                              "never move); to freeze parameters, leave them out of the optimizer")


def check_stop_at(flag: str, stop_at: int, steps_flag: str, steps: int) -> None:
    """A stop (0: none) inside the run: a stop at or past its last step would be ignored."""
    if stop_at and stop_at >= steps:
        raise ConfigError(f"{flag} {stop_at}: the run ends at step {steps} ({steps_flag}); a stop must come before "
                          f"it (1 to {steps - 1}), or leave {flag} out")


def check_at_least(settings, minimums: dict[str, int]) -> None:
    """Each count of `settings` (a TrainConfig, a Namespace) at least its minimum, by name."""
    for name, minimum in minimums.items():
        value = getattr(settings, name)
        if value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: must be at least {minimum}")


def check_seed(seed: int) -> None:
    if not 0 <= seed < 2**64:
        raise ConfigError(f"--seed {seed}: must be in [0, 2**64)")


def check_device(name: str) -> None:
    """auto, cpu, cuda or cuda:N, and CUDA only where there is CUDA."""
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: the trainer runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")


def check_parallel(parallel: str, device: str, module: str = "packed_adamw.torch.gpt.train") -> None:
    """--parallel against how the process was started (`module`: the trainer torchrun starts)."""
    if parallel not in PARALLEL:
        raise ConfigError(f"--parallel {parallel}: choose one of {', '.join(PARALLEL)}")
    world = launched_world_size()
    if parallel == "none":
        if world > 1:
            raise ConfigError(
                f"--parallel none (the default) cannot run as one of WORLD_SIZE={world} processes started by "
                "torchrun: pass --parallel ddp (every rank holds the whole model) or --parallel fsdp (FSDP2: "
                "parameters and optimizer state sharded across the ranks), or run without torchrun")
        return
    if not torch.distributed.is_available():
        raise ConfigError(f"--parallel {parallel}: this torch build has no torch.distributed")
    if not (under_torchrun() or distributed_ready()):
        raise ConfigError(
            f"--parallel {parallel}: start with torchrun --nproc_per_node=N -m {module} --parallel {parallel} ... "
            "(torchrun sets RANK, WORLD_SIZE and the rendezvous)")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {device}: under torchrun each rank uses cuda:LOCAL_RANK (or the "
                          "CPU); pass --device auto, cuda or cpu")


def moment_stats_biases(config: TrainConfig) -> list[int]:
    try:
        biases = [int(b) for b in config.moment_stats_biases.split(",")]
        for bias in biases:
            StateFormat(m_bias=bias, rms_bias=bias)
    except ValueError as error:
        raise ConfigError(f"--moment-stats-biases {config.moment_stats_biases}: give comma-separated "
                          f"exponent biases such as 12,15,18,21 ({error})") from None
    return biases


def grad_clip_value(text: str) -> float | None:
    """`--grad-clip`: a number, or `none` for no clipping (the range is checked with the rest)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor `none`") from None


FLAG_HELP = {
    "optimizer": f"one of {', '.join(OPTIMIZERS)} (the peers are imported when chosen); ",
    "autocast": "bf16: forward and loss under torch.autocast(bfloat16) with FP32 parameters; ",
    "mode": "PackedAdamW's moment format (with --optimizer packed-muon: its AdamW part's); ",
    "muon_lr": "--optimizer muon / packed-muon: Muon's peak learning rate for the block matrices (the schedule "
               "scales it as it scales --lr, which the AdamW part keeps); ",
    "muon_momentum": "--optimizer muon / packed-muon: Muon's momentum; ",
    "muon_mode": "--optimizer packed-muon: the Muon momentum's format (packed: 2-byte E5M10 codes, bf16, fp32); ",
    "checkpoints": "write checkpoints (default); --no-checkpoints writes none, for optimizers whose state they "
                   "cannot hold (torchao's): the run cannot resume",
}


def parse_args(argv=None, description: str = "") -> tuple[TrainConfig, argparse.Namespace]:
    """The settings of the command line `argv` (sys.argv's by default), checked; an invalid one
    exits 2 with one line naming it. `description` heads --help."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m packed_adamw.torch.gpt.train", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--demo | --synthetic] [options]  (--help lists them)")
    parser.add_argument("--demo", action="store_true",
                        help="tiny GPT on the embedded corpus (builds the tape if needed), out runs/demo")
    parser.add_argument("--synthetic", action="store_true",
                        help="one update on random tokens, no corpus: a smoke test, not evidence of learning")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if field.name == "config":
            parser.add_argument(flag, choices=sorted(MODEL_PRESETS), default=default, help="model preset")
        elif field.name == "grad_clip":
            parser.add_argument(flag, type=grad_clip_value, default=default, metavar="NORM|none",
                                help=f"global gradient-norm clipping, > 0, or none; default {default!r}")
        elif field.name == "format_steps":
            parser.add_argument(flag, choices=FORMAT_STEPS, default=default,
                                help="with --track-format: count every step (all) or only the logged ones "
                                     f"(logged: no counting cost on the others); default {default!r}")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=FLAG_HELP.get(field.name))
        else:
            parser.add_argument(flag, type=type(default), default=default,
                                help=FLAG_HELP.get(field.name, "") + f"default {default!r}")
    # Flags given explicitly override the demo's settings, which override the defaults.
    namespace = argparse.Namespace(**DEMO) if "--demo" in (sys.argv[1:] if argv is None else argv) else None
    args = parser.parse_args(argv, namespace)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    try:
        check_config(config)
        if args.synthetic and config.parallel != "none":
            raise ConfigError(f"--parallel {config.parallel}: --synthetic is one update in one process; "
                              "leave out --parallel")
        if not args.synthetic:  # which writes nothing
            check_out(out_dir(config))
    except (ConfigError, RunDirectoryError) as error:
        parser.error(str(error))  # one line on stderr, exit code 2
    return config, args
