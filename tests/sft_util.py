"""Tiny chat checkpoints and chat rows for fine-tuning tests (seconds per run on 2 cores)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import mff
from mff.data.tokenizer import train_bpe
from tests.cli_util import ROOT, WORDS, cli_env

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TINY = {
    "qwen3": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3_moe": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=512, mlp_only_layers=(0,)),
    "deepseek3": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                      first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      max_position_embeddings=512, num_nextn_predict_layers=0),
    "glm4": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=512),
}


def sentence(rng: random.Random, lo: int = 3, hi: int = 10) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chat_tokenizer(seed: int = 0):
    """A byte-level BPE with ChatML's special tokens (``<|endoftext|>`` 0, ``<|im_start|>`` and ``<|im_end|>`` next)."""
    rng = random.Random(seed)
    tok = train_bpe([sentence(rng, 20, 60) for _ in range(200)], 384)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def make_chat_checkpoint(folder: Path, family: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """An HF folder (config, safetensors, tokenizer.json, tokenizer_config.json with a ChatML
    template and ``<|im_end|>`` as EOS) of a tiny random ``family`` model."""
    fam = mff.get_family(family)
    base = mff.build(family).config
    cfg = dataclasses.replace(base, **{**TINY[family], **overrides})
    model = mff.build(family, cfg)
    params = model.init(seed)
    tok = chat_tokenizer(seed)
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    extra = {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(tok_cfg)}
    assert fam.name == family
    mff.save_hf(model, params, folder, extra_files=extra)
    return folder


def write_rows(path: Path, n: int = 40, fmt: str = "sharegpt", seed: int = 0, turns: int = 2) -> Path:
    """``n`` rows of short random conversations in ``fmt`` (.jsonl)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            if fmt == "alpaca":
                row = {"instruction": sentence(rng), "input": sentence(rng) if rng.random() < 0.5 else "", "output": sentence(rng)}
            else:
                msgs = []
                for _ in range(turns):
                    msgs += [("user", sentence(rng)), ("assistant", sentence(rng))]
                if fmt == "sharegpt":
                    row = {"conversations": [{"from": "human" if r == "user" else "gpt", "value": v} for r, v in msgs]}
                else:
                    row = {"messages": [{"role": r, "content": v} for r, v in msgs]}
            f.write(json.dumps(row) + "\n")
    return path


def run_finetune(args: list[str], cache: Path, **kw) -> subprocess.CompletedProcess:
    """``python -m mff.recipes.finetune ARGS`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "mff.recipes.finetune", *args], capture_output=True, text=True, env=cli_env(cache),
                          cwd=ROOT, **kw)
