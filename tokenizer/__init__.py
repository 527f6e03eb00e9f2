"""Byte-level BPE tokenizer of the project: a committed artifact with exactly 12,095 entries.

The artifact (`bpe-12095.json`) is retrained byte-for-byte from the embedded corpus with
`python -m packed_adamw.tokenizer.train_tokenizer`; `corpus.py` names that corpus and
`tape.py` turns documents into the finite token tapes that training reads.
"""

import hashlib
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

VOCAB_SIZE = 12095
EOT_TOKEN = "<|endoftext|>"

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_ARTIFACT = PACKAGE_DIR / f"bpe-{VOCAB_SIZE}.json"

RETRAIN_HINT = "retrain it with `python -m packed_adamw.tokenizer.train_tokenizer`"


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """Load a tokenizer file (default: the committed artifact), checking it has VOCAB_SIZE entries."""
    path = Path(path) if path is not None else TOKENIZER_ARTIFACT
    tokenizer = Tokenizer.from_file(str(path))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise ValueError(
            f"tokenizer {path} has {size} entries, expected exactly {VOCAB_SIZE}; "
            f"use the committed artifact or {RETRAIN_HINT}"
        )
    if tokenizer.token_to_id(EOT_TOKEN) is None:
        raise ValueError(f"tokenizer {path} has no {EOT_TOKEN!r} token; {RETRAIN_HINT}")
    # A document that literally contains "<|endoftext|>" must encode as text, so that
    # encode/decode round-trips every string; only the tape builder inserts the real EOT id.
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_sha256(path: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) of the tokenizer file's bytes (default: the committed artifact)."""
    path = Path(path) if path is not None else TOKENIZER_ARTIFACT
    return hashlib.sha256(path.read_bytes()).hexdigest()


def token_byte_counts(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id decodes to (int64 [VOCAB_SIZE]); special tokens count 0.

    In a byte-level vocabulary every character of a token string stands for exactly one
    byte, so the count is the string length; decoding single tokens would not work, since
    a token may hold part of a multi-byte character.
    """
    byte_alphabet = set(ByteLevel.alphabet())
    special_ids = {i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special}
    counts = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id in special_ids:
            continue
        if not set(token) <= byte_alphabet:
            raise ValueError(f"token {token!r} (id {token_id}) is not byte-level; {RETRAIN_HINT}")
        counts[token_id] = len(token)
    return counts
