"""Sharding tables -> placements, the mesh shape rules, and gather-on-use on a real 1-process mesh."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import mff
from mff.parallel import ParallelConfig, mesh_shape, resolve_placements


class FakeMesh:
    """Just the DeviceMesh surface resolve_placements reads."""

    mesh_dim_names = ("dp_replicate", "dp_shard", "ep", "tp")

    def __init__(self, *shape):
        self.shape = shape
        self.ndim = len(shape)

    def size(self, i):
        return self.shape[i]


TABLE = [("model.embed_tokens.weight", ("vocab", "embed")), ("**.norm.weight", ("embed",))]


def test_size_one_axes_replicate():
    assert resolve_placements("model.embed_tokens.weight", (10, 8), TABLE, FakeMesh(1, 1, 1, 1)) == (Replicate(),) * 4


def test_fsdp_shards_the_embed_dim():
    assert resolve_placements("model.embed_tokens.weight", (10, 8), TABLE, FakeMesh(1, 2, 1, 1)) == (Replicate(), Shard(1), Replicate(), Replicate())


def test_ep_nests_the_dense_fsdp_shard_and_splits_experts():
    table = TABLE + [("**.experts.gate_up_proj", ("expert", "mlp", "embed"))]
    mesh = FakeMesh(1, 2, 2, 1)
    assert resolve_placements("model.norm.weight", (8,), table, mesh) == (Replicate(), Shard(0), Shard(0), Replicate())
    assert resolve_placements("model.layers.1.mlp.experts.gate_up_proj", (4, 6, 8), table, mesh) == (
        Replicate(), Shard(2), Shard(0), Replicate())
    with pytest.raises(ValueError, match=r"dim 0 of size 6 \(embed\) does not divide mesh axes dp_shard 2 x ep 2 = 4"):
        resolve_placements("model.norm.weight", (6,), table, mesh)


def test_errors_name_param_dim_and_sizes():
    with pytest.raises(ValueError, match=r"'model.norm.weight': dim 0 of size 7 \(embed\) does not divide mesh axes dp_shard 2 = 2"):
        resolve_placements("model.norm.weight", (7,), TABLE, FakeMesh(1, 2, 1, 1))
    with pytest.raises(ValueError, match="no row of the sharding table matches"):
        resolve_placements("lm_head.weight", (10, 8), TABLE, FakeMesh(1, 1, 1, 1))
    with pytest.raises(ValueError, match="has 2 dims"):
        resolve_placements("model.norm.weight", (4, 4), TABLE, FakeMesh(1, 1, 1, 1))


@pytest.mark.parametrize("size", ["tiny", "v3-671b"])
def test_every_deepseek3_param_has_a_rule(size):
    model = mff.build("deepseek3", size=size)
    mesh = FakeMesh(1, 8, 1, 1)
    for path, shape in model.param_shapes().items():
        resolve_placements(path, shape, model.sharding_table, mesh)


def test_mesh_shape_rules():
    assert mesh_shape(ParallelConfig(), 4) == (1, 4, 1, 1)
    assert mesh_shape(ParallelConfig(dp_replicate=2), 4) == (2, 2, 1, 1)
    assert mesh_shape(ParallelConfig(tp=2), 4) == (1, 2, 1, 2)
    assert mesh_shape(ParallelConfig(ep=2, dp_shard=2), 4) == (1, 2, 2, 1)
    with pytest.raises(ValueError, match="WORLD_SIZE is 4"):
        mesh_shape(ParallelConfig(dp_shard=3), 4)
    with pytest.raises(ValueError, match=r"dp_replicate 1 x dp_shard 2 x ep 1 x tp 2 = 4 processes, but WORLD_SIZE is 2"):
        mesh_shape(ParallelConfig(dp_shard=2, tp=2), 2)
    with pytest.raises(ValueError, match="not divisible by dp_replicate 1 x ep 1 x tp 3"):
        mesh_shape(ParallelConfig(tp=3), 4)
    with pytest.raises(ValueError, match="--parallel.cp 2: context parallelism is not supported yet"):
        mesh_shape(ParallelConfig(cp=2), 2)
    # pipeline stages take their share of the world; the returned shape is one stage's mesh
    assert mesh_shape(ParallelConfig(pp=2), 2) == (1, 1, 1, 1)
    assert mesh_shape(ParallelConfig(pp=2, ep=2), 8) == (1, 2, 2, 1)
    with pytest.raises(ValueError, match=r"WORLD_SIZE 4 is not divisible by pp 3 x dp_replicate 1 x ep 1 x tp 1 = 3"):
        mesh_shape(ParallelConfig(pp=3), 4)
    with pytest.raises(ValueError, match=r"mesh pp 2 x dp_replicate 1 x dp_shard 1 x ep 1 x tp 1 = 2 processes, but WORLD_SIZE is 4"):
        mesh_shape(ParallelConfig(pp=2, dp_shard=1), 4)
    with pytest.raises(ValueError, match=r"--parallel.pp 0: must be an integer >= 1"):
        mesh_shape(ParallelConfig(pp=0), 4)


def test_dtensor_params_give_same_logits_and_matching_grad_placements(dist1):
    model = mff.build("deepseek3", size="tiny")
    mesh = dist1
    plain = model.init(seed=3)
    sharded = model.init(seed=3, mesh=mesh)
    for k in plain:
        assert torch.equal(plain[k].detach(), sharded[k].full_tensor().detach())
    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    a, b = model.forward(plain, batch), model.forward(sharded, batch)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    leaves = [v for v in sharded.values() if v.requires_grad]
    grads = torch.autograd.grad(b.loss, leaves)
    assert all(g.placements == p.placements for g, p in zip(grads, leaves))
