"""Causal self-attention for training on a CPU, in blocks of query rows, as torch custom ops.

On a CPU, torch's fused flash-attention kernel (``F.scaled_dot_product_attention``) runs its
small tiles through the BLAS at a fraction of the matmul peak; this op runs the same
attention as a few large batched matmuls per block of query rows and keeps each block's
probabilities for the backward (no recomputation of the scores):

- forward, for the query rows ``s .. e`` of each block (``block`` rows) and the keys ``0 .. e``
  they may see (the causal mask applies inside the diagonal ``block x block`` tile only):
  ``S = q[s:e] k[:e]^T * scale`` in fp32 (the inputs cast up: the same products with fp32 sums
  that the flash kernel forms; the scale as the GEMM's alpha), ``P = softmax(S)`` in fp32,
  stored in the input dtype, ``o[s:e] = P v[:e]``;
- backward (FlashAttention-2, Dao 2023, section 3.1 / Algorithm 2, with the stored ``P`` instead
  of a recomputed one): ``dP = do[s:e] v[:e]^T`` in fp32, ``delta = rowsum(do * o)``,
  ``dS = P * (dP - delta)``, ``dq[s:e] = dS k[:e] * scale``, ``dk[:e] += dS^T q[s:e] * scale``,
  ``dv[:e] += P^T do[s:e]``; ``dk`` and ``dv`` are summed in fp32 (float64 for float64 inputs).

Measured on this project's 2-core CPU (2026-12-07, forward + backward of one layer, batch 4 x 8
heads x 512 tokens, 2 threads, alternating with the flash kernel, median of 7): head width 96
with 64-wide values (MLA; the flash kernel needs V zero-padded to 96) 0.68-0.71x the flash
kernel's time in fp32 and 0.56x in bf16, head width 64 0.72-0.81x in fp32 and 0.57-0.66x in
bf16. The error against a float64 reference is the flash kernel's in fp32; in bf16 (and fp16) it
is up to 1.4-3x the flash kernel's per op (relative by norm 0.0022-0.0033 against 0.0016-0.0017 at
8 x 256 tokens x width 32; the max error half the flash kernel's at 32 x 512 x 96), because the
probabilities are kept rounded to bf16 and ``dS`` is rounded to bf16 for its two products, while
a whole qwen3 bf16-mixed model's gradient error is the same with either kernel (review,
2026-12-07).
Recomputing the probabilities in the backward from a stored log-sum-exp instead (what the flash
kernel does) kept only 0.84-1.02x of the flash kernel's time. The stored probabilities cost
``N x block^2 x (1 + 2 + ... + T / block)`` elements per layer (about half of ``N T^2``).

- ``mff::causal_attention(q [N, T, D], k [N, T, D], v [N, T, E], scale, block)
  -> (o [N, T, E], p [packed])``: ``N`` = batch x heads, floating dtypes, all three alike;
- ``mff::causal_attention_backward(do, q, k, v, o, p, scale, block) -> (dq, dk, dv)``.

Both are ops so that ``torch.compile`` holds them whole (opaque to the compiler, the same
kernels as eagerly) and selective activation checkpointing can save the forward's outputs
(:mod:`mff.nn.blocks`). ValueError for shapes or dtypes that do not match (naming them).
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "MAX_TOKENS", "causal_attention_blocks", "probs_numel"]

BLOCK = 64
"""Query rows per block: 64 measured fastest of 64 / 128 / 256 at 512 tokens (see above)."""

MAX_TOKENS = 512
"""The longest sequence :mod:`mff.nn.attention` sends here: measured faster than the flash kernel
at 512 tokens, slower at 1024 (batch 2: 1.05-1.61x its time, fp32 and bf16, head widths 64 and
96, on a loaded machine), where torch's flash kernel also takes larger tiles, while the stored
probabilities grow with ``T^2``."""


def probs_numel(N: int, T: int, block: int) -> int:
    """Elements of the packed probabilities: block ``i`` (rows ``s .. e``) holds ``N x (e - s) x e``;
    in closed form (valid for symbolic sizes under ``torch.compile``): ``m = T // block`` full
    blocks hold ``block^2 (1 + ... + m)`` per row of ``N``, the last partial one ``(T - m block) T``."""
    m = T // block
    return N * (block * block * m * (m + 1) // 2 + (T - m * block) * T)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [N, T, D], [N, T, D], [N, T, E]; got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected k shaped like q and "
                         f"v [N, T, E] with q's N and T")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}: expected one floating dtype")
    if block < 1:
        raise ValueError(f"block={block}; expected a positive number of query rows")


def _blocks(T: int, block: int):
    """(s, e, offset) per block of query rows: rows ``s .. e``, keys ``0 .. e``, and where the
    block's probabilities start in the packed buffer (in units of N)."""
    offset = 0
    for s in range(0, T, block):
        e = min(s + block, T)
        yield s, e, offset
        offset += (e - s) * e


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op("mff::causal_attention", mutates_args=())
def causal_attention_blocks(q_NTD: torch.Tensor, k_NTD: torch.Tensor, v_NTE: torch.Tensor, scale: float,
                            block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [N, T, E], p)``: causal ``softmax(q k^T * scale) v`` per row of ``N``, and the
    probabilities of every block packed in one 1-d buffer (:func:`probs_numel` elements, the
    input dtype) for the backward."""
    _check(q_NTD, k_NTD, v_NTE, block)
    N, T, _ = q_NTD.shape
    block = max(1, min(block, T))  # one block of all rows when block >= T (the same packing)
    acc = _acc_dtype(q_NTD.dtype)
    q, k, v = q_NTD.contiguous(), k_NTD.contiguous(), v_NTE.contiguous()
    qa, ka = q.to(acc), k.to(acc)
    o = q.new_empty(N, T, v.shape[-1])
    p_all = q.new_empty(probs_numel(N, T, block))
    hidden = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)  # key after query
    scores_all = q.new_empty(N * block * T, dtype=acc)
    for s, e, off in _blocks(T, block):
        scores = scores_all[:N * (e - s) * e].view(N, e - s, e)
        torch.baddbmm(scores, qa[:, s:e], ka[:, :e].transpose(1, 2), beta=0, alpha=scale, out=scores)  # scale in the GEMM
        scores[:, :, s:e].masked_fill_(hidden[:e - s, :e - s], float("-inf"))
        p = p_all[N * off:N * (off + (e - s) * e)].view(N, e - s, e)
        if p.dtype == acc:
            torch.softmax(scores, dim=-1, out=p)
        else:
            p.copy_(torch.softmax(scores, dim=-1))
        torch.bmm(p, v[:, :e], out=o[:, s:e])
    return o, p_all


@causal_attention_blocks.register_fake
def _(q_NTD, k_NTD, v_NTE, scale, block):
    _check(q_NTD, k_NTD, v_NTE, block)
    N, T, _ = q_NTD.shape
    return q_NTD.new_empty(N, T, v_NTE.shape[-1]), q_NTD.new_empty(probs_numel(N, T, block))


@torch.library.custom_op("mff::causal_attention_backward", mutates_args=())
def causal_attention_backward(do_NTE: torch.Tensor, q_NTD: torch.Tensor, k_NTD: torch.Tensor, v_NTE: torch.Tensor,
                              o_NTE: torch.Tensor, p: torch.Tensor, scale: float, block: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`causal_attention_blocks` for the output gradient ``do_NTE``."""
    _check(q_NTD, k_NTD, v_NTE, block)
    N, T, D = q_NTD.shape
    block = max(1, min(block, T))
    acc = _acc_dtype(q_NTD.dtype)
    q, k, v = q_NTD.contiguous(), k_NTD.contiguous(), v_NTE.contiguous()
    do = do_NTE.to(q.dtype).contiguous()
    da, va = do.to(acc), v.to(acc)
    delta = (da * o_NTE.to(acc)).sum(-1, keepdim=True).mul_(scale)  # [N, T, 1], times scale
    dq = torch.empty_like(q)
    dk = torch.zeros(N, T, D, dtype=acc, device=q.device)
    dv = torch.zeros(N, T, v.shape[-1], dtype=acc, device=q.device)
    same = q.dtype == acc
    ds_all = q.new_empty(N * block * T, dtype=acc)
    for s, e, off in _blocks(T, block):
        pb = p[N * off:N * (off + (e - s) * e)].view(N, e - s, e)
        ds = ds_all[:N * (e - s) * e].view(N, e - s, e)
        torch.baddbmm(ds, da[:, s:e], va[:, :e].transpose(1, 2), beta=0, alpha=scale, out=ds)  # dP * scale
        ds.sub_(delta[:, s:e]).mul_(pb)  # dS * scale (0 at hidden keys: P is 0 there)
        ds = ds if same else ds.to(q.dtype)
        torch.bmm(ds, k[:, :e], out=dq[:, s:e])
        if same:
            dk[:, :e].baddbmm_(ds.transpose(1, 2), q[:, s:e])
            dv[:, :e].baddbmm_(pb.transpose(1, 2), do[:, s:e])
        else:  # low-precision products (the flash kernel's), summed in fp32
            dk[:, :e] += torch.bmm(ds.transpose(1, 2), q[:, s:e])
            dv[:, :e] += torch.bmm(pb.transpose(1, 2), do[:, s:e])
    return dq, dk.to(q.dtype), dv.to(q.dtype)


@causal_attention_backward.register_fake
def _(do_NTE, q_NTD, k_NTD, v_NTE, o_NTE, p, scale, block):
    return torch.empty_like(q_NTD), torch.empty_like(k_NTD), torch.empty_like(v_NTE)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, block = inputs
    o, p = output
    ctx.mark_non_differentiable(p)
    ctx.save_for_backward(q, k, v, o, p)
    ctx.scale, ctx.block = scale, block


def _backward(ctx, do, _dp):
    q, k, v, o, p = ctx.saved_tensors
    dq, dk, dv = causal_attention_backward(do, q, k, v, o, p, ctx.scale, ctx.block)
    return dq, dk, dv, None, None


causal_attention_blocks.register_autograd(_backward, setup_context=_setup_context)
