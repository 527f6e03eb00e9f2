"""Packed-document batches (torch_frontend/gpt/packed_data.py): both packing rules against
document-level statements of them, cu_seqlens, peek, exact position save/restore, sharding,
rule mismatch."""
import random

import numpy as np
import pytest
import torch

from packed_adamw.tokenizer.tape import TapeError, TapeExhausted, TapeReader, build_tape
from packed_adamw.torch.gpt.packed_data import (
    DEFAULT_PACKING, PACKING_CROP, PACKING_RULES, PACKING_SPLIT, PackedDocumentLoader, cu_seqlens_of,
)

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


def crop_reference_rows(documents, count: int, context: int) -> list[np.ndarray]:
    """The crop rule stated over documents: a row takes whole documents from document i on,
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


def split_reference_rows(documents, bos: int, context: int) -> tuple[list[np.ndarray], int]:
    """The split rule stated over documents: each document [BOS, tokens] is trained as the
    pairs (BOS, t1), (t1, t2), ..., (tn, the next document's BOS = its EOT); rows take the
    pairs in order, `context` at a time; a document whose pairs continue into a new row starts
    there as a new piece, BOS first. Returns the full rows and how many pieces got a BOS."""
    pairs = [(int(a), int(b)) for document, following in zip(documents, documents[1:] + [[bos]])
             for a, b in zip(document, np.concatenate([document[1:], following[:1]]))]
    rows, inserted = [], 0
    for k in range(len(pairs) // context):
        chunk = pairs[k * context:(k + 1) * context]
        inserted += chunk[0][0] != bos
        rows.append(np.array([bos] + [target for _, target in chunk]))
    return rows, inserted


def drain(loader) -> list:
    batches = []
    with pytest.raises(TapeExhausted, match="more --passes"):
        while True:
            batches.append(loader.next_batch())
    return batches


def full_rows(batches) -> np.ndarray:
    """Each row's T + 1 tokens, in order."""
    return torch.cat([torch.cat([b.inputs, b.targets[:, -1:]], dim=1) for b in batches]).numpy()


def test_crop_rows_follow_the_rule(reader):
    loader = PackedDocumentLoader(reader, B, T, packing=PACKING_CROP)
    batches = [loader.next_batch() for _ in range(4)]
    assert np.array_equal(full_rows(batches), np.stack(crop_reference_rows(tape_documents(reader), 4 * B, T)))


def test_split_rule_trains_every_token_once(reader):
    assert DEFAULT_PACKING == PACKING_SPLIT
    bos = reader.header.eot_token_id
    batches = drain(PackedDocumentLoader(reader, B, T))
    rows = full_rows(batches)
    expected, inserted = split_reference_rows(tape_documents(reader), bos, T)
    assert len(batches) == reader.num_tokens // (B * T)  # only the last partial step is left
    assert np.array_equal(rows, np.stack(expected[:len(rows)]))
    assert inserted > 0  # the tape has documents split across rows
    # The tape, rebuilt from the batches without each row's leading BOS (inserted or not: the
    # targets, T a row), is the tape itself up to the last partial step: every token once.
    tape = np.asarray(reader.tokens, dtype=np.int64)
    assert np.array_equal(rows[:, 1:].reshape(-1), tape[:rows.shape[0] * T])
    assert (rows[:, 0] == bos).all()
    for batch in batches:
        assert batch.inputs.dtype == batch.targets.dtype == torch.int64
        assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    # The crop rule, on the same tape, leaves tails out.
    assert len(drain(PackedDocumentLoader(reader, B, T, packing=PACKING_CROP))) < len(batches)


@pytest.mark.parametrize("packing", PACKING_RULES)
def test_cu_seqlens_mark_every_document_piece_and_row(reader, packing):
    bos = reader.header.eot_token_id
    loader = PackedDocumentLoader(reader, B, T, packing=packing)
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


def mid_document(reader, packing) -> PackedDocumentLoader:
    """A loader stepped to a position inside a document (offset > 0) for the split rule."""
    loader = PackedDocumentLoader(reader, B, T, packing=packing)
    loader.next_batch()
    while packing == PACKING_SPLIT and loader.offset == 0:
        loader.next_batch()
    return loader


@pytest.mark.parametrize("packing", PACKING_RULES)
def test_peek_does_not_consume(reader, packing):
    loader = mid_document(reader, packing)
    position = (loader.cursor, loader.offset)
    first, second = loader.peek(), loader.peek()
    first.inputs.zero_()  # a caller's edit of a peeked batch does not reach the loader
    assert (loader.cursor, loader.offset) == position
    taken = loader.next_batch()
    for a, b in zip(second, taken):
        assert torch.equal(a, b)
    assert (loader.cursor, loader.offset) != position


@pytest.mark.parametrize("packing", PACKING_RULES)
def test_position_saves_and_restores_exactly(reader, packing):
    loader = mid_document(reader, packing)
    state = loader.state_dict()
    assert state["packing"] == packing
    if packing == PACKING_SPLIT:
        assert state["offset"] > 0
    ahead = [loader.next_batch() for _ in range(3)]
    resumed = PackedDocumentLoader(reader, B, T, packing=packing)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.peek().inputs, ahead[0].inputs)
    for a, b in zip(ahead, (resumed.next_batch() for _ in range(3))):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert resumed.state_dict() == loader.state_dict()
    with pytest.raises(TapeError, match="batch_size=3"):
        PackedDocumentLoader(reader, B + 1, T, packing=packing).load_state_dict(state)
    with pytest.raises(TapeError, match="not a document start" if packing == PACKING_CROP else "is not a position"):
        PackedDocumentLoader(reader, B, T, packing=packing).load_state_dict({**state, "cursor": state["cursor"] + 1})


def test_split_position_must_be_inside_its_document(reader):
    loader = mid_document(reader, PACKING_SPLIT)
    state = loader.state_dict()
    fresh = PackedDocumentLoader(reader, B, T)
    for damaged in ({"offset": state["offset"] + 1},  # not where a step ends
                    {"cursor": 0, "offset": state["cursor"] + state["offset"]},  # past the cursor's document
                    {"offset": -1}, {"offset": True}):
        with pytest.raises(TapeError, match="offset"):
            fresh.load_state_dict({**state, **damaged})
    assert (fresh.cursor, fresh.offset) == (0, 0)  # a refused state leaves the loader as it was


def test_state_without_offset_is_refused(reader):
    """Every state names its rule and holds cursor and offset; one without an offset (the
    loader's first format, before the split rule) is refused, not read as offset 0."""
    for packing in PACKING_RULES:
        loader = PackedDocumentLoader(reader, B, T, packing=packing)
        loader.next_batch()
        state = loader.state_dict()
        del state["offset"]
        with pytest.raises(TapeError, match="holds no offset"):
            PackedDocumentLoader(reader, B, T, packing=packing).load_state_dict(state)


def test_another_rule_is_refused(reader):
    for saved, resumed in ((PACKING_SPLIT, PACKING_CROP), (PACKING_CROP, PACKING_SPLIT)):
        loader = PackedDocumentLoader(reader, B, T, packing=saved)
        loader.next_batch()
        with pytest.raises(TapeError, match=f"packing '{saved}'.*--packing"):
            PackedDocumentLoader(reader, B, T, packing=resumed).load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="packing='bos-greedy'.*bos-greedy-split/1"):
        PackedDocumentLoader(reader, B, T, packing="bos-greedy")


@pytest.mark.parametrize("packing", PACKING_RULES)
def test_ranks_share_the_single_process_rows(reader, packing):
    world = 2
    single = PackedDocumentLoader(reader, world * B, T, packing=packing)
    ranks = [PackedDocumentLoader(reader, B, T, rank=r, world_size=world, packing=packing) for r in range(world)]
    for _ in range(3):
        whole = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
        for part in parts:
            assert torch.equal(part.cu_seqlens, cu_seqlens_of(part.inputs, reader.header.eot_token_id))
        assert (ranks[0].cursor, ranks[0].offset) == (ranks[1].cursor, ranks[1].offset) == (single.cursor,
                                                                                            single.offset)
        assert ranks[1].state_dict() == ranks[0].state_dict()  # one position for every rank


def test_bad_arguments_say_so(reader):
    with pytest.raises(ValueError, match="rank 2"):
        PackedDocumentLoader(reader, B, T, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size and context"):
        PackedDocumentLoader(reader, 0, T)
