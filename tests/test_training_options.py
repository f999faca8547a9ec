"""Issue 6, acceptance 3-4 and the loss rules: activation checkpointing and torch.compile give
the plain step's grads and count expert loads once; bf16-mixed keeps fp32 master params and
fp32-sensitive parts; the correction bias stays fp32 in a bf16 model; the chunked head+loss
equals the unchunked one; a micro-batch without targets contributes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import mff
from mff.models import get_family
from mff.nn.loss import linear_cross_entropy_sum
from mff.optim import OptimConfig, init_state
from mff.train.precision import compute_params
from mff.train.step import train_step


def _small(family: str):
    cfg = get_family(family).sizes["tiny"]
    over = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family == "deepseek3":
        over.update(intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, first_k_dense_replace=1)
    else:
        over.update(intermediate_size=128, num_key_value_heads=2, head_dim=16)
        if family == "qwen3_moe":
            over.update(moe_intermediate_size=32)
    return mff.build(family, dataclasses.replace(cfg, **over))


def _batch(seed=0, B=2, T=24, V=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _loss_grads(model, params, batch):
    out = model.forward(params, batch, logits=False)
    names = [k for k, v in params.items() if v.requires_grad]
    grads = torch.autograd.grad(out.loss, [params[k] for k in names])
    return out, dict(zip(names, grads))


def _assert_same(ref, got, atol=1e-5):
    (out0, g0), (out1, g1) = ref, got
    assert float(out1.loss.detach()) == pytest.approx(float(out0.loss.detach()), abs=atol)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=atol, rtol=0, msg=k)
    assert out1.expert_load.keys() == out0.expert_load.keys()
    for k in out0.expert_load:
        assert torch.equal(out1.expert_load[k], out0.expert_load[k]), k  # counted once, not again in the recompute


@pytest.mark.parametrize("family", ["deepseek3", "qwen3_moe", "qwen3"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpointing_gives_the_plain_grads(family, ac):
    model = _small(family)
    params = model.init(0)
    batch = _batch()
    ref = _loss_grads(model, params, batch)
    assert ref[0].expert_load or family == "qwen3"
    _assert_same(ref, _loss_grads(model.with_execution(ac=ac), params, batch))


@pytest.mark.parametrize("family,ac", [("deepseek3", "none"), ("deepseek3", "full"), ("qwen3", "selective"),
                                       ("deepseek3", "selective"), ("qwen3_moe", "selective")])
def test_compile_gives_the_plain_grads(family, ac):
    model = _small(family)
    params = model.init(0)
    ref = _loss_grads(model, params, _batch())
    compiled = model.with_execution(ac=ac, compile=True)
    for seed in (0, 1):  # the second call reuses the compiled graphs
        _assert_same(_loss_grads(model, params, _batch(seed)), _loss_grads(compiled, params, _batch(seed)))
    assert ref is not None


def test_a_compiled_moe_block_is_one_graph_and_its_expert_gemms_are_saved_by_selective_ac():
    import torch._dynamo

    from mff.nn import blocks

    for family in ("qwen3_moe", "deepseek3"):
        model = _small(family)
        moe = model.skeleton.model.layers[1].mlp
        params = {k.removeprefix("model.layers.1.mlp."): v for k, v in model.init(0).items() if k.startswith("model.layers.1.mlp.")}
        x = torch.randn(2, 24, 64, requires_grad=True)
        explained = torch._dynamo.explain(lambda x, moe=moe, params=params: torch.func.functional_call(moe, params, (x,)))(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, (family, explained.break_reasons)
    assert torch.ops.mff.grouped_mm.default in blocks._SAVE_OPS
    # eagerly and compiled, an expert with no rows gets zero grads from the custom op
    from mff.nn.grouped_gemm import grouped_mm

    xs = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    counts = torch.tensor([2, 0, 3])
    y = grouped_mm(xs, w, counts)
    torch.testing.assert_close(y, torch.cat([xs[:2] @ w[0], xs[2:] @ w[2]]))
    gx, gw = torch.autograd.grad(y.square().sum(), (xs, w))
    rx, rw = torch.autograd.grad(torch.cat([xs[:2] @ w[0], xs[2:] @ w[2]]).square().sum(), (xs, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert torch.equal(gw[1], torch.zeros(8, 4))
    torch.library.opcheck(torch.ops.mff.grouped_mm.default, (xs.detach(), w.detach(), counts))


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_compiled_moe_training_steps_equal_eager_with_the_recipes_grouped_gemm(ac):
    """Two AdamW steps (the recipes' optimizer and their torch._grouped_mm pick), eager and
    compiled: the losses within 1e-5 and every param within 2e-4 after each step. AdamW's first
    step is about lr * sign(g) (lr 3e-3), so a grad on the wrong elements moves a param by about
    6e-3, while rounding differences of near-zero grads (|g| ~ eps) move it by up to ~4e-5."""
    from mff import backend

    try:
        backend.select_ops("cpu")  # as the recipes: torch._grouped_mm where it runs
        model = _small("deepseek3")
        batches = [_batch(0), _batch(1)]
        runs = []
        for m in (model, model.with_execution(ac=ac, compile=True)):
            params = model.init(0)
            state = init_state(OptimConfig(), params)
            snaps = []
            for b in batches:
                loss = train_step(m, params, state, [b], 3e-3, OptimConfig()).loss
                snaps.append((loss, {k: v.detach().clone() for k, v in params.items()}))
            runs.append(snaps)
        for step, ((loss_a, a), (loss_b, b)) in enumerate(zip(*runs)):
            assert loss_b == pytest.approx(loss_a, abs=1e-5), step + 1
            for k in a:
                torch.testing.assert_close(b[k], a[k], atol=2e-4, rtol=0, msg=f"step {step + 1}: {k}")
    finally:
        backend.select_ops("cpu", grouped_mm="loop")


def test_the_grouped_gemm_op_refuses_counts_that_do_not_split_the_rows():
    from mff import backend
    from mff.nn.grouped_gemm import grouped_mm, grouped_mm_weight_grad

    x, w = torch.randn(6, 16), torch.randn(3, 16, 8)
    for counts in ([1, 1, 1], [2, 3, 3], [4, -1, 3], [3, 3]):
        with pytest.raises(ValueError, match=r"group counts .* must be 3 non-negative ints summing to the 6 rows"):
            grouped_mm(x, w, torch.tensor(counts))
        with pytest.raises(ValueError, match="must be"):
            backend.grouped_mm_fused(x, w, counts)
    with pytest.raises(ValueError, match=r"must be 2 non-negative ints summing to the 6 rows"):
        grouped_mm_weight_grad(x, torch.randn(6, 8), torch.tensor([1, 1]))


def test_selective_with_compile_is_refused_under_expert_parallelism():
    from mff.parallel.mesh import ParallelConfig
    from mff.train.config import TrainConfig
    from mff.train.loop import check_train_config

    model = _small("deepseek3")
    cfg = TrainConfig(model=model.config, compile=True, ac="selective", parallel=ParallelConfig(ep=2), batch_size=8)
    with pytest.raises(ValueError, match=r"--ac selective with --compile is not supported with --parallel.ep > 1"):
        check_train_config(cfg, model, 1)
    check_train_config(dataclasses.replace(cfg, parallel=ParallelConfig()), model, 1)  # ep 1: compiles whole
    check_train_config(dataclasses.replace(cfg, ac="full"), model, 1)


def test_bf16_mixed_keeps_fp32_masters_and_fp32_router():
    model = _small("deepseek3")
    params = model.init(0)
    compute = compute_params(model, params, "bf16-mixed")
    assert compute["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    for k in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert compute[k].dtype == torch.float32
    batch = _batch()
    out = model.forward(compute, batch)
    assert out.logits.dtype == torch.bfloat16 and out.losses["lm"].dtype == torch.float32
    ref = model.forward(params, batch)
    assert float(out.losses["lm"]) == pytest.approx(float(ref.losses["lm"]), rel=2e-2)
    state = init_state(OptimConfig(), params)
    before = {k: v.detach().clone() for k, v in params.items()}
    stats = train_step(model, params, state, [batch], 1e-3, OptimConfig(), precision="bf16-mixed")
    assert stats.loss == pytest.approx(float(ref.loss), rel=2e-2)
    for k, v in params.items():
        assert v.dtype == before[k].dtype  # masters stay fp32
    assert all(t.dtype == torch.float32 for t in state["exp_avg"].values())
    assert not torch.equal(params["model.layers.0.self_attn.q_a_proj.weight"], before["model.layers.0.self_attn.q_a_proj.weight"])


def _retained_mib(fn):
    """``(fn(), MiB that fn allocated and had not freed when it returned)``: CPU allocations as
    torch.profiler records them."""
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        result = fn()
    return result, sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]") / 2**20


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_bf16_mixed_casts_each_block_at_use(ac):
    """``forward_params`` (what train_step runs) gives the loss of the cast-all-at-once
    ``compute_params`` bit for bit and the same gradients, bit for bit except the embedding's
    and the head's (left fp32 and cast by their users, so their gradients are summed in fp32:
    within bf16 rounding of the others); under recomputation (full or selective: the weight
    casts are recomputed, not saved) the blocks' bf16 weights are not kept from the forward to
    the backward, so what the forward leaves allocated shrinks by all the blocks' bf16 weights."""
    from mff.train.precision import forward_params

    base = _small("deepseek3")
    cfg = dataclasses.replace(base.config, hidden_size=128, num_hidden_layers=6, intermediate_size=512, moe_intermediate_size=128)
    model = mff.build("deepseek3", config=cfg).with_execution(ac=ac)
    params = model.init(0)
    batch = _batch(B=1, T=4)
    names = [k for k, v in params.items() if v.requires_grad]
    leaves = [params[k] for k in names]

    def at_once():
        return model.forward(compute_params(model, params, "bf16-mixed"), batch, logits=False).loss

    def at_use():
        with forward_params(model, params, "bf16-mixed") as compute:
            assert compute["model.layers.2.self_attn.q_a_proj.weight"].dtype == torch.float32  # cast inside the block
            assert compute["model.embed_tokens.weight"].dtype == torch.float32  # unsharded: the lookup casts its rows
            assert compute["lm_head.weight"].dtype == torch.float32  # the loss casts it
            assert compute["model.norm.weight"].dtype == torch.bfloat16
            assert compute["model.layers.2.mlp.gate.weight"].dtype == torch.float32
            return model.forward(compute, batch, logits=False).loss

    loss_once, held_once = _retained_mib(at_once)
    loss_use, held_use = _retained_mib(at_use)
    assert torch.equal(loss_once, loss_use)
    for name, a, b in zip(names, torch.autograd.grad(loss_once, leaves), torch.autograd.grad(loss_use, leaves)):
        assert b.dtype == torch.float32, name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            # summed in fp32, not rounded to bf16 on the way (the embedding's rows are distinct
            # tokens here, so only the head's rounding shows)
            assert name != "lm_head.weight" or not torch.equal(a, b), name
            torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-2 * float(a.abs().max()))
        else:
            assert torch.equal(a, b), name
    blocks = sum(v.numel() * 2 for k, v in params.items() if model.is_block_param(k) and not model.is_fp32(k)) / 2**20
    if ac != "none":
        assert held_use <= held_once - 0.9 * blocks, (held_once, held_use, blocks)
    else:  # without recomputation the block's backward needs its bf16 weights either way
        assert held_use >= held_once - 0.1 * blocks, (held_once, held_use, blocks)


def test_correction_bias_stays_fp32_in_a_bf16_model(tmp_path):
    model = _small("deepseek3")
    params = {k: v.detach() for k, v in model.init(0).items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    params[bias] = torch.zeros(8)
    params[bias][:2] = torch.tensor([6.90, 6.91])
    assert torch.tensor([6.90, 6.91]).bfloat16().unique().numel() == 1  # bf16 would merge them
    mff.save_hf(model, params, tmp_path / "hf")
    loaded_model, loaded = mff.load(tmp_path / "hf", dtype=torch.bfloat16)
    assert loaded[bias].dtype == torch.float32 and loaded["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert float(loaded[bias][1] - loaded[bias][0]) == pytest.approx(0.01, abs=1e-6)
    # with equal router scores, the expert with the larger bias wins
    gate = loaded_model.skeleton.model.layers[1].mlp.gate
    x = torch.zeros(3, 64)
    w = torch.zeros(8, 64)
    _, _, idx = torch.func.functional_call(gate, {"weight": w, "e_score_correction_bias": loaded[bias]}, (x,))
    assert (idx[:, 0] == 1).all() and (idx[:, 1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_linear_cross_entropy_matches_unchunked(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, 50, (37,), generator=g)
    y[[3, 10, 36]] = -100
    ref = F.cross_entropy((h @ w.t()).float(), y, ignore_index=-100, reduction="sum")
    ref_g = torch.autograd.grad(0.5 * ref, (h, w))
    for rows in (1, 8, 37, 100):
        out = linear_cross_entropy_sum(h, w, y, chunk_rows=rows)
        assert out.dtype == torch.float32
        got = torch.autograd.grad(0.5 * out, (h, w))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float(out) == pytest.approx(float(ref), rel=1e-5 if dtype == torch.float32 else 1e-2)
        for a, b in zip(got, ref_g):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    with pytest.raises(IndexError, match="label 50 is outside"):
        linear_cross_entropy_sum(h, w, torch.full((37,), 50))
    with pytest.raises(ValueError, match="labels must be int64"):
        linear_cross_entropy_sum(h, w, y.float())
    with pytest.raises(ValueError, match="chunk_rows=0"):
        linear_cross_entropy_sum(h, w, y, chunk_rows=0)


def test_fused_cross_entropy_with_an_fp32_head_and_bf16_rows_gives_fp32_head_grads():
    """bf16-mixed's head: the loss casts the fp32 weight inside and sums its gradient in fp32,
    over vocabulary blocks of about 2^22 elements (2048 rows of width 2048: two blocks here,
    the second one partial), against a float64 reference on the same bf16 values; the bf16
    gradient of the rows carries the loss's scale without rounding it to bf16 first."""
    g = torch.Generator().manual_seed(0)
    V, D = 3000, 2048
    h = torch.randn(13, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, V, (13,), generator=g)
    y[[2, 7]] = -100
    y[0], y[1] = V - 1, 2048  # targets in the second block
    out = linear_cross_entropy_sum(h, w, y, chunk_rows=5)
    gh, gw = torch.autograd.grad(out / 3, (h, w))  # 1/3: a scale bf16 cannot hold
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.float32
    ref = F.cross_entropy(h.double() @ w.bfloat16().double().t(), y, ignore_index=-100, reduction="sum")
    rh, rw = torch.autograd.grad(ref / 3, (h, w))
    assert float(out) == pytest.approx(float(ref), rel=1e-4)
    torch.testing.assert_close(gw.double(), rw.double(), atol=1e-3 * float(rw.abs().max()), rtol=2e-2)
    torch.testing.assert_close(gh.double(), rh.double(), atol=1e-2 * float(rh.abs().max()), rtol=2e-2)
    # the scale is applied in fp32 and rounded once: no uniform bias (bf16(1/3) * 3 = 1.002)
    assert float(gh.double().norm() / rh.double().norm()) == pytest.approx(1.0, abs=5e-4)


def test_loss_without_logits_equals_loss_with_logits():
    model = _small("deepseek3")
    params = model.init(0)
    batch = _batch()
    a = model.forward(params, batch)
    b = model.forward(params, batch, logits=False)
    assert b.logits is None and a.logits.shape == (2, 24, 256)
    for k in a.losses:
        assert float(b.losses[k]) == pytest.approx(float(a.losses[k]), rel=1e-6)


def test_microbatch_without_targets_contributes_nothing():
    model = _small("deepseek3")
    params = model.init(0)
    batch = _batch()
    empty = dict(_batch(1), labels=torch.full((2, 24), -100))
    s1 = train_step(model, {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in params.items()}, init_state(OptimConfig(), params),
                    [batch], 0.0, OptimConfig(max_grad_norm=0.0))
    s2 = train_step(model, {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in params.items()}, init_state(OptimConfig(), params),
                    [batch, empty], 0.0, OptimConfig(max_grad_norm=0.0))
    assert s2.losses["lm"] == pytest.approx(s1.losses["lm"], rel=1e-6)
    assert s2.grad_norm == pytest.approx(s1.grad_norm, rel=1e-3)  # the balance term counts the empty rows' tokens
