"""Qwen3 (dense): GQA with per-head q/k RMSNorm before RoPE and a separate ``head_dim``.

Numerics follow HF transformers ``models/qwen3`` (v5); config field names are HF's
``Qwen3Config`` names (``attention_bias`` puts biases on q/k/v/o). Sliding-window attention
(``use_sliding_window``) is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mff.model import Family
from mff.models import common
from mff.models.validate import check_gqa, need
from mff.nn.decoder import CausalLM, DecoderLayer
from mff.nn.gqa import GQA
from mff.nn.mlp import GatedMLP
from mff.nn.rope import RopeParameters, rotary_dim

__all__ = ["Qwen3Config", "SIZES", "FAMILY", "skeleton", "sliding_window_check"]


@dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 architecture (HF ``Qwen3Config`` names)."""

    vocab_size: int = 151936
    """Vocabulary size V."""
    hidden_size: int = 4096
    """Model width D."""
    intermediate_size: int = 22016
    """MLP width."""
    num_hidden_layers: int = 32
    """Transformer layers L."""
    num_attention_heads: int = 32
    """Query heads H."""
    num_key_value_heads: int = 32
    """KV heads (GQA)."""
    head_dim: int = 128
    """Per-head width (independent of hidden_size / heads)."""
    hidden_act: Literal["silu"] = "silu"
    """MLP activation (SwiGLU)."""
    max_position_embeddings: int = 32768
    """Longest sequence the model accepts."""
    initializer_range: float = 0.02
    """Std of the normal init of weight matrices."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (also of q_norm / k_norm)."""
    tie_word_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    rope_parameters: RopeParameters = RopeParameters()
    """RoPE parameters (HF v5 rope_parameters)."""
    attention_bias: bool = False
    """Biases on q/k/v/o."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id (metadata)."""
    eos_token_id: int | tuple[int, ...] | None = None
    """End-of-sequence token id(s) (metadata)."""
    pad_token_id: int | None = None
    """Padding token id (metadata)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        check_gqa(self)


SIZES = {
    "tiny": Qwen3Config(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
                        rope_parameters=RopeParameters(rope_theta=1000000.0)),
    "0.6b": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                        max_position_embeddings=40960, tie_word_embeddings=True, rope_parameters=RopeParameters(rope_theta=1000000.0),
                        bos_token_id=151643, eos_token_id=151645),
    "8b": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=40960, rope_parameters=RopeParameters(rope_theta=1000000.0),
                      bos_token_id=151643, eos_token_id=151645),
    "32b": Qwen3Config(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=40960, rope_parameters=RopeParameters(rope_theta=1000000.0),
                       bos_token_id=151643, eos_token_id=151645),
}


def qwen3_attention(cfg) -> GQA:
    """Qwen3's attention block: GQA with per-head q/k RMSNorm."""
    return GQA(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
               qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, eps=cfg.rms_norm_eps)


def skeleton(cfg: Qwen3Config) -> CausalLM:
    """The meta skeleton (HF ``Qwen3ForCausalLM`` param paths)."""
    layers = [DecoderLayer(qwen3_attention(cfg), GatedMLP(cfg.hidden_size, cfg.intermediate_size), cfg.hidden_size, cfg.rms_norm_eps)
              for _ in range(cfg.num_hidden_layers)]
    return CausalLM(cfg, layers, cfg.rope_parameters, rotary_dim(cfg.rope_parameters, cfg.head_dim))


def sliding_window_check(d: dict) -> None:
    """Reject configs that turn on sliding-window attention (not implemented)."""
    need(not d.get("use_sliding_window"), "config.json: use_sliding_window=true is not supported")


FAMILY = Family(
    name="qwen3",
    config_cls=Qwen3Config,
    sizes=SIZES,
    default_size="tiny",
    skeleton=skeleton,
    init_table=common.gqa_init_table,
    sharding_table=common.gqa_sharding_table,
    count_targets=common.lm_count_targets,
    param_counts=common.gqa_param_counts,
    train_flops_per_token=common.gqa_train_flops_per_token,
    hf_model_types=("qwen3",),
    from_hf_config=lambda d: common.config_from_hf(Qwen3Config, d, checks=sliding_window_check),
    to_hf_config=lambda cfg: common.config_to_hf(cfg, "qwen3", "Qwen3ForCausalLM"),
    description="Qwen3 dense: GQA with per-head q/k norm",
)
