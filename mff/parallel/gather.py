"""Gather-on-use: turn a param leaf (a DTensor on the run's mesh) into the full local tensor
a block computes with, so that the backward sends each gradient back to its param's placements.

This is SimpleFSDP's rule (torchtitan): the weight is redistributed to ``Replicate`` where it
is used; the local gradient is declared ``Partial`` over the data-parallel axes (each rank saw
its own tokens), so autograd's backward of the redistribute reduce-scatters it onto a
``Shard`` param (FSDP) or all-reduces it onto a ``Replicate`` param (DDP/HSDP). On an axis of
size 1 the declaration is ``Replicate`` (identical, and no collective is issued).

Plain tensors pass through untouched, so ``forward(params, batch)`` also works on an ordinary
``dict[str, Tensor]`` in research code.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["DATA_AXES", "gather"]

DATA_AXES = ("dp_replicate", "dp_shard")
"""Mesh axis names over which ranks see different tokens (their grads are partial sums)."""


def _grad_placements(w: DTensor) -> tuple:
    mesh = w.device_mesh
    names = mesh.mesh_dim_names or ()
    out = []
    for i in range(mesh.ndim):
        name = names[i] if i < len(names) else ""
        out.append(Partial() if name in DATA_AXES and mesh.size(i) > 1 else Replicate())
    return tuple(out)


def gather(w: torch.Tensor) -> torch.Tensor:
    """The full tensor of param ``w`` on this rank, differentiable back to ``w``.

    Args:
        w: a param leaf: a DTensor with any placements, or a plain tensor.
    Returns:
        A plain tensor with ``w``'s global shape and dtype. For a DTensor the backward yields
        a gradient with exactly ``w``'s placements.
    """
    if not isinstance(w, DTensor):
        return w
    full = w.redistribute(w.device_mesh, [Replicate()] * w.device_mesh.ndim)
    if not w.requires_grad:
        return full.to_local()
    return full.to_local(grad_placements=_grad_placements(w))
