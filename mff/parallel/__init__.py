"""Parallelism on torch.distributed: the mesh, sharding tables -> DTensor placements, gather-on-use."""

from mff.parallel.gather import DATA_AXES, gather
from mff.parallel.mesh import MESH_AXES, ParallelConfig, build_mesh, mesh_shape
from mff.parallel.sharding import (
    DEFAULT_AXIS_MAP,
    placements_of,
    resolve_placements,
    shard_params,
)

__all__ = [
    "DATA_AXES",
    "DEFAULT_AXIS_MAP",
    "MESH_AXES",
    "ParallelConfig",
    "build_mesh",
    "gather",
    "mesh_shape",
    "placements_of",
    "resolve_placements",
    "shard_params",
]
