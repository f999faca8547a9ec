"""The blockwise causal attention that CPU training runs (mff.nn.block_attention): against a
per-query-row loop in float64, finite differences, the flash kernel's error in bf16, under
torch.compile, and where causal_attention takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mff.nn.attention import causal_attention, cpu_block_attention
from mff.nn.block_attention import MAX_TOKENS, causal_attention_blocks, probs_numel


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _loop_reference(q_BTHD, k_BTKD, v_BTKE, scale):
    """Causal attention one query row at a time: query t of head h sees keys 0..t of KV head
    h // (H / K)."""
    B, T, H, _ = q_BTHD.shape
    rep = H // k_BTKD.shape[2]
    rows = []
    for t in range(T):
        heads = []
        for h in range(H):
            s = (k_BTKD[:, :t + 1, h // rep] @ q_BTHD[:, t, h, :, None])[..., 0] * scale  # [B, t + 1]
            heads.append((torch.softmax(s, -1)[:, None] @ v_BTKE[:, :t + 1, h // rep])[:, 0])  # [B, E]
        rows.append(torch.stack(heads, 1))
    return torch.stack(rows, 1)  # [B, T, H, E]


@pytest.mark.parametrize("T", [1, 5, 64, 65, 130, 512])
@pytest.mark.parametrize("block", [7, 64])
def test_packed_probabilities_size_is_the_sum_over_blocks(T, block):
    assert probs_numel(3, T, block) == 3 * sum((min(s + block, T) - s) * min(s + block, T) for s in range(0, T, block))


def test_a_block_longer_than_the_sequence_is_one_block():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 5, 3, generator=g) for _ in range(3))
    o, p = causal_attention_blocks(q, k, v, 0.5, 8000)
    o5, p5 = causal_attention_blocks(q, k, v, 0.5, 5)
    assert torch.equal(o, o5) and torch.equal(p, p5) and p.numel() == probs_numel(2, 5, 8000)


@pytest.mark.parametrize("T", [1, 5, 13])
def test_gradients_match_finite_differences(T):
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(2, T, 6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, T, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: causal_attention_blocks(q, k, v, 0.4, 4)[0], (q, k, v))


@pytest.mark.parametrize("H,K,D,E", [(4, 2, 16, 16), (4, 4, 24, 16)])  # GQA; MLA-like (narrower values)
def test_training_attention_on_cpu_is_the_blockwise_op_and_matches_a_row_loop(H, K, D, E):
    g = torch.Generator().manual_seed(0)
    B, T = 2, 150  # 3 blocks of 64, the last one partial
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, T, K, D, generator=g, requires_grad=True)
    v = torch.randn(B, T, K, E, generator=g, requires_grad=True)
    dout = torch.randn(B, T, H, E, generator=g)
    with _Ops() as seen:
        out = causal_attention(q, k, v, D ** -0.5)
        out.backward(dout)
    assert "mff.causal_attention.default" in seen.names and "mff.causal_attention_backward.default" in seen.names
    assert not any("flash" in n for n in seen.names)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _loop_reference(q64, k64, v64, D ** -0.5)
    ref.backward(dout.double())
    torch.testing.assert_close(out, ref.float(), rtol=0, atol=2e-6)
    for got, want in zip((q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)


def test_bf16_error_stays_within_2_5_times_the_flash_kernels():
    """Scores in fp32 (bf16 products, fp32 sums, as the flash kernel forms them): the error of
    output and grads against float64 is within 2.5x the flash kernel's on the same inputs (it is
    larger because the stored probabilities and dS are rounded to bf16: 2.26x here; a plain
    attention with its scores rounded to bf16 too is at 2.83x)."""
    g = torch.Generator().manual_seed(1)
    N, T, D, E = 8, 256, 32, 32
    q, k = (torch.randn(N, T, D, generator=g).bfloat16() for _ in range(2))
    v, dout = (torch.randn(N, T, E, generator=g).bfloat16() for _ in range(2))

    def run(fn, dtype):
        x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]  # fresh leaves for every run
        out = fn(*x)
        out.backward(dout.to(dtype))
        return [out, *(t.grad for t in x)]

    flash = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    ref = run(flash, torch.float64)
    err = lambda got: max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
    e_blocks = err(run(lambda q, k, v: causal_attention_blocks(q, k, v, 0.2, 64)[0], torch.bfloat16))
    e_flash = err(run(flash, torch.bfloat16))
    assert 1e-4 < e_flash < 1e-2 and e_blocks <= 2.5 * e_flash, (e_blocks, e_flash)


def test_autocast_func_transforms_and_broadcast_batches_keep_sdpa():
    """Where SDPA has rules the op lacks: autocast (it casts SDPA's inputs to one dtype),
    ``torch.func.grad`` (the op has no functorch rule), k/v broadcast over the batch. Each still
    computes, through SDPA."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 70, 2, 8, generator=g, requires_grad=True) for _ in range(3))
    with _Ops() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention(q, k, v.bfloat16(), 0.3)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and not any(n.startswith("mff.causal_attention") for n in seen.names)
    grad_q = torch.func.grad(lambda q: causal_attention(q, k, v, 0.3).sum())(q.detach())
    want = torch.autograd.grad(causal_attention(q, k, v, 0.3).sum(), q)[0]
    torch.testing.assert_close(grad_q, want, rtol=0, atol=1e-5)
    with _Ops() as seen:
        causal_attention(q, k[:1], v[:1], 0.3).sum().backward()  # k/v batch 1, broadcast by SDPA
    assert not any(n.startswith("mff.causal_attention") for n in seen.names)


def test_inference_long_sequences_and_the_switch_keep_the_flash_kernel():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 70, 2, 8, generator=g) for _ in range(3))
    with _Ops() as seen, torch.no_grad():
        causal_attention(q.requires_grad_(), k, v, 0.3)
    assert not any(n.startswith("mff.causal_attention") for n in seen.names)
    with _Ops() as seen, cpu_block_attention(False):
        causal_attention(q, k, v, 0.3).sum().backward()
    assert not any(n.startswith("mff.causal_attention") for n in seen.names)
    with _Ops() as seen:  # the switch is back on after the block
        causal_attention(q, k, v, 0.3).sum().backward()
    assert "mff.causal_attention.default" in seen.names
    q, k, v = (torch.randn(1, MAX_TOKENS + 1, 1, 4, generator=g, requires_grad=True) for _ in range(3))
    with _Ops() as seen:  # longer sequences: the flash kernel
        causal_attention(q, k, v, 0.3).sum().backward()
    assert not any(n.startswith("mff.causal_attention") for n in seen.names)
    with _Ops() as seen:
        causal_attention(q[:, :MAX_TOKENS], k[:, :MAX_TOKENS], v[:, :MAX_TOKENS], 0.3).sum().backward()
    assert "mff.causal_attention.default" in seen.names
    with pytest.raises(TypeError, match="enabled=1; expected True or False"):
        with cpu_block_attention(1):
            pass


def test_saves_its_inputs_output_and_the_probabilities_only():
    g = torch.Generator().manual_seed(3)
    N, T, D, E = 3, 100, 8, 4
    q, k = (torch.randn(N, T, D, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(N, T, E, generator=g, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_attention_blocks(q, k, v, 0.5, 64)
    assert sum(saved.values()) == 4 * (2 * N * T * D + 2 * N * T * E + probs_numel(N, T, 64))


def test_compiled_grads_equal_eager():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 96, 4, 16, generator=g) for _ in range(3))

    def f(q, k, v):
        return (causal_attention(q, k, v, 0.25) ** 2).sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*x).backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_bad_shapes_and_dtypes_are_named():
    q = torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match=r"q \(2, 8, 4\), k \(2, 7, 4\)"):
        causal_attention_blocks(q, torch.randn(2, 7, 4), torch.randn(2, 8, 4), 1.0, 4)
    with pytest.raises(ValueError, match="torch.float32, torch.float32, torch.bfloat16: expected one floating dtype"):
        causal_attention_blocks(q, q, q.bfloat16(), 1.0, 4)
    with pytest.raises(ValueError, match="must be"):
        causal_attention_blocks(q[0], q[0], q[0], 1.0, 4)
    with pytest.raises(ValueError, match="block=0"):
        causal_attention_blocks(q, q, q, 1.0, 0)
