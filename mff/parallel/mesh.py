"""The run's DeviceMesh. It is always built, with axes of size 1 on one process, so that
scaling out changes no model code.

Axes, outermost first: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP), ``tp``.
Tensor and expert parallelism (``tp``, ``ep``) and pipeline/context parallelism are named in
:class:`ParallelConfig` and rejected until they are built.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_AXES", "ParallelConfig", "mesh_shape", "build_mesh"]

MESH_AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel sizes. Their product must equal WORLD_SIZE."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP outer axis); params are replicated over it."""
    dp_shard: int = -1
    """FSDP degree: params sharded over it and gathered on use; -1 = the rest of WORLD_SIZE."""
    tp: int = 1
    """Tensor parallelism degree (not supported yet: must be 1)."""
    ep: int = 1
    """Expert parallelism degree (not supported yet: must be 1)."""
    pp: int = 1
    """Pipeline parallelism degree (not supported yet: must be 1)."""
    cp: int = 1
    """Context parallelism degree (not supported yet: must be 1)."""
    timeout_s: float = 1800.0
    """Seconds a collective may wait before the run fails."""


def mesh_shape(cfg: ParallelConfig, world_size: int) -> tuple[int, int, int]:
    """Sizes of ``(dp_replicate, dp_shard, tp)`` for ``world_size`` processes.

    Raises:
        ValueError: a size < 1 (other than dp_shard=-1), an unsupported parallelism > 1, or a
            product that does not equal ``world_size`` (the message shows the product).
    """
    for name in ("tp", "ep", "pp", "cp"):
        size = getattr(cfg, name)
        if size != 1:
            raise ValueError(f"--parallel.{name.replace('_', '-')} {size}: not supported yet (only 1)")
    if cfg.dp_replicate < 1:
        raise ValueError(f"--parallel.dp-replicate {cfg.dp_replicate}: must be >= 1")
    dp_shard = cfg.dp_shard
    if dp_shard == -1:
        rest = cfg.dp_replicate * cfg.tp
        if world_size % rest:
            raise ValueError(
                f"WORLD_SIZE {world_size} is not divisible by dp_replicate {cfg.dp_replicate} x tp {cfg.tp} = {rest}"
            )
        dp_shard = world_size // rest
    elif dp_shard < 1:
        raise ValueError(f"--parallel.dp-shard {dp_shard}: must be >= 1 or -1 (the rest)")
    shape = (cfg.dp_replicate, dp_shard, cfg.tp)
    if shape[0] * shape[1] * shape[2] != world_size:
        raise ValueError(
            f"mesh dp_replicate {shape[0]} x dp_shard {shape[1]} x tp {shape[2]} = "
            f"{shape[0] * shape[1] * shape[2]} processes, but WORLD_SIZE is {world_size}"
        )
    return shape


def build_mesh(device_type: str, cfg: ParallelConfig, world_size: int) -> DeviceMesh:
    """The DeviceMesh with axes :data:`MESH_AXES` (the process group must be initialised)."""
    return init_device_mesh(device_type, mesh_shape(cfg, world_size), mesh_dim_names=MESH_AXES)
