"""Sharding as data: a family's table maps param path patterns to logical axes per tensor dim;
the run maps logical axes to mesh axes; the two give each param its DTensor placements.

Rules (first matching row wins; see ``mff.tree`` for the pattern syntax):
- a param that no row matches is an error;
- a row whose number of logical axes differs from the param's ndim is an error;
- ``Shard`` on a mesh axis of size 1 is ``Replicate``;
- a logical axis may map to several mesh axes: the dim is then split over all of them, outer
  axis first (dense params' ``embed`` dim is FSDP-sharded over ``dp_shard`` and ``ep``);
- a dim whose size does not divide the product of its mesh axes is an error naming the param,
  the dim and the sizes;
- a logical axis may be written ``(name, unit)``: the dim is made of blocks of ``unit``
  elements that are never cut (attention heads of ``head_dim`` rows), so the *number of
  blocks* must divide (``num_key_value_heads`` 2 does not divide tp 4, even though 2 x 128
  rows would);
- the ``vocab`` axis (:data:`UNEVEN_AXES`) may split unevenly: its rows are cut as
  ``torch.chunk`` cuts them (DTensor's ``Shard``; parts of ``ceil(V / n)`` rows, the last
  shorter), which is the vocabulary padded to a multiple of n with the padding rows left
  unstored, so they can never be predicted; every rank must hold at least one row;
- a mesh axis shards at most one dim of a param (the first dim mapped to it): a stacked expert
  tensor's ``expert`` dim takes ``ep``, so its ``embed`` dim is split over ``dp_shard`` only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from mff.tree import first_match

__all__ = ["ShardingTable", "LogicalAxis", "UNEVEN_AXES", "AxisMap", "DEFAULT_AXIS_MAP", "resolve_placements", "shard_params", "placements_of", "describe_placement"]

LogicalAxis = "str | tuple[str, int] | None"
ShardingTable = Sequence[tuple[str, tuple[LogicalAxis, ...]]]

AxisMap = Mapping[str, "str | tuple[str, ...] | None"]

DEFAULT_AXIS_MAP: AxisMap = {
    "embed": ("dp_shard", "ep"),
    "lora": ("dp_shard", "ep"),
    "vocab": "tp",
    "heads": "tp",
    "mlp": "tp",
    "expert": "ep",
}
"""Logical axis -> mesh axis or axes (None = never sharded). ``embed`` (the hidden dim) is the
dim FSDP splits (and ``lora``, MLA's low-rank dims); ``expert`` the stacked-expert dim EP splits."""

UNEVEN_AXES = frozenset({"vocab"})
"""Logical axes whose dim may split unevenly (``torch.chunk`` sizes; see the module docstring)."""


def resolve_placements(
    path: str,
    shape: Sequence[int],
    table: ShardingTable,
    mesh: DeviceMesh,
    axis_map: AxisMap = DEFAULT_AXIS_MAP,
) -> tuple[Placement, ...]:
    """Placements of param ``path`` (global ``shape``) on ``mesh``: one per mesh axis.

    Raises:
        ValueError: no table row matches ``path``; the row's axes do not fit ``shape``; an
            unknown logical axis; a dim (or its number of ``unit`` blocks) that does not divide
            its mesh axes; an uneven axis that would leave a rank without rows.
    """
    hit = first_match(path, table)
    if hit is None:
        raise ValueError(f"param {path!r}: no row of the sharding table matches it")
    pattern, axes = hit
    if len(axes) != len(shape):
        raise ValueError(f"param {path!r} has {len(shape)} dims {tuple(shape)}, but sharding row {pattern!r} names {len(axes)} axes {axes}")
    names = list(mesh.mesh_dim_names or ())
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for dim, logical in enumerate(axes):
        if logical is None:
            continue
        unit = 1
        if isinstance(logical, tuple):
            logical, unit = logical
            if shape[dim] % unit:
                raise ValueError(f"param {path!r}: dim {dim} of size {shape[dim]} is not a whole number of {logical} of {unit}")
        if logical not in axis_map:
            raise ValueError(f"param {path!r}: logical axis {logical!r} (row {pattern!r}) is not in the axis map {sorted(axis_map)}")
        mapped = axis_map[logical]
        mesh_axes = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
        use = [names.index(a) for a in mesh_axes
               if a in names and mesh.size(names.index(a)) > 1 and not isinstance(placements[names.index(a)], Shard)]
        if not use:
            continue
        total = math.prod(mesh.size(i) for i in use)
        sizes = " x ".join(f"{names[i]} {mesh.size(i)}" for i in use)
        blocks = shape[dim] // unit
        if logical in UNEVEN_AXES:
            if (total - 1) * -(-blocks // total) >= blocks:
                raise ValueError(f"param {path!r}: dim {dim} of size {shape[dim]} ({logical}) split over mesh axes {sizes} = {total} "
                                 f"in parts of {-(-blocks // total)} leaves the last rank no rows")
        elif blocks % total:
            if unit > 1:
                raise ValueError(f"param {path!r}: dim {dim} of size {shape[dim]} holds {blocks} {logical} of {unit} rows; "
                                 f"{blocks} {logical} do not split evenly over mesh axes {sizes} = {total}")
            raise ValueError(f"param {path!r}: dim {dim} of size {shape[dim]} ({logical}) does not divide mesh axes {sizes} = {total}")
        for i in use:
            placements[i] = Shard(dim)
    return tuple(placements)


def shard_params(
    params: Mapping[str, torch.Tensor],
    table: ShardingTable,
    mesh: DeviceMesh,
    axis_map: AxisMap = DEFAULT_AXIS_MAP,
) -> dict[str, DTensor]:
    """Distribute full tensors (the same on every rank) into DTensors on ``mesh``.

    ``requires_grad`` is carried over. Raises as :func:`resolve_placements`.
    """
    out = {}
    for path, t in params.items():
        placements = resolve_placements(path, t.shape, table, mesh, axis_map)
        d = distribute_tensor(t.detach(), mesh, placements)
        out[path] = d.requires_grad_(t.requires_grad)
    return out


def describe_placement(placements: Sequence[Placement], mesh: DeviceMesh) -> str:
    """Human-readable placements, ``dp_shard:S(0)`` per sharded axis or ``replicated``."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    parts = [f"{n}:S({p.dim})" for n, p in zip(names, placements) if isinstance(p, Shard)]
    return " ".join(parts) if parts else "replicated"


def placements_of(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{path: description}`` of each DTensor leaf's placements (plain tensors: ``local``)."""
    out = {}
    for path, t in params.items():
        out[path] = describe_placement(t.placements, t.device_mesh) if isinstance(t, DTensor) else "local"
    return out
