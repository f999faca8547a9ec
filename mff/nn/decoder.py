"""The pre-norm decoder-only transformer shared by the GQA families (Llama, Qwen3, Qwen3-MoE,
GLM-4, GLM-4.5): embedding, decoder layers, final norm, output head, and the LM loss.

Param paths are HF's in-memory names: ``model.embed_tokens.weight``, ``model.layers.{i}.`` +
``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*`` (GLM-4 adds
``post_self_attn_layernorm`` and ``post_mlp_layernorm``), ``model.norm.weight`` and
``lm_head.weight`` (absent when the embeddings are tied).

Block (HF ``LlamaDecoderLayer``; GLM-4's "sandwich" norms from HF ``Glm4DecoderLayer``)::

    h = h + post_self_attn_norm(attn(input_norm(h)))     # post_self_attn_norm: GLM-4 only
    h = h + post_mlp_norm(mlp(post_attention_norm(h)))   # post_mlp_norm: GLM-4 only

Shape legend: B batch, T sequence, D hidden, V vocabulary, E experts, K top-k, N = B*T.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mff.model import Output
from mff.nn.attention import document_causal_mask
from mff.nn.layers import Embedding, RMSNorm
from mff.nn.loss import count_targets as _count
from mff.nn.loss import cross_entropy_sum
from mff.nn.moe import MoE
from mff.nn.rope import RopeParameters, rope_cos_sin, rope_inv_freq
from mff.parallel.gather import gather

__all__ = ["DecoderLayer", "CausalLM", "BalanceFn"]

# (config, router scores per MoE layer [N, E], chosen experts per MoE layer [N, K],
#  target counts) -> the weighted balance loss term, or None for none
BalanceFn = Callable[[Any, Sequence[torch.Tensor], Sequence[torch.Tensor], Mapping[str, torch.Tensor]], "torch.Tensor | None"]


class DecoderLayer(nn.Module):
    """One block. ``forward(h [B,T,D], cos, sin, mask) -> (h, (load [E], scores [N,E], idx [N,K]) | None)``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, sandwich_norms: bool = False):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        if sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(hidden_size, eps)
            self.post_mlp_layernorm = RMSNorm(hidden_size, eps)
        else:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None

    def forward(self, h_BTD, cos, sin, mask):
        a = self.self_attn(self.input_layernorm(h_BTD), cos, sin, mask)
        if self.post_self_attn_layernorm is not None:
            a = self.post_self_attn_layernorm(a)
        h_BTD = h_BTD + a
        x = self.post_attention_layernorm(h_BTD)
        routing = None
        if isinstance(self.mlp, MoE):
            y, load, scores, idx = self.mlp(x)
            routing = (load, scores, idx)
        else:
            y = self.mlp(x)
        if self.post_mlp_layernorm is not None:
            y = self.post_mlp_layernorm(y)
        return h_BTD + y, routing


class _Body(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], eps: float):
        super().__init__()
        self.embed_tokens = Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)


class CausalLM(nn.Module):
    """The skeleton of a GQA family. ``forward(input_ids, labels=None, position_ids=None,
    document_ids=None, target_counts=None) -> Output`` (see :meth:`mff.model.Model.forward`).

    Args:
        cfg: the family config; reads ``vocab_size``, ``hidden_size``, ``rms_norm_eps``,
            ``tie_word_embeddings``, ``max_position_embeddings``.
        layers: the decoder layers (:class:`DecoderLayer`), in order.
        rope: RoPE parameters; ``rotary_dim``: rotating dims per head.
        balance_fn: computes the weighted MoE balance loss term from the routing outputs, or
            None for a model without one.
    """

    def __init__(self, cfg: Any, layers: list[nn.Module], rope: RopeParameters, rotary_dim: int,
                 balance_fn: BalanceFn | None = None):
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        inv_freq, self.attention_factor = rope_inv_freq(rope, rotary_dim)
        self._inv_freq = inv_freq.tolist()  # a plain list: skeletons hold no buffers
        self._balance_fn = balance_fn

    def forward(self, input_ids, labels=None, position_ids=None, document_ids=None, target_counts=None):
        cfg = self.config
        B, T = input_ids.shape
        if T > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        h = self.model.embed_tokens(input_ids)
        inv_freq = torch.tensor(self._inv_freq, dtype=torch.float32, device=input_ids.device)
        cos, sin = rope_cos_sin(position_ids, inv_freq, self.attention_factor, h.dtype)
        mask = document_causal_mask(document_ids) if document_ids is not None else None

        expert_load: dict[str, torch.Tensor] = {}
        scores, indices = [], []
        for i, layer in enumerate(self.model.layers):
            h, routing = layer(h, cos, sin, mask)
            if routing is not None:
                expert_load[f"model.layers.{i}.mlp"] = routing[0].detach()
                scores.append(routing[1])
                indices.append(routing[2])
        w = self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
        logits = self.model.norm(h) @ gather(w).t()
        out = Output(logits=logits, expert_load=expert_load)
        if labels is None:
            return out
        counts = target_counts if target_counts is not None else {"lm": _count(labels), "balance": torch.tensor(labels.numel())}
        out.losses["lm"] = cross_entropy_sum(logits, labels) / counts["lm"].clamp(min=1)
        if scores and self._balance_fn is not None:
            term = self._balance_fn(cfg, scores, indices, {**counts, "tokens": torch.tensor(labels.numel())})
            if term is not None:
                out.losses["balance"] = term
        return out
