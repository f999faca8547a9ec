"""Causal self-attention over [B, T, H, D] tensors, optionally restricted to documents, to
valid (non-padding) keys, and against a KV cache.

Masks are boolean, True where query i may attend key j:

- packed documents (``document_ids`` [B, T]): ``j <= i`` and both in the same document;
- with a KV cache holding ``offset`` earlier slots, the causal mask is aligned bottom-right:
  query i of L_q (absolute slot ``offset + i``) sees keys ``j <= offset + i``, and only keys
  marked valid (left padding and unfilled slots are invalid). The mask spans every slot of the
  preallocated cache, so a decode step has the same shapes at every position (one compiled graph).

A query row with no visible key (a padding position) gives 0, never NaN. Computed by
``F.scaled_dot_product_attention``, except plain causal attention for training on a CPU, which
takes the blockwise op of :mod:`mff.nn.block_attention` (faster there; :func:`cpu_block_attention`
turns it off); value and query/key head dims may differ (MLA). On an NPU the op table's
``attention`` entry (``torch_npu.npu_fusion_attention``, :mod:`mff.backend.npu_attention`)
computes it instead, with this torch path as its fallback.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from mff.backend import ops
from mff.nn.block_attention import BLOCK, MAX_TOKENS, causal_attention_blocks
from mff.nn.layers import is_plain

__all__ = ["document_causal_mask", "cache_causal_mask", "causal_attention", "attention_torch", "repeat_kv", "cpu_block_attention"]

_CPU_BLOCKS = True


@contextlib.contextmanager
def cpu_block_attention(enabled: bool):
    """Within the block, whether plain causal attention for training on a CPU, up to
    ``MAX_TOKENS`` (512) tokens, takes the blockwise op of :mod:`mff.nn.block_attention` (the
    default, True: faster than the flash kernel there, and it keeps each layer's attention
    probabilities, about ``batch x heads x T^2 / 2`` values in the compute dtype, for the
    backward) or the flash kernel (False: keeps only a log-sum-exp per query, as on CUDA; for a
    CPU run short of memory, or to measure what an accelerator keeps). Not thread-safe: a process-wide setting while the block runs. With
    activation checkpointing the backward runs the forward again, so the backward must run
    inside the same block (otherwise the recomputation takes the other kernel and checkpointing
    raises that the recomputed values differ)."""
    global _CPU_BLOCKS
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r}; expected True or False")
    before, _CPU_BLOCKS = _CPU_BLOCKS, enabled
    try:
        yield
    finally:
        _CPU_BLOCKS = before


def document_causal_mask(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, T, T], True where query t may attend key s (s <= t, same document)."""
    T = document_ids_BT.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids_BT.device).tril()
    same = document_ids_BT[:, :, None] == document_ids_BT[:, None, :]
    return (causal & same)[:, None]


def cache_causal_mask(key_valid_BS: torch.Tensor, offset: int | torch.Tensor, q_len: int) -> torch.Tensor:
    """Boolean mask [B, 1, q_len, S] for ``q_len`` new queries after ``offset`` (an int or a
    0-d tensor) filled slots of an S-slot cache: key j visible to query i iff ``j <= offset + i``
    and ``key_valid[b, j]``."""
    S = key_valid_BS.shape[1]
    j = torch.arange(S, device=key_valid_BS.device)
    i = torch.arange(q_len, device=key_valid_BS.device) + offset
    causal = j[None, :] <= i[:, None]  # [L, S]
    return (causal[None] & key_valid_BS[:, None, :])[:, None]


def repeat_kv(x_BSKD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * n_rep, D], KV head j serving query heads
    ``j * n_rep .. (j + 1) * n_rep - 1`` (HF ``repeat_kv``)."""
    if n_rep == 1:
        return x_BSKD
    B, S, K, D = x_BSKD.shape
    return x_BSKD[:, :, :, None, :].expand(B, S, K, n_rep, D).reshape(B, S, K * n_rep, D)


def causal_attention(
    q_BTHD: torch.Tensor,
    k_BSKD: torch.Tensor,
    v_BSKE: torch.Tensor,
    scale: float,
    mask_B1TS: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, per head. Returns [B, T, H, E].

    K/V may have fewer heads K than the queries' H (GQA / MQA; H a multiple of K): query head h
    reads KV head ``h // (H / K)``. ``mask_B1TS``: a boolean mask (:func:`document_causal_mask`,
    :func:`cache_causal_mask`), or None for plain causal attention with T == S. Rows with no
    visible key output 0.

    Few queries (decoding, T <= 16) take a plain einsum/softmax path over the grouped heads,
    which on CPU is far faster than SDPA with a mask at that size; otherwise
    ``F.scaled_dot_product_attention``. With an NPU op table, ``ops.attention`` (the fused kernel,
    this function's torch path where the kernel's limits are not met).
    """
    if ops.attention is not None:
        return ops.attention(q_BTHD, k_BSKD, v_BSKE, scale, mask_B1TS, attention_torch)
    return attention_torch(q_BTHD, k_BSKD, v_BSKE, scale, mask_B1TS)


def _blocks_apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Plain causal attention for training on a CPU (grad needed, T == S <= ``MAX_TOKENS``, plain
    tensors, not turned off by :func:`cpu_block_attention`): the blockwise op
    (:mod:`mff.nn.block_attention`) is faster there than the flash kernel. Inference (no grad)
    and longer sequences keep the flash kernel, which stores no probabilities."""
    if not (_CPU_BLOCKS and q.device.type == "cpu" and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False
    if torch.is_autocast_enabled("cpu") or torch._C._are_functorch_transforms_active():
        return False  # autocast casts SDPA's inputs, not a custom op's; torch.func.grad/vmap: SDPA's own rules
    B, T, H, D = q.shape
    K = k.shape[2]
    same = (k.shape == (B, T, K, D) and v.shape[:3] == (B, T, K) and H % K == 0  # else SDPA broadcasts or raises
            and q.dtype == k.dtype == v.dtype)
    return same and T <= MAX_TOKENS and all(is_plain(t) for t in (q, k, v))


def attention_torch(q_BTHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKE: torch.Tensor, scale: float,
                    mask_B1TS: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_attention` in plain torch, whatever the op table holds (the NPU entry's twin)."""
    B, T, H, _ = q_BTHD.shape
    K = k_BSKD.shape[2]
    n_rep = H // K
    if mask_B1TS is not None and T <= 16 and torch.compiler.is_compiling():
        # broadcast-and-sum forms the compiler fuses into loops over the cache (no copies)
        qg = q_BTHD.reshape(B, T, K, n_rep, q_BTHD.shape[-1]).permute(0, 2, 3, 1, 4)  # [B, K, rep, T, D]
        kk = k_BSKD.permute(0, 2, 1, 3)[:, :, None, None]  # [B, K, 1, 1, S, D]
        scores = (qg[:, :, :, :, None, :].float() * kk.float()).sum(-1) * scale  # [B, K, rep, T, S]
        m = mask_B1TS[:, :, None]
        empty = ~m.any(-1, keepdim=True)
        probs = torch.softmax(scores.masked_fill(~(m | empty), float("-inf")), dim=-1).masked_fill(empty, 0.0)
        vv = v_BSKE.permute(0, 2, 1, 3)[:, :, None, None]  # [B, K, 1, 1, S, E]
        o = (probs[..., None] * vv.float()).sum(-2).to(v_BSKE.dtype)  # [B, K, rep, T, E]
        return o.permute(0, 3, 1, 2, 4).reshape(B, T, H, v_BSKE.shape[-1])
    if mask_B1TS is not None and T <= 16:
        qg = q_BTHD.reshape(B, T, K, n_rep, q_BTHD.shape[-1])
        scores = torch.einsum("btkrd,bskd->bkrts", qg, k_BSKD).float() * scale  # [B, K, rep, T, S]
        m = mask_B1TS[:, :, None]  # [B, 1, 1, T, S]
        # a row with no visible key softmaxes to NaN; the where selects 0 there (and at every
        # hidden key), so NaN in visible scores still propagates. 4 ops a layer, not 7 (decode
        # is op-dispatch bound on CPU); masked_fill's backward zeroes the hidden keys' NaN grads
        probs = torch.where(m, torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1), 0.0)
        o = torch.einsum("bkrts,bske->btkre", probs.to(v_BSKE.dtype), v_BSKE)
        return o.reshape(B, T, H, v_BSKE.shape[-1])
    if mask_B1TS is None and _blocks_apply(q_BTHD, k_BSKD, v_BSKE):
        D, E = q_BTHD.shape[-1], v_BSKE.shape[-1]  # keys: T of them (_blocks_apply)
        q = q_BTHD.transpose(1, 2).reshape(B * H, T, D)
        k = repeat_kv(k_BSKD, n_rep).transpose(1, 2).reshape(B * H, T, D)
        v = repeat_kv(v_BSKE, n_rep).transpose(1, 2).reshape(B * H, T, E)
        o, _ = causal_attention_blocks(q, k, v, scale, BLOCK)
        return o.view(B, H, T, E).transpose(1, 2)
    q = q_BTHD.transpose(1, 2)
    k = repeat_kv(k_BSKD, n_rep).transpose(1, 2)
    v = repeat_kv(v_BSKE, n_rep).transpose(1, 2)
    D, E = q.shape[-1], v.shape[-1]
    if E < D:
        # MLA (value heads narrower than query/key heads): zero-pad V to the query width so SDPA
        # takes its fused flash kernel (which needs equal widths; the other path materialises
        # the [B, H, T, S] scores), then drop the padding (as HF does for flash attention)
        v = F.pad(v, (0, D - E))
    if mask_B1TS is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o[..., :E].transpose(1, 2)
    empty = ~mask_B1TS.any(-1, keepdim=True)  # [B, 1, T, 1]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS | empty, scale=scale)
    return o[..., :E].masked_fill(empty, 0.0).transpose(1, 2)
