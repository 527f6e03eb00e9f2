"""A small GPT in plain PyTorch: the reference model that PackedAdamW is trained on.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention, GELU MLP),
a final LayerNorm, and an output head tied to the token embedding. No dropout, so a run has
no random state after initialisation and resumes exactly. The model runs in its parameters'
dtype (float32, or bfloat16 for the trainer's `--param-dtype bf16`, with no autocast); the
loss is computed from float32 logits either way.

Presets (vocabulary 12,095, the project tokenizer):

    name       d_model  layers  heads  context  parameters
    reference      288       8      9      256  11,550,240
    tiny           128       4      4      128   2,357,888
    gpt2-small     768      12     12     1024  95,131,392   (GPT-2 124M's shape; peers table)
    micro           32       2      2       16     413,024   (tests only)
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from packed_adamw.tokenizer import VOCAB_SIZE


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]


PRESETS = {
    # head_dim 32; 11,550,240 parameters, within 0.5% of the 11.6 M the project asks for.
    "reference": GPTConfig(d_model=288, n_layers=8, n_heads=9, context=256),
    "tiny": GPTConfig(d_model=128, n_layers=4, n_heads=4, context=128),
    "micro": GPTConfig(d_model=32, n_layers=2, n_heads=2, context=16),
    # GPT-2 124M's shape (the peers table, benchmarks/peers.py): 95,131,392 parameters with this
    # vocabulary (GPT-2's 124 M count has its 50,257-token vocabulary in the tied embedding).
    "gpt2-small": GPTConfig(d_model=768, n_layers=12, n_heads=12, context=1024),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)
        # GPT-2: scale the residual-stream projections by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        """Logits [B, T, vocab]; with `targets`, also the cross-entropy loss (nats)."""
        T = idx.shape[1]
        if T > self.config.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.config.context}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        # The head is the token embedding itself (weight tying), so it is saved once.
        logits = F.linear(self.ln_final(x), self.tok_emb.weight)
        if targets is None:
            return logits
        # The loss in float32 whatever the parameters' dtype: bf16 logits would round the
        # log-softmax to 8 bits (a no-op for float32 parameters, whose bits it keeps).
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
        return logits, loss
