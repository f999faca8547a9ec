"""MoE routing and experts: closed-form router values, grouped GEMM vs per-expert loop,
balance loss, and the aux-loss-free bias update."""

from __future__ import annotations

import pytest
import torch

from mff import backend
from mff.nn.moe import Experts, select_experts, sequence_balance_loss
from mff.train.step import update_expert_bias


def test_bias_changes_selection_but_not_weights():
    scores = torch.tensor([[0.9, 0.8, 0.3, 0.2]])
    w, idx = select_experts(scores, torch.tensor([0.0, 0.0, 1.0, 0.0]), top_k=2, norm_topk_prob=True)
    got = dict(zip(idx[0].tolist(), w[0].tolist()))
    assert set(got) == {2, 0}
    assert got[0] == pytest.approx(0.75) and got[2] == pytest.approx(0.25)


def test_norm_topk_and_routed_scaling():
    scores = torch.tensor([[0.9, 0.6, 0.1, 0.1]])
    w, idx = select_experts(scores, None, top_k=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    order = idx[0].argsort()
    assert idx[0][order].tolist() == [0, 1]
    torch.testing.assert_close(w[0][order], torch.tensor([1.5, 1.0]))


def test_group_limit_excludes_groups():
    # 4 groups of 2; group scores (top-2 sums): g0 0.2, g1 1.8, g2 1.0, g3 1.1 -> topk_group 2 keeps g1, g3
    scores = torch.tensor([[0.1, 0.1, 0.9, 0.9, 0.95, 0.05, 0.6, 0.5]])
    _, idx = select_experts(scores, None, top_k=3, n_group=4, topk_group=2)
    assert sorted(idx[0].tolist()) == [2, 3, 6]  # 4 (0.95) is in the dropped group 2
    _, idx = select_experts(scores, None, top_k=3, n_group=1, topk_group=1)
    assert sorted(idx[0].tolist()) == [2, 3, 4]


def test_select_experts_errors():
    with pytest.raises(ValueError, match="n_group"):
        select_experts(torch.rand(2, 6), None, top_k=2, n_group=4, topk_group=2)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0]])
def test_grouped_mm_fused_equals_loop(counts):
    if not backend._grouped_mm_runs("cpu"):
        pytest.skip("torch._grouped_mm does not run on this torch/CPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 8, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 12, generator=g, requires_grad=True)
    y1 = backend.grouped_mm_fused(x, w, counts)
    y2 = backend.grouped_mm_loop(x, w, counts)
    torch.testing.assert_close(y1, y2)
    up = torch.randn(y1.shape, generator=g)
    g1 = torch.autograd.grad(y1, (x, w), up)
    g2 = torch.autograd.grad(y2, (x, w), up)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("impl", ["loop", "fused"])
def test_grouped_mm_of_transposed_expert_params_gives_grads_in_the_params_layout(impl):
    """The experts pass ``w.transpose(1, 2)`` of their contiguous ``[E, out, in]`` params; the
    param's gradient must come out contiguous like the param (a transposed one sends the whole
    AdamW group off the fused kernel) and equal the per-expert ``x_e^T g_e``."""
    if impl == "fused" and not backend._grouped_mm_runs("cpu"):
        pytest.skip("torch._grouped_mm does not run on this torch/CPU")
    mm = backend.grouped_mm_loop if impl == "loop" else backend.grouped_mm_fused
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    w_EFD = torch.randn(4, 12, 8, generator=g, requires_grad=True)  # [E, out, in]
    up = torch.randn(10, 12, generator=g)
    gx, gw = torch.autograd.grad(mm(x, w_EFD.transpose(1, 2), counts), (x, w_EFD), up)
    assert gw.stride() == w_EFD.stride()
    starts = [0, 3, 3, 8, 10]
    for e in range(4):
        rows = slice(starts[e], starts[e + 1])
        torch.testing.assert_close(gw[e], up[rows].t() @ x[rows].detach())
        torch.testing.assert_close(gx[rows], up[rows] @ w_EFD[e].detach())


def test_grouped_mm_fused_takes_the_loop_for_dtypes_the_kernel_rejects():
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5]
    x = torch.randn(8, 8, generator=g, dtype=torch.float64)
    w = torch.randn(3, 8, 4, generator=g, dtype=torch.float64)  # torch._grouped_mm raises on float64
    torch.testing.assert_close(backend.grouped_mm_fused(x, w, counts), backend.grouped_mm_loop(x, w, counts))
    ref = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    torch.testing.assert_close(backend.grouped_mm_fused(x, w, counts), ref)


def test_experts_match_plain_loop():
    torch.manual_seed(0)
    E, D, I, N, K = 4, 8, 12, 10, 2
    with torch.device("meta"):
        ex = Experts(E, D, I)
    gate_up, down = torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    x = torch.randn(N, D)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    w = torch.rand(N, K)
    for impl in ("loop", "fused"):
        backend.select_ops("cpu", grouped_mm=impl)
        y, counts = torch.func.functional_call(ex, {"gate_up_proj": gate_up, "down_proj": down}, (x, w, idx), strict=True)
        ref = torch.zeros(N, D, dtype=torch.float64)
        for n in range(N):
            for k in range(K):
                e = idx[n, k]
                h = gate_up[e].double() @ x[n].double()
                a = torch.nn.functional.silu(h[:I]) * h[I:]
                ref[n] += w[n, k].double() * (down[e].double() @ a)
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
        assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    backend.select_ops("cpu")


def test_balance_loss_closed_form():
    # uniform routing over E=4 with K=2 and uniform scores: f_i = 1, P_i = 1/4 -> sum = 1
    scores = torch.full((1, 4, 4), 0.5)
    idx = torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert sequence_balance_loss(scores, idx).item() == pytest.approx(1.0)
    # all tokens to experts 0, 1 whose normalised scores are 0.4 each: f = [2, 2, 0, 0], P = [0.4, 0.4, .1, .1]
    scores = torch.tensor([[[0.8, 0.8, 0.2, 0.2]] * 3])
    idx = torch.tensor([[[0, 1]] * 3])
    assert sequence_balance_loss(scores, idx).item() == pytest.approx(2 * 0.4 * 2)


def test_expert_bias_update_sign_rule():
    params = {"m.mlp.gate.e_score_correction_bias": torch.zeros(4)}
    update_expert_bias(params, {"m.mlp": torch.tensor([8, 2, 5, 5])}, rate=0.001)  # mean 5
    torch.testing.assert_close(params["m.mlp.gate.e_score_correction_bias"], torch.tensor([-0.001, 0.001, 0.0, 0.0]))
