"""Grouped-query attention (GQA, Ainslie et al. 2023, arXiv 2305.13245) with the switches the
Llama, Qwen2/3 and GLM-4 families need: q/k/v (and o) biases, per-head q/k RMSNorm before RoPE
(Qwen3, GLM-4.5 ``use_qk_norm``), partial rotary and the three RoPE pair layouts.

Param names are HF transformers': ``q_proj`` [H*Dh, D], ``k_proj`` / ``v_proj`` [Hkv*Dh, D],
``o_proj`` [D, H*Dh], optional ``q_norm`` / ``k_norm`` [Dh]. Query head h reads KV head
``h // (H / Hkv)`` (HF ``repeat_kv``; :func:`mff.nn.attention.repeat_kv`). Softmax scale ``Dh ** -0.5``.

Tensor parallelism (Megatron-LM): with q/k/v split by heads over ``tp`` (column-parallel, their
biases split alike) and o_proj by its input heads (row-parallel), each rank computes H / tp
query heads and Hkv / tp KV heads; rank r's query heads read rank r's KV heads, the same
``h // (H / Hkv)`` grouping. Head counts are read from the projections' local widths. q/k
norms act per head and stay replicated; their gradients are summed over tp.

Shape legend: B batch, T sequence, D hidden, H query heads, Hkv KV heads, Dh head_dim,
R rotary dims (<= Dh).
"""

from __future__ import annotations

import torch
from torch import nn

from mff.nn.attention import causal_attention
from mff.nn.layers import Linear, RMSNorm, linears
from mff.nn.paged import cache_update, from_rows, to_rows
from mff.nn.rope import apply_rope
from mff.parallel.tp import tp_shard

__all__ = ["GQA"]


def _group(w: torch.Tensor):
    split = tp_shard(w)
    return split.group if split is not None else None


class GQA(nn.Module):
    """``forward(x [B,T,D], cos, sin [B,T,R], mask [B,1,T,T] | None) -> [B,T,D]``.

    Args:
        qkv_bias: biases on q/k/v (Qwen2, GLM-4 ``attention_bias``).
        o_bias: a bias on o_proj (Llama and Qwen3 ``attention_bias`` set both).
        qk_norm: RMSNorm over each head's Dh dims of q and k, before RoPE.
        rope_layout: ``"half"``, ``"interleave"`` or ``"pairs"`` (see :mod:`mff.nn.rope`).
    Raises:
        ValueError: ``num_heads`` not a multiple of ``num_key_value_heads``.
    """

    def cache_shapes(self, batch_size: int, max_len: int) -> dict[str, tuple[int, ...]]:
        """Shapes of this layer's KV cache: K and V per KV head."""
        return {"k": (batch_size, max_len, self.num_kv, self.head_dim), "v": (batch_size, max_len, self.num_kv, self.head_dim)}

    def __init__(self, hidden_size: int, num_heads: int, num_key_value_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False, rope_layout: str = "half",
                 eps: float = 1e-6):
        super().__init__()
        if num_key_value_heads < 1 or num_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_key_value_heads}")
        self.num_heads, self.num_kv, self.head_dim = num_heads, num_key_value_heads, head_dim
        self.rope_layout = rope_layout
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, num_key_value_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, num_key_value_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                kv: dict | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """``kv``: this layer's cache ``{"k", "v": [B, S, Hkv, Dh]}``; the new keys and values are
        written at ``slots`` (int64 [T], in place) and attention runs over all S slots with
        ``mask`` [B, 1, T, S]. With a paged cache (pools ``[num_blocks, block_size, Hkv, Dh]``)
        ``slots`` is a :class:`mff.nn.paged.PagedBatch` and ``x`` the packed tokens [1, N, D]."""
        B, T, _ = x_BTD.shape
        # -1: the heads of this rank (all of them without tensor parallelism)
        q, k, v = (y.view(B, T, -1, self.head_dim) for y in linears(x_BTD, [self.q_proj, self.k_proj, self.v_proj]))
        if self.q_norm is not None:
            q, k = self.q_norm(q, _group(self.q_proj.weight)), self.k_norm(k, _group(self.k_proj.weight))
        q = apply_rope(q, cos, sin, layout=self.rope_layout)
        k = apply_rope(k, cos, sin, layout=self.rope_layout)
        if kv is not None:
            if kv["k"].shape[2] != k.shape[2]:
                raise NotImplementedError(f"a KV cache of {kv['k'].shape[2]} KV heads, but this rank computes {k.shape[2]}: "
                                          "generation with a GQA KV cache under tensor parallelism is not supported")
            k, v = cache_update(kv, slots, k=k, v=v)
            q = to_rows(q, slots)
        o = from_rows(causal_attention(q, k, v, self.head_dim ** -0.5, mask), slots)
        return self.o_proj(o.reshape(B, T, -1))
