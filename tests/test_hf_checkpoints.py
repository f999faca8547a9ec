"""HF checkpoint folders: MTP layers, sharded indexes, per-expert vs stacked experts, FP8,
mff checkpoints, the convert CLI, --init-from, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import mff
from mff.ckpt.safetensors_io import SafetensorsFolder, write_sharded
from mff.models.deepseek3 import SIZES as DS_SIZES
from tests.cli_util import ROOT, make_corpus, run_cli

transformers = pytest.importorskip("transformers")

SMALL_DS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                max_position_embeddings=64)


def _ds_model(mtp: int = 1):
    import dataclasses

    cfg = dataclasses.replace(DS_SIZES["tiny"], **SMALL_DS, num_nextn_predict_layers=mtp)
    model = mff.build("deepseek3", cfg)
    params = {k: v.detach() for k, v in model.init(seed=3).items()}
    with torch.no_grad():
        for k, v in params.items():
            if k.endswith("e_score_correction_bias"):
                v.copy_(torch.linspace(-0.2, 0.2, v.numel()))
    return model, params


@pytest.fixture()
def ds_folder(tmp_path):
    model, params = _ds_model()
    return model, params, mff.save_hf(model, params, tmp_path / "ds")


def _rewrite(folder, drop=(), change=None):
    sd = load_file(str(folder / "model.safetensors"))
    for k in list(sd):
        if any(k.startswith(p) or k == p for p in drop):
            del sd[k]
    sd.update(change or {})
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_mtp_layers_load_and_transformers_reads_the_folder(ds_folder):
    model, params, folder = ds_folder
    assert any(k.startswith("model.layers.2.eh_proj") for k in load_file(str(folder / "model.safetensors")))
    m2, p2 = mff.load(folder)
    assert m2.config.num_nextn_predict_layers == 1
    for k in params:
        assert torch.equal(p2[k], params[k]), k
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(m2.forward(p2, {"input_ids": ids}).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_no_mtp_tensors_loads_with_mtp_off_and_one_notice(ds_folder, capsys):
    _, _, folder = ds_folder
    _rewrite(folder, drop=("model.layers.2.",))
    m2, p2 = mff.load(folder)
    err = capsys.readouterr().err
    assert m2.config.num_nextn_predict_layers == 0 and len(err.strip().splitlines()) == 1 and "MTP off" in err
    assert not any(k.startswith("model.layers.2.") for k in p2)


def test_some_mtp_tensors_is_an_error(ds_folder):
    _, _, folder = ds_folder
    _rewrite(folder, drop=("model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight"))
    with pytest.raises(ValueError, match="only some MTP tensors.*eh_proj"):
        mff.load(folder)


def test_sharded_index_and_stacked_experts_load(tmp_path, ds_folder):
    model, params, folder = ds_folder
    # a sharded copy in mff's stacked layout (v5 in-memory names), as some tools write it
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(folder / "config.json", out / "config.json")
    files = write_sharded(out, [(k, v.shape, v.dtype) for k, v in params.items()], params.__getitem__, max_shard_size=200_000)
    assert len(files) >= 2 and (out / "model.safetensors.index.json").is_file()
    _, p2 = mff.load(out)
    for k in params:
        assert torch.equal(p2[k], params[k]), k


def _fp8_quantize(w: torch.Tensor, block: int):
    R, C = w.shape
    nr, nc = -(-R // block), -(-C // block)
    scale = torch.empty(nr, nc)
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_checkpoint_dequantises_blockwise(ds_folder):
    _, params, folder = ds_folder
    sd = load_file(str(folder / "model.safetensors"))
    block = 16
    expected = {}
    for k in list(sd):
        if k.endswith("proj.weight") and sd[k].dim() == 2 and "layers.0" in k:
            q, s = _fp8_quantize(sd[k], block)
            sd[k], sd[k + "_scale_inv"] = q, s
            ref = torch.empty(q.shape)
            for i in range(q.shape[0]):  # plain loop reference
                ref[i] = q[i].float() * s[i // block].repeat_interleave(block)[: q.shape[1]]
            expected[k] = ref
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    (folder / "config.json").write_text(json.dumps(cfg))
    _, p32 = mff.load(folder)
    _, pauto = mff.load(folder, dtype=None)
    assert expected
    for k, ref in expected.items():
        assert torch.equal(p32[k], ref), k
        assert pauto[k].dtype == torch.bfloat16 and torch.equal(pauto[k], ref.to(torch.bfloat16))
    # an fp8 weight without quantization_config is refused
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mff.load(folder)


def test_mff_checkpoint_loads_by_its_metadata(tmp_path):
    model = mff.build("qwen3_moe")
    params = {k: v.detach() for k, v in model.init(seed=0).items()}
    meta = {"family": "qwen3_moe", "size": "tiny", "config": __import__("mff.recipes.common", fromlist=["x"]).config_to_dict(model.config)}
    mff.ckpt.save_weights(tmp_path / "run", params, meta)
    for path in (tmp_path / "run", tmp_path / "run" / "step_00000000"):
        m2, p2 = mff.load(path)
        assert m2.config == model.config and all(torch.equal(p2[k], params[k]) for k in params)


# ---- bad input -------------------------------------------------------------------------------


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json"):
        mff.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mff.load(tmp_path / "nope")


def test_unknown_model_type(ds_folder):
    _, _, folder = ds_folder
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model_type 'mamba'.*qwen3_moe"):
        mff.load(folder)


def test_missing_tensor_is_named(ds_folder):
    _, _, folder = ds_folder
    _rewrite(folder, drop=("model.layers.1.self_attn.o_proj.weight",))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*model\.layers\.1\.self_attn\.o_proj\.weight"):
        mff.load(folder)


def test_misshaped_tensor_names_both_shapes(ds_folder):
    _, _, folder = ds_folder
    _rewrite(folder, change={"model.norm.weight": torch.ones(31)})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(31,\), the model expects \(32,\)"):
        mff.load(folder)


def test_misshaped_expert_tensor(ds_folder):
    _, _, folder = ds_folder
    _rewrite(folder, change={"model.layers.1.mlp.experts.3.up_proj.weight": torch.ones(16, 31)})
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight' has shape \(16, 31\), the model expects \(16, 32\)"):
        mff.load(folder)


def test_unexpected_tensor_is_listed(ds_folder):
    _, _, folder = ds_folder
    _rewrite(folder, change={"model.layers.0.mystery.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="does not.*mystery"):
        mff.load(folder)


def test_truncated_safetensors(ds_folder):
    _, _, folder = ds_folder
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors.*(corrupt|truncated)"):
        mff.load(folder)


def test_index_naming_a_missing_shard(tmp_path, ds_folder):
    _, params, folder = ds_folder
    files = write_sharded(tmp_path, [(k, v.shape, v.dtype) for k, v in params.items()], params.__getitem__, max_shard_size=200_000)
    (tmp_path / files[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"missing.*{files[-1]}"):
        SafetensorsFolder(tmp_path)


# ---- CLIs --------------------------------------------------------------------------------------


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "mff.recipes.convert", *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_convert_cli_round_trip(ds_folder, tmp_path):
    _, params, folder = ds_folder
    r = _convert("--src", folder, "--dst", tmp_path / "m", "--to", "mff")
    assert r.returncode == 0, r.stderr
    r = _convert("--src", tmp_path / "m", "--dst", tmp_path / "h", "--to", "hf")
    assert r.returncode == 0, r.stderr
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "h" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    r = _convert("--src", folder, "--dst", tmp_path / "h", "--to", "hf")
    assert r.returncode == 2 and r.stderr.startswith("error:") and "is not an empty folder" in r.stderr
    r = _convert("--src", tmp_path / "nothing", "--dst", tmp_path / "x", "--to", "hf")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_pretrain_init_from(tmp_path):
    """--init-from starts from the weights (first loss far below a fresh init's) with a fresh optimizer."""
    corpus = make_corpus(tmp_path / "corpus")
    common = ["--seq-len", "32", "--batch-size", "4", "--data.path", str(corpus), "--data.vocab-size", "512",
              "--optim.warmup-steps", "1", "--eval-every", "0", "--threads", "1"]
    small = ["--model", "llama", "--model.hidden-size", "64", "--model.intermediate-size", "128", "--model.num-hidden-layers", "2",
             "--model.vocab-size", "512", "--model.num-attention-heads", "4", "--model.num-key-value-heads", "2"]
    r = run_cli([*small, *common, "--steps", "30", "--ckpt-dir", str(tmp_path / "a"), "--metrics-file", str(tmp_path / "a.jsonl")], tmp_path / "c")
    assert r.returncode == 0, r.stderr
    r = run_cli([*common, "--init-from", str(tmp_path / "a"), "--steps", "2", "--ckpt-dir", str(tmp_path / "b"),
                 "--metrics-file", str(tmp_path / "b.jsonl")], tmp_path / "c")
    assert r.returncode == 0, r.stderr
    first = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    started = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert started[0]["step"] == 1 and started[0]["loss"] < first[0]["loss"] - 1.0
    assert started[0]["loss"] < first[-1]["loss"] + 0.3
    # a --model.* override that changes a shape is refused, naming the tensor
    r = run_cli([*common, "--init-from", str(tmp_path / "a"), "--model.intermediate-size", "96", "--steps", "2",
                 "--ckpt-dir", str(tmp_path / "d")], tmp_path / "c")
    assert r.returncode == 1 and "mlp.gate_proj.weight' has shape (128, 64), the model expects (96, 64)" in r.stderr, r.stderr
    r = run_cli([*common, "--init-from", str(tmp_path / "a"), "--model", "qwen3", "--ckpt-dir", str(tmp_path / "e")], tmp_path / "c")
    assert r.returncode == 2 and "holds a llama model" in r.stderr
    # an override that drops tensors (a layer) is refused too
    r = run_cli([*common, "--init-from", str(tmp_path / "a"), "--model.num-hidden-layers", "1", "--steps", "2",
                 "--ckpt-dir", str(tmp_path / "f")], tmp_path / "c")
    assert r.returncode == 1 and "tensors this model does not" in r.stderr and "model.layers.1." in r.stderr, r.stderr
    # the run uses the checkpoint's tokenizer, and rerunning the same command resumes it
    assert (tmp_path / "b" / "tokenizer.json").read_text() == (tmp_path / "a" / "tokenizer.json").read_text()
    r = run_cli([*common, "--init-from", str(tmp_path / "a"), "--steps", "4", "--ckpt-dir", str(tmp_path / "b")], tmp_path / "c")
    assert r.returncode == 0 and "resumed from" in r.stdout + r.stderr, r.stderr


@pytest.mark.parametrize("to", ["mff", "hf"])
def test_interrupted_conversion_leaves_nothing(ds_folder, tmp_path, monkeypatch, to):
    """A conversion killed while writing leaves no --dst and no temp folder; a killed run's
    temp folder (dead PID) is removed by the next conversion."""
    import mff.ckpt.checkpoint as ck
    import mff.ckpt.hf as hfmod
    from mff.recipes import convert as conv

    _, _, folder = ds_folder
    real = ck.write_safetensors if to == "mff" else hfmod.write_sharded

    def dying(*args, **kwargs):
        real(*args, **kwargs)  # the data is on disk, under the temp name
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(ck if to == "mff" else hfmod, "write_safetensors" if to == "mff" else "write_sharded", dying)
    dst = tmp_path / "out"
    assert conv.main(["--src", str(folder), "--dst", str(dst), "--to", to]) == 130
    assert not dst.exists() and not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()
    stale = tmp_path / ".tmp-out-999999999"
    stale.mkdir()
    (stale / "junk").write_bytes(b"x" * 10)
    assert conv.main(["--src", str(folder), "--dst", str(dst), "--to", to]) == 0
    assert not stale.exists() and mff.load(dst)[0].family.name == "deepseek3"


def _hf_folder(tmp_path, kind="qwen3_moe", **kw):
    from tests.hf_util import init_o1

    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, **kw)
        hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, **kw)
        hf = transformers.LlamaForCausalLM(cfg).eval()
    init_o1(hf, seed=2)
    hf.save_pretrained(tmp_path / kind)
    return hf, tmp_path / kind


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_hf_defaults_apply_to_missing_keys(tmp_path):
    """transformers writes no head_dim for Qwen3-MoE unless given; missing keys mean HF's defaults."""
    hf, folder = _hf_folder(tmp_path)
    assert "head_dim" not in json.loads((folder / "config.json").read_text())
    model, params = mff.load(folder)
    assert model.config.head_dim == 8 and model.config.norm_topk_prob is False
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.forward(params, {"input_ids": ids}).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("key,value,needle", [
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
    ("norm_topk_prob", 1, "norm_topk_prob=1 must be true or false"),
    ("hidden_size", "32", "hidden_size='32' must be an integer"),
    ("rms_norm_eps", None, None),
    ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6' must be a number"),
    ("num_key_value_heads", 3, "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ("rope_scaling", "linear", "rope_scaling='linear' must be an object"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope type 'yarn' needs ['factor']"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope type 'linear' is not supported"),
    ("eos_token_id", ["</s>"], "eos_token_id=['</s>']"),
])
def test_bad_config_values_are_named(tmp_path, key, value, needle):
    _, folder = _hf_folder(tmp_path)
    _edit_config(folder, **{key: value})
    if needle is None:
        mff.load(folder)  # a missing key takes the default
        return
    with pytest.raises(ValueError) as e:
        mff.load(folder)
    assert needle in str(e.value)


def test_tied_config_with_a_different_head_loads_untied(tmp_path, capsys):
    hf, folder = _hf_folder(tmp_path, kind="llama")
    _edit_config(folder, tie_word_embeddings=True)
    model, params = mff.load(folder)
    assert not model.config.tie_word_embeddings and torch.equal(params["lm_head.weight"], hf.lm_head.weight)
    assert "loading them untied" in capsys.readouterr().err


def test_integer_tensor_is_refused(tmp_path):
    _, folder = _hf_folder(tmp_path, kind="llama")
    _rewrite(folder, change={"model.norm.weight": torch.ones(32, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has dtype torch\.int64; expected a floating-point tensor"):
        mff.load(folder)


def test_fp8_stacked_experts_become_bf16(tmp_path):
    """dtype=None turns every dequantised FP8 weight into bf16, stacked experts included."""
    model, params = _ds_model(mtp=0)
    folder = mff.save_hf(model, params, tmp_path / "ds")
    sd = load_file(str(folder / "model.safetensors"))
    for k in [k for k in sd if ".experts." in k and k.endswith(".weight")]:
        q, s = _fp8_quantize(sd[k], 8)
        sd[k], sd[k + "_scale_inv"] = q, s
    save_file(sd, str(folder / "model.safetensors"))
    _edit_config(folder, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]})
    _, p = mff.load(folder, dtype=None)
    assert p["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert p["model.layers.1.mlp.experts.down_proj"].dtype == torch.bfloat16


def test_index_must_match_its_shards(tmp_path, ds_folder):
    _, params, _ = ds_folder
    out = tmp_path / "s"
    out.mkdir()
    files = write_sharded(out, [(k, v.shape, v.dtype) for k, v in params.items()], params.__getitem__, max_shard_size=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    name, original = next(iter(index["weight_map"].items()))
    index["weight_map"][name] = "/etc/passwd"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="must be shard file names inside the folder"):
        SafetensorsFolder(out)
    index["weight_map"][name] = next(f for f in files if f != original)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="the index maps it to"):
        SafetensorsFolder(out)


def test_v4_config_spellings(tmp_path):
    """The older HF spellings load the same model: num_experts, rope_theta at the top level,
    rope_scaling instead of rope_parameters, partial_rotary_factor at the top level."""
    hf, folder = _hf_folder(tmp_path)
    model, params = mff.load(folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert "num_local_experts" in cfg or "num_experts" in cfg
    e = cfg.pop("num_local_experts", cfg.pop("num_experts", None))
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(num_experts=e, rope_theta=theta, rope_scaling=None)
    (folder / "config.json").write_text(json.dumps(cfg))
    m2, _ = mff.load(folder)
    assert m2.config == model.config
    # DeepSeek-V3 YaRN in v4 form; GLM's partial_rotary_factor at the top level
    from mff.ckpt.hf import config_from_hf_dict

    _, ds = config_from_hf_dict({"model_type": "deepseek_v3", "rope_theta": 10000.0,
                                 "rope_scaling": {"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                  "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}})
    assert ds.rope_parameters.rope_type == "yarn" and ds.rope_parameters.factor == 40.0 and ds.rope_parameters.beta_fast == 32.0
    _, glm = config_from_hf_dict({"model_type": "glm4", "rope_theta": 500.0, "partial_rotary_factor": 0.25})
    assert glm.rope_parameters.partial_rotary_factor == 0.25 and glm.rope_parameters.rope_theta == 500.0
    _, llama = config_from_hf_dict({"model_type": "llama", "partial_rotary_factor": 0.25})
    assert llama.rope_parameters.partial_rotary_factor == 1.0  # llama ignores it, as transformers does


def test_scale_beside_a_non_fp8_weight_is_refused(ds_folder):
    _, _, folder = ds_folder
    _rewrite(folder, change={"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match="o_proj.weight_scale_inv' scales .* not FP8"):
        mff.load(folder)
