"""MindSpore ``.ckpt`` files: a streaming reader and writer that need no MindSpore.

Format source: ``docs/mindformers_formats.md`` section 2 (MindSpore 2.10
``mindspore/train/serialization.py`` and ``checkpoint_pb2.py``), checked against files MindSpore
2.10 wrote (``tests/data/mindspore/``). In short:

- The file is a run of serialized ``Checkpoint`` messages holding one ``Value`` each: on the wire
  every record is ``0x0a <varint length> <Value>``. ``Value`` = ``tag`` (the parameter name,
  field 1) + ``tensor`` (``TensorProto``, field 2) or ``maptensor`` (field 3). ``TensorProto`` =
  ``dims`` (repeated int64, field 1), ``tensor_type`` (``str(mindspore dtype)`` such as
  ``"Float32"``, ``"BFloat16"``, ``"str"``; field 2), ``tensor_content`` (raw C-order
  little-endian bytes, field 3).
- A tensor larger than 512 MiB is cut into several consecutive records with the same tag and the
  full ``dims`` in each; a reader concatenates their contents.
- Scalars have ``dims == []`` (the loader also reads ``[0]`` as a scalar); ``append_dict``
  strings have type ``"str"``, ``dims == [0]`` and UTF-32-LE content (numpy ``U<n>``).
- ``crc_check=True`` appends ``b"crc_num"`` + a 10-byte big-endian zlib CRC32 of all bytes before it.
- Encrypted files (``enc_key``) are blocks that start with a 4-byte little-endian magic
  (0x7F3A5ED8 AES-GCM, 0x7F3A5ED9 AES-CBC, 0x7F3A5EDA SM4-CBC; MindSpore ``utils/crypto.h``).

Records are walked one at a time, so files beyond 2 GiB (python protobuf's single-message limit)
and beyond RAM minus the output are fine. The message classes are built at import from a
hand-written descriptor (no generated code); small records are parsed with them. Records larger
than :data:`SMALL_RECORD` are read by hand (field walk of the same schema) so that their tensor
bytes go straight from the file into the output tensor, with no intermediate copies.

MindSpore / MindFormers safetensors (files and sharded folders) are read by
:mod:`mff.ckpt.mindspore_safetensors`, re-exported here.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from mff.ckpt.mindspore_safetensors import is_ms_safetensors, open_mindformers_safetensors, read_ms_safetensors

__all__ = [
    "MindSporeCheckpointError", "iter_ckpt", "read_ckpt", "ckpt_names", "write_ckpt", "is_mindspore_ckpt",
    "MS_DTYPES", "TORCH_TO_MS", "Checkpoint", "Value", "TensorProto", "MapTensorProto",
    "open_mindformers_safetensors", "read_ms_safetensors", "is_ms_safetensors",  # re-exported from mindspore_safetensors
]

# bytes per record chunk when writing (MindSpore SLICE_SIZE = 512 * 1024 KB); tests shrink it
SLICE_BYTES = 512 * 1024 * 1024
# records up to this size are read whole and parsed with protobuf; larger ones stream their content
SMALL_RECORD = 1 << 20

MS_DTYPES: dict[str, torch.dtype] = {
    "Float32": torch.float32, "Float16": torch.float16, "BFloat16": torch.bfloat16, "Float64": torch.float64,
    "Int8": torch.int8, "UInt8": torch.uint8, "Int16": torch.int16, "UInt16": torch.uint16,
    "Int32": torch.int32, "UInt32": torch.uint32, "Int64": torch.int64, "UInt64": torch.uint64,
    "Bool": torch.bool,
}
TORCH_TO_MS: dict[torch.dtype, str] = {v: k for k, v in MS_DTYPES.items()}

_CRC_MAGIC = b"crc_num"
_CRC_TRAILER = len(_CRC_MAGIC) + 10
_ENC_MAGIC = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC", 0x7F3A5EDA: "SM4-CBC"}


class MindSporeCheckpointError(ValueError):
    """A MindSpore checkpoint that cannot be read (or written): the message names the file and,
    for damaged data, the byte offset."""


# ---------------------------------------------------------------- message classes (checkpoint.proto)

def _build_messages():
    fdp = descriptor_pb2.FileDescriptorProto(name="mff_mindspore_checkpoint.proto", package="mff_mindspore", syntax="proto2")
    F = descriptor_pb2.FieldDescriptorProto
    req, opt, rep = F.LABEL_REQUIRED, F.LABEL_OPTIONAL, F.LABEL_REPEATED

    def add(msg, name, number, label, ftype, type_name=None, oneof=None):
        f = msg.field.add(name=name, number=number, label=label, type=ftype)
        if type_name:
            f.type_name = type_name
        if oneof is not None:
            f.oneof_index = oneof

    tensor = fdp.message_type.add(name="TensorProto")
    add(tensor, "dims", 1, rep, F.TYPE_INT64)
    add(tensor, "tensor_type", 2, req, F.TYPE_STRING)
    add(tensor, "tensor_content", 3, req, F.TYPE_BYTES)
    mapt = fdp.message_type.add(name="MapTensorProto")
    add(mapt, "tensor", 1, rep, F.TYPE_MESSAGE, ".mff_mindspore.TensorProto")
    ckpt = fdp.message_type.add(name="Checkpoint")
    value = ckpt.nested_type.add(name="Value")
    value.oneof_decl.add(name="value")
    add(value, "tag", 1, req, F.TYPE_STRING)
    add(value, "tensor", 2, opt, F.TYPE_MESSAGE, ".mff_mindspore.TensorProto", oneof=0)
    add(value, "maptensor", 3, opt, F.TYPE_MESSAGE, ".mff_mindspore.MapTensorProto", oneof=0)
    add(ckpt, "value", 1, rep, F.TYPE_MESSAGE, ".mff_mindspore.Checkpoint.Value")
    pool = descriptor_pool.DescriptorPool()  # private pool: no clash with MindSpore's own descriptor
    pool.Add(fdp)

    def cls(name):
        desc = pool.FindMessageTypeByName(name)
        if hasattr(message_factory, "GetMessageClass"):
            return message_factory.GetMessageClass(desc)
        return message_factory.MessageFactory(pool).GetPrototype(desc)  # protobuf < 4.22

    return (cls("mff_mindspore.Checkpoint"), cls("mff_mindspore.Checkpoint.Value"),
            cls("mff_mindspore.TensorProto"), cls("mff_mindspore.MapTensorProto"))


Checkpoint, Value, TensorProto, MapTensorProto = _build_messages()


# ---------------------------------------------------------------- varints

def _varint_bytes(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf writes negative int64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_at(buf, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``buf[pos:]``; IndexError if it runs past the end."""
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


# ---------------------------------------------------------------- reading

class _Stream:
    """A file read forward, with position, end (the CRC trailer excluded) and an optional running CRC32."""

    def __init__(self, f, path: Path, end: int, crc: bool):
        self.f, self.path, self.end, self.pos = f, path, end, 0
        self.crc = 0 if crc else None

    def fail(self, offset: int, what: str):
        raise MindSporeCheckpointError(f"{self.path}: {what} (at byte {offset})")

    def read(self, n: int, what: str) -> bytes:
        if self.pos + n > self.end:
            self.fail(self.pos, f"truncated: {what} needs {n} bytes but only {self.end - self.pos} remain")
        b = self.f.read(n)
        if len(b) != n:
            self.fail(self.pos, f"truncated: {what} needs {n} bytes, read {len(b)}")
        self.pos += n
        if self.crc is not None:
            self.crc = zlib.crc32(b, self.crc)
        return b

    def read_into(self, mv: memoryview, what: str):
        n = len(mv)
        if self.pos + n > self.end:
            self.fail(self.pos, f"truncated: {what} needs {n} bytes but only {self.end - self.pos} remain")
        done = 0
        while done < n:
            got = self.f.readinto(mv[done:])
            if not got:
                self.fail(self.pos + done, f"truncated: {what} needs {n} bytes, read {done}")
            done += got
        self.pos += n
        if self.crc is not None:
            self.crc = zlib.crc32(mv, self.crc)

    def skip(self, n: int, what: str):
        if self.crc is not None:  # every byte must pass through the CRC
            left = n
            while left:
                step = min(left, 64 << 20)
                self.read(step, what)
                left -= step
            return
        if self.pos + n > self.end:
            self.fail(self.pos, f"truncated: {what} needs {n} bytes but only {self.end - self.pos} remain")
        self.pos += n
        self.f.seek(self.pos)

    def varint(self, what: str) -> int:
        start, result, shift = self.pos, 0, 0
        while True:
            if self.pos >= self.end:
                self.fail(start, f"truncated: file ends inside the {what}")
            b = self.read(1, what)[0]
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift >= 70:
                self.fail(start, f"{what} is not a valid varint")


@dataclass
class _Record:
    """One record's header; the content is either ``content`` (already read) or ``content_len``
    bytes still waiting in the stream."""
    offset: int
    tag: str
    tensor_type: str
    dims: list[int]
    content_len: int
    content: bytes | None = None
    extra: list = field(default_factory=list)


def _check_start(f, path: Path, size: int):
    head = f.read(4)
    f.seek(0)
    if len(head) >= 4 and int.from_bytes(head, "little") in _ENC_MAGIC:
        mode = _ENC_MAGIC[int.from_bytes(head, "little")]
        raise MindSporeCheckpointError(
            f"{path} is encrypted (MindSpore enc_key/enc_mode, {mode} block magic); decrypt it with MindSpore first "
            "(mindspore.load_checkpoint(path, dec_key=..., dec_mode=...) then mindspore.save_checkpoint without enc_key)")
    if head[:1] != b"\x0a":
        raise MindSporeCheckpointError(
            f"{path} is not a MindSpore checkpoint: a record starts with byte 0x0a, found 0x{head[0]:02x} (at byte 0); "
            "encrypted or compressed files must be turned back into a plain MindSpore .ckpt first")


def _data_end(f, size: int) -> tuple[int, int | None]:
    """(end of the records, stored CRC or None)."""
    if size >= _CRC_TRAILER:
        f.seek(size - _CRC_TRAILER)
        tail = f.read(_CRC_TRAILER)
        f.seek(0)
        if tail[: len(_CRC_MAGIC)] == _CRC_MAGIC:
            return size - _CRC_TRAILER, int.from_bytes(tail[len(_CRC_MAGIC):], "big")
    return size, None


def _parse_small(s: _Stream, offset: int, raw: bytes) -> _Record:
    value = Value()
    try:
        value.ParseFromString(raw)
        tag = value.tag
    except (DecodeError, RuntimeError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        s.fail(offset, f"record is not a valid checkpoint Value: {e}")
    if not isinstance(tag, str):  # upb hands back bytes for a proto2 string that is not UTF-8
        s.fail(offset, f"record tag {tag!r} is not valid UTF-8")
    if not value.IsInitialized():  # python protobuf (upb) does not enforce proto2 'required' when parsing
        s.fail(offset, f"record {tag!r} lacks required fields {value.FindInitializationErrors()}")
    which = value.WhichOneof("value")
    if which == "maptensor":
        _refuse_map(s, offset, tag)
    if which != "tensor":
        s.fail(offset, f"record {tag!r} holds no tensor")
    t = value.tensor
    return _Record(offset, tag, t.tensor_type, list(t.dims), len(t.tensor_content), t.tensor_content)


def _refuse_map(s: _Stream, offset: int, tag: str):
    s.fail(offset, f"record {tag!r} is a map tensor (MindSpore MapParameter, an embedding hash table); "
                   "mff reads only dense tensors")


def _string_at(buf, pos: int) -> tuple[str, int]:
    """(text, next position) of the length-prefixed UTF-8 string at ``buf[pos:]``; IndexError
    if it runs past the end, UnicodeDecodeError if it is not UTF-8."""
    n, pos = _varint_at(buf, pos)
    if pos + n > len(buf):
        raise IndexError("string runs past the end of the buffer")
    return bytes(buf[pos:pos + n]).decode("utf-8"), pos + n


def _parse_head(s: _Stream, offset: int, length: int, head: bytes) -> _Record | None:
    """Hand walk of a big record whose first bytes are ``head``: a record in MindSpore's layout
    (tag, then the tensor with dims, type and content last, content running to the record end).
    None when the record is laid out otherwise (then it is parsed whole)."""
    try:
        pos, tag, end = 0, None, length
        while True:
            key, pos = _varint_at(head, pos)
            if key == 0x0A and tag is None:
                tag, pos = _string_at(head, pos)
            elif key == 0x1A and tag is not None:
                _refuse_map(s, offset, tag)
            elif key == 0x12 and tag is not None:
                n, pos = _varint_at(head, pos)
                if pos + n != end:
                    return None
                break
            else:
                return None
        dims, ttype = [], None
        while True:
            key, pos = _varint_at(head, pos)
            if key == 0x08:
                d, pos = _varint_at(head, pos)
                dims.append(d - (1 << 64) if d >= 1 << 63 else d)
            elif key == 0x0A:  # packed dims
                n, pos = _varint_at(head, pos)
                stop = pos + n
                while pos < stop:
                    d, pos = _varint_at(head, pos)
                    dims.append(d - (1 << 64) if d >= 1 << 63 else d)
            elif key == 0x12:
                ttype, pos = _string_at(head, pos)
            elif key == 0x1A and ttype is not None:
                n, pos = _varint_at(head, pos)
                if pos + n != end:
                    return None
                return _Record(offset, tag, ttype, dims, n, extra=[head[pos:]])
            else:
                return None
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def _next_record(s: _Stream) -> _Record:
    offset = s.pos
    key = s.read(1, "record key")[0]
    if key != 0x0A:
        s.fail(offset, f"expected a record (byte 0x0a), found 0x{key:02x}: not a MindSpore checkpoint, or damaged")
    length = s.varint("record length")
    if s.pos + length > s.end:
        s.fail(offset, f"truncated: the record declares {length} bytes but only {s.end - s.pos} remain in the file")
    if length <= SMALL_RECORD:
        return _parse_small(s, offset, s.read(length, "record"))
    head = s.read(min(length, 1 << 16), "record header")
    rec = _parse_head(s, offset, length, head)
    if rec is None:  # not MindSpore's layout: parse it whole
        return _parse_small(s, offset, head + s.read(length - len(head), "record"))
    return rec


@dataclass
class _Pending:
    rec: _Record
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    nbytes: int
    want: bool
    buf: torch.Tensor | None = None
    parts: list = field(default_factory=list)
    filled: int = 0
    records: int = 0


def _start(s: _Stream, rec: _Record, want: bool) -> _Pending:
    if rec.tensor_type == "str":
        return _Pending(rec, None, (), -1, want)
    if rec.tensor_type == "Int4":
        s.fail(rec.offset, f"tensor {rec.tag!r} has type Int4 (MindSpore qint4x2, two 4-bit values per byte); "
                           "mff does not decode packed int4 tensors")
    dtype = MS_DTYPES.get(rec.tensor_type)
    if dtype is None:
        s.fail(rec.offset, f"tensor {rec.tag!r} has unknown tensor_type {rec.tensor_type!r}; expected one of {sorted(MS_DTYPES)} or 'str'")
    if any(d < 0 for d in rec.dims):
        s.fail(rec.offset, f"tensor {rec.tag!r} has negative dims {rec.dims}")
    shape = () if rec.dims in ([], [0]) else tuple(rec.dims)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # bytes of this tensor the file can still hold: this record's content (read or not) and all that follows
    avail = s.end - s.pos + (rec.content_len if rec.content is not None else sum(len(x) for x in rec.extra))
    if nbytes > avail:
        s.fail(rec.offset, f"tensor {rec.tag!r}: dims {rec.dims} of {rec.tensor_type} need {nbytes} bytes but the file has only "
                           f"{avail} left: damaged or truncated")
    buf = torch.empty(nbytes, dtype=torch.uint8) if want else None
    return _Pending(rec, dtype, shape, nbytes, want, buf)


def _add(s: _Stream, p: _Pending, rec: _Record):
    if rec.tensor_type != p.rec.tensor_type or rec.dims != p.rec.dims:
        s.fail(rec.offset, f"record {rec.tag!r} continues a tensor of {p.rec.tensor_type} {p.rec.dims} with {rec.tensor_type} {rec.dims}")
    p.records += 1
    n = rec.content_len
    if p.dtype is None:  # string: keep the (small) bytes
        p.parts.append(rec.content if rec.content is not None else _read_rest(s, rec))
        return
    if p.filled + n > p.nbytes:
        s.fail(rec.offset, f"tensor {rec.tag!r}: its records hold more than the {p.nbytes} bytes its dims {p.rec.dims} "
                           f"of {p.rec.tensor_type} need")
    if not p.want:
        if rec.content is None:
            s.skip(n - sum(len(x) for x in rec.extra), f"content of {rec.tag!r}")
        p.filled += n
        return
    dest = p.buf.numpy().data[p.filled:p.filled + n]
    if rec.content is not None:
        dest[:] = rec.content
    else:
        got = 0
        for piece in rec.extra:  # bytes already read with the header
            dest[got:got + len(piece)] = piece
            got += len(piece)
        s.read_into(dest[got:], f"content of {rec.tag!r}")
    p.filled += n


def _read_rest(s: _Stream, rec: _Record) -> bytes:
    done = b"".join(bytes(x) for x in rec.extra)
    return done + s.read(rec.content_len - len(done), f"content of {rec.tag!r}")


def _finish(s: _Stream, p: _Pending) -> torch.Tensor | str | None:
    if p.dtype is None:
        raw = b"".join(p.parts)
        if len(raw) % 4:
            s.fail(p.rec.offset, f"string {p.rec.tag!r}: {len(raw)} bytes is not whole UTF-32 characters")
        try:
            return raw.decode("utf-32-le").rstrip("\x00") if p.want else None
        except UnicodeDecodeError as e:
            s.fail(p.rec.offset, f"string {p.rec.tag!r} is not valid UTF-32-LE: {e}")
    if p.rec.dims == [0] and p.filled == 0:  # an empty 1-D tensor (MindSpore writes it as dims [0], no bytes)
        return torch.empty(0, dtype=p.dtype) if p.want else None
    if p.filled != p.nbytes:
        s.fail(p.rec.offset, f"tensor {p.rec.tag!r}: {p.records} record(s) hold {p.filled} bytes but dims {p.rec.dims} of "
                             f"{p.rec.tensor_type} need {p.nbytes}")
    if not p.want:
        return None
    return p.buf.view(p.dtype).reshape(p.shape)


def _walk(path, verify_crc: bool, want: Callable[[str], bool]) -> Iterator[tuple[_Record, torch.Tensor | str | None]]:
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise MindSporeCheckpointError(f"cannot open MindSpore checkpoint {path}: {e.strerror or e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise MindSporeCheckpointError(f"{path} is empty (0 bytes): not a MindSpore checkpoint")
        _check_start(f, path, size)
        end, stored = _data_end(f, size)
        if verify_crc and stored is None:
            raise MindSporeCheckpointError(f"{path} has no CRC trailer (b'crc_num' + 10 bytes; written without crc_check=True), "
                                           "so verify_crc=True cannot check it")
        s = _Stream(f, path, end, verify_crc)
        pending: _Pending | None = None
        while s.pos < s.end:
            rec = _next_record(s)
            if pending is None or rec.tag != pending.rec.tag:
                if pending is not None:
                    yield pending.rec, _finish(s, pending)
                pending = _start(s, rec, want(rec.tag))
            _add(s, pending, rec)
        if pending is not None:
            yield pending.rec, _finish(s, pending)
        if verify_crc and s.crc != stored:
            raise MindSporeCheckpointError(f"{path}: CRC mismatch: the trailer says {stored:#010x} but bytes 0..{end} give "
                                           f"{s.crc:#010x}; the file is damaged")


def iter_ckpt(path: str | os.PathLike, verify_crc: bool = False) -> Iterator[tuple[str, torch.Tensor | str]]:
    """Stream the entries of a MindSpore ``.ckpt`` file as ``(tag, value)`` in file order.

    Format: ``docs/mindformers_formats.md`` section 2 (MindSpore 2.10
    ``train/serialization.py``). Consecutive records with the same tag (a tensor > 512 MiB cut
    into chunks) are joined into one tensor of the stored ``dims``. Values are CPU tensors of
    the stored dtype (``BFloat16`` -> ``torch.bfloat16`` bit-exact, ``Bool`` -> ``torch.bool``,
    unsigned -> ``torch.uint16/32/64``); scalars (``dims`` ``[]``, or ``[0]`` for a non-string)
    are 0-d tensors; ``str`` entries (``append_dict`` strings) are python ``str``. Only one tensor
    is in memory at a time besides those the caller keeps; its bytes are read from the file
    straight into the returned tensor.

    With ``verify_crc`` every byte goes through zlib CRC32 and the trailer is checked after the
    last entry (so a mismatch is raised when the iteration ends, after the entries were yielded).

    Raises:
        MindSporeCheckpointError: encrypted file ("... is encrypted ..."), not a checkpoint,
            truncated or damaged record (file and byte offset named), map tensor, ``Int4``
            (packed qint4x2, not decoded) or unknown ``tensor_type``, chunks that do not add up
            to ``dims``, missing trailer with ``verify_crc=True``, CRC mismatch.
    """
    for rec, value in _walk(path, verify_crc, lambda tag: True):
        yield rec.tag, value


def read_ckpt(path: str | os.PathLike, verify_crc: bool = False, names: Container[str] | None = None) -> dict[str, torch.Tensor | str]:
    """All entries of a ``.ckpt`` file (or only those whose tag is in ``names``) as a dict in
    file order; see :func:`iter_ckpt` for the values and errors. Entries not wanted are skipped
    with a seek (read only when ``verify_crc`` needs their bytes)."""
    want = (lambda tag: True) if names is None else (lambda tag: tag in names)
    return {rec.tag: value for rec, value in _walk(path, verify_crc, want) if want(rec.tag)}


def ckpt_names(path: str | os.PathLike) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(tag, tensor_type, shape)`` of every entry, in file order, without reading tensor
    contents (seeks over them). ``shape`` is the shape :func:`iter_ckpt` gives: ``()`` for scalars
    and ``str`` entries, else the stored ``dims``. Errors as :func:`iter_ckpt`."""
    out = []
    for rec, _ in _walk(path, False, lambda tag: False):
        dims = () if rec.tensor_type == "str" or rec.dims in ([], [0]) else tuple(rec.dims)
        out.append((rec.tag, rec.tensor_type, dims))
    return out


def is_mindspore_ckpt(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file whose first record header parses as a MindSpore checkpoint
    record (``0x0a <len> 0x0a <tag len> <tag> 0x12|0x1a``). Encrypted ``.ckpt`` files give False."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 12)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    try:
        if head[:1] != b"\x0a":
            return False
        length, pos = _varint_at(head, 1)
        if pos + length > size or head[pos] != 0x0A:
            return False
        n, p2 = _varint_at(head, pos + 1)
        if p2 + n >= min(len(head), pos + length):
            return False
        head[p2:p2 + n].decode("utf-8")
        return head[p2 + n] in (0x12, 0x1A)
    except (IndexError, ValueError, UnicodeDecodeError):
        return False


# ---------------------------------------------------------------- writing

def _record_header(tag: bytes, dims: list[int], ttype: bytes, content_len: int) -> bytes:
    """The bytes before ``tensor_content`` of one ``Checkpoint`` record holding one tensor, laid
    out as protobuf serializes it (fields in number order)."""
    tensor = b"".join(b"\x08" + _varint_bytes(d) for d in dims)
    tensor += b"\x12" + _varint_bytes(len(ttype)) + ttype + b"\x1a" + _varint_bytes(content_len)
    tensor_len = len(tensor) + content_len
    value = b"\x0a" + _varint_bytes(len(tag)) + tag + b"\x12" + _varint_bytes(tensor_len) + tensor
    return b"\x0a" + _varint_bytes(len(value) + content_len) + value


def _metadata_tensor(name: str, v) -> torch.Tensor | str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float32)  # MindSpore: Tensor(python float) is float32
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return v
    raise MindSporeCheckpointError(f"metadata {name!r}: expected int, float, bool, str or a 0-d tensor, got {type(v).__name__}")


def write_ckpt(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]] | Iterable[tuple[str, torch.Tensor | Callable[[], torch.Tensor]]],
    metadata: Mapping[str, int | float | str | bool] | None = None,
    crc: bool = False,
) -> int:
    """Write a MindSpore ``.ckpt`` file that ``mindspore.load_checkpoint`` reads; return its size in bytes.

    Format: ``docs/mindformers_formats.md`` section 2 (MindSpore 2.10
    ``train/serialization.py`` ``_exec_save``): one record per tensor, tensors of more than
    :data:`SLICE_BYTES` (512 MiB) cut into byte chunks, each a record with the same tag and the
    full dims (as ``_write_parameter_bytes_data``). ``tensors`` is a mapping or an iterable of
    ``(name, tensor)``; a value may be a zero-argument callable producing the tensor, called when
    it is written, so a large model need never be in memory at once. Tensors may be on any
    device and DTensors (gathered; copied to CPU one at a time); dtypes: see :data:`TORCH_TO_MS`. A python ``str``
    value is written as MindSpore writes ``append_dict`` strings. ``metadata`` entries follow
    the tensors: ``int`` -> Int64 scalar, ``float`` -> Float32 scalar (as MindSpore's
    ``Tensor(float)``), ``bool`` -> Bool, ``str`` -> str. ``crc=True`` appends the
    ``crc_num`` trailer (``crc_check=True``).

    The file is written to a temp name in the same folder and renamed into place; on any error
    the temp file is removed.

    Raises:
        FileNotFoundError: the target folder does not exist.
        MindSporeCheckpointError: a dtype MindSpore cannot store, a duplicate or empty name, a
            value that is not a tensor / str / callable, bad metadata.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    meta = [(k, _metadata_tensor(k, v)) for k, v in (metadata or {}).items()]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    total, running = 0, 0
    seen: set[str] = set()
    try:
        with open(tmp, "wb") as f:
            def emit(b):
                nonlocal total, running
                f.write(b)
                total += len(b)
                if crc:
                    running = zlib.crc32(b, running)

            for name, value in _chain(items, meta):
                if not isinstance(name, str) or not name:
                    raise MindSporeCheckpointError(f"tensor names must be non-empty strings, got {name!r}")
                if name in seen:
                    raise MindSporeCheckpointError(f"tensor {name!r} is given twice; MindSpore would join the two into one")
                seen.add(name)
                if callable(value) and not isinstance(value, torch.Tensor):
                    value = value()
                _write_entry(emit, name, value)
            if crc:
                f.write(_CRC_MAGIC + running.to_bytes(10, "big"))
                total += _CRC_TRAILER
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return total


def _chain(*its):
    for it in its:
        yield from it


def _write_entry(emit, name: str, value):
    tag = name.encode("utf-8")
    if isinstance(value, str):
        content = value.encode("utf-32-le") or b"\x00" * 4  # numpy U1 for ""
        emit(_record_header(tag, [0], b"str", len(content)))
        emit(content)
        return
    if not isinstance(value, torch.Tensor):
        raise MindSporeCheckpointError(f"tensor {name!r}: expected a torch.Tensor, str or a callable producing one, got {type(value).__name__}")
    if value.dtype not in TORCH_TO_MS:
        raise MindSporeCheckpointError(f"tensor {name!r}: dtype {value.dtype} has no MindSpore checkpoint type; "
                                       f"supported: {sorted(str(d) for d in TORCH_TO_MS)}")
    if hasattr(value, "full_tensor"):  # a DTensor: gather it
        value = value.full_tensor()
    t = value.detach().to("cpu").contiguous()
    ttype = TORCH_TO_MS[t.dtype].encode()
    dims = list(t.shape)
    data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
    n = len(data)
    if n <= SLICE_BYTES:
        emit(_record_header(tag, dims, ttype, n))
        emit(data)
        return
    for start in range(0, n, SLICE_BYTES):
        piece = data[start:start + SLICE_BYTES]
        emit(_record_header(tag, dims, ttype, len(piece)))
        emit(piece)
