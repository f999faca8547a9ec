"""Token-level cross entropy as a sum and a count, so callers can normalise by any token
count (per micro-batch, or the global count of a step across micro-batches and ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mff.parallel.tp import copy_to_tp

__all__ = ["IGNORE_INDEX", "cross_entropy_sum", "count_targets", "default_chunk_rows", "linear_cross_entropy_sum",
           "vocab_parallel_linear_cross_entropy_sum"]

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
    here with plain matmuls. Every chunk works in the same preallocated buffers (``out=``
    matmuls and in-place softmax passes), with the numerics of ``torch.logsumexp`` and of
    ``exp(logits - lse)`` for the softmax.

    With a process ``group``, ``w_VD`` holds vocabulary rows ``[start, start + V_local)`` of a
    vocabulary split over the group's ranks (Megatron-LM's ``vocab_parallel_cross_entropy``):
    per chunk, each rank's log-sum-exp over its rows and its logit of the target (0 when the
    target is another rank's) are all-gathered in one collective and combined into the full
    row's values; the gradient of ``h`` is this rank's part (the caller sums it over the group).
    """

    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk_rows: int, need_grad: bool, start: int, group):
        N, V = h_ND.shape[0], w_VD.shape[0]
        w_dtype = w_VD.dtype
        if w_VD.dtype != h_ND.dtype:  # the products run in h's dtype; the gradient comes back in the weight's
            w_VD = w_VD.to(h_ND.dtype)
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h = h_ND.new_empty(h_ND.shape) if need_grad else None  # row-major: each chunk's rows are one block
        grad_w = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_grad else None
        ranks = dist.get_world_size(group) if group is not None else 1
        # One set of chunk buffers for the whole call, reused by every chunk: a fresh [n, V]
        # tensor for each op (what torch.logsumexp and out-of-place ops allocate) costs page
        # faults on every chunk on a CPU once the allocator returns such blocks to the OS.
        rows = min(chunk_rows, N)
        low = h_ND.dtype != torch.float32
        logits_buf = h_ND.new_empty((rows, V), dtype=torch.float32)
        shifted_buf = torch.empty_like(logits_buf)  # exp(logits - max), for the log-sum-exp
        low_buf = h_ND.new_empty((rows, V)) if low else None  # the logits / their gradient in the compute dtype
        # in the compute dtype the weight gradient's products are summed into the fp32 grad_w
        # through a block of about 2^22 elements, vocabulary rows at a time, so no second
        # [V, D] tensor exists besides grad_w
        block = max(1, min(V, (1 << 22) // max(1, w_VD.shape[1])))
        part_w = w_VD.new_empty((block, w_VD.shape[1]), dtype=h_ND.dtype) if need_grad and low else None
        part_w32 = torch.empty(part_w.shape, dtype=torch.float32, device=w_VD.device) if need_grad and low else None
        for begin in range(0, N, chunk_rows):
            h = h_ND[begin:begin + chunk_rows]
            y = labels_N[begin:begin + chunk_rows]
            n = h.shape[0]
            logits = logits_buf[:n]  # [n, V_local]: the only logits alive at a time
            if low:
                torch.mm(h, w_VD.t(), out=low_buf[:n])
                logits.copy_(low_buf[:n])
            else:
                torch.mm(h, w_VD.t(), out=logits)
            keep = y != IGNORE_INDEX
            if group is None:
                mine = keep
                safe = torch.where(keep, y, 0)
            else:
                local = y - start
                mine = keep & (local >= 0) & (local < V)
                safe = torch.where(mine, local, 0)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            # log-sum-exp as torch.logsumexp computes it (max, exp of the shifted logits, sum,
            # log; an infinite max is not subtracted), into the reused buffer
            top = logits.amax(dim=-1)
            top = top.masked_fill(top.abs() == float("inf"), 0.0)
            shifted = torch.sub(logits, top[:, None], out=shifted_buf[:n]).exp_()
            lse = shifted.sum(dim=-1).log_().add_(top)
            if group is not None:
                stats = torch.stack((lse, picked * mine))  # [2, n]
                parts = [torch.empty_like(stats) for _ in range(ranks)]
                dist.all_gather(parts, stats.contiguous(), group=group)
                stats = torch.stack(parts)  # [ranks, 2, n]
                lse, picked = torch.logsumexp(stats[:, 0], dim=0), stats[:, 1].sum(0)
            total += ((lse - picked) * keep).sum()
            if need_grad:
                # d/dlogits of sum CE = softmax - onehot(label), zero for ignored rows
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(n, device=g.device), safe] -= mine.to(g.dtype)
                g.mul_(keep[:, None])
                if low:
                    g = low_buf[:n].copy_(g)
                torch.mm(g, w_VD, out=grad_h[begin:begin + n])
                if not low:
                    grad_w.addmm_(g.t(), h)
                else:  # the products in the compute dtype (no fp32 copies of g and h), summed in fp32
                    for v0 in range(0, V, block):
                        m = min(block, V - v0)
                        torch.mm(g[:, v0:v0 + m].t(), h, out=part_w[:m])
                        grad_w[v0:v0 + m].add_(part_w32[:m].copy_(part_w[:m]))
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(w_dtype))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # the scale stays fp32 (a bf16 tensor times a 0-d fp32 one is exact, then rounded once):
        # rounded to bf16 first, a 1/tokens scale would bias every gradient behind the head
        return grad_h * grad_out, grad_w * grad_out, None, None, None, None, None


def _check_head_inputs(where: str, h_ND, weight_VD, labels_N, chunk_rows, vocab_size: int) -> None:
    if h_ND.dim() != 2 or weight_VD.dim() != 2 or h_ND.shape[1] != weight_VD.shape[1] or labels_N.shape != h_ND.shape[:1]:
        raise ValueError(f"{where}: h {tuple(h_ND.shape)}, weight {tuple(weight_VD.shape)}, labels "
                         f"{tuple(labels_N.shape)}; expected [N, D], [V, D], [N]")
    if labels_N.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: labels must be int64 (or int32) token ids, got {labels_N.dtype}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"{where}: chunk_rows={chunk_rows} must be >= 1")
    bad = (labels_N != IGNORE_INDEX) & ((labels_N < 0) | (labels_N >= vocab_size))
    if bool(bad.any()):
        raise IndexError(f"label {int(labels_N[bad][0])} is outside the vocabulary [0, {vocab_size})")


def linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor,
                             chunk_rows: int | None = None) -> torch.Tensor:
    """``cross_entropy_sum(h @ weight.T, labels)`` without materialising the [N, V] logits.

    The output head and the loss run over chunks of ``chunk_rows`` rows (default
    :func:`default_chunk_rows`); each chunk's logits are made in the compute dtype, turned to
    fp32 for the log-softmax, and, when a gradient is needed, turned into the chunk's gradients
    at once, so peak memory holds one chunk's logits instead of the whole batch's (in fp32
    that is 4 N V bytes: 4 GiB for 8192 tokens of a 129k vocabulary). What the call holds
    besides: the gradients (``h``'s, and the weight's summed in fp32, 4 V D bytes, until the
    backward), a cast of the weight to the compute dtype when it has another dtype, and chunk
    buffers of about 2^22 elements. FLOPs are those of the unchunked head and loss.

    Shapes: ``h_ND`` [N, D] and ``weight_VD`` [V, D], float; ``labels_N`` int64 or int32 [N] (-100 =
    ignored). The products run in ``h_ND``'s dtype (the compute dtype): a weight of another
    dtype (the fp32 head under ``bf16-mixed``) is cast inside, and its gradient, summed over the
    chunks in fp32, comes back in the weight's own dtype with no second rounding. Returns a 0-d
    fp32 tensor; all labels ignored gives 0 (never NaN).

    Raises:
        IndexError: a label outside [0, V) that is not ``IGNORE_INDEX``.
        ValueError: mismatched shapes, labels that are not integers, ``chunk_rows`` < 1.
    """
    V = weight_VD.shape[0]
    _check_head_inputs("linear_cross_entropy_sum", h_ND, weight_VD, labels_N, chunk_rows, V)
    need_grad = torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad)
    rows = chunk_rows or default_chunk_rows(V)
    return _LinearCrossEntropy.apply(h_ND, weight_VD, labels_N, rows, need_grad, 0, None)


def vocab_parallel_linear_cross_entropy_sum(h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor, vocab_start: int,
                                            vocab_size: int, group: dist.ProcessGroup | None,
                                            chunk_rows: int | None = None) -> torch.Tensor:
    """:func:`linear_cross_entropy_sum` with the head's vocabulary rows split over the ranks
    of ``group`` (tensor parallelism; Megatron-LM's ``vocab_parallel_cross_entropy``).

    Each rank holds ``weight_VD`` = rows ``[vocab_start, vocab_start + V_local)`` of the
    ``vocab_size``-row head and the same ``h_ND`` and ``labels_N``; per chunk of rows it makes
    only its [n, V_local] logits, and the ranks exchange two numbers per token (the
    log-sum-exp over their rows and the target's logit), so no rank holds the full logits.
    Returns the sum over target tokens (fp32, 0-d, the same on every rank). The backward gives
    each rank the gradient of its weight rows and sums the gradient of ``h`` over the group.
    ``chunk_rows`` (default :func:`default_chunk_rows` of ``ceil(vocab_size / ranks)``) must be
    the same on every rank, as must the shapes of ``h_ND`` and ``labels_N``.

    Raises:
        IndexError: a label outside [0, vocab_size) that is not ``IGNORE_INDEX``.
        ValueError: mismatched shapes, labels that are not integers, ``chunk_rows`` < 1, a
            row range outside the vocabulary.
    """
    where = "vocab_parallel_linear_cross_entropy_sum"
    _check_head_inputs(where, h_ND, weight_VD, labels_N, chunk_rows, vocab_size)
    if not 0 <= vocab_start <= vocab_start + weight_VD.shape[0] <= vocab_size:
        raise ValueError(f"{where}: rows [{vocab_start}, {vocab_start + weight_VD.shape[0]}) are not inside the vocabulary [0, {vocab_size})")
    if group is None or dist.get_world_size(group) == 1:
        if weight_VD.shape[0] != vocab_size:
            raise ValueError(f"{where}: without a group the weight must hold all {vocab_size} rows, not {weight_VD.shape[0]}")
        return linear_cross_entropy_sum(h_ND, weight_VD, labels_N, chunk_rows)
    ranks = dist.get_world_size(group)
    need_grad = torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad)
    rows = chunk_rows or default_chunk_rows(-(-vocab_size // ranks))
    return _LinearCrossEntropy.apply(copy_to_tp(h_ND, group), weight_VD, labels_N, rows, need_grad, vocab_start, group)
