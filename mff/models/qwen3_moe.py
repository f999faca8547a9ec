"""Qwen3-MoE: Qwen3's attention with softmax-routed MoE layers and HF's Switch-style router
balance loss.

Numerics follow HF transformers ``models/qwen3_moe`` (v5): a layer is MoE when it is not in
``mlp_only_layers`` and ``(idx + 1) % decoder_sparse_step == 0``; routing is softmax, top-k,
renormalised when ``norm_topk_prob``; no shared experts. The balance loss is HF's
``load_balancing_loss_func`` over all MoE layers of the batch, weighted by
``router_aux_loss_coef`` (mff adds it whenever labels are given; HF only with
``output_router_logits``). Config names are HF's ``Qwen3MoeConfig`` names (``num_experts``,
also read from ``num_local_experts``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from mff.model import Family
from mff.models import common
from mff.models.qwen3 import qwen3_attention, sliding_window_check
from mff.models.validate import check_gqa, check_moe, need
from mff.nn.decoder import BalanceLoss, CausalLM, DecoderLayer
from mff.nn.mlp import GatedMLP
from mff.nn.moe import MoE, switch_balance_from_stats, switch_balance_stats
from mff.nn.rope import RopeParameters, rotary_dim

__all__ = ["Qwen3MoeConfig", "SIZES", "FAMILY", "skeleton"]


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-MoE architecture (HF ``Qwen3MoeConfig`` names; the defaults are HF's, so a
    config.json that leaves a key out means what it means to transformers)."""

    vocab_size: int = 151936
    """Vocabulary size V."""
    hidden_size: int = 2048
    """Model width D."""
    intermediate_size: int = 6144
    """Width of dense (mlp_only) layers."""
    moe_intermediate_size: int = 768
    """Width of each routed expert."""
    num_hidden_layers: int = 24
    """Transformer layers L."""
    num_attention_heads: int = 32
    """Query heads H."""
    num_key_value_heads: int = 4
    """KV heads (GQA)."""
    head_dim: int | None = None
    """Per-head width; None = hidden_size // num_attention_heads."""
    hidden_act: Literal["silu"] = "silu"
    """Activation (SwiGLU)."""
    max_position_embeddings: int = 32768
    """Longest sequence the model accepts."""
    initializer_range: float = 0.02
    """Std of the normal init of weight matrices."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    rope_parameters: RopeParameters = RopeParameters()
    """RoPE parameters (HF v5 rope_parameters)."""
    attention_bias: bool = False
    """Biases on q/k/v/o."""
    num_experts: int = 128
    """Routed experts E per MoE layer (HF also spells it num_local_experts)."""
    num_experts_per_tok: int = 8
    """Routed experts per token K (top-k)."""
    norm_topk_prob: bool = False
    """Renormalise the top-k probabilities to sum 1."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is MoE (HF: (idx + 1) % step == 0)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layer indices that use a dense MLP."""
    router_aux_loss_coef: float = 0.001
    """Weight of the router balance loss (0 = off)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id (metadata)."""
    eos_token_id: int | tuple[int, ...] | None = None
    """End-of-sequence token id(s) (metadata)."""
    pad_token_id: int | None = None
    """Padding token id (metadata)."""

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        check_gqa(self)
        check_moe(self, self.num_experts)
        need(self.decoder_sparse_step >= 1, f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        need(math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0,
             f"router_aux_loss_coef={self.router_aux_loss_coef} must be a finite number >= 0")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        need(not bad, f"mlp_only_layers {bad} are outside [0, num_hidden_layers={self.num_hidden_layers})")

    def is_moe_layer(self, idx: int) -> bool:
        """HF's rule for layer ``idx``."""
        return self.num_experts > 0 and (idx + 1) % self.decoder_sparse_step == 0 and idx not in self._dense_layers

    @functools.cached_property
    def _dense_layers(self) -> frozenset[int]:
        return frozenset(self.mlp_only_layers)


SIZES = {
    "tiny": Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, moe_intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=(0,),
                           rope_parameters=RopeParameters(rope_theta=1000000.0)),
    "30b-a3b": Qwen3MoeConfig(num_hidden_layers=48, head_dim=128, max_position_embeddings=40960, norm_topk_prob=True,
                              rope_parameters=RopeParameters(rope_theta=1000000.0), bos_token_id=151643, eos_token_id=151645),
    "235b-a22b": Qwen3MoeConfig(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                                num_attention_heads=64, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                                norm_topk_prob=True, rope_parameters=RopeParameters(rope_theta=1000000.0),
                                bos_token_id=151643, eos_token_id=151645),
}


def balance_stats(cfg: Qwen3MoeConfig, scores, indices):
    """The Switch balance loss's additive statistics of some MoE layers (None when the loss is off)."""
    if cfg.router_aux_loss_coef <= 0:
        return None
    return switch_balance_stats(scores, indices, cfg.num_experts)


def _balance_size(cfg: Qwen3MoeConfig) -> int:
    return 2 * cfg.num_experts + 1 if cfg.router_aux_loss_coef > 0 else 0


def balance_loss(cfg: Qwen3MoeConfig, stats, counts):
    """``router_aux_loss_coef * switch_balance_loss`` from the statistics of every MoE layer,
    weighted by this batch's share of the step's tokens (``counts["tokens"] / counts["balance"]``)
    so micro-batches sum to the mean."""
    aux = switch_balance_from_stats(stats, cfg.num_experts)
    return cfg.router_aux_loss_coef * aux * counts["tokens"].to(aux.device) / counts["balance"].clamp(min=1).to(aux.device)


def skeleton(cfg: Qwen3MoeConfig) -> CausalLM:
    """The meta skeleton (HF ``Qwen3MoeForCausalLM`` param paths)."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = MoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                      norm_topk_prob=cfg.norm_topk_prob, scoring_func="softmax")
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        layers.append(DecoderLayer(qwen3_attention(cfg), mlp, cfg.hidden_size, cfg.rms_norm_eps))
    return CausalLM(cfg, layers, cfg.rope_parameters, rotary_dim(cfg.rope_parameters, cfg.head_dim), balance=BalanceLoss(balance_stats, balance_loss, _balance_size))


def _fraction(cfg: Qwen3MoeConfig) -> float:
    return cfg.num_experts_per_tok / cfg.num_experts


FAMILY = Family(
    name="qwen3_moe",
    config_cls=Qwen3MoeConfig,
    sizes=SIZES,
    default_size="tiny",
    skeleton=skeleton,
    init_table=common.gqa_init_table,
    sharding_table=common.gqa_sharding_table,
    count_targets=common.lm_balance_count_targets,
    param_counts=lambda cfg, shapes: common.gqa_param_counts(cfg, shapes, _fraction(cfg)),
    train_flops_per_token=lambda cfg, shapes, T: common.gqa_train_flops_per_token(cfg, shapes, T, _fraction(cfg)),
    fp32_params=("**.mlp.gate.weight",),
    hf_model_types=("qwen3_moe",),
    from_hf_config=lambda d: common.config_from_hf(Qwen3MoeConfig, d, aliases={"num_experts": ("num_local_experts",)},
                                                   checks=sliding_window_check),
    to_hf_config=lambda cfg: common.config_to_hf(cfg, "qwen3_moe", "Qwen3MoeForCausalLM"),
    description="Qwen3-MoE: GQA with q/k norm, softmax-routed experts",
)
