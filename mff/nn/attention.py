"""Causal self-attention over [B, T, H, D] tensors, optionally restricted to documents.

``document_ids`` [B, T] (int) marks packed documents: query t attends key s only when
``s <= t`` and both carry the same id. Without it the mask is plain causal (SDPA's
``is_causal``). Computed by ``F.scaled_dot_product_attention``; value and query/key head
dims may differ (MLA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["document_causal_mask", "causal_attention"]


def document_causal_mask(document_ids_BT: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, T, T], True where query t may attend key s (s <= t, same document)."""
    T = document_ids_BT.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids_BT.device).tril()
    same = document_ids_BT[:, :, None] == document_ids_BT[:, None, :]
    return (causal & same)[:, None]


def causal_attention(
    q_BTHD: torch.Tensor,
    k_BTHD: torch.Tensor,
    v_BTHE: torch.Tensor,
    scale: float,
    mask_B1TT: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, per head. Returns [B, T, H, E].

    ``mask_B1TT`` from :func:`document_causal_mask`, or None for plain causal attention.
    """
    q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BTHD, v_BTHE))
    if mask_B1TT is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TT, scale=scale)
    return o.transpose(1, 2)
