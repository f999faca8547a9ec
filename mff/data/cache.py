"""Content-keyed cache folders written atomically.

An entry is a folder ``<root>/<key>/``. It is filled under a temporary name in the same
parent folder and renamed into place with `os.replace` only when complete, so readers see
either a whole entry or none; a failure removes the temporary folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import numpy as np


def cache_key(parts: Any) -> str:
    """SHA-1 hex digest of `parts` serialised as canonical JSON (sorted keys, no spaces)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha1(blob.encode("utf-8")).hexdigest()


def file_sha1(path: str, chunk: int = 1 << 20) -> str:
    """SHA-1 hex digest of a file's bytes."""
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(final: str) -> Iterator[str]:
    """Yield a fresh temporary folder that becomes `final` when the block exits cleanly.

    If the block raises, the temporary folder is deleted and the error propagates. If `final`
    already exists by then (another process finished first), the new copy is discarded and the
    existing one kept: entries of the same key hold the same content.
    """
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the entry is meant to be shared
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def save_npy(folder: str, name: str, array: np.ndarray) -> None:
    """Write `array` as ``folder/name`` (a .npy file) through a temp name and `os.replace`."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")  # per process: ranks may write the same entry at once
    with open(tmp, "wb") as fh:
        np.save(fh, array, allow_pickle=False)
    os.replace(tmp, os.path.join(folder, name))


def save_json(folder: str, name: str, obj: Any) -> None:
    """Write `obj` as indented JSON to ``folder/name`` through a temp name and `os.replace`."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(folder, name))
