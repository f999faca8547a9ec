"""Parallelism on torch.distributed: the mesh, sharding tables -> DTensor placements, gather-on-use,
and the expert-parallel token dispatch (:mod:`mff.parallel.ep`, used by :mod:`mff.nn.moe`)."""

from mff.parallel.gather import gather
from mff.parallel.mesh import (
    DATA_AXES,
    MESH_AXES,
    ParallelConfig,
    build_mesh,
    data_parallel_group,
    data_parallel_rank,
    data_parallel_size,
    mesh_shape,
)
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
    "data_parallel_group",
    "data_parallel_rank",
    "data_parallel_size",
    "gather",
    "mesh_shape",
    "placements_of",
    "resolve_placements",
    "shard_params",
]
