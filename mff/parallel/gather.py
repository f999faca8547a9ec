"""Gather-on-use: turn a param leaf (a DTensor on the run's mesh) into the local tensor a
block computes with, so that the backward sends each gradient back to its param's placements.

This is SimpleFSDP's rule (torchtitan): the weight is redistributed to ``Replicate`` where it
is used; the local gradient is declared ``Partial`` over the data-parallel axes (each rank saw
its own tokens), so autograd's backward of the redistribute reduce-scatters it onto a
``Shard`` param (FSDP) or all-reduces it onto a ``Replicate`` param (DDP/HSDP). On an axis of
size 1 the declaration is ``Replicate`` (identical, and no collective is issued).

Axes named in ``keep`` stay sharded: a tensor-parallel layer keeps its ``tp`` shard and the
experts keep their ``ep`` shard; their gradients stay ``Shard`` on those axes. Axes named in
``partial`` are gathered with a ``Partial`` gradient: each of their ranks used a different part
of the gathered weight (GLM-4's fused ``gate_up_proj`` under tensor parallelism), so the parts
are summed (reduce-scattered onto a ``Shard`` param) in the backward.

Plain tensors pass through untouched, so ``forward(params, batch)`` also works on an ordinary
``dict[str, Tensor]`` in research code.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from mff.parallel.mesh import DATA_AXES

__all__ = ["DATA_AXES", "gather"]


def gather(w: torch.Tensor, keep: tuple[str, ...] = (), partial: tuple[str, ...] = ()) -> torch.Tensor:
    """The tensor of param ``w`` this rank computes with, differentiable back to ``w``.

    Args:
        w: a param leaf: a DTensor with any placements, or a plain tensor.
        keep: mesh axis names on which ``w`` keeps its ``Shard`` (e.g. ``("tp",)`` in a
            tensor-parallel layer); every other axis is gathered.
        partial: mesh axis names (besides the data-parallel ones) over which the gradient of
            the gathered tensor is a partial sum.
    Returns:
        A plain tensor: ``w``'s global shape, except along dims sharded on a ``keep`` axis,
        which hold this rank's shard. For a DTensor the backward yields a gradient with
        exactly ``w``'s placements.
    """
    if not isinstance(w, DTensor):
        return w
    mesh = w.device_mesh
    names = mesh.mesh_dim_names or ()
    target, grad = [], []
    for i, p in enumerate(w.placements):
        name = names[i] if i < len(names) else ""
        if name in keep and isinstance(p, Shard):
            target.append(p)
            grad.append(p)
        else:
            target.append(Replicate())
            summed = name in DATA_AXES or name in partial
            grad.append(Partial() if summed and mesh.size(i) > 1 else Replicate())
    full = w.redistribute(mesh, target)
    if not w.requires_grad:
        return full.to_local()
    return full.to_local(grad_placements=tuple(grad))
