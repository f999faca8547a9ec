"""``python -m mff.recipes.pretrain --model NAME`` trains every family (a few steps of a small
config), and the loss goes down."""

from __future__ import annotations

import json

import pytest

from tests.cli_util import make_corpus, run_cli

SMALL = ["--model.hidden-size", "64", "--model.intermediate-size", "128", "--model.num-hidden-layers", "2", "--model.vocab-size", "512",
         "--model.num-attention-heads", "4"]
EXTRA = {
    "qwen3": ["--model.num-key-value-heads", "2", "--model.head-dim", "16"],
    "qwen3_moe": ["--model.num-key-value-heads", "2", "--model.head-dim", "16", "--model.moe-intermediate-size", "32"],
    "glm4": ["--model.num-key-value-heads", "2", "--model.head-dim", "16"],
    "glm4_moe": ["--model.num-key-value-heads", "2", "--model.head-dim", "16", "--model.moe-intermediate-size", "32"],
    "llama": ["--model.num-key-value-heads", "2"],
    "telechat3": ["--model.moe-intermediate-size", "32", "--model.q-lora-rank", "32", "--model.kv-lora-rank", "16"],
}


@pytest.mark.parametrize("family", list(EXTRA))
def test_pretrain_every_family(tmp_path_factory, family):
    root = tmp_path_factory.mktemp(family)
    corpus = make_corpus(root / "corpus")
    metrics = root / "m.jsonl"
    r = run_cli(["--model", family, *SMALL, *EXTRA[family], "--seq-len", "32", "--batch-size", "4", "--data.path", str(corpus),
                 "--data.vocab-size", "512", "--steps", "8", "--optim.warmup-steps", "2", "--eval-every", "0", "--threads", "1",
                 "--ckpt-dir", str(root / "ckpt"), "--metrics-file", str(metrics)], root / "cache")
    assert r.returncode == 0, r.stderr
    losses = [json.loads(line)["lm_loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
