"""LoRA adapters both ways between mff and the ``peft`` library itself, on tiny random HF models:
an mff-trained adapter loads with ``PeftModel.from_pretrained`` and gives mff's logits; an
adapter made by ``peft`` (non-zero B) loads into mff and gives PEFT's logits; PEFT's
``merge_and_unload()`` equals mff's merge. Stacked experts go through PEFT's ``target_parameters``."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import mff  # noqa: E402
import mff.peft as mp  # noqa: E402
from mff.optim import OptimConfig, init_state  # noqa: E402
from mff.train.step import train_step  # noqa: E402
from tests.hf_util import init_o1  # noqa: E402

V = 101
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=None, bos_token_id=None)
CASES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(BASE, head_dim=16), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], None),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(BASE, head_dim=16, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, mlp_only_layers=[0]),
                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=128, pad_token_id=None, eos_token_id=None, bos_token_id=None),
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(BASE, head_dim=16, attention_bias=True),
             ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], None),
}


def _hf(case: str):
    cfg_name, cls_name, kwargs, _, _ = CASES[case]
    cfg = getattr(transformers, cfg_name)(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    init_o1(model, seed=1, bias_scale=0.3)
    return model


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    cache = {}

    def get(case):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            _hf(case).save_pretrained(path)
            cache[case] = path
        return cache[case]

    return get


def _ids(seed: int = 5):
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def _train_adapters(lm, params, steps: int = 3):
    """A few AdamW steps on random labels, so every B is non-zero."""
    adapters = mp.init_adapters(lm, seed=3)
    both = {**params, **adapters}
    cfg = OptimConfig(lr=2e-2, warmup_steps=0, weight_decay=0.0)
    state = init_state(cfg, both)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        ids = torch.randint(0, V, (2, 16), generator=g)
        train_step(lm, both, state, [{"input_ids": ids, "labels": torch.roll(ids, -1, 1)}], 2e-2, cfg)
    return {k: both[k] for k in adapters}


@pytest.mark.parametrize("case", list(CASES))
def test_mff_adapter_loads_in_peft(case, bases, tmp_path):
    model, params = mff.load(bases(case))
    lm = mp.add_lora(model, r=4, alpha=16)
    expected_targets = sum(1 for p in model.param_shapes() if any(p.endswith(f".{n}.weight") for n in CASES[case][3]))
    expected_targets += sum(1 for p in model.param_shapes() if p.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    assert len(lm.lora.targets) == expected_targets
    adapters = _train_adapters(lm, params)
    assert all(float(adapters[k].abs().max()) > 0 for k in adapters if k.endswith(".lora_B"))
    mp.save_peft(lm, adapters, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    listed = set(cfg["target_modules"] or []) | {t.rsplit(".", 1)[0].rsplit(".", 1)[-1] if t.endswith(".weight") else t
                                                 for t in cfg["target_parameters"] or []}
    assert {n for n in CASES[case][3]} | {t.rsplit(".", 1)[-1] for t in CASES[case][4] or []} == {x.rsplit(".", 1)[-1] for x in listed}
    hf = type(_hf(case)).from_pretrained(bases(case)).eval()
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = _ids()
    with torch.no_grad():
        theirs = pm(ids).logits
        ours = lm.forward({**params, **adapters}, {"input_ids": ids}).logits
        base = model.forward(params, {"input_ids": ids}).logits
    assert float((ours - base).abs().max()) > 1e-2  # the adapters change the model
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # PEFT's merge_and_unload() equals mff's merge
    merged_hf = pm.merge_and_unload().state_dict()
    merged = mp.merge(lm, params, adapters)
    for path in lm.lora.targets:
        torch.testing.assert_close(merged[path], merged_hf[path], atol=1e-5, rtol=0)


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _peft_made(case: str, tmp_path):
    """A PEFT adapter made by peft itself, with random non-zero A and B. For the MoE models the
    dense MLP projections are given as 2-D ``target_parameters``: peft 0.21 rewrites MLP names in
    ``target_modules`` of MoE model types into the stacked experts (huggingface/peft#3711)."""
    hf = _hf(case)
    modules, params = list(CASES[case][3]), list(CASES[case][4] or [])
    if params:
        modules = [m for m in modules if m not in MLP_NAMES]
        params += [f"model.layers.0.mlp.{m}.weight" for m in MLP_NAMES]
        params += [f"shared_experts.{m}.weight" for m in MLP_NAMES if case == "deepseek_v3"]
    kw = {"target_parameters": params} if params else {}
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=12, target_modules=modules, init_lora_weights=False, **kw)).eval()

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path / "from_peft")
    return pm


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_loads_in_mff(case, bases, tmp_path):
    pm = _peft_made(case, tmp_path)
    model, params = mff.load(bases(case))
    n_adapted = sum(1 for n, _ in pm.named_parameters() if n.endswith("lora_A.default.weight"))
    assert n_adapted == len(mp.resolve_targets(model, ("all",)))  # every projection: dense MLPs not lost to the MoE rewrite
    spec, adapters = mp.read_peft(tmp_path / "from_peft", model)
    assert spec.r == 4 and spec.alpha == 12 and abs(spec.scale - 3.0) < 1e-12
    lm = model.with_lora(spec)
    ids = _ids(9)
    with torch.no_grad():
        theirs = pm(ids).logits
        ours = lm.forward({**params, **adapters}, {"input_ids": ids}).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # mff.load with adapter= merges the same adapter
    m2, merged = mff.load(bases(case), adapter=tmp_path / "from_peft")
    with torch.no_grad():
        torch.testing.assert_close(m2.forward(merged, {"input_ids": ids}).logits, theirs, atol=1e-4, rtol=0)
    merged_hf = pm.merge_and_unload().state_dict()
    for path in spec.targets:
        torch.testing.assert_close(merged[path], merged_hf[path], atol=1e-5, rtol=0)


def test_expert_layout_is_peft_own(bases, tmp_path):
    """PEFT's stacked-expert layout: lora_A [E*r, in] expert-major, lora_B [out, r*E] rank-major."""
    pm = _peft_made("qwen3_moe", tmp_path)
    experts = pm.base_model.model.model.layers[1].mlp.experts
    wrapper = experts if experts.parameter_name == "gate_up_proj" else experts.base_layer
    assert wrapper.parameter_name == "gate_up_proj"
    a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
    model, params = mff.load(bases("qwen3_moe"))
    _, adapters = mp.read_peft(tmp_path / "from_peft", model)
    A = adapters["model.layers.1.mlp.experts.gate_up_proj.lora_A"]
    B = adapters["model.layers.1.mlp.experts.gate_up_proj.lora_B"]
    E, r = 4, 4
    for e in range(E):
        torch.testing.assert_close(A[e], a[e * r:(e + 1) * r].detach())
        for j in range(r):
            torch.testing.assert_close(B[e][:, j], b[:, j * E + e].detach())


def test_peft_rank_pattern_adapter_loads_in_mff(tmp_path):
    """v4-style targets on a v5 MoE model: peft fuses gate_proj + up_proj into the experts'
    gate_up_proj with rank 2r and alpha 2 alpha (rank_pattern / alpha_pattern); mff reads the
    per-target ranks and gives PEFT's logits."""
    cfg_name, cls_name, kwargs, _, _ = CASES["qwen3_moe"]
    cfg = getattr(transformers, cfg_name)(**{**kwargs, "mlp_only_layers": []})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(cfg).eval()
    init_o1(hf, seed=2)
    hf.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                                                 init_lora_weights=False)).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["rank_pattern"] and saved["target_parameters"]
    model, params = mff.load(tmp_path / "base")
    spec, adapters = mp.read_peft(tmp_path / "adapter", model)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert spec.rank_of(gate_up) == 4 and spec.scale_of(gate_up) == spec.scale == 3.0
    ids = _ids(3)
    with torch.no_grad():
        torch.testing.assert_close(model.with_lora(spec).forward({**params, **adapters}, {"input_ids": ids}).logits, pm(ids).logits,
                                   atol=1e-4, rtol=0)
    # and back out: mff writes the per-target ranks as PEFT's patterns
    mp.save_peft(model.with_lora(spec), adapters, tmp_path / "again")
    pm2 = peft.PeftModel.from_pretrained(type(hf).from_pretrained(tmp_path / "base").eval(), tmp_path / "again").eval()
    with torch.no_grad():
        torch.testing.assert_close(pm2(ids).logits, pm(ids).logits, atol=1e-4, rtol=0)
