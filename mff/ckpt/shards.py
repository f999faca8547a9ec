"""Per-rank shard files of a checkpoint: which piece of each tensor a rank holds and writes,
the piece index kept in ``meta.msgpack``, and reading any region of a tensor back from the
pieces, so a checkpoint saved on one mesh loads onto another.

A DTensor's local shard is the block left after splitting its global shape, mesh axis by mesh
axis (outermost first), along the dim each ``Shard(d)`` names (DTensor's own rule; two axes
sharding the same dim nest: the inner axis splits the outer axis's block). A split that does not
divide evenly follows ``torch.chunk`` (parts of ``ceil(n / size)``, the last ranks shorter: a
vocabulary split over tp). ``Shard`` on a size-1
axis and ``Replicate`` leave the block whole; of ranks holding the same block, only the one at
coordinate 0 on every such axis writes it, so each element is stored once.

The index (``meta["layout"]``)::

    {"world_size": W,
     "meshes": [{"axes": [...], "shape": [...]}, ...],
     "tensors": {"model": {name: entry}, "optim": {name: entry}}}
    entry = {"shape": [...], "dtype": "float32", "mesh": i (into meshes, or None for a plain
             tensor), "placements": ["R", "S(0)", ...] (one per mesh axis),
             "pieces": [{"file": "model-rank00001-of-00002.safetensors",
                         "offset": [...], "length": [...]}, ...]}

Each piece file holds a piece under the tensor's own name. Checkpoints without an index (mff's
single-file layout before sharded saving) are read as one whole piece per tensor.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from mff.parallel.tp import chunk_range

__all__ = [
    "encode_placements",
    "decode_placements",
    "shard_region",
    "writes_piece",
    "piece_file",
    "tensor_entry",
    "ShardedTensors",
]

_SHARD_RE = re.compile(r"S\((\d+)\)\Z")


class ShardIndexError(ValueError):
    """A piece index that does not describe its tensors (turned into CheckpointError by callers)."""


def encode_placements(placements: Sequence[Placement]) -> list[str]:
    """``["R", "S(0)", ...]``: one string per mesh axis.

    Raises:
        ValueError: a placement other than ``Replicate`` or ``Shard`` (e.g. ``Partial``, which
            params and optimizer state never have).
    """
    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(f"S({p.dim})")
        elif isinstance(p, Replicate):
            out.append("R")
        else:
            raise ValueError(f"placement {p} cannot be checkpointed (only Replicate and Shard)")
    return out


def decode_placements(codes: Sequence[str]) -> list[Placement]:
    """Inverse of :func:`encode_placements`. Raises ValueError for an unknown code."""
    out: list[Placement] = []
    for c in codes:
        m = _SHARD_RE.match(str(c))
        if m:
            out.append(Shard(int(m.group(1))))
        elif c == "R":
            out.append(Replicate())
        else:
            raise ValueError(f"unknown placement {c!r} (expected 'R' or 'S(<dim>)')")
    return out


def _is_split(p: Placement, size: int) -> bool:
    return type(p) is Shard and size > 1


def shard_region(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                 placements: Sequence[Placement]) -> tuple[list[int], list[int]]:
    """``(offset, length)`` per tensor dim of the block a rank at mesh coordinate ``coord``
    holds of a tensor of global ``shape`` with ``placements`` (one per mesh axis).

    Follows DTensor's sharding (``torch.distributed.tensor``: each mesh axis in order splits
    the current block of dim ``d`` into ``mesh_shape[axis]`` parts as ``torch.chunk`` does;
    rank ``coord[axis]`` keeps part ``coord[axis]``, which may be shorter or empty).

    Raises:
        ValueError: lengths that differ (``mesh_shape``, ``coord``, ``placements``), a coordinate
            outside the mesh or a Shard dim outside ``shape``.
    """
    if not len(mesh_shape) == len(coord) == len(placements):
        raise ValueError(f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(coord)} and placements {tuple(placements)} differ in length")
    offset, length = [0] * len(shape), [int(s) for s in shape]
    for axis, (size, c, p) in enumerate(zip(mesh_shape, coord, placements)):
        if not 0 <= c < size:
            raise ValueError(f"coordinate {tuple(coord)} is outside the mesh {tuple(mesh_shape)}")
        if isinstance(p, Shard) and type(p) is not Shard:
            raise ValueError(f"placement {p} on mesh axis {axis} is not supported (only Replicate and Shard)")
        if not _is_split(p, size):
            continue
        d = p.dim
        if not 0 <= d < len(shape):
            raise ValueError(f"Shard({d}) on mesh axis {axis} of a {len(shape)}-d tensor")
        start, stop = chunk_range(length[d], c, size)
        offset[d] += start
        length[d] = stop - start
    return offset, length


def writes_piece(mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]) -> bool:
    """Whether the rank at ``coord`` writes its block: it is at coordinate 0 on every mesh axis
    that does not split the tensor (the lowest of the replicas holding the same block)."""
    return all(c == 0 for size, c, p in zip(mesh_shape, coord, placements) if not _is_split(p, size))


def piece_file(kind: str, rank: int, world_size: int) -> str:
    """The file a rank writes its ``kind`` ("model" or "optim") pieces to:
    ``model.safetensors`` on one process, else ``model-rank00003-of-00004.safetensors``."""
    if world_size == 1:
        return f"{kind}.safetensors"
    return f"{kind}-rank{rank:05d}-of-{world_size:05d}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_entry(kind: str, t: torch.Tensor, mesh_index: int | None, world_size: int) -> dict:
    """The index entry of tensor ``t`` (a DTensor, or a plain tensor that rank 0 writes whole):
    global shape, dtype, placements and every piece with the file that holds it.

    Computed from the placements and the mesh alone (no collective): rank 0 lists the pieces
    of all ranks."""
    if not isinstance(t, DTensor):
        return {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "mesh": None, "placements": [],
                "pieces": [{"file": piece_file(kind, 0, world_size), "offset": [0] * t.dim(), "length": list(t.shape)}]}
    mesh = t.device_mesh
    ranks = mesh.mesh.tolist() if mesh.ndim else [mesh.mesh.item()]
    pieces = []
    for coord in itertools.product(*(range(s) for s in mesh.shape)):
        if not writes_piece(mesh.shape, coord, t.placements):
            continue
        rank = ranks
        for c in coord:
            rank = rank[c]
        offset, length = shard_region(t.shape, mesh.shape, coord, t.placements)
        pieces.append({"file": piece_file(kind, int(rank), world_size), "offset": offset, "length": length})
    return {"shape": list(t.shape), "dtype": _dtype_name(t.dtype), "mesh": mesh_index,
            "placements": encode_placements(t.placements), "pieces": pieces}


def _overlap(a_off: Sequence[int], a_len: Sequence[int], b_off: Sequence[int], b_len: Sequence[int]):
    """Per dim ``(start, stop)`` of the intersection of two blocks, or None when it is empty."""
    out = []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


class ShardedTensors:
    """The ``kind`` ("model" or "optim") tensors of a step dir, read region by region from
    their piece files (each opened once, memory-mapped, by ``safetensors.safe_open``).

    Also serves as a tensor source for :func:`mff.ckpt.hf.load_hf_tensors` (``names``,
    ``shape``, ``shards``, ``read``), assembling one whole tensor at a time.

    Raises (on construction): ShardIndexError for a malformed index; OSError/ValueError from
    reading the header of a checkpoint without an index (see :meth:`_open`).
    """

    def __init__(self, step_dir: str | os.PathLike, meta: Mapping, kind: str):
        self.step_dir = Path(step_dir)
        self.kind = kind
        self._handles: dict[str, object] = {}
        layout = meta.get("layout")
        if layout is None:
            self.where = str(self.step_dir / f"{kind}.safetensors")
            self.entries = self._single_file_index(f"{kind}.safetensors")
        else:
            one = isinstance(layout, Mapping) and layout.get("world_size") == 1
            self.where = str(self.step_dir / f"{kind}.safetensors") if one else f"{self.step_dir} ({kind} shard files)"
            try:
                self.entries = dict(layout["tensors"][kind])
            except (KeyError, TypeError):
                raise ShardIndexError(f"{self.step_dir}/meta.msgpack: the layout index has no {kind!r} tensors") from None
            for name, e in self.entries.items():
                self._check_entry(name, e)

    def _single_file_index(self, fname: str) -> dict[str, dict]:
        h = self._open(fname)
        entries = {}
        for name in h.keys():
            sl = h.get_slice(name)
            shape = list(sl.get_shape())
            entries[name] = {"shape": shape, "dtype": None, "pieces": [{"file": fname, "offset": [0] * len(shape), "length": shape}]}
        return entries

    def _check_entry(self, name: str, e: Mapping) -> None:
        try:
            shape = [int(s) for s in e["shape"]]
            getattr(torch, e["dtype"])
            volume = 0
            for p in e["pieces"]:
                if len(p["offset"]) != len(shape) or len(p["length"]) != len(shape) or Path(p["file"]).name != p["file"]:
                    raise ValueError(p)
                if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(p["offset"], p["length"], shape)):
                    raise ValueError(p)
                volume += math.prod(p["length"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ShardIndexError(f"{self.step_dir}/meta.msgpack: malformed layout entry for {self.kind} tensor {name!r}: {err}") from None
        if volume != math.prod(shape):
            raise ShardIndexError(f"{self.step_dir}/meta.msgpack: the pieces of {self.kind} tensor {name!r} cover {volume} elements, "
                                  f"its shape {tuple(shape)} has {math.prod(shape)}")

    def _open(self, fname: str):
        """The safe_open handle of piece file ``fname`` (cached).

        Raises:
            FileNotFoundError: the file is missing.
            ValueError: it is not a readable safetensors file (corrupt or truncated).
        """
        h = self._handles.get(fname)
        if h is None:
            path = self.step_dir / fname
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint file {path} is missing")
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:
                raise ValueError(f"checkpoint file {path} is corrupt or truncated: {e}") from None
            self._handles[fname] = h
        return h

    def close(self) -> None:
        """Drop the open file handles."""
        self._handles.clear()

    @property
    def names(self) -> list[str]:
        """Every tensor name."""
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """The global shape of ``name``."""
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype | None:
        """The stored dtype of ``name`` (None for a single-file checkpoint without an index)."""
        d = self.entries[name]["dtype"]
        return getattr(torch, d) if d is not None else None

    def read_region(self, name: str, offset: Sequence[int], length: Sequence[int]) -> torch.Tensor:
        """The block ``[offset, offset + length)`` of tensor ``name`` as a fresh contiguous CPU
        tensor, copied from the overlapping slices of its pieces only.

        Raises:
            KeyError: no tensor ``name``.
            ValueError: a corrupt piece file, a piece whose stored shape or dtype differs from
                the index, or a region that the pieces do not cover.
        """
        entry = self.entries[name]
        if math.prod(length) == 0:
            return torch.empty(tuple(length), dtype=self.dtype(name) or torch.float32)
        out: torch.Tensor | None = None
        covered = 0
        for p in entry["pieces"]:
            ov = _overlap(offset, length, p["offset"], p["length"])
            if ov is None:
                continue
            h = self._open(p["file"])
            try:
                sl = h.get_slice(name)
            except Exception:
                raise ValueError(f"checkpoint file {self.step_dir / p['file']} lacks the piece of {name!r} the index puts there") from None
            if list(sl.get_shape()) != list(p["length"]):
                raise ValueError(f"checkpoint file {self.step_dir / p['file']}: piece of {name!r} has shape {tuple(sl.get_shape())}, "
                                 f"the index says {tuple(p['length'])}")
            src = tuple(slice(lo - po, hi - po) for (lo, hi), po in zip(ov, p["offset"]))
            try:
                part = sl[src] if src else sl[...]
            except Exception as e:
                raise ValueError(f"checkpoint file {self.step_dir / p['file']} is corrupt or truncated: {e}") from None
            if out is None:
                out = torch.empty(tuple(length), dtype=part.dtype)
            elif part.dtype != out.dtype:
                raise ValueError(f"{self.where}: the pieces of {name!r} have different dtypes ({out.dtype}, {part.dtype})")
            dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(ov, offset))
            out[dst].copy_(part)
            covered += math.prod(hi - lo for lo, hi in ov)
        if out is None or covered != math.prod(length):
            raise ValueError(f"{self.where}: the pieces of {name!r} do not cover the block at offset {tuple(offset)} of "
                             f"size {tuple(length)}")
        return out

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (assembled from all its pieces)."""
        return self.read_region(name, [0] * len(self.shape(name)), list(self.shape(name)))

    # --- tensor source for mff.ckpt.hf.load_hf_tensors: one pseudo-shard holding everything
    def shards(self) -> Iterator[tuple[str, ShardedTensors]]:
        """``(where, self)``: one shard whose ``get_tensor`` assembles a whole tensor."""
        yield self.where, self

    def keys(self):
        return self.entries.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.read(name)
