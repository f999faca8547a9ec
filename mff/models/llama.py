"""Llama-2/3 and SmolLM2 (and, through two switches, Qwen2-shaped checkpoints).

Pre-norm GQA decoder with SwiGLU MLPs and RoPE (default or Llama-3.1 scaling). Numerics follow
HF transformers ``models/llama`` (v5); config field names are HF's ``LlamaConfig`` names plus two
mff switches: ``qkv_bias`` (biases on q/k/v but not o, as Qwen2) and ``qk_norm`` (per-head q/k
RMSNorm before RoPE). ``model_type`` ``llama``, ``qwen2`` and ``smollm`` configs load as this family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mff.model import Family
from mff.models import common
from mff.models.validate import check_gqa
from mff.nn.decoder import CausalLM, DecoderLayer
from mff.nn.gqa import GQA
from mff.nn.mlp import GatedMLP
from mff.nn.rope import RopeParameters, rotary_dim

__all__ = ["LlamaConfig", "SIZES", "FAMILY", "skeleton"]


@dataclass(frozen=True)
class LlamaConfig:
    """Llama architecture (HF ``LlamaConfig`` names) plus the ``qkv_bias`` / ``qk_norm`` switches."""

    vocab_size: int = 32000
    """Vocabulary size V."""
    hidden_size: int = 4096
    """Model width D."""
    intermediate_size: int = 11008
    """MLP width."""
    num_hidden_layers: int = 32
    """Transformer layers L."""
    num_attention_heads: int = 32
    """Query heads H."""
    num_key_value_heads: int | None = None
    """KV heads (GQA; H must be a multiple); None = num_attention_heads."""
    head_dim: int | None = None
    """Per-head width; None = hidden_size // num_attention_heads."""
    hidden_act: Literal["silu"] = "silu"
    """MLP activation (SwiGLU)."""
    max_position_embeddings: int = 2048
    """Longest sequence the model accepts."""
    initializer_range: float = 0.02
    """Std of the normal init of weight matrices."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    rope_parameters: RopeParameters = RopeParameters()
    """RoPE parameters (HF v5 rope_parameters; default or llama3 scaling)."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections (HF Llama)."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    qkv_bias: bool = False
    """mff switch: biases on q/k/v only (Qwen2)."""
    qk_norm: bool = False
    """mff switch: per-head RMSNorm of q and k before RoPE (Qwen3 / OLMo-2 style)."""
    bos_token_id: int | None = 1
    """Beginning-of-sequence token id (metadata)."""
    eos_token_id: int | tuple[int, ...] | None = 2
    """End-of-sequence token id(s) (metadata)."""
    pad_token_id: int | None = None
    """Padding token id (metadata)."""

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        check_gqa(self)


SIZES = {
    "tiny": LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        rope_parameters=RopeParameters(rope_theta=10000.0), bos_token_id=None, eos_token_id=None),
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                tie_word_embeddings=True, rope_parameters=RopeParameters(rope_theta=100000.0),
                                initializer_range=0.041666666666666664, bos_token_id=1, eos_token_id=2),
    "llama2-7b": LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                               rope_parameters=RopeParameters(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                                              high_freq_factor=4.0, original_max_position_embeddings=8192),
                               bos_token_id=128000, eos_token_id=128001),
}


def skeleton(cfg: LlamaConfig) -> CausalLM:
    """The meta skeleton (HF ``LlamaForCausalLM`` param paths)."""
    layers = [
        DecoderLayer(
            GQA(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                qkv_bias=cfg.attention_bias or cfg.qkv_bias, o_bias=cfg.attention_bias, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
            cfg.hidden_size, cfg.rms_norm_eps,
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return CausalLM(cfg, layers, cfg.rope_parameters, rotary_dim(cfg.rope_parameters, cfg.head_dim))


# HF ``Qwen2Config`` defaults where they differ from ``LlamaConfig``'s: a qwen2 config.json
# without these keys means these values.
QWEN2_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768, "bos_token_id": None,
                  "eos_token_id": None}


def from_hf_config(d: dict) -> LlamaConfig:
    """A LlamaConfig from an HF ``llama`` / ``qwen2`` / ``smollm`` config.json dict (a key left
    out takes the default of that model type's HF config class)."""
    def checks(d):
        if d.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
    if d.get("model_type") == "qwen2":
        d = {**QWEN2_DEFAULTS, **d}
    cfg = common.config_from_hf(LlamaConfig, d, checks=checks)
    if d.get("model_type") == "qwen2":  # Qwen2: q/k/v biases always, no o bias
        cfg = LlamaConfig(**{**cfg.__dict__, "qkv_bias": True, "attention_bias": False})
    return cfg


def to_hf_config(cfg: LlamaConfig) -> dict:
    """HF config.json: ``llama``; ``qwen2`` when only q/k/v carry biases; ``qwen3`` for qk_norm."""
    if cfg.qk_norm:
        if cfg.qkv_bias and not cfg.attention_bias:
            raise ValueError("a llama config with qk_norm and q/k/v-only biases has no HF equivalent")
        return common.config_to_hf(cfg, "qwen3", "Qwen3ForCausalLM", skip=("qkv_bias", "qk_norm", "mlp_bias"))
    if cfg.qkv_bias and not cfg.attention_bias:
        return common.config_to_hf(cfg, "qwen2", "Qwen2ForCausalLM", skip=("qkv_bias", "qk_norm", "attention_bias", "mlp_bias"))
    return common.config_to_hf(cfg, "llama", "LlamaForCausalLM", skip=("qkv_bias", "qk_norm"))


FAMILY = Family(
    name="llama",
    config_cls=LlamaConfig,
    sizes=SIZES,
    default_size="tiny",
    skeleton=skeleton,
    init_table=common.gqa_init_table,
    sharding_table=common.gqa_sharding_table,
    count_targets=common.lm_count_targets,
    param_counts=common.gqa_param_counts,
    train_flops_per_token=common.gqa_train_flops_per_token,
    hf_model_types=("llama", "qwen2", "smollm"),
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
    description="Llama-2/3, SmolLM2 (and Qwen2-shaped) dense GQA decoders",
)
