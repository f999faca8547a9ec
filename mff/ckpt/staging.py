"""Folders written whole or not at all: built under a temp name beside the target, renamed into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["staged_folder"]


@contextmanager
def staged_folder(out: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp folder ``.tmp-<name>-<pid>`` beside ``out``; when the block ends
    without an error it replaces ``out`` (which must be absent or empty), else it is removed, so
    ``out`` is never half-written. The caller checks ``out`` beforehand."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
