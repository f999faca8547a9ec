"""Special tokens and chat templates travel with a checkpoint: ``convert --to hf`` of a
pretraining run tells transformers its EOS (config.json, generation_config.json,
tokenizer_config.json), ``pretrain --init-from`` an Instruct checkpoint keeps its chat template
for ``generate --chat``, ``generate --chat-template FILE`` supplies one, and ``convert --no-mtp``
gives a DeepSeek-V3 folder transformers loads without unexpected keys."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import mff
from mff.ckpt.tokenizer_files import TextAssets, load_text_assets
from mff.data.chat import render_chat_template
from mff.recipes.convert import ConvertConfig, convert
from tests.cli_util import ROOT, cli_env, make_corpus, run_cli, tiny_args
from tests.sft_util import CHATML, make_chat_checkpoint

transformers = pytest.importorskip("transformers")

FAST = ["--seq-len", "32", "--batch-size", "4", "--steps", "2", "--optim.warmup-steps", "1", "--eval-every", "0", "--threads", "1"]


def _cli(module: str, *args, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, env=cli_env(cache), cwd=ROOT,
                          timeout=600)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "docs", n_docs=30)


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory, corpus) -> Path:
    """A 2-step pretraining run of the tiny DeepSeek-V3 (MTP on) with its own byte-level BPE."""
    root = tmp_path_factory.mktemp("pre")
    r = run_cli(tiny_args(corpus) + ["--steps", "2", "--ckpt-dir", str(root / "run")], root / "cache", timeout=600)
    assert r.returncode == 0, r.stderr
    return root / "run"


@pytest.fixture(scope="module")
def exported(pretrain_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hf"
    r = _cli("mff.recipes.convert", "--src", pretrain_run, "--to", "hf", "--dst", out, cache=out.parent)
    assert r.returncode == 0, r.stderr
    return out


def _eod(run: Path) -> int:
    return Tokenizer.from_file(str(run / "tokenizer.json")).token_to_id("<|endoftext|>")


def test_pretrain_export_names_the_eod_token(pretrain_run, exported):
    eod = _eod(pretrain_run)
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == eod
    assert json.loads((exported / "generation_config.json").read_text()) == {"eos_token_id": eod}
    tok_cfg = json.loads((exported / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tok_cfg["eos_token"] == "<|endoftext|>"
    assert tok_cfg["model_max_length"] == mff.load(pretrain_run)[0].config.max_position_embeddings
    assert "chat_template" not in tok_cfg and "bos_token" not in tok_cfg  # the trained BPE has neither

    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == eod
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert model.generation_config.eos_token_id == eod

    class ForceEos(transformers.LogitsProcessor):  # a free first token, then EOS
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > prompt.shape[1]:
                scores[:] = -float("inf")
                scores[:, eod] = 0.0
            return scores

    prompt = tok("alpha beta gamma", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=eod,
                         logits_processor=transformers.LogitsProcessorList([ForceEos()]))
    assert out.shape[1] == prompt.shape[1] + 2 and out[0, -1] == eod  # generation stopped at the EOS


def test_mff_reads_the_run_eos(pretrain_run):
    text = load_text_assets(pretrain_run)
    assert text.eos_ids == [_eod(pretrain_run)] and text.eos_token == "<|endoftext|>" and text.chat_template is None


def make_tokenizer_json() -> str:
    from mff.data.tokenizer import train_bpe

    return train_bpe(["alpha beta gamma delta"] * 4, 300).to_str()


def test_config_eos_is_kept():
    from mff.ckpt.tokenizer_files import hf_export_files

    tok = Tokenizer.from_str(make_tokenizer_json())
    assets = TextAssets(tok, eos_token="<|endoftext|>", eos_ids=[0])
    ids, files = hf_export_files(assets, {"bos_token_id": None, "eos_token_id": 5, "pad_token_id": None}, 512, 128)
    assert ids == {}  # config.json keeps its eos_token_id
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": [5, 0]}
    assert json.loads(files["tokenizer_config.json"])["eos_token"] == "<|endoftext|>"
    # a tokenizer id outside the model's vocabulary is not used
    ids, files = hf_export_files(TextAssets(tok, eos_ids=[600]), {"eos_token_id": None}, 512)
    assert ids == {} and "generation_config.json" not in files
    # an HF folder's own tokenizer_config.json is kept as it is
    _, files = hf_export_files(assets, {"eos_token_id": None}, 512, copied={"tokenizer.json": tok.to_str(), "tokenizer_config.json": "{}"},
                               keep_tokenizer_config=True)
    assert files["tokenizer_config.json"] == "{}"


def test_save_hf_writes_generation_config(tmp_path):
    model = mff.build("llama", dataclasses.replace(mff.build("llama").config, vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                    bos_token_id=1, eos_token_id=2))
    out = mff.save_hf(model, model.init(0), tmp_path / "hf")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 2


def test_no_mtp_loads_without_unexpected_keys(pretrain_run, exported, tmp_path):
    _, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])  # the MTP layer
    out = tmp_path / "nomtp"
    r = _cli("mff.recipes.convert", "--src", pretrain_run, "--to", "hf", "--dst", out, "--no-mtp", cache=tmp_path)
    assert r.returncode == 0 and "dropped 1 MTP layer(s)" in r.stderr, r.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["eos_token_id"] == _eod(pretrain_run)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"]
    model, params = mff.load(pretrain_run)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.forward(params, {"input_ids": ids}).logits, atol=1e-4, rtol=0)
    lm, _ = mff.load(out)
    assert lm.config.num_nextn_predict_layers == 0


def test_no_mtp_without_mtp_layers(pretrain_run, tmp_path, capsys):
    with pytest.raises(ValueError, match="--no-mtp is for --to hf"):
        convert(ConvertConfig(src=str(pretrain_run), dst=str(tmp_path / "p"), to="peft", mtp=False))
    assert not (tmp_path / "p").exists()
    base = make_chat_checkpoint(tmp_path / "qwen3")  # no MTP layers to drop: a note, and the same folder
    out = convert(ConvertConfig(src=str(base), dst=str(tmp_path / "q"), to="hf", mtp=False))
    assert "qwen3 has none); nothing to drop" in capsys.readouterr().err
    got, want = json.loads((out / "config.json").read_text()), json.loads((base / "config.json").read_text())
    im_end = Tokenizer.from_file(str(base / "tokenizer.json")).token_to_id("<|im_end|>")
    assert want["eos_token_id"] is None and got.pop("eos_token_id") == im_end  # filled in from tokenizer_config.json's eos_token
    assert got == {k: v for k, v in want.items() if k != "eos_token_id"}


def test_init_from_instruct_keeps_the_chat_template(corpus, tmp_path):
    base = make_chat_checkpoint(tmp_path / "instruct")
    run = tmp_path / "run"
    r = run_cli(["--init-from", str(base), "--data.path", str(corpus), "--ckpt-dir", str(run), *FAST], tmp_path / "cache", timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads((run / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    text = load_text_assets(run)
    im_end = text.tokenizer.token_to_id("<|im_end|>")
    assert text.chat_template == CHATML and text.eos_token == "<|im_end|>" and text.eos_ids == [im_end]
    g = _cli("mff.recipes.generate", "--ckpt", run, "--chat", "--prompt", "alpha beta", "--max-new-tokens", "4", cache=tmp_path)
    assert g.returncode == 0, g.stderr
    # out of the run again: transformers renders the same chat prompt and stops at <|im_end|>
    out = convert(ConvertConfig(src=str(run), dst=str(tmp_path / "hf"), to="hf"))
    tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "alpha beta"}]
    assert tok.eos_token == "<|im_end|>"
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == render_chat_template(CHATML, messages)
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == im_end
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == im_end


def test_init_from_gguf_keeps_the_chat_template(tmp_path):
    from tests.test_gguf import hf_weights, write_gguf

    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}<s>assistant:"
    gguf_path = tmp_path / "chat.gguf"
    write_gguf(gguf_path, hf_weights(), chat_template=template)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(20):  # printable ASCII only: the GGUF's tiny vocabulary has no newline
        (docs / f"d{i}.txt").write_text(" ".join(["hello", "abc", "xyz"][j % 3] for j in range(i, i + 30)))
    run = tmp_path / "run"
    r = run_cli(["--init-from", str(gguf_path), "--data.path", str(docs), "--ckpt-dir", str(run), "--data.val-permille", "200", *FAST],
                tmp_path / "cache", timeout=600)
    assert r.returncode == 0, r.stderr
    tok_cfg = json.loads((run / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == template and tok_cfg["bos_token"] == "<s>" and tok_cfg["eos_token"] == "</s>"
    g = _cli("mff.recipes.generate", "--ckpt", run, "--chat", "--prompt", "hello", "--max-new-tokens", "3", cache=tmp_path)
    assert g.returncode == 0, g.stderr


def test_generate_chat_template_file(pretrain_run, tmp_path, capsys):
    from mff.recipes.generate import main as generate

    def error(args, needle):  # in-process: the one-line error and exit code 2
        assert generate(["--ckpt", str(pretrain_run), "--prompt", "a", "--max-new-tokens", "2", *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and needle in err and "Traceback" not in err, err

    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    r = _cli("mff.recipes.generate", "--ckpt", pretrain_run, "--chat", "--chat-template", tpl, "--prompt", "alpha", "--max-new-tokens", "4",
             cache=tmp_path)
    assert r.returncode == 0 and r.stdout.endswith("\n"), r.stderr
    error(["--chat"], "--chat-template FILE")  # a pretraining run has no template of its own
    error(["--chat-template", tpl], "needs --chat")
    error(["--chat", "--chat-template", tmp_path / "nope.jinja"], "nope.jinja does not exist")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    error(["--chat", "--chat-template", bad], f"--chat-template {bad} does not parse (line 1)")
    bad.write_text("{{ raise_exception('rendered from the file: ' + messages[0]['content']) }}")  # the file is what renders
    error(["--chat", "--chat-template", bad], "rendered from the file: a")
    for body, kind in (("{{ 1 / 0 }}", "ZeroDivisionError"), ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError")):
        bad.write_text(body)  # what the template's own expressions raise is a one-line error too
        error(["--chat", "--chat-template", bad], f"--chat-template {bad} fails: {kind}")
