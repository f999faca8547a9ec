"""MindRecord datasets (MindSpore's ``.mindrecord`` + ``.mindrecord.db``), read without MindSpore
(written by :mod:`mff.data.mindrecord_writer`).

Format (``docs/mindformers_formats.md`` §4; MindSpore's ``minddata/mindrecord``
``shard_header``, ``shard_writer``, ``shard_column``, ``shard_page``; checked byte for byte against
a file MindSpore 2.10.0's ``FileWriter`` wrote, ``tests/data/mindrecord/``):

- A data file starts with ``u64 LE n`` and ``n`` bytes of JSON (the header), zero-padded to
  ``header_size``. Page ``k`` starts at ``header_size + k * page_size``; its ``page_size`` entry in
  the header is the number of bytes used (the file ends after the last page's used bytes).
- Header keys: ``schema`` (one entry: ``schema`` field -> ``{"type", "shape"?}`` with types
  int32/int64/float32/float64/string/bytes, ``blob_fields`` = the array and bytes fields, ``desc``),
  ``page`` (``page_id``, ``page_type`` RAW_DATA|BLOB_DATA, ``page_type_id``, ``page_size``,
  ``start_row_id``/``end_row_id``, ``row_group_ids``), ``index_fields``, ``shard_addresses`` (the
  file names of all shards of the dataset), ``shard_id``, ``compression_size``, ``version``.
- Rows are written in row groups. Row group ``g`` is the blob page whose ``page_type_id`` is ``g``
  (rows ``start_row_id .. end_row_id - 1``); its scalar fields lie in the raw page whose
  ``row_group_ids`` lists ``{"id": g, "offset": o}``, starting at byte ``o``.
- BLOB_DATA row: ``u64 LE len`` + blob. With one blob field the blob is that field's payload;
  with several, each field in ``blob_fields`` order is ``u64 BE len`` + payload.
- Payloads: int32/int64 arrays are compressed when the file version is >= 3.0 and the schema has
  an int32/int64 field with a shape: ``u32 BE count``, a bitmap of 2-bit width codes (4 per byte,
  first element in the high bits; code c = ``2**c`` bytes), then each value as a little-endian
  signed integer of its width (the smallest of 1/2/4/8 bytes that holds it). Other arrays are
  their little-endian bytes, bytes fields themselves.
- RAW_DATA row: ``u64 LE len`` + a MessagePack map of the scalar fields (sorted keys).
- ``<file>.db`` (optional here) is SQLite: table ``INDEXES`` (row id -> raw/blob page ids and
  offsets, plus the index fields) and ``SHARD_NAME``. MindSpore's reader needs it; this reader
  builds its row index from the pages instead.

A dataset written with ``shard_num = N > 1`` is N files ``NAME0 .. NAME{N-1}``, each with a header
naming all of them; rows are split into contiguous runs, so reading the shards in order gives the
rows in the order they were written.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "MindRecordError",
    "MindRecordDataset",
    "MindRecordShard",
    "decode_int_array",
    "encode_int_array",
    "find_shards",
    "is_mindrecord",
]

NUMERIC_TYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
FIELD_TYPES = (*NUMERIC_TYPES, "string", "bytes")
RAW_PAGE, BLOB_PAGE = "RAW_DATA", "BLOB_DATA"
COMPRESSED_SINCE = (3, 0)
"""Integer arrays are compressed in files of this version and later (MindSpore's ``kVersion``)."""

DEFAULT_HEADER_SIZE = 1 << 24  # MindSpore's FileWriter defaults: 16 MiB header, 32 MiB pages
DEFAULT_PAGE_SIZE = 1 << 25
_NAME = re.compile(r"\.mindrecord\d*$")
_U64 = struct.Struct("<Q")


class MindRecordError(ValueError):
    """A MindRecord file that is truncated, malformed or lacks what was asked of it."""


def _version(v: Any) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in str(v).split("."))
    except ValueError:
        raise MindRecordError(f"unknown MindRecord version {v!r} (expected e.g. '3.0')") from None


# -- integer array compression -------------------------------------------------------------------


def decode_int_array(buf, dtype, where: str = "blob") -> np.ndarray:
    """Decode MindSpore's compressed integer array (``ShardColumn::UncompressInt``).

    Args:
        buf: the payload bytes: ``u32 BE count``, ``ceil(count / 4)`` bitmap bytes of 2-bit width
            codes (first element in the high bits), then the values, each a little-endian signed
            integer of ``2**code`` bytes.
        dtype: the result dtype (the schema type, int32 or int64).
        where: names the payload in errors.

    Returns:
        1-D array of ``dtype`` [count].

    Raises:
        MindRecordError: the payload is shorter or longer than its count and codes describe.
    """
    data = np.frombuffer(buf, dtype=np.uint8)
    if data.size < 4:
        raise MindRecordError(f"{where}: compressed integer array of {data.size} bytes, shorter than its 4-byte count")
    n = int.from_bytes(data[:4].tobytes(), "big")
    nmap = (n + 3) // 4
    if data.size < 4 + nmap:
        raise MindRecordError(f"{where}: compressed integer array of {n} values needs a {nmap}-byte width bitmap, has {data.size - 4} bytes")
    codes = ((data[4:4 + nmap, None] >> np.array([6, 4, 2, 0], np.uint8)) & 3).reshape(-1)[:n]
    widths = np.left_shift(1, codes.astype(np.int64))
    ends = np.cumsum(widths)
    need = 4 + nmap + (int(ends[-1]) if n else 0)
    if data.size != need:
        raise MindRecordError(f"{where}: compressed integer array of {n} values takes {need} bytes by its width codes, the payload has {data.size}")
    starts = 4 + nmap + ends - widths
    out = np.empty(n, dtype=np.int64)
    for code, dt in enumerate(("<i1", "<i2", "<i4", "<i8")):
        sel = np.flatnonzero(codes == code)
        if sel.size:
            w = 1 << code
            out[sel] = data[starts[sel, None] + np.arange(w)].copy().view(dt).reshape(-1)
    return out.astype(dtype)


def encode_int_array(values) -> bytes:
    """Compress an integer array as MindSpore does (``ShardColumn::CompressInt``); see
    :func:`decode_int_array` for the layout. Each value takes the smallest signed width of
    1, 2, 4 or 8 bytes that holds it."""
    v = np.asarray(values).astype(np.int64).reshape(-1)
    n = v.size
    codes = np.full(n, 3, np.uint8)
    for code, dt in ((2, np.int32), (1, np.int16), (0, np.int8)):
        info = np.iinfo(dt)
        codes[(v >= info.min) & (v <= info.max)] = code
    padded = np.zeros(-(-n // 4) * 4, np.uint8)
    padded[:n] = codes
    bitmap = (padded.reshape(-1, 4) << np.array([6, 4, 2, 0], np.uint8)).sum(axis=1, dtype=np.uint8)
    le = v.astype("<i8").view(np.uint8).reshape(n, 8)
    keep = np.arange(8)[None, :] < np.left_shift(1, codes.astype(np.int64))[:, None]
    return n.to_bytes(4, "big") + bitmap.tobytes() + le[keep].tobytes()


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Page:
    page_id: int
    kind: str
    type_id: int
    used: int
    start_row: int
    end_row: int
    groups: tuple[tuple[int, int], ...]


def _read_header(path: str) -> tuple[dict, bytes]:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise MindRecordError(f"{path}: {size} bytes, too short for a MindRecord file (expected an 8-byte header length, then the JSON header)")
        n = _U64.unpack(head)[0]
        if n == 0 or n > size - 8:
            raise MindRecordError(f"{path}: the header length field says {n} bytes but the file has {size - 8} after it "
                                  "(truncated, or not a MindRecord file)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MindRecordError(f"{path}: the {n}-byte header is not JSON ({e}); not a MindRecord file, or a damaged one") from None
    if not isinstance(header, dict):
        raise MindRecordError(f"{path}: the header is a JSON {type(header).__name__}, expected an object")
    missing = [k for k in ("header_size", "page_size", "page", "schema", "version") if k not in header]
    if missing:
        raise MindRecordError(f"{path}: the header lacks {missing} (has {sorted(header)}); not a MindRecord header")
    if not isinstance(header["header_size"], int) or header["header_size"] < 8 + n:
        raise MindRecordError(f"{path}: header_size {header['header_size']!r} is smaller than the {8 + n}-byte header itself")
    if not isinstance(header["page_size"], int) or header["page_size"] < 1:
        raise MindRecordError(f"{path}: page_size {header['page_size']!r} must be a positive integer")
    return header, raw


class MindRecordShard:
    """One MindRecord data file: its header, schema and rows.

    The row index (where each row's blob and raw bytes lie) is built on first access by walking
    the pages named in the header; the file is memory-mapped, so a row read touches only its bytes.

    Args:
        path: the data file (not the ``.db``).

    Attributes:
        path, header (the parsed JSON), schema (field -> ``{"type", "shape"?}``), blob_fields
        (in blob order), raw_fields, shard_id, shard_addresses, compressed (integer arrays are
        compressed), header_bytes (the header JSON as stored).

    Raises:
        FileNotFoundError: no such file.
        MindRecordError: a bad or truncated header, an unknown field type, pages that lie past the
            end of the file (truncated), or rows that do not fit their pages (on first row access).
    """

    def __init__(self, path: str):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"MindRecord: {self.path} does not exist")
        self.header, self.header_bytes = _read_header(self.path)
        h = self.header
        schemas = h["schema"]
        if not isinstance(schemas, list) or not schemas or not isinstance(schemas[0], dict) or "schema" not in schemas[0]:
            raise MindRecordError(f"{self.path}: header 'schema' must be a list holding one schema object, got {schemas!r}")
        self.schema: dict[str, dict] = dict(schemas[0]["schema"])
        for name, spec in self.schema.items():
            if not isinstance(spec, dict) or spec.get("type") not in FIELD_TYPES:
                raise MindRecordError(f"{self.path}: field {name!r} has type {spec!r}, expected one of {list(FIELD_TYPES)}")
        self.blob_fields: list[str] = list(schemas[0].get("blob_fields", []))
        unknown = [f for f in self.blob_fields if f not in self.schema]
        if unknown:
            raise MindRecordError(f"{self.path}: blob_fields {unknown} are not in the schema {sorted(self.schema)}")
        self.raw_fields = [f for f in self.schema if f not in self.blob_fields]
        self.header_size, self.page_size = int(h["header_size"]), int(h["page_size"])
        self.shard_id = int(h.get("shard_id", 0))
        self.shard_addresses = [str(a) for a in h.get("shard_addresses") or [os.path.basename(self.path)]]
        self.version = _version(h["version"])
        self.compressed = self.version >= COMPRESSED_SINCE and any(
            s["type"] in ("int32", "int64") and "shape" in s for s in self.schema.values())
        self.pages = [self._page(p) for p in h["page"]]
        size = os.path.getsize(self.path)
        for p in self.pages:
            end = self.header_size + p.page_id * self.page_size + p.used
            if end > size:
                raise MindRecordError(f"{self.path} is truncated: it has {size} bytes but page {p.page_id} ({p.kind}, {p.used} bytes used) "
                                      f"ends at byte {end}")
        blob = [p for p in self.pages if p.kind == BLOB_PAGE]
        self._num_rows = sum(p.end_row - p.start_row for p in blob) if blob else None
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._index: tuple[np.ndarray, ...] | None = None

    def _page(self, p: Any) -> _Page:
        try:
            groups = tuple((int(g["id"]), int(g["offset"])) for g in p.get("row_group_ids", []))
            page = _Page(int(p["page_id"]), str(p["page_type"]), int(p["page_type_id"]), int(p["page_size"]),
                         int(p.get("start_row_id", 0)), int(p.get("end_row_id", 0)), groups)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MindRecordError(f"{self.path}: malformed page entry {p!r} in the header ({e!r})") from None
        if page.kind not in (RAW_PAGE, BLOB_PAGE):
            raise MindRecordError(f"{self.path}: page {page.page_id} has page_type {page.kind!r}, expected {RAW_PAGE} or {BLOB_PAGE}")
        if page.page_id < 0 or not 0 <= page.used <= self.page_size:
            raise MindRecordError(f"{self.path}: page {page.page_id} uses {page.used} bytes of a {self.page_size}-byte page")
        return page

    # -- row index -------------------------------------------------------------------------
    def _start(self, page: _Page) -> int:
        return self.header_size + page.page_id * self.page_size

    def _walk(self, page: _Page, begin: int, end: int, count: int | None) -> list[tuple[int, int]]:
        """(file offset, length) of the rows stored in ``[begin, end)`` of ``page`` (``count``
        of them, or all up to ``end``)."""
        base, out, off = self._start(page), [], begin
        mm = self._mm
        while off < end and (count is None or len(out) < count):
            if off + 8 > end:
                raise MindRecordError(f"{self.path}: page {page.page_id} ({page.kind}) holds a partial row length at byte {off} "
                                      f"of {end} used bytes (damaged file)")
            n = int.from_bytes(mm[base + off:base + off + 8].tobytes(), "little")
            if off + 8 + n > end:
                raise MindRecordError(f"{self.path}: a row of {n} bytes at byte {off} of page {page.page_id} ({page.kind}) runs past "
                                      f"the page's {end} used bytes (damaged file)")
            out.append((base + off + 8, n))
            off += 8 + n
        if count is not None and len(out) < count:
            raise MindRecordError(f"{self.path}: page {page.page_id} ({page.kind}) holds {len(out)} rows of row group where the blob "
                                  f"page says {count}")
        return out

    def _build_index(self) -> tuple[np.ndarray, ...]:
        blob_pages = sorted((p for p in self.pages if p.kind == BLOB_PAGE), key=lambda p: p.type_id)
        raw_pages = sorted((p for p in self.pages if p.kind == RAW_PAGE), key=lambda p: p.page_id)
        blob: list[tuple[int, int]] = []
        raw: list[tuple[int, int]] = []
        if not blob_pages:  # no row groups recorded: the raw pages in order hold every row
            for p in raw_pages:
                raw += self._walk(p, 0, p.used, None)
            blob = [(0, 0)] * len(raw)
        else:
            where: dict[int, tuple[_Page, int, int]] = {}
            for p in raw_pages:
                offs = sorted(set(o for _, o in p.groups))
                for g, o in p.groups:
                    later = [x for x in offs if x > o]
                    end = later[0] if later else p.used
                    if o < end or g not in where:  # an emptied page still lists a placeholder group
                        where[g] = (p, o, end)
            for p in blob_pages:
                rows = self._walk(p, 0, p.used, None)
                if p.start_row != len(blob) or len(rows) != p.end_row - p.start_row:
                    raise MindRecordError(f"{self.path}: blob page {p.page_id} holds {len(rows)} rows; its header entry says rows "
                                          f"{p.start_row}..{p.end_row - 1} after {len(blob)} rows (damaged file)")
                blob += rows
                if self.raw_fields or p.type_id in where:
                    if p.type_id not in where:
                        raise MindRecordError(f"{self.path}: no raw page lists row group {p.type_id} (blob page {p.page_id})")
                    rp, o, end = where[p.type_id]
                    raw += self._walk(rp, o, end, len(rows))
                else:
                    raw += [(0, 0)] * len(rows)
        b, r = np.array(blob, np.int64).reshape(-1, 2), np.array(raw, np.int64).reshape(-1, 2)
        return b[:, 0], b[:, 1], r[:, 0], r[:, 1]

    @property
    def index(self) -> tuple[np.ndarray, ...]:
        """(blob offset, blob length, raw offset, raw length), int64 [num_rows] each: file byte
        offsets of each row's bytes after its length prefix."""
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def __len__(self) -> int:
        """Number of rows."""
        if self._num_rows is None:
            self._num_rows = len(self.index[0])
        return self._num_rows

    # -- fields ----------------------------------------------------------------------------
    def _check_row(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"MindRecord: row {i} out of range for {n} rows in {self.path}")
        return int(i) % n

    def blob_payloads(self, i: int) -> dict[str, memoryview]:
        """Row ``i``'s blob split into its fields' payload bytes (still compressed)."""
        i = self._check_row(i)
        off, n = int(self.index[0][i]), int(self.index[1][i])
        buf = memoryview(self._mm[off:off + n])
        if len(self.blob_fields) == 1:
            return {self.blob_fields[0]: buf}
        out, pos = {}, 0
        for name in self.blob_fields:
            if pos + 8 > n:
                raise MindRecordError(f"{self.path}: row {i}'s blob ends at byte {n} before field {name!r} (damaged file)")
            m = int.from_bytes(buf[pos:pos + 8], "big")
            if pos + 8 + m > n:
                raise MindRecordError(f"{self.path}: row {i}'s field {name!r} of {m} bytes runs past its {n}-byte blob (damaged file)")
            out[name] = buf[pos + 8:pos + 8 + m]
            pos += 8 + m
        return out

    def _decode_blob(self, name: str, payload, i: int):
        spec = self.schema[name]
        t = spec["type"]
        if t == "bytes":
            return bytes(payload)
        if t == "string":
            return bytes(payload).decode("utf-8")
        if self.compressed and t in ("int32", "int64"):
            arr = decode_int_array(payload, NUMERIC_TYPES[t], f"{self.path} row {i} field {name!r}")
        else:
            dt = NUMERIC_TYPES[t]
            if len(payload) % dt.itemsize:
                raise MindRecordError(f"{self.path}: row {i} field {name!r} has {len(payload)} bytes, not a whole number of {t}")
            arr = np.frombuffer(payload, dtype=dt).copy()
        shape = spec.get("shape")
        if shape and sum(1 for s in shape if s == -1) <= 1 and len(shape) > 1:
            arr = arr.reshape(shape)
        return arr

    def raw_values(self, i: int) -> dict[str, Any]:
        """Row ``i``'s scalar fields (numpy scalars of the schema type; str for strings)."""
        i = self._check_row(i)
        if not self.raw_fields:
            return {}
        off, n = int(self.index[2][i]), int(self.index[3][i])
        try:
            values = msgpack.unpackb(self._mm[off:off + n].tobytes(), raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            raise MindRecordError(f"{self.path}: row {i}'s raw fields are not a MessagePack map ({e})") from None
        if not isinstance(values, dict):
            raise MindRecordError(f"{self.path}: row {i}'s raw fields are a {type(values).__name__}, expected a MessagePack map")
        out = {}
        for name in self.raw_fields:
            if name in values:
                t = self.schema[name]["type"]
                v = values[name]
                out[name] = NUMERIC_TYPES[t].type(v) if t in NUMERIC_TYPES else v
        return out

    def check_fields(self, fields: Iterable[str]) -> list[str]:
        """``fields`` as a list, each checked against the schema.

        Raises:
            MindRecordError: a field the schema does not have (the message lists the schema's).
        """
        fields = list(fields)
        missing = [f for f in fields if f not in self.schema]
        if missing:
            raise MindRecordError(f"{self.path}: no field {missing[0]!r} in the schema; it has "
                                  + ", ".join(f"{k} ({v['type']}{' ' + str(v['shape']) if 'shape' in v else ''})" for k, v in self.schema.items()))
        return fields

    def read(self, i: int, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Row ``i``: field -> value (arrays as numpy arrays of the schema dtype and shape, bytes,
        str, or numpy scalars). ``fields`` None reads all.

        Raises:
            IndexError: ``i`` out of range.
            MindRecordError: a field the schema lacks, or damaged row bytes.
        """
        wanted = self.check_fields(self.schema if fields is None else fields)
        out: dict[str, Any] = {}
        if any(f in self.blob_fields for f in wanted):
            payloads = self.blob_payloads(i)
            for f in wanted:
                if f in payloads:
                    out[f] = self._decode_blob(f, payloads[f], i)
        if any(f in self.raw_fields for f in wanted):
            raw = self.raw_values(i)
            for f in wanted:
                if f in self.raw_fields:
                    if f not in raw:
                        raise MindRecordError(f"{self.path}: row {i} has no value for field {f!r}")
                    out[f] = raw[f]
        return {f: out[f] for f in wanted}

    def array_lengths(self, name: str) -> np.ndarray:
        """Elements of array field ``name`` in every row, int64 [num_rows], read from the
        compressed counts (or the payload sizes) without decoding the values.

        Raises:
            MindRecordError: ``name`` is not an array (blob) field of a numeric type.
        """
        self.check_fields([name])
        t = self.schema[name]["type"]
        if name not in self.blob_fields or t not in NUMERIC_TYPES:
            raise MindRecordError(f"{self.path}: field {name!r} is {t}{' (a scalar)' if name not in self.blob_fields else ''}, "
                                  "expected an int32/int64/float array field")
        out = np.empty(len(self), np.int64)
        for i in range(len(self)):
            p = self.blob_payloads(i)[name]
            if self.compressed and t in ("int32", "int64"):
                if len(p) < 4:
                    raise MindRecordError(f"{self.path}: row {i} field {name!r} holds {len(p)} bytes, too few for its element count")
                out[i] = int.from_bytes(p[:4], "big")
            else:
                out[i] = len(p) // NUMERIC_TYPES[t].itemsize
        return out


def is_mindrecord(path: str) -> bool:
    """Whether ``path`` names MindRecord data: a file called ``*.mindrecord`` / ``*.mindrecordN``
    or whose first bytes are a MindRecord header length and JSON, a folder holding such files, or a
    glob pattern matching them."""
    p = str(path)
    if os.path.isdir(p):
        return any(_NAME.search(f) for f in os.listdir(p))
    if os.path.isfile(p):
        if _NAME.search(p):
            return True
        try:
            with open(p, "rb") as fh:
                head = fh.read(10)
        except OSError:
            return False
        return len(head) == 10 and 0 < _U64.unpack(head[:8])[0] < os.path.getsize(p) and head[8:10] == b'{"'
    if any(c in p for c in "*?["):
        return any(_NAME.search(f) for f in glob.glob(p))
    return False


def _resolve_address(folder: str, address: str) -> str:
    local = os.path.join(folder, os.path.basename(address))
    if os.path.isfile(local) or not os.path.isabs(address):
        return local
    return address


def find_shards(path: str) -> list[list[str]]:
    """The MindRecord datasets ``path`` names, each as its shard files in shard order.

    ``path`` may be one data file (any shard of a dataset: its header lists all of them; they are
    looked up beside it; a dataset of one shard may have been renamed), a folder (every ``*.mindrecord`` / ``*.mindrecordN`` file in it, not
    recursive) or a glob pattern. Files of the same dataset count once; datasets come in the order
    of their first file name.

    Raises:
        FileNotFoundError: nothing matches ``path``, or a shard a header names is missing (the
            message names it and the file whose header lists it).
        MindRecordError: a bad header, or a shard whose header gives it another shard id.
    """
    p = str(path)
    if os.path.isdir(p):
        files = sorted(os.path.join(p, f) for f in os.listdir(p) if _NAME.search(f) and os.path.isfile(os.path.join(p, f)))
        if not files:
            raise FileNotFoundError(f"MindRecord: no *.mindrecord files in the folder {p}")
    elif os.path.isfile(p):
        files = [p]
    else:
        files = sorted(f for f in glob.glob(p) if _NAME.search(f) and os.path.isfile(f)) if any(c in p for c in "*?[") else []
        if not files:
            raise FileNotFoundError(f"MindRecord: {p} does not exist (expected a .mindrecord file, a folder of them or a glob pattern)")
    datasets: list[list[str]] = []
    seen: set[str] = set()
    for f in files:
        if os.path.abspath(f) in seen:
            continue
        header, _ = _read_header(f)
        addresses = [str(a) for a in header.get("shard_addresses") or [os.path.basename(f)]]
        folder = os.path.dirname(os.path.abspath(f))
        # a one-file dataset is read under whatever name it has now (files get renamed and copied)
        shards = [f] if len(addresses) == 1 else [_resolve_address(folder, a) for a in addresses]
        for k, s in enumerate(shards):
            if not os.path.isfile(s):
                raise FileNotFoundError(f"MindRecord: shard {k} of {len(shards)} ({s}) is missing; the header of {f} names shards {addresses}")
        sid = int(header.get("shard_id", 0))
        if sid >= len(shards) or os.path.abspath(shards[sid]) != os.path.abspath(f):
            raise MindRecordError(f"MindRecord: {f} says it is shard {sid} of {addresses}, but that shard is another file")
        datasets.append(shards)
        seen.update(os.path.abspath(s) for s in shards)
    return datasets


class MindRecordDataset:
    """All rows of one or more MindRecord datasets, read in order (shard 0's rows first).

    Args:
        path: a data file (any shard), a folder or a glob pattern (see :func:`find_shards`).

    Attributes:
        path: as given. shards: the :class:`MindRecordShard` of every file, in order. schema: the
        common schema (field -> spec).

    Raises:
        FileNotFoundError: see :func:`find_shards`.
        MindRecordError: a bad file, or shards whose schemas differ.
    """

    def __init__(self, path: str):
        self.path = str(path)
        self.shards = [MindRecordShard(f) for files in find_shards(self.path) for f in files]
        first = self.shards[0]
        for s in self.shards[1:]:
            if s.schema != first.schema or s.blob_fields != first.blob_fields:
                raise MindRecordError(f"MindRecord: {s.path} has schema {s.schema} (blob fields {s.blob_fields}), unlike {first.path}'s "
                                      f"{first.schema} (blob fields {first.blob_fields}); one dataset needs one schema")
        self.schema = first.schema
        self._offsets = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        """Rows in all shards."""
        return int(self._offsets[-1])

    def locate(self, i: int) -> tuple[MindRecordShard, int]:
        """(shard, row within it) of global row ``i``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"MindRecord: row {i} out of range for {n} rows in {self.path}")
        i = int(i) % n
        k = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return self.shards[k], i - int(self._offsets[k])

    def read(self, i: int, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Row ``i`` (see :meth:`MindRecordShard.read`)."""
        shard, j = self.locate(i)
        return shard.read(j, fields)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.read(i)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.read(i)

    def array_lengths(self, name: str) -> np.ndarray:
        """Elements of array field ``name`` per row, int64 [len(self)] (see :meth:`MindRecordShard.array_lengths`)."""
        return np.concatenate([s.array_lengths(name) for s in self.shards]) if self.shards else np.zeros(0, np.int64)
