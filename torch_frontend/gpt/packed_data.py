"""Packed-document batches from a token tape: rows of documents, each starting with BOS, and
the `cu_seqlens` that keep attention inside a document.

A tape (docs/TAPE.md) is documents each followed by the end-of-text token EOT. This module
uses **EOT as BOS**, as GPT-2-style tapes do: the token stream it reads is

    S = [EOT] + tape            S[k] = tape[k - 1] for k >= 1

so every document appears in S as `[EOT, its tokens...]`: its BOS is the EOT that ends the
document before it (the first document gets the EOT put in front of the tape). A *document
start* is a position k of S with S[k] == EOT.

A row is T + 1 tokens x_0 .. x_T with x_0 = BOS; it gives inputs x_0 .. x_{T-1} and targets
x_1 .. x_T. Two packing rules (`packing=`, one of `PACKING_RULES`), both greedy in tape order:

**"bos-greedy-split/1"** (`PACKING_SPLIT`, the default): rows fill with the stream without gaps,
and a document that does not fit in the rest of a row continues at the start of the next row
as a new piece with a BOS inserted before it. Row k of the pass is

    [BOS] + S[k*T + 1 : (k + 1)*T + 1]

so the targets of consecutive rows are the tape itself, T tokens at a time: **every token of the
tape is a target exactly once per pass**, and nothing is cropped. When S[k*T] is a document
start the row is S[k*T : (k+1)*T + 1], a whole-document start; otherwise S[k*T], the previous
row's last target, is replaced as an input by the inserted BOS. **The model sees a continuation
as a new document**: attention (cu_seqlens) does not reach the piece before it, and its first
target is predicted from BOS alone. (A continuation can be a single token: the EOT that ends a
document whose last content token was the previous row's last target.) The only tokens left
untrained are the pass's last partial step, fewer than world_size * batch_size * T.

**"bos-greedy-crop/1"** (`PACKING_CROP`, the rule before this one): a row is S[c : c + T + 1]
from a document start c, the documents from c on end to end, the last one cropped where the
row ends (a document longer than the row is its first T + 1 tokens); the next row starts at the
first document start at or after c + T (S[c + T] is only the row's last target, so a document
starting exactly there is not lost). The rest of a cropped document is never trained on
(nanochat's BOS-aligned loaders also drop cropped tails).

How much of a tape a pass trains, measured on the large corpus's train.tape (docs/CORPUS.md:
25,449,244 tokens, 6,103 documents, mean 4,170 tokens, median 1,021; 86% of the tokens are in
documents longer than 2,048) with steps of 32 rows x 2,048: the split rule gives 388 steps
(25,427,968 targets, 99.9% of the tape), the crop rule 84 steps (5,505,024 targets, 21.6%).

A step of `world_size` ranks x `batch_size` rows takes world_size * batch_size consecutive
rows; rank r gets rows [r * B, (r + 1) * B): the rows a single process with batch W * B would
get at that step, its r-th block, under either rule. The loader's position (where the step's
first row starts) is therefore the same on every rank; it is kept as `cursor`, a document start,
and `offset`, the tokens into that document where the next row begins (always 0 under the crop
rule).

A batch is `PackedBatch(inputs, targets, cu_seqlens)`: inputs[i] = row[:-1],
targets[i] = row[1:] (int64, (B, T)), and `cu_seqlens` (int32) the document (or piece) starts
over the flattened B * T inputs, from 0, ending with B * T: a row boundary is always a document
boundary (every row starts with BOS). `peek()` gives the next batch without consuming it, so a
checkpoint can store exactly the batch training will see next; `state_dict()` /
`load_state_dict()` save and restore the position exactly, with the rule's name: a state is
refused by a loader of another rule.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader

PACKING_SPLIT = "bos-greedy-split/1"
PACKING_CROP = "bos-greedy-crop/1"
PACKING_RULES = (PACKING_SPLIT, PACKING_CROP)
DEFAULT_PACKING = PACKING_SPLIT
_SCAN_CHUNK = 1 << 16  # tokens read at a time when looking for a document start


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
    tokens from `reader`, packed by the rule `packing` (module docstring: the rules, BOS = EOT,
    sharding)."""

    def __init__(self, reader: TapeReader, batch_size: int, context: int, rank: int = 0, world_size: int = 1,
                 packing: str = DEFAULT_PACKING):
        if batch_size < 1 or context < 1:
            raise ValueError(f"PackedDocumentLoader: batch_size and context must be positive, got {batch_size} "
                             f"and {context}")
        if not 0 <= rank < world_size:
            raise ValueError(f"PackedDocumentLoader: rank {rank} is not one of world_size={world_size} ranks")
        if packing not in PACKING_RULES:
            raise ValueError(f"PackedDocumentLoader: packing={packing!r} is not a packing rule; pick one of "
                             f"{', '.join(PACKING_RULES)}")
        self.reader, self.path = reader, reader.path
        self.batch_size, self.context, self.rank, self.world_size = batch_size, context, rank, world_size
        self.packing = packing
        self.bos = int(reader.header.eot_token_id)
        self.stream_length = reader.num_tokens + 1  # S = [BOS] + tape
        # The next row starts at S[cursor + offset]; cursor is a document start (S[0] is the BOS
        # put before the first document).
        self.cursor, self.offset = 0, 0
        # ((cursor, offset), batch, (next cursor, next offset)) of the last peek
        self._peeked: tuple[tuple[int, int], PackedBatch, tuple[int, int]] | None = None

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

    def _start_of_document_at(self, at: int) -> int:
        """The last document start k <= at (at < stream_length; S[0] is one)."""
        stop = at + 1
        while stop > 0:
            start = max(stop - _SCAN_CHUNK, 0)
            hits = np.flatnonzero(self._stream(start, stop) == self.bos)
            if hits.size:
                return start + int(hits[-1])
            stop = start
        raise AssertionError("S[0] is BOS")

    # ---- the rows of a step ----------------------------------------------------------------
    def _exhausted(self, position: int, needed: int) -> TapeExhausted:
        return TapeExhausted(
            f"{self.path}: {self.stream_length - position} tokens left at packed-stream position {position}, "
            f"{needed} needed (a step: {self.world_size} ranks x {self.batch_size} rows of {self.context + 1} "
            f"tokens, packing {self.packing}); build the tape with more --passes or train fewer steps")

    def _crop_rows(self, cursor: int) -> tuple[np.ndarray, tuple[int, int]]:
        """This rank's rows of the step from `cursor` under the crop rule, and the next position."""
        starts, position = [], cursor
        for _ in range(self.world_size * self.batch_size):
            if position + self.context + 1 > self.stream_length:
                raise self._exhausted(position, self.context + 1)
            starts.append(position)
            position = self._next_start(position + self.context)
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        return np.stack([self._stream(c, c + self.context + 1) for c in mine]), (position, 0)

    def _split_rows(self, position: int) -> tuple[np.ndarray, tuple[int, int]]:
        """This rank's rows of the step from S[position] under the split rule, and the next position."""
        step_tokens = self.world_size * self.batch_size * self.context
        if position + step_tokens + 1 > self.stream_length:
            raise self._exhausted(position, step_tokens + 1)
        first = position + self.rank * self.batch_size * self.context
        block = self._stream(first, first + self.batch_size * self.context + 1)
        rows = np.stack([block[i * self.context:(i + 1) * self.context + 1] for i in range(self.batch_size)])
        rows[:, 0] = self.bos  # a row starting mid-document: its continuation piece gets a BOS
        following = position + step_tokens
        start = self._start_of_document_at(following)
        return rows, (start, following - start)

    # ---- batches ---------------------------------------------------------------------------
    def peek(self) -> PackedBatch:
        """The next batch, not consumed: `next_batch()` returns these same tensors' values."""
        here = (self.cursor, self.offset)
        if self._peeked is None or self._peeked[0] != here:
            if self.packing == PACKING_CROP:
                rows, following = self._crop_rows(self.cursor)
            else:
                rows, following = self._split_rows(self.cursor + self.offset)
            rows = torch.from_numpy(rows)
            inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            self._peeked = (here, PackedBatch(inputs, targets, cu_seqlens_of(inputs, self.bos)), following)
        _, batch, _ = self._peeked
        # Copies: a caller editing a peeked batch in place must not change what next_batch gives.
        return PackedBatch(*(t.clone() for t in batch))

    def next_batch(self) -> PackedBatch:
        batch = self.peek()
        self.cursor, self.offset = self._peeked[2]
        return batch

    # ---- saving and restoring the position ---------------------------------------------------
    def state_dict(self) -> dict:
        return {"packing": self.packing, "cursor": self.cursor, "offset": self.offset,
                "tape_header_sha256": self.reader.header.header_sha256, "path": str(self.path),
                "batch_size": self.batch_size, "context": self.context, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict` (of any rank: the position is every rank's).
        A state of another packing rule is refused (it names the rule to resume with)."""
        self.reader.load_state_dict({**state, "cursor": 0})  # checks the tape's identity
        if state.get("packing") != self.packing:
            raise TapeError(f"packed loader state of {self.path} was written under packing {state.get('packing')!r}, "
                            f"this loader packs {self.packing!r}; resume with the rule the run started with "
                            f"(PackedDocumentLoader(packing=...), chat_train --packing)")
        expected = {"batch_size": self.batch_size, "context": self.context, "world_size": self.world_size}
        for key, ours in expected.items():
            if state.get(key) != ours:
                raise TapeError(f"packed loader state of {self.path} has {key}={state.get(key)!r}, this loader has "
                                f"{ours!r}; resume with the batch size, context and number of processes the run "
                                "started with")
        missing = [key for key in ("cursor", "offset") if key not in state]
        if missing:
            # The loader's first format (a366ee4, on main for half an hour before the split rule)
            # held no offset; its states also carry that code's identity, which load_state refuses.
            raise TapeError(f"packed loader state of {self.path} holds no {' and no '.join(missing)}: it is of the "
                            "loader's first format (before the split rule) or damaged; start the run anew")
        cursor, offset = state["cursor"], state["offset"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (cursor, offset)):
            raise TapeError(f"packed loader state of {self.path}: cursor {cursor!r} and offset {offset!r} must be "
                            "integers >= 0; the state is damaged")
        if self.packing == PACKING_CROP:
            valid = offset == 0 and cursor <= self.stream_length and (
                cursor == self.stream_length or self._next_start(cursor) == cursor)
            where = "a document start"
        else:
            position = cursor + offset
            step_tokens = self.world_size * self.batch_size * self.context
            valid = (position < self.stream_length and position % step_tokens == 0
                     and self._start_of_document_at(position) == cursor)
            where = (f"a position inside the document starting at the cursor, a multiple of a step's "
                     f"{step_tokens} tokens")
        if not valid:
            raise TapeError(f"packed cursor {cursor!r} + offset {offset!r} is not {where} of {self.path} "
                            f"({self.stream_length} stream tokens); the state is damaged or from another tape")
        self.cursor, self.offset = cursor, offset
