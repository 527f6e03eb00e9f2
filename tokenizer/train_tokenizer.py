"""Retrain the committed tokenizer artifact from the embedded corpus, byte-for-byte.

    python -m packed_adamw.tokenizer.train_tokenizer            # rewrites the committed files
    python -m packed_adamw.tokenizer.train_tokenizer --out /tmp/bpe.json

Writes the tokenizer and, next to it, CORPUS_PROVENANCE.json (corpus files, hashes,
licenses, and the trainer settings and hash of the tokenizer they produced).
"""

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from packed_adamw.core.atomic_file import atomic_write

from . import EOT_TOKEN, TOKENIZER_ARTIFACT, VOCAB_SIZE
from .corpus import Document, corpus_provenance, default_corpus_documents

TRAINER_SETTINGS = {
    "model": "BPE",
    "pre_tokenizer": "ByteLevel(add_prefix_space=False)",
    "decoder": "ByteLevel",
    "vocab_size": VOCAB_SIZE,
    "min_frequency": 0,
    "special_tokens": [EOT_TOKEN],
    "initial_alphabet": "ByteLevel.alphabet() (all 256 bytes)",
}


def train_tokenizer(documents: Sequence[Document], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE tokenizer with `vocab_size` entries on the documents, in order."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=[EOT_TOKEN],
        # All 256 bytes, so any UTF-8 text encodes even if the corpus never shows a byte.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((text for _, text in documents), trainer=trainer)
    # The trainer silently stops early when the corpus runs out of merges.
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(
            f"training gave {size} entries instead of {vocab_size}: the corpus is too small"
        )
    return tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TOKENIZER_ARTIFACT,
                        help="tokenizer file to write (default: the committed artifact)")
    parser.add_argument("--provenance", type=Path, default=None,
                        help="provenance file to write (default: CORPUS_PROVENANCE.json next to --out)")
    args = parser.parse_args(argv)
    provenance_path = args.provenance or args.out.with_name("CORPUS_PROVENANCE.json")

    documents = default_corpus_documents()
    tokenizer_bytes = train_tokenizer(documents).to_str(pretty=True).encode("utf-8")
    provenance = corpus_provenance(documents)
    provenance["tokenizer"] = {
        "artifact": TOKENIZER_ARTIFACT.name,
        "sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
        "trained_with": f"tokenizers {tokenizers.__version__}",
        "trainer": TRAINER_SETTINGS,
        "training_documents": "all documents above, in the order listed",
        "retrain": "python -m packed_adamw.tokenizer.train_tokenizer",
    }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, tokenizer_bytes)
    atomic_write(provenance_path, (json.dumps(provenance, indent=2) + "\n").encode("utf-8"))
    print(f"wrote {args.out} ({VOCAB_SIZE} entries, sha256 {provenance['tokenizer']['sha256']})")
    print(f"wrote {provenance_path}")


if __name__ == "__main__":
    main()
