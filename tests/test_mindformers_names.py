"""MindFormers names and layouts (Mcore and legacy) <-> mff params, training-checkpoint extras,
and the convert CLI for MindSpore / MindFormers checkpoints.

References: the fixture ``tests/data/mindformers_qwen3`` (written by MindFormers 2.0.0 itself,
with its fp32 logits), Mcore and legacy tensors built here by plain loops from the formulas of
``docs/mindformers_formats.md`` §3, and HF transformers' DeepseekV3ForCausalLM.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import mff
from mff.ckpt.autoload import checkpoint_kind, tokenizer_folder
from mff.ckpt.mindformers import MindFormersCheckpointError, load_mindformers, mindformers_state, save_mindformers
from mff.ckpt.mindformers_names import LegacyLayout, McoreLayout
from mff.ckpt.mindspore import write_ckpt
from mff.models import get_family
from mff.recipes import convert

DATA = Path(__file__).parent / "data" / "mindformers_qwen3"


# ------------------------------------------------------------------------------------------
# helpers


def _small(name: str, **kw):
    """A 2-layer, 64-wide config of family ``name`` (MoE families: 8 experts, MoE from layer 1)."""
    f = get_family(name)
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    if name in ("deepseek3", "telechat3"):
        base.update(moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    else:
        base.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        if name in ("qwen3_moe", "glm4_moe"):
            base.update(moe_intermediate_size=32)
    return f, dataclasses.replace(f.sizes["tiny"], **{**base, **kw})


def _random_params(model, dtype=torch.float32, seed=0):
    """Every param random (norms and biases too, so a misplaced tensor cannot go unnoticed)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p, s in model.param_shapes().items():
        t = torch.randn(s, generator=g)
        out[p] = t.to(torch.float32 if model.is_fp32(p) else dtype)
    return out


def _assert_same(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _write(path, tensors, metadata=None):
    write_ckpt(path, list(tensors.items()) if isinstance(tensors, dict) else tensors, metadata)
    return path


def _interleave_rows(gate, up):
    """Mcore linear_fc1 (§3.1): rows g0, u0, g1, u1, ..."""
    return torch.stack([r for i in range(gate.shape[0]) for r in (gate[i], up[i])])


def _qkv_groups(q, k, v, ng):
    """Mcore linear_qkv (§3.1): per KV group its q heads, then its k head, then its v head."""
    qg, kg, vg = q.chunk(ng, 0), k.chunk(ng, 0), v.chunk(ng, 0)
    return torch.cat([torch.cat([qg[g], kg[g], vg[g]]) for g in range(ng)])


def _legacy_rope(rows):
    """Legacy DeepSeek-V3 rope rows (§3.3): interleaved pairs -> half split, row j*R/2+i = row 2i+j."""
    R = rows.shape[0]
    return torch.stack([rows[2 * i + j] for j in range(2) for i in range(R // 2)])


# ------------------------------------------------------------------------------------------
# 1. the fixture MindFormers wrote


@pytest.mark.parametrize("ckpt", ["mf_model.ckpt", "mf_model.safetensors"])
@pytest.mark.parametrize("config", ["hf_config.json", "mf_config.json"])
def test_fixture_gives_mindformers_logits(ckpt, config):
    ck = load_mindformers(DATA / ckpt, config_path=DATA / config)
    assert ck.model.family.name == "qwen3" and ck.layout == McoreLayout()
    ids = torch.from_numpy(np.load(DATA / "input_ids.npy")).long()
    ref = torch.from_numpy(np.load(DATA / "logits.npy"))
    with torch.no_grad():
        logits = ck.model.forward(ck.params, {"input_ids": ids}).logits
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_fixture_with_yaml_config(tmp_path):
    hf = json.loads((DATA / "hf_config.json").read_text())
    yaml = pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"use_legacy": False, "model": {"model_config": hf}}))
    ck = load_mindformers(DATA / "mf_model.ckpt", config_path=tmp_path / "run.yaml")
    ref = load_mindformers(DATA / "mf_model.ckpt", config_path=DATA / "hf_config.json")
    _assert_same(ck.params, ref.params)


# ------------------------------------------------------------------------------------------
# 2. every family: mff -> Mcore .ckpt -> mff is exact


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "glm4", "glm4_moe", "deepseek3", "telechat3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mcore_ckpt_round_trip_is_exact(family, dtype, tmp_path):
    f, cfg = _small(family)
    model = mff.build(f, cfg)
    params = _random_params(model, dtype)
    save_mindformers(tmp_path / "m.ckpt", model, params)
    ck = load_mindformers(tmp_path / "m.ckpt", f, cfg, dtype=None)
    _assert_same(ck.params, params)
    # the router stays fp32 in the file whatever the model dtype (§3.2)
    names = dict((n, dt) for n, _, dt, _ in mindformers_state(model, params))
    assert all(dt == torch.float32 for n, dt in names.items() if ".router." in n)
    assert ("output_layer.weight" in names) == (not cfg.tie_word_embeddings)


@pytest.mark.parametrize("layout", [McoreLayout(qkv="contiguous", fc1="contiguous", experts_3d=True), McoreLayout(qkv="separate", fc1="separate")])
def test_mcore_layout_options_round_trip(layout, tmp_path):
    f, cfg = _small("glm4_moe")
    model = mff.build(f, cfg)
    params = _random_params(model)
    save_mindformers(tmp_path / "ms", model, params, format="safetensors", layout=layout, max_shard_size="100KB")
    assert len(list((tmp_path / "ms").glob("ms-model-*-of-*.safetensors"))) > 1
    raw = {"use_contiguous_weight_layout_attention": layout.qkv == "contiguous", "use_interleaved_weight_layout_mlp": layout.fc1 != "contiguous"}
    ck = load_mindformers(tmp_path / "ms", f, cfg, raw_config=raw, dtype=None)
    _assert_same(ck.params, params)


def test_legacy_llama_round_trip(tmp_path):
    f, cfg = _small("llama", attention_bias=True, tie_word_embeddings=False)
    model = mff.build(f, cfg)
    params = _random_params(model)
    for layout in (LegacyLayout(), LegacyLayout(qkv_concat=True)):
        path = tmp_path / f"l{layout.qkv_concat}.ckpt"
        save_mindformers(path, model, params, layout=layout)
        ck = load_mindformers(path, f, cfg)
        assert ck.layout == layout
        _assert_same(ck.params, params)
    qwen3 = mff.build(*_small("qwen3"))
    with pytest.raises(ValueError, match="q_norm"):  # Qwen3 has no legacy layout
        save_mindformers(tmp_path / "q.ckpt", qwen3, _random_params(qwen3), layout=LegacyLayout())


def test_qwen3_moe_mcore_by_hand(tmp_path):
    """Mcore tensors built by plain loops from §3.1 / §3.2 (independent of the tables) load to the params."""
    f, cfg = _small("qwen3_moe", tie_word_embeddings=False)
    model = mff.build(f, cfg)
    p = _random_params(model)
    E, F, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    mf = {"embedding.word_embeddings.weight": p["model.embed_tokens.weight"]}
    for i in range(cfg.num_hidden_layers):
        a, m, o = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"decoder.layers.{i}."
        mf[o + "input_layernorm.weight"] = p[f"model.layers.{i}.input_layernorm.weight"]
        mf[o + "self_attention.linear_qkv.weight"] = _qkv_groups(p[a + "q_proj.weight"], p[a + "k_proj.weight"], p[a + "v_proj.weight"], 2)
        mf[o + "self_attention.linear_proj.weight"] = p[a + "o_proj.weight"]
        mf[o + "self_attention.q_layernorm.weight"] = p[a + "q_norm.weight"]
        mf[o + "self_attention.k_layernorm.weight"] = p[a + "k_norm.weight"]
        mf[o + "pre_mlp_layernorm.weight"] = p[f"model.layers.{i}.post_attention_layernorm.weight"]
        if m + "gate.weight" in p:
            gu, dn = p[m + "experts.gate_up_proj"], p[m + "experts.down_proj"]
            mf[o + "mlp.router.weight"] = p[m + "gate.weight"]
            per_expert = [torch.cat([gu[e, :F], gu[e, F:]], 0) for e in range(E)]  # HF gate_e; up_e
            mf[o + "mlp.experts.weight1"] = torch.stack(per_expert).transpose(1, 2).reshape(E * H, 2 * F)
            mf[o + "mlp.experts.weight2"] = torch.stack([dn[e] for e in range(E)]).transpose(1, 2).reshape(E * F, H)
        else:
            mf[o + "mlp.linear_fc1.weight"] = _interleave_rows(p[m + "gate_proj.weight"], p[m + "up_proj.weight"])
            mf[o + "mlp.linear_fc2.weight"] = p[m + "down_proj.weight"]
    mf["decoder.final_layernorm.weight"] = p["model.norm.weight"]
    mf["output_layer.weight"] = p["lm_head.weight"]
    ck = load_mindformers(_write(tmp_path / "m.ckpt", mf), f, cfg)
    _assert_same(ck.params, p)


# ------------------------------------------------------------------------------------------
# 3. DeepSeek-V3: fused and unfused Mcore MLA


def _ds_mcore_by_hand(p, cfg, fused: bool):
    """The Mcore DeepSeek-V3 tensors of §3.2, by hand (MTP blocks included)."""
    L, E, F, H = cfg.num_hidden_layers, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    mf = {"embedding.word_embeddings.weight": p["model.embed_tokens.weight"]}
    for i in range(L + cfg.num_nextn_predict_layers):
        h = f"model.layers.{i}."
        o = f"decoder.layers.{i}." if i < L else f"mtp.layers.{i - L}.transformer_layer."
        a, m, s = h + "self_attn.", h + "mlp.", o + "self_attention."
        if i >= L:
            j = i - L
            for hf, name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "final_layernorm")):
                mf[f"mtp.layers.{j}.{name}.weight"] = p[h + hf + ".weight"]
        mf[o + "input_layernorm.weight"] = p[h + "input_layernorm.weight"]
        mf[o + "pre_mlp_layernorm.weight"] = p[h + "post_attention_layernorm.weight"]
        if fused:
            mf[s + "linear_qkv.weight"] = torch.cat([p[a + "q_a_proj.weight"], p[a + "kv_a_proj_with_mqa.weight"]], 0)
            mf[s + "linear_qb.weight"] = p[a + "q_b_proj.weight"]
            mf[s + "k_layernorm.weight"] = p[a + "kv_a_layernorm.weight"]
            mf[s + "linear_kvb.weight"] = p[a + "kv_b_proj.weight"]
        else:
            mf[s + "linear_q_down_proj.weight"] = p[a + "q_a_proj.weight"]
            mf[s + "linear_kv_down_proj.weight"] = p[a + "kv_a_proj_with_mqa.weight"]
            mf[s + "linear_q_up_proj.weight"] = p[a + "q_b_proj.weight"]
            mf[s + "kv_layernorm.weight"] = p[a + "kv_a_layernorm.weight"]
            mf[s + "linear_kv_up_proj.weight"] = p[a + "kv_b_proj.weight"]
        mf[s + "q_layernorm.weight"] = p[a + "q_a_layernorm.weight"]
        mf[s + "linear_proj.weight"] = p[a + "o_proj.weight"]
        if m + "gate.weight" in p:
            gu, dn = p[m + "experts.gate_up_proj"], p[m + "experts.down_proj"]
            mf[o + "mlp.router.weight"] = p[m + "gate.weight"]
            mf[o + "mlp.router.expert_bias"] = p[m + "gate.e_score_correction_bias"]
            mf[o + "mlp.experts.weight1"] = torch.stack([gu[e] for e in range(E)]).transpose(1, 2).reshape(E * H, 2 * F)
            mf[o + "mlp.experts.weight2"] = torch.stack([dn[e] for e in range(E)]).transpose(1, 2).reshape(E * F, H)
            sh = m + "shared_experts."
            mf[o + "mlp.shared_experts.linear_fc1.weight"] = _interleave_rows(p[sh + "gate_proj.weight"], p[sh + "up_proj.weight"])
            mf[o + "mlp.shared_experts.linear_fc2.weight"] = p[sh + "down_proj.weight"]
        else:
            mf[o + "mlp.linear_fc1.weight"] = _interleave_rows(p[m + "gate_proj.weight"], p[m + "up_proj.weight"])
            mf[o + "mlp.linear_fc2.weight"] = p[m + "down_proj.weight"]
    mf["decoder.final_layernorm.weight"] = p["model.norm.weight"]
    mf["output_layer.weight"] = p["lm_head.weight"]
    return mf


def test_deepseek3_fused_and_unfused_mla_load_the_same(tmp_path):
    f, cfg = _small("deepseek3")
    model = mff.build(f, cfg)
    p = _random_params(model)
    fused = load_mindformers(_write(tmp_path / "f.ckpt", _ds_mcore_by_hand(p, cfg, True)), f, cfg)
    unfused = load_mindformers(_write(tmp_path / "u.ckpt", _ds_mcore_by_hand(p, cfg, False)), f, cfg)
    assert fused.layout.mla_fused and not unfused.layout.mla_fused
    _assert_same(fused.params, p)
    _assert_same(unfused.params, p)
    assert fused.model.config.num_nextn_predict_layers == 1


# ------------------------------------------------------------------------------------------
# 4. legacy DeepSeek-V3 names with the permuted rope rows


def _ds_legacy_by_hand(p, cfg, gemm=False):
    """Legacy DeepSeek-V3 tensors (§3.3, research/deepseek3/convert_weight.py) by plain loops."""
    nh, N, R, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    L, F = cfg.num_hidden_layers, cfg.moe_intermediate_size
    mf = {"model.tok_embeddings.embedding_weight": p["model.embed_tokens.weight"], "model.norm_out.weight": p["model.norm.weight"],
          "lm_head.weight": p["lm_head.weight"]}
    for i in range(L + cfg.num_nextn_predict_layers):
        h = f"model.layers.{i}."
        a, m, at, ff = h + "self_attn.", h + "mlp.", h + "attention.", h + "feed_forward."
        mf[h + "attention_norm.weight"] = p[h + "input_layernorm.weight"]
        mf[h + "ffn_norm.weight"] = p[h + "post_attention_layernorm.weight"]
        mf[at + "q2l_proj.weight"] = p[a + "q_a_proj.weight"]
        mf[at + "lq_norm.weight"] = p[a + "q_a_layernorm.weight"]
        q_b = p[a + "q_b_proj.weight"]
        mf[at + "l2q_nope_proj.weight"] = torch.cat([q_b[k * (N + R): k * (N + R) + N] for k in range(nh)])
        mf[at + "l2q_pe_proj.weight"] = torch.cat([_legacy_rope(q_b[k * (N + R) + N: (k + 1) * (N + R)]) for k in range(nh)])
        kv_a = p[a + "kv_a_proj_with_mqa.weight"]
        mf[at + "kv2l_latent_kv.weight"] = kv_a[:C]
        mf[at + "kv2l_k_pe.weight"] = _legacy_rope(kv_a[C:])
        mf[at + "lkv_norm.weight"] = p[a + "kv_a_layernorm.weight"]
        kv_b = p[a + "kv_b_proj.weight"]
        mf[at + "lkv2kv_k_nope.weight"] = torch.cat([kv_b[k * (N + V): k * (N + V) + N] for k in range(nh)])
        mf[at + "lkv2kv_v.weight"] = torch.cat([kv_b[k * (N + V) + N: (k + 1) * (N + V)] for k in range(nh)])
        mf[at + "wo.weight"] = p[a + "o_proj.weight"]
        if m + "gate.weight" in p:
            gu, dn = p[m + "experts.gate_up_proj"], p[m + "experts.down_proj"]
            mf[ff + "routed_experts.router.dense.weight"] = p[m + "gate.weight"]
            mf[ff + "routed_experts.router.router.topk_bias"] = p[m + "gate.e_score_correction_bias"]
            w1, w3, w2 = gu[:, :F], gu[:, F:], dn  # [E, out, in]
            if gemm:
                w1, w3, w2 = w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)
            mf[ff + "routed_experts.ffn.w1.weight"], mf[ff + "routed_experts.ffn.w3.weight"] = w1.contiguous(), w3.contiguous()
            mf[ff + "routed_experts.ffn.w2.weight"] = w2.contiguous()
            m, ff = m + "shared_experts.", ff + "shared_experts."
        mf[ff + "w1.weight"], mf[ff + "w3.weight"], mf[ff + "w2.weight"] = (p[m + x + "_proj.weight"] for x in ("gate", "up", "down"))
        if i >= L:
            j = i - L
            for hf, name in (("enorm", "norm_emb"), ("hnorm", "norm"), ("eh_proj", "dense")):
                mf[f"model.mtp_hidden_fusers.{j}.{name}.weight"] = p[h + hf + ".weight"]
    return mf


def test_legacy_deepseek3_matches_hf_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mff.models.deepseek3 import DeepseekV3Config
    from mff.nn.rope import RopeParameters
    from tests.hf_util import hf_state, init_o1

    arch = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=128)
    hf_cfg = transformers.DeepseekV3Config(**arch, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=True,
                                           num_mtp_layers=0, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    init_o1(hf, seed=1, bias_scale=0.3)
    cfg = DeepseekV3Config(**arch, rope_parameters=RopeParameters(rope_theta=10000.0), num_nextn_predict_layers=0)
    hf_params = hf_state(hf)
    ids = torch.randint(0, arch["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert ref.abs().max() > 1.0
    for gemm in (False, True):
        ck = load_mindformers(_write(tmp_path / f"legacy{gemm}.ckpt", _ds_legacy_by_hand(hf_params, cfg, gemm)), "deepseek3", cfg)
        assert isinstance(ck.layout, LegacyLayout)
        _assert_same(ck.params, {k: v.float() for k, v in hf_params.items()})
        with torch.no_grad():
            logits = ck.model.forward(ck.params, {"input_ids": ids}).logits
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    # with rope_interleave=False the half-split rows are what the model expects: taken as stored
    flat = dataclasses.replace(cfg, rope_interleave=False)
    legacy = _ds_legacy_by_hand(hf_params, cfg)
    ck = load_mindformers(_write(tmp_path / "flat.ckpt", legacy), "deepseek3", flat)
    assert torch.equal(ck.params["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][16:], legacy["model.layers.0.attention.kv2l_k_pe.weight"])


def test_legacy_deepseek3_with_mtp(tmp_path):
    f, cfg = _small("deepseek3")
    model = mff.build(f, cfg)
    p = _random_params(model)
    p["model.layers.2.shared_head.norm.weight"] = p["model.norm.weight"].clone()  # legacy MTP shares the final norm
    ck = load_mindformers(_write(tmp_path / "l.ckpt", _ds_legacy_by_hand(p, cfg)), f, cfg)
    _assert_same(ck.params, p)
    save_mindformers(tmp_path / "again.ckpt", model, p, layout=LegacyLayout())  # the tables write the same file
    _assert_same(load_mindformers(tmp_path / "again.ckpt", f, cfg).params, p)


# ------------------------------------------------------------------------------------------
# 5. training checkpoints: optimizer state, buffers, bookkeeping, unknown and missing names


def _training_ckpt(tmp_path, extra=(), drop=()):
    f, cfg = _small("deepseek3")
    model = mff.build(f, cfg)
    p = _random_params(model)
    items = [(n, get) for n, _, _, get in mindformers_state(model, p) if n not in drop]
    # moments chosen so that a correct mapping gives exp_avg = param, exp_avg_sq = 2 * param
    items += [("adam_m." + n, get) for n, get in list(items)]
    items += [("adam_v." + n, (lambda get=get: 2 * get())) for n, get in list(items) if not n.startswith("adam_")]
    E = cfg.n_routed_experts
    items += [("decoder.layers.1.mlp.router.expert_load", torch.zeros(E)), ("decoder.layers.1.mlp.router.fi_accu", torch.zeros(E)),
              ("global_step", torch.tensor([7], dtype=torch.int32)), ("model_name", "deepseek_v3"), *extra]
    _write(tmp_path / "train.ckpt", items, {"epoch_num": 1, "loss_scale": 1024.0})
    return f, cfg, model, p, tmp_path / "train.ckpt"


def test_optimizer_state_and_bookkeeping(tmp_path, capsys):
    f, cfg, model, p, path = _training_ckpt(tmp_path)
    plain = load_mindformers(path, f, cfg)
    assert plain.optimizer_state is None
    _assert_same(plain.params, p)
    assert plain.metadata == {"global_step": 7, "model_name": "deepseek_v3", "epoch_num": 1, "loss_scale": 1024.0}
    err = capsys.readouterr().err
    assert "skipped" in err and "optimizer entries" in err and "expert_load" in err

    ck = load_mindformers(path, f, cfg, optimizer=True)
    st = ck.optimizer_state
    assert int(st["step"]) == 7
    trainable = [k for k in p if model.is_trainable(k)]
    assert sorted(st["exp_avg"]) == sorted(trainable) and "model.layers.1.mlp.gate.e_score_correction_bias" not in st["exp_avg"]
    for k in trainable:
        assert st["exp_avg"][k].dtype == torch.float32
        assert torch.equal(st["exp_avg"][k], p[k].float()), k
        assert torch.equal(st["exp_avg_sq"][k], 2 * p[k].float()), k
    # and back: mff AdamW state -> adam_m / adam_v -> the same state
    save_mindformers(tmp_path / "back.ckpt", model, p, optimizer_state=st)
    again = load_mindformers(tmp_path / "back.ckpt", f, cfg, optimizer=True).optimizer_state
    assert int(again["step"]) == 7
    for slot in ("exp_avg", "exp_avg_sq"):
        _assert_same(again[slot], st[slot])


def test_unknown_and_missing_names_are_listed(tmp_path):
    extra = [("decoder.layers.0.self_attention.linear_bogus.weight", torch.zeros(2)), ("decoder.layers.9.input_layernorm.weight", torch.zeros(64))]
    f, cfg, *_, path = _training_ckpt(tmp_path, extra=extra)
    with pytest.raises(MindFormersCheckpointError, match="2 tensors the deepseek3 model does not") as e:
        load_mindformers(path, f, cfg)
    assert "linear_bogus" in str(e.value) and "decoder.layers.9.input_layernorm.weight" in str(e.value)
    f, cfg, *_, path = _training_ckpt(tmp_path, drop=("decoder.layers.1.mlp.experts.weight2", "mtp.layers.0.enorm.weight"))
    with pytest.raises(MindFormersCheckpointError, match="lacks 2 tensors") as e:
        load_mindformers(path, f, cfg)
    assert "decoder.layers.1.mlp.experts.weight2" in str(e.value) and "mtp.layers.0.enorm.weight" in str(e.value)
    # asked for the optimizer state of a weights-only file
    model = mff.build(f, cfg)
    save_mindformers(tmp_path / "w.ckpt", model, _random_params(model))
    with pytest.raises(MindFormersCheckpointError, match="optimizer entries"):
        load_mindformers(tmp_path / "w.ckpt", f, cfg, optimizer=True)


# ------------------------------------------------------------------------------------------
# 6. convert CLI


def _run(capsys, *args):
    rc = convert.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def test_convert_ckpt_to_hf_and_back(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    rc, err = _run(capsys, "--src", DATA / "mf_model.ckpt", "--dst", tmp_path / "hf", "--to", "hf", "--config", DATA / "hf_config.json")
    assert rc == 0, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.from_numpy(np.load(DATA / "input_ids.npy")).long()
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    torch.testing.assert_close(logits, torch.from_numpy(np.load(DATA / "logits.npy")), atol=1e-4, rtol=0)

    # hf -> mindspore (.ckpt + config.json) -> mff, and mff.load on the mindspore folder
    rc, err = _run(capsys, "--src", tmp_path / "hf", "--dst", tmp_path / "ms", "--to", "mindspore")
    assert rc == 0, err
    assert {p.name for p in (tmp_path / "ms").iterdir()} >= {"model.ckpt", "config.json"}
    assert checkpoint_kind(tmp_path / "ms") == checkpoint_kind(tmp_path / "ms" / "model.ckpt") == "mindspore"
    assert tokenizer_folder(tmp_path / "ms" / "model.ckpt") == tmp_path / "ms"
    rc, err = _run(capsys, "--src", tmp_path / "ms", "--dst", tmp_path / "mff", "--to", "mff")
    assert rc == 0, err
    _, ref = mff.load(tmp_path / "hf")
    _assert_same(mff.load(tmp_path / "mff")[1], ref)
    _assert_same(mff.load(tmp_path / "ms")[1], ref)
    _assert_same(mff.load(tmp_path / "ms" / "model.ckpt")[1], ref)
    # MindFormers safetensors out, and a MindFormers config without model_type plus --model
    rc, err = _run(capsys, "--src", tmp_path / "hf", "--dst", tmp_path / "mst", "--to", "mindspore", "--ms-format", "safetensors")
    assert rc == 0, err
    mf_cfg = {k: v for k, v in json.loads((DATA / "mf_config.json").read_text()).items() if k != "model_type"}
    (tmp_path / "mf_config.json").write_text(json.dumps(mf_cfg))
    rc, err = _run(capsys, "--src", tmp_path / "mst", "--dst", tmp_path / "mff2", "--to", "mff", "--model", "qwen3",
                   "--config", tmp_path / "mf_config.json")
    assert rc == 0, err
    _assert_same(mff.load(tmp_path / "mff2")[1], ref)


def test_convert_bad_input(tmp_path, capsys):
    src = DATA / "mf_model.ckpt"
    rc, err = _run(capsys, "--src", src, "--dst", tmp_path / "a", "--to", "hf")
    assert rc == 2 and "config" in err and "--model" in err
    mf_cfg = {k: v for k, v in json.loads((DATA / "mf_config.json").read_text()).items() if k != "model_type"}
    (tmp_path / "nomt.json").write_text(json.dumps(mf_cfg))
    rc, err = _run(capsys, "--src", src, "--dst", tmp_path / "a", "--to", "hf", "--config", tmp_path / "nomt.json")
    assert rc == 2 and "no model_type" in err and "--model" in err
    wrong = dict(json.loads((DATA / "hf_config.json").read_text()), num_key_value_heads=1)
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    rc, err = _run(capsys, "--src", src, "--dst", tmp_path / "a", "--to", "hf", "--config", tmp_path / "wrong.json")
    assert rc == 2 and "decoder.layers.0.self_attention.linear_qkv.weight" in err and "(128, 64)" in err and "(96, 64)" in err
    rc, err = _run(capsys, "--src", src, "--dst", tmp_path / "a", "--to", "hf", "--config", DATA / "hf_config.json", "--model", "glm4")
    assert rc == 2 and "glm4" in err
    enc = tmp_path / "enc.ckpt"
    enc.write_bytes((DATA.parent / "mindspore" / "dtypes_encrypted_aesgcm.ckpt").read_bytes())
    rc, err = _run(capsys, "--src", enc, "--dst", tmp_path / "a", "--to", "hf", "--config", DATA / "hf_config.json")
    assert rc == 2 and "is encrypted" in err
    assert not (tmp_path / "a").exists()


def test_convert_with_the_mindformers_config_loads_in_transformers(tmp_path, capsys):
    """MindFormers' config carries the full tokenizer's pad id (151643) for a 128-token vocabulary;
    it is dropped with a notice, so transformers can build the embedding of the HF output."""
    transformers = pytest.importorskip("transformers")
    rc, err = _run(capsys, "--src", DATA / "mf_model.ckpt", "--dst", tmp_path / "hf", "--to", "hf", "--config", DATA / "mf_config.json")
    assert rc == 0, err
    assert "pad_token_id 151643 is outside vocab_size 128" in err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids = torch.from_numpy(np.load(DATA / "input_ids.npy")).long()
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, torch.from_numpy(np.load(DATA / "logits.npy")), atol=1e-4, rtol=0)
