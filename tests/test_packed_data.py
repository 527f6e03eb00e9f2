"""Packed-document batches (torch_frontend/gpt/packed_data.py): the packing rule against a
document-level reference, cu_seqlens, peek, exact cursor save/restore, sharding."""
import random

import numpy as np
import pytest
import torch

from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader, build_tape
from packed_adamw.torch.gpt.packed_data import PackedDocumentLoader, cu_seqlens_of

WORDS = "the king and queen of a far country went over hills to see what lay beyond".split()
B, T = 3, 16


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """A tape of documents from 1 to 40 words: many shorter than a row, some longer."""
    rng = random.Random(0)
    documents = [(f"d{i}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))) for i in range(50)]
    path = tmp_path_factory.mktemp("packed") / "a.tape"
    build_tape(documents, path, passes=2)
    return TapeReader(path)


def tape_documents(reader) -> list[np.ndarray]:
    """The tape's documents, each as the loader sees it: [BOS = EOT, its tokens]."""
    tokens = np.asarray(reader.tokens, dtype=np.int64)
    eot = reader.header.eot_token_id
    ends = np.flatnonzero(tokens == eot)
    assert ends[-1] == len(tokens) - 1
    return [np.concatenate([[eot], piece[:-1]]) for piece in np.split(tokens, ends[:-1] + 1)]


def reference_rows(documents, count: int, context: int) -> list[np.ndarray]:
    """The packing rule stated over documents: a row takes whole documents from document i on,
    the last one cropped to fill context + 1 tokens; the next row starts with the document
    whose BOS is the row's last token, if one is, else with the one after the cropped one."""
    rows, i = [], 0
    for _ in range(count):
        row, j = [], i
        while sum(map(len, row)) < context + 1:
            row.append(documents[j])
            j += 1
        filled = np.concatenate(row)
        rows.append(filled[:context + 1])
        # j - 1 is the last document touched; it started at len(filled) - len(documents[j - 1])
        last_start = len(filled) - len(documents[j - 1])
        i = j - 1 if last_start == context else j
    return rows


def test_rows_follow_the_packing_rule(reader):
    loader = PackedDocumentLoader(reader, B, T)
    batches = [loader.next_batch() for _ in range(4)]
    expected = reference_rows(tape_documents(reader), 4 * B, T)
    got = torch.cat([torch.cat([b.inputs, b.targets[:, -1:]], dim=1) for b in batches])
    assert np.array_equal(got.numpy(), np.stack(expected))
    for batch in batches:
        assert batch.inputs.dtype == batch.targets.dtype == torch.int64
        assert batch.inputs.shape == batch.targets.shape == (B, T)
        assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
        assert (batch.inputs[:, 0] == reader.header.eot_token_id).all()  # every row starts with BOS


def test_cu_seqlens_mark_every_document_and_row(reader):
    bos = reader.header.eot_token_id
    loader = PackedDocumentLoader(reader, B, T)
    for _ in range(3):
        batch = loader.next_batch()
        cu = batch.cu_seqlens
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * T
        assert (torch.diff(cu) > 0).all()
        flat = batch.inputs.reshape(-1)
        starts = set(cu[:-1].tolist())
        assert {r * T for r in range(B)} <= starts  # row boundaries are document boundaries
        assert starts == set(torch.nonzero(flat == bos).reshape(-1).tolist())  # and only BOS starts one
        assert batch.max_seqlen == int(torch.diff(cu).max())
    # A row whose first token is not BOS still starts a sequence.
    assert cu_seqlens_of(torch.tensor([[5, 0, 6], [7, 8, 0]]), 0).tolist() == [0, 1, 3, 5, 6]


def test_peek_does_not_consume(reader):
    loader = PackedDocumentLoader(reader, B, T)
    loader.next_batch()
    cursor = loader.cursor
    first, second = loader.peek(), loader.peek()
    first.inputs.zero_()  # a caller's edit of a peeked batch does not reach the loader
    assert loader.cursor == cursor
    taken = loader.next_batch()
    for a, b in zip(second, taken):
        assert torch.equal(a, b)
    assert loader.cursor != cursor


def test_cursor_saves_and_restores_exactly(reader):
    loader = PackedDocumentLoader(reader, B, T)
    for _ in range(2):
        loader.next_batch()
    state = loader.state_dict()
    ahead = [loader.next_batch() for _ in range(3)]
    resumed = PackedDocumentLoader(reader, B, T)
    resumed.load_state_dict(state)
    for a, b in zip(ahead, (resumed.next_batch() for _ in range(3))):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    with pytest.raises(TapeError, match="batch_size=3"):
        PackedDocumentLoader(reader, B + 1, T).load_state_dict(state)
    with pytest.raises(TapeError, match="not a document start"):
        PackedDocumentLoader(reader, B, T).load_state_dict({**state, "cursor": state["cursor"] + 1})


def test_ranks_share_the_single_process_rows(reader):
    world = 2
    single = PackedDocumentLoader(reader, world * B, T)
    ranks = [PackedDocumentLoader(reader, B, T, rank=r, world_size=world) for r in range(world)]
    for _ in range(3):
        whole = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
        assert ranks[0].cursor == ranks[1].cursor == single.cursor
        assert ranks[1].state_dict() == ranks[0].state_dict()  # one cursor for every rank


def test_exhausted_tape_says_so(reader):
    loader = PackedDocumentLoader(reader, B, T)
    with pytest.raises(TapeExhausted, match="more --passes"):
        for _ in range(reader.num_tokens):
            loader.next_batch()
    with pytest.raises(ValueError, match="rank 2"):
        PackedDocumentLoader(reader, B, T, rank=2, world_size=2)
