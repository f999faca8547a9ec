"""Checkpoint layout, atomic writes, pruning, and clear errors for corrupt or mismatched files."""

from __future__ import annotations

import os

import msgpack
import pytest
import torch

from mff import ckpt


def _tree():
    g = torch.Generator().manual_seed(0)
    params = {"a.weight": torch.randn(3, 4, generator=g), "b.bias": torch.randn(4, generator=g)}
    state = {"step": torch.tensor(7), "exp_avg": {k: torch.randn(v.shape, generator=g) for k, v in params.items()},
             "exp_avg_sq": {k: torch.rand(v.shape, generator=g) for k, v in params.items()}}
    return params, state


def test_layout_and_round_trip(tmp_path):
    params, state = _tree()
    path = ckpt.save(tmp_path, 100, params, state, {"tokens_seen": 5, "data": {"position": 3}})
    assert path.name == "step_00000100"
    assert sorted(os.listdir(path)) == ["meta.msgpack", "model.safetensors", "optim.safetensors"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000100"
    like_p = {k: torch.zeros_like(v) for k, v in params.items()}
    like_s = {"step": torch.tensor(0), "exp_avg": {k: torch.zeros_like(v) for k, v in params.items()},
              "exp_avg_sq": {k: torch.zeros_like(v) for k, v in params.items()}}
    p2, s2, meta = ckpt.load(ckpt.latest_step_dir(tmp_path), like_p, like_s)
    assert all(torch.equal(p2[k], params[k]) for k in params)
    assert int(s2["step"]) == 7 and all(torch.equal(s2["exp_avg"][k], state["exp_avg"][k]) for k in params)
    assert meta["step"] == 100 and meta["tokens_seen"] == 5 and meta["format"] == "mff-checkpoint"


def test_keep_last_prunes_only_after_new_is_complete(tmp_path):
    params, state = _tree()
    for step in (1, 2, 3):
        ckpt.save(tmp_path, step, params, state, {}, keep_last=2)
    assert ckpt.list_steps(tmp_path) == [2, 3]
    with pytest.raises(ckpt.CheckpointError, match="refusing to overwrite"):
        ckpt.save(tmp_path, 3, params, state, {})


def test_partial_write_is_invisible(tmp_path):
    params, state = _tree()
    ckpt.save(tmp_path, 1, params, state, {})
    (tmp_path / ".tmp-step_00000002-999").mkdir()  # a crashed writer's leftovers
    assert ckpt.list_steps(tmp_path) == [1]
    assert ckpt.latest_step_dir(tmp_path).name == "step_00000001"


def test_corrupt_and_mismatched_files_are_named(tmp_path):
    params, state = _tree()
    path = ckpt.save(tmp_path, 1, params, state, {})
    like = {k: torch.zeros_like(v) for k, v in params.items()}
    with pytest.raises(ckpt.CheckpointError, match=r"'a.weight' has shape \(3, 4\), the model expects \(4, 4\)"):
        ckpt.load(path, {**like, "a.weight": torch.zeros(4, 4)})
    with pytest.raises(ckpt.CheckpointError, match="has no tensor 'c.weight'"):
        ckpt.load(path, {**like, "c.weight": torch.zeros(1)})
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupt or truncated"):
        ckpt.load(path, like)
    (path / "meta.msgpack").write_bytes(msgpack.packb({"format": "other"}))
    with pytest.raises(ckpt.CheckpointError, match="not an mff checkpoint"):
        ckpt.read_meta(path)
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(ckpt.CheckpointError, match=r"not a step dir name.*; step dirs there: step_00000001 \(to resume from one"):
        ckpt.latest_step_dir(tmp_path)
    (tmp_path / "latest").write_text("step_00000009")
    with pytest.raises(ckpt.CheckpointError, match=r"names step_00000009, which does not exist.*step dirs there: step_00000001 .*"
                                                   r"echo step_00000001 > "):
        ckpt.latest_step_dir(tmp_path)
    for s in range(2, 9):
        (tmp_path / ckpt.step_dir_name(s)).mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"step dirs there: step_00000004, .*, step_00000008 \(and 3 older\)"):
        ckpt.latest_step_dir(tmp_path)
