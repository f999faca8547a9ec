"""TeleChat3: DeepSeek-V3's architecture (MLA, sigmoid routing with expert bias, MTP) with
TeleChat3's sizes. The defaults are those of MindFormers' ``configuration_telechat3.py``
(vocab 131072, hidden 2560, 192 routed + 1 shared experts, top-8, routed_scaling_factor 2.8,
one MTP layer, 4 layers, no RoPE scaling); ``model_type: telechat3`` configs load as this family.
"""

from __future__ import annotations

import dataclasses

from mff.models.deepseek3 import FAMILY as _DEEPSEEK3
from mff.models.deepseek3 import SIZES as _DS_SIZES
from mff.models.deepseek3 import DeepseekV3Config
from mff.nn.rope import RopeParameters

__all__ = ["TELECHAT3_DEFAULT", "SIZES", "FAMILY"]

TELECHAT3_DEFAULT = DeepseekV3Config(
    vocab_size=131072, hidden_size=2560, intermediate_size=7680, moe_intermediate_size=1536,
    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=32, n_shared_experts=1,
    n_routed_experts=192, routed_scaling_factor=2.8, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
    max_position_embeddings=4096, rope_parameters=RopeParameters(rope_theta=10000.0),
    num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
)

SIZES = {
    # the deepseek3 tiny model with TeleChat3's routing scale
    "tiny": dataclasses.replace(_DS_SIZES["tiny"], routed_scaling_factor=2.8),
    # MindFormers' configuration_telechat3.py defaults (meta device only on CPU)
    "mf-default": TELECHAT3_DEFAULT,
}

FAMILY = dataclasses.replace(
    _DEEPSEEK3,
    name="telechat3",
    sizes=SIZES,
    hf_model_types=("telechat3",),
    description="TeleChat3: DeepSeek-V3 architecture with TeleChat3 sizes",
)
