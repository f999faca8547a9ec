"""The pretrain recipe with the issue-6 options: Muon + bf16-mixed + selective recomputation
trains, saves the whole optimizer state and resumes exactly; a checkpoint's optimizer must match
the run's; unsupported option combinations fail at start-up with the reason."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from mff.ckpt import latest_step_dir
from tests.cli_util import make_corpus, run_cli, tiny_args

OPTS = ["--optim.name", "muon", "--precision", "bf16-mixed", "--ac", "selective", "--steps", "6", "--save-every", "3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("opts")
    return make_corpus(root / "corpus", n_docs=20), root / "cache"


def _losses(path):
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def test_muon_bf16_mixed_selective_resumes_exactly(corpus, tmp_path):
    data, cache = corpus
    args = tiny_args(data) + OPTS
    full = run_cli(args + ["--ckpt-dir", str(tmp_path / "a"), "--metrics-file", str(tmp_path / "a.jsonl")], cache, timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    assert "(cpu measured bfloat16 matmul)" in full.stdout  # MFU of bf16 compute is against the bf16 peak
    for extra in (["--stop-after", "3"], []):
        r = run_cli(args + extra + ["--ckpt-dir", str(tmp_path / "b"), "--metrics-file", str(tmp_path / "b.jsonl")], cache, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    assert _losses(tmp_path / "b.jsonl") == _losses(tmp_path / "a.jsonl")
    with safe_open(str(latest_step_dir(tmp_path / "a") / "optim.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "momentum_buffer/model.layers.1.mlp.experts.gate_up_proj" in keys  # stacked experts on Muon
    assert "exp_avg/model.embed_tokens.weight" in keys and "exp_avg/lm_head.weight" in keys  # embeddings and head on AdamW
    assert not any(k.startswith("momentum_buffer/") and k.endswith("norm.weight") for k in keys)  # 1-D params on AdamW


def test_resume_with_another_optimizer_is_refused(corpus, tmp_path):
    data, cache = corpus
    args = tiny_args(data) + ["--steps", "4", "--ckpt-dir", str(tmp_path / "c")]
    assert run_cli(args + ["--stop-after", "2"], cache, timeout=600).returncode == 0
    r = run_cli(args + ["--optim.name", "muon"], cache, timeout=600)
    assert r.returncode == 1
    assert "holds adamw optimizer state; this run has --optim.name muon" in r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--optim.schedule", "wsd", "--optim.decay-ratio", "0.9", "--steps", "10", "--optim.warmup-steps", "2"], "overlaps the 2 warmup steps"),
    (["--precision", "fp16"], "fp16"),
    (["--optim.name", "sgd"], "sgd"),
])
def test_bad_option_combinations_fail_at_start_up(corpus, tmp_path, flags, message):
    data, cache = corpus
    r = run_cli(tiny_args(data) + flags + ["--ckpt-dir", str(tmp_path / "d")], cache, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr
