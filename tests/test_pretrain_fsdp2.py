"""The same command under ``torchrun --nproc_per_node=2`` (gloo, FSDP over dp_shard=2) follows
the single-process loss curve: nothing in the step assumes world_size == 1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.cli_util import ROOT, make_corpus, run_cli, tiny_args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_process_fsdp_matches_one_process(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    args = tiny_args(corpus) + ["--steps", "5"]
    one = run_cli(args + ["--ckpt-dir", str(tmp_path / "one"), "--metrics-file", str(tmp_path / "one.jsonl")], cache, timeout=600)
    assert one.returncode == 0, one.stderr
    env = dict(os.environ, MFF_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}", "-m", "mff.recipes.pretrain",
           *args, "--ckpt-dir", str(tmp_path / "two"), "--metrics-file", str(tmp_path / "two.jsonl"), "--parallel.dp-shard", "2"]
    two = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "dp_shard': 2" in two.stdout
    for a, b in zip(_losses(tmp_path / "one.jsonl"), _losses(tmp_path / "two.jsonl"), strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
