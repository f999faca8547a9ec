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

Reduction once per step (pipeline parallelism, where a step runs many micro-batches through
each stage): :func:`gather_for_step` gathers a param over its data-parallel axes once, as a
fresh leaf that the step's micro-batches all use; inside :func:`local_grads` the gathers declare
no reduction over the data axes, so each rank accumulates its own unreduced gradient on that
leaf; :func:`reduce_step_grad` then sums it over the data axes onto the param's placements in
one reduce-scatter (or all-reduce), once per step, as FSDP does with gradient sync off for all
but the last micro-batch (torchtitan under pipeline parallelism keeps the params unsharded for
the step in the same way: ``reshard_after_forward=False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from mff.parallel.mesh import DATA_AXES

__all__ = ["DATA_AXES", "gather", "gather_for_step", "local_grads", "reduce_step_grad"]

# a plain flag, not a ContextVar: torch.compile reads (and guards on) module globals inside a
# compiled block, where reading a ContextVar would break the graph
_LOCAL_GRADS = {"on": False}


@contextlib.contextmanager
def local_grads() -> Iterator[None]:
    """Within this context :func:`gather` declares the gradients of the data-parallel axes
    unreduced (each rank keeps its own): for params gathered once per step by
    :func:`gather_for_step`, whose gradients :func:`reduce_step_grad` sums once."""
    before = _LOCAL_GRADS["on"]
    _LOCAL_GRADS["on"] = True
    try:
        yield
    finally:
        _LOCAL_GRADS["on"] = before


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
    defer = _LOCAL_GRADS["on"]
    target, grad = [], []
    for i, p in enumerate(w.placements):
        name = names[i] if i < len(names) else ""
        if name in keep and isinstance(p, Shard):
            target.append(p)
            grad.append(p)
        else:
            target.append(Replicate())
            summed = (name in DATA_AXES and not defer) or name in partial
            grad.append(Partial() if summed and mesh.size(i) > 1 else Replicate())
    full = w.redistribute(mesh, target)
    if not w.requires_grad:
        return full.to_local()
    return full.to_local(grad_placements=tuple(grad))


def _step_placements(w: DTensor, keep: tuple[str, ...]) -> list[Placement]:
    names = w.device_mesh.mesh_dim_names or ()
    return [Replicate() if i < len(names) and names[i] in DATA_AXES and names[i] not in keep else p for i, p in enumerate(w.placements)]


def gather_for_step(w: torch.Tensor, keep: tuple[str, ...] = ()) -> torch.Tensor:
    """``w`` gathered over its data-parallel axes (:data:`DATA_AXES`, except those in ``keep``:
    the ``ep`` split of stacked experts), as a new leaf DTensor (``requires_grad`` as ``w``'s)
    that the step's micro-batches use in place of ``w`` under :func:`local_grads`. Tensor-parallel
    shards stay as they are. A plain tensor comes back as a detached leaf."""
    if not isinstance(w, DTensor):
        return w.detach().requires_grad_(w.requires_grad)
    with torch.no_grad():
        full = w.redistribute(w.device_mesh, _step_placements(w, keep))
    return full.detach().requires_grad_(w.requires_grad)


@torch.no_grad()
def reduce_step_grad(leaf: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """The gradient of param ``w`` from the unreduced gradient accumulated on its step leaf
    (:func:`gather_for_step`): summed over the data-parallel axes on which the leaf was gathered
    and placed as ``w`` (one reduce-scatter or all-reduce per axis group). None when the leaf got
    no gradient."""
    g = leaf.grad
    if g is None:
        return None
    if not isinstance(w, DTensor):
        return g
    mesh = w.device_mesh
    names = mesh.mesh_dim_names or ()
    partial = [Partial() if names[i] in DATA_AXES and isinstance(p, Replicate) and mesh.size(i) > 1 else p
               for i, p in enumerate(leaf.placements)]
    unreduced = DTensor.from_local(g.to_local(), mesh, partial, run_check=False, shape=g.shape, stride=g.stride())
    return unreduced.redistribute(mesh, w.placements)
