"""Parallelism on torch.distributed: the mesh, sharding tables -> DTensor placements, gather-on-use,
tensor-parallel communication (:mod:`mff.parallel.tp`) and the expert-parallel token dispatch
(:mod:`mff.parallel.ep`, used by :mod:`mff.nn.moe`)."""

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
    UNEVEN_AXES,
    placements_of,
    resolve_placements,
    shard_params,
)
from mff.parallel.tp import TP_AXIS, chunk_range, copy_to_tp, gather_from_tp, reduce_from_tp, tp_shard

__all__ = [
    "DATA_AXES",
    "DEFAULT_AXIS_MAP",
    "TP_AXIS",
    "UNEVEN_AXES",
    "MESH_AXES",
    "ParallelConfig",
    "build_mesh",
    "chunk_range",
    "copy_to_tp",
    "data_parallel_group",
    "data_parallel_rank",
    "data_parallel_size",
    "gather",
    "gather_from_tp",
    "mesh_shape",
    "placements_of",
    "reduce_from_tp",
    "resolve_placements",
    "shard_params",
    "tp_shard",
]
