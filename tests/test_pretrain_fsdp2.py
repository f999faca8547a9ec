"""Issue 5, acceptance 6: ``torchrun --nproc_per_node=2 -m mff.recipes.pretrain --model deepseek3
--parallel.dp-shard 2`` trains on the default corpus and follows the loss curve of one process
with the same ``--batch-size`` (the global batch) within 1e-4 over 20 steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli_util import ROOT, cli_env, run_cli
from tests.dist_util import free_port

# a tiny DeepSeek-V3 (MLA, MoE with the expert bias, MTP) on the default corpus and tokenizer
FLAGS = ["--model", "deepseek3", "--model.hidden-size", "64", "--model.intermediate-size", "128", "--model.moe-intermediate-size", "32",
         "--model.num-hidden-layers", "2", "--model.q-lora-rank", "32", "--model.kv-lora-rank", "16", "--model.num-attention-heads", "2",
         "--seq-len", "32", "--batch-size", "4", "--optim.warmup-steps", "2", "--eval-every", "0", "--threads", "1", "--steps", "20"]



def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_process_fsdp_follows_one_process_on_the_default_corpus(tmp_path):
    cache = tmp_path / "cache"
    one = run_cli(FLAGS + ["--ckpt-dir", str(tmp_path / "one"), "--metrics-file", str(tmp_path / "one.jsonl")], cache, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "mff.recipes.pretrain",
           *FLAGS, "--ckpt-dir", str(tmp_path / "two"), "--metrics-file", str(tmp_path / "two.jsonl"), "--parallel.dp-shard", "2"]
    two = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(cache), cwd=ROOT, timeout=600)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "'dp_shard': 2" in two.stdout
    a, b = _records(tmp_path / "one.jsonl"), _records(tmp_path / "two.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 21))
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-4), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3), x["step"]  # fp32 reduction order over 20 Adam steps
