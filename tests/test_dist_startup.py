"""Start-up errors under torchrun (acceptance 5): a mesh that does not fit WORLD_SIZE, and a
param dim that does not divide its mesh axes, stop every rank with one line naming the cause
(no traceback from mff), before any data is read."""

from __future__ import annotations

import subprocess

import pytest

from tests.cli_util import make_corpus, tiny_args
from tests.dist_util import torchrun


def _launch(tmp_path, extra: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """torchrun 2 processes with per-rank stderr files; returns the result and each rank's stderr."""
    logs = tmp_path / "logs"
    args = tiny_args(make_corpus(tmp_path / "corpus")) + ["--steps", "2", "--ckpt-dir", str(tmp_path / "ck"), *extra]
    r = torchrun(2, args, tmp_path / "cache", timeout=180, launcher=["--log-dir", str(logs), "--redirects", "2", "--monitor-interval", "1"])
    per_rank = [next(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text() for rank in range(2)]
    return r, per_rank


@pytest.mark.parametrize("extra, cause", [
    (["--parallel.dp-shard", "4"], "mesh dp_replicate 1 x dp_shard 4 x ep 1 x tp 1 = 4 processes, but WORLD_SIZE is 2"),
    (["--parallel.dp-shard", "2", "--model.hidden-size", "63"],
     "param 'model.embed_tokens.weight': dim 1 of size 63 (embed) does not divide mesh axes dp_shard 2 = 2"),
])
def test_bad_layout_fails_at_start_up_on_every_rank(tmp_path, extra, cause):
    r, per_rank = _launch(tmp_path, extra)
    assert r.returncode != 0
    for rank, err in enumerate(per_rank):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines == [f"error: rank {rank}: {cause}"], err
    assert "step " not in r.stdout and "data:" not in r.stdout  # failed before training and before the data
