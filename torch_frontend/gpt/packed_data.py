"""Packed-document batches from a token tape: rows of whole documents, each starting with BOS,
and the `cu_seqlens` that keep attention inside a document.

A tape (docs/TAPE.md) is documents each followed by the end-of-text token EOT. This module
uses **EOT as BOS**, as GPT-2-style tapes do: the token stream it reads is

    S = [EOT] + tape            S[k] = tape[k - 1] for k >= 1

so every document appears in S as `[EOT, its tokens...]`: its BOS is the EOT that ends the
document before it (the first document gets the EOT put in front of the tape). A *document
start* is a position k of S with S[k] == EOT.

Packing rule (`PACKING_RULE`, "bos-greedy-crop/1"), greedy in tape order:

- a row is the T + 1 consecutive tokens S[c : c + T + 1] from a document start c: the
  documents from c on, end to end, in tape order; the last one is cropped where the row ends
  (and a document longer than the row is its first T + 1 tokens);
- the next row starts at the first document start at or after c + T. S[c + T] is only the
  last row's last target, so a document starting exactly there is not lost; the rest of a
  cropped document is skipped (nanochat's BOS-aligned loaders also drop cropped tails; this
  rule keeps one integer of state instead of a buffer of documents);
- a step of `world_size` ranks x `batch_size` rows takes world_size * batch_size consecutive
  rows; rank r gets rows [r * B, (r + 1) * B): the rows a single process with batch W * B
  would get at that step, its r-th block. The cursor (the first row start of the next step)
  is therefore the same on every rank.

A batch is `PackedBatch(inputs, targets, cu_seqlens)`: inputs[i] = row[:-1],
targets[i] = row[1:] (int64, (B, T)), and `cu_seqlens` (int32) the document starts over the
flattened B * T inputs, from 0, ending with B * T: a row boundary is always a document
boundary (every row starts with BOS). `peek()` gives the next batch without consuming it, so
a checkpoint can store exactly the batch training will see next; `state_dict()` /
`load_state_dict()` save and restore the cursor exactly.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader

PACKING_RULE = "bos-greedy-crop/1"
_SCAN_CHUNK = 1 << 16  # tokens read at a time when looking for the next document start


class PackedBatch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64
    cu_seqlens: torch.Tensor  # (documents + 1,) int32, document starts over the flattened inputs, then B * T

    @property
    def max_seqlen(self) -> int:
        """The longest document piece of the batch (what varlen attention asks for)."""
        return int(torch.diff(self.cu_seqlens).max())


def cu_seqlens_of(inputs: torch.Tensor, bos: int) -> torch.Tensor:
    """Document starts of (B, T) inputs whose rows each start with `bos`, over the flattened
    inputs, then B * T (int32)."""
    rows, context = inputs.shape
    starts = (inputs == bos)
    starts[:, 0] = True  # a row start is a boundary even if its first token were not BOS
    flat = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([flat, torch.tensor([rows * context])]).to(torch.int32)


class PackedDocumentLoader:
    """Rank `rank` of `world_size`'s packed-document batches of `batch_size` rows of `context`
    tokens from `reader` (module docstring: the rule, BOS = EOT, sharding)."""

    def __init__(self, reader: TapeReader, batch_size: int, context: int, rank: int = 0, world_size: int = 1):
        if batch_size < 1 or context < 1:
            raise ValueError(f"PackedDocumentLoader: batch_size and context must be positive, got {batch_size} "
                             f"and {context}")
        if not 0 <= rank < world_size:
            raise ValueError(f"PackedDocumentLoader: rank {rank} is not one of world_size={world_size} ranks")
        self.reader, self.path = reader, reader.path
        self.batch_size, self.context, self.rank, self.world_size = batch_size, context, rank, world_size
        self.bos = int(reader.header.eot_token_id)
        self.stream_length = reader.num_tokens + 1  # S = [BOS] + tape
        self.cursor = 0  # S[0] is the BOS put before the first document
        self._peeked: tuple[int, PackedBatch, int] | None = None  # (cursor, batch, next cursor)

    # ---- the stream S ----------------------------------------------------------------------
    def _stream(self, start: int, stop: int) -> np.ndarray:
        """S[start:stop] as int64 (stop <= stream_length)."""
        tokens = np.asarray(self.reader.tokens[max(start - 1, 0):stop - 1], dtype=np.int64)
        return np.concatenate([[self.bos], tokens]) if start == 0 else tokens

    def _next_start(self, at: int) -> int:
        """The first document start k >= at, or stream_length when there is none."""
        position = at
        while position < self.stream_length:
            chunk = self._stream(position, min(position + _SCAN_CHUNK, self.stream_length))
            hits = np.flatnonzero(chunk == self.bos)
            if hits.size:
                return position + int(hits[0])
            position += len(chunk)
        return self.stream_length

    def _row_starts(self, cursor: int) -> tuple[list[int], int]:
        """The step's world_size * batch_size row starts from `cursor`, and the next cursor."""
        starts, position = [], cursor
        rows = self.world_size * self.batch_size
        for _ in range(rows):
            if position + self.context + 1 > self.stream_length:
                raise TapeExhausted(
                    f"{self.path}: {self.stream_length - position} tokens left at packed-stream position {position}, "
                    f"a row needs {self.context + 1} (a step: {self.world_size} ranks x {self.batch_size} rows); "
                    "build the tape with more --passes or train fewer steps")
            starts.append(position)
            position = self._next_start(position + self.context)
        return starts, position

    # ---- batches ---------------------------------------------------------------------------
    def peek(self) -> PackedBatch:
        """The next batch, not consumed: `next_batch()` returns these same tensors' values."""
        if self._peeked is None or self._peeked[0] != self.cursor:
            starts, following = self._row_starts(self.cursor)
            mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            rows = torch.from_numpy(np.stack([self._stream(c, c + self.context + 1) for c in mine]))
            inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            self._peeked = (self.cursor, PackedBatch(inputs, targets, cu_seqlens_of(inputs, self.bos)), following)
        _, batch, _ = self._peeked
        # Copies: a caller editing a peeked batch in place must not change what next_batch gives.
        return PackedBatch(*(t.clone() for t in batch))

    def next_batch(self) -> PackedBatch:
        batch = self.peek()
        self.cursor = self._peeked[2]
        return batch

    # ---- saving and restoring the cursor -----------------------------------------------------
    def state_dict(self) -> dict:
        return {"packing": PACKING_RULE, "cursor": self.cursor,
                "tape_header_sha256": self.reader.header.header_sha256, "path": str(self.path),
                "batch_size": self.batch_size, "context": self.context, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore a cursor saved by `state_dict` (of any rank: the cursor is every rank's)."""
        self.reader.load_state_dict({**state, "cursor": 0})  # checks the tape's identity
        expected = {"packing": PACKING_RULE, "batch_size": self.batch_size, "context": self.context,
                    "world_size": self.world_size}
        for key, ours in expected.items():
            if state.get(key) != ours:
                raise TapeError(f"packed cursor state of {self.path} has {key}={state.get(key)!r}, this loader has "
                                f"{ours!r}; resume with the packing, batch size, context and number of processes "
                                "the run started with")
        cursor = state["cursor"]
        valid = (isinstance(cursor, int) and not isinstance(cursor, bool) and 0 <= cursor <= self.stream_length
                 and (cursor == self.stream_length or self._next_start(cursor) == cursor))
        if not valid:
            raise TapeError(f"packed cursor {cursor!r} is not a document start of {self.path} "
                            f"({self.stream_length} stream tokens); the state is damaged or from another tape")
        self.cursor = cursor
