"""The resolved placements as a short table for the start-up log: params grouped by placement,
layer indices folded (``model.layers.*.mlp.gate.weight (x2)``)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Shard

__all__ = ["compact_placement", "placement_table"]

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def compact_placement(placements: Sequence[Placement], axes: Sequence[str]) -> str:
    """``dp_shard+ep:S(1) tp:S(0)``: mesh axes that shard the same dim joined by ``+`` (outer
    first), one group per dim in order of the first axis; ``replicated`` when none shards."""
    groups: dict[int, list[str]] = {}
    for name, p in zip(axes, placements):
        if isinstance(p, Shard):
            groups.setdefault(p.dim, []).append(name)
    return " ".join(f"{'+'.join(names)}:S({d})" for d, names in groups.items()) or "replicated"


def placement_table(params: Mapping[str, torch.Tensor]) -> list[str]:
    """One line per (placement, path with layer indices as ``*``), sorted by placement:
    ``"dp_shard:S(1)  model.layers.*.self_attn.q_a_proj.weight (x2)"``. Plain tensors show as
    ``local``."""
    rows: Counter[tuple[str, str]] = Counter()
    for path, t in params.items():
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            axes = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
            where = compact_placement(t.placements, axes)
        else:
            where = "local"
        rows[(where, _INDEX.sub("*", path))] += 1
    width = max((len(w) for w, _ in rows), default=0)
    return [f"{w:<{width}}  {p}" + (f" (x{n})" if n > 1 else "") for (w, p), n in sorted(rows.items())]
