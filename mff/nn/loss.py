"""Token-level cross entropy as a sum and a count, so callers can normalise by any token
count (per micro-batch, or the global count of a step across micro-batches and ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "cross_entropy_sum", "count_targets", "default_chunk_rows", "linear_cross_entropy_sum"]

IGNORE_INDEX = -100


def count_targets(labels_BT: torch.Tensor) -> torch.Tensor:
    """Number of labels that are not ``IGNORE_INDEX`` (int64, 0-d)."""
    return (labels_BT != IGNORE_INDEX).sum()


def cross_entropy_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum over target tokens of ``-log softmax(logits)[label]``, computed in fp32 (0-d).

    Shapes: logits [..., V] (any float dtype), labels int64 [...]. Labels equal to
    ``IGNORE_INDEX`` (-100) contribute nothing; all ignored gives 0, never NaN.

    Raises:
        IndexError: a label outside [0, V) that is not ``IGNORE_INDEX``.
    """
    V = logits_BTV.shape[-1]
    labels = labels_BT.reshape(-1)
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        raise IndexError(f"label {int(labels[bad][0])} is outside the vocabulary [0, {V})")
    return F.cross_entropy(logits_BTV.reshape(-1, V).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk of :func:`linear_cross_entropy_sum`: about 2^22 logits (16 MiB in fp32,
    so a chunk's softmax passes stay in the CPU caches) per chunk, at least 128 rows."""
    return max(128, (1 << 22) // max(1, vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of token cross entropies of ``h W^T``, chunk by chunk over the rows, with the
    gradients computed in the same pass (so the backward holds no logits): the fused
    linear-cross-entropy of Liger-Kernel / Apple's "Cut Your Losses" (arXiv 2411.09009), written
    here with plain matmuls."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk_rows: int, need_grad: bool):
        N = h_ND.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h = torch.empty_like(h_ND) if need_grad else None
        grad_w = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_grad else None
        for start in range(0, N, chunk_rows):
            h = h_ND[start:start + chunk_rows]
            y = labels_N[start:start + chunk_rows]
            logits = h @ w_VD.t()  # [n, V]: the only logits alive at a time
            if logits.dtype != torch.float32:
                logits = logits.float()
            keep = y != IGNORE_INDEX
            safe = torch.where(keep, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += ((lse - picked) * keep).sum()
            if need_grad:
                # d/dlogits of sum CE = softmax - onehot(label), zero for ignored rows
                g = torch.exp(logits.sub_(lse[:, None]))
                g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
                g.mul_(keep[:, None])
                g = g.to(h.dtype)
                grad_h[start:start + chunk_rows] = g @ w_VD
                if h.dtype == torch.float32:
                    grad_w.addmm_(g.t(), h)
                else:  # the product in the compute dtype (no fp32 copies of g and h), summed in fp32
                    grad_w += g.t() @ h
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(w_VD.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None


def linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor,
                             chunk_rows: int | None = None) -> torch.Tensor:
    """``cross_entropy_sum(h @ weight.T, labels)`` without materialising the [N, V] logits.

    The output head and the loss run over chunks of ``chunk_rows`` rows (default
    :func:`default_chunk_rows`); each chunk's logits are made in the compute dtype, turned to
    fp32 for the log-softmax, and, when a gradient is needed, turned into the chunk's gradients
    at once, so peak memory holds one chunk's logits instead of the whole batch's (in fp32
    that is 4 N V bytes: 4 GiB for 8192 tokens of a 129k vocabulary). FLOPs are those of the
    unchunked head and loss.

    Shapes: ``h_ND`` [N, D] and ``weight_VD`` [V, D] in one float dtype; ``labels_N`` int64 [N]
    (-100 = ignored). Returns a 0-d fp32 tensor; all labels ignored gives 0 (never NaN).

    Raises:
        IndexError: a label outside [0, V) that is not ``IGNORE_INDEX``.
        ValueError: mismatched shapes, labels that are not integers, ``chunk_rows`` < 1.
    """
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1] or labels_N.shape != h_ND.shape[:1]:
        raise ValueError(f"linear_cross_entropy_sum: h {tuple(h_ND.shape)}, weight {tuple(weight_VD.shape)}, labels "
                         f"{tuple(labels_N.shape)}; expected [N, D], [V, D], [N]")
    if labels_N.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"linear_cross_entropy_sum: labels must be int64 (or int32) token ids, got {labels_N.dtype}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy_sum: chunk_rows={chunk_rows} must be >= 1")
    V = weight_VD.shape[0]
    bad = (labels_N != IGNORE_INDEX) & ((labels_N < 0) | (labels_N >= V))
    if bool(bad.any()):
        raise IndexError(f"label {int(labels_N[bad][0])} is outside the vocabulary [0, {V})")
    need_grad = torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad)
    rows = chunk_rows or default_chunk_rows(V)
    if weight_VD.dtype != h_ND.dtype:
        weight_VD = weight_VD.to(h_ND.dtype)
    return _LinearCrossEntropy.apply(h_ND, weight_VD, labels_N, rows, need_grad)
