"""Global-norm gradient clipping over a pytree of (possibly sharded) gradients."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

__all__ = ["global_grad_norm", "clip_grads_"]


@torch.no_grad()
def global_grad_norm(grads: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all gradients together, over every shard and mesh axis (the same value
    on every rank; computed in fp32). Non-finite grads give inf/nan."""
    tensors = list(grads.values())
    if not tensors:
        return 0.0
    norms = torch._foreach_norm(tensors)
    total = torch.zeros((), dtype=torch.float32)
    for n in norms:
        full = n.full_tensor() if isinstance(n, DTensor) else n
        total = total + full.float().cpu() ** 2
    return float(total.sqrt())


@torch.no_grad()
def clip_grads_(grads: Mapping[str, torch.Tensor], max_norm: float) -> float:
    """Scale ``grads`` in place so their global norm is at most ``max_norm`` (0 = never);
    returns the norm before clipping (as ``torch.nn.utils.clip_grad_norm_``: coefficient
    ``max_norm / (norm + 1e-6)`` when below 1)."""
    norm = global_grad_norm(grads)
    if max_norm > 0 and norm > max_norm and norm == norm and norm != float("inf"):
        torch._foreach_mul_(list(grads.values()), max_norm / (norm + 1e-6))
    return norm
