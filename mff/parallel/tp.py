"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053 section 3): the
communication of column- and row-parallel layers, and where a param is split over ``tp``.

A layer decides how to compute from its weight's placement on the mesh axis named ``tp``
(:func:`tp_shard`), never from a flag:

- ``Shard(0)`` of a ``[F, D]`` weight: column-parallel. The input passes through
  :func:`copy_to_tp` (identity forward; the backward all-reduces the input gradient, whose
  parts come from every rank's output features); the output holds this rank's features.
- ``Shard(1)``: row-parallel. The input holds this rank's features; the partial products are
  summed by :func:`reduce_from_tp` (all-reduce forward, identity backward).
- ``Replicate`` on ``tp`` (or a plain tensor, or a size-1 axis): the plain computation.

Sizes of an uneven split follow ``torch.chunk`` (DTensor's rule for ``Shard``): rank r of n
holds rows ``[r * ceil(V / n), ...)``, the last ranks fewer (see :func:`chunk_range`).

The collectives are ``torch.distributed.all_reduce`` / ``all_gather`` on the mesh's ``tp``
process group, so they run under the process group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["TP_AXIS", "TPShard", "tp_shard", "chunk_range", "copy_to_tp", "reduce_from_tp", "gather_from_tp"]

TP_AXIS = "tp"


@dataclass(frozen=True)
class TPShard:
    """Where a param is split over the ``tp`` mesh axis: the tensor ``dim``, this rank's
    index ``rank`` of ``size`` ranks, and their process ``group``."""

    dim: int
    rank: int
    size: int
    group: dist.ProcessGroup


def tp_shard(w: torch.Tensor) -> TPShard | None:
    """The split of param ``w`` over the ``tp`` mesh axis, or None when it has none: a plain
    tensor, a mesh without a ``tp`` axis, a ``tp`` axis of size 1, or ``Replicate`` on it."""
    if not isinstance(w, DTensor):
        return None
    mesh = w.device_mesh
    names = mesh.mesh_dim_names or ()
    if TP_AXIS not in names:
        return None
    i = names.index(TP_AXIS)
    p = w.placements[i]
    if not isinstance(p, Shard) or mesh.size(i) == 1:
        return None
    return TPShard(dim=p.dim, rank=mesh.get_local_rank(TP_AXIS), size=mesh.size(i), group=mesh.get_group(TP_AXIS))


def chunk_range(length: int, rank: int, size: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s part when ``length`` items are split over ``size``
    ranks as ``torch.chunk`` (and DTensor's ``Shard``) split them: parts of ``ceil(length /
    size)``, the last ranks shorter or empty (as if the length were padded to a multiple of
    ``size`` and the padding dropped)."""
    step = -(-length // size)
    start = min(rank * step, length)
    return start, min(start + step, length)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over ``group`` backward (Megatron's
    ``copy_to_tensor_model_parallel_region``, the ``f`` of the paper's figure 3)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward; identity backward (Megatron's
    ``reduce_from_tensor_model_parallel_region``, the paper's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate every rank's last dim (``torch.chunk`` sizes that sum to ``full``) forward;
    this rank's slice of the gradient backward (Megatron's ``gather_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, full):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        step = -(-full // size)
        ctx.range = chunk_range(full, rank, size)
        padded = torch.zeros(*x.shape[:-1], step, dtype=x.dtype, device=x.device)
        padded[..., :x.shape[-1]] = x
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        pieces = [p[..., :stop - start] for p, (start, stop) in ((parts[r], chunk_range(full, r, size)) for r in range(size))]
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.range
        return grad[..., start:stop].contiguous(), None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` unchanged, entering a column-parallel region: its gradient is summed over the
    ranks of ``group`` (each computed the part coming from its own output features). None or a
    size-1 group: ``x`` itself."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group`` (partial products of a row-parallel layer);
    the gradient passes through unchanged. None or a size-1 group: ``x`` itself."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None, full: int) -> torch.Tensor:
    """[..., full]: every rank's [..., part] of ``group`` concatenated in rank order, the
    parts split as :func:`chunk_range` splits ``full`` (shorter parts padded for the
    all-gather, the padding dropped). Differentiable (the backward takes this rank's slice).

    Raises:
        ValueError: ``x``'s last dim is not this rank's part of ``full``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    start, stop = chunk_range(full, dist.get_rank(group), dist.get_world_size(group))
    if x.shape[-1] != stop - start:
        raise ValueError(f"gather_from_tp: last dim {x.shape[-1]} is not this rank's part {stop - start} of {full}")
    return _GatherFromTP.apply(x, group, full)
