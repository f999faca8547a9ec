"""Tensor parallelism pieces (mff/parallel/tp.py, the tp rows of the sharding tables, the
vocab-parallel head and loss): one-process checks, and one 2-process gloo check of the layers
against their unsplit computation (the whole-model proof is tests/test_dist_layouts.py -k tp2).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import Replicate, Shard

import mff
from mff.nn.loss import IGNORE_INDEX, _LinearCrossEntropy, linear_cross_entropy_sum
from mff.parallel import resolve_placements
from mff.parallel import tp as tpmod
from mff.parallel.tp import chunk_range, copy_to_tp, gather_from_tp, reduce_from_tp, tp_shard
from tests.dist_util import free_port
from tests.test_sharding import FakeMesh

TP2 = FakeMesh(1, 1, 1, 2)  # dp_replicate, dp_shard, ep, tp


@pytest.mark.parametrize("length,size", [(255, 2), (256, 2), (10, 4), (7, 3), (1, 1), (129280, 8)])
def test_chunk_range_is_torch_chunk(length, size):
    parts = torch.arange(length).chunk(size)
    for r in range(size):
        start, stop = chunk_range(length, r, size)
        want = parts[r] if r < len(parts) else torch.arange(0)
        assert torch.equal(torch.arange(start, stop), want), (r, start, stop)


def test_vocab_splits_unevenly_heads_only_whole():
    table = mff.build("qwen3", size="tiny").sharding_table
    # an odd vocabulary is split as if padded to a multiple of tp; the padding is not stored
    assert resolve_placements("model.embed_tokens.weight", (255, 8), table, TP2) == (Replicate(),) * 3 + (Shard(0),)
    with pytest.raises(ValueError, match=r"'lm_head.weight': dim 0 of size 9 \(vocab\) .* leaves the last rank no rows"):
        resolve_placements("lm_head.weight", (9, 8), table, FakeMesh(1, 1, 1, 4))
    # 2 KV heads of 32 rows: 64 rows divide tp 4, but the heads do not
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight': dim 0 of size 64 holds 2 heads of 32 rows; 2 heads do not split evenly over mesh axes tp 4 = 4"):
        resolve_placements("model.layers.0.self_attn.k_proj.weight", (64, 256), table, FakeMesh(1, 1, 1, 4))
    with pytest.raises(ValueError, match="not a whole number of heads of 32"):
        resolve_placements("model.layers.0.self_attn.q_proj.weight", (48, 256), table, TP2)


def test_model_init_refuses_kv_heads_that_do_not_divide_tp():
    model = mff.build("qwen3", size="tiny")  # 4 KV heads
    shapes = model.param_shapes()
    path = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=f"'{path}': dim 0 of size 128 holds 4 heads of 32 rows; 4 heads do not split evenly over mesh axes tp 8 = 8"):
        resolve_placements(path, shapes[path], model.sharding_table, FakeMesh(1, 1, 1, 8))


@pytest.mark.parametrize("family", ["deepseek3", "qwen3_moe", "glm4", "glm4_moe", "qwen3", "llama"])
def test_tp_rows_of_the_tables(family):
    """Column layers split their out dim over tp, row layers their in dim; routed experts,
    routers, low-rank MLA projections, norms and MTP's eh_proj stay whole over tp."""
    model = mff.build(family, size="tiny")
    expect = {
        "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_b_proj.weight": 0, "kv_b_proj.weight": 0,
        "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0, "o_proj.weight": 1, "gate_proj.weight": 0,
        "up_proj.weight": 0, "down_proj.weight": 1, "gate_up_proj.weight": 0, "embed_tokens.weight": 0, "lm_head.weight": 0,
    }
    seen = set()
    for path, shape in model.param_shapes().items():
        tp = resolve_placements(path, shape, model.sharding_table, TP2)[3]
        key = ".".join(path.split(".")[-2:])
        want = Replicate() if ".experts." in path or key not in expect else Shard(expect[key])
        assert tp == want, (path, tp)
        seen.add(key if tp != Replicate() else "")
    assert {"o_proj.weight", "embed_tokens.weight"} <= seen


def test_tp_functions_on_a_one_rank_group(dist1):
    """The autograd Functions themselves (not the size-1 shortcut) on a one-rank group: the
    identity both ways."""
    group = dist1.get_group("tp")
    x = torch.randn(3, 4, requires_grad=True)
    for fn in (tpmod._CopyToTP.apply, tpmod._ReduceFromTP.apply):
        y = fn(x, group)
        assert torch.equal(y, x)
        g = torch.randn(3, 4)
        assert torch.equal(torch.autograd.grad(y, x, g)[0], g)
    y = tpmod._GatherFromTP.apply(x, group, 4)
    assert torch.equal(y, x)
    assert copy_to_tp(x, None) is x and reduce_from_tp(x, group) is x and gather_from_tp(x, None, 4) is x


def test_vocab_parallel_loss_on_a_one_rank_group_is_the_plain_loss(dist1):
    group = dist1.get_group("tp")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 5, generator=g, requires_grad=True)
    w = torch.randn(7, 5, generator=g, requires_grad=True)
    y = torch.tensor([0, 6, 3, IGNORE_INDEX, 2, 2, 5, 1, IGNORE_INDEX])
    want = linear_cross_entropy_sum(h, w, y, chunk_rows=4)
    gw = torch.autograd.grad(want, (h, w))
    loss = _LinearCrossEntropy.apply(h, w, y, 4, True, 0, group)  # the vocab-parallel branch, one rank
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), gw):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_replicated_and_plain_weights_take_the_plain_path(dist1):
    w = mff.build("qwen3", size="tiny").init(seed=0, mesh=dist1)["model.embed_tokens.weight"]
    assert tp_shard(w) is None and tp_shard(torch.zeros(3)) is None


# ---- two processes (gloo): the split layers equal their unsplit computation -------------------


def _two_rank_checks(rank: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.func import functional_call

    from mff.nn.head import head_cross_entropy_sum, head_logits, head_weight
    from mff.nn.layers import Embedding, Linear
    from mff.nn.loss import vocab_parallel_linear_cross_entropy_sum
    from mff.nn.mlp import FusedGatedMLP
    from mff.nn.rope import rope_cos_sin
    from mff.optim.clip import global_grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def split(t, dim):
        return distribute_tensor(t.detach(), mesh, [Shard(dim) if dim is not None else Replicate()]).requires_grad_()

    def close(a, b, what):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-5, atol=1e-6, msg=what)

    def check_module(module, dims, args, what, extra=None):
        """Output and grads (params and the first input) of ``module`` with the params in ``dims``
        split over tp on that dim (the rest replicated) equal those with whole params."""
        gen = torch.Generator().manual_seed(1)
        full = {k: torch.randn(p.shape, generator=gen, dtype=torch.float64) for k, p in module.named_parameters()}
        runs = []
        for params in ({k: split(v, dims.get(k)) for k, v in full.items()}, {k: v.clone().requires_grad_() for k, v in full.items()}):
            inputs = [args[0].clone().requires_grad_(), *args[1:]]
            out = functional_call(module, params, (*inputs, *(extra() if extra else ())))
            leaves = [*params.values(), inputs[0]]
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out)) if torch.is_grad_enabled() else []
            runs.append((out, grads))
        close(runs[0][0], runs[1][0], what)
        for i, (a, b) in enumerate(zip(runs[0][1], runs[1][1])):
            close(a, b, f"{what} grad {i} of {list(full)}")

    g = torch.Generator().manual_seed(0)
    V, D, N = 7, 6, 11  # an odd vocabulary: rank 0 holds rows 0..3, rank 1 rows 4..6
    h = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 6, 3, IGNORE_INDEX, 4, 2, 5, 1, IGNORE_INDEX, 6, 3])

    # vocab-parallel loss (chunks of 4 rows) and logits against float64 torch
    hh, wd = h.clone().requires_grad_(), split(w, 0)
    head = head_weight(wd)
    assert head.weight.shape[0] == (4, 3)[rank] and head.start == (0, 4)[rank]
    loss = vocab_parallel_linear_cross_entropy_sum(hh, head.weight, y, head.start, V, head.group, chunk_rows=4)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hr @ wr.t(), y, ignore_index=IGNORE_INDEX, reduction="sum")
    close(loss, ref, "loss")
    for a, b, what in zip(torch.autograd.grad(loss, (hh, wd)), torch.autograd.grad(ref, (hr, wr)), ("grad h", "grad w")):
        close(a, b, what)
    close(head_cross_entropy_sum(h, head_weight(split(w, 0)), y), ref, "head loss")
    logits = head_logits(h, head_weight(split(w, 0)))
    assert logits.shape == (N, V)
    close(logits, h @ w.t(), "gathered logits")

    # vocab-parallel embedding
    emb = Embedding(V, D).double()
    ids = torch.tensor([[0, 3, 4, 6], [5, 1, 2, 6]])
    wd = split(w, 0)
    out = functional_call(emb, {"weight": wd}, (ids,))
    wr = w.clone().requires_grad_()
    ref = torch.nn.functional.embedding(ids, wr)
    close(out, ref, "embedding")
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    close(torch.autograd.grad(out, wd, go)[0], torch.autograd.grad(ref, wr, go)[0], "embedding grad")

    # column then row Linear (with biases), and GLM-4's fused gate_up MLP
    x = torch.randn(3, 5, D, generator=g, dtype=torch.float64)
    w1, b1 = torch.randn(8, D, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    w2, b2 = torch.randn(D, 8, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    col, row = Linear(D, 8, bias=True).double(), Linear(8, D, bias=True).double()
    pd = {"w1": split(w1, 0), "b1": split(b1, 0), "w2": split(w2, 1), "b2": split(b2, None)}
    xd = x.clone().requires_grad_()
    mid = functional_call(col, {"weight": pd["w1"], "bias": pd["b1"]}, (xd,))
    assert mid.shape[-1] == 4  # this rank's half of the features
    out = functional_call(row, {"weight": pd["w2"], "bias": pd["b2"]}, (torch.tanh(mid),))
    pr = {k: v.clone().requires_grad_() for k, v in {"w1": w1, "b1": b1, "w2": w2, "b2": b2}.items()}
    xr = x.clone().requires_grad_()
    ref = torch.tanh(xr @ pr["w1"].t() + pr["b1"]) @ pr["w2"].t() + pr["b2"]
    close(out, ref, "column -> row")
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    names = ["w1", "b1", "w2", "b2"]
    got = torch.autograd.grad(out, [xd] + [pd[k] for k in names], go)
    want = torch.autograd.grad(ref, [xr] + [pr[k] for k in names], go)
    for a, b, what in zip(got, want, ["x"] + names):
        close(a, b, f"column -> row grad {what}")

    mlp = FusedGatedMLP(D, 4).double()
    gu, down = torch.randn(8, D, generator=g, dtype=torch.float64), torch.randn(D, 4, generator=g, dtype=torch.float64)
    pd = {"gate_up_proj.weight": split(gu, 0), "down_proj.weight": split(down, 1)}
    pr = {"gate_up_proj.weight": gu.clone().requires_grad_(), "down_proj.weight": down.clone().requires_grad_()}
    out, ref = functional_call(mlp, pd, (x,)), functional_call(mlp, pr, (x,))
    close(out, ref, "fused gate_up MLP")
    for k, a, b in zip(pd, torch.autograd.grad(out, list(pd.values()), go), torch.autograd.grad(ref, list(pr.values()), go)):
        close(a, b, f"fused MLP grad {k}")

    # attention: GQA with biases and q/k norms; MLA expanded (with grads) and absorbed (cache)
    from mff.nn.attention import cache_causal_mask
    from mff.nn.gqa import GQA
    from mff.nn.mla import MLA

    B, T = 2, 5
    pos = torch.arange(T).expand(B, T)
    gqa = GQA(8, 4, 2, 4, qkv_bias=True, o_bias=True, qk_norm=True).double()
    cos, sin = rope_cos_sin(pos, torch.tensor([1.0, 0.1]), 1.0, torch.float64)
    x8 = torch.randn(B, T, 8, generator=g, dtype=torch.float64)
    dims = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0,
            "o_proj.weight": 1}
    check_module(gqa, dims, (x8, cos, sin, None), "GQA")
    mla = MLA(8, 4, 6, 5, 3, 2, 4, 0.3, False).double()
    dims = {"q_b_proj.weight": 0, "kv_b_proj.weight": 0, "o_proj.weight": 1}
    cos, sin = rope_cos_sin(pos, torch.tensor([1.0]), 1.0, torch.float64)
    check_module(mla, dims, (x8, cos, sin, None), "MLA")
    mask = cache_causal_mask(torch.ones(B, T, dtype=torch.bool), 0, T)
    with torch.no_grad():
        check_module(mla, dims, (x8, cos, sin, mask), "MLA absorbed", lambda: ({k: torch.zeros(v, dtype=torch.float64) for k, v in mla.cache_shapes(B, T).items()},
                                                                               torch.arange(T)))

    # global grad norm: a split grad counts each element once, a replicated one once
    a, b = torch.randn(V, D, generator=g), torch.randn(4, generator=g)
    norm = global_grad_norm({"a": split(a, 0), "b": split(b, None)})
    assert abs(norm - float(torch.cat([a.flatten(), b]).norm())) < 1e-5
    dist.destroy_process_group()


def test_split_layers_equal_the_unsplit_ones_on_two_ranks():
    mp.spawn(_two_rank_checks, args=(free_port(),), nprocs=2, join=True)
