"""Finite token tapes: documents tokenized once, written as uint16 tokens behind a checked header.

    python -m packed_adamw.tokenizer.tape build --out runs/tape [--text F ...] [--parquet F ...]
        [--passes N] [--seed S] [--val-fraction F] [--tokenizer PATH]
    python -m packed_adamw.tokenizer.tape info runs/tape/train.tape

The byte layout is specified in docs/TAPE.md. A tape holds `passes` passes over its
documents, each document followed by the end-of-text token; the order of pass p is the
documents sorted by SHA-256 of (seed, p, document), so it depends only on the recorded
seed and the documents, not on library versions. `TapeReader` memory-maps a tape and serves
consecutive (input, target) windows from a cursor that saves and restores exactly.
"""

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import struct
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from packed_adamw.core.atomic_file import atomic_open

from . import EOT_TOKEN, RETRAIN_HINTS, VOCAB_SIZE, load_tokenizer, token_byte_counts, tokenizer_artifact
from . import tokenizer_sha256 as file_tokenizer_sha256
from .corpus import (
    CorpusError, CorpusNotInstalledError, Document, corpus_sha256, deduplicate_documents,
    default_corpus_documents, document_sha256, parquet_documents, text_file_documents,
)

MAGIC = b"PAWTAPE\x00"
FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")
# magic, format_version, payload_offset, vocab_size, eot_token_id, passes, split, val_fraction,
# seed, documents_per_pass, token_count, then four raw SHA-256 digests: tokenizer, corpus,
# payload, header.
FIXED_HEADER = struct.Struct("<8sIIIIIIdQQQ32s32s32s32s")
FIXED_HEADER_BYTES = 256  # FIXED_HEADER padded with zeros, room for later fields
HEADER_SHA256_OFFSET = FIXED_HEADER.size - 32
PAYLOAD_ALIGNMENT = 64
SPLITS = ("all", "train", "validation")
HASH_CHUNK_TOKENS = 1 << 22
REBUILD_HINT = "rebuild it with `python -m packed_adamw.tokenizer.tape build`"


class TapeError(ValueError):
    """A tape file that cannot be used: not a tape, truncated, corrupted or mismatched."""


class TapeExhausted(Exception):
    """Fewer tokens remain after the cursor than the requested batch needs."""


@dataclasses.dataclass(frozen=True)
class TapeHeader:
    format_version: int
    payload_offset: int
    vocab_size: int
    eot_token_id: int
    passes: int
    split: str  # "all" (build_tape), "train" or "validation" (build_split)
    val_fraction: float  # fraction of documents held out by build_split; 0.0 for "all"
    seed: int
    documents_per_pass: int
    token_count: int
    tokenizer_sha256: str
    corpus_sha256: str  # corpus_sha256() of the whole source corpus (before any split)
    payload_sha256: str
    header_sha256: str  # over the header region with this field zeroed; identifies the tape


def _payload_offset(vocab_size: int) -> int:
    table_end = FIXED_HEADER_BYTES + vocab_size * TOKEN_DTYPE.itemsize
    return -(-table_end // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def _header_region(header: TapeHeader, byte_counts: np.ndarray) -> bytes:
    """Fixed header, token byte-count table and padding, exactly as stored before the payload."""
    fixed = FIXED_HEADER.pack(
        MAGIC, header.format_version, header.payload_offset, header.vocab_size,
        header.eot_token_id, header.passes, SPLITS.index(header.split), header.val_fraction,
        header.seed, header.documents_per_pass, header.token_count,
        bytes.fromhex(header.tokenizer_sha256), bytes.fromhex(header.corpus_sha256),
        bytes.fromhex(header.payload_sha256), bytes.fromhex(header.header_sha256),
    )
    region = bytearray(header.payload_offset)
    region[: len(fixed)] = fixed
    table = byte_counts.astype(TOKEN_DTYPE).tobytes()
    region[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + len(table)] = table
    return bytes(region)


def _region_sha256(region: bytes) -> str:
    zeroed = bytearray(region)
    zeroed[HEADER_SHA256_OFFSET : HEADER_SHA256_OFFSET + 32] = bytes(32)
    return hashlib.sha256(zeroed).hexdigest()


def _ordering_key(*parts: object) -> bytes:
    return hashlib.sha256(":".join(map(str, parts)).encode("utf-8")).digest()


def _document_ids(documents: Sequence[Document]) -> list[str]:
    # The corpus_sha256 manifest line: a document is its name and its text.
    return [f"{document_sha256(text)}  {name}" for name, text in documents]


def _write_tape(
    documents: Sequence[Document], out_path: Path, *, tokenizer_path, passes: int, seed: int,
    split: str, val_fraction: float, source_corpus_sha256: str, vocab_size: int = VOCAB_SIZE,
) -> TapeHeader:
    if tokenizer_path is None:
        tokenizer_path = tokenizer_artifact(vocab_size)
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not any(text for _, text in documents):
        raise CorpusError(f"empty corpus: no text to write to {out_path}")

    tokenizer = load_tokenizer(tokenizer_path, vocab_size=vocab_size)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    # Tokenize each document once; every pass reuses these arrays in its own order.
    document_tokens = [
        np.append(np.asarray(encoding.ids, dtype=TOKEN_DTYPE), TOKEN_DTYPE.type(eot_id))
        for encoding in tokenizer.encode_batch([text for _, text in documents])
    ]
    document_ids = _document_ids(documents)
    pass_orders = [
        sorted(range(len(documents)), key=lambda i: (_ordering_key(seed, p, document_ids[i]), i))
        for p in range(passes)
    ]
    token_count = passes * sum(len(tokens) for tokens in document_tokens)

    payload_offset = _payload_offset(vocab_size)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # flush, fsync and rename, as for every file the project writes (core/atomic_file.py)
    with atomic_open(out_path, "wb") as tape_file:
        tape_file.seek(payload_offset)
        payload_hash = hashlib.sha256()
        for order in pass_orders:
            for i in order:
                payload_hash.update(document_tokens[i].data)
                tape_file.write(document_tokens[i].data)
        header = TapeHeader(
            format_version=FORMAT_VERSION, payload_offset=payload_offset,
            vocab_size=vocab_size, eot_token_id=eot_id, passes=passes, split=split,
            val_fraction=val_fraction, seed=seed, documents_per_pass=len(documents),
            token_count=token_count, tokenizer_sha256=file_tokenizer_sha256(tokenizer_path),
            corpus_sha256=source_corpus_sha256, payload_sha256=payload_hash.hexdigest(),
            header_sha256="00" * 32,
        )
        byte_counts = token_byte_counts(tokenizer)
        header = dataclasses.replace(
            header, header_sha256=_region_sha256(_header_region(header, byte_counts))
        )
        tape_file.seek(0)
        tape_file.write(_header_region(header, byte_counts))
    return header


def build_tape(
    documents: Sequence[Document], out_path: str | os.PathLike, *,
    tokenizer: str | os.PathLike | None = None, passes: int = 1, seed: int = 0,
    vocab_size: int = VOCAB_SIZE,
) -> TapeHeader:
    """Write all documents as one tape of `passes` seeded passes (atomically).

    `tokenizer` is a tokenizer file path (default: the committed artifact).
    """
    return _write_tape(
        documents, Path(out_path), tokenizer_path=tokenizer, passes=passes, seed=seed,
        split="all", val_fraction=0.0, source_corpus_sha256=corpus_sha256(documents),
        vocab_size=vocab_size,
    )


def split_documents(
    documents: Sequence[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document: the round(val_fraction * n) documents (at least one)
    with the smallest SHA-256 of their name and text are validation. Independent of the seed
    and of the input order."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(documents) < 2:
        raise CorpusError(f"need at least 2 documents for a train/validation split, got {len(documents)}")
    document_ids = _document_ids(documents)
    ranked = sorted(range(len(documents)), key=lambda i: (_ordering_key("validation", document_ids[i]), i))
    val_count = min(max(1, round(val_fraction * len(documents))), len(documents) - 1)
    val_indices = set(ranked[:val_count])
    train = [doc for i, doc in enumerate(documents) if i not in val_indices]
    val = [doc for i, doc in enumerate(documents) if i in val_indices]
    return train, val


def build_split(
    documents: Sequence[Document], out_dir: str | os.PathLike, *, val_fraction: float = 0.05,
    passes: int = 1, seed: int = 0, tokenizer: str | os.PathLike | None = None,
    vocab_size: int = VOCAB_SIZE,
) -> tuple[Path, Path]:
    """Write `out_dir/train.tape` (`passes` passes) and `out_dir/val.tape` (one pass).

    Documents whose text equals another's are dropped first (the smallest name of each
    group is kept; a UserWarning says how many), so no text is in both tapes. The recorded
    corpus hash is of the documents kept.
    """
    if not documents:
        raise CorpusError(f"empty corpus: no documents to write to {out_dir}")
    documents, duplicates = deduplicate_documents(documents)
    if duplicates:
        warnings.warn(f"dropped {len(duplicates)} duplicate documents (same text as another), "
                      f"e.g. {duplicates[0][0]} (same as {duplicates[0][1]})", stacklevel=2)
    train_docs, val_docs = split_documents(documents, val_fraction)
    source_hash = corpus_sha256(documents)
    out_dir = Path(out_dir)
    train_path, val_path = out_dir / "train.tape", out_dir / "val.tape"
    for docs, path, split, split_passes in (
        (train_docs, train_path, "train", passes), (val_docs, val_path, "validation", 1),
    ):
        _write_tape(
            docs, path, tokenizer_path=tokenizer, passes=split_passes, seed=seed, split=split,
            val_fraction=val_fraction, source_corpus_sha256=source_hash, vocab_size=vocab_size,
        )
    return train_path, val_path


def read_header(path: str | os.PathLike) -> tuple[TapeHeader, np.ndarray]:
    """Parse and check a tape's header region; returns the header and token byte counts."""
    path = Path(path)
    if not path.is_file():
        raise TapeError(f"{path} is a directory, not a tape" if path.is_dir() else f"{path}: no such tape file")
    file_size = path.stat().st_size
    with open(path, "rb") as tape_file:
        fixed = tape_file.read(FIXED_HEADER_BYTES)
        if len(fixed) < FIXED_HEADER_BYTES or fixed[:8] != MAGIC:
            raise TapeError(f"{path} is not a token tape (bad magic or too short); {REBUILD_HINT}")
        fields = FIXED_HEADER.unpack_from(fixed)
        if fields[1] != FORMAT_VERSION:
            raise TapeError(
                f"{path} has tape format version {fields[1]}, this reader reads {FORMAT_VERSION}; "
                f"{REBUILD_HINT}"
            )
        payload_offset, vocab_size = fields[2], fields[3]
        if payload_offset != _payload_offset(vocab_size) or payload_offset > file_size:
            raise TapeError(f"{path} has a corrupted or truncated header; {REBUILD_HINT}")
        region = fixed + tape_file.read(payload_offset - FIXED_HEADER_BYTES)
    header_hash = region[HEADER_SHA256_OFFSET : HEADER_SHA256_OFFSET + 32].hex()
    if _region_sha256(region) != header_hash or fields[6] >= len(SPLITS):
        raise TapeError(f"{path} has a corrupted header (checksum mismatch); {REBUILD_HINT}")
    header = TapeHeader(
        format_version=fields[1], payload_offset=payload_offset, vocab_size=vocab_size,
        eot_token_id=fields[4], passes=fields[5], split=SPLITS[fields[6]],
        val_fraction=fields[7], seed=fields[8], documents_per_pass=fields[9],
        token_count=fields[10], tokenizer_sha256=fields[11].hex(), corpus_sha256=fields[12].hex(),
        payload_sha256=fields[13].hex(), header_sha256=header_hash,
    )
    byte_counts = np.frombuffer(
        region, dtype=TOKEN_DTYPE, count=vocab_size, offset=FIXED_HEADER_BYTES
    ).astype(np.int64)
    return header, byte_counts


class TapeReader:
    """Memory-mapped tape with a cursor serving consecutive (input, target) windows.

    On open it checks the header checksum, the file size, the vocabulary size, the
    tokenizer hash (when `tokenizer_sha256` is given) and, unless `verify_payload=False`,
    the SHA-256 of all tokens (one sequential read: about 0.1 s per 100 MB).
    """

    def __init__(
        self, path: str | os.PathLike, *, tokenizer_sha256: str | None = None,
        verify_payload: bool = True, vocab_size: int = VOCAB_SIZE,
    ):
        self.path = Path(path)
        self.header, self.token_byte_counts = read_header(self.path)
        header = self.header
        expected_size = header.payload_offset + header.token_count * TOKEN_DTYPE.itemsize
        actual_size = self.path.stat().st_size
        if actual_size != expected_size:
            raise TapeError(
                f"{self.path} is {actual_size} bytes but its header says {expected_size} "
                f"({header.token_count} tokens): the file is truncated or damaged; {REBUILD_HINT}"
            )
        if header.vocab_size != vocab_size:
            raise TapeError(
                f"{self.path} was built with a {header.vocab_size}-token vocabulary, this project "
                f"uses {vocab_size}; {REBUILD_HINT}"
            )
        if tokenizer_sha256 is not None and header.tokenizer_sha256 != tokenizer_sha256:
            raise TapeError(
                f"{self.path} was built with another tokenizer (sha256 {header.tokenizer_sha256}, "
                f"expected {tokenizer_sha256}); {REBUILD_HINT} using the same tokenizer"
            )
        self.tokens = np.memmap(
            self.path, dtype=TOKEN_DTYPE, mode="r", offset=header.payload_offset,
            shape=(header.token_count,),
        )
        if verify_payload:
            self._verify_payload()
        self.num_tokens = header.token_count
        self.cursor = 0

    def _verify_payload(self) -> None:
        payload_hash = hashlib.sha256()
        for start in range(0, len(self.tokens), HASH_CHUNK_TOKENS):
            payload_hash.update(self.tokens[start : start + HASH_CHUNK_TOKENS].tobytes())
        if payload_hash.hexdigest() != self.header.payload_sha256:
            raise TapeError(f"{self.path} has corrupted tokens (payload checksum mismatch); {REBUILD_HINT}")

    def _batch_at(self, start: int, batch_size: int, context: int) -> tuple[np.ndarray, np.ndarray]:
        window = np.asarray(self.tokens[start : start + batch_size * context + 1], dtype=np.int64)
        return window[:-1].reshape(batch_size, context), window[1:].reshape(batch_size, context)

    def remaining_batches(self, batch_size: int, context: int) -> int:
        """Full batches left after the cursor (each needs batch_size*context + 1 tokens)."""
        _check_shape(batch_size, context)
        return max(0, (self.num_tokens - 1 - self.cursor) // (batch_size * context))

    def next_batch(self, batch_size: int, context: int) -> tuple[np.ndarray, np.ndarray]:
        """Consecutive windows from the cursor: x[i] = tokens[c+i*T : c+(i+1)*T], y = x shifted by one."""
        if self.remaining_batches(batch_size, context) == 0:
            raise TapeExhausted(
                f"{self.path}: {self.num_tokens - self.cursor} tokens left after cursor "
                f"{self.cursor}, a batch of {batch_size}x{context} needs "
                f"{batch_size * context + 1}; build the tape with more --passes or train fewer steps"
            )
        batch = self._batch_at(self.cursor, batch_size, context)
        self.cursor += batch_size * context
        return batch

    def iter_eval_batches(self, batch_size: int, context: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every full batch of the tape from its start; the cursor is left alone."""
        _check_shape(batch_size, context)
        batch_tokens = batch_size * context
        for index in range((self.num_tokens - 1) // batch_tokens):
            yield self._batch_at(index * batch_tokens, batch_size, context)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "tape_header_sha256": self.header.header_sha256, "path": str(self.path)}

    def load_state_dict(self, state: dict) -> None:
        if state["tape_header_sha256"] != self.header.header_sha256:
            raise TapeError(
                f"cursor state belongs to tape {state.get('path')} (header sha256 "
                f"{state['tape_header_sha256']}), not to {self.path} "
                f"({self.header.header_sha256}); resume with the tape the run started on"
            )
        cursor = state["cursor"]
        if not (isinstance(cursor, int) and 0 <= cursor <= self.num_tokens):
            raise TapeError(f"cursor {cursor!r} is outside {self.path} ({self.num_tokens} tokens)")
        self.cursor = cursor


def _check_shape(batch_size: int, context: int) -> None:
    if batch_size < 1 or context < 1:
        raise ValueError(f"batch_size and context must be positive, got {batch_size} and {context}")


def _input_files(option: str, arguments: Sequence[str], suffix: str) -> list[str]:
    """Files named on the command line: files, directories (their `*suffix` files) or quoted globs.

    Raises CorpusError naming the argument that yields no file.
    """
    files = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            found = sorted(str(f) for f in path.iterdir() if f.name.endswith(suffix) and f.is_file())
            if not found:
                raise CorpusError(f"{option} {argument}: the directory holds no *{suffix} files")
        elif path.exists():
            found = [argument]
        elif any(c in argument for c in "*?["):
            found = sorted(glob.glob(argument))
            if not found:
                raise CorpusError(f"{option} {argument}: the pattern matches no file")
        else:
            raise CorpusError(f"{option} {argument}: no such file")
        files += found
    return files


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m packed_adamw.tokenizer.tape",
                                     description="Build or inspect token tapes.")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write DIR/train.tape and DIR/val.tape")
    build.add_argument("--out", type=Path, required=True, help="output directory")
    build.add_argument("--text", nargs="+", default=[], metavar="FILE",
                       help="UTF-8 text files, one document each (a directory: its *.txt files; "
                            "a quoted glob is expanded)")
    build.add_argument("--parquet", nargs="+", default=[], metavar="FILE",
                       help="parquet shards with a string `text` column, one document per row "
                            "(a directory: its *.parquet files; a quoted glob is expanded)")
    build.add_argument("--passes", type=int, default=1, help="passes over the training documents")
    build.add_argument("--seed", type=int, default=0, help="seed of each pass's document order")
    build.add_argument("--val-fraction", type=float, default=0.05,
                       help="fraction of documents held out for validation (one pass)")
    build.add_argument("--tokenizer", type=Path, default=None,
                       help="tokenizer file (default: the committed artifact of --vocab-size)")
    build.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, choices=sorted(RETRAIN_HINTS),
                       help=f"entries of the tokenizer (default {VOCAB_SIZE})")
    info = commands.add_parser("info", help="print a tape's header as JSON and verify the file")
    info.add_argument("tape", type=Path)
    args = parser.parse_args(argv)

    def fail(message: str):
        """One line on stderr, exit code 2, no traceback: the message names the file."""
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    if args.command == "info":
        try:
            header, _ = read_header(args.tape)
        except (TapeError, OSError) as error:
            fail(str(error))
        print(json.dumps(dataclasses.asdict(header), indent=2))
        try:  # the size, vocabulary and payload checksum, as a reader checks them
            TapeReader(args.tape, vocab_size=header.vocab_size)
        except (TapeError, OSError) as error:
            fail(f"{error} (the header above is intact; the tape is not usable)")
        print(f"{args.tape}: size and payload checksum verified", file=sys.stderr)
        return

    if args.passes < 1:
        parser.error(f"--passes {args.passes}: must be at least 1")
    if not 0 <= args.seed < 2**64:
        parser.error(f"--seed {args.seed}: must be in [0, 2**64)")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction {args.val_fraction}: must be in (0, 1)")
    if args.tokenizer is not None:
        if not args.tokenizer.is_file():
            parser.error(f"--tokenizer {args.tokenizer}: no such file")
        try:
            load_tokenizer(args.tokenizer, vocab_size=args.vocab_size)
        except Exception as error:  # the tokenizers library raises plain Exception for a bad file
            fail(f"--tokenizer {args.tokenizer}: {error}")
    try:
        if args.text or args.parquet:
            documents = []
            if args.text:
                documents += text_file_documents(_input_files("--text", args.text, ".txt"))
            if args.parquet:
                documents += parquet_documents(_input_files("--parquet", args.parquet, ".parquet"))
        else:
            documents = default_corpus_documents()
        documents, duplicates = deduplicate_documents(documents)
        if duplicates:
            examples = ", ".join(f"{dropped} (same as {kept})" for dropped, kept in duplicates[:3])
            print(f"dropped {len(duplicates)} duplicate documents (same text as another): {examples}"
                  f"{', ...' if len(duplicates) > 3 else ''}")
        paths = build_split(
            documents, args.out, val_fraction=args.val_fraction, passes=args.passes,
            seed=args.seed, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        )
    except (CorpusError, CorpusNotInstalledError, TapeError) as error:
        fail(str(error))
    for path in paths:
        header, _ = read_header(path)
        print(f"wrote {path}: {header.token_count} tokens, {header.documents_per_pass} documents "
              f"x {header.passes} passes ({header.split})")


if __name__ == "__main__":
    main()
