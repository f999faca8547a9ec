"""Streaming safetensors writing and sharded-folder reading.

Writing: ``safetensors.torch.save_file`` turns every tensor into a Python ``bytes`` object before
writing, which holds a second copy of the whole model in memory. :func:`write_safetensors` writes
the same format (the documented layout: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`` padded with spaces to a
multiple of 8, then the raw little-endian data in offset order) one tensor at a time from the
tensors' own memory, into a temp file renamed into place. Files are read back with the
``safetensors`` library.

Reading: :class:`SafetensorsFolder` indexes a single ``model.safetensors`` or a sharded folder
(``model.safetensors.index.json``, HF's ``weight_map``) and opens one shard at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from mff.paths import file_kind

__all__ = ["DTYPE_CODES", "write_safetensors", "write_sharded", "SafetensorsFolder", "parse_size", "read_weight_map", "check_weight_map"]

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` (name -> CPU tensor, any layout) to a safetensors file at ``path``.

    Each tensor is written from its own memory (a contiguous copy only for non-contiguous
    views), so peak extra memory is one tensor, not the file. Written to ``path + ".tmp"`` and
    renamed. Returns the file size in bytes.

    Raises:
        ValueError: a dtype safetensors cannot store, or a non-string metadata value.
        OSError: the write failed (the partial temp file is removed; ``path`` is untouched).
    """
    path = Path(path)
    header: dict = {}
    if metadata:
        bad = {k: v for k, v in metadata.items() if not isinstance(v, str)}
        if bad:
            raise ValueError(f"safetensors metadata values must be strings, got {bad}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPE_CODES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        size = _nbytes(t.shape, t.dtype)
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in tensors.values():
                t = t.detach().to("cpu")
                if t.numel():
                    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full, file-size limit, Ctrl-C) leaves no partial file
        raise
    return 8 + len(raw) + offset


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"``. ValueError otherwise."""
    if isinstance(size, str) and size.strip().isdigit():
        size = int(size.strip())
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"size {size} must be > 0")
        return size
    s = str(size).strip().upper()
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                value = float(s[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * mult)
            break
    raise ValueError(f"size {size!r}: expected a positive number of bytes or a string like '5GB', '500MB'")


def write_sharded(
    folder: str | os.PathLike,
    names_shapes: Sequence[tuple[str, torch.Size, torch.dtype]],
    get: Callable[[str], torch.Tensor],
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write tensors to ``folder`` as HF does: ``model.safetensors`` when they fit in one shard,
    else ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    ``get(name)`` produces each tensor when its shard is written (so callers can build tensors
    lazily). ``progress(nbytes)`` is called after each shard with its tensor bytes. Returns the
    file names written.
    """
    limit = parse_size(max_shard_size)
    shards: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for item in names_shapes:
        n = _nbytes(item[1], item[2])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    folder = Path(folder)
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for fname, shard in zip(files, shards):
        tensors = {}
        for name, shape, dtype in shard:
            t = get(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"tensor {name!r}: produced {t.dtype} {tuple(t.shape)}, declared {dtype} {tuple(shape)}")
            tensors[name] = t
            weight_map[name] = fname
            total += _nbytes(shape, dtype)
        write_safetensors(folder / fname, tensors, metadata)
        if progress is not None:
            progress(sum(_nbytes(t.shape, t.dtype) for t in tensors.values()))
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = folder / "model.safetensors.index.json.tmp"
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, folder / "model.safetensors.index.json")
    return files


class SafetensorsFolder:
    """The tensors of a folder holding ``model.safetensors`` or a sharded index.

    ``names`` lists every tensor; ``shards()`` yields ``(file, open handle)`` one shard at a
    time (only that shard is mapped); ``read(name)`` opens the one file holding ``name``;
    ``file_metadata[file]`` is each file's ``__metadata__`` (``{}`` when absent).

    Other layouts (MindFormers ``param_name_map.json``, a chosen file list) pass ``files`` (file
    names inside ``folder``) and optionally ``weight_map`` (tensor -> file, checked against the
    files' contents) with ``index_name`` (the map's file name, for messages); see
    :mod:`mff.ckpt.mindspore_safetensors`.

    Raises:
        FileNotFoundError: no ``model.safetensors`` and no index in ``folder`` (the message lists
            the safetensors files that are there); an index naming a missing shard.
        ValueError: a corrupt or truncated file (names the file and the library's reason), or a
            malformed index.
    """

    def __init__(self, folder: str | os.PathLike, prefix: str = "model", files: Sequence[str] | None = None,
                 weight_map: Mapping[str, str] | None = None, index_name: str | None = None):
        self.folder = Path(folder)
        if files is None:
            files, weight_map, index_name = self._discover(prefix)
        index = self.folder / (index_name or "index")
        if weight_map is not None:
            check_weight_map(index, weight_map)
        self.files = list(files)
        missing = [f for f in self.files if not (self.folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index if weight_map is not None else self.folder} names shard files that are missing: {missing}")
        self.file_of: dict[str, str] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.file_metadata: dict[str, dict[str, str]] = {}
        for f in self.files:
            with self._open(f) as h:
                self.file_metadata[f] = dict(h.metadata() or {})
                for k in h.keys():
                    if k in self.file_of:
                        raise ValueError(f"tensor {k!r} is stored twice, in {self.file_of[k]} and {f}")
                    if weight_map is not None and weight_map.get(k) != f:
                        raise ValueError(f"{index}: tensor {k!r} is in {f} but the index maps it to {weight_map.get(k)!r}")
                    sl = h.get_slice(k)
                    self.file_of[k] = f
                    self.meta[k] = (sl.get_dtype(), tuple(sl.get_shape()))
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.file_of))
            if absent:
                raise ValueError(f"{index} lists tensors that no shard holds: {absent[:5]}")

    def _discover(self, prefix: str) -> tuple[list[str], dict | None, str | None]:
        single = self.folder / f"{prefix}.safetensors"
        index = self.folder / f"{prefix}.safetensors.index.json"
        if single.is_file():  # as transformers: the single file wins over an index
            return [single.name], None, None
        for p in (single, index):
            if os.path.lexists(p) and not p.is_file():
                raise ValueError(f"{p} is {file_kind(p)}, not a file")
        if index.is_file():
            weight_map = read_weight_map(index)
            return sorted(set(weight_map.values())), weight_map, index.name
        present = sorted(p.name for p in self.folder.glob("*.safetensors") if p.is_file())
        raise FileNotFoundError(f"{self.folder} has no {single.name} and no {index.name}"
                                + (f" (safetensors files present: {present})" if present else ""))

    @contextmanager
    def _open(self, fname: str) -> Iterator:
        path = self.folder / fname
        if not os.access(path, os.R_OK):
            raise PermissionError(f"{path} is not readable (permission denied)")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:
            raise ValueError(f"{path} is not a readable safetensors file (corrupt or truncated?): {e}") from None
        with handle as h:
            yield h

    @property
    def names(self) -> list[str]:
        """Every tensor name."""
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``."""
        return self.meta[name][1]

    def shards(self) -> Iterator[tuple[str, object]]:
        """``(file name, handle with keys() / get_tensor())`` for each shard in turn."""
        for f in self.files:
            with self._open(f) as h:
                yield f, _CheckedHandle(h, self.folder / f)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, opening only its shard."""
        with self._open(self.file_of[name]) as h:
            return _CheckedHandle(h, self.folder / self.file_of[name]).get_tensor(name)


def read_weight_map(index: Path, flat_ok: bool = False) -> dict[str, str]:
    """The tensor -> file map of an index file: HF's ``{"weight_map": {...}}``, or with
    ``flat_ok`` also a plain ``{tensor: file}`` object (MindFormers ``param_name_map.json``).

    Raises:
        ValueError: not JSON, no ``weight_map`` object, or file names that are not plain names
            inside the folder.
    """
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"] if not (flat_ok and isinstance(data, dict) and "weight_map" not in data) else data
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
    check_weight_map(index, weight_map)
    return weight_map


def check_weight_map(index: Path, weight_map: Mapping[str, str]):
    """ValueError unless every value of ``weight_map`` is a plain file name inside the folder."""
    bad = sorted({repr(f) for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..")})
    if bad:
        raise ValueError(f"{index}: weight_map values must be shard file names inside the folder, got {bad[:5]}")


class _CheckedHandle:
    """A safe_open handle whose reads name the file when the data is truncated."""

    def __init__(self, handle, path: Path):
        self._h, self._path = handle, path

    def keys(self):
        return self._h.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            return self._h.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{self._path}: cannot read tensor {name!r} (file corrupt or truncated?): {e}") from None
