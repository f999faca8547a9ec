"""DeepSeek-V3 numerics against HF transformers' DeepseekV3ForCausalLM on a tiny random model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mff  # noqa: E402
from mff.models.deepseek3 import DeepseekV3Config  # noqa: E402
from mff.nn.rope import RopeParameters  # noqa: E402
from tests.hf_util import hf_state, init_o1  # noqa: E402

ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
            mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=32)

ARCH = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
    qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def _pair(q_lora_rank=24, rope_interleave=True, tie=False):
    arch = dict(ARCH, q_lora_rank=q_lora_rank, tie_word_embeddings=tie)
    hf_cfg = transformers.DeepseekV3Config(**arch, rope_parameters=dict(ROPE), rope_interleave=rope_interleave,
                                           num_mtp_layers=0, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    init_o1(hf, seed=1, bias_scale=0.3)
    cfg = DeepseekV3Config(**arch, rope_parameters=RopeParameters(**ROPE), rope_interleave=rope_interleave,
                           num_nextn_predict_layers=0)
    model = mff.build("deepseek3", cfg)
    params = hf_state(hf)
    if tie:
        params.pop("lm_head.weight", None)
    assert set(params) == set(model.param_shapes()), set(params) ^ set(model.param_shapes())
    return hf, model, params


@pytest.mark.parametrize("q_lora_rank,rope_interleave,tie", [(24, True, False), (None, False, False), (24, True, True)])
def test_logits_and_loss_match_hf(q_lora_rank, rope_interleave, tie):
    hf, model, params = _pair(q_lora_rank, rope_interleave, tie)
    assert any(v.abs().sum() > 0 for k, v in params.items() if k.endswith("e_score_correction_bias"))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, ARCH["vocab_size"], (2, 40), generator=g)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        out = model.forward(params, {"input_ids": ids, "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)})
    assert ref.logits.abs().max() > 1.0  # far from uniform: the comparison has teeth
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)
    assert abs(out.losses["lm"].item() - ref.loss.item()) <= 1e-5


def test_routing_matches_hf():
    hf, model, params = _pair()
    ids = torch.randint(0, ARCH["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    captured = {}

    def hook(mod, args, out):
        captured["idx"] = out[2]

    layer = hf.model.layers[1].mlp.gate
    h = layer.register_forward_hook(hook)
    with torch.no_grad():
        hf(input_ids=ids)
        out = model.forward(params, {"input_ids": ids})
    h.remove()
    counts = torch.bincount(captured["idx"].reshape(-1), minlength=ARCH["n_routed_experts"])
    assert torch.equal(out.expert_load["model.layers.1.mlp"], counts)
