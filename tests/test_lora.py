"""LoRA on mff's own models: scales, merge == unmerged, B = 0 equals the base, only adapters
train, no full-size delta in a training step, every compute path (grouped experts, decode-time
gathered experts, MLA's absorbed decode) against the merged weights, and the bad inputs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mff
import mff.peft as mp
from mff.generate import greedy_generate
from mff.model import LoRASpec
from mff.optim import OptimConfig, init_state
from mff.peft import LoraConfig
from mff.train.step import train_step
from tests.sft_util import TINY


def _model(family: str, **over):
    cfg = dataclasses.replace(mff.build(family).config, **{**TINY[family], **over})
    return mff.build(family, cfg)


def _random(adapters: dict, scale: float = 0.05, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (scale * torch.randn(v.shape, generator=g)).requires_grad_(True) for k, v in adapters.items()}


def _ids(V: int = 512, B: int = 2, T: int = 12, seed: int = 1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("r,alpha,rslora,scale", [(8, 32, False, 4.0), (8, 16, False, 2.0), (8, 16, True, 16 / math.sqrt(8)),
                                                  (4, None, False, 2.0)])
def test_scale(r, alpha, rslora, scale):
    lm = mp.add_lora(_model("qwen3"), r=r, alpha=alpha, rslora=rslora)
    assert lm.lora.scale == pytest.approx(scale)
    slot = lm.skeleton.model.layers[0].self_attn.q_proj.lora_weight
    assert slot.scale == pytest.approx(scale) and slot.A.shape == (r, 64) and slot.B.shape == (64, r)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek3", "glm4"])
@pytest.mark.parametrize("r,alpha", [(8, 32), (8, 16)])
def test_merged_equals_unmerged(family, r, alpha):
    model = _model(family)
    params = model.init(0)
    lm = mp.add_lora(model, r=r, alpha=alpha)
    adapters = _random(mp.init_adapters(lm, seed=1))
    ids = _ids()
    with torch.no_grad():
        adapted = lm.forward({**params, **adapters}, {"input_ids": ids}).logits
        merged = mp.merge(lm, params, adapters)
        plain = model.forward(merged, {"input_ids": ids}).logits
        base = model.forward(params, {"input_ids": ids}).logits
    assert float((adapted - base).abs().max()) > 1e-3
    torch.testing.assert_close(adapted, plain, atol=1e-5, rtol=0)
    back = mp.unmerge(lm, merged, adapters)
    for k in params:
        torch.testing.assert_close(back[k], params[k], atol=1e-6, rtol=0)
    assert all(params[k] is not merged[k] for k in lm.lora.targets)  # merge makes new tensors


@pytest.mark.parametrize("family", ["qwen3", "deepseek3"])
def test_fresh_adapters_are_the_base_model(family):
    model = _model(family)
    params = model.init(0)
    lm = mp.add_lora(model, r=4)
    adapters = mp.init_adapters(lm, seed=3)
    assert all(float(v.abs().max()) == 0 for k, v in adapters.items() if k.endswith(".lora_B"))
    assert all(float(v.abs().max()) > 0 for k, v in adapters.items() if k.endswith(".lora_A"))
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(lm.forward({**params, **adapters}, {"input_ids": ids}).logits, model.forward(params, {"input_ids": ids}).logits)


def test_default_targets_cover_every_projection():
    lm = mp.add_lora(_model("deepseek3"), r=2)
    names = {t.split(".", 3)[3] for t in lm.lora.targets}
    assert names == {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                     "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"}
    shapes = lm.adapter_shapes()
    assert shapes["model.layers.1.mlp.experts.gate_up_proj.lora_A"] == (4, 2, 64)  # one A and B per expert
    assert shapes["model.layers.1.mlp.experts.gate_up_proj.lora_B"] == (4, 64, 2)
    mtp = mp.add_lora(_model("deepseek3", num_nextn_predict_layers=1), r=2)
    assert not [t for t in mtp.lora.targets if t.startswith("model.layers.2.")]  # MTP layers stay frozen


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek3"])
def test_only_adapters_train(family):
    model = _model(family)
    params = model.init(0)
    for t in params.values():
        t.requires_grad_(False)
    lm = mp.add_lora(model, r=4, alpha=8)
    adapters = mp.init_adapters(lm, seed=1)
    both = {**params, **adapters}
    base_before = {k: v.clone() for k, v in params.items()}
    cfg = OptimConfig(lr=1e-2, warmup_steps=0)
    state = init_state(cfg, both)
    assert set(state["exp_avg"]) == set(adapters) and set(state["exp_avg_sq"]) == set(adapters)
    ids = _ids(T=16)
    for _ in range(2):
        train_step(lm, both, state, [{"input_ids": ids, "labels": torch.roll(ids, -1, 1)}], 1e-2, cfg)
    for k in params:
        assert torch.equal(both[k], base_before[k]), k
    assert all(float(both[k].abs().max()) > 0 for k in adapters if k.endswith(".lora_B"))


class _MatmulShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten._grouped_mm.default):
            self.shapes.append(tuple(out.shape))
        return out


def test_a_training_step_never_builds_a_full_size_delta():
    """x -> A -> B: no matmul of the forward or backward makes a tensor shaped like an adapted
    weight (its delta, or its gradient)."""
    model = _model("qwen3_moe")
    params = {k: v.requires_grad_(False) for k, v in model.init(0).items()}
    lm = mp.add_lora(model, r=4)
    adapters = mp.init_adapters(lm, seed=1)
    ids = _ids(T=7)  # 14 tokens: no activation is shaped like a weight
    weights = {tuple(params[t].shape) for t in lm.lora.targets} | {tuple(params[t].shape[1:]) for t in lm.lora.targets}
    weights |= {s[::-1] for s in weights}
    with _MatmulShapes() as rec:
        out = lm.forward({**params, **adapters}, {"input_ids": ids, "labels": ids}, logits=False)
        torch.autograd.grad(out.loss, list(adapters.values()))
    assert rec.shapes and not [s for s in rec.shapes if s in weights or (len(s) == 3 and s[1:] in weights)]


def test_decode_paths_match_the_merged_model():
    """Greedy decoding (KV cache: MLA's absorbed attention with LoRA on kv_b_proj, gathered
    per-slot experts) of the adapted model equals the merged one."""
    for family in ("deepseek3", "qwen3_moe"):
        model = _model(family)
        params = model.init(0)
        lm = mp.add_lora(model, r=4)
        adapters = _random(mp.init_adapters(lm, seed=2), 0.2)
        prompt = _ids(B=1, T=5, seed=4)
        with torch.no_grad():
            adapted = greedy_generate(lm, {**params, **adapters}, prompt, 8)
            merged = greedy_generate(model, mp.merge(lm, params, adapters), prompt, 8)
        assert torch.equal(adapted, merged), family


def test_adapter_sharding_rows_follow_the_base():
    lm = mp.add_lora(_model("qwen3_moe"), r=4)
    rows = dict(mp.adapter_sharding_table(lm))
    assert rows["model.layers.0.self_attn.q_proj.weight.lora_A"] == (None, "embed")
    assert rows["model.layers.0.self_attn.q_proj.weight.lora_B"] == (("heads", 16), None)  # column-parallel: B split like W
    assert rows["model.layers.0.self_attn.o_proj.weight.lora_A"] == (None, ("heads", 16))  # row-parallel: A split like W
    assert rows["model.layers.1.mlp.experts.gate_up_proj.lora_A"] == ("expert", None, "embed")
    assert rows["model.layers.1.mlp.experts.down_proj.lora_B"] == ("expert", "embed", None)


@pytest.mark.parametrize("targets,match", [
    (("q_porj",), "matches no weight .* nearest param paths: .*q_proj"),
    (("**.q_norm.weight",), "not a linear weight or stacked experts"),
    (("input_layernorm",), "not a linear weight or stacked experts"),
    (("model.layers.9.**",), "matches no weight"),
])
def test_bad_targets(targets, match):
    with pytest.raises(ValueError, match=match):
        mp.add_lora(_model("qwen3"), r=4, targets=targets)


@pytest.mark.parametrize("cfg,match", [(LoraConfig(r=-1), "--lora.r -1 must be >= 1"), (LoraConfig(r=4, alpha=0), "--lora.alpha 0"),
                                       (LoraConfig(r=4, alpha=-2.0), "--lora.alpha -2.0"), (LoraConfig(alpha=8), "needs --lora.r"),
                                       (LoraConfig(r=4, dropout=1.0), "--lora.dropout 1.0")])
def test_bad_rank_alpha_dropout(cfg, match):
    with pytest.raises(ValueError, match=match):
        mp.lora_spec(_model("qwen3"), cfg)


def test_bad_spec_and_params():
    model = _model("qwen3")
    params = model.init(0)
    with pytest.raises(ValueError, match="r=0 must be >= 1"):
        model.with_lora(LoRASpec(targets=("model.layers.0.self_attn.q_proj.weight",), r=0, alpha=1.0))
    with pytest.raises(ValueError, match="only 2-D weights and 3-D"):
        model.with_lora(LoRASpec(targets=("model.norm.weight",), r=2, alpha=1.0))
    lm = mp.add_lora(model, r=2)
    adapters = mp.init_adapters(lm)
    with pytest.raises(ValueError, match="params lack"):
        lm.forward(params, {"input_ids": _ids()})
    with pytest.raises(ValueError, match="the model has none"):
        model.forward({**params, **adapters}, {"input_ids": _ids()})
    bad = dict(adapters)
    bad["model.layers.0.self_attn.q_proj.weight.lora_A"] = torch.zeros(3, 64)
    with pytest.raises(ValueError, match=r"lora_A' has shape \(3, 64\), the model expects \(2, 64\)"):
        lm.forward({**params, **bad}, {"input_ids": _ids()})
