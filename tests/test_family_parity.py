"""Every family against HF transformers: tiny random HF models are saved with
``save_pretrained`` and loaded with ``mff.load``; logits, LM loss, selected experts and greedy
tokens must match."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mff  # noqa: E402
from mff.generate import greedy_generate  # noqa: E402
from tests.hf_util import init_o1  # noqa: E402

V = 101
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=None, bos_token_id=None)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=3)

CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama-tied-bias-llama3rope": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(
        BASE, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=24,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2-as-llama": ("Qwen2Config", "Qwen2ForCausalLM", "llama", dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(BASE, head_dim=24, tie_word_embeddings=True)),
    "qwen3-untied-bias": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(BASE, head_dim=16, attention_bias=True)),
    "qwen3_moe-norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe", dict(
        BASE, **MOE, head_dim=16, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0], router_aux_loss_coef=0.01)),
    "qwen3_moe-nonorm-sparse2": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe", dict(
        BASE, **MOE, head_dim=16, num_experts=8, norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", "glm4", dict(
        BASE, head_dim=16, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "glm4-tied-full-rotary": ("Glm4Config", "Glm4ForCausalLM", "glm4", dict(BASE, head_dim=16, tie_word_embeddings=True, attention_bias=False)),
    "glm4_moe-groups-qknorm": ("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4_moe", dict(
        BASE, **MOE, head_dim=16, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "glm4_moe-nogroups": ("Glm4MoeConfig", "Glm4MoeForCausalLM", "glm4_moe", dict(
        BASE, **MOE, head_dim=16, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
        use_qk_norm=False, attention_bias=False, tie_word_embeddings=True)),
    "deepseek3-yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "deepseek3", dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 32})),
}


def _hf_model(case: str, seed: int = 1):
    cfg_name, cls_name, _, kwargs = CASES[case]
    cfg = getattr(transformers, cfg_name)(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(cfg).eval()
    init_o1(hf, seed=seed, bias_scale=0.3)
    return hf


def _routing_hooks(modules):
    captured = []
    handles = [m.register_forward_hook(lambda mod, a, out: captured.append(out[2].detach().sort(-1).values)) for m in modules]
    return captured, handles


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            hf = _hf_model(case)
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            cache[case] = (hf, path)
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_load_matches_hf(case, saved, capsys):
    hf, path = saved(case)
    model, params = mff.load(path)
    assert model.family.name == CASES[case][2]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (2, 33), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    hf_gates = [m.mlp.gate for m in hf.model.layers if hasattr(m.mlp, "gate")]
    mff_gates = [m.mlp.gate for m in model.skeleton.model.layers if hasattr(m.mlp, "gate")]
    hf_sel, h1 = _routing_hooks(hf_gates)
    mff_sel, h2 = _routing_hooks(mff_gates)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids, output_router_logits=True) if "moe" in case else hf(input_ids=ids, labels=ids)
        out = model.forward(params, {"input_ids": ids, "labels": labels})
    for h in h1 + h2:
        h.remove()
    assert ref.logits.abs().max() > 1.0  # far from uniform: the comparison has teeth
    assert (out.logits - ref.logits).abs().max().item() <= 1e-4
    if "qwen3_moe" in case:
        hf_lm = ref.loss - transformers.Qwen3MoeConfig().router_aux_loss_coef * 0 - hf.config.router_aux_loss_coef * ref.aux_loss
        assert abs(out.losses["lm"].item() - hf_lm.item()) <= 1e-5
        assert abs(out.losses["balance"].item() - hf.config.router_aux_loss_coef * ref.aux_loss.item()) <= 1e-6
    else:
        assert abs(out.losses["lm"].item() - ref.loss.item()) <= 1e-5
    assert len(hf_sel) == len(mff_sel) == len(hf_gates) == len(out.expert_load)
    for a, b in zip(hf_sel, mff_sel):
        assert torch.equal(a, b)  # the same experts for every token
    prompt = ids[:1, :8]
    ref_tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    tokens = greedy_generate(model, params, prompt, 12)
    assert torch.equal(tokens, ref_tokens)


def test_moe_configs_have_nonzero_expert_bias(saved):
    hf, _ = saved("glm4_moe-groups-qknorm")
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)


@pytest.mark.parametrize("case", ["llama-untied", "qwen3_moe-norm", "glm4", "glm4_moe-groups-qknorm", "deepseek3-yarn"])
def test_round_trip(case, saved, tmp_path):
    """mff -> HF folder -> transformers gives the same logits; HF -> mff -> HF gives identical bytes."""
    from safetensors.torch import load_file

    hf, path = saved(case)
    model, params = mff.load(path, dtype=None)
    out_dir = mff.save_hf(model, params, tmp_path / "out")
    a, b = load_file(str(path / "model.safetensors")), load_file(str(out_dir / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    ids = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf2(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_cached_generation_matches_full_forward_and_hf(case, saved):
    """32 cached greedy tokens == argmax of full forward passes == HF generate; chunked prefill too."""
    from mff.generate import generate

    hf, path = saved(case)
    model, params = mff.load(path)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(4))
    cached = generate(model, params, ids, 32)
    assert torch.equal(cached, greedy_generate(model, params, ids, 32))
    assert torch.equal(cached, hf.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None))
    assert torch.equal(cached, generate(model, params, ids, 32, prefill_chunk=4))
