"""The output head: logits and the token cross entropy from the last hidden states, with the
head matrix ``[V, D]`` (``lm_head.weight``, or the embedding matrix when tied).

Vocab-parallel when the head's rows are split over the ``tp`` mesh axis (Megatron-LM's
column-parallel output layer with ``vocab_parallel_cross_entropy``): each rank multiplies by
its row range of the vocabulary (:func:`mff.parallel.tp.chunk_range`; a vocabulary that is
not a multiple of tp is split as if padded to one, and the padding rows are not stored, so
they are never predicted and never enter the softmax) and the loss reduces only per-token
statistics over tp (:func:`mff.nn.loss.vocab_parallel_linear_cross_entropy_sum`): the full
[N, V] logits never exist on a rank. ``head_logits`` all-gathers the full logits; it serves
evaluation and generation, never the training step (which asks for the losses only).

Shape legend: N tokens, D hidden, V vocabulary, Vl this rank's vocabulary rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mff.nn.layers import linear
from mff.nn.loss import linear_cross_entropy_sum, vocab_parallel_linear_cross_entropy_sum
from mff.parallel.gather import gather
from mff.parallel.tp import TP_AXIS, chunk_range, copy_to_tp, gather_from_tp, tp_shard

__all__ = ["HeadWeight", "head_weight", "head_logits", "head_cross_entropy_sum"]


@dataclass(frozen=True)
class HeadWeight:
    """The head rows this rank computes with: ``weight`` [Vl, D] holds vocabulary rows
    ``[start, start + Vl)`` of ``vocab_size``; ``group`` is the tp process group they are split
    over (None: ``weight`` is the whole head)."""

    weight: torch.Tensor
    start: int
    vocab_size: int
    group: dist.ProcessGroup | None


def head_weight(w_VD: torch.Tensor) -> HeadWeight:
    """Gather the head param ``w_VD`` (a DTensor on any mesh, or a plain tensor) once per
    forward: whole, or this rank's vocabulary rows when its rows are split over tp."""
    split = tp_shard(w_VD)
    V = w_VD.shape[0]
    if split is None or split.dim != 0:
        return HeadWeight(gather(w_VD), 0, V, None)
    start, _ = chunk_range(V, split.rank, split.size)
    return HeadWeight(gather(w_VD, keep=(TP_AXIS,)), start, V, split.group)


def head_logits(h: torch.Tensor, head: HeadWeight) -> torch.Tensor:
    """Logits [..., V] of ``h`` [..., D] in ``h``'s dtype (a weight of another dtype, the fp32
    head under ``bf16-mixed``, is cast to it); under tp each rank's [..., Vl] are all-gathered
    into the full vocabulary (for evaluation and generation)."""
    w = head.weight if head.weight.dtype == h.dtype else head.weight.to(h.dtype)
    if head.group is None:
        return linear(h, w)
    local = linear(copy_to_tp(h, head.group), w)
    return gather_from_tp(local, head.group, head.vocab_size)


def head_cross_entropy_sum(h_ND: torch.Tensor, head: HeadWeight, labels_N: torch.Tensor) -> torch.Tensor:
    """Sum of token cross entropies of ``h_ND @ W^T`` against ``labels_N`` (-100 ignored),
    fp32 0-d, chunked so no [N, V] logits exist (:func:`mff.nn.loss.linear_cross_entropy_sum`,
    or its vocab-parallel form under tp: the same value on every tp rank)."""
    if head.group is None:
        return linear_cross_entropy_sum(h_ND, head.weight, labels_N)
    return vocab_parallel_linear_cross_entropy_sum(h_ND, head.weight, labels_N, head.start, head.vocab_size, head.group)
