"""The reference GPT, its finite-tape trainer and exact-resume checkpoints (docs/TRAINING.md).

    python -m packed_adamw.torch.gpt.train --demo
"""
from .model import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]
