"""A missing config.json key means what it means to transformers, at every depth.

For every family with a transformers class and every RoPE type mff supports, a tiny random HF
model is saved with ``save_pretrained``; then each key of its config.json (top level, and each
key inside ``rope_parameters``) is deleted in turn and the edited folder is loaded by
transformers and by ``mff.load``. Both must give the same logits (1e-4) or both must refuse.
The keys are enumerated from the written file, so a key transformers adds later is covered.

"Refuse" for transformers means ``from_pretrained`` or its forward raises, or it loads with
missing or mis-shaped weights (it would random-initialise them) or unexpected ones (it would drop
them: the config no longer describes the file); for mff it means ``mff.load`` raises.
A deletion that leaves transformers' resolved config unchanged reuses the untouched model's
logits (same config and weights, same model), so only deletions that change something pay
for a second transformers load.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mff  # noqa: E402
from tests.hf_util import init_o1  # noqa: E402

V = 64
T = 40
# values chosen to differ from every family's default, so that a key mff misreads shows in the logits
GQA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-2, tie_word_embeddings=True, attention_bias=True)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(GQA)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {k: v for k, v in GQA.items() if k != "head_dim"}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(GQA)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(GQA, **MOE, num_experts=4, norm_topk_prob=True, mlp_only_layers=[0],
                                                                decoder_sparse_step=1)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(GQA, attention_bias=False, pad_token_id=None, eos_token_id=None)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(GQA, **MOE, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                                                             first_k_dense_replace=1, use_qk_norm=True, routed_scaling_factor=1.5,
                                                             norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64, rms_norm_eps=1e-2, attention_bias=True, routed_scaling_factor=1.5, norm_topk_prob=False)),
}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
             "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5},
    "llama3": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 16},
}
CASES = [(f, r) for f in FAMILIES for r in ROPES]


def _hf_class(family):
    return getattr(transformers, FAMILIES[family][1])


def _build(family: str, rope: str, folder):
    cfg_name, _, kwargs = FAMILIES[family]
    rope_parameters = dict(ROPES[rope])
    if family.startswith("glm4"):
        rope_parameters["partial_rotary_factor"] = 0.5
    cfg = getattr(transformers, cfg_name)(**kwargs, rope_parameters=rope_parameters)
    torch.manual_seed(0)
    hf = _hf_class(family)(cfg).eval()
    init_o1(hf, seed=3, bias_scale=0.3)
    hf.save_pretrained(folder)


def _hf_logits(folder, ids):
    """transformers' logits for the folder, or None where it refuses or would random-initialise."""
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    except Exception:  # noqa: BLE001 - any refusal counts
        return None
    if info["missing_keys"] or info["mismatched_keys"] or info["unexpected_keys"]:
        return None
    try:
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits
    except Exception:  # noqa: BLE001 - a config its own forward cannot run is a refusal too
        return None


def _mff_logits(folder, ids):
    try:
        model, params = mff.load(folder)
    except (ValueError, FileNotFoundError) as e:
        return e
    with torch.no_grad():
        return model.forward(params, {"input_ids": ids}).logits


def _resolved(folder):
    try:
        return transformers.AutoConfig.from_pretrained(folder).to_dict()
    except Exception:  # noqa: BLE001
        return None


def _deletions(config: dict):
    """('key',) for each top-level key, ('rope_parameters', 'key') for each key inside the RoPE block."""
    out = [(k,) for k in config]
    for block in ("rope_parameters", "rope_scaling"):
        if isinstance(config.get(block), dict):
            out += [(block, k) for k in config[block]]
    return out


@pytest.mark.parametrize("family,rope", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_each_missing_key_means_what_transformers_means(family, rope, tmp_path):
    base = tmp_path / "base"
    _build(family, rope, base)
    config = json.loads((base / "config.json").read_text())
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(base, ids)
    assert ref is not None and ref.abs().max() > 1.0  # far from uniform: the comparison has teeth
    got = _mff_logits(base, ids)
    assert not isinstance(got, Exception), got
    assert (got - ref).abs().max().item() <= 1e-4
    resolved = _resolved(base)
    failures = []
    for path in _deletions(config):
        folder = tmp_path / "-".join(path)
        shutil.copytree(base, folder)
        edited = json.loads(json.dumps(config))
        parent = edited
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
        (folder / "config.json").write_text(json.dumps(edited))
        now = _resolved(folder)
        hf = ref if now is not None and now == resolved else _hf_logits(folder, ids)
        mine = _mff_logits(folder, ids)
        where = ".".join(path)
        if hf is None:
            if not isinstance(mine, Exception):
                failures.append(f"without {where}: transformers refuses, mff loads")
        elif isinstance(mine, Exception):
            failures.append(f"without {where}: transformers loads, mff refuses: {mine}")
        elif mine.shape != hf.shape or (mine - hf).abs().max().item() > 1e-4:
            diff = (mine - hf).abs().max().item() if mine.shape == hf.shape else f"shapes {tuple(mine.shape)} vs {tuple(hf.shape)}"
            failures.append(f"without {where}: logits differ by {diff}")
        shutil.rmtree(folder)
    assert not failures, "\n".join(failures)


HF_FAMILY = {"llama": "llama", "qwen2": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "glm4": "glm4", "glm4_moe": "glm4_moe",
             "deepseek_v3": "deepseek3"}


def test_rope_scaling_replaces_rope_parameters_as_in_transformers(tmp_path):
    """A config.json with both blocks: transformers 5 takes rope_scaling whole (whatever its type)
    with the top-level rope_theta and partial_rotary_factor; a top-level null partial factor
    rotates the whole head."""
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    cases = {
        "llama": [{"rope_scaling": {"rope_type": "default"}},
                  {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}, "rope_theta": 2000.0},
                  {"rope_scaling": {"rope_type": "default", "rope_theta": 2000.0}}],
        "glm4": [{"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "partial_rotary_factor": 0.25},
                 {"partial_rotary_factor": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}],
    }
    for family, edits in cases.items():
        base = tmp_path / family
        _build(family, "yarn", base)
        config = json.loads((base / "config.json").read_text())
        for i, edit in enumerate(edits):
            folder = tmp_path / f"{family}-{i}"
            shutil.copytree(base, folder)
            (folder / "config.json").write_text(json.dumps({**config, **edit}))
            ref, got = _hf_logits(folder, ids), _mff_logits(folder, ids)
            assert ref is not None and not isinstance(got, Exception), (family, edit, got)
            assert (got - ref).abs().max().item() <= 1e-4, (family, edit)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_an_empty_config_means_the_transformers_defaults(model_type):
    """``{"model_type": ...}`` alone: every field mff reads takes the value transformers' config
    class gives it (keys that change no weight shape and no logit included: token ids, lengths)."""
    from mff.models import family_for_model_type

    family = family_for_model_type(model_type)
    cfg = family.from_hf_config({"model_type": model_type})  # not validated: GLM-4.5's defaults leave head_dim 42 * 0.5 odd
    assert family.name == HF_FAMILY[model_type]
    hf = getattr(transformers, FAMILIES[model_type][0])()
    hf.standardize_rope_params()
    wrong = []
    for name, value in vars(cfg).items():
        if name == "rope_parameters":
            ref = hf.rope_parameters
            got = {"rope_type": value.rope_type, "rope_theta": value.rope_theta, "partial_rotary_factor": value.partial_rotary_factor}
            want = {"rope_type": ref["rope_type"], "rope_theta": ref["rope_theta"],
                    "partial_rotary_factor": ref.get("partial_rotary_factor", 1.0) if family.name.startswith("glm4") else 1.0}
            if got != want:
                wrong.append(f"rope_parameters {got} != {want}")
        elif hasattr(hf, name):
            ref = getattr(hf, name)
            ref = tuple(ref) if isinstance(ref, list) else ref
            if name == "num_key_value_heads" and ref is None:
                ref = hf.num_attention_heads
            if value != ref:
                wrong.append(f"{name}: mff {value!r}, transformers {ref!r}")
    assert not wrong, "\n".join(wrong)
