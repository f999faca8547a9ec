"""The benchmark model configs shared by the training and generation benchmarks (issue specs):
qwen3_bench and deepseek3_bench, as mff configs and as HF transformers configs."""

from __future__ import annotations

from mff.models.deepseek3 import DeepseekV3Config
from mff.models.qwen3 import Qwen3Config
from mff.nn.rope import RopeParameters

QWEN3_BENCH = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096,
                          rope_parameters=RopeParameters(rope_theta=1e6))

DEEPSEEK3_BENCH = DeepseekV3Config(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
    routed_scaling_factor=2.5, max_position_embeddings=2048, num_nextn_predict_layers=0,
    rope_parameters=RopeParameters(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                   mscale_all_dim=1.0, original_max_position_embeddings=512),
)

CONFIGS = {"qwen3_bench": ("qwen3", QWEN3_BENCH), "deepseek3_bench": ("deepseek3", DEEPSEEK3_BENCH)}
