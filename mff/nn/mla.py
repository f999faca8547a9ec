"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3 (arXiv 2412.19437 section 2.1.1), the
naive (expanded) path used for training and full-sequence forward.

Param names are HF transformers' ``DeepseekV3Attention``:
``q_a_proj`` [q_lora, D], ``q_a_layernorm`` [q_lora], ``q_b_proj`` [H*(N+R), q_lora]
(or ``q_proj`` [H*(N+R), D] when ``q_lora_rank`` is None), ``kv_a_proj_with_mqa``
[C+R, D], ``kv_a_layernorm`` [C], ``kv_b_proj`` [H*(N+Vd), C], ``o_proj`` [D, H*Vd].

With a KV cache (generation) the layer caches only the normalised latent ``c`` [C] and the
rotated shared key ``k_rot`` [R] per token, and attends in the latent space ("absorbed"
attention, DeepSeek-V2 paper section 2.1.2 / appendix; MindFormers' absorbed MLA): with
``kv_b_proj`` split into ``W_UK`` [H, N, C] and ``W_UV`` [H, Vd, C], the score is
``(q_nope W_UK) . c_s + q_rot . k_rot_s`` and the output ``(sum_s a_s c_s) W_UV^T``, which
equals the expanded computation. The cache per token per layer is C + R values. With a LoRA
adapter on ``kv_b_proj`` the absorbed path uses ``W + s B A`` (built per decode step for that
one weight; merging the adapter first avoids it).

Tensor parallelism (Megatron-LM): ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` split by
heads over ``tp`` (column-parallel), ``o_proj`` by its input heads (row-parallel); the
low-rank ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms, and so the latent cache, stay
replicated. Each rank computes H / tp heads, read from the projections' local widths.

Shape legend: B batch, T sequence, S cached slots, D hidden, H heads, N qk_nope_head_dim,
R qk_rope_head_dim, Vd v_head_dim, C kv_lora_rank. Numerics follow HF ``DeepseekV3Attention``: the softmax scale is
``(N + R) ** -0.5`` times the YaRN correction (:func:`mff.nn.rope.yarn_softmax_scale`).
"""

from __future__ import annotations

import torch
from torch import nn

from mff.nn.attention import causal_attention
from mff.nn.layers import Linear, RMSNorm, linears
from mff.nn.lora import delta_weight, slot_name
from mff.nn.paged import cache_update, from_rows, to_rows
from mff.nn.rope import apply_rope
from mff.parallel.gather import gather
from mff.parallel.tp import TP_AXIS, copy_to_tp, tp_shard

__all__ = ["MLA"]


class MLA(nn.Module):
    """MLA block. ``forward(x [B,T,D], cos, sin [B,T,R], mask [B,1,T,T] | None) -> [B,T,D]``."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        rope_interleave: bool,
        attention_bias: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.softmax_scale = softmax_scale
        self.rope_interleave = rope_interleave
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk_dim)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * qk_dim)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)

    def cache_shapes(self, batch_size: int, max_len: int) -> dict[str, tuple[int, ...]]:
        """Shapes of this layer's cache: the latent ``c`` [C] and the rotated key ``k_rot`` [R] per slot."""
        return {"c": (batch_size, max_len, self.kv_lora_rank), "k_rot": (batch_size, max_len, self.rope)}

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                kv: dict | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Without ``kv``: the expanded path (training). With ``kv`` (``{"c": [B, S, C],
        "k_rot": [B, S, R]}``): writes this step's ``slots`` (int64 [T]) in place and attends over
        all S slots in the latent space, ``mask`` [B, 1, T, S]. A paged cache (pools
        ``[num_blocks, block_size, C]`` / ``[.., R]``) comes with a :class:`mff.nn.paged.PagedBatch`
        as ``slots`` and the packed tokens [1, N, D] as ``x``."""
        B, T, _ = x_BTD.shape
        if self.q_lora_rank is None:
            q, kv_a = linears(x_BTD, [self.q_proj, self.kv_a_proj_with_mqa])
        else:
            q_a, kv_a = linears(x_BTD, [self.q_a_proj, self.kv_a_proj_with_mqa])
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q_BTHK = q.view(B, T, -1, self.nope + self.rope)  # H: this rank's heads
        H = q_BTHK.shape[2]
        q_nope, q_rot = q_BTHK.split([self.nope, self.rope], dim=-1)

        c_BTC, k_rot_BTR = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        c_BTC = self.kv_a_layernorm(c_BTC)

        q_rot = apply_rope(q_rot, cos, sin, self.rope_interleave)
        # the shared rotary key (replicated over tp) serves this rank's heads only: its
        # gradient is summed over the tp ranks (Megatron's copy to the tensor-parallel region)
        split = tp_shard(self.kv_b_proj.weight)
        k_rot_BTR = copy_to_tp(k_rot_BTR, split.group if split is not None else None)
        k_rot_BT1R = apply_rope(k_rot_BTR.unsqueeze(2), cos, sin, self.rope_interleave)
        if kv is not None:
            return self._absorbed(q_nope, q_rot, c_BTC, k_rot_BT1R.squeeze(2), mask, kv, slots)

        kv = self.kv_b_proj(c_BTC).view(B, T, H, self.nope + self.v_dim)
        k_nope, v_BTHV = kv.split([self.nope, self.v_dim], dim=-1)
        q_full = torch.cat((q_nope, q_rot), dim=-1)
        k_full = torch.cat((k_nope, k_rot_BT1R.expand(B, T, H, self.rope)), dim=-1)
        o_BTHV = causal_attention(q_full, k_full, v_BTHV, self.softmax_scale, mask)
        return self.o_proj(o_BTHV.reshape(B, T, H * self.v_dim))

    def _absorbed(self, q_nope, q_rot, c_BTC, k_rot_BTR, mask, kv, slots):
        B, T, H, _ = q_nope.shape
        c_BSC, k_rot_BSR = cache_update(kv, slots, c=c_BTC, k_rot=k_rot_BTR)
        w = gather(self.kv_b_proj.weight, keep=(TP_AXIS,))
        lora = self.kv_b_proj.__dict__["_modules"].get(slot_name("weight"))
        if lora is not None:  # the absorbed path needs the adapted weight itself: W + s B A, this rank's heads
            w = w + delta_weight(gather(lora.A), gather(lora.B, keep=(TP_AXIS,)), lora.scale)
        w = w.view(H, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)  # [H, N, C], [H, Vd, C]
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)
        q_cat = to_rows(torch.cat((q_lat, q_rot), dim=-1), slots)  # [B, T, H, C + R]
        k_cat = torch.cat((c_BSC, k_rot_BSR), dim=-1)[:, :, None]  # [B, S, 1, C + R]: one key head (MQA)
        o_lat = from_rows(causal_attention(q_cat, k_cat, c_BSC[:, :, None], self.softmax_scale, mask), slots)
        o_BTHV = torch.einsum("bthc,hvc->bthv", o_lat, w_uv)
        return self.o_proj(o_BTHV.reshape(B, T, H * self.v_dim))
