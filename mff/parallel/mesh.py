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

Pipeline parallelism adds an outermost axis ``pp`` to the same mesh (``pp x dp_replicate x dp_shard x
ep x tp``): ranks along ``pp`` hold different layers (:mod:`mff.parallel.pp`) and read the same tokens.
Params live on this rank's slice of the mesh without ``pp`` (the 4-D mesh :func:`build_mesh` returns,
whose axes are :data:`MESH_AXES` whatever ``pp`` is); :func:`pipeline_group` gives the ``pp`` group.
Context parallelism is named in :class:`ParallelConfig` and rejected until built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["MESH_AXES", "DATA_AXES", "ParallelConfig", "mesh_shape", "build_mesh", "data_parallel_size", "data_parallel_rank",
           "data_parallel_group", "pipeline_group", "pipeline_pair_group", "pipeline_size", "pipeline_rank"]

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
    """Pipeline parallelism degree: the layers split into stages over pp ranks (training only)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, or interleaved-1f1b (several stages per rank)."""
    pp_stages_per_rank: int | None = None
    """Pipeline stages each pp rank holds (virtual stages); default 2 for interleaved-1f1b, else 1."""
    pp_microbatches: int | None = None
    """Micro-batches per pipeline pass (each rank's batch split along its rows); default: the number of stages."""
    pp_layers: str | None = None
    """Layers per stage by hand, comma-separated, one number per stage (e.g. 3,5); default: balanced by --parallel.pp-balance."""
    pp_balance: Literal["params", "flops"] = "params"
    """How stages are balanced when --parallel.pp-layers is not given: by param count or by training FLOPs per token."""
    cp: int = 1
    """Context parallelism degree (not supported yet: must be 1)."""
    timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before the run fails with the operation's name."""


def mesh_shape(cfg: ParallelConfig, world_size: int) -> tuple[int, int, int, int]:
    """Sizes of ``(dp_replicate, dp_shard, ep, tp)`` for ``world_size / pp`` processes (each
    pipeline stage's share of the world).

    Raises:
        ValueError: context parallelism > 1 ("not supported yet"), a size < 1 (other than
            dp_shard=-1), a ``pp`` that does not divide ``world_size``, or a product that does
            not equal ``world_size`` (the message shows each size and the product); a pipeline
            option (``pp_layers``, ``pp_microbatches``, ``pp_stages_per_rank``) without ``pp`` > 1.
    """
    if cfg.cp != 1:
        raise ValueError(f"--parallel.cp {cfg.cp}: context parallelism is not supported yet (only 1)")
    if cfg.pp == 1:
        for name in ("pp_layers", "pp_microbatches", "pp_stages_per_rank"):
            if getattr(cfg, name) is not None:
                raise ValueError(f"--parallel.{name.replace('_', '-')} {getattr(cfg, name)} is a pipeline option: give --parallel.pp N "
                                 "(N > 1) too, or leave it out")
    for name in ("pp", "dp_replicate", "tp", "ep"):
        size = getattr(cfg, name)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"--parallel.{name.replace('_', '-')} {size!r}: must be an integer >= 1")
    if not (cfg.timeout_s >= 1 and cfg.timeout_s != float("inf")):
        raise ValueError(f"--parallel.timeout-s {cfg.timeout_s}: must be a finite number >= 1 second")
    dp_shard = cfg.dp_shard
    rest = cfg.pp * cfg.dp_replicate * cfg.ep * cfg.tp
    if dp_shard == -1:
        if world_size % rest:
            pp = f"pp {cfg.pp} x " if cfg.pp > 1 else ""
            raise ValueError(
                f"WORLD_SIZE {world_size} is not divisible by {pp}dp_replicate {cfg.dp_replicate} x ep {cfg.ep} x tp {cfg.tp} = {rest}"
            )
        dp_shard = world_size // rest
    elif not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"--parallel.dp-shard {dp_shard!r}: must be >= 1 or -1 (the rest)")
    shape = (cfg.dp_replicate, dp_shard, cfg.ep, cfg.tp)
    if cfg.pp * math.prod(shape) != world_size:
        pp = f"pp {cfg.pp} x " if cfg.pp > 1 else ""
        raise ValueError(
            f"mesh {pp}dp_replicate {shape[0]} x dp_shard {shape[1]} x ep {shape[2]} x tp {shape[3]} = "
            f"{cfg.pp * math.prod(shape)} processes, but WORLD_SIZE is {world_size}"
        )
    return shape


def build_mesh(device_type: str, cfg: ParallelConfig, world_size: int) -> DeviceMesh:
    """The DeviceMesh with axes :data:`MESH_AXES` (the process group must be initialised).

    With ``cfg.pp`` > 1 the mesh made is ``pp x`` :data:`MESH_AXES` and the one returned is this
    rank's ``pp`` slice of it (axes :data:`MESH_AXES`; the params of its stages live there);
    :func:`pipeline_group` gives the ``pp`` group. The :data:`DATA_AXES` are also flattened into
    a 1-D mesh named ``dp``, whose group sums the per-rank counts, losses and expert loads (see
    :func:`data_parallel_group`).
    """
    shape = mesh_shape(cfg, world_size)
    if cfg.pp == 1:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        _DP_MESH[mesh] = mesh[DATA_AXES]._flatten("dp")
        return mesh
    root = init_device_mesh(device_type, (cfg.pp, *shape), mesh_dim_names=("pp", *MESH_AXES))
    mesh = root[MESH_AXES]
    _DP_MESH[mesh] = root[DATA_AXES]._flatten("dp")
    _PP_MESH[mesh] = root["pp"]
    _PP_ROOT[mesh] = root
    return mesh


_DP_MESH: dict[DeviceMesh, DeviceMesh] = {}
_PP_MESH: dict[DeviceMesh, DeviceMesh] = {}
_PP_ROOT: dict[DeviceMesh, DeviceMesh] = {}
_PAIRS: dict[tuple[int, int, int], object] = {}


def pipeline_pair_group(mesh: DeviceMesh, a: int, b: int):
    """The process group of pp coordinates ``a`` and ``b`` (a != b) at this rank's data and
    tensor coordinates (the two ranks holding a param that two stages share: the token
    embedding of the first and the last stage), or None when this rank is neither. Every rank
    of the run must call it (the groups of every coordinate are made together), once per pair:
    later calls return the same group."""
    key = (id(mesh), a, b)
    if key not in _PAIRS:
        import torch.distributed as dist

        ranks = _PP_ROOT[mesh].mesh.reshape(_PP_ROOT[mesh].size(0), -1)
        pairs = [[int(ranks[a, j]), int(ranks[b, j])] for j in range(ranks.shape[1])]
        _PAIRS[key], _ = dist.new_subgroups_by_enumeration(pairs)
    return _PAIRS[key]


def pipeline_group(mesh: DeviceMesh | None):
    """The ``pp`` process group of ``mesh`` (the ranks holding the other pipeline stages of this
    rank's data and tensor coordinates), or None when the run has no pipeline (pp = 1)."""
    pp = _PP_MESH.get(mesh) if mesh is not None else None
    return pp.get_group() if pp is not None else None


def pipeline_size(mesh: DeviceMesh | None) -> int:
    """The pipeline degree of the run ``mesh`` belongs to (1 without a pipeline)."""
    pp = _PP_MESH.get(mesh) if mesh is not None else None
    return pp.size() if pp is not None else 1


def pipeline_rank(mesh: DeviceMesh | None) -> int:
    """This rank's coordinate on the ``pp`` axis (0 without a pipeline)."""
    pp = _PP_MESH.get(mesh) if mesh is not None else None
    return pp.get_local_rank() if pp is not None else 0


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
