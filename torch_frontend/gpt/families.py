"""Model families: what `--config NAME` builds.

A family is one model architecture with its named presets. The trainer reaches models only
through `preset_config`, `build_model` and `parameter_kind`, so a second family plugs in by
adding a `ModelFamily` to FAMILIES (its preset names must not repeat another family's).

A family's model has `config.context` and `config.vocab_size`, `blocks` (the modules FSDP2
shards one by one before the root), `num_parameters()`, and
`forward(idx, targets=None, reduction="mean")` returning (logits, loss) with targets; its
parameters are drawn from torch's global generator, so a seed fixes them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from .chat_model import PRESETS as CHAT_PRESETS
from .chat_model import ChatGPT, chat_parameter_kind
from .model import GPT
from .model import PRESETS as GPT_PRESETS


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    presets: Mapping[str, object]  # preset name -> the frozen dataclass the model is built from
    build: Callable[[object], torch.nn.Module]
    # parameter name -> the kind of tensor telemetry groups it under (log.jsonl's "kinds")
    parameter_kind: Callable[[str], str]


def gpt_parameter_kind(name: str) -> str:
    if name.endswith(".bias"):
        return "bias"
    if "ln_" in name:
        return "layernorm"
    if "emb" in name:
        return "embedding"
    if ".attn." in name:
        return "attention_" + name.split(".")[-2]  # attention_qkv, attention_proj
    return "mlp"


FAMILIES = (
    ModelFamily("gpt", GPT_PRESETS, GPT, gpt_parameter_kind),
    # nanochat-style (chat_model.py); its forward also takes cu_seqlens= for packed documents,
    # and muon_adamw_groups() gives nanochat's optimizer split.
    ModelFamily("chat", CHAT_PRESETS, ChatGPT, chat_parameter_kind),
)
MODEL_PRESETS = {name: family for family in FAMILIES for name in family.presets}  # preset -> its family
assert len(MODEL_PRESETS) == sum(len(family.presets) for family in FAMILIES), "two families name the same preset"


def family_of(preset: str) -> ModelFamily:
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[preset]


def preset_config(preset: str):
    """The model configuration a preset names (recorded in checkpoints as the run's "model")."""
    return family_of(preset).presets[preset]


def new_model(preset: str) -> torch.nn.Module:
    """The preset's model, its parameters drawn from torch's global generator."""
    return family_of(preset).build(preset_config(preset))
