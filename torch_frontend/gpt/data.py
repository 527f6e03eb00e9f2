"""The run's tokens: the training and validation tapes of --data (docs/TAPE.md), and each
rank's share of the training tape under torchrun."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from packed_adamw.tokenizer import RETRAIN_HINTS, tokenizer_artifact, tokenizer_sha256
from packed_adamw.tokenizer.corpus import default_corpus_documents
from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader, build_split, read_header

from .config import TrainConfig
from .distributed import Ranks


def open_tapes(config: TrainConfig, ranks: Ranks | None = None) -> tuple[TapeReader, TapeReader]:
    """The training and validation tapes of --data, built from the embedded corpus when neither
    exists and --build-data is given. One tape without the other is refused, with or without
    --build-data: the two must be split from one corpus, so the missing one cannot be built
    alone, and building both would replace the user's file.

    The tapes may be of either committed tokenizer (12,095 entries, the default; 32,768, the
    large corpus's, docs/CORPUS.md): the training tape's header says which, the validation
    tape must have the same, and both must have been built with that tokenizer's file. The
    model takes its vocabulary from them (`TapeReader.header.vocab_size`)."""
    data = Path(config.data)
    train_path, val_path = data / "train.tape", data / "val.tape"
    main_rank = ranks is None or ranks.main
    present = [path for path in (train_path, val_path) if path.exists()]
    if ranks is not None:
        ranks.barrier()  # every rank has looked before one of them builds
    build_command = f"`python -m packed_adamw.tokenizer.tape build --out {data}`"
    if len(present) == 1:
        (kept,), missing = present, val_path if present == [train_path] else train_path
        raise TapeError(f"{missing} is missing ({data} holds {kept.name} alone); the tapes are split from one "
                        f"corpus, so neither is built without the other and {kept.name} is never replaced: build "
                        f"both from your corpus with {build_command} --text (or --parquet) FILES, or pass a --data "
                        "directory that holds both (or neither, with --build-data)")
    if not present:
        if not config.build_data:
            raise TapeError(f"no tapes in {data}: pass --build-data to build them from the embedded corpus, "
                            f"or build them with {build_command}")
        if main_rank:  # one rank builds them, the others wait below
            print(f"building {train_path} and {val_path} from the embedded corpus ...")
            build_split(default_corpus_documents(), data)
    if ranks is not None:
        ranks.barrier()
    vocab_size = read_header(train_path)[0].vocab_size
    if vocab_size not in RETRAIN_HINTS:
        raise TapeError(f"{train_path} was built with a {vocab_size}-token vocabulary; the trainer reads tapes of "
                        f"the committed tokenizers ({', '.join(f'{v:,}' for v in sorted(RETRAIN_HINTS))} entries): "
                        f"rebuild it with {build_command} --vocab-size N")
    sha = tokenizer_sha256(tokenizer_artifact(vocab_size))
    return (TapeReader(train_path, tokenizer_sha256=sha, vocab_size=vocab_size),
            TapeReader(val_path, tokenizer_sha256=sha, vocab_size=vocab_size))


class TapeShard:
    """Rank r of W reads windows r, r+W, r+2W, ... of the tape's consecutive B x T windows.

    Step s reads tokens [s*W*B*T, (s+1)*W*B*T + 1) of the tape: the tokens a single process
    with batch W*B reads at step s; rank r's share is their r-th B x T window. The cursor
    (saved per rank) is where this rank's next window starts, g + r*B*T for the run's
    position g; a step runs only while the last rank's window fits, so all ranks stop at
    the same step.
    """

    def __init__(self, reader: TapeReader, rank: int, world_size: int, batch_size: int, context: int):
        self.reader, self.rank, self.world_size = reader, rank, world_size
        self.shape = (batch_size, context)
        self.window = batch_size * context
        self.cursor = rank * self.window
        self.path = reader.path

    def _check(self, batch_size: int, context: int) -> None:
        if (batch_size, context) != self.shape:
            raise ValueError(f"this shard serves batches of {self.shape}, not {(batch_size, context)}")

    @property
    def position(self) -> int:
        return self.cursor - self.rank * self.window

    def remaining_batches(self, batch_size: int, context: int) -> int:
        """Steps left for the whole run (the same on every rank)."""
        self._check(batch_size, context)
        return max(0, (self.reader.num_tokens - 1 - self.position) // (self.world_size * self.window))

    def next_batch(self, batch_size: int, context: int) -> tuple[np.ndarray, np.ndarray]:
        if self.remaining_batches(batch_size, context) == 0:
            raise TapeExhausted(
                f"{self.path}: {self.reader.num_tokens - self.position} tokens left after position {self.position}, "
                f"a step of {self.world_size} ranks x {batch_size}x{context} needs "
                f"{self.world_size * self.window + 1}; "
                "build the tape with more --passes or train fewer steps")
        self.reader.cursor = self.cursor
        batch = self.reader.next_batch(batch_size, context)
        self.cursor += self.world_size * self.window
        return batch

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "tape_header_sha256": self.reader.header.header_sha256,
                "path": str(self.path), "rank": self.rank, "world_size": self.world_size,
                "window_tokens": self.window}

    def load_state_dict(self, state: dict) -> None:
        # The tape's identity, as TapeReader checks it (the cursor itself is checked below).
        self.reader.load_state_dict({**state, "cursor": 0})
        for key, ours in (("rank", self.rank), ("world_size", self.world_size), ("window_tokens", self.window)):
            if state.get(key) != ours:
                raise TapeError(f"cursor state of {self.path} has {key}={state.get(key)!r}, this rank has {ours}; "
                                "resume with the number of processes and batch size the run started with")
        cursor = state["cursor"]
        position = cursor - self.rank * self.window if isinstance(cursor, int) else -1
        if not (0 <= position <= self.reader.num_tokens and position % (self.world_size * self.window) == 0):
            raise TapeError(f"cursor {cursor!r} is not a window of rank {self.rank} of {self.world_size} "
                            f"in {self.path} ({self.reader.num_tokens} tokens)")
        self.cursor = cursor
