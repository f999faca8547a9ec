"""Token sampling: exact boundary cases, HF transformers' logits warpers as the reference, and sampling checks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mff.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    filter_logits,
    mark_seen,
    min_p_mask,
    sample,
    seen_mask_from_ids,
    top_k_mask,
    top_p_mask,
)


def kept(mask: torch.Tensor) -> set[int]:
    """Indices kept in a 1-row mask or a 1-row filtered-logits tensor."""
    row = mask[0] if mask.dtype == torch.bool else torch.isfinite(mask[0])
    return set(torch.nonzero(row).flatten().tolist())


# ---------------------------------------------------------------- exact boundaries


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p,expected", [(0.75, {0, 1}), (0.70, {0, 1}), (0.5, {0}), (1e-9, {0})])
def test_top_p_exact_boundaries(p, expected, dtype):
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=dtype)
    assert kept(top_p_mask(probs, p)) == expected
    # the same through filter_logits (softmax of log-probs of a dyadic distribution)
    assert kept(filter_logits(probs.log(), SamplingConfig(top_p=p))) == expected


def test_top_p_one_keeps_all_and_top_token_always_kept():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    assert top_p_mask(probs, 1.0).all()
    m = top_p_mask(probs, 1e-12)
    assert m.sum(-1).tolist() == [1, 1] and m[0, 0] and m[1, 3]
    # ties in probability are ordered by index: the lower index is kept
    assert kept(top_p_mask(torch.tensor([[0.25, 0.25, 0.25, 0.25]], dtype=torch.float64), 0.5)) == {0, 1}


def test_top_p_after_top_k_on_renormalised_distribution():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64).log()
    # after top-k 2 the distribution is [0.4, 0.3] / 0.7; 0.4 / 0.7 = 0.571 >= 0.5 -> only token 0
    assert kept(filter_logits(logits, SamplingConfig(top_k=2, top_p=0.5))) == {0}
    # without top-k, 0.4 < 0.5 so the nucleus needs token 1 as well
    assert kept(filter_logits(logits, SamplingConfig(top_p=0.5))) == {0, 1}


def test_repetition_penalty_ctrl_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]
    assert logits.tolist() == [[2.0, -2.0, 1.0]]  # not modified in place
    assert apply_repetition_penalty(logits, seen, 1.0).equal(logits)
    assert filter_logits(logits, SamplingConfig(repetition_penalty=2.0), seen_mask=seen).tolist() == [[1.0, -4.0, 1.0]]


def test_top_k_ties_keep_exactly_k():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0]])
    m = top_k_mask(logits, 2)
    assert m.sum(-1).tolist() == [2, 2]
    assert m[0, 3].item() is False and kept(m[1:]) == {1, 2}
    assert top_k_mask(logits, 0).all() and top_k_mask(logits, 4).all() and top_k_mask(logits, 100).all()
    with pytest.raises(ValueError, match="top_k"):
        top_k_mask(logits, -1)


def test_min_p():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]], dtype=torch.float64)
    assert kept(min_p_mask(probs, 0.2)) == {0, 1, 2}  # threshold 0.1, inclusive
    assert kept(min_p_mask(probs, 0.21)) == {0, 1}
    assert kept(min_p_mask(probs, 0.99)) == {0}
    assert min_p_mask(probs, 0.0).all()
    # scale-free: unnormalised input gives the same mask
    assert min_p_mask(probs * 7, 0.2).equal(min_p_mask(probs, 0.2))
    assert kept(filter_logits(probs.log(), SamplingConfig(min_p=0.2))) == {0, 1, 2}


def test_seen_mask_helpers():
    ids = torch.tensor([[0, 2, 2, -1], [5, 1, 7, 3]])
    seen = seen_mask_from_ids(ids, 6)  # -1 (padding) and 7 (>= vocab) are ignored
    assert seen.tolist() == [[True, False, True, False, False, False], [False, True, False, True, False, True]]
    seen2 = mark_seen(seen, torch.tensor([4, 0]))
    assert seen2[0, 4] and seen2[1, 0] and not seen[0, 4]
    assert (seen2 & ~seen).sum() == 2


# ---------------------------------------------------------------- HF reference


@pytest.mark.parametrize("seed", range(4))
def test_single_filters_match_hf(seed):
    g = torch.Generator().manual_seed(seed)
    B, V = 8, 257
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (B, 20), generator=g)
    dummy = torch.zeros(B, 1, dtype=torch.long)
    for k in (1, 5, 40, V, V + 3):
        ref = TopKLogitsWarper(k)(dummy, logits.clone())
        torch.testing.assert_close(filter_logits(logits, SamplingConfig(top_k=k)), ref, rtol=0, atol=0)
    for p in (0.05, 0.3, 0.9, 0.999):
        ref = TopPLogitsWarper(p)(dummy, logits.clone())
        torch.testing.assert_close(filter_logits(logits, SamplingConfig(top_p=p)), ref, rtol=0, atol=0)
    for m in (0.01, 0.1, 0.5, 0.95):
        ref = MinPLogitsWarper(m)(dummy, logits.clone())
        torch.testing.assert_close(filter_logits(logits, SamplingConfig(min_p=m)), ref, rtol=0, atol=0)
    for pen in (0.7, 1.3, 2.0):
        ref = RepetitionPenaltyLogitsProcessor(pen)(ids, logits.clone())
        torch.testing.assert_close(apply_repetition_penalty(logits, seen_mask_from_ids(ids, V), pen), ref, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(6))
def test_full_chain_matches_hf(seed):
    g = torch.Generator().manual_seed(100 + seed)
    B, V = 6, 300
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, 30), generator=g)
    r = torch.rand(5, generator=g, dtype=torch.float64).tolist()
    cfg = SamplingConfig(
        temperature=0.3 + 1.5 * r[0],
        top_k=int(5 + r[1] * 100),
        top_p=0.2 + 0.79 * r[2],
        min_p=0.3 * r[3],
        repetition_penalty=0.8 + r[4],
    )
    procs = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty),
        TemperatureLogitsWarper(cfg.temperature),
        TopKLogitsWarper(cfg.top_k),
        TopPLogitsWarper(cfg.top_p),
        MinPLogitsWarper(cfg.min_p),
    ])
    ref = procs(ids, logits.clone())
    out = filter_logits(logits, cfg, seen_mask=seen_mask_from_ids(ids, V))
    assert torch.isfinite(out).equal(torch.isfinite(ref))
    torch.testing.assert_close(out, ref)


# ---------------------------------------------------------------- sampling


def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g)
    cfg = SamplingConfig(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1)
    state = g.get_state()
    assert sample(logits, cfg, generator=g).equal(logits.argmax(-1))
    assert g.get_state().equal(state)  # greedy draws no random numbers
    out = sample(logits, cfg)
    assert out.dtype == torch.int64 and out.shape == (16,)
    # greedy takes the argmax of the penalised logits
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    seen = torch.tensor([[True, False, False]])
    assert sample(logits, SamplingConfig(temperature=0.0, repetition_penalty=2.0), seen_mask=seen).tolist() == [1]
    assert kept(filter_logits(logits, SamplingConfig(temperature=0.0, repetition_penalty=2.0), seen_mask=seen)) == {1}


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=1.2, top_p=0.95)
    a = [sample(logits, cfg, generator=g) for g in [torch.Generator().manual_seed(7)] for _ in range(5)]
    b = [sample(logits, cfg, generator=g) for g in [torch.Generator().manual_seed(7)] for _ in range(5)]
    c = [sample(logits, cfg, generator=g) for g in [torch.Generator().manual_seed(8)] for _ in range(5)]
    assert all(x.equal(y) for x, y in zip(a, b))
    assert not all(x.equal(y) for x, y in zip(a, c))
    assert all(x.dtype == torch.int64 and x.shape == (32,) for x in a)


def test_sampled_tokens_stay_in_kept_set():
    g = torch.Generator().manual_seed(1)
    B, V = 64, 50
    logits = torch.randn(B, V, generator=g) * 2
    seen = seen_mask_from_ids(torch.randint(0, V, (B, 10), generator=g), V)
    for cfg in [
        SamplingConfig(top_k=5),
        SamplingConfig(top_p=0.6),
        SamplingConfig(min_p=0.2),
        SamplingConfig(temperature=2.0, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.5),
    ]:
        keep = torch.isfinite(filter_logits(logits, cfg, seen_mask=seen))
        hits = torch.zeros(B, V, dtype=torch.bool)
        for _ in range(200):
            tok = sample(logits, cfg, generator=g, seen_mask=seen)
            assert keep.gather(1, tok[:, None]).all(), cfg
            hits[torch.arange(B), tok] = True
        assert (hits & ~keep).sum() == 0
        assert hits.sum() > B  # it does sample more than the top token


def test_sampling_frequencies_match_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    cfg = SamplingConfig(temperature=0.8, top_k=5, top_p=0.95)
    n = 40000
    rows = logits.expand(n, -1)
    probs = torch.softmax(filter_logits(logits[None], cfg), -1)[0]
    tok = sample(rows, cfg, generator=torch.Generator().manual_seed(3))
    freq = torch.bincount(tok, minlength=6).double() / n
    assert freq[probs == 0].sum() == 0
    torch.testing.assert_close(freq, probs.double(), atol=0.012, rtol=0)  # ~5 sigma at p = 0.5


def test_batch_rows_are_independent():
    g = torch.Generator().manual_seed(2)
    peaked = torch.tensor([8.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    flat = torch.zeros(6)
    two = torch.tensor([3.0, 3.0, -5.0, -5.0, -5.0, -5.0])
    logits = torch.stack([peaked, flat, two])
    cfg = SamplingConfig(top_p=0.9)
    batched = filter_logits(logits, cfg)
    for i in range(3):
        torch.testing.assert_close(batched[i : i + 1], filter_logits(logits[i : i + 1], cfg), rtol=0, atol=0)
    assert torch.isfinite(batched).sum(-1).tolist() == [1, 6, 2]
    probs = torch.softmax(logits.double(), -1)
    assert top_p_mask(probs, 0.9).sum(-1).tolist() == [1, 6, 2]
    hits = torch.zeros(3, 6, dtype=torch.bool)
    for _ in range(300):
        tok = sample(logits, cfg, generator=g)
        hits[torch.arange(3), tok] = True
    assert hits.equal(torch.isfinite(batched))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_no_nan_when_all_but_one_filtered(dtype):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(8, 64, generator=g) * 5).to(dtype)
    only_one = torch.full((2, 64), float("-inf"), dtype=dtype)
    only_one[0, 7] = 1.0
    only_one[1, 63] = -30.0
    for x, cfg in [
        (logits, SamplingConfig(top_k=1)),
        (logits, SamplingConfig(top_p=1e-9)),
        (logits, SamplingConfig(min_p=0.999999, temperature=0.05)),
        (only_one, SamplingConfig(top_p=0.5, top_k=3, min_p=0.5)),
        (only_one, SamplingConfig()),
    ]:
        out = filter_logits(x, cfg)
        assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert not out.isnan().any()
        probs = torch.softmax(out, -1)
        assert not probs.isnan().any()
        tok = sample(x, cfg, generator=g)
        assert tok.equal(x.float().argmax(-1)), cfg
    assert sample(only_one, SamplingConfig()).tolist() == [7, 63]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.2),
        ("top_p", float("nan")),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("min_p", float("inf")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", 1e-320),  # underflows to 0 in fp32: the penalised logits would be inf
        ("repetition_penalty", 5e-5),
        ("repetition_penalty", 2e4),
    ],
)
def test_validate_errors(field, value):
    cfg = SamplingConfig(**{field: value})
    with pytest.raises(ValueError, match=field) as err:
        cfg.validate()
    assert repr(value) in str(err.value)
    with pytest.raises(ValueError, match=field):
        sample(torch.zeros(1, 4), cfg)


def test_validate_accepts_bounds():
    for cfg in [
        SamplingConfig(),
        SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
        SamplingConfig(temperature=5.0, top_k=1, top_p=1e-6, min_p=0.999, repetition_penalty=1e-3),
    ]:
        cfg.validate()


def test_temperatures_too_small_for_fp32_are_greedy():
    """A positive temperature below 1e-5 (down to ones that underflow in fp32) decodes greedily,
    like 0, instead of dividing the logits into inf/nan; 1e-5 itself still samples."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    for t in (0.0, 1e-39, 1e-320, 9.9e-6):
        cfg = SamplingConfig(temperature=t)
        assert cfg.greedy
        assert torch.equal(sample(logits, cfg, torch.Generator().manual_seed(1)), logits.argmax(-1)), t
    assert not SamplingConfig(temperature=1e-5).greedy
    assert torch.isfinite(filter_logits(logits, SamplingConfig(temperature=1e-5)).softmax(-1)).all()


def test_shape_errors():
    with pytest.raises(ValueError, match="2-D"):
        sample(torch.zeros(4), SamplingConfig())
    with pytest.raises(ValueError, match="seen_mask"):
        filter_logits(torch.zeros(2, 4), SamplingConfig(), seen_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="seen_mask"):
        filter_logits(torch.zeros(2, 4), SamplingConfig(), seen_mask=torch.zeros(2, 4))


def test_compiles_without_graph_breaks():
    """fullgraph=True fails on any graph break, e.g. a .item() / .tolist() host sync."""
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2)

    def step(logits, seen):
        tok = sample(logits, cfg, seen_mask=seen)
        return tok, mark_seen(seen, tok)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    seen = seen_mask_from_ids(torch.randint(0, 100, (3, 5)), 100)
    torch.manual_seed(11)
    tok, seen2 = compiled(logits, seen)
    torch.manual_seed(11)
    tok_b, _ = compiled(logits, seen)
    assert tok.equal(tok_b) and tok.dtype == torch.int64
    assert torch.isfinite(filter_logits(logits, cfg, seen_mask=seen)).gather(1, tok[:, None]).all()
    assert seen2.gather(1, tok[:, None]).all()
    assert math.isclose(float(torch.softmax(filter_logits(logits, cfg, seen), -1).sum(-1).mean()), 1.0, rel_tol=1e-6)
