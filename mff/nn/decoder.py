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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mff.model import Output
from mff.nn.attention import cache_causal_mask, document_causal_mask
from mff.nn.blocks import BlockExecution, run_block
from mff.nn.head import HeadWeight, head_cross_entropy_sum, head_logits, head_weight
from mff.nn.layers import Embedding, RMSNorm
from mff.nn.loss import count_targets as _count
from mff.nn.moe import MoE
from mff.nn.rope import RopeParameters, rope_cos_sin, rope_inv_freq

__all__ = ["DecoderLayer", "CausalLM", "BalanceLoss", "prepare_positions_and_mask"]


@dataclass(frozen=True)
class BalanceLoss:
    """A family's MoE balance loss as additive statistics, so pipeline stages can each sum their
    own layers' and the last stage finish the term.

    - ``stats(config, router scores per MoE layer [N, E], chosen experts per layer [N, K])``:
      a 1-d fp32 tensor of a fixed size that adds up over disjoint sets of layers, or None when
      the loss is off;
    - ``finish(config, stats summed over every MoE layer, target counts + "tokens")``: the
      weighted term (0-d);
    - ``size(config)``: the length of the statistics, 0 when the loss is off.
    """

    stats: Callable[[Any, Sequence[torch.Tensor], Sequence[torch.Tensor]], "torch.Tensor | None"]
    finish: Callable[[Any, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    size: Callable[[Any], int]


def prepare_positions_and_mask(input_ids, position_ids, document_ids, attention_mask, cache, max_positions):
    """Positions, attention mask and cache bookkeeping for one forward.

    Without a cache: positions default to ``0 .. T-1`` (or follow ``attention_mask`` for left
    padding); the mask is None (plain causal), the document mask, or causal & valid keys.
    With a cache (see :meth:`mff.model.Model.init_cache`): the new slots ``pos .. pos + T - 1``
    are marked valid per ``attention_mask``; each row's positions continue from its
    ``next_pos``; the mask is aligned bottom-right and spans every cache slot. All of it is
    tensor arithmetic on ``cache["pos"]`` (no host value), so a decode step traces once.

    Returns ``(position_ids [B, T], mask or None, slots int64 [T] or None, updated cache or None)``.
    Raises ValueError when the sequence or the cache would exceed their lengths (the cache check
    uses the host counter ``cache["offset"]`` when present).
    """
    B, T = input_ids.shape
    valid = attention_mask.bool() if attention_mask is not None else None
    if cache is None:
        if T > max_positions:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings {max_positions}")
        if position_ids is None:
            position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0) if valid is not None else torch.arange(T, device=input_ids.device).expand(B, T)
        mask = document_causal_mask(document_ids) if document_ids is not None else None
        if valid is not None:
            pad_mask = cache_causal_mask(valid, 0, T)
            mask = pad_mask if mask is None else mask & pad_mask
        return position_ids, mask, None, None
    if "paged" in cache:  # a paged cache (mff.nn.paged): the batch is packed, its layout computed by the engine
        paged = cache["paged"]
        if input_ids.shape != paged.position_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} do not match the paged batch's {tuple(paged.position_ids.shape)} tokens")
        return paged.position_ids, paged.mask, paged, cache
    S = cache["valid"].shape[1]
    new_cache = dict(cache)
    if "offset" in cache:
        if cache["offset"] + T > S:
            raise ValueError(f"the KV cache holds {S} slots; {cache['offset']} are filled and {T} more do not fit")
        new_cache["offset"] = cache["offset"] + T
    step_valid = valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
    pos = cache["pos"]
    slots = pos + torch.arange(T, device=input_ids.device)
    cache["valid"].index_copy_(1, slots, step_valid)
    if position_ids is None:
        position_ids = (cache["next_pos"][:, None] + step_valid.long().cumsum(-1) - 1).clamp(min=0)
    mask = cache_causal_mask(cache["valid"], pos, T)
    new_cache["pos"] = pos + T
    new_cache["next_pos"] = cache["next_pos"] + step_valid.long().sum(-1)
    return position_ids, mask, slots, new_cache


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

    def forward(self, h_BTD, cos, sin, mask, kv=None, slots=None):
        a = self.self_attn(self.input_layernorm(h_BTD), cos, sin, mask, kv, slots)
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
    document_ids=None, target_counts=None, attention_mask=None, cache=None) -> Output`` (see
    :meth:`mff.model.Model.forward`); :meth:`pipeline_stage` runs a part of the same forward
    (a pipeline stage).

    Args:
        cfg: the family config; reads ``vocab_size``, ``hidden_size``, ``rms_norm_eps``,
            ``tie_word_embeddings``, ``max_position_embeddings``.
        layers: the decoder layers (:class:`DecoderLayer`), in order.
        rope: RoPE parameters; ``rotary_dim``: rotating dims per head.
        balance: the MoE balance loss as additive statistics, or None for a model without one.
    """

    def __init__(self, cfg: Any, layers: list[nn.Module], rope: RopeParameters, rotary_dim: int,
                 balance: BalanceLoss | None = None):
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg.vocab_size, cfg.hidden_size, layers, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        inv_freq, self.attention_factor = rope_inv_freq(rope, rotary_dim)
        self._inv_freq = inv_freq.tolist()  # a plain list: skeletons hold no buffers
        self._balance = balance
        self.execution: BlockExecution | None = None  # set by Model.with_execution

    def cache_shapes(self, batch_size: int, max_len: int) -> list[dict[str, tuple[int, ...]]]:
        """Per layer, the shapes of its KV cache tensors."""
        return [layer.self_attn.cache_shapes(batch_size, max_len) for layer in self.model.layers]

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.tensor(self._inv_freq, dtype=torch.float32, device=position_ids.device)
        return rope_cos_sin(position_ids, inv_freq, self.attention_factor, dtype)

    def _layers(self, h, cos, sin, mask, indices: range, layer_kv=None, slots=None):
        """Layers ``indices`` on ``h`` [B, T, D]: ``(h, expert loads {path: [E]}, balance
        statistics of these layers or None)``."""
        expert_load: dict[str, torch.Tensor] = {}
        scores, chosen = [], []
        for i in indices:
            h, routing = run_block(self.model.layers[i], self.execution, h, cos, sin, mask, layer_kv[i] if layer_kv else None, slots)
            if routing is not None:
                expert_load[f"model.layers.{i}.mlp"] = routing[0].detach()
                scores.append(routing[1])
                chosen.append(routing[2])
        stats = self._balance.stats(self.config, scores, chosen) if scores and self._balance is not None else None
        return h, expert_load, stats

    def _head(self) -> HeadWeight:
        cfg = self.config
        return head_weight(self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight)

    def _losses(self, h_norm, head: HeadWeight, labels, counts, stats) -> dict[str, torch.Tensor]:
        """The weighted loss terms from the final-normed hidden states [B, T, D] and the
        balance statistics of every MoE layer (or None)."""
        B, T = labels.shape
        losses = {"lm": head_cross_entropy_sum(h_norm.reshape(B * T, -1), head, labels.reshape(-1)) / counts["lm"].clamp(min=1)}
        if stats is not None:
            losses["balance"] = self._balance.finish(self.config, stats, {**counts, "tokens": torch.tensor(labels.numel())})
        return losses

    def forward(self, input_ids, labels=None, position_ids=None, document_ids=None, target_counts=None, attention_mask=None, cache=None,
                return_logits=True):
        cfg = self.config
        position_ids, mask, slots, new_cache = prepare_positions_and_mask(
            input_ids, position_ids, document_ids, attention_mask, cache, cfg.max_position_embeddings)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(position_ids, h.dtype)
        layer_kv = cache["layers"] if cache is not None else None
        h, expert_load, stats = self._layers(h, cos, sin, mask, range(len(self.model.layers)), layer_kv, slots)
        head = self._head()
        h = self.model.norm(h)
        if isinstance(return_logits, torch.Tensor):  # only these positions' logits (a paged batch's sequence ends)
            logits = head_logits(h[:, return_logits], head)
        elif return_logits == "last":  # only the last position's logits (a prefill that samples or scores from it)
            logits = head_logits(h[:, -1:], head)
        else:
            logits = head_logits(h, head) if return_logits or labels is None else None
        out = Output(logits=logits, expert_load=expert_load, cache=new_cache)
        if labels is None:
            return out
        counts = target_counts if target_counts is not None else {"lm": _count(labels), "balance": torch.tensor(labels.numel())}
        out.losses.update(self._losses(h, head, labels, counts, stats))
        return out

    def pipeline_stage(self, carry: tuple[torch.Tensor, ...], layers: range, first: bool, last: bool, input_ids, labels=None,
                       position_ids=None, document_ids=None, attention_mask=None, target_counts=None):
        """One pipeline stage of :meth:`forward` (training, no cache): the embedding when
        ``first``, the decoder layers ``layers``, and when ``last`` the final norm, the head and
        the losses. ``carry`` is what the previous stage returned: ``(h [B, T, D],)``, plus the
        balance statistics so far ``[S]`` when the model has a balance loss (empty for the first
        stage). Returns ``(carry for the next stage, or the weighted loss terms when last;
        expert loads {path: [E]} of this stage's MoE layers)``. The same computation as
        :meth:`forward`, term for term; only sums of balance statistics are regrouped."""
        cfg = self.config
        position_ids, mask, _, _ = prepare_positions_and_mask(input_ids, position_ids, document_ids, attention_mask, None,
                                                              cfg.max_position_embeddings)
        h = self.model.embed_tokens(input_ids) if first else carry[0]
        stats_in = carry[1] if len(carry) > 1 else None
        cos, sin = self._rope(position_ids, h.dtype)
        h, expert_load, stats = self._layers(h, cos, sin, mask, layers)
        stats = _add_stats(stats_in, stats, self._balance_size(input_ids.device))
        if not last:
            return ((h,) if stats is None else (h, stats)), expert_load
        counts = target_counts if target_counts is not None else {"lm": _count(labels), "balance": torch.tensor(labels.numel())}
        return self._losses(self.model.norm(h), self._head(), labels, counts, stats), expert_load

    def pipeline_carry_shapes(self, batch_size: int, seq_len: int) -> list[tuple[tuple[int, ...], bool]]:
        """What a non-last :meth:`pipeline_stage` returns, as ``(shape, is_hidden)`` per tensor:
        the hidden states (compute dtype) and, with a balance loss, its statistics (fp32)."""
        out = [((batch_size, seq_len, self.config.hidden_size), True)]
        zero = self._balance_size("meta")
        if zero is not None:
            out.append(((zero.shape[0],), False))
        return out

    def _balance_size(self, device) -> torch.Tensor | None:
        """Zero balance statistics (what a stage without MoE layers passes on), or None for a
        model without a balance loss or without MoE layers."""
        if self._balance is None or not any(isinstance(layer.mlp, MoE) for layer in self.model.layers):
            return None
        n = self._balance.size(self.config)
        return torch.zeros(n, dtype=torch.float32, device=device) if n else None


def _add_stats(a: torch.Tensor | None, b: torch.Tensor | None, zero) -> torch.Tensor | None:
    if a is None and b is None:
        return zero
    if a is None:
        return b
    return a if b is None else a + b
