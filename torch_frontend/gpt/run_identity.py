"""What identifies a reference-GPT run (train.py): its default --out directory, and its trajectory,
the settings a resume must match. Both read the optimizer kind's own settings, so they live above
config.py and optimizers.py."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import TrainConfig, model_config
from .distributed import launched_world_size
from .optimizers import optimizer_kind

# The settings that decide the bits of every kind's result.
TRAJECTORY_FIELDS = ("optimizer", "mode", "param_dtype", "m_bias", "rms_bias", "batch_size", "max_steps", "lr",
                     "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "seed", "parallel")


def trajectory(config: TrainConfig, vocab_size: int | None = None) -> dict:
    """The settings that decide the bits of the result, with the model spelled out: the preset's
    configuration with the vocabulary of the run's tapes (`vocab_size`; None: the preset's own),
    so a resume whose tapes have another vocabulary is refused."""
    # Recorded only when on, so checkpoints made before --autocast existed stay resumable.
    autocast = {"autocast": config.autocast} if config.autocast != "none" else {}
    # Settings only some kinds read (Muon's) are recorded for those alone: the checkpoints of
    # the other kinds stay resumable.
    own = {name: getattr(config, name) for name in optimizer_kind(config.optimizer).own_settings}
    # The number of ranks decides which windows each rank reads and the global batch.
    return {"model": dataclasses.asdict(model_config(config.config, vocab_size)),
            **{name: getattr(config, name) for name in TRAJECTORY_FIELDS}, **autocast, **own,
            "world_size": launched_world_size()}


def out_dir(config: TrainConfig) -> Path:
    """--out, or the run's default directory: runs/<preset>-<the kind's run name>[-bf16]
    [-autocast-bf16][-ddp2]."""
    name = optimizer_kind(config.optimizer).run_name(config)
    if config.param_dtype != "fp32":
        name += f"-{config.param_dtype}"
    if config.autocast != "none":
        name += f"-autocast-{config.autocast}"
    if config.parallel != "none":
        name += f"-{config.parallel}{launched_world_size()}"
    return Path(config.out or f"runs/{config.config}-{name}")
