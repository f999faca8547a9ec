"""Issue 15, acceptance 4 and the scoring engine: rolling windows score every position once; with a
model whose prediction depends on the current token only, 10 tokens in windows of 4 (stride 4)
give exactly one full forward's token log-probabilities; a rolling score of a sequence longer
than the model's context equals a plain per-position loop (and lm-eval's own window function);
batched, shared-context continuation scores equal one full forward per pair, for dense, MoE
and MLA models, with contexts cut from the left past the model's length."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mff
from mff.eval.lm import LanguageModel
from mff.eval.scoring import ScoreOptions, score_continuations
from mff.eval.tokens import rolling_windows, window_requests
from tests.sft_util import TINY


def _model(family: str = "qwen3", seed: int = 0, **kw):
    cfg = dataclasses.replace(mff.build(family).config, **{**TINY[family], "vocab_size": 97, "max_position_embeddings": 32, **kw})
    model = mff.build(family, cfg)
    params = model.init(seed)
    gen = torch.Generator().manual_seed(seed)
    for k, v in params.items():  # O(1) weights: the log-probabilities are far from uniform
        if v.dim() >= 2 and "norm" not in k:
            params[k] = torch.randn(v.shape, generator=gen) * (1.5 / v.shape[-1] ** 0.5)
    return model, params


@torch.no_grad()
def _token_logprobs(model, params, ids):
    """log p(ids[t] | ids[:t]) for t = 1 .. len-1, from one full forward."""
    logits = model.forward(params, {"input_ids": torch.tensor([ids])}).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 11, 33])
@pytest.mark.parametrize("window", [1, 2, 4, 8])
def test_rolling_windows_score_each_position_once(n, window):
    for stride in range(1, window + 1):
        wins = rolling_windows(n, window, stride)
        scored = [t for _, last, first in wins for t in range(first, last + 1)]
        assert scored == list(range(1, n)), (n, window, stride)
        for begin, last, first in wins:
            assert last - begin <= window and begin < first  # fits the window, at least one token of context


def test_ten_tokens_window_four_equal_one_full_forward():
    assert rolling_windows(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (5, 9, 9)]
    model, params = _model()
    params["model.layers.0.self_attn.o_proj.weight"].zero_()  # no attention: each prediction sees its own token only
    params["model.layers.1.self_attn.o_proj.weight"].zero_()
    ids = [int(x) for x in torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(1))]
    full = _token_logprobs(model, params, ids)
    pairs = window_requests(ids, 4, 4)
    assert [len(c) for _, c in pairs] == [4, 4, 1]
    scores, _ = score_continuations(model, params, pairs, ScoreOptions(batch_size=2))
    assert [s for s, _ in scores] == pytest.approx([sum(full[0:4]), sum(full[4:8]), full[8]], abs=1e-5)


@torch.no_grad()
def _plain_rolling(model, params, ids, window, stride):
    """Position by position: target t belongs to chunk c (1..window, then stride at a time); it is
    predicted from up to ``window`` tokens ending before the chunk's last target."""
    total, n = 0.0, len(ids)
    for t in range(1, n):
        c = 0 if t <= window else 1 + (t - window - 1) // stride
        last = min(window + c * stride, n - 1)
        start = max(0, last - window)
        lp = torch.log_softmax(model.forward(params, {"input_ids": torch.tensor([ids[start:last]])}).logits[0].float(), -1)
        total += float(lp[t - 1 - start, ids[t]])
    return total


@pytest.mark.parametrize("window,stride", [(32, 32), (32, 9), (7, 7)])
def test_rolling_longer_than_context_equals_plain_loop(window, stride):
    model, params = _model()
    lm = LanguageModel(model, params, tokenizer=None, batch_size=3)  # type: ignore[arg-type]
    rng = random.Random(window + stride)
    seqs = [[rng.randrange(97) for _ in range(n)] for n in (80, 33, 2, 5)]
    got = lm.rolling_ids(seqs, window=window, stride=stride)
    assert got == pytest.approx([_plain_rolling(model, params, s, window, stride) for s in seqs], abs=1e-4)


def test_windows_match_lm_eval_rolling():
    utils = pytest.importorskip("lm_eval.utils")
    rng = random.Random(0)
    for n in (1, 5, 31, 32, 33, 64, 100):
        tokens = [rng.randrange(1, 97) for _ in range(n)]
        theirs = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(tokens, 0, 32, 1)]
        ours = window_requests([0] + tokens, 32, 32)
        assert ours == [(list(a), list(b)) for a, b in theirs], n


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek3"])
def test_shared_context_scores_equal_one_forward_per_pair(family):
    model, params = _model(family)
    rng = random.Random(1)
    contexts = [[rng.randrange(97) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    pairs = [(c, [rng.randrange(97) for _ in range(rng.randint(1, 6))]) for c in contexts for _ in range(rng.randint(1, 4))]
    rng.shuffle(pairs)
    pairs.append((contexts[0], [int(torch.log_softmax(model.forward(params, {"input_ids": torch.tensor([contexts[0]])}).logits[0, -1], -1)
                                    .argmax())]))  # a greedy one-token continuation
    want = [sum(_token_logprobs(model, params, c + x)[len(c) - 1:]) for c, x in pairs]
    for bs in (1, 3, 64):
        got, cut = score_continuations(model, params, pairs, ScoreOptions(batch_size=bs))
        assert cut == 0
        assert [s for s, _ in got] == pytest.approx(want, abs=1e-4), bs
        assert got[-1][1] is True


def test_long_requests_keep_their_last_tokens():
    model, params = _model()
    rng = random.Random(2)
    pairs = [([rng.randrange(97) for _ in range(40)], [rng.randrange(97) for _ in range(3)]),
             ([5], [rng.randrange(97) for _ in range(40)]), ([1, 2], [3])]
    got, cut = score_continuations(model, params, pairs, ScoreOptions(batch_size=4, max_length=16))
    assert cut == 2
    first = (pairs[0][0] + pairs[0][1])[-17:]
    assert got[0][0] == pytest.approx(sum(_token_logprobs(model, params, first)[-3:]), abs=1e-4)
    second = (pairs[1][0] + pairs[1][1])[-17:]
    assert got[1][0] == pytest.approx(sum(_token_logprobs(model, params, second)[-16:]), abs=1e-4)
    assert got[2][0] == pytest.approx(_token_logprobs(model, params, [1, 2, 3])[-1], abs=1e-4)


def test_bad_pairs_are_named():
    model, params = _model()
    with pytest.raises(ValueError, match="request 1: empty continuation"):
        score_continuations(model, params, [([1], [2]), ([1], [])])
    with pytest.raises(ValueError, match="token id 500 outside the vocabulary"):
        score_continuations(model, params, [([1], [500])])
    with pytest.raises(ValueError, match="batch_size=0"):
        score_continuations(model, params, [([1], [2])], ScoreOptions(batch_size=0))
