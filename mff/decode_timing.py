"""When compiling the decode step pays back: decode timings recorded per model shape on this machine.

``torch.compile`` makes each decode step faster but its first call pays the tracing and (on a
machine whose Inductor cache does not hold the kernels yet) the kernel compilation: minutes on
a 2-core CPU for the first process, tens of seconds for later ones. Whether a generation of n
tokens gains from it is the break-even

    n > first_compiled_step_s / (eager_step_s - compiled_step_s)

in seconds per decode step. :func:`record_path` names one small JSON file per model shape
(config, dtype, batch size, cache bucket, device, threads and torch version) under
``$MFF_CACHE_DIR/decode-timing`` (default ``~/.cache/mff/decode-timing``); every ``generate``
run adds what it measured (:func:`update_record`), and ``--compile auto`` compiles only when the
recorded figures say it pays back (:func:`break_even_tokens`). The figures of a shape never
measured on this machine are unknown, so ``auto`` then decodes eagerly.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from mff.ckpt.tokenizer_files import write_text_atomic
from mff.data.config import DataConfig, resolve_cache_dir

__all__ = ["record_path", "read_record", "update_record", "break_even_tokens"]

_FIELDS = ("eager_step_s", "compiled_step_s", "first_compiled_step_s")


def _root() -> Path:
    return Path(resolve_cache_dir(DataConfig())) / "decode-timing"  # the data cache's folder rule ($MFF_CACHE_DIR)


def record_path(key: dict) -> Path:
    """The record file of the decode shape described by ``key`` (JSON-serialisable: the model
    config, dtype, batch size, cache bucket, device, threads, torch version)."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return _root() / f"{digest}.json"


def read_record(path: Path) -> dict[str, float]:
    """The recorded timings (seconds; a missing or unreadable record, or one that is not a small
    regular file, gives ``{}``: nothing known; values outside (1 ns, 1e5 s) are dropped)."""
    try:
        if not path.is_file() or path.stat().st_size > 4096:  # a FIFO, a device, or not a record mff wrote
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if k in _FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 1e-9 < v < 1e5}


def update_record(path: Path, eager_step_s: float | None = None, compiled_step_s: float | None = None,
                  first_compiled_step_s: float | None = None) -> dict[str, float]:
    """Add one run's measurements and write the record (temp file, then rename; a cache that
    cannot be written is skipped: the record only saves future runs a guess). Step times keep
    the latest value; the first compiled step keeps the smallest seen, since Inductor's on-disk
    cache only makes later first calls cheaper. Returns the record."""
    rec = read_record(path)
    for name, value in (("eager_step_s", eager_step_s), ("compiled_step_s", compiled_step_s)):
        if value is not None and math.isfinite(value) and value > 0:
            rec[name] = value
    if first_compiled_step_s is not None and math.isfinite(first_compiled_step_s) and first_compiled_step_s > 0:
        rec["first_compiled_step_s"] = min(first_compiled_step_s, rec.get("first_compiled_step_s", math.inf))
    try:
        write_text_atomic(path, json.dumps(rec, indent=1, sort_keys=True))
    except OSError:
        pass
    return rec


def break_even_tokens(rec: dict[str, float]) -> float | None:
    """Decode steps above which compiling is faster end to end (``inf`` when the compiled step
    is not faster), or None when the record lacks a figure."""
    if not all(k in rec for k in _FIELDS):
        return None
    gain = rec["eager_step_s"] - rec["compiled_step_s"]
    return rec["first_compiled_step_s"] / gain if gain > 0 else math.inf
