"""Megatron data blends: the --data-path syntax, the blending order, per-dataset sample counts."""

from __future__ import annotations

import numpy as np
import pytest

from mff.data.blend import (
    Blend,
    BlendedDataset,
    build_blended_gpt_datasets,
    build_blending_indices,
    normalize_weights,
    parse_blend,
    samples_per_dataset,
)
from mff.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from tests.data_util import write_indexed


def _write(prefix, docs):
    write_indexed(prefix, docs)
    return str(prefix)


def test_parse_pairs_and_single_prefix():
    assert parse_blend("0.7 data/a 0.3 data/b") == Blend(("data/a", "data/b"), (0.7, 0.3))
    assert parse_blend(["30", "a", "70", "b"]) == Blend(("a", "b"), (30.0, 70.0))
    assert parse_blend("  data/only  ") == Blend(("data/only",), None)
    assert parse_blend("1 data/only") == Blend(("data/only",), (1.0,))


@pytest.mark.parametrize("spec,match", [
    ("", "empty"),
    ("a 0.3 b", "missing weight: token 1 'a' is not a number"),
    ("0.7 a b 0.3", "missing weight: token 3 'b' is not a number"),
    ("0.7 a 0.3", r"weight '0.3' \(token 3\) has no prefix after it \(odd number of tokens: 3\)"),
    ("0.5", r"weight '0.5' \(token 1\) has no prefix after it"),
    ("0 a 1 b", r"weight '0' \(token 1\) must be a finite number > 0"),
    ("1 a -2 b", r"weight '-2' \(token 3\) must be a finite number > 0"),
    ("nan a", r"weight 'nan' \(token 1\) must be a finite number > 0"),
    ("inf a", r"weight 'inf' \(token 1\) must be a finite number > 0"),
    ("0.5 0.5 b", r"token 2 '0.5' should be the prefix after weight '0.5', but it is a number"),
])
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_blend(spec)


def test_normalize_and_sample_counts():
    assert normalize_weights([1, 3]) == [0.25, 0.75]
    assert samples_per_dataset([0.25, 0.75], 100) == ([25, 75], [26, 76])
    assert samples_per_dataset([0.5, 0.5], 1) == ([1, 1], [2, 2])
    assert samples_per_dataset([0.3, 0.7], 1000) == ([300, 700], [302, 704])
    assert samples_per_dataset([0.5, 0.5], 0) == ([0, 0], [0, 0])


# Worked by hand: sample i goes to argmax_k w_k * max(i, 1) - count_k, ties to the lowest k.
@pytest.mark.parametrize("weights,size,order,nth", [
    # i=0: errors (.5, .5) tie -> 0; i=1: (-.5, .5) -> 1; i=2: (0, 0) -> 0; ...
    ([1, 1], 6, [0, 1, 0, 1, 0, 1], [0, 0, 1, 1, 2, 2]),
    # i=0: (.25, .75) -> 1; i=1: (.25, -.25) -> 0; i=2: (-.5, .5) -> 1; i=3: (-.25, .25) -> 1;
    # i=4: (0, 0) -> 0; i=5..7: dataset 1 lags by .75, .5, .25 -> 1
    ([1, 3], 8, [1, 0, 1, 1, 0, 1, 1, 1], [0, 0, 1, 2, 1, 3, 4, 5]),
    # i=0: (.25, .5, .25) -> 1; i=1: (.25, -.5, .25) -> 0; i=2: (-.5, 0, .5) -> 2;
    # i=3: (-.25, .5, -.25) -> 1; i=4: (0, 0, 0) -> 0; i=5: (-.75, .5, .25) -> 1
    ([1, 2, 1], 6, [1, 0, 2, 1, 0, 1], [0, 0, 0, 1, 1, 2]),
    # megatron-core 0.16.1 helpers_cpp.build_blending_indices; the first 4 worked by hand:
    # i=0: (.2, .5, .3) -> 1; i=1: (.2, -.5, .3) -> 2; i=2: (.4, 0, -.4) -> 0; i=3: (-.4, .5, -.1) -> 1
    ([0.2, 0.5, 0.3], 12, [1, 2, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1], [0, 0, 0, 1, 1, 2, 1, 3, 2, 4, 2, 5]),
    ([1, 1, 1], 9, [0, 1, 2] * 3, [0, 0, 0, 1, 1, 1, 2, 2, 2]),
    ([5], 3, [0, 0, 0], [0, 1, 2]),
])
def test_blending_order_by_hand(weights, size, order, nth):
    di, dsi = build_blending_indices(weights, size)
    assert di.tolist() == order and dsi.tolist() == nth
    assert di.dtype == np.int16 and dsi.dtype == np.int64


def test_blending_follows_weights():
    di, dsi = build_blending_indices([0.6, 0.3, 0.1], 10_000)
    assert np.bincount(di).tolist() == [6000, 3000, 1000]
    for k in range(3):
        assert dsi[di == k].tolist() == list(range(int(np.sum(di == k))))


def test_blending_bad_weights():
    with pytest.raises(ValueError, match="numbers > 0"):
        build_blending_indices([1, 0], 3)
    with pytest.raises(ValueError, match="numbers > 0"):
        build_blending_indices([], 3)


@pytest.fixture
def three(tmp_path):
    rng = np.random.default_rng(0)
    out = []
    for k, n in enumerate((3, 2, 4)):
        docs = [list(rng.integers(2, 50, size=int(rng.integers(1, 6)))) + [1] for _ in range(n)]
        out.append(_write(tmp_path / f"p{k}", docs))
    return out


def test_blended_samples_come_from_their_dataset(three):
    cfg = GPTDatasetConfig(seq_len=4, split="1,0,0", eod_id=1)
    train, valid, test = build_blended_gpt_datasets(f"0.5 {three[0]} 0.3 {three[1]} 0.2 {three[2]}", (20, None, None), cfg)
    assert valid is None and test is None
    assert isinstance(train, BlendedDataset) and len(train) == 10 + 6 + 4
    for i in range(len(train)):
        k, j = train.source(i)
        np.testing.assert_array_equal(train.tokens(i), train.datasets[k].tokens(j))
        assert train[i]["input_ids"].tolist() == train.datasets[k][j]["input_ids"].tolist()
    assert np.bincount(train.dataset_index).tolist() == [10, 6, 4]


@pytest.mark.parametrize("weights", [[1e-9, 1], [0.999999, 1e-6], [1, 1e-12, 1], [1e-6, 1e-9, 1e-12], [3, 1e-300]])
@pytest.mark.parametrize("n", [1, 2, 7, 60])
def test_extreme_weights_never_overrun(three, weights, n):
    spec = " ".join(f"{w!r} {p}" for w, p in zip(weights, three))
    train = build_blended_gpt_datasets(spec, (n, 0, 0), GPTDatasetConfig(seq_len=3, split="1,0,0"))[0]
    assert len(train) >= n
    for i in range(len(train)):
        assert train.tokens(i).shape == (4,)


def test_random_weights_never_overrun(three):
    rng = np.random.default_rng(1)
    for _ in range(20):
        w = rng.random(3) ** int(rng.integers(1, 15)) + 1e-15
        n = int(rng.integers(1, 120))
        train = build_blended_gpt_datasets(" ".join(f"{float(x)!r} {p}" for x, p in zip(w, three)), (n, 0, 0),
                                           GPTDatasetConfig(seq_len=2, split="1,0,0", cache=False))[0]
        for k, ds in enumerate(train.datasets):
            taken = train.dataset_sample_index[train.dataset_index == k]
            assert taken.size == 0 or taken.max() < len(ds)


def test_single_prefix_is_not_blended(three):
    train = build_blended_gpt_datasets(three[0], (5, None, None), GPTDatasetConfig(seq_len=2, split="1,0,0"))[0]
    assert isinstance(train, GPTDataset) and train.num_samples == 5


def test_weighted_split_needs_a_sample_count(three):
    with pytest.raises(ValueError, match="the train split needs a sample count"):
        build_blended_gpt_datasets(f"1 {three[0]} 1 {three[1]}", (None, None, None), GPTDatasetConfig(seq_len=2, split="1,0,0"))


def test_missing_prefix(three, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.idx does not exist"):
        build_blended_gpt_datasets(f"1 {three[0]} 1 {tmp_path / 'nope'}", (4, 0, 0), GPTDatasetConfig(seq_len=2))


def test_blended_dataset_checks_indices(three):
    ds = build_blended_gpt_datasets(three[0], (None, None, None), GPTDatasetConfig(seq_len=2, split="1,0,0"))[0]
    with pytest.raises(ValueError, match=f"dataset 0 has {len(ds)} samples but the blend asks for sample {len(ds)}"):
        BlendedDataset([ds], np.zeros(1, np.int16), np.array([len(ds)]))


def test_oversampled_dataset_is_rebuilt_bigger(three, tmp_path):
    # weights (1e-6, 1, 1e-6, 1e-6), 1 sample: targets (1, 1, 1, 1) -> 4 blended samples, of which
    # the heavy dataset takes 3, more than the 2 asked of it (ceil(1 * 1.005)). With one 5-token
    # document and seq_len 2 it holds exactly 2 (Megatron raises "the blend oversamples" here).
    big = _write(tmp_path / "big", [[7, 8, 9, 10, 1]])
    spec = f"1e-6 {three[0]} 1 {big} 1e-6 {three[1]} 1e-6 {three[2]}"
    train = build_blended_gpt_datasets(spec, (1, 0, 0), GPTDatasetConfig(seq_len=2, split="1,0,0", shuffle=False))[0]
    assert train.dataset_index.tolist() == [1, 0, 1, 1]  # i=1: the heavy one is 3e-6 ahead, dataset 0 lags 1e-6
    assert train.datasets[1].num_samples == 3 and len(train.datasets[1]) == 4
    assert [train.tokens(i).tolist() for i in (0, 2, 3)] == [[7, 8, 9], [9, 10, 1], [1, 7, 8]]
