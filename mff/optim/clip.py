"""Global-norm gradient clipping over a pytree of (possibly sharded) gradients."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["global_grad_norm", "clip_grads_"]


@torch.no_grad()
def global_grad_norm(grads: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None) -> float:
    """The L2 norm of all gradients together, over every shard and mesh axis (the same value
    on every rank; computed in fp32). Non-finite grads give inf/nan. ``group``: ranks holding
    other gradients of the same model (the pipeline stages): their squared norms are summed."""
    tensors = list(grads.values())
    total = torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors) if tensors else []
    for n in norms:
        full = n.full_tensor() if isinstance(n, DTensor) else n
        total = total + full.float().cpu() ** 2
    if group is not None and dist.get_world_size(group) > 1:
        first = tensors[0].to_local() if tensors and isinstance(tensors[0], DTensor) else (tensors[0] if tensors else total)
        summed = total.to(first.device)  # on the grads' device: a NCCL/HCCL group takes no CPU tensor
        dist.all_reduce(summed, group=group)
        total = summed.cpu()
    return float(total.sqrt())


@torch.no_grad()
def clip_grads_(grads: Mapping[str, torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None,
                counted: Collection[str] | None = None) -> float:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (0 = never);
    returns the norm before clipping (as ``torch.nn.utils.clip_grad_norm_``: coefficient
    ``max_norm / (norm + 1e-6)`` when below 1). Under pipeline parallelism ``group`` is the pp
    group (every stage's gradients make the norm) and ``counted`` the gradients this rank adds to
    it (a param two stages share is counted on one of them); all of ``grads`` are scaled."""
    norm = global_grad_norm(grads if counted is None else {k: v for k, v in grads.items() if k in counted}, group)
    if max_norm > 0 and norm > max_norm and norm == norm and norm != float("inf"):
        torch._foreach_mul_(list(grads.values()), max_norm / (norm + 1e-6))
    return norm
