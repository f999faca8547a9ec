"""DeepSeek-V3 (arXiv 2412.19437): MLA attention, DeepSeekMoE with aux-loss-free routing
(sigmoid scores + expert bias, group-limited top-k), sequence-wise balance loss, and MTP.

Numerics follow HF transformers ``models/deepseek_v3`` (v5); param paths are HF's in-memory
names, with MTP depths at ``model.layers.{num_hidden_layers + k}`` under DeepSeek's checkpoint
names. Config field names are HF's ``DeepseekV3Config`` names (and DeepSeek's own
``num_nextn_predict_layers``, ``moe_layer_freq``, ``aux_loss_alpha``); the class defaults are
HF's, the published DeepSeek-V3 with its YaRN context is size ``v3-671b``.

Shape legend: B batch, T sequence, D hidden_size, V vocab_size, E routed experts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mff.model import Family, Output
from mff.models.common import config_from_hf, config_to_hf, scaled_init_table
from mff.models.validate import MAX_HEAD_DIM, check_pad_token
from mff.nn.blocks import BlockExecution, run_block
from mff.nn.decoder import prepare_positions_and_mask
from mff.nn.head import HeadWeight, head_cross_entropy_sum, head_logits, head_weight
from mff.nn.layers import Embedding, RMSNorm
from mff.nn.loss import count_targets as _count
from mff.nn.mla import MLA
from mff.nn.mlp import GatedMLP
from mff.nn.moe import MoE, sequence_balance_loss
from mff.nn.mtp import add_mtp_params, mtp_block_input, mtp_labels
from mff.nn.rope import RopeParameters, rope_cos_sin, rope_inv_freq, yarn_softmax_scale

__all__ = ["DeepseekV3Config", "SIZES", "FAMILY", "DeepseekV3ForCausalLM", "MLA_LATENT_NORM_EPS"]

MLA_LATENT_NORM_EPS = 1e-6
"""Epsilon of MLA's ``q_a_layernorm`` / ``kv_a_layernorm``: fixed, not ``rms_norm_eps`` (DeepSeek's
reference ``model.py`` and HF ``DeepseekV3Attention`` build both norms with the default 1e-6)."""


@dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek-V3 architecture (HF ``DeepseekV3Config`` names; the defaults are HF's: the
    671B dimensions with plain RoPE and 4096 positions, the real YaRN context is size
    ``v3-671b``) plus its training coefficients."""

    vocab_size: int = 129280
    """Vocabulary size V."""
    hidden_size: int = 7168
    """Model width D."""
    intermediate_size: int = 18432
    """Width of the dense MLP layers."""
    moe_intermediate_size: int = 2048
    """Width of each routed expert (and, times n_shared_experts, of the shared expert)."""
    num_hidden_layers: int = 61
    """Transformer layers of the main model (MTP depths come on top)."""
    num_attention_heads: int = 128
    """Attention heads H."""
    num_key_value_heads: int = 128
    """Kept for HF config compatibility; MLA does not use it."""
    n_shared_experts: int = 1
    """Shared experts per MoE layer (0 = none)."""
    n_routed_experts: int = 256
    """Routed experts E per MoE layer."""
    routed_scaling_factor: float = 2.5
    """Multiplier of the routed experts' gate weights."""
    kv_lora_rank: int = 512
    """MLA compressed KV width C (what the inference cache stores)."""
    q_lora_rank: int | None = 1536
    """MLA query compression width; None = a full-rank q_proj."""
    qk_rope_head_dim: int = 64
    """Rotary part R of each query/key head (one shared rotary key per token)."""
    v_head_dim: int = 128
    """Value head width."""
    qk_nope_head_dim: int = 128
    """Non-rotary part N of each query/key head."""
    n_group: int = 8
    """Expert groups for group-limited routing (1 = no limit)."""
    topk_group: int = 4
    """Groups each token may route into."""
    num_experts_per_tok: int = 8
    """Routed experts per token K (top-k)."""
    first_k_dense_replace: int = 3
    """The first layers that use a dense MLP instead of MoE."""
    moe_layer_freq: int = 1
    """After the dense layers, every moe_layer_freq-th layer is MoE (DeepSeek's rule: index % freq == 0)."""
    norm_topk_prob: bool = True
    """Normalise the top-k gate weights to sum 1 before routed_scaling_factor."""
    hidden_act: Literal["silu"] = "silu"
    """MLP activation (SwiGLU)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model accepts."""
    initializer_range: float = 0.02
    """Std of the normal init of weight matrices."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_parameters: RopeParameters = RopeParameters()
    """RoPE / YaRN parameters (HF v5 rope_parameters)."""
    rope_interleave: bool = True
    """DeepSeek's interleaved rotary pair layout (HF rope_interleave)."""
    attention_bias: bool = False
    """Biases on q_a_proj, kv_a_proj_with_mqa and o_proj."""
    tie_word_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    num_nextn_predict_layers: int = 1
    """MTP depths D (0 = no MTP)."""
    bos_token_id: int | None = 0
    """Beginning-of-sequence token id (metadata)."""
    eos_token_id: int | None = 1
    """End-of-sequence token id (metadata)."""
    pad_token_id: int | None = None
    """Padding token id (metadata)."""
    aux_loss_alpha: float = 0.0001
    """Sequence-wise balance loss weight alpha (paper section 4.2: 0.0001); 0 = off."""
    mtp_loss_scaling_factor: float = 0.3
    """MTP loss weight lambda (paper section 4.2: 0.3 for the first 10T tokens, then 0.1)."""
    moe_router_bias_update_rate: float = 0.001
    """Expert-bias update speed gamma of aux-loss-free balancing (paper: 0.001); 0 = frozen bias."""

    def validate(self) -> None:
        """Check the config; raise ValueError naming the first bad field and what it must be."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"model config: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            need(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be > 0")
        for name in ("qk_nope_head_dim", "n_shared_experts", "n_routed_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")
        for name in ("initializer_range", "aux_loss_alpha", "mtp_loss_scaling_factor", "moe_router_bias_update_rate"):
            v = getattr(self, name)
            need(math.isfinite(v) and v >= 0, f"{name}={v} must be a finite number >= 0")
        need(math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        need(math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0,
             f"routed_scaling_factor={self.routed_scaling_factor} must be a finite number > 0")
        need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        for name in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            need(getattr(self, name) <= MAX_HEAD_DIM, f"{name}={getattr(self, name)} is past {MAX_HEAD_DIM:,}; no attention head is that wide")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, f"q_lora_rank={self.q_lora_rank} must be > 0 or None")
        need(self.moe_layer_freq >= 1, f"moe_layer_freq={self.moe_layer_freq} must be >= 1")
        if self.n_routed_experts:
            need(1 <= self.num_experts_per_tok <= self.n_routed_experts,
                 f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts={self.n_routed_experts}]")
            need(self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts={self.n_routed_experts} must divide into n_group={self.n_group} groups")
            need(1 <= self.topk_group <= self.n_group, f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
            need(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
                 f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of topk_group={self.topk_group} groups")
            need(self.moe_intermediate_size > 0, f"moe_intermediate_size={self.moe_intermediate_size} must be > 0")
        try:
            self.rope_parameters.validate()
        except ValueError as e:
            raise ValueError(f"model config: {e}") from None
        check_pad_token(self)

    @property
    def qk_head_dim(self) -> int:
        """Query/key head width N + R."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, idx: int) -> bool:
        """True when layer ``idx`` (MTP depths included, at ``num_hidden_layers + k``) is MoE."""
        return self.n_routed_experts > 0 and idx >= self.first_k_dense_replace and idx % self.moe_layer_freq == 0


SIZES: dict[str, DeepseekV3Config] = {
    # CPU default: trains in minutes on 2 cores; every feature on (group-limited routing, MTP).
    "tiny": DeepseekV3Config(
        vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=128,
        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096,
        rope_parameters=RopeParameters(rope_theta=10000.0), num_nextn_predict_layers=1, bos_token_id=None, eos_token_id=None,
    ),
    # The paper's dimensions (meta device only on CPU).
    "v3-671b": DeepseekV3Config(
        max_position_embeddings=163840,
        rope_parameters=RopeParameters(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
                                       mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096),
    ),
}


# ------------------------------------------------------------------------------------------
# skeleton


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + MLA(norm(h))``, then ``+ MLP or MoE(norm(h))``."""

    def __init__(self, cfg: DeepseekV3Config, idx: int):
        super().__init__()
        scale = cfg.qk_head_dim ** -0.5 * yarn_softmax_scale(cfg.rope_parameters)
        self.self_attn = MLA(
            cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, scale, cfg.rope_interleave, cfg.attention_bias, MLA_LATENT_NORM_EPS,
        )
        if cfg.is_moe_layer(idx):
            self.mlp = MoE(
                cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                cfg.n_shared_experts, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h_BTD, cos, sin, mask, kv=None, slots=None):
        """Returns ``(h [B,T,D], expert load [E] | None, balance [B] | None)``."""
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos, sin, mask, kv, slots)
        x = self.post_attention_layernorm(h_BTD)
        if isinstance(self.mlp, MoE):
            y, load, scores, idx = self.mlp(x)
            B, T, _ = x.shape
            return h_BTD + y, load, sequence_balance_loss(scores.view(B, T, -1), idx.view(B, T, -1))
        return h_BTD + self.mlp(x), None, None


class DeepseekV3Model(nn.Module):
    """``embed_tokens``, ``layers`` (main layers, then MTP depths), ``norm``."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        for k in range(cfg.num_nextn_predict_layers):
            idx = cfg.num_hidden_layers + k
            layers.append(add_mtp_params(DecoderLayer(cfg, idx), cfg.hidden_size, cfg.rms_norm_eps))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    """The skeleton. ``forward(input_ids, labels=None, position_ids=None, document_ids=None,
    target_counts=None, attention_mask=None, cache=None) -> Output`` (see
    :meth:`mff.model.Model.forward`; with a cache the MTP depths are skipped and no loss is computed)."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        inv_freq, self.attention_factor = rope_inv_freq(cfg.rope_parameters, cfg.qk_rope_head_dim)
        self._inv_freq = inv_freq.tolist()  # a plain list: skeletons hold no buffers
        self.execution: BlockExecution | None = None  # set by Model.with_execution

    def _head_weight(self) -> HeadWeight:
        return head_weight(self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight)

    def cache_shapes(self, batch_size: int, max_len: int) -> list[dict[str, tuple[int, ...]]]:
        """Per main layer (MTP depths are not used in generation), the MLA latent cache shapes."""
        return [self.model.layers[i].self_attn.cache_shapes(batch_size, max_len) for i in range(self.config.num_hidden_layers)]

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.tensor(self._inv_freq, dtype=torch.float32, device=position_ids.device)
        return rope_cos_sin(position_ids, inv_freq, self.attention_factor, dtype)

    def _layers(self, h, cos, sin, mask, indices: range, layer_kv=None, slots=None):
        """Main layers ``indices`` on ``h`` [B, T, D]: ``(h, expert loads {path: [E]}, per-layer
        balance terms [B] of these layers' MoE blocks)``."""
        expert_load: dict[str, torch.Tensor] = {}
        balance: list[torch.Tensor] = []
        for i in indices:
            h, load, bal = run_block(self.model.layers[i], self.execution, h, cos, sin, mask, layer_kv[i] if layer_kv else None, slots)
            if load is not None:
                expert_load[f"model.layers.{i}.mlp"] = load.detach()
                balance.append(bal)
        return h, expert_load, balance

    def _losses(self, h, h_norm, emb_BTD, head: HeadWeight, cos, sin, mask, labels, document_ids, counts, balance_sum, expert_load):
        """The weighted loss terms from the last layer's output ``h`` [B, T, D] and its final
        norm ``h_norm``: the main head's,
        the MTP depths' (which also add their expert loads to ``expert_load``) and the balance
        term from ``balance_sum`` (the sum of every earlier MoE layer's per-sequence terms, or 0)."""
        cfg = self.config
        B, T = labels.shape
        L = cfg.num_hidden_layers
        losses = {"lm": head_cross_entropy_sum(h_norm.reshape(B * T, -1), head, labels.reshape(-1)) / counts["lm"].clamp(min=1)}
        mtp_terms = []
        for k in range(1, cfg.num_nextn_predict_layers + 1):
            layer = self.model.layers[L + k - 1]
            emb_next = torch.roll(emb_BTD, shifts=-k, dims=1)  # Emb(x_{t+k}); wrapped tail is masked
            h, load, bal = run_block(layer, self.execution, mtp_block_input(layer, h, emb_next), cos, sin, mask)
            if load is not None:
                expert_load[f"model.layers.{L + k - 1}.mlp"] = load.detach()
                balance_sum = balance_sum + bal.sum()
            ce = head_cross_entropy_sum(layer.shared_head.norm(h).reshape(B * T, -1), head, mtp_labels(labels, document_ids, k).reshape(-1))
            mtp_terms.append(ce / counts[f"mtp.{k}"].clamp(min=1))
        if mtp_terms:
            losses["mtp"] = cfg.mtp_loss_scaling_factor / len(mtp_terms) * sum(mtp_terms)
        if self._has_moe() and cfg.aux_loss_alpha > 0:
            losses["balance"] = cfg.aux_loss_alpha * balance_sum / counts["balance"].clamp(min=1)
        return losses

    def pipeline_carry_shapes(self, batch_size: int, seq_len: int) -> list[tuple[tuple[int, ...], bool]]:
        """What a non-last :meth:`pipeline_stage` returns, as ``(shape, is_hidden)`` per tensor:
        the hidden states (compute dtype) and, with MoE layers and a balance loss, the sum of
        the balance terms so far (fp32 [1])."""
        out = [((batch_size, seq_len, self.config.hidden_size), True)]
        if self._has_moe() and self.config.aux_loss_alpha > 0:
            out.append(((1,), False))
        return out

    def _has_moe(self) -> bool:
        cfg = self.config
        return any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers))

    def _counts(self, input_ids, labels, document_ids, target_counts):
        if target_counts is not None:
            return target_counts
        return count_targets(self.config, {"labels": labels, "document_ids": document_ids, "input_ids": input_ids})

    def forward(self, input_ids, labels=None, position_ids=None, document_ids=None, target_counts=None, attention_mask=None, cache=None,
                return_logits=True):
        cfg = self.config
        position_ids, mask, slots, new_cache = prepare_positions_and_mask(
            input_ids, position_ids, document_ids, attention_mask, cache, cfg.max_position_embeddings)
        emb_BTD = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(position_ids, emb_BTD.dtype)
        layer_kv = cache["layers"] if cache is not None else None
        h, expert_load, balance = self._layers(emb_BTD, cos, sin, mask, range(cfg.num_hidden_layers), layer_kv, slots)
        head = self._head_weight()
        h_main = self.model.norm(h)
        with_loss = labels is not None and cache is None
        if isinstance(return_logits, torch.Tensor):  # only these positions' logits (a paged batch's sequence ends)
            logits = head_logits(h_main[:, return_logits], head)
        elif return_logits == "last":  # only the last position's logits (a prefill that samples or scores from it)
            logits = head_logits(h_main[:, -1:], head)
        else:
            logits = head_logits(h_main, head) if return_logits or not with_loss else None
        out = Output(logits=logits, expert_load=expert_load, cache=new_cache)
        if not with_loss:
            return out
        counts = self._counts(input_ids, labels, document_ids, target_counts)
        balance_sum = sum(b.sum() for b in balance)
        out.losses.update(self._losses(h, h_main, emb_BTD, head, cos, sin, mask, labels, document_ids, counts, balance_sum, expert_load))
        return out

    def pipeline_stage(self, carry: tuple[torch.Tensor, ...], layers: range, first: bool, last: bool, input_ids, labels=None,
                       position_ids=None, document_ids=None, attention_mask=None, target_counts=None):
        """One pipeline stage of :meth:`forward` (training, no cache): the embedding when
        ``first``, the main layers ``layers``, and when ``last`` the final norm, the head, the MTP
        depths (with the embedding of the shifted tokens: the last stage holds the embedding
        too) and the losses. ``carry`` is what the previous stage returned: ``(h [B, T, D],)``,
        plus the sum of the per-sequence balance terms so far [1] when the model has MoE layers
        and a balance loss (empty for the first stage). Returns ``(carry for the next stage, or
        the weighted loss terms when last; expert loads {path: [E]} of this stage's MoE layers,
        MTP depths included)``. The same computation as :meth:`forward`, term for term; only the
        sum of balance terms is regrouped by stage."""
        cfg = self.config
        position_ids, mask, _, _ = prepare_positions_and_mask(input_ids, position_ids, document_ids, attention_mask, None,
                                                              cfg.max_position_embeddings)
        emb_BTD = self.model.embed_tokens(input_ids) if first or (last and cfg.num_nextn_predict_layers) else None
        h = emb_BTD if first else carry[0]
        cos, sin = self._rope(position_ids, h.dtype)
        h, expert_load, balance = self._layers(h, cos, sin, mask, layers)
        carries_balance = self._has_moe() and cfg.aux_loss_alpha > 0
        balance_sum = carry[1].reshape(()) if len(carry) > 1 else 0
        balance_sum = balance_sum + sum(b.sum() for b in balance)
        if not last:
            if not carries_balance:
                return (h,), expert_load
            if not isinstance(balance_sum, torch.Tensor):
                balance_sum = torch.zeros((), dtype=torch.float32, device=h.device)
            return (h, balance_sum.reshape(1)), expert_load
        counts = self._counts(input_ids, labels, document_ids, target_counts)
        losses = self._losses(h, self.model.norm(h), emb_BTD, self._head_weight(), cos, sin, mask, labels, document_ids, counts, balance_sum, expert_load)
        return losses, expert_load


# ------------------------------------------------------------------------------------------
# tables


def init_table(cfg: DeepseekV3Config) -> list[tuple[str, tuple]]:
    """:func:`mff.models.common.scaled_init_table` with L = main layers + MTP depths: norms 1,
    expert bias and biases 0, residual output projections N(0, (0.02 / sqrt(2 L))^2), the rest
    N(0, 0.02^2)."""
    return scaled_init_table(cfg.initializer_range, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)


def sharding_table(cfg: DeepseekV3Config) -> list[tuple[str, tuple]]:
    """(path pattern, logical axis per dim). ``embed`` is the hidden dim FSDP splits; ``heads``
    dims split in whole heads (tensor parallelism: q_b/q and kv_b column-parallel, o
    row-parallel; the low-rank q_a and kv_a projections, their norms and eh_proj stay whole
    over tp), ``mlp`` the dense and shared-expert width (gate/up column, down row), ``vocab``
    the vocabulary, ``lora`` MLA's low-rank dims (q_lora_rank, kv_lora_rank), which FSDP splits
    like ``embed``. Routed experts are not tensor-parallel (their ``mlp`` dims are None)."""
    qk = ("heads", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return [
        ("model.embed_tokens.weight", ("vocab", "embed")),
        ("lm_head.weight", ("vocab", "embed")),
        ("**.q_proj.weight", (qk, "embed")),
        ("**.q_a_proj.weight", (None, "embed")),
        ("**.q_b_proj.weight", (qk, "lora")),
        ("**.kv_a_proj_with_mqa.weight", (None, "embed")),
        ("**.kv_b_proj.weight", (("heads", cfg.qk_nope_head_dim + cfg.v_head_dim), "lora")),
        ("**.o_proj.weight", ("embed", ("heads", cfg.v_head_dim))),
        ("**.o_proj.bias", ("embed",)),
        ("**.bias", (None,)),
        ("**.mlp.gate.weight", (None, "embed")),
        ("**.mlp.gate.e_score_correction_bias", (None,)),
        ("**.experts.gate_up_proj", ("expert", None, "embed")),
        ("**.experts.down_proj", ("expert", "embed", None)),
        ("**.gate_proj.weight", ("mlp", "embed")),
        ("**.up_proj.weight", ("mlp", "embed")),
        ("**.down_proj.weight", ("embed", "mlp")),
        ("**.eh_proj.weight", ("embed", None)),
        ("**.q_a_layernorm.weight", ("lora",)),
        ("**.kv_a_layernorm.weight", ("lora",)),
        ("**.*norm.weight", ("embed",)),
    ]


def count_targets(cfg: DeepseekV3Config, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Denominators of the loss terms for ``batch`` (see :meth:`mff.model.Model.count_targets`)."""
    labels = batch.get("labels")
    if labels is None:
        return {}
    docs = batch.get("document_ids")
    out = {"lm": _count(labels)}
    for k in range(1, cfg.num_nextn_predict_layers + 1):
        out[f"mtp.{k}"] = _count(mtp_labels(labels, docs, k))
    out["balance"] = torch.tensor(labels.shape[0], dtype=torch.int64)
    return out


def _is_mtp(cfg: DeepseekV3Config, path: str) -> bool:
    parts = path.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.num_hidden_layers


def param_counts(cfg: DeepseekV3Config, shapes: Mapping[str, torch.Size]) -> dict[str, int]:
    """``total`` params and ``activated`` per token (routed experts count K/E of their size, the
    output head counts, the embedding lookup does not), each also without MTP (``*_no_mtp``)."""
    frac = cfg.num_experts_per_tok / cfg.n_routed_experts if cfg.n_routed_experts else 1.0
    res = {"total": 0, "activated": 0.0, "total_no_mtp": 0, "activated_no_mtp": 0.0}
    for path, shape in shapes.items():
        n = math.prod(shape)
        act = n * frac if ".experts." in path else (0 if path == "model.embed_tokens.weight" and not cfg.tie_word_embeddings else n)
        res["total"] += n
        res["activated"] += act
        if not _is_mtp(cfg, path):
            res["total_no_mtp"] += n
            res["activated_no_mtp"] += act
    return {k: int(round(v)) for k, v in res.items()}


def train_flops_per_token(cfg: DeepseekV3Config, shapes: Mapping[str, torch.Size], seq_len: int) -> float:
    """Training FLOPs per token: 6 x (activated params without the embedding lookup, plus the
    head once more per MTP depth) + causal attention ``6 H (qk + v) (T + 1) / 2`` per layer
    (the PaLM paper's appendix B count, with the causal mask halving the context)."""
    counts = param_counts(cfg, shapes)
    dense = counts["activated"] + cfg.num_nextn_predict_layers * cfg.vocab_size * cfg.hidden_size
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    attn = layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * (seq_len + 1) / 2
    return 6.0 * (dense + attn)


def from_hf_config(d: dict) -> DeepseekV3Config:
    """A DeepseekV3Config from an HF ``deepseek_v3`` config.json dict. A config without
    ``num_nextn_predict_layers`` means 1, as ``DeepseekV3Config``'s default; a folder without
    MTP tensors then loads with MTP off (:func:`mff.ckpt.hf.load_hf_tensors` says so).

    ``num_key_value_heads`` is read and not used (MLA has one key and value per head).

    Raises:
        ValueError: as :func:`mff.models.common.config_from_hf`."""
    return config_from_hf(DeepseekV3Config, d, aliases={"n_routed_experts": ("num_local_experts",)})


def to_hf_config(cfg: DeepseekV3Config) -> dict:
    """HF ``deepseek_v3`` config.json dict (keeps DeepSeek's num_nextn_predict_layers;
    num_key_value_heads = num_attention_heads, which HF's MLA code assumes)."""
    out = config_to_hf(cfg, "deepseek_v3", "DeepseekV3ForCausalLM", skip=("mtp_loss_scaling_factor", "moe_router_bias_update_rate"))
    out["num_key_value_heads"] = cfg.num_attention_heads
    return out


FAMILY = Family(
    name="deepseek3",
    config_cls=DeepseekV3Config,
    sizes=SIZES,
    default_size="tiny",
    skeleton=DeepseekV3ForCausalLM,
    init_table=init_table,
    sharding_table=sharding_table,
    count_targets=count_targets,
    param_counts=param_counts,
    train_flops_per_token=train_flops_per_token,
    fp32_params=("**.mlp.gate.weight", "**.e_score_correction_bias"),
    frozen_params=("**.e_score_correction_bias",),
    hf_model_types=("deepseek_v3",),
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
    description="DeepSeek-V3: MLA, MoE with aux-loss-free routing, MTP",
)


