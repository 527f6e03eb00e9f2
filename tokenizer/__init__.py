"""Byte-level BPE tokenizers of the project: committed artifacts with exactly 12,095 and 32,768 entries.

The default artifact (`bpe-12095.json`) is retrained byte-for-byte from the embedded
Shakespeare corpus with `python -m packed_adamw.tokenizer.train_tokenizer`; `corpus.py`
names that corpus and `tape.py` turns documents into the finite token tapes that training
reads. The large one (`bpe-32768.json`) is trained on the training split of the large
corpus (`large_corpus.py`, docs/CORPUS.md) and is loaded with
`load_tokenizer(vocab_size=LARGE_VOCAB_SIZE)`.
"""

import hashlib
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

VOCAB_SIZE = 12095  # the default: the reference GPT, the demo and tapes use this one
LARGE_VOCAB_SIZE = 32768
EOT_TOKEN = "<|endoftext|>"

PACKAGE_DIR = Path(__file__).resolve().parent
TOKENIZER_ARTIFACT = PACKAGE_DIR / f"bpe-{VOCAB_SIZE}.json"

RETRAIN_HINT = "retrain it with `python -m packed_adamw.tokenizer.train_tokenizer`"
# How each committed artifact is retrained, by vocabulary size.
RETRAIN_HINTS = {
    VOCAB_SIZE: RETRAIN_HINT,
    LARGE_VOCAB_SIZE: "retrain it with "
    "`python -m packed_adamw.tokenizer.large_corpus train-tokenizer --cache CACHE`",
}


def tokenizer_artifact(vocab_size: int = VOCAB_SIZE) -> Path:
    """The committed tokenizer file with `vocab_size` entries."""
    if vocab_size not in RETRAIN_HINTS:
        raise ValueError(f"vocab_size={vocab_size}: the committed tokenizers have "
                         f"{' or '.join(map(str, RETRAIN_HINTS))} entries")
    return PACKAGE_DIR / f"bpe-{vocab_size}.json"


def load_tokenizer(path: str | os.PathLike | None = None, *, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Load a tokenizer file (default: the committed artifact of that size), checking it has
    exactly `vocab_size` entries (default VOCAB_SIZE) and the end-of-text token."""
    path = Path(path) if path is not None else tokenizer_artifact(vocab_size)
    retrain_hint = RETRAIN_HINTS.get(vocab_size, RETRAIN_HINT)
    tokenizer = Tokenizer.from_file(str(path))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(
            f"tokenizer {path} has {size} entries, expected exactly {vocab_size}; "
            f"use the committed artifact or {retrain_hint}"
        )
    if tokenizer.token_to_id(EOT_TOKEN) is None:
        raise ValueError(f"tokenizer {path} has no {EOT_TOKEN!r} token; {retrain_hint}")
    # A document that literally contains "<|endoftext|>" must encode as text, so that
    # encode/decode round-trips every string; only the tape builder inserts the real EOT id.
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenizer_sha256(path: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) of the tokenizer file's bytes (default: the committed artifact)."""
    path = Path(path) if path is not None else TOKENIZER_ARTIFACT
    return hashlib.sha256(path.read_bytes()).hexdigest()


def token_byte_counts(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id decodes to (int64 [vocabulary size]); special tokens count 0.

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
