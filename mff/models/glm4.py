"""GLM-4-0414 (dense): GQA with q/k/v biases, partial rotary in GLM's in-place pair layout,
"sandwich" norms (``post_self_attn_layernorm``, ``post_mlp_layernorm``) and a fused
``gate_up_proj``.

Numerics follow HF transformers ``models/glm4`` (v5); config names are HF's ``Glm4Config``
names (``attention_bias`` = q/k/v biases; o_proj has none). ``partial_rotary_factor`` lives in
``rope_parameters`` (v5) or at the top level (v4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mff.model import Family
from mff.models import common
from mff.models.validate import check_gqa
from mff.nn.decoder import CausalLM, DecoderLayer
from mff.nn.gqa import GQA
from mff.nn.mlp import FusedGatedMLP
from mff.nn.rope import RopeParameters, rotary_dim

__all__ = ["Glm4Config", "SIZES", "FAMILY", "skeleton"]


@dataclass(frozen=True)
class Glm4Config:
    """GLM-4-0414 architecture (HF ``Glm4Config`` names)."""

    vocab_size: int = 151552
    """Vocabulary size V."""
    hidden_size: int = 4096
    """Model width D."""
    intermediate_size: int = 13696
    """MLP width."""
    num_hidden_layers: int = 40
    """Transformer layers L."""
    num_attention_heads: int = 32
    """Query heads H."""
    num_key_value_heads: int = 2
    """KV heads (GQA)."""
    head_dim: int = 128
    """Per-head width."""
    hidden_act: Literal["silu"] = "silu"
    """Activation (SwiGLU)."""
    max_position_embeddings: int = 131072
    """Longest sequence the model accepts."""
    initializer_range: float = 0.02
    """Std of the normal init of weight matrices."""
    rms_norm_eps: float = 1.5625e-07
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    rope_parameters: RopeParameters = RopeParameters(partial_rotary_factor=0.5)
    """RoPE parameters; partial_rotary_factor 0.5 rotates half of each head."""
    attention_bias: bool = True
    """Biases on q/k/v (not on o_proj)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id (metadata)."""
    eos_token_id: int | tuple[int, ...] | None = (151329, 151336, 151338)
    """End-of-sequence token id(s) (metadata)."""
    pad_token_id: int | None = 151329
    """Padding token id (metadata)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        check_gqa(self)


SIZES = {
    "tiny": Glm4Config(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       eos_token_id=None, pad_token_id=None),
    "9b-0414": Glm4Config(max_position_embeddings=32768, rms_norm_eps=1e-5),
    "32b-0414": Glm4Config(hidden_size=6144, intermediate_size=23040, num_hidden_layers=61, num_attention_heads=48,
                           num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-5),
}


def skeleton(cfg: Glm4Config) -> CausalLM:
    """The meta skeleton (HF ``Glm4ForCausalLM`` param paths)."""
    layers = [
        DecoderLayer(
            GQA(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                qkv_bias=cfg.attention_bias, rope_layout="pairs", eps=cfg.rms_norm_eps),
            FusedGatedMLP(cfg.hidden_size, cfg.intermediate_size), cfg.hidden_size, cfg.rms_norm_eps, sandwich_norms=True,
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return CausalLM(cfg, layers, cfg.rope_parameters, rotary_dim(cfg.rope_parameters, cfg.head_dim))


FAMILY = Family(
    name="glm4",
    config_cls=Glm4Config,
    sizes=SIZES,
    default_size="tiny",
    skeleton=skeleton,
    init_table=common.gqa_init_table,
    sharding_table=common.gqa_sharding_table,
    count_targets=common.lm_count_targets,
    param_counts=common.gqa_param_counts,
    train_flops_per_token=common.gqa_train_flops_per_token,
    hf_model_types=("glm4",),
    from_hf_config=lambda d: common.config_from_hf(Glm4Config, d, partial_rotary=True),
    to_hf_config=lambda cfg: common.config_to_hf(cfg, "glm4", "Glm4ForCausalLM"),
    description="GLM-4-0414 dense: partial rotary, sandwich norms, fused gate_up",
)
