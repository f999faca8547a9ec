"""The NPU op table on CPU through the torch_npu stand-in (tests/npu_standin.py): each fused
entry equals its torch twin, falls back (announced once, with the reason) where the kernel's
documented limits are not met, obeys MFF_NPU_FUSED, and a whole model of every family gives the
plain path's logits and grads: plain causal, packed documents, left-padded generation with a KV
cache, and MoE layers with an expert that gets no token."""

from __future__ import annotations

import pytest
import torch

import mff
from mff import backend
from mff.backend import npu as npu_ops
from mff.nn.attention import attention_torch, cache_causal_mask, causal_attention, document_causal_mask
from mff.nn.rope import apply_rope
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
    assert backend.ops.names == {"rms_norm": "npu_rms_norm", "grouped_mm": "npu_grouped_matmul", "swiglu": "npu_swiglu",
                                 "attention": "npu_fusion_attention", "rope": "npu_rotary_mul",
                                 "moe_permute": "npu_moe_token_permute"}


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
    ("attention", lambda: causal_attention(*_qkv(2, 6, 4, 2, 200), 0.1), "head dim 200 (the kernel takes a multiple of 16 up to 512)"),
    ("attention", lambda: causal_attention(*_qkv(2, 4, 4, 2, 32, S=6), 0.1, torch.ones(2, 1, 1, 6, dtype=torch.bool)),
     "mask torch.bool (2, 1, 1, 6) (the kernel takes a bool mask [2 or 1, 1, 4, 6] here)"),
    ("attention", lambda: causal_attention(*_qkv(1, 2, 4, 2, 32, S=5), 0.1), "a causal call of 2 queries over 5 keys without a mask"),
    ("rope", lambda: apply_rope(torch.randn(1, 3, 2, 32), *_cos_sin(1, 3, 32, factor=1.5)),
     "cos/sin outside [-1, 1] (a YaRN attention factor above 1; the kernel takes [-1, 1])"),
    ("moe_permute", lambda: backend.ops.moe_permute(torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.int64)), "no tokens"),
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


def test_reasons_that_differ_only_in_numbers_are_announced_once(npu, capsys):
    for S in (5, 6, 7):  # as a maskless decode over a growing cache would
        causal_attention(*_qkv(1, 2, 4, 2, 32, S=S), 0.1)
    assert sorted(why for _, why in npu_ops.fallbacks.seen) == [
        f"a causal call of 2 queries over {S} keys without a mask" for S in (5, 6, 7)]
    err = capsys.readouterr().err
    assert err.count("mff: attention takes the torch twin on this NPU: ") == 1 and "over 5 keys" in err
    npu_ops.fallbacks.clear()
    causal_attention(*_qkv(1, 2, 4, 2, 32, S=8), 0.1)
    assert "over 8 keys" in capsys.readouterr().err  # clear() forgets what was announced


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
    assert [k for k, v in names.items() if v.startswith("npu_")] == ["swiglu"]
    names = backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "attention,moe_permute"}).names
    assert [k for k, v in names.items() if v.startswith("npu_")] == ["attention", "moe_permute"]
    assert backend.ops.moe_unpermute is not None and backend.ops.rope is None
    with pytest.raises(ValueError, match=r"MFF_NPU_FUSED='flash': unknown op flash; expected 1 \(or all\), 0 \(or none\) "
                                         r"or a comma list of rms_norm, grouped_mm, swiglu, attention, rope, moe_permute"):
        backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "flash"})
    with pytest.raises(ValueError, match=r"MFF_NPU_FUSED='flash': unknown op flash"):
        backend.select_ops("cpu", env={"MFF_NPU_FUSED": "flash"})  # checked off the NPU too, not ignored
    assert set(backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "none"}).names.values()) == {"torch", "loop"}
    assert len([v for v in backend.select_ops("npu", torch_npu_module=npu, env={"MFF_NPU_FUSED": "all"}).names.values()
                if v.startswith("npu_")]) == 6




def _qkv(B, T, H, K, D, S=None, E=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    return (torch.randn(B, T, H, D, generator=g), torch.randn(B, S, K, D, generator=g),
            torch.randn(B, S, K, E or D, generator=g))


def _cos_sin(B, T, R, factor=1.0):
    pos = torch.arange(T, dtype=torch.float32)[None].expand(B, T) + 3
    freqs = pos[..., None] / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def _same(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", ["causal", "packed", "left-padded", "mla-widths"])
def test_fusion_attention_equals_the_torch_attention(npu, case):
    B, T, H, K, D = 2, 8, 4, 2, 32
    E = 16 if case == "mla-widths" else None
    q, k, v = _qkv(B, T, H, K, D, E=E)
    mask = None
    if case == "packed":
        mask = document_causal_mask(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1]]))
    if case == "left-padded":
        mask = cache_causal_mask(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool), 0, T)
    (y1, g1), (y2, g2) = (_grads(lambda a, b, c: causal_attention(a, b, c, 0.3, mask), q, k, v),
                          _grads(lambda a, b, c: attention_torch(a, b, c, 0.3, mask), q, k, v))
    _same(y1, y2)
    for a, b in zip(g1, g2):
        _same(a, b)
    (name, args), = npu.calls
    assert name == "npu_fusion_attention" and not npu_ops.fallbacks.seen
    if case == "packed":
        assert args == ("TND", (16, 4, 32), (16, 2, 32), (3, 8, 10, 16))  # cumulative document ends over the 2 rows
    elif case == "left-padded":
        assert args == ("BSND", (2, 8, 4, 32), (2, 8, 2, 32), 0, (2, 1, 8, 8))
        assert torch.equal(y1[0, :3], torch.zeros_like(y1[0, :3]))  # padding rows see no key: 0, as on the torch path
    else:
        assert args == ("BSND", (2, 8, 4, 32), (2, 8, 2, 32), 3, (2048, 2048))  # GQA: 2 KV heads passed as they are


@pytest.mark.parametrize("filled", [137, 600, 1000, 3000, 4095])
def test_decode_masks_past_512_keys_give_the_true_masked_softmax(npu, filled):
    S = 4096
    q, k, v = _qkv(2, 1, 4, 1, 64, S=S, seed=filled)
    valid = torch.zeros(2, S, dtype=torch.bool)
    valid[:, :filled] = True
    valid[1, : filled // 3] = False  # row 1 is left-padded
    mask = cache_causal_mask(valid, filled - 1, 1)
    y = causal_attention(q, k, v, 0.125, mask)
    # the reference from first principles, per row and head: softmax over the visible keys only
    for b in range(2):
        keys = valid[b].nonzero().squeeze(1)
        for h in range(4):
            p = torch.softmax((k[b, keys, 0] @ q[b, 0, h]) * 0.125, dim=0)
            _same(y[b, 0, h], p @ v[b, keys, 0])
    assert npu.calls[0][1][3:] == (0, (2, 1, 1, S))


def test_a_maskless_non_causal_call_is_full_attention(npu):
    q, k, v = _qkv(1, 6, 2, 2, 16)
    everything = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    y = causal_attention(q, k, v, 0.25, everything)
    ref = torch.softmax(torch.einsum("thd,shd->hts", q[0], k[0]) * 0.25, -1) @ v[0].transpose(0, 1)
    _same(y[0], ref.transpose(0, 1))
    assert npu.calls[0][1][3] == 0 and not npu_ops.fallbacks.seen


@pytest.mark.parametrize("layout", ["half", "interleave", "pairs"])
def test_rotary_mul_equals_the_torch_rope_in_every_layout(npu, layout):
    x = torch.randn(2, 5, 3, 32)
    cos, sin = _cos_sin(2, 5, 32)
    (y1, g1), (y2, g2) = _grads(lambda a: apply_rope(a, cos, sin, layout=layout), x), _grads(
        lambda a: backend.select_ops("cpu") and apply_rope(a, cos, sin, layout=layout), x)
    _same(y1, y2)
    _same(g1[0], g2[0])
    assert npu.calls == [("npu_rotary_mul", ((2, 5, 3, 32), "interleave" if layout == "pairs" else "half"))]


def test_partial_rotary_hands_the_kernel_the_rotary_dims_only(npu):
    x = torch.randn(2, 4, 3, 128)
    cos, sin = _cos_sin(2, 4, 64)  # head dim 128, partial_rotary_factor 0.5
    y = apply_rope(x, cos, sin, layout="half")
    assert npu.calls == [("npu_rotary_mul", ((2, 4, 3, 64), "half"))]
    assert torch.equal(y[..., 64:], x[..., 64:])  # the pass-through dims, bit for bit
    backend.select_ops("cpu")
    _same(y, apply_rope(x, cos, sin, layout="half"))


def test_a_torch_npu_without_rotary_mode_takes_the_kernel_at_128_only(capsys):
    old = make_standin(rotary_mode=False)
    npu_ops.fallbacks.clear()
    backend.select_ops("npu", torch_npu_module=old, env={})
    try:
        x, cos, sin = torch.randn(1, 4, 2, 128), *_cos_sin(1, 4, 128)
        y = apply_rope(x, cos, sin)
        assert old.calls == [("npu_rotary_mul", ((1, 4, 2, 128), "half"))]
        apply_rope(torch.randn(1, 4, 2, 64), *_cos_sin(1, 4, 64))
        apply_rope(torch.randn(1, 4, 2, 64), *_cos_sin(1, 4, 64), layout="pairs")
        assert len(old.calls) == 1
        assert set(npu_ops.fallbacks.seen) == {
            ("rope", "rotary dim 64 (this torch_npu's npu_rotary_mul, without rotary_mode, takes 128 only)"),
            ("rope", "layout 'pairs' (this torch_npu's npu_rotary_mul has no rotary_mode, so no interleave mode)")}
        assert capsys.readouterr().err.count("mff: rope takes the torch twin on this NPU: ") == 2
    finally:
        backend.select_ops("cpu")
        npu_ops.fallbacks.clear()
    _same(y, apply_rope(x, cos, sin))


def test_moe_token_permute_and_unpermute_follow_the_stable_expert_order(npu):
    x = torch.randn(5, 8)
    idx = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 0], [1, 2]])
    w = torch.rand(5, 2)
    xs, pos = backend.ops.moe_permute(x, idx)
    ref_x, ref_pos = npu_ops.moe_permute_torch(x, idx)
    assert torch.equal(xs, ref_x) and pos.tolist() == ref_pos.tolist()
    # expert 0 gets slots (0,1) (1,0) (3,0) (3,1) in that order: rows 0..3 of the permuted tokens
    assert pos.tolist()[:2] == [6, 0] and torch.equal(xs[:4], x[[0, 1, 3, 3]])
    y = torch.randn(10, 8)
    (o1, g1), (o2, g2) = (_grads(lambda a, b: backend.ops.moe_unpermute(a, pos, b), y, w),
                          _grads(lambda a, b: npu_ops.moe_unpermute_torch(a, ref_pos, b), y, w))
    _same(o1, o2)
    for a, b in zip(g1, g2):
        _same(a, b)
    assert [c[0] for c in npu.calls] == ["npu_moe_token_permute", "npu_moe_token_unpermute"]

def _forward_and_grads(model, params, batch, cache=None):
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    out = model.forward(params, batch, cache) if cache is not None else model.forward(params, batch)
    loss = out.loss if out.loss is not None else (out.logits * torch.linspace(-1, 1, out.logits.shape[-1])).sum()
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return out.logits.detach(), dict(zip(params, grads))


def _generation(model, params):
    """A left-padded prompt prefilled into a KV cache, then two greedy decode steps: the last-position
    logits of each call, and the param grads of the prefill (the decode steps write the cache in
    place, which autograd cannot take back through)."""
    params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, :2] = False
    out = model.forward(params, {"input_ids": ids, "attention_mask": valid}, model.init_cache(2, 12))
    weights = torch.linspace(-1, 1, out.logits.shape[-1])
    grads = torch.autograd.grad((out.logits[valid] * weights).mean(), list(params.values()), allow_unused=True)
    logits = [out.logits[:, -1].detach()]
    with torch.no_grad():
        for _ in range(2):
            out = model.forward(params, {"input_ids": logits[-1].argmax(-1, keepdim=True)}, out.cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits), dict(zip(params, grads))


CASES = ["causal", "packed", "generation"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", list(mff.models.FAMILIES))
def test_every_family_gives_the_plain_logits_and_grads_with_the_npu_table(family, case):
    model = mff.build(family, size="tiny")
    params = model.init(seed=0)
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    if case == "packed":
        batch["document_ids"] = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2, 2]])
        batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 0, 1, 2]])
    moe = [k for k in params if k.endswith("e_score_correction_bias")]
    if moe:  # expert 0 of each MoE layer is never selected: it gets no token, and its grads must be exactly 0
        params = dict(params, **{k: params[k].clone().index_fill_(0, torch.tensor([0]), -1e4) for k in moe})
    run = (lambda: _generation(model, params)) if case == "generation" else (lambda: _forward_and_grads(model, params, batch))
    backend.select_ops("cpu", grouped_mm="loop")
    ref_logits, ref_grads = run()
    standin = make_standin()
    npu_ops.fallbacks.clear()
    backend.select_ops("npu", torch_npu_module=standin, env={})
    try:
        logits, grads = run()
    finally:
        backend.select_ops("cpu")
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for k, g in grads.items():
        if ref_grads[k] is None:
            assert g is None, k
            continue
        torch.testing.assert_close(g, ref_grads[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert not npu_ops.fallbacks.seen, npu_ops.fallbacks.seen
    used = {c[0] for c in standin.calls}
    assert {"npu_rms_norm", "npu_fusion_attention", "npu_rotary_mul"} <= used
    layouts = {c[1][0] for c in standin.calls if c[0] == "npu_fusion_attention"}
    assert layouts == {"causal": {"BSND"}, "packed": {"TND"}, "generation": {"BSND"}}[case]
    if any(".experts." in k for k in params) and case != "generation":
        assert {"npu_grouped_matmul", "npu_swiglu", "npu_moe_token_permute", "npu_moe_token_unpermute"} <= used
    for k in params:
        if moe and grads[k] is not None and (k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")):
            assert torch.equal(grads[k][0], torch.zeros_like(grads[k][0])), k


def test_the_npu_check_script_says_no_npu_and_its_device_parity_passes_on_the_standin(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("npu_check", "scripts/npu_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    present, what = script._npu_present()
    assert not present and "torch_npu does not import" in what
    # the device half of the script, run on CPU over the stand-in: every case compared and printed
    rc = script.device_parity(torch.device("cpu"), 1e-4, torch_npu_module=make_standin(), families=["deepseek3"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS: largest fp32 difference" in out
    assert out.count("max |fused - twin|") == 2 * 3  # fp32 and bf16, three cases
    assert "left-padded KV cache" in out and "npu_fusion_attention" in out
    assert backend.ops.names["attention"] == "torch"


def test_inference_mode_empty_inputs_and_any_cos_table_match_the_torch_path(npu):
    q, k, v = _qkv(1, 4, 2, 2, 16)
    mask = document_causal_mask(torch.tensor([[0, 0, 1, 1]]))
    cos, sin = torch.rand(1, 4, 16, generator=torch.Generator().manual_seed(0)), torch.rand(1, 4, 16)  # not cat(f, f)
    with torch.inference_mode():
        y = causal_attention(q, k, v, 0.25, mask), apply_rope(q, cos, sin, layout="interleave")
        empty = torch.randn(1, 0, 2, 16)
        e = apply_rope(empty, cos[:, :0], sin[:, :0]), causal_attention(empty, empty, empty, 0.25, torch.ones(1, 1, 0, 0, dtype=torch.bool))
    assert {"an empty input"} == {why for _, why in npu_ops.fallbacks.seen}
    backend.select_ops("cpu")
    _same(y[0], attention_torch(q, k, v, 0.25, mask))
    _same(y[1], apply_rope(q, cos, sin, layout="interleave"))
    assert e[0].shape == (1, 0, 2, 16) and e[1].shape == (1, 0, 2, 16)
