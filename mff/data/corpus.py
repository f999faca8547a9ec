"""Finding corpus files, reading them into documents, and the stable train/validation split.

A document has a *key*: the POSIX path of its file relative to the folder it was found in (or
the file name for a file named directly), plus ``":<line>"`` for a .jsonl line. The key alone
decides the split, so a document stays in its split however the corpus is moved or extended.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Sequence

from mff.paths import file_kind

EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages"})
"""Path components that exclude a file from the default (standard library) corpus."""


@dataclass(frozen=True)
class SourceFile:
    """One input file.

    Attributes:
        path: absolute path on disk.
        rel: key prefix, the POSIX path relative to the folder it was found in (or the name).
        kind: ``"text"`` (the whole file is one document) or ``"jsonl"`` (one per line).
        size: size in bytes.
        mtime_ns: modification time in nanoseconds.
    """

    path: str
    rel: str
    kind: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Document:
    """One document: its split key and its text (a non-empty str)."""

    key: str
    text: str


def stdlib_root() -> str:
    """The standard library folder of the running interpreter (``sysconfig`` "stdlib")."""
    return os.path.abspath(sysconfig.get_paths()["stdlib"])


def _source(path: str, rel: str, kind: str) -> SourceFile:
    st = os.stat(path)
    return SourceFile(path=path, rel=rel, kind=kind, size=st.st_size, mtime_ns=st.st_mtime_ns)


def _walk(root: str, suffixes: dict[str, str], exclude: frozenset[str]) -> list[SourceFile]:
    """Files under `root` whose suffix is a key of `suffixes`, sorted by relative path."""
    found: list[SourceFile] = []

    def unreadable(err: OSError) -> None:
        raise OSError(err.errno, f"data: cannot read corpus folder {err.filename!r}: {err.strerror}") from None

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = [d for d in dirnames if d not in exclude]
        for name in filenames:
            kind = suffixes.get(os.path.splitext(name)[1].lower())
            if kind is None:
                continue
            full = os.path.join(dirpath, name)
            rel = Path(os.path.relpath(full, root)).as_posix()
            if exclude and any(part in exclude for part in PurePosixPath(rel).parts):
                continue
            found.append(_source(full, rel, kind))
    found.sort(key=lambda f: f.rel)
    return found


def discover_files(paths: Sequence[str]) -> tuple[list[SourceFile], list[str]]:
    """List the corpus files for ``DataConfig.path``.

    Args:
        paths: .txt / .jsonl files or folders; empty means the default corpus, the ``.py``
            files under `stdlib_root()` (any path with a ``site-packages`` or
            ``dist-packages`` component excluded), each one document.

    Returns:
        ``(files, roots)``: the files sorted by relative path (ties kept in argument order),
        and the absolute roots they were found under (the folders, or the named files).

    Raises:
        FileNotFoundError: a path does not exist (the message names it).
        ValueError: a named file is neither .txt nor .jsonl.
    """
    if not paths:
        root = stdlib_root()
        return _walk(root, {".py": "text"}, EXCLUDED_DIR_NAMES), [root]
    suffixes = {".txt": "text", ".jsonl": "jsonl"}
    files: list[tuple[str, int, SourceFile]] = []
    roots: list[str] = []
    for index, raw in enumerate(paths):
        path = os.path.abspath(os.path.expanduser(raw))
        roots.append(path)
        if os.path.isdir(path):
            files.extend((f.rel, index, f) for f in _walk(path, suffixes, frozenset()))
        elif os.path.isfile(path):
            kind = suffixes.get(os.path.splitext(path)[1].lower())
            if kind is None:
                raise ValueError(f"data: unsupported corpus file {raw!r}: expected .txt or .jsonl")
            files.append((os.path.basename(path), index, _source(path, os.path.basename(path), kind)))
        elif os.path.exists(path):
            raise ValueError(f"data: corpus path {raw!r} is {file_kind(path)}; expected a .txt or .jsonl file or a folder of them")
        else:
            raise FileNotFoundError(f"data: corpus path not found: {raw!r}")
    files.sort(key=lambda t: (t[0], t[1]))
    return [f for _, _, f in files], roots


def read_documents(files: Sequence[SourceFile], text_field: str = "text") -> tuple[list[Document], int]:
    """Read the documents of `files`, in file order then line order.

    A file that is not valid UTF-8 is skipped and counted. Documents that are empty or only
    white space (and blank .jsonl lines) are dropped; kept documents keep their white space.

    Returns:
        ``(documents, skipped_non_utf8)``.

    Raises:
        ValueError: a .jsonl line is not a JSON object with a string `text_field`; the message
            names the file and the 1-based line number.
    """
    docs: list[Document] = []
    skipped = 0
    for f in files:
        with open(f.path, "rb") as fh:
            raw = fh.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if f.kind == "text":
            if text.strip():
                docs.append(Document(f.rel, text))
            continue
        # Split on "\n" only: str.splitlines would also break at U+2028 inside JSON strings.
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data: {f.path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"data: {f.path}:{lineno}: no {text_field!r} field in the JSON record")
            value = record[text_field]
            if not isinstance(value, str):
                raise ValueError(
                    f"data: {f.path}:{lineno}: field {text_field!r} is {type(value).__name__}, not a string"
                )
            if value.strip():
                docs.append(Document(f"{f.rel}:{lineno}", value))
    return docs, skipped


def is_validation(key: str, val_permille: int) -> bool:
    """Whether the document with this key belongs to the validation split.

    True when ``int.from_bytes(sha1(key.encode("utf-8")).digest()[:8], "big") % 1000 <
    val_permille``: stable across processes, machines and ``PYTHONHASHSEED``.
    """
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < val_permille


def split_documents(docs: Sequence[Document], val_permille: int) -> tuple[list[Document], list[Document]]:
    """Split documents into ``(train, val)`` by `is_validation`, keeping their order.

    Fallbacks keep both splits non-empty: an empty validation split takes the last document
    from training; a validation split holding every document gives the first one back.

    Raises:
        ValueError: `val_permille` is outside 0..1000; no documents ("empty corpus"); only
            one document (a document-level split needs two).
    """
    if not 0 <= val_permille <= 1000:
        raise ValueError(f"data: val_permille must be in 0..1000, got {val_permille}")
    if not docs:
        raise ValueError("data: empty corpus: no non-empty documents were found")
    if len(docs) == 1:
        raise ValueError(
            f"data: the corpus has a single document ({docs[0].key!r}); the train/validation "
            "split is by document and needs at least two"
        )
    flags = [is_validation(d.key, val_permille) for d in docs]
    if not any(flags):
        flags[-1] = True
    elif all(flags):
        flags[0] = False
    train = [d for d, v in zip(docs, flags) if not v]
    val = [d for d, v in zip(docs, flags) if v]
    return train, val
