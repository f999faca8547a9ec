"""GLM-4.5 (MoE): GQA (optional per-head q/k norm, q/k/v biases) with partial rotary in the
half layout, and DeepSeek-V3-style MoE layers: sigmoid routing with the fp32 expert bias
``e_score_correction_bias`` (aux-loss-free balancing, updated by the step function), group
limit, shared experts, ``first_k_dense_replace`` dense layers.

Numerics follow HF transformers ``models/glm4_moe`` (v5); config names are HF's
``Glm4MoeConfig`` names (``n_routed_experts``, also read from ``num_local_experts``). GLM-4.5's
MTP layers (``num_nextn_predict_layers``) are not built: their tensors are skipped on load with a
notice, as HF does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mff.model import Family
from mff.models import common
from mff.models.validate import check_gqa, check_moe, need
from mff.nn.decoder import CausalLM, DecoderLayer
from mff.nn.gqa import GQA
from mff.nn.mlp import GatedMLP
from mff.nn.moe import MoE
from mff.nn.rope import RopeParameters, rotary_dim

__all__ = ["Glm4MoeConfig", "SIZES", "FAMILY", "skeleton"]


@dataclass(frozen=True)
class Glm4MoeConfig:
    """GLM-4.5 architecture (HF ``Glm4MoeConfig`` names; the defaults are HF's) plus the
    expert-bias update rate."""

    vocab_size: int = 151552
    """Vocabulary size V."""
    hidden_size: int = 4096
    """Model width D."""
    intermediate_size: int = 10944
    """Width of the dense layers."""
    moe_intermediate_size: int = 1408
    """Width of each routed expert (times n_shared_experts: of the shared expert)."""
    num_hidden_layers: int = 46
    """Transformer layers L."""
    num_attention_heads: int = 96
    """Query heads H."""
    num_key_value_heads: int = 8
    """KV heads (GQA)."""
    head_dim: int | None = None
    """Per-head width; None = hidden_size // num_attention_heads."""
    hidden_act: Literal["silu"] = "silu"
    """Activation (SwiGLU)."""
    max_position_embeddings: int = 131072
    """Longest sequence the model accepts."""
    initializer_range: float = 0.02
    """Std of the normal init of weight matrices."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    rope_parameters: RopeParameters = RopeParameters(partial_rotary_factor=0.5)
    """RoPE parameters; partial_rotary_factor 0.5 rotates half of each head."""
    attention_bias: bool = False
    """Biases on q/k/v (not on o_proj)."""
    use_qk_norm: bool = False
    """Per-head RMSNorm of q and k before RoPE."""
    n_routed_experts: int = 128
    """Routed experts E per MoE layer."""
    n_shared_experts: int = 1
    """Shared experts per MoE layer."""
    num_experts_per_tok: int = 8
    """Routed experts per token K (top-k)."""
    routed_scaling_factor: float = 1.0
    """Multiplier of the routed experts' gate weights."""
    n_group: int = 1
    """Expert groups for group-limited routing."""
    topk_group: int = 1
    """Groups each token may route into."""
    first_k_dense_replace: int = 1
    """The first layers use a dense MLP."""
    norm_topk_prob: bool = True
    """Normalise the top-k gate weights before routed_scaling_factor."""
    num_nextn_predict_layers: int = 1
    """MTP layers of the published checkpoint (metadata; mff skips them)."""
    moe_router_bias_update_rate: float = 0.001
    """mff: expert-bias update speed of aux-loss-free balancing (0 = frozen bias)."""
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
        check_moe(self, self.n_routed_experts, self.n_group, self.topk_group)
        need(self.n_shared_experts >= 0, f"n_shared_experts={self.n_shared_experts} must be >= 0")
        need(self.first_k_dense_replace >= 0, f"first_k_dense_replace={self.first_k_dense_replace} must be >= 0")
        need(math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0,
             f"routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        need(math.isfinite(self.moe_router_bias_update_rate) and self.moe_router_bias_update_rate >= 0,
             f"moe_router_bias_update_rate={self.moe_router_bias_update_rate} must be >= 0")

    def is_moe_layer(self, idx: int) -> bool:
        """HF's rule for layer ``idx``: the first ``first_k_dense_replace`` layers are dense, the rest MoE."""
        return idx >= self.first_k_dense_replace


_GLM45_ROPE = RopeParameters(rope_theta=1000000.0, partial_rotary_factor=0.5)

SIZES = {
    "tiny": Glm4MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, moe_intermediate_size=256, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                          attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, num_nextn_predict_layers=0),
    "glm-4.5-air": Glm4MoeConfig(head_dim=128, attention_bias=True, rope_parameters=_GLM45_ROPE,
                                 eos_token_id=(151329, 151336, 151338), pad_token_id=151329),
    "glm-4.5": Glm4MoeConfig(hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92,
                             num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True, use_qk_norm=True,
                             n_routed_experts=160, routed_scaling_factor=2.5, first_k_dense_replace=3, rope_parameters=_GLM45_ROPE,
                             eos_token_id=(151329, 151336, 151338), pad_token_id=151329),
}


def skeleton(cfg: Glm4MoeConfig) -> CausalLM:
    """The meta skeleton (HF ``Glm4MoeForCausalLM`` param paths)."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = MoE(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                      cfg.n_shared_experts, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        attn = GQA(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                   qkv_bias=cfg.attention_bias, qk_norm=cfg.use_qk_norm, eps=cfg.rms_norm_eps)
        layers.append(DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps))
    return CausalLM(cfg, layers, cfg.rope_parameters, rotary_dim(cfg.rope_parameters, cfg.head_dim))


def _fraction(cfg: Glm4MoeConfig) -> float:
    return cfg.num_experts_per_tok / cfg.n_routed_experts


FAMILY = Family(
    name="glm4_moe",
    config_cls=Glm4MoeConfig,
    sizes=SIZES,
    default_size="tiny",
    skeleton=skeleton,
    init_table=common.gqa_init_table,
    sharding_table=common.gqa_sharding_table,
    count_targets=common.lm_count_targets,
    param_counts=lambda cfg, shapes: common.gqa_param_counts(cfg, shapes, _fraction(cfg)),
    train_flops_per_token=lambda cfg, shapes, T: common.gqa_train_flops_per_token(cfg, shapes, T, _fraction(cfg)),
    fp32_params=("**.mlp.gate.weight", "**.e_score_correction_bias"),
    frozen_params=("**.e_score_correction_bias",),
    hf_model_types=("glm4_moe",),
    from_hf_config=lambda d: common.config_from_hf(Glm4MoeConfig, d, aliases={"n_routed_experts": ("num_local_experts",)},
                                                   partial_rotary=True),
    to_hf_config=lambda cfg: common.config_to_hf(cfg, "glm4_moe", "Glm4MoeForCausalLM", skip=("moe_router_bias_update_rate",)),
    description="GLM-4.5 MoE: partial rotary GQA, sigmoid routing with expert bias",
)
