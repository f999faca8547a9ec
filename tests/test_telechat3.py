"""TeleChat3 is the DeepSeek-V3 family with TeleChat3's sizes (MindFormers configuration_telechat3.py)."""

import torch

import mff
from mff.models import family_for_model_type


def test_defaults_are_telechat3s():
    fam = mff.get_family("telechat3")
    cfg = fam.sizes["mf-default"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size) == (131072, 2560, 7680, 1536)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 1536, 512, 128, 64, 128)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (192, 1, 8, 8, 4)
    assert (cfg.routed_scaling_factor, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers) == (2.8, 3, 1)
    assert family_for_model_type("telechat3") is fam


def test_tiny_telechat3_trains_a_step():
    model = mff.build("telechat3")
    params = model.init(seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    out = model.forward(params, {"input_ids": ids, "labels": ids})
    assert set(out.losses) == {"lm", "mtp", "balance"}
    assert model.config.routed_scaling_factor == 2.8
