"""Per-step schedule tables: the learning-rate multiplier, Muon's momentum and Muon's weight
decay for every step of a run, computed before it starts, saved with it, read by position.

Step t of the run (`t_step`, 0-based) reads row t of each table. The shapes follow
nanochat's base_train (its 2026 version; the earlier values in parentheses):

- `lr_multiplier`: linear warmup (t + 1) / warmup_steps over the first `warmup_steps` steps,
  then 1.0, then over the last round(warmdown_ratio * num_steps) steps a linear warmdown
  p + (1 - p) * final_lr_frac with p = (num_steps - t) / warmdown_steps (final_lr_frac 0.05,
  warmdown_ratio 0.65; earlier 0.0 and 0.5).
- `muon_momentum`: momentum_start -> momentum_peak linearly over the first
  `momentum_warmup_steps` steps (0.85 -> 0.97 over 400; earlier 0.95 over 300), then the
  peak; during the lr warmdown linearly down to `momentum_final` (0.90), or held at the peak
  when momentum_final is None (the earlier schedule).
- `muon_weight_decay`: the Muon groups' weight decay, `weight_decay` times a cosine
  0.5 * (1 + cos(pi * t / num_steps)) ("cosine"), or (1 - t / num_steps) ("linear", the
  earlier one), or constant. nanochat first scales its base value (0.28; earlier 0.2) with
  batch size and depth; here `weight_decay` is the value the run uses (the caller scales;
  default 0: no decay unless asked).

The tables are float64 numpy arrays; `apply_schedule` writes row t into the optimizer's
groups: every group's lr = its base lr (`initial_lr`) * lr_multiplier[t], and the Muon groups
(kind "muon") get momentum and weight_decay. The group's `initial_lr` is recorded from its lr
the first time (torch's LR schedulers use the same key); it is saved in the optimizer's
state_dict, so a resumed run keeps it.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

TABLE_NAMES = ("lr_multiplier", "muon_momentum", "muon_weight_decay")
WEIGHT_DECAY_SHAPES = ("cosine", "linear", "constant")
BASE_LR_KEY = "initial_lr"


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The settings the tables are computed from (defaults: nanochat's 2026 base_train)."""

    num_steps: int
    warmup_steps: int = 40
    warmdown_ratio: float = 0.65
    final_lr_frac: float = 0.05
    momentum_start: float = 0.85
    momentum_peak: float = 0.97
    momentum_warmup_steps: int = 400
    momentum_final: float | None = 0.90
    weight_decay: float = 0.0
    weight_decay_shape: str = "cosine"

    def __post_init__(self):
        for name in ("num_steps", "warmup_steps", "momentum_warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "num_steps" else 0):
                raise ValueError(f"ScheduleConfig: {name}={value!r} must be an int >= "
                                 f"{1 if name == 'num_steps' else 0}")
        if not 0.0 <= self.warmdown_ratio <= 1.0:
            raise ValueError(f"ScheduleConfig: warmdown_ratio={self.warmdown_ratio!r} must be in [0, 1]")
        if self.weight_decay_shape not in WEIGHT_DECAY_SHAPES:
            raise ValueError(f"ScheduleConfig: weight_decay_shape={self.weight_decay_shape!r} is not one of "
                             f"{WEIGHT_DECAY_SHAPES}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_multiplier(config: ScheduleConfig, t: int) -> float:
    warmdown = round(config.warmdown_ratio * config.num_steps)
    if t < config.warmup_steps:
        return (t + 1) / config.warmup_steps
    if t <= config.num_steps - warmdown:
        return 1.0
    progress = (config.num_steps - t) / warmdown
    return progress + (1 - progress) * config.final_lr_frac


def muon_momentum(config: ScheduleConfig, t: int) -> float:
    warmdown = round(config.warmdown_ratio * config.num_steps)
    warmdown_start = config.num_steps - warmdown
    if t < config.momentum_warmup_steps:
        frac = t / config.momentum_warmup_steps
        return (1 - frac) * config.momentum_start + frac * config.momentum_peak
    if config.momentum_final is not None and warmdown and t >= warmdown_start:
        progress = (t - warmdown_start) / warmdown
        return (1 - progress) * config.momentum_peak + progress * config.momentum_final
    return config.momentum_peak


def muon_weight_decay(config: ScheduleConfig, t: int) -> float:
    if config.weight_decay_shape == "cosine":
        return config.weight_decay * 0.5 * (1 + math.cos(math.pi * t / config.num_steps))
    if config.weight_decay_shape == "linear":
        return config.weight_decay * (1 - t / config.num_steps)
    return config.weight_decay


_FUNCTIONS = {"lr_multiplier": lr_multiplier, "muon_momentum": muon_momentum, "muon_weight_decay": muon_weight_decay}


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTables:
    """The run's tables (`TABLE_NAMES` -> float64 arrays of num_steps rows) and the config
    they were computed from."""

    config: ScheduleConfig
    tables: dict[str, np.ndarray]

    def __len__(self) -> int:
        return self.config.num_steps

    def row(self, t_step: int) -> dict[str, float]:
        """Row `t_step` of every table, as Python floats."""
        if not isinstance(t_step, int) or isinstance(t_step, bool) or not 0 <= t_step < len(self):
            raise IndexError(f"t_step={t_step!r} is outside the schedule's {len(self)} steps (0 to {len(self) - 1}); "
                             "the run has reached the end of its schedule, or the step counter is wrong")
        return {name: float(table[t_step]) for name, table in self.tables.items()}

    def to_tensors(self, prefix: str = "schedule/") -> dict[str, torch.Tensor]:
        return {prefix + name: torch.from_numpy(np.ascontiguousarray(table)) for name, table in self.tables.items()}

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict[str, torch.Tensor], prefix: str = "schedule/"):
        """Tables read back as saved (not recomputed): a run continues on the tables it started with."""
        schedule = ScheduleConfig(**config)
        tables = {name: tensors[prefix + name].numpy().astype(np.float64, copy=True) for name in TABLE_NAMES}
        for name, table in tables.items():
            if table.shape != (schedule.num_steps,):
                raise ValueError(f"schedule table {name!r} has shape {table.shape}, its config says "
                                 f"{schedule.num_steps} steps; the saved state is damaged")
        return cls(schedule, tables)

    def differences(self, other: "ScheduleTables") -> list[str]:
        """One line per table whose bits differ from `other`'s (empty: the same tables)."""
        lines = []
        for name in TABLE_NAMES:
            a, b = self.tables[name], other.tables[name]
            if a.shape != b.shape or not np.array_equal(a.view(np.uint64), b.view(np.uint64)):
                where = ("shapes " + f"{a.shape} vs {b.shape}" if a.shape != b.shape
                         else f"first at t_step {int(np.flatnonzero(a.view(np.uint64) != b.view(np.uint64))[0])}")
                lines.append(f"schedule table {name} differs ({where})")
        return lines


def build_schedule(config: ScheduleConfig) -> ScheduleTables:
    """Every table for every step of the run."""
    tables = {name: np.array([fn(config, t) for t in range(config.num_steps)], dtype=np.float64)
              for name, fn in _FUNCTIONS.items()}
    return ScheduleTables(config, tables)


def apply_schedule(optimizer: torch.optim.Optimizer, tables: ScheduleTables, t_step: int) -> dict[str, float]:
    """Set the optimizer's groups for step `t_step`: every group's lr = its `initial_lr` (its lr
    when first seen) * lr_multiplier[t_step]; groups of kind "muon" also take muon_momentum and
    muon_weight_decay. Returns the row applied."""
    row = tables.row(t_step)
    for index, group in enumerate(optimizer.param_groups):
        if isinstance(group["lr"], torch.Tensor):
            raise TypeError(f"apply_schedule: param_groups[{index}] has a tensor lr (capturable); the schedule "
                            "writes Python floats: build the optimizer with float learning rates")
        base = group.setdefault(BASE_LR_KEY, group["lr"])
        group["lr"] = base * row["lr_multiplier"]
        if group.get("kind") == "muon":
            group["momentum"] = row["muon_momentum"]
            group["weight_decay"] = row["muon_weight_decay"]
    return row
