"""Faults during a run (issue 20): a checkpoint write that fails half-way is one line naming the
file and the OS error, leaves no temp folder, and keeps every earlier checkpoint byte-identical."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from tests.cli_util import ROOT, cli_env, make_corpus, tiny_args, tree_digest


def test_a_save_that_hits_the_file_size_limit_is_one_line_and_leaves_the_previous_checkpoint(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", 20)
    run = tmp_path / "run"
    base = [sys.executable, "-m", "mff.recipes.pretrain", *tiny_args(corpus), "--save-every", "2", "--ckpt-dir", str(run)]
    r = subprocess.run([*base, "--steps", "4"], capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    before = tree_digest(run)
    largest = max(p.stat().st_size for p in (run / "step_00000004").iterdir())
    limit = largest - 1000  # the optimizer file of the next checkpoint cannot be written whole

    def cap_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([*base, "--steps", "6"], capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT,
                       preexec_fn=cap_file_size)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "File too large" in lines[0] and ".safetensors" in lines[0] and "step_00000004, is unchanged" in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    after = tree_digest(run)
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp")]
    assert {k: v for k, v in after.items() if "step_00000004" in k} == {k: v for k, v in before.items() if "step_00000004" in k}
    assert (run / "latest").read_text().strip() == "step_00000004"


def test_weights_with_nan_or_inf_are_refused_naming_the_tensor(tmp_path):
    """A checkpoint whose weights hold NaN or inf is refused on load (mff.load, and the CLI as one
    line naming the tensor); allow_non_finite=True loads it anyway."""
    import torch
    from safetensors.torch import load_file, save_file

    import mff

    model = mff.build("qwen3", size="tiny")
    params = model.init(seed=0)
    folder = tmp_path / "hf"
    mff.save_hf(model, params, folder)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][3, :5] = float("nan")
    weights[name][0, 0] = float("inf")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor {name} holds NaN or inf \(6 of"):
        mff.load(folder)
    _, loaded = mff.load(folder, allow_non_finite=True)
    assert torch.isnan(loaded[name]).sum() == 5
    r = subprocess.run([sys.executable, "-m", "mff.recipes.generate", "--ckpt", str(folder), "--prompt", "x", "--compile", "off"],
                       capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and name in lines[0] and "NaN or inf" in lines[0], r.stderr


@pytest.mark.parametrize("file,content,needle", [
    ("tokenizer_config.json", b'{"eos_token": "</s>",', "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", b'{"eos_token": "\xff\xfe"}', "tokenizer_config.json is not UTF-8 text (byte 15"),
    ("tokenizer_config.json", b'["eos"]', "tokenizer_config.json must hold a JSON object, got a list"),
    ("tokenizer_config.json", b'{"eos_token": 5}', "tokenizer_config.json: eos_token is 5; expected the token's text"),
    ("tokenizer_config.json", b'{"chat_template": {"a": 1}}', "tokenizer_config.json: chat_template is a dict"),
    ("tokenizer_config.json", b'{"eos_token": "\\ud800"}', "tokenizer_config.json: eos_token holds a \\uD800-\\uDFFF escape"),
    ("generation_config.json", b'{"eos_token_id": "two"}', "generation_config.json: eos_token_id is 'two'; expected a token id"),
    ("generation_config.json", b'{"eos_token_id": [2, true]}', "generation_config.json: eos_token_id is [2, True]"),
    ("generation_config.json", b'{"eos_token_id": 1180591620717411303424}',
     "generation_config.json: eos_token_id holds 1180591620717411303424; expected token ids in [0, 2**31)"),
    ("generation_config.json", b'{"eos_token_id": [2, -1]}', "generation_config.json: eos_token_id holds -1"),
    ("config.json", None, "config.json: eos_token_id is 2.5"),
])
def test_bad_tokenizer_and_generation_configs_name_the_file_and_key(tmp_path, file, content, needle):
    import json

    import mff
    from mff.ckpt.tokenizer_files import load_text_assets

    model = mff.build("qwen3", size="tiny")
    folder = tmp_path / "hf"
    mff.save_hf(model, model.init(seed=0), folder)
    if content is None:  # config.json: the eos id of an otherwise valid config
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 2.5}))
        (folder / "generation_config.json").unlink(missing_ok=True)
    else:
        (folder / file).write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_text_assets(folder)
    assert needle in str(e.value) and str(folder) in str(e.value), str(e.value)
    r = subprocess.run([sys.executable, "-m", "mff.recipes.generate", "--ckpt", str(folder), "--prompt", "x", "--compile", "off"],
                       capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    cli_needle = "config.json: eos_token_id=2.5 must be an integer" if content is None else needle  # the model config's own check
    assert r.returncode != 0 and len(lines) == 1 and cli_needle in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("family", ["deepseek3", "telechat3", "qwen3", "qwen3_moe", "glm4", "glm4_moe", "llama"])
def test_the_param_estimate_is_exact(family):
    import dataclasses
    import math

    import mff
    from mff.model import Model, estimate_param_count

    model = mff.build(family, size="tiny")
    # layer patterns: dense and MoE layers mixed past the first five layers, MTP depths of either kind
    patterns = {"qwen3_moe": [dict(decoder_sparse_step=2), dict(mlp_only_layers=(6, 7, 8), intermediate_size=5000),
                              dict(decoder_sparse_step=3, mlp_only_layers=(0, 5))],
                "deepseek3": [dict(first_k_dense_replace=7), dict(moe_layer_freq=2, first_k_dense_replace=1),
                              dict(moe_layer_freq=3, num_nextn_predict_layers=2)],
                "telechat3": [dict(moe_layer_freq=2)], "glm4_moe": [dict(first_k_dense_replace=7)]}
    for layers, extra in [(2, {}), (7, {}), *((9, p) for p in patterns.get(family, []))]:
        cfg = dataclasses.replace(model.config, num_hidden_layers=layers, **extra)
        assert estimate_param_count(model.family, cfg) == sum(math.prod(s) for s in Model(model.family, cfg).param_shapes().values()), extra


def test_dense_layers_past_the_fifth_are_counted(tmp_path):
    """A qwen3_moe config.json whose later layers are dense and huge (mlp_only_layers) is refused
    like one with huge MoE layers: the estimate counts each layer's kind."""
    import dataclasses

    import mff
    from mff.model import check_model_fits

    model = mff.build("qwen3_moe", size="tiny")
    cfg = dataclasses.replace(model.config, num_hidden_layers=100_000, mlp_only_layers=tuple(range(6, 100_000)), intermediate_size=100_000)
    with pytest.raises(ValueError, match=r"num_hidden_layers 100000.* params"):
        check_model_fits(model.family, cfg, "cpu", None, "config.json")


def test_a_config_too_big_for_memory_is_refused_before_anything_is_built(tmp_path):
    """config.json claiming a million layers: refused in well under a second (building its
    skeleton alone took minutes), naming the sizes, the param count and the memory."""
    import json

    import mff

    model = mff.build("qwen3", size="tiny")
    folder = tmp_path / "hf"
    mff.save_hf(model, model.init(seed=0), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1_000_000}))
    with pytest.raises(ValueError, match=r"num_hidden_layers 1000000.* params, .* GiB in float32, more than the .* GiB free on cpu"):
        mff.load(folder)
    r = subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(folder), "--dst", str(tmp_path / "out"), "--to", "mff"],
                       capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "num_hidden_layers 1000000" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()
    # pretrain's --model.* sizes are checked the same way, before the skeleton is built
    r = subprocess.run([sys.executable, "-m", "mff.recipes.pretrain", "--model", "qwen3", "--model.num-hidden-layers", "1000000",
                        "--model.hidden-size", "4096", "--steps", "1", "--ckpt-dir", str(tmp_path / "run"), "--threads", "1"],
                       capture_output=True, text=True, env=cli_env(tmp_path / "cache"), cwd=ROOT, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --model: the config (num_hidden_layers 1000000"), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_float16_cast_that_overflows_says_so(tmp_path):
    import torch

    import mff

    model = mff.build("qwen3", size="tiny")
    params = model.init(seed=0)
    params["model.norm.weight"] = torch.full_like(params["model.norm.weight"], 1e6)  # finite in fp32, inf in fp16
    mff.save_hf(model, params, tmp_path / "hf")
    mff.load(tmp_path / "hf")  # fp32: fine
    with pytest.raises(ValueError, match=r"model.norm.weight holds inf in float16 .*values past 65504.*load it in float32 or bfloat16"):
        mff.load(tmp_path / "hf", dtype=torch.float16)


def test_an_adapter_holding_nan_is_refused(tmp_path):
    """The adapters of mff.load(base, adapter=...) are checked like the base weights."""
    import torch

    import mff
    import mff.peft as mp

    model = mff.build("qwen3", size="tiny")
    mff.save_hf(model, model.init(seed=0), tmp_path / "base")
    lm = mp.add_lora(model, r=4)
    adapters = mp.init_adapters(lm)
    name = next(k for k in adapters if k.endswith("lora_A"))
    adapters[name] = adapters[name].clone()
    adapters[name][0, 0] = float("nan")
    mp.save_peft(lm, adapters, tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"adapter: tensor .* holds NaN or inf \(1 of"):
        mff.load(tmp_path / "base", adapter=tmp_path / "adapter")
    _, params = mff.load(tmp_path / "base", adapter=tmp_path / "adapter", allow_non_finite=True)
    assert any(bool(torch.isnan(v).any()) for v in params.values())


@pytest.mark.parametrize("family,field", [("qwen3", "head_dim"), ("deepseek3", "qk_rope_head_dim"), ("deepseek3", "v_head_dim")])
def test_an_absurd_head_width_is_refused_before_the_rotary_tables_are_built(family, field):
    """head_dim 2**34 made the skeleton allocate its 64 GiB rotary table first (a RuntimeError traceback)."""
    import dataclasses

    import mff
    from mff.model import estimate_param_count

    model = mff.build(family, size="tiny")
    cfg = dataclasses.replace(model.config, **{field: 2**34})
    with pytest.raises(ValueError, match=rf"{field}=17179869184 is past 65,536"):
        estimate_param_count(model.family, cfg)
