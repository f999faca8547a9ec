"""Write MindRecord datasets as MindSpore's ``FileWriter`` does, without MindSpore.

The layout is described in :mod:`mff.data.mindrecord` (the reader). One call lays the rows out as
one ``write_raw_data`` call followed by ``commit`` does in MindSpore's ``ShardWriter``: rows cut
into row groups at page boundaries (``CutRowGroup``), blob pages first (group g = blob page g),
then raw pages holding whole groups; the ``.db`` holds the same ``INDEXES`` and ``SHARD_NAME``
tables. The fixture MindSpore 2.10.0 wrote (``tests/data/mindrecord``) comes out byte for byte.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from .mindrecord import BLOB_PAGE, DEFAULT_HEADER_SIZE, DEFAULT_PAGE_SIZE, FIELD_TYPES, NUMERIC_TYPES, RAW_PAGE, encode_int_array

__all__ = ["write_mindrecord"]


def _check_schema(schema: Mapping[str, Mapping]) -> dict[str, dict]:
    out = {}
    if not schema:
        raise ValueError("write_mindrecord: the schema is empty")
    for name, spec in schema.items():
        t = spec.get("type") if isinstance(spec, Mapping) else None
        if t not in FIELD_TYPES:
            raise ValueError(f"write_mindrecord: field {name!r} has type {t!r}, expected one of {list(FIELD_TYPES)}")
        if "shape" in spec and t not in NUMERIC_TYPES:
            raise ValueError(f"write_mindrecord: field {name!r} of type {t} cannot have a shape")
        out[str(name)] = {"shape": [int(s) for s in spec["shape"]], "type": t} if "shape" in spec else {"type": t}
    return dict(sorted(out.items()))


def _pack_scalar(v: Any) -> bytes:
    # MindSpore packs a row through nlohmann::json::to_msgpack: a float takes 4 bytes when float32 holds it exactly
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return msgpack.packb(v, use_single_float=float(np.float32(v)) == v)
    if isinstance(v, np.integer):
        v = int(v)
    return msgpack.packb(v)


def _encode_row(i: int, row: Mapping[str, Any], schema: dict[str, dict], blob_fields: list[str], compressed: bool) -> tuple[bytes, bytes, int]:
    """(blob, raw, bytes saved by compression) of one row."""
    extra = sorted(set(row) - set(schema))
    missing = [f for f in schema if f not in row]
    if extra or missing:
        raise ValueError(f"write_mindrecord: row {i} has fields {sorted(row)}; the schema has {list(schema)} "
                         f"({'missing ' + str(missing) if missing else 'unknown ' + str(extra)})")
    plain, packed = [], []
    for name in blob_fields:
        t, shape = schema[name]["type"], schema[name].get("shape")
        if t == "bytes":
            data = bytes(row[name])
            plain.append(data)
            packed.append(data)
            continue
        arr = np.asarray(row[name])
        if arr.dtype.kind not in "iufb" or (t in ("int32", "int64") and arr.dtype.kind == "f"):
            raise ValueError(f"write_mindrecord: row {i} field {name!r} holds {arr.dtype} values, expected {t}")
        cast = arr.astype(NUMERIC_TYPES[t])
        if t in ("int32", "int64") and not np.array_equal(cast, arr):
            raise ValueError(f"write_mindrecord: row {i} field {name!r} has values outside {t}")
        if shape and -1 not in shape and cast.size != int(np.prod(shape)):
            raise ValueError(f"write_mindrecord: row {i} field {name!r} has {cast.size} elements, the schema shape {shape} needs {int(np.prod(shape))}")
        data = cast.tobytes()
        plain.append(data)
        packed.append(encode_int_array(cast) if compressed and t in ("int32", "int64") else data)

    def frame(parts: list[bytes]) -> bytes:
        if len(parts) == 1:
            return parts[0]
        return b"".join(len(p).to_bytes(8, "big") + p for p in parts)

    blob = frame(packed)
    saved = len(frame(plain)) - len(blob)
    raw_fields = [f for f in schema if f not in blob_fields]
    out = [msgpack.Packer().pack_map_header(len(raw_fields))]
    for name in raw_fields:  # sorted, as nlohmann::json orders object keys
        t, v = schema[name]["type"], row[name]
        if t == "string":
            if not isinstance(v, str):
                raise ValueError(f"write_mindrecord: row {i} field {name!r} is {type(v).__name__}, expected str")
        elif t in ("int32", "int64"):
            info = np.iinfo(NUMERIC_TYPES[t])
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not info.min <= int(v) <= info.max:
                raise ValueError(f"write_mindrecord: row {i} field {name!r} = {v!r} is not an {t}")
            v = int(v)
        else:
            if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool):
                raise ValueError(f"write_mindrecord: row {i} field {name!r} = {v!r} is not a number")
            v = float(np.float32(v)) if t == "float32" else float(v)
        out += [msgpack.packb(name), _pack_scalar(v)]
    return blob, b"".join(out), saved


@dataclass
class _NewPage:
    page_id: int
    kind: str
    type_id: int
    start_row: int = 0
    end_row: int = 0
    groups: list[tuple[int, int]] = field(default_factory=list)  # (row group id, offset)
    chunks: list[bytes] = field(default_factory=list)  # rows with their length prefixes

    @property
    def used(self) -> int:
        return sum(len(c) for c in self.chunks)

    def entry(self, shard_id: int) -> dict:
        groups = self.groups or [(0, 0)]  # MindSpore writes an empty list as one {id 0, offset 0}
        return {"end_row_id": self.end_row, "page_id": self.page_id, "page_size": self.used, "page_type": self.kind,
                "page_type_id": self.type_id, "row_group_ids": [{"id": g, "offset": o} for g, o in groups],
                "shard_id": shard_id, "start_row_id": self.start_row}


def _lay_out(blobs: list[bytes], raws: list[bytes], page_size: int) -> tuple[list[_NewPage], list[tuple[int, int, int, int, int, int]]]:
    """Pages of one shard as MindSpore's ``ShardWriter`` cuts them for one write call, and per row
    (raw page id, raw offset, raw end, group, blob page id, blob offset) for the ``.db``."""
    groups: list[list[int]] = []
    nb = nr = 0
    for i, (b, r) in enumerate(zip(blobs, raws)):
        sb, sr = 8 + len(b), 8 + len(r)
        if sb > page_size or sr > page_size:
            raise ValueError(f"write_mindrecord: row {i} needs {max(sb, sr)} bytes in a page, more than page_size {page_size}")
        if not groups or nb + sb > page_size or nr + sr > page_size:
            groups.append([i, i])
            nb = nr = 0
        groups[-1][1] = i + 1
        nb, nr = nb + sb, nr + sr
    pages: list[_NewPage] = []
    where: list[list] = [[0] * 6 for _ in blobs]
    for g, (a, e) in enumerate(groups):  # blob pages first: group g is blob page g
        p = _NewPage(len(pages), BLOB_PAGE, g, a, e)
        for i in range(a, e):
            where[i][3:6] = [g, p.page_id, p.used]
            p.chunks.append(len(blobs[i]).to_bytes(8, "little") + blobs[i])
        pages.append(p)
    raw_page = None
    for g, (a, e) in enumerate(groups):
        size = sum(8 + len(raws[i]) for i in range(a, e))
        if raw_page is None or raw_page.used + size > page_size:
            # MindSpore numbers a later raw page's page_type_id from the previous raw page's page_id
            type_id = 0 if raw_page is None else raw_page.page_id + 1
            raw_page = _NewPage(len(pages), RAW_PAGE, type_id)
            pages.append(raw_page)
        raw_page.groups.append((g, raw_page.used))
        for i in range(a, e):
            off = raw_page.used
            raw_page.chunks.append(len(raws[i]).to_bytes(8, "little") + raws[i])
            where[i][0:3] = [raw_page.page_id, off, off + 8 + len(raws[i])]
    return pages, [tuple(w) for w in where]


_DB_COLUMNS = ("CREATE TABLE INDEXES(  ROW_ID               INT  NOT NULL, PAGE_ID_RAW          INT  NOT NULL, "
               "PAGE_OFFSET_RAW      INT  NOT NULL, PAGE_OFFSET_RAW_END  INT  NOT NULL, ROW_GROUP_ID         INT  NOT NULL, "
               "PAGE_ID_BLOB         INT  NOT NULL, PAGE_OFFSET_BLOB     INT  NOT NULL, PAGE_OFFSET_BLOB_END INT  NOT NULL,INC_0 INT")
_SQL_TYPE = {"int32": "INT", "int64": "INT", "float32": "REAL", "float64": "REAL", "string": "TEXT"}


def _write_db(path: str, shard_name: str, schema: dict[str, dict], index_fields: list[str], rows: list[Mapping],
              where: list[tuple], blobs: list[bytes]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        con = sqlite3.connect(tmp)
        cols = "".join(f", {f}_0 {_SQL_TYPE[schema[f]['type']]}" for f in index_fields)
        con.execute(f"{_DB_COLUMNS}{cols}, PRIMARY KEY(ROW_ID,INC_0))")
        con.execute("CREATE TABLE SHARD_NAME(NAME TEXT NOT NULL)")
        con.execute("INSERT INTO SHARD_NAME VALUES (?)", (shard_name,))
        marks = ",".join("?" * (9 + len(index_fields)))
        values = []
        for i, (row, (rp, ro, re_, g, bp, bo)) in enumerate(zip(rows, where)):
            values.append((i, rp, ro, re_, g, bp, bo, bo + 8 + len(blobs[i]), 0, *(row[f] if schema[f]["type"] == "string" else
                                                                                  float(row[f]) if _SQL_TYPE[schema[f]["type"]] == "REAL" else
                                                                                  int(row[f]) for f in index_fields)))
        con.executemany(f"INSERT INTO INDEXES VALUES ({marks})", values)
        con.commit()
        con.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_mindrecord(path: str, rows: Iterable[Mapping[str, Any]], schema: Mapping[str, Mapping], *, shard_num: int = 1,
                     index_fields: Sequence[str] = (), desc: str = "", page_size: int = DEFAULT_PAGE_SIZE,
                     header_size: int = DEFAULT_HEADER_SIZE, db: bool = True) -> list[str]:
    """Write ``rows`` as a MindRecord dataset laid out as MindSpore's ``FileWriter`` lays out one
    ``write_raw_data`` call followed by ``commit`` (same header JSON, pages, compression and ``.db``
    tables; byte-identical data file for the fixture in ``tests/data/mindrecord``).

    Args:
        path: the data file; with ``shard_num`` N > 1 the files are ``path + "0"`` .. ``path + str(N-1)``.
        rows: dicts holding every schema field: arrays (anything numpy takes) for fields with a
            shape, ``bytes`` for bytes fields, int/float/str scalars otherwise.
        schema: field -> ``{"type": int32|int64|float32|float64|string|bytes, "shape": [...]}``
            (``shape`` only for numeric arrays; -1 = any length), as MindSpore's ``add_schema``.
        shard_num: files to split the rows over (contiguous runs; the first ``len % N`` shards take
            one row more).
        index_fields: scalar fields copied into the ``.db`` index (MindSpore's ``add_index``).
        desc: the schema description.
        page_size, header_size: bytes (MindSpore's defaults 32 MiB and 16 MiB).
        db: also write each shard's ``.db`` (MindSpore's reader needs it; this module's does not).

    Returns:
        the data file paths, in shard order.

    Every file is written under a temporary name and moved into place, data files first and
    ``.db`` files last.

    Raises:
        ValueError: a bad schema, a row that does not match it, an index field that is not a
            scalar field, a row or header larger than its page or header size, ``shard_num`` < 1.
    """
    schema = _check_schema(schema)
    if shard_num < 1:
        raise ValueError(f"write_mindrecord: shard_num {shard_num} must be >= 1")
    if page_size < 64 or header_size < 64:
        raise ValueError(f"write_mindrecord: page_size {page_size} and header_size {header_size} must be at least 64 bytes")
    blob_fields = [f for f, s in schema.items() if "shape" in s or s["type"] == "bytes"]
    for f in index_fields:
        if f not in schema or f in blob_fields:
            raise ValueError(f"write_mindrecord: index field {f!r} must be a scalar field of the schema ({[k for k in schema if k not in blob_fields]})")
    compressed = any(s["type"] in ("int32", "int64") and "shape" in s for s in schema.values())
    rows = list(rows)
    encoded = [_encode_row(i, r, schema, blob_fields, compressed) for i, r in enumerate(rows)]
    paths = [str(path)] if shard_num == 1 else [f"{path}{k}" for k in range(shard_num)]
    os.makedirs(os.path.dirname(os.path.abspath(paths[0])), exist_ok=True)
    names = [os.path.basename(p) for p in paths]
    per, extra = divmod(len(rows), shard_num)
    bounds = np.cumsum([0] + [per + (k < extra) for k in range(shard_num)])
    pending: list[tuple[str, str]] = []
    dbs = []
    try:
        for k, p in enumerate(paths):
            a, e = int(bounds[k]), int(bounds[k + 1])
            blobs, raws = [b for b, _, _ in encoded[a:e]], [r for _, r, _ in encoded[a:e]]
            pages, where = _lay_out(blobs, raws, page_size)
            header = {"header_size": header_size, "index_fields": [{"index_field": f, "schema_id": 0} for f in index_fields],
                      "page": [pg.entry(k) for pg in pages], "page_size": page_size,
                      "compression_size": sum(s for _, _, s in encoded[a:e]),
                      "schema": [{"blob_fields": blob_fields, "desc": desc, "schema": schema}], "shard_addresses": names,
                      "shard_id": k, "statistics": None, "version": "3.0"}
            text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
            if 8 + len(text) > header_size:
                raise ValueError(f"write_mindrecord: the header of {p} takes {8 + len(text)} bytes, more than header_size {header_size}")
            tmp = f"{p}.tmp-{os.getpid()}"
            pending.append((tmp, p))
            with open(tmp, "wb") as fh:
                fh.write(len(text).to_bytes(8, "little") + text)
                fh.write(b"\0" * (header_size - 8 - len(text)))
                for pg in pages:
                    fh.seek(header_size + pg.page_id * page_size)
                    fh.write(b"".join(pg.chunks))
            if db:
                dbs.append((p + ".db", names[k], rows[a:e], where, blobs))
        for tmp, p in pending:
            os.replace(tmp, p)
        pending = []
        for dbp, name, part, where, blobs in dbs:
            _write_db(dbp, name, schema, list(index_fields), part, where, blobs)
    finally:
        for tmp, _ in pending:
            if os.path.exists(tmp):
                os.remove(tmp)
    return paths
