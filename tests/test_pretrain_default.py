"""Acceptance of the main job: the README's command trains the tiny DeepSeek-V3 on the default
corpus for the default number of steps, and the final validation LM loss is below ln(vocab)/2
and below the validation unigram entropy. Slow (about 11 minutes on 2 cores)."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.cli_util import run_cli


@pytest.mark.slow
def test_default_pretraining_learns(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    r = run_cli(["--model", "deepseek3", "--ckpt-dir", str(tmp_path / "ckpt"), "--metrics-file", str(metrics)],
                tmp_path / "cache", timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [rec["step"] for rec in records] == list(range(1, 301))
    final = records[-1]["val_loss"]
    entropy = float(re.findall(r"validation unigram entropy ([0-9.]+)", r.stdout)[-1])
    print(f"final val_loss {final:.4f}, ln(8192)/2 = {math.log(8192) / 2:.4f}, unigram entropy {entropy:.4f}")
    assert final < math.log(8192) / 2
    assert final < entropy
