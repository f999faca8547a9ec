"""How much of each param a device holds, from the family's sharding table and the mesh sizes
alone (no process group, no DeviceMesh, no storage).

The placements come from :func:`mff.parallel.sharding.resolve_placements` itself, called on
:class:`MeshSizes` (the sizes and axis names it reads of a mesh), so the planner follows the
run's rules exactly and raises the run's errors (a dim that does not divide its mesh axes, a
param no row matches). From the placements, :func:`local_shape` gives the largest shard a
device holds: each ``Shard(d)`` cuts dim d into ``n`` parts as ``torch.chunk`` (and DTensor)
cut it, ``ceil(size / n)`` rows for the first parts, nested splits of one dim applied outer
axis first; coordinate 0 of every axis holds the largest part.

:func:`param_shards` adds what a device holds while it computes: each param gathered over the
data-parallel axes (FSDP's all-gather) keeping its tensor-parallel split and, for stacked
experts, its ``ep`` split (the ``expert`` dim), as :func:`mff.parallel.gather.gather` and
``gather_for_step`` do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard

from mff.optim.muon import DEFAULT_ADAMW_PATTERNS
from mff.parallel.mesh import DATA_AXES, MESH_AXES
from mff.parallel.sharding import DEFAULT_AXIS_MAP, AxisMap, resolve_placements
from mff.tree import first_match, matches

__all__ = ["MeshSizes", "local_shape", "ParamShard", "param_shards"]


class MeshSizes:
    """The part of a :class:`~torch.distributed.device_mesh.DeviceMesh` that
    :func:`~mff.parallel.sharding.resolve_placements` reads: axis names and sizes. ``sizes``
    maps each of :data:`mff.parallel.MESH_AXES` to its size (missing axes are 1)."""

    mesh_dim_names = MESH_AXES

    def __init__(self, sizes: Mapping[str, int]):
        unknown = set(sizes) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; expected {MESH_AXES}")
        self.shape = tuple(int(sizes.get(a, 1)) for a in MESH_AXES)
        self.ndim = len(self.shape)

    def size(self, i: int) -> int:
        return self.shape[i]


def local_shape(shape: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int]) -> tuple[int, ...]:
    """The largest local shard of a tensor of global ``shape`` with ``placements`` on a mesh of
    ``sizes`` (one per placement): ``Shard(d)`` on an axis of size n leaves ``ceil(rows / n)``
    rows of dim d (``torch.chunk``'s first part), applied in mesh-axis order."""
    out = list(shape)
    for p, n in zip(placements, sizes):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // n)
    return tuple(out)


@dataclass(frozen=True)
class ParamShard:
    """What a device holds of one param (numbers of elements).

    Attributes:
        path: the param path; ``shape``: its global shape; ``local_shape``: its largest shard's.
        local: elements of the largest local shard (what the device stores between steps).
        gathered: elements after gathering over the data-parallel axes (what it computes with).
        trainable: has a gradient and optimizer state (not the MoE expert bias).
        fp32: kept in fp32 in every precision (router weight, expert bias).
        matrix: a Muon param (>= 2-D, not an embedding or output head): Muon keeps one moment.
    """

    path: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    local: int
    gathered: int
    trainable: bool
    fp32: bool
    matrix: bool


_LAYER = re.compile(r"^model\.layers\.\d+\.")


def _index_free(patterns) -> bool:
    """True when no pattern can tell one layer index from another (no digit in it: ``*`` and
    ``**`` match every index alike), so params of equal shape whose paths differ only in their
    ``model.layers.{i}`` index resolve alike."""
    return not any(re.search(r"\d", p) for p in patterns)


def param_shards(model, sizes: Mapping[str, int], axis_map: AxisMap = DEFAULT_AXIS_MAP,
                 adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS, paths: Sequence[str] | None = None) -> dict[str, ParamShard]:
    """:class:`ParamShard` of each param of ``model`` (an :class:`mff.model.Model`; only
    ``paths`` when given) on a mesh of ``sizes``.

    The placements and flags of a param are resolved once per kind: params whose paths differ
    only in the decoder layer index (``model.layers.{i}``) and whose shapes are equal share them
    when no pattern of the sharding table, the frozen and fp32 lists or ``adamw_patterns`` names
    an index, so the time grows with the param count, not with it times the table's rows.

    Raises:
        ValueError: as :func:`mff.parallel.sharding.resolve_placements` (a dim that does not
            divide its mesh axes, naming the param; a param no table row matches).
    """
    mesh = MeshSizes(sizes)
    table = model.sharding_table
    shapes = model.param_shapes()
    family = getattr(model, "family", None)
    patterns = [p for p, _ in table] + list(adamw_patterns) + list(getattr(family, "frozen_params", ())) + list(getattr(family, "fp32_params", ()))
    share = _index_free(patterns)
    kinds: dict[tuple, tuple] = {}
    out = {}
    for path in (paths if paths is not None else shapes):
        shape = tuple(shapes[path])
        key = (_LAYER.sub("model.layers.#.", path), shape) if share else (path, shape)
        got = kinds.get(key)
        if got is None:
            placements = resolve_placements(path, shape, table, mesh, axis_map)
            hit = first_match(path, table)
            keep = {"tp"} | ({"ep"} if hit is not None and "expert" in hit[1] else set())
            data = [Replicate() if axis in DATA_AXES and axis not in keep else p for axis, p in zip(MESH_AXES, placements)]
            mine = local_shape(shape, placements, mesh.shape)
            got = kinds[key] = (mine, math.prod(mine), math.prod(local_shape(shape, data, mesh.shape)), model.is_trainable(path),
                                model.is_fp32(path), len(shape) >= 2 and not any(matches(p, path) for p in adamw_patterns))
        mine, local, gathered, trainable, fp32, matrix = got
        out[path] = ParamShard(path=path, shape=shape, local_shape=mine, local=local, gathered=gathered, trainable=trainable,
                               fp32=fp32, matrix=matrix)
    return out
