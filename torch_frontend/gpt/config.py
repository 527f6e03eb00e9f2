"""A training run's settings (`TrainConfig`) and their choices; cli.py checks them and parses
the command line into them."""
from __future__ import annotations

import dataclasses

import torch

from .checkpoint import CHECKPOINT_NAME, SHARDED_CHECKPOINT_NAME
from .families import preset_config


class ConfigError(ValueError):
    """Settings that cannot work together."""


# --param-dtype: what the model's parameters are. bf16 trains bf16 live weights (forward and
# backward in bf16, no autocast); PackedAdamW then keeps each one's exact FP32 master as the
# weight plus an int16 low half in its state (FORMAT.md, "Split masters").
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# --autocast: the forward and loss under torch.autocast in this dtype, with FP32 parameters
AUTOCAST = {"none": None, "bf16": torch.bfloat16}
PARALLEL = ("none", "ddp", "fsdp")
FORMAT_STEPS = ("all", "logged")  # --format-steps: which steps --track-format counts


@dataclasses.dataclass
class TrainConfig:
    # -- what the run computes: recorded in the checkpoint and required equal on resume --
    config: str = "tiny"  # model preset (families.MODEL_PRESETS)
    optimizer: str = "packed-adamw"  # or "torch-adamw", the torch.optim.AdamW baseline
    mode: str = "packed"  # PackedAdamW mode: packed | fp16 | fp32 (with packed-muon: its AdamW part's)
    param_dtype: str = "fp32"  # or "bf16": bf16 live weights (with packed-adamw: split FP32 masters)
    autocast: str = "none"  # or "bf16": forward and loss under bf16 autocast, FP32 parameters
    m_bias: int = 15
    rms_bias: int = 15
    batch_size: int = 16
    max_steps: int = 500  # step budget, and the length of the cosine schedule
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on matrices and embeddings; biases and LayerNorms get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # global-norm clipping; None (`--grad-clip none`): no clipping
    seed: int = 0
    # Muon + AdamW (--optimizer muon or packed-muon): Muon's peak learning rate for the block
    # matrices (the schedule scales it as it scales --lr, which the AdamW part keeps), its
    # momentum, and packed-muon's momentum format (packed | bf16 | fp32)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_mode: str = "packed"
    parallel: str = "none"  # under torchrun: "ddp" or "fsdp" (FSDP2); batch_size is then per rank
    # -- how the run is carried out: free to change between sessions --
    data: str = "runs/data/shakespeare"
    build_data: bool = False  # build data/train.tape and val.tape from the embedded corpus if neither exists
    out: str = ""  # default runs/<config>-<mode or optimizer>
    device: str = "auto"
    resume: str = ""  # "", "auto" (resume if out/checkpoint exists), a checkpoint path or a run directory
    checkpoint_every: int = 100
    checkpoints: bool = True  # --no-checkpoints: write none (needed by optimizers whose state they cannot hold)
    stop_at_step: int = 0  # >0: write a checkpoint and stop at this step (the schedule keeps max_steps)
    eval_every: int = 100
    eval_batches: int = 8  # validation batches per evaluation; 0 = the whole validation tape
    log_every: int = 10
    log_moment_stats: bool = False  # fp32 mode: write moment_stats.jsonl every moment_stats_every steps
    moment_stats_every: int = 100
    moment_stats_biases: str = "12,15,18,21"
    # packed/fp16: "format" records in log.jsonl every log_every steps and format.png (counting
    # changes no bit of training, so it may be switched on or off between sessions)
    track_format: bool = False
    # "all": every step counts (a record covers the steps since the last); "logged": only the
    # logged steps count, so counting costs nothing on the others (a record covers its step)
    format_steps: str = "all"
    progress: bool = True
    deterministic: bool = True  # CUDA: deterministic kernels, without which resume is not bit-exact

    @property
    def checkpoint_name(self) -> str:
        return SHARDED_CHECKPOINT_NAME if self.parallel == "fsdp" else CHECKPOINT_NAME


def model_config(preset: str, vocab_size: int | None = None):
    """The preset's model configuration with the vocabulary of the run's tapes: the presets are
    shapes, and the tapes' header says how many tokens the embedding needs (12,095 for the
    default tokenizer, 32,768 for the large corpus's). None, or the preset's own size, gives
    the preset unchanged."""
    base = preset_config(preset)
    if vocab_size is None or vocab_size == getattr(base, "vocab_size", None):
        return base
    if not (dataclasses.is_dataclass(base) and "vocab_size" in {f.name for f in dataclasses.fields(base)}):
        raise ConfigError(f"--config {preset}: its model configuration has no vocab_size to set to the tapes' "
                          f"{vocab_size}; train it on tapes of its own vocabulary")
    return dataclasses.replace(base, vocab_size=vocab_size)


DEMO = dict(config="tiny", build_data=True, out="runs/demo", resume="auto")
