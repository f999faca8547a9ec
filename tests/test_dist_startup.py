"""Start-up errors under torchrun (acceptance 5): a mesh that does not fit WORLD_SIZE, and a
param dim that does not divide its mesh axes, stop every rank with one line naming the cause
(no traceback from mff), before any data is read."""

from __future__ import annotations

import subprocess

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from mff.parallel.summary import compact_placement, placement_table
from tests.cli_util import make_corpus, tiny_args
from tests.dist_util import torchrun_rank_stderr


def _launch(tmp_path, extra: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """torchrun 2 processes with per-rank stderr files; returns the result and each rank's stderr."""
    args = tiny_args(make_corpus(tmp_path / "corpus")) + ["--steps", "2", "--ckpt-dir", str(tmp_path / "ck"), *extra]
    return torchrun_rank_stderr(2, args, tmp_path)


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


def test_placement_table_groups_params_and_folds_layer_indices(dist1):
    axes = ("dp_replicate", "dp_shard", "ep", "tp")
    assert compact_placement((Replicate(), Shard(1), Shard(1), Shard(0)), axes) == "dp_shard+ep:S(1) tp:S(0)"
    assert compact_placement((Shard(2), Replicate(), Shard(0), Replicate()), axes) == "dp_replicate:S(2) ep:S(0)"
    assert compact_placement((Replicate(),) * 4, axes) == "replicated"

    def dt(*placements):
        return DTensor.from_local(torch.zeros(4, 4), dist1, placements, run_check=False)

    R, S = Replicate(), Shard
    params = {f"model.layers.{i}.self_attn.q_proj.weight": dt(R, S(1), S(1), S(0)) for i in range(4)}
    params |= {"model.layers.0.mlp.experts.down_proj": dt(R, S(1), S(0), R), "model.norm.weight": dt(R, R, R, R),
               "step": torch.zeros(())}
    assert placement_table(params) == [
        "dp_shard+ep:S(1) tp:S(0)  model.layers.*.self_attn.q_proj.weight (x4)",
        "dp_shard:S(1) ep:S(0)     model.layers.*.mlp.experts.down_proj",
        "local                     step",
        "replicated                model.norm.weight",
    ]
