"""The run's DeviceMesh. It is always built, with axes of size 1 on one process, so that
scaling out changes no model code.

Axes, outermost first (:data:`MESH_AXES`): ``dp_replicate`` (HSDP replicas), ``dp_shard``
(FSDP), ``ep`` (expert parallelism), ``tp`` (tensor parallelism). WORLD_SIZE is their product.

Ranks along ``dp_replicate``, ``dp_shard`` and ``ep`` read different tokens (the data-parallel
degree is their product); ranks along ``tp`` read the same tokens. One 4-D mesh serves both
kinds of param, as torchtitan's dense and expert meshes do:

- dense params are FSDP-sharded over ``dp_shard`` *and* ``ep`` (a nested ``Shard`` of the same
  dim on both axes), so expert parallelism costs the dense weights no memory;
- stacked experts ``[E, ...]`` are split by expert over ``ep`` and FSDP-sharded over ``dp_shard``.

Pipeline and context parallelism are named in :class:`ParallelConfig` and rejected until built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_AXES", "DATA_AXES", "ParallelConfig", "mesh_shape", "build_mesh", "data_parallel_size", "data_parallel_rank", "data_parallel_group"]

MESH_AXES = ("dp_replicate", "dp_shard", "ep", "tp")
DATA_AXES = ("dp_replicate", "dp_shard", "ep")
"""Mesh axes over which ranks see different tokens (their grads are partial sums)."""


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes: ``dp_replicate x dp_shard x ep x tp`` must equal WORLD_SIZE."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer axis); params are replicated over it."""
    dp_shard: int = -1
    """FSDP degree (of the experts; dense params are sharded over dp_shard x ep); -1 = the rest of WORLD_SIZE."""
    tp: int = 1
    """Tensor parallelism degree: attention heads, MLP hidden dims and the vocabulary split over tp ranks."""
    ep: int = 1
    """Expert parallelism degree: routed experts split over ep ranks, tokens sent to them by all-to-all."""
    pp: int = 1
    """Pipeline parallelism degree (not supported yet: must be 1)."""
    cp: int = 1
    """Context parallelism degree (not supported yet: must be 1)."""
    timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before the run fails with the operation's name."""


def mesh_shape(cfg: ParallelConfig, world_size: int) -> tuple[int, int, int, int]:
    """Sizes of ``(dp_replicate, dp_shard, ep, tp)`` for ``world_size`` processes.

    Raises:
        ValueError: pipeline or context parallelism > 1 ("not supported yet"), a size < 1
            (other than dp_shard=-1), or a product that does not equal ``world_size`` (the
            message shows each size and the product).
    """
    for name in ("pp", "cp"):
        size = getattr(cfg, name)
        if size != 1:
            what = {"pp": "pipeline", "cp": "context"}[name]
            raise ValueError(f"--parallel.{name} {size}: {what} parallelism is not supported yet (only 1)")
    for name in ("dp_replicate", "tp", "ep"):
        size = getattr(cfg, name)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"--parallel.{name.replace('_', '-')} {size!r}: must be an integer >= 1")
    if not cfg.timeout_s >= 1:
        raise ValueError(f"--parallel.timeout-s {cfg.timeout_s}: must be >= 1 second")
    dp_shard = cfg.dp_shard
    rest = cfg.dp_replicate * cfg.ep * cfg.tp
    if dp_shard == -1:
        if world_size % rest:
            raise ValueError(
                f"WORLD_SIZE {world_size} is not divisible by dp_replicate {cfg.dp_replicate} x ep {cfg.ep} x tp {cfg.tp} = {rest}"
            )
        dp_shard = world_size // rest
    elif not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"--parallel.dp-shard {dp_shard!r}: must be >= 1 or -1 (the rest)")
    shape = (cfg.dp_replicate, dp_shard, cfg.ep, cfg.tp)
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh dp_replicate {shape[0]} x dp_shard {shape[1]} x ep {shape[2]} x tp {shape[3]} = "
            f"{math.prod(shape)} processes, but WORLD_SIZE is {world_size}"
        )
    return shape


def build_mesh(device_type: str, cfg: ParallelConfig, world_size: int) -> DeviceMesh:
    """The DeviceMesh with axes :data:`MESH_AXES` (the process group must be initialised).

    The :data:`DATA_AXES` are also flattened into a 1-D mesh named ``dp``, whose group sums the per-rank counts, losses and expert loads (see :func:`data_parallel_group`).
    """
    mesh = init_device_mesh(device_type, mesh_shape(cfg, world_size), mesh_dim_names=MESH_AXES)
    _DP_MESH[mesh] = mesh[DATA_AXES]._flatten("dp")
    return mesh


_DP_MESH: dict[DeviceMesh, DeviceMesh] = {}


def data_parallel_group(mesh: DeviceMesh | None):
    """The process group of the ranks that read different tokens and share this rank's tensor-
    parallel coordinate (made by :func:`build_mesh`); ``None`` (the default
    group: every rank) for a mesh without it or no mesh (plain tensors in research code)."""
    dp = _DP_MESH.get(mesh) if mesh is not None else None
    return dp.get_group() if dp is not None else None


def data_parallel_size(mesh: DeviceMesh) -> int:
    """Number of ranks that read different tokens: the product of the :data:`DATA_AXES` sizes."""
    names = mesh.mesh_dim_names or ()
    return math.prod(mesh.size(i) for i, n in enumerate(names) if n in DATA_AXES)


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the :data:`DATA_AXES` ranks (row-major, ``dp_replicate`` outermost);
    equal on all ``tp`` ranks of a group, which read the same tokens."""
    names = mesh.mesh_dim_names or ()
    rank = 0
    for i, n in enumerate(names):
        if n in DATA_AXES:
            rank = rank * mesh.size(i) + mesh.get_local_rank(i)
    return rank
