"""Expert parallelism: token slots sent to the rank that holds their routed expert by
all-to-all, and the expert outputs sent back (GShard, arXiv 2006.16668 section 2; the
dropless "all-to-all dispatcher" of Megatron-LM's ``moe/token_dispatcher.py``).

The stacked experts ``[E, ...]`` are split by expert over the mesh axis ``ep`` (``Shard(0)``):
ep rank ``r`` of ``P`` holds the contiguous experts ``[r E/P, (r+1) E/P)``. Every rank routes
its own tokens over all ``E`` experts; then, for one MoE layer, in the ``ep`` group:

1. :func:`plan_send`: this rank's ``N K`` token slots sorted by expert (stable), the slots per
   expert ``counts [E]``, and the rows sent to each ep rank (the slots of its experts);
2. the counts are exchanged (:func:`exchange_counts`, one all-to-all of ``E`` ints): rank r
   learns ``recv_counts [P, E/P]``, the slots each source rank sends to each of its experts;
3. :func:`plan_receive`: the received rows arrive ordered by (source, local expert); the
   permutation that orders them by (local expert, source) for the grouped GEMM, and the group
   sizes per local expert;
4. the token activations go out with :func:`all_to_all` (variable splits, differentiable:
   its backward is the reverse all-to-all), the local experts run, the outputs come back the
   same way, and the caller combines them with the routing weights exactly as on one rank.

On one rank (``ep`` of size 1, or plain tensors) none of this runs: see :mod:`mff.nn.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["expert_group", "plan_send", "exchange_counts", "plan_receive", "all_to_all", "SendPlan", "ReceivePlan"]


def expert_group(w: torch.Tensor) -> dist.ProcessGroup | None:
    """The ``ep`` process group over which stacked expert param ``w`` is split by expert
    (``Shard(0)`` on a mesh axis named ``ep`` of size > 1), or None (plain tensor, no such
    axis, or size 1: every expert is local)."""
    if not isinstance(w, DTensor):
        return None
    mesh = w.device_mesh
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        return None
    i = names.index("ep")
    if mesh.size(i) == 1 or w.placements[i] != Shard(0):
        return None
    return mesh.get_group("ep")


@dataclass
class SendPlan:
    """This rank's side of a dispatch (:func:`plan_send`).

    - ``order`` [S] int64: slot indices (``n K + k``) sorted by expert, stable (S = N K);
    - ``token_of_slot`` [S] int64: the token ``n`` of each sorted slot (``order // K``);
    - ``counts`` [E] int64: slots routed to each expert (the expert load);
    - ``send_splits``: rows of the sorted slots sent to each ep rank (``P`` ints, sum S).
    """

    order: torch.Tensor
    token_of_slot: torch.Tensor
    counts: torch.Tensor
    send_splits: list[int]


def plan_send(idx_NK: torch.Tensor, num_experts: int, ep_size: int) -> SendPlan:
    """Sort this rank's token slots by routed expert and split them by owning ep rank.

    Args:
        idx_NK: routed expert ids [N, K] (int64, in ``[0, num_experts)``).
        num_experts: E, the routed experts over all ranks.
        ep_size: P, the ep ranks; rank r owns experts ``[r E/P, (r+1) E/P)``.
    Raises:
        ValueError: ``num_experts`` not divisible by ``ep_size``.
    """
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not divide over ep {ep_size} ranks")
    K = idx_NK.shape[1]
    flat = idx_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    send = counts.view(ep_size, num_experts // ep_size).sum(1).tolist()  # host sync: the split sizes
    return SendPlan(order=order, token_of_slot=order // K, counts=counts, send_splits=send)


def exchange_counts(counts_E: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of the per-expert slot counts in ``group`` (P ranks).

    ``counts_E`` [E] int64 (this rank's slots per expert). Returns ``recv_counts`` [P, E/P]:
    row s holds the slots rank s routed to each of this rank's experts.
    """
    P = dist.get_world_size(group)
    out = torch.empty_like(counts_E)
    dist.all_to_all_single(out, counts_E.contiguous(), group=group)
    return out.view(P, -1)


@dataclass
class ReceivePlan:
    """The receiving side of a dispatch (:func:`plan_receive`).

    - ``recv_splits``: rows received from each ep rank (P ints);
    - ``local_order`` [R] int64: indices into the received rows (source-major) that order
      them by local expert, then source, then the source's own slot order;
    - ``local_counts``: rows per local expert after that ordering (E/P ints, the GEMM groups).
    """

    recv_splits: list[int]
    local_order: torch.Tensor
    local_counts: list[int]


def plan_receive(recv_counts: torch.Tensor) -> ReceivePlan:
    """Group sizes and the (source, expert) -> (expert, source) permutation of the received rows.

    ``recv_counts`` [P, E/P] int64 (see :func:`exchange_counts`). Rows arrive as P blocks
    (one per source rank), each sorted by local expert.
    """
    P, El = recv_counts.shape
    flat = recv_counts.reshape(-1)
    segment = torch.repeat_interleave(torch.arange(P * El, device=flat.device), flat)  # (source, expert) id of each row
    key = (segment % El) * P + segment // El  # the (expert, source) id
    return ReceivePlan(
        recv_splits=recv_counts.sum(1).tolist(),
        local_order=torch.argsort(key, stable=True),
        local_counts=recv_counts.sum(0).tolist(),
    )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 with variable splits; the backward sends the
    gradients back along the reverse routes (input and output splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Send rows ``x[sum(in_splits[:r]) : sum(in_splits[:r+1])]`` to rank r of ``group``;
    return the rows received, ``out_splits[s]`` from each rank s in rank order.

    Differentiable: the gradient travels back by the reverse all-to-all. ``x`` [sum(in_splits), ...].
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)
