"""KV-cache generation: chunked prefill, the MLA latent cache, batching with left padding and
stop ids, and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mff
from mff.generate import generate
from mff.sampling import SamplingConfig


def _model(family: str):
    model = mff.build(family)
    cfg = dataclasses.replace(model.config, vocab_size=97, num_hidden_layers=2, max_position_embeddings=64)
    model = mff.build(family, cfg)
    params = {k: v.detach() for k, v in model.init(seed=0).items()}
    with torch.no_grad():  # O(1) activations so the logits are far from uniform
        for k, v in params.items():
            if v.dim() >= 2:
                v.normal_(0, v.shape[-1] ** -0.5, generator=torch.Generator().manual_seed(len(k)))
    return model, params


@pytest.mark.parametrize("family", ["qwen3", "deepseek3", "glm4_moe"])
def test_chunked_prefill_equals_full_forward(family):
    model, params = _model(family)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.forward(params, {"input_ids": ids}).logits
        cache = model.init_cache(2, 16)
        parts = []
        for a, b in ((0, 5), (5, 6), (6, 8)):
            out = model.forward(params, {"input_ids": ids[:, a:b]}, cache)
            cache = out.cache
            parts.append(out.logits)
    assert full.abs().max() > 1.0
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-5
    assert cache["offset"] == 8 and cache["next_pos"].tolist() == [8, 8]


def test_mla_cache_holds_the_latent_and_rope_key_only():
    model, _ = _model("deepseek3")
    cfg = model.config
    cache = model.init_cache(1, 10)
    assert len(cache["layers"]) == cfg.num_hidden_layers
    per_token = sum(t[0, 0].numel() for t in cache["layers"][0].values())
    assert per_token == cfg.kv_lora_rank + cfg.qk_rope_head_dim  # not H * (qk_head_dim + v_head_dim)


def test_masked_rows_give_zero_not_nan():
    from mff.nn.attention import cache_causal_mask, causal_attention

    valid = torch.tensor([[False, False, True, True]])
    mask = cache_causal_mask(valid, 0, 4)
    q = k = v = torch.randn(1, 4, 2, 8)
    o = causal_attention(q, k, v, 0.3, mask)
    assert torch.isfinite(o).all() and o[0, :2].abs().max() == 0
    # query i of 2 new queries after 3 cached slots sees keys up to 3 + i (bottom-right alignment)
    m = cache_causal_mask(torch.ones(1, 5, dtype=torch.bool), 3, 2)[0, 0]
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_few_query_attention_matches_a_plain_loop_with_empty_rows():
    """The decode path (T <= 16 with a mask): outputs and grads against a per-row softmax loop;
    rows with no visible key give 0 and zero grads, a NaN in a visible key's score propagates."""
    from mff.nn.attention import attention_torch

    g = torch.Generator().manual_seed(0)
    B, T, S, H, K, D, E = 2, 3, 7, 4, 2, 8, 5
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True)
               for shape in ((B, T, H, D), (B, S, K, D), (B, S, K, E)))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.5
    mask[0, 0, 1] = False  # an empty row
    mask[1, 0, 2, 3] = True
    o = attention_torch(q, k, v, 0.3, mask)
    ref = torch.zeros(B, T, H, E)
    for b in range(B):
        for t in range(T):
            keys = mask[b, 0, t].nonzero()[:, 0]
            for h in range(H):
                if len(keys):
                    p = torch.softmax(q[b, t, h] @ k[b, keys, h // 2].T * 0.3, dim=0)
                    ref[b, t, h] = p @ v[b, keys, h // 2]
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(o.square().sum(), (q, k, v))
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    assert grads[0][0, 1].abs().max() == 0
    k2 = k.detach().clone()
    k2[1, 3, 0, 0] = float("nan")  # key 3 is visible to row (1, 2): its heads 0-1 (KV head 0) turn NaN
    o2 = attention_torch(q.detach(), k2, v.detach(), 0.3, mask)
    assert o2[1, 2, :2].isnan().all() and not o2[0].isnan().any()


@pytest.mark.parametrize("family", ["llama", "deepseek3"])
def test_batch_left_padding_and_stop(family):
    model, params = _model(family)
    for seed in range(100):  # prompts where row 0's third new token appears nowhere else
        g = torch.Generator().manual_seed(seed)
        p0, p1 = torch.randint(1, 96, (1, 5), generator=g), torch.randint(1, 96, (1, 8), generator=g)
        alone0 = generate(model, params, p0, 6)[0, 5:]
        alone1 = generate(model, params, p1, 6)[0, 8:]
        stop = int(alone0[2])  # row 0 stops at its third new token
        if stop not in alone0[:2].tolist() and stop not in alone1.tolist() and stop != 96:
            break
    else:
        pytest.fail("no suitable prompts")
    pad = 96
    batch = torch.full((2, 8), pad)
    batch[0, 3:] = p0[0]
    batch[1] = p1[0]
    mask = batch != pad
    mask[1] = True
    out = generate(model, params, batch, 6, attention_mask=mask, eos_token_id=stop, pad_token_id=pad)
    assert out.shape == (2, 14)
    assert out[0, 8:11].tolist() == alone0[:3].tolist()  # up to and including the stop token
    assert out[0, 11:].tolist() == [pad] * 3
    assert torch.equal(out[1, 8:], alone1)


def test_sampling_is_seeded_and_respects_top_k():
    model, params = _model("qwen3")
    ids = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=0.8, top_k=1)
    assert torch.equal(generate(model, params, ids, 5, sampling=cfg, seed=1), generate(model, params, ids, 5))  # top-1 == greedy
    cfg = SamplingConfig(temperature=1.0, top_p=0.9)
    a, b = (generate(model, params, ids, 8, sampling=cfg, seed=3) for _ in range(2))
    assert torch.equal(a, b)


def test_model_generate_method():
    model, params = _model("glm4")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(params, ids, max_new_tokens=4), generate(model, params, ids, 4))


@pytest.mark.parametrize("kwargs,needle", [
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.int64)), "prompt is empty"),
    (dict(max_new_tokens=100), "exceeds the model's context"),
    (dict(sampling=SamplingConfig(top_p=1.5)), "top_p=1.5"),
    (dict(sampling=SamplingConfig(top_p=0.0)), "top_p=0.0"),
    (dict(sampling=SamplingConfig(temperature=-1.0)), "temperature=-1.0"),
    (dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (dict(attention_mask=torch.tensor([[1, 1, 0]])), "pad prompts on the left"),
    (dict(pad_token_id=-1), "pad_token_id=-1"),
    (dict(input_ids=torch.tensor([[1, 2, 3, 97]]), prefill_chunk=2), "token id 97, outside the vocabulary"),
    (dict(eos_token_id=2.0), "eos_token_id=2.0 must be an int"),
    (dict(seed=2**70), "seed="),
])
def test_bad_input(kwargs, needle):
    model, params = _model("qwen3")
    args = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        generate(model, params, args.pop("input_ids"), **args)


@pytest.mark.parametrize("family", ["qwen3", "deepseek3"])
def test_compiled_decode_step_matches_eager(family):
    """The compiled decode step (fused mat-vecs and attention) gives the eager tokens."""
    model, params = _model(family)
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :2] = False  # a left-padded row
    eager = generate(model, params, ids, 12, attention_mask=mask)
    compiled = generate(model, params, ids, 12, attention_mask=mask, compile=True)
    assert torch.equal(eager, compiled)
    # another prompt length and max_new_tokens in the same cache bucket: no second compilation
    from torch._dynamo.utils import counters

    before = dict(counters["frames"])
    compiled = generate(model, params, ids[:, 1:], 20, attention_mask=mask[:, 1:], compile=True)
    assert dict(counters["frames"]) == before, (before, dict(counters["frames"]))
    assert torch.equal(generate(model, params, ids[:, 1:], 20, attention_mask=mask[:, 1:]), compiled)


@pytest.mark.parametrize("family", ["qwen3", "deepseek3"])
def test_compiled_bf16_decode_step_matches_eager_logits(family):
    """In bf16 the compiled step realises each mat-vec's input (the dense projections and the
    routed experts'): its logits stay those of the eager bf16 step, for a batch of 3 rows, over
    6 steps against the cache (the tokens fed are the eager ones)."""
    from mff.generate import _compiled_step, _eager_step

    model, params = _model(family)
    params = model.cast(params, torch.bfloat16)
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(3))
    eager, compiled = _eager_step(model), _compiled_step(model, torch.device("cpu"))
    with torch.inference_mode():
        caches = []
        for _ in range(2):  # one cache for each step function (they write in place)
            out = model.forward(params, {"input_ids": ids}, model.init_cache(3, 16, dtype=torch.bfloat16))
            caches.append({k: v for k, v in out.cache.items() if k != "offset"})
        cache, cache_c = caches
        tok = out.logits[:, -1].float().argmax(-1)
        for _ in range(6):
            want, cache = eager(params, tok, cache)
            got, cache_c = compiled(params, tok, cache_c)
            err = (got.float() - want.float()).abs().max().item()
            assert err <= 0.05 * want.float().abs().max().item(), (err, want.abs().max().item())
            tok = want.float().argmax(-1)


def test_compiled_generate_past_the_recompile_limit_gives_the_eager_tokens():
    """Once Dynamo's recompile limit is reached (here 1 graph: a second batch size), the compiled
    loop's unguarded steps are refused by Dynamo; generate then runs them with their guards
    (uncompiled) instead of raising. Also when a callback swaps a param for another layout."""
    model, params = _model("qwen3")
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for B in (1, 2):
            want = generate(model, params, ids[:B], 6)
            assert torch.equal(generate(model, params, ids[:B], 6, compile=True), want)
    torch._dynamo.reset()
    key = "model.layers.0.mlp.down_proj.weight"
    swapped = dict(params)

    def swap(tok):
        swapped[key] = params[key].t().contiguous().t()  # same values, column-major

    want = generate(model, params, ids, 6)
    assert torch.equal(generate(model, swapped, ids, 6, compile=True, on_token=swap), want)


def test_cache_bucket():
    from mff.generate import cache_bucket

    assert [cache_bucket(n, 4096) for n in (1, 256, 257, 600, 4000)] == [256, 256, 512, 1024, 4096]
    assert cache_bucket(300, 300) == 300 and cache_bucket(10, 64) == 64  # never past the context


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matmul kernels (mm, addmm, bmm) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family,q_lora_rank", [("qwen3", 0), ("deepseek3", 0), ("deepseek3", None), ("glm4", 0),
                                                ("qwen3_moe", 0)])
def test_decode_layout_keeps_values_and_tokens(family, q_lora_rank, monkeypatch):
    """decode_layout: every 2-D projection weight with more outputs than inputs becomes a
    transposed view of a row-major [in, out] copy with the same shape and values, the others
    (and the embedding table) keep their row-major [out, in]; the projections that read the
    same input (q/k/v, gate/up, MLA's q_a or q with kv_a) become views of one copy ([in, sum out]
    when wider than tall, else [sum out, in]; their biases of one vector) and run as one
    matmul; the logits of a forward and of a decode step agree to fp32 rounding and greedy
    generation gives the same tokens, also with every mat-vec split over 2 threads."""
    from mff.generate import SIBLING_PROJECTIONS, decode_layout
    from mff.nn import layers

    model, params = _model(family)
    if q_lora_rank is None:
        model = mff.build(family, dataclasses.replace(model.config, q_lora_rank=None))
        params = {k: v.detach() for k, v in model.init(seed=0).items()}
    laid = decode_layout(params)
    assert laid.keys() == params.keys()
    moved = [k for k in params if laid[k] is not params[k]]
    assert moved and "model.embed_tokens.weight" not in moved
    groups = 0
    for k in moved:
        v = laid[k]
        assert v.shape == params[k].shape and torch.equal(v, params[k])
        module, _, name = k.rpartition(".")[0].rpartition(".")
        group = next((g for g in SIBLING_PROJECTIONS if g[0] == name and all(f"{module}.{n}.weight" in params for n in g)), None)
        member = any(f"{module}.{n}.weight" in params for g in SIBLING_PROJECTIONS if name in g for n in g if n != name)
        if v.dim() >= 2 and not member:  # out > in: a row-major W^T
            assert v.shape[-2] > v.shape[-1] and not v.is_contiguous() and v.transpose(-1, -2).stride(-1) == 1, k
        if group is not None and k.endswith(".weight"):
            groups += 1
            members = [laid[f"{module}.{n}.weight"] for n in group]
            assert len({m.untyped_storage().data_ptr() for m in members}) == 1  # one copy, side by side
            total, width = sum(w.shape[0] for w in members), members[0].shape[1]
            assert all(m.stride() == ((1, total) if total > width else (width, 1)) for m in members)
    kept = [k for k in params if laid[k] is params[k] and params[k].dim() >= 2 and k != "model.embed_tokens.weight"]
    assert all(params[k].shape[-2] <= params[k].shape[-1] and params[k].is_contiguous() for k in kept), kept
    # per layer: attention (q/k/v, or MLA's q_a or q with kv_a; GLM-4's gate_up is one weight already) and the
    # dense or shared-expert MLP (deepseek3: 2 layers and its MTP layer; qwen3_moe: layer 0 dense, layer 1 MoE)
    expected = {"qwen3": 2 * 2, "deepseek3": 3 * 2, "glm4": 2 * 1, "qwen3_moe": 2 + 1}[family]
    assert groups == expected, (groups, moved)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = model.forward(params, {"input_ids": ids}).logits
        with _CountMatmuls() as plain:
            model.forward(params, {"input_ids": ids})
        with _CountMatmuls() as joint:
            b = model.forward(laid, {"input_ids": ids}).logits
    assert (a - b).abs().max().item() <= 1e-5
    # matmuls saved: 2 per q/k/v, 1 per other pair (the MTP layer does not run in inference)
    fewer = {"qwen3": 2 * (2 + 1), "deepseek3": 2 * (1 + 1), "glm4": 2 * 2, "qwen3_moe": 2 * 2 + 1}[family]
    assert plain.n - joint.n == fewer, (plain.n, joint.n)
    assert torch.equal(generate(model, laid, ids, 12), generate(model, params, ids, 12))
    # the same with every mat-vec split over 2 threads (the tiny weights are below the size that pays)
    monkeypatch.setattr(layers, "MATVEC_SPLIT_MIN", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls = []
        real = layers.threaded_matvec
        monkeypatch.setattr(layers, "threaded_matvec", lambda x, w: calls.append(real(x, w) is not None) or real(x, w))
        with torch.no_grad():
            cache = model.init_cache(1, 8)
            step = model.forward(params, {"input_ids": ids}, cache).cache
            nxt = ids[:, -1:]
            want = model.forward(params, {"input_ids": nxt}, {k: v for k, v in step.items()}).logits
            calls.clear()
            got = model.forward(laid, {"input_ids": nxt}, step).logits
        assert (want - got).abs().max().item() <= 1e-5
        assert sum(calls) > 0  # mat-vecs that ran split
        assert torch.equal(generate(model, laid, ids, 12), generate(model, params, ids, 12))
    finally:
        torch.set_num_threads(threads)



@pytest.mark.parametrize("layout", ["W", "W^T", "W^T column slice", "W row slice", "expert W^T", "expert W"])
def test_threaded_matvec_equals_linear(layout, monkeypatch):
    """mff.nn.layers.threaded_matvec splits a one-row fp32 product x W^T over the threads as
    one bmm over views of W (no copy) for the two layouts decode_layout makes, each output
    equal to F.linear's to fp32 rounding; ``linear`` takes it only without grad."""
    import torch.nn.functional as F

    from mff.nn.layers import linear, threaded_matvec

    g = torch.Generator().manual_seed(0)
    D, Fo = 384, 768
    big = torch.randn(2 * Fo, 2 * D, generator=g)
    w = {"W": torch.randn(Fo, D, generator=g),
         "W^T": torch.randn(D, Fo, generator=g).t(),
         "W^T column slice": torch.randn(D, 2 * Fo, generator=g)[:, Fo // 2:Fo // 2 + Fo].t(),  # strides (1, 2 Fo), offset
         "W row slice": big[Fo // 3:Fo // 3 + Fo, :D],  # [Fo, D] with strides (2 D, 1), offset
         "expert W^T": torch.randn(3, D, Fo, generator=g).transpose(1, 2)[1],
         "expert W": torch.randn(3, Fo, D, generator=g)[2]}[layout]
    x = torch.randn(1, 1, D, generator=g)
    want = F.linear(x, w)
    threads = torch.get_num_threads()
    try:
        for P in (2, 3):
            torch.set_num_threads(P)
            with _CountMatmuls() as mm:
                got = threaded_matvec(x, w)
            assert got is not None and got.shape == (1, 1, Fo) and mm.n == 1
            assert (got - want).abs().max().item() <= 1e-4
            assert (threaded_matvec(x[0, 0], w) - want[0, 0]).abs().max().item() <= 1e-4  # a 1-D row
            with torch.no_grad():
                b = torch.randn(Fo, generator=g)
                assert (linear(x, w, b) - F.linear(x, w, b)).abs().max().item() <= 1e-4
        # where it does not apply: the caller runs F.linear
        assert threaded_matvec(x.bfloat16(), w.bfloat16()) is None
        assert threaded_matvec(x.expand(1, 2, D), w) is None  # two rows
        assert threaded_matvec(x, w[:Fo - 1]) is None  # 767 outputs over 3 threads
        assert threaded_matvec(x[..., ::2], w[::2, ::2]) is None  # neither rows nor columns unit-stride
        monkeypatch.setattr("mff.nn.layers.MATVEC_SPLIT_MIN", w.numel() + 1)
        assert threaded_matvec(x, w) is None
        monkeypatch.undo()
        torch.set_num_threads(1)
        assert threaded_matvec(x, w) is None
        torch.set_num_threads(2)
        with _CountMatmuls() as mm:
            linear(x, w)  # grad enabled: F.linear (one mm)
        assert mm.n == 1 and threaded_matvec(x, w) is not None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_matvec_reads_the_values_of_strided_and_fused_inputs(dtype):
    """Under torch.compile, mff's ``linear`` for up to 4 rows realises a bf16 input (Inductor's
    force-stride-order) before its mat-vec. The result must be x's values whatever x is: a norm's
    output fused into it, a slice with a step, a transpose, an expand, a row at an offset, a
    split of a fused projection, over widths that Inductor may pad (> 1024, unaligned)."""
    from mff.nn.layers import linear

    g = torch.Generator().manual_seed(5)
    D, Fo = 1030, 24
    w = torch.randn(Fo, D, generator=g).to(dtype)
    base = torch.randn(4, 3 * D, generator=g).to(dtype)
    producers = {
        "rmsnorm": lambda t: t[:, :D] * torch.rsqrt(t[:, :D].float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype),
        "silu*up (split of a fused projection)": lambda t: torch.nn.functional.silu(t[:, :D]) * t[:, D:2 * D],
        "slice with a step": lambda t: t[:, ::3],
        "transpose": lambda t: t[:, :D * 2].reshape(t.shape[0], D, 2).transpose(1, 2)[:, 1],
        "expand of one row": lambda t: (t[:1, D:2 * D] * 2).expand(t.shape[0], D),
        "rows at an offset": lambda t: torch.cat([t, t])[t.shape[0] - 1:2 * t.shape[0] - 1, 2 * D:],
    }
    for name, f in producers.items():
        for B in (1, 2, 3, 4):
            torch._dynamo.reset()
            fn = torch.compile(lambda t, w, f=f: linear(f(t), w), dynamic=False)
            with torch.no_grad():
                got = fn(base[:B], w)
                want = f(base[:B]).double() @ w.double().t()
            err = (got.double() - want).abs().max().item()
            scale = want.abs().max().item()
            assert got.shape == (B, Fo) and err <= (2e-2 if dtype == torch.bfloat16 else 1e-4) * scale, (name, B, err, scale)


def test_generate_runs_in_inference_mode_and_returns_an_ordinary_tensor():
    """generate decodes under torch.inference_mode but runs on_token / stop_fn outside it (under
    no_grad, as before) with ordinary tensors they may keep, modify or use with autograd, and
    returns ids the caller can modify in place."""
    model, params = _model("qwen3")
    ids = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(0))
    kept, modes = [], []
    w = torch.ones(3, requires_grad=True)

    def on_token(t):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        kept.append(t)
        with torch.enable_grad():
            (w * 2).sum().backward()

    def stop_fn(t):
        t.add_(1)  # its own copy: does not change the tokens
        return torch.zeros_like(t, dtype=torch.bool)

    forward_modes = []
    hook = model.skeleton.register_forward_pre_hook(lambda *_: forward_modes.append(torch.is_inference_mode_enabled()))
    out = generate(model, params, ids, 3, on_token=on_token, stop_fn=stop_fn)
    hook.remove()
    assert forward_modes and all(forward_modes)  # plain CPU params: the decode runs in inference mode
    assert modes and all(m == (False, False) for m in modes)
    assert not any(t.is_inference() for t in kept) and torch.equal(torch.stack(kept, 1), out[:, 4:])
    kept[0].add_(1)
    assert torch.equal(w.grad, torch.full((3,), 2.0 * len(kept)))
    assert torch.equal(out, generate(model, params, ids, 3))
    assert not out.is_inference() and out.shape == (1, 7)
    out[:, -1] = 0  # an inference tensor would raise here
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_decode_layout_twice_copies_nothing_and_needs_no_grad():
    """decode_layout on laid-out params keeps every tensor; on params that require grad it
    returns copies that need none (so the side-by-side groups still run as one matmul)."""
    from mff.generate import decode_layout

    for family in ("qwen3", "deepseek3"):
        model, params = _model(family)
        laid = decode_layout({k: torch.nn.Parameter(v) for k, v in params.items()})
        moved = [k for k in laid if not isinstance(laid[k], torch.nn.Parameter)]
        assert moved and not any(laid[k].requires_grad for k in moved)
        again = decode_layout(laid)
        assert all(again[k] is laid[k] for k in laid), [k for k in laid if again[k] is not laid[k]]


def test_linear_split_declines_what_f_linear_rejects_or_tracers_fix():
    """linear() takes the threaded split only where it is F.linear's equal: a bad input width
    or bias dtype raises F.linear's own error, and under torch.jit.trace or make_fx the traced
    graph has no views with fixed strides (replayed on another layout it stays right)."""
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from mff.nn.layers import linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(768, 384, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="cannot be multiplied"):
                linear(torch.randn(1, 385), w)
            with pytest.raises(RuntimeError):
                linear(torch.randn(1, 384), w, torch.zeros(768, dtype=torch.float64))
            x = torch.randn(384, generator=g)
            other = w.t().contiguous().t()
            traced = torch.jit.trace(lambda a, b: linear(a, b), (x, w), check_trace=False)
            assert (traced(x, other) - F.linear(x, other)).abs().max().item() <= 1e-4
            gm = make_fx(lambda a, b: linear(a, b), tracing_mode="real")(x, w)
            assert (gm(x, other) - F.linear(x, other)).abs().max().item() <= 1e-4
    finally:
        torch.set_num_threads(threads)
