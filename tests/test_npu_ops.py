"""The NPU op table on CPU through the torch_npu stand-in (tests/npu_standin.py): each fused
entry equals its torch twin, falls back (announced once, with the reason) where the kernel's
documented limits are not met, obeys MFF_NPU_FUSED, and a whole model of every family gives the
plain path's logits and grads."""

from __future__ import annotations

import pytest
import torch

import mff
from mff import backend
from mff.backend import npu as npu_ops
from tests.npu_standin import KernelContractError, make_standin


@pytest.fixture
def npu():
    """The NPU op table over a fresh stand-in; the CPU table is restored afterwards."""
    standin = make_standin()
    npu_ops.fallbacks.clear()
    backend.select_ops("npu", torch_npu_module=standin, env={})
    try:
        yield standin
    finally:
        backend.select_ops("cpu")
        npu_ops.fallbacks.clear()


def _grads(f, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    y = f(*xs)
    gs = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum(), xs)
    return y.detach(), gs


def test_the_npu_table_names_the_kernels(npu):
    assert backend.ops.names == {"rms_norm": "npu_rms_norm", "grouped_mm": "npu_grouped_matmul", "swiglu": "npu_swiglu"}


def test_each_kernel_equals_its_twin_forward_and_backward(npu):
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 16), torch.randn(16)
    (y1, g1), (y2, g2) = (_grads(lambda a, b: backend.ops.rms_norm(a, b, 1e-6), x, w),
                          _grads(lambda a, b: backend.rms_norm_torch(a, b, 1e-6), x, w))
    torch.testing.assert_close(y1, y2, atol=1e-6, rtol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    h = torch.randn(4, 6, 24)
    (y1, g1), (y2, g2) = _grads(backend.ops.swiglu, h), _grads(backend.swiglu_torch, h)
    torch.testing.assert_close(y1, y2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g1[0], g2[0], atol=1e-6, rtol=1e-6)
    # grouped matmul with an expert that gets no row: its weight's grad is exactly zero on both paths
    xs, ws, counts = torch.randn(5, 8), torch.randn(3, 8, 4), [2, 0, 3]
    (y1, (gx1, gw1)), (y2, (gx2, gw2)) = (_grads(lambda a, b: backend.ops.grouped_mm(a, b, counts), xs, ws),
                                          _grads(lambda a, b: backend.grouped_mm_loop(a, b, counts), xs, ws))
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx1, gx2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw1, gw2, atol=1e-5, rtol=1e-5)
    assert torch.equal(gw1[1], torch.zeros_like(gw1[1])) and torch.equal(gw2[1], torch.zeros_like(gw2[1]))
    assert [c[0] for c in npu.calls] == ["npu_rms_norm", "npu_swiglu", "npu_grouped_matmul"]
    assert not npu_ops.fallbacks.seen


@pytest.mark.parametrize("op,call,reason", [
    ("swiglu", lambda: backend.ops.swiglu(torch.randn(*[1] * 8, 4)), "9 dims (the kernel takes 1 to 8)"),
    ("swiglu", lambda: backend.ops.swiglu(torch.randn(8, 2).t()), "a non-contiguous input"),
    ("swiglu", lambda: backend.ops.swiglu(torch.randn(2, 4, dtype=torch.float64)), "dtype torch.float64"),
    ("rms_norm", lambda: backend.ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8), 1e-6), "mixed dtypes"),
    ("grouped_mm", lambda: backend.ops.grouped_mm(torch.randn(0, 8), torch.randn(2, 8, 4), [0, 0]), "no rows"),
])
def test_a_call_outside_the_kernel_limits_takes_the_twin_announced_once(npu, capsys, op, call, reason):
    first = call()
    call()
    assert not npu.calls  # the stand-in, which would raise on these, was never called
    (key, count), = npu_ops.fallbacks.seen.items()
    assert key[0] == op and reason in key[1] and count == 2
    err = capsys.readouterr().err
    assert err.count(f"mff: {op} takes the torch twin on this NPU: ") == 1 and reason in err
    assert first is not None


def test_the_standin_rejects_what_the_kernel_rejects():
    m = make_standin()
    with pytest.raises(KernelContractError, match="odd"):
        m.npu_swiglu(torch.randn(2, 7))
    with pytest.raises(KernelContractError, match="counts"):
        m.npu_grouped_matmul([torch.randn(5, 8)], [torch.randn(2, 8, 4)], group_list=torch.tensor([2, 2]), split_item=2,
                             group_type=0, group_list_type=1)


def test_mff_npu_fused_chooses_the_kernels(npu):
    assert set(backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "0"}).names.values()) == {"torch", "loop"}
    names = backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "swiglu"}).names
    assert names == {"rms_norm": "torch", "grouped_mm": "loop", "swiglu": "npu_swiglu"}
    with pytest.raises(ValueError, match=r"MFF_NPU_FUSED='rope': unknown op rope; expected 0, 1 or a comma list of rms_norm, grouped_mm, swiglu"):
        backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "rope"})


def _forward_and_grads(model, params, batch):
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    out = model.forward(params, batch)
    grads = torch.autograd.grad(out.loss, list(params.values()), allow_unused=True)
    return out.logits.detach(), dict(zip(params, grads))


@pytest.mark.parametrize("family", list(mff.models.FAMILIES))
def test_every_family_gives_the_plain_logits_and_grads_with_the_npu_table(family):
    model = mff.build(family, size="tiny")
    params = model.init(seed=0)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    moe = [k for k in params if k.endswith("e_score_correction_bias")]
    if moe:  # expert 0 of each MoE layer is never selected: it gets no token, and its grads must be exactly 0
        params = dict(params, **{k: params[k].clone().index_fill_(0, torch.tensor([0]), -1e4) for k in moe})
    backend.select_ops("cpu", grouped_mm="loop")
    ref_logits, ref_grads = _forward_and_grads(model, params, batch)
    standin = make_standin()
    backend.select_ops("npu", torch_npu_module=standin, env={})
    try:
        logits, grads = _forward_and_grads(model, params, batch)
    finally:
        backend.select_ops("cpu")
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for k, g in grads.items():
        if ref_grads[k] is None:
            assert g is None, k
            continue
        torch.testing.assert_close(g, ref_grads[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    used = {c[0] for c in standin.calls}
    assert "npu_rms_norm" in used
    if any(".experts." in k for k in params):
        assert {"npu_grouped_matmul", "npu_swiglu"} <= used
    for k in params:
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            if moe:
                assert torch.equal(grads[k][0], torch.zeros_like(grads[k][0])), k
