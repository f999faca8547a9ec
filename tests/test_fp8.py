"""Block-scaled FP8 (DeepSeek-V3) checkpoint dequantisation: e4m3 decoding, block scales incl. partial edge
blocks, shape errors, cross-shard pairing, and the config's quantization_config."""

from __future__ import annotations

import re

import pytest
import torch

from mff.ckpt.fp8 import (
    Fp8Dequantizer,
    block_size_from_config,
    decode_e4m3,
    decode_e4m3_closed_form,
    dequantize_block_fp8,
    dequantize_tensors,
)

BLOCK = (128, 128)


def _ceil(a, b):
    return -(-a // b)


def _fp8_weight(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)


def _scales(rows, cols, block=BLOCK):
    """Distinct, non-power-of-two scale per block: scale_inv[i, j] = 2**(i - j) * (1 + (i * n_j + j) / 1024)."""
    n_i, n_j = _ceil(rows, block[0]), _ceil(cols, block[1])
    i = torch.arange(n_i, dtype=torch.float64)[:, None]
    j = torch.arange(n_j, dtype=torch.float64)[None, :]
    return (torch.exp2(i - j) * (1 + (i * n_j + j) / 1024)).to(torch.float32)


def _reference(w, s, block=BLOCK):
    """Plain loop over blocks: out[block (i, j)] = float(w[block (i, j)]) * s[i, j], in fp32."""
    w32 = w.float()
    out = torch.empty_like(w32)
    b0, b1 = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rs, cs = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            out[rs, cs] = w32[rs, cs] * s[i, j]
    return out


def test_decode_e4m3_known_bytes():
    raw = torch.tensor([0x38, 0x40, 0xB8, 0x7E, 0x01], dtype=torch.uint8)
    want = torch.tensor([1.0, 2.0, -1.0, 448.0, 2.0**-9])
    assert torch.equal(decode_e4m3(raw), want)
    assert torch.equal(decode_e4m3_closed_form(raw), want)
    assert decode_e4m3(raw).dtype == torch.float32


def test_decode_e4m3_all_bytes_match_closed_form():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    a, b = decode_e4m3(raw), decode_e4m3_closed_form(raw)
    nan = torch.isnan(b)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(a), nan) and torch.equal(a[~nan], b[~nan])
    assert b[~nan].abs().max() == 448.0


@pytest.mark.parametrize("rows, cols", [(576, 7168), (1000, 256)])
def test_dequantize_matches_block_loop(rows, cols):
    w, s = _fp8_weight(rows, cols, seed=rows), _scales(rows, cols)
    assert s.shape == (_ceil(rows, 128), _ceil(cols, 128))
    ref = _reference(w, s)
    out32 = dequantize_block_fp8(w, s, BLOCK, torch.float32)
    assert out32.dtype == torch.float32 and out32.shape == (rows, cols)
    assert torch.equal(out32, ref)
    out16 = dequantize_block_fp8(w, s, BLOCK)
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, ref.to(torch.bfloat16))
    # raw uint8 bytes give the same result
    assert torch.equal(dequantize_block_fp8(w.view(torch.uint8), s, [128, 128], torch.float32), ref)

    w32 = w.float()
    last_row_block, last_col_block = s.shape[0] - 1, s.shape[1] - 1
    tail = slice(last_row_block * 128, rows)  # the last (possibly partial) row block
    last_cols = slice(last_col_block * 128, cols)
    assert torch.equal(out32[tail, last_cols], w32[tail, last_cols] * s[last_row_block, last_col_block])
    assert torch.equal(out32[tail, :128], w32[tail, :128] * s[last_row_block, 0])
    nonzero = w32[tail, :128] != 0
    assert nonzero.any() and not torch.equal(out32[tail, :128][nonzero], (w32[tail, :128] * s[last_row_block - 1, 0])[nonzero])


def test_edge_blocks_explicit():
    # 576 x 7168: 5 scale rows (rows 512..575 use row 4, a 64-row partial block), 56 exact column blocks
    w, s = _fp8_weight(576, 7168, seed=1), _scales(576, 7168)
    assert s.shape == (5, 56)
    out = dequantize_block_fp8(w, s, BLOCK, torch.float32)
    w32 = w.float()
    for j in (0, 27, 55):
        cs = slice(j * 128, (j + 1) * 128)
        assert torch.equal(out[512:576, cs], w32[512:576, cs] * s[4, j])
        assert torch.equal(out[384:512, cs], w32[384:512, cs] * s[3, j])
    assert torch.equal(out[:, 7040:7168], w32[:, 7040:7168] * s.repeat_interleave(128, 0)[:576, 55:56])

    # 1000 x 256: 8 scale rows (rows 896..999 use row 7, a 104-row partial block), 2 column blocks
    w, s = _fp8_weight(1000, 256, seed=2), _scales(1000, 256)
    assert s.shape == (8, 2)
    out = dequantize_block_fp8(w, s, BLOCK, torch.float32)
    w32 = w.float()
    assert torch.equal(out[896:1000, :128], w32[896:1000, :128] * s[7, 0])
    assert torch.equal(out[896:1000, 128:], w32[896:1000, 128:] * s[7, 1])
    assert torch.equal(out[768:896, 128:], w32[768:896, 128:] * s[6, 1])


def test_partial_column_block():
    w, s = _fp8_weight(130, 200, seed=3), _scales(130, 200)
    assert s.shape == (2, 2)
    assert torch.equal(dequantize_block_fp8(w, s, BLOCK, torch.float32), _reference(w, s))


def test_wrong_scale_shape_names_both_shapes():
    w = _fp8_weight(576, 256, seed=4)
    with pytest.raises(ValueError, match=re.escape("(4, 2)")) as e:
        dequantize_block_fp8(w, torch.ones(4, 2), BLOCK, name="model.layers.0.self_attn.q_a_proj.weight")
    assert "(5, 2)" in str(e.value) and "model.layers.0.self_attn.q_a_proj.weight" in str(e.value)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_block_fp8(torch.ones(4, 4), torch.ones(1, 1), BLOCK)


def test_dequantize_tensors_single_mapping():
    w, s = _fp8_weight(256, 384, seed=5), _scales(256, 384)
    norm = torch.randn(384)
    ids = torch.arange(5)
    out = dequantize_tensors({"a.weight": w, "a.weight_scale_inv": s, "norm.weight": norm, "ids": ids}, BLOCK, torch.bfloat16)
    assert list(out) == ["a.weight", "norm.weight", "ids"]
    assert torch.equal(out["a.weight"], _reference(w, s).to(torch.bfloat16))
    assert out["norm.weight"].dtype == torch.bfloat16 and torch.equal(out["norm.weight"], norm.to(torch.bfloat16))
    assert out["ids"] is ids


def test_fp8_weight_without_scale_and_orphan_scale_error():
    w = _fp8_weight(128, 128, seed=6)
    with pytest.raises(ValueError, match=r"FP8 weights without .*'lonely\.weight'"):
        dequantize_tensors({"lonely.weight": w, "x.bias": torch.zeros(3)}, BLOCK)
    with pytest.raises(ValueError, match=r"scales without their weight: \['ghost\.weight_scale_inv'\]"):
        dequantize_tensors({"ghost.weight_scale_inv": torch.ones(1, 1)}, BLOCK)


@pytest.mark.parametrize("order", ["weight_first", "scale_first"])
def test_dequantizer_pairs_across_shards(order):
    wa, sa = _fp8_weight(200, 300, seed=7), _scales(200, 300)
    wb, sb = _fp8_weight(128, 64, seed=8), _scales(128, 64)
    norm = torch.randn(300)
    shard1 = {"a.weight": wa, "b.weight_scale_inv": sb, "norm.weight": norm}
    shard2 = {"a.weight_scale_inv": sa, "b.weight": wb}
    shards = [shard1, shard2] if order == "weight_first" else [shard2, shard1]
    deq = Fp8Dequantizer([128, 128], torch.float32)
    got = {}
    for shard in shards:
        for name, t in shard.items():
            ready = deq.add(name, t)
            assert all(not n.endswith("_scale_inv") for n, _ in ready)
            got.update(ready)
        if shard is shards[0]:
            assert ("norm.weight" in got) == (shard is shard1) and "a.weight" not in got and "b.weight" not in got
            assert len(deq.pending) == 2
    deq.finish()
    assert deq.pending == []
    assert sorted(got) == ["a.weight", "b.weight", "norm.weight"]
    assert torch.equal(got["a.weight"], _reference(wa, sa))
    assert torch.equal(got["b.weight"], _reference(wb, sb))


def test_dequantizer_finish_reports_unmatched():
    deq = Fp8Dequantizer(BLOCK)
    assert deq.add("a.weight", _fp8_weight(128, 128, seed=9)) == []
    assert deq.add("b.weight_scale_inv", torch.ones(1, 1)) == []
    with pytest.raises(ValueError) as e:
        deq.finish()
    assert "'a.weight'" in str(e.value) and "'b.weight_scale_inv'" in str(e.value)


def test_dequantizer_rejects_duplicates_and_scale_for_unquantised_weight():
    deq = Fp8Dequantizer(BLOCK)
    deq.add("n.weight", torch.ones(4))
    with pytest.raises(ValueError, match="added twice"):
        deq.add("n.weight", torch.ones(4))
    with pytest.raises(ValueError, match="not FP8"):
        deq.add("n.weight_scale_inv", torch.ones(1, 1))


def test_block_size_from_config():
    deepseek_v3 = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    assert block_size_from_config(deepseek_v3) == (128, 128)
    assert block_size_from_config({"model_type": "deepseek_v3", "hidden_size": 7168}) is None
    assert block_size_from_config({"quantization_config": None}) is None
    with pytest.raises(ValueError, match="'gptq'"):
        block_size_from_config({"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="'e5m2'"):
        block_size_from_config({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}})
    for bad in ([128], [128, 0], [128.0, 128], "128x128"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            block_size_from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": bad}})
    with pytest.raises(ValueError, match="no weight_block_size"):
        block_size_from_config({"quantization_config": {"quant_method": "fp8"}})
