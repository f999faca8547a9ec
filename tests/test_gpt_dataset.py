"""Megatron GPT samples: splits, document/sample/shuffle indices, per-sample options, index cache."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from mff.data import gpt_dataset as gd
from mff.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    build_gpt_datasets,
    build_indices,
    build_sample_index,
    num_epochs_for,
    parse_split,
    split_ranges,
)
from tests.data_util import write_indexed

STREAM_DOCS = [[10, 11, 99], [20, 21, 99], [30, 31, 32, 99]]


def test_stream_samples_in_order(tmp_path):
    ds = GPTDataset(write_indexed(tmp_path / "s", STREAM_DOCS), np.arange(3), None, GPTDatasetConfig(seq_len=4, shuffle=False))
    assert len(ds) == 2  # (10 tokens - 1) // 4
    assert ds.tokens(0).tolist() == [10, 11, 99, 20, 21]
    assert ds.tokens(1).tolist() == [21, 99, 30, 31, 32]
    ex = ds[0]
    assert ex["input_ids"].tolist() == [10, 11, 99, 20]
    assert ex["labels"].tolist() == [11, 99, 20, 21]
    assert ex["position_ids"].tolist() == [0, 1, 2, 3]
    assert ex["document_ids"].tolist() == [0, 0, 0, 0]
    assert all(v.dtype == np.int64 and v.shape == (4,) for v in ex.values())


def test_reset_positions_attention_and_eod_loss_mask(tmp_path):
    cfg = GPTDatasetConfig(seq_len=4, shuffle=False, eod_id=99, reset_position_ids=True,
                           reset_attention_mask=True, eod_mask_loss=True)
    ds = GPTDataset(write_indexed(tmp_path / "s", STREAM_DOCS), np.arange(3), None, cfg)
    ex = ds[0]
    assert ex["position_ids"].tolist() == [0, 1, 2, 0]
    doc = ex["document_ids"]
    visible = np.tril(np.ones((4, 4), bool)) & (doc[:, None] == doc[None, :])
    assert visible[3].tolist() == [False, False, False, True]  # token 3 attends only to itself
    assert visible[2].tolist() == [True, True, True, False]
    assert (ex["labels"] != -100).astype(int).tolist() == [1, 1, 0, 1]
    assert ex["labels"].tolist() == [11, 99, -100, 21]
    ex1 = ds[1]  # [21, 99, 30, 31] -> [99, 30, 31, 32]
    assert ex1["position_ids"].tolist() == [0, 1, 0, 1]
    assert ex1["document_ids"].tolist() == [0, 0, 1, 1]
    assert ex1["labels"].tolist() == [99, -100, 31, 32]


def test_options_need_eod_id(tmp_path):
    with pytest.raises(ValueError, match="need eod_id"):
        GPTDataset(write_indexed(tmp_path / "s", STREAM_DOCS), np.arange(3), None, GPTDatasetConfig(seq_len=4, eod_mask_loss=True))


def test_sample_out_of_range(tmp_path):
    ds = GPTDataset(write_indexed(tmp_path / "s", STREAM_DOCS), np.arange(3), None, GPTDatasetConfig(seq_len=4, shuffle=False))
    with pytest.raises(IndexError, match="sample 2 out of range for 2 train samples"):
        ds[2]


# -- indices -----------------------------------------------------------------------------------


def _sample_index_loop(lengths, doc_index, seq_len, num_epochs, tokens_per_epoch):
    """helpers.cpp build_sample_idx (drop the last partial sample, one extra token), as a plain loop."""
    n = (num_epochs * tokens_per_epoch - 1) // seq_len
    rows = [(0, 0)]
    d, off = 0, 0
    while len(rows) <= n:
        remaining = seq_len + 1
        while remaining != 0:
            doc_len = lengths[doc_index[d]] - off
            remaining -= doc_len
            if remaining <= 0:
                off += remaining + doc_len - 1
                remaining = 0
            else:
                d += 1
                off = 0
        rows.append((d, off))
    return np.array(rows)


@pytest.mark.parametrize("seed", range(6))
def test_sample_index_matches_megatron_loop(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 30, size=int(rng.integers(1, 80))).astype(np.int32)
    lengths[0] = max(lengths[0], 1) if seed % 2 else 0  # an empty first document too
    if lengths.sum() < 2:
        lengths[-1] = 5
    seq_len = int(rng.integers(2, 40))
    epochs = int(rng.integers(1, 4))
    docs = np.arange(len(lengths))
    doc_index = np.tile(docs, epochs).astype(np.int32)
    rng.shuffle(doc_index)
    tokens = int(lengths.sum())
    got = build_sample_index(lengths, doc_index, seq_len, epochs, tokens)
    np.testing.assert_array_equal(got, _sample_index_loop(lengths, doc_index, seq_len, epochs, tokens))
    assert got.dtype == np.int32


# Six documents of lengths 3, 5, 2, 7, 4, 6 (doc k = 100(k+1), 100(k+1)+1, ..., EOD 1); seq_len 4,
# seed 1234, split "1,0,0". Expected values printed by megatron-core 0.16.1's GPTDataset.
SIX_LENGTHS = [3, 5, 2, 7, 4, 6]
MEGATRON_SIX = {
    3: (  # one epoch: 6 samples
        [2, 1, 5, 0, 4, 3],
        [[0, 0], [1, 2], [2, 1], [2, 5], [4, 0], [5, 0], [5, 4]],
        [0, 4, 3, 2, 5, 1],
    ),
    7: (  # two epochs, the second only 1/6 used: shuffled separately
        [2, 1, 5, 0, 4, 3, 0, 4, 3, 2, 5, 1],
        [[0, 0], [1, 2], [2, 1], [2, 5], [4, 0], [5, 0], [5, 4], [6, 1], [7, 2], [8, 2], [8, 6], [10, 1], [10, 5], [11, 3]],
        [1, 0, 3, 2, 5, 4, 8, 9, 11, 7, 10, 12, 6],
    ),
    12: (  # two epochs shuffled together
        [1, 2, 5, 2, 3, 4, 1, 0, 4, 5, 0, 3],
        [[0, 0], [0, 4], [2, 1], [2, 5], [4, 1], [4, 5], [5, 2], [6, 2], [7, 1], [8, 2], [9, 2], [10, 0], [11, 1], [11, 5]],
        [7, 11, 2, 3, 1, 9, 5, 4, 0, 8, 6, 10, 12],
    ),
}


def _six_docs():
    return [[100 * (k + 1) + i for i in range(length - 1)] + [1] for k, length in enumerate(SIX_LENGTHS)]


@pytest.mark.parametrize("num_samples", sorted(MEGATRON_SIX))
def test_indices_equal_megatron(tmp_path, num_samples):
    doc_index, sample_index, shuffle_index = build_indices(np.array(SIX_LENGTHS, np.int32), np.arange(6), 4, num_samples, 1234)
    want = MEGATRON_SIX[num_samples]
    assert doc_index.tolist() == want[0] and doc_index.dtype == np.int32
    assert sample_index.tolist() == want[1] and sample_index.dtype == np.int32
    assert shuffle_index.tolist() == want[2] and shuffle_index.dtype == np.uint32


def test_first_sample_equals_megatron(tmp_path):
    cfg = GPTDatasetConfig(seq_len=4, split="1,0,0")
    train = build_gpt_datasets(str(write_indexed(tmp_path / "c", _six_docs()).prefix), (3, 0, 0), cfg)[0]
    assert train.tokens(0).tolist() == [300, 1, 200, 201, 202]
    train7 = build_gpt_datasets(str(tmp_path / "c"), (7, 0, 0), cfg)[0]
    assert train7.tokens(0).tolist() == [202, 203, 1, 600, 601]


def test_num_epochs():
    assert num_epochs_for(10, 4, None) == 1
    assert num_epochs_for(10, 4, 2) == 1  # 9 tokens needed
    assert num_epochs_for(10, 4, 3) == 2  # 13 needed
    assert num_epochs_for(10, 3, 3) == 1  # exactly 10
    assert num_epochs_for(10, 3, 4) == 2
    with pytest.raises(ValueError, match="no tokens"):
        num_epochs_for(0, 4, 1)


def test_many_epochs_without_shuffle_repeat_the_stream():
    lengths = np.array([3, 3, 4], np.int32)
    d, s, p = build_indices(lengths, np.arange(3), 4, 10, seed=0, shuffle=False)
    assert d.tolist() == [0, 1, 2] * 5  # 41 tokens needed -> 5 epochs of 10
    assert p.tolist() == list(range(len(p))) and len(p) == (50 - 1) // 4
    stream = np.tile(np.arange(10), 5)
    starts = np.cumsum([0] + [lengths[i] for i in d])[s[:, 0]] + s[:, 1]
    assert starts.tolist() == list(range(0, 4 * len(s), 4))
    assert len(stream) >= starts[-1] + 1


def test_separate_final_epoch_is_shuffled_apart():
    lengths = np.full(10, 10, np.int32)  # 100 tokens, 9 samples per epoch at seq_len 10
    d, s, p = build_indices(lengths, np.arange(10), 10, 10, seed=5)  # 2 epochs, 1 sample of the 2nd
    assert sorted(d[:10]) == list(range(10)) and sorted(d[10:]) == list(range(10))
    sans_final = (100 - 1) // 10
    assert sorted(p[:sans_final]) == list(range(sans_final))
    assert sorted(p[sans_final:]) == list(range(sans_final, len(p)))
    d2, _, p2 = build_indices(lengths, np.arange(10), 10, 17, seed=5)  # 8 of 9 from the 2nd: together
    assert sorted(d2[:10]) != list(range(10)) and sorted(p2[:sans_final]) != list(range(sans_final))


# -- splits ------------------------------------------------------------------------------------


def test_split_ranges():
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001]
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("969, 30, 1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_ranges("1,1", 5) == [(0, 2), (2, 5), None]  # 2.5 rounds half to even
    assert split_ranges("100,0,0", 7) == [(0, 7), None, None]
    assert split_ranges("98/2", 100) == [(0, 98), (98, 100), None]


@pytest.mark.parametrize("bad,match", [
    ("a,b", "'a' is not a non-negative number"),
    ("1,2,3,4", "expected 1 to 3 weights"),
    ("0,0,0", "sum to 0"),
    ("90,-10", "'-10' is not a non-negative number"),
    ("", "expected 1 to 3 weights"),
])
def test_bad_split(bad, match):
    with pytest.raises(ValueError, match=match):
        split_ranges(bad, 10)


def test_build_gpt_datasets_splits_by_document(tmp_path):
    docs = [[i, i, 99] for i in range(2, 12)]
    train, valid, test = build_gpt_datasets(str(write_indexed(tmp_path / "c", docs).prefix), (None, None, None),
                                            GPTDatasetConfig(seq_len=2, split="6,3,1", shuffle=False))
    assert train.documents.tolist() == list(range(6))
    assert valid.documents.tolist() == [6, 7, 8] and test.documents.tolist() == [9]
    assert test.tokens(0).tolist() == [11, 11, 99]
    assert build_gpt_datasets(str(tmp_path / "c"), (None, None, None), GPTDatasetConfig(seq_len=2, split="1"))[1:] == [None, None]


def test_samples_from_an_empty_split(tmp_path):
    prefix = str(write_indexed(tmp_path / "c", [[1, 2, 3]] * 10).prefix)
    cfg = GPTDatasetConfig(seq_len=2, split="969,30,1")
    assert len(build_gpt_datasets(prefix, (None, None, None), cfg)[2]) == 0
    with pytest.raises(ValueError, match=r"the test split of .*c \(0 of 10 documents, --split '969,30,1'\) holds no token"):
        build_gpt_datasets(prefix, (5, 0, 1), cfg)


# -- cache -------------------------------------------------------------------------------------


def test_indices_are_cached_and_reused(tmp_path, monkeypatch):
    ix = write_indexed(tmp_path / "c", _six_docs())
    cfg = GPTDatasetConfig(seq_len=4, split="1,0,0")
    first = GPTDataset(ix, np.arange(6), 7, cfg)
    paths = first.cache_paths()
    assert os.path.dirname(paths["sample_index"]) == os.path.join(str(tmp_path / "c"), "cache", "GPTDataset_indices")
    assert all(os.path.isfile(p) for p in paths.values())
    assert os.path.basename(paths["sample_index"]).endswith("-GPTDataset-train-sample_index.npy")

    def boom(*a, **k):
        raise AssertionError("rebuilt instead of read from the cache")

    monkeypatch.setattr(gd, "build_indices", boom)
    again = GPTDataset(ix, np.arange(6), 7, cfg)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
        assert getattr(again, name).dtype == getattr(first, name).dtype
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(ix, np.arange(6), 7, GPTDatasetConfig(seq_len=4, seed=1))  # another seed: another entry


def test_cache_off_and_cache_dir(tmp_path):
    ix = write_indexed(tmp_path / "c", _six_docs())
    GPTDataset(ix, np.arange(6), 3, GPTDatasetConfig(seq_len=4, cache=False))
    assert not os.path.exists(tmp_path / "c")
    ds = GPTDataset(ix, np.arange(6), 3, GPTDatasetConfig(seq_len=4, cache_dir=str(tmp_path / "idx")))
    assert len(os.listdir(tmp_path / "idx")) == 4 and ds.shuffle_index.tolist() == MEGATRON_SIX[3][2]


def test_broken_cache_entry_is_rebuilt(tmp_path):
    ix = write_indexed(tmp_path / "c", _six_docs())
    cfg = GPTDatasetConfig(seq_len=4)
    paths = GPTDataset(ix, np.arange(6), 3, cfg).cache_paths()
    with open(paths["shuffle_index"], "wb") as fh:
        fh.write(b"garbage")
    assert GPTDataset(ix, np.arange(6), 3, cfg).shuffle_index.tolist() == MEGATRON_SIX[3][2]


@pytest.mark.parametrize("name,change,reason", [
    ("sample_index", lambda a: a.__setitem__((2, 0), 10**6), "sample starts outside"),
    ("sample_index", lambda a: a.__setitem__((2, 1), 10**6), "sample offsets outside their documents"),
    ("document_index", lambda a: a.__setitem__(0, 99), "document ids outside [0, 6)"),
    ("shuffle_index", lambda a: a.__setitem__(0, a[1]), "a shuffle index that repeats samples"),
    ("shuffle_index", lambda a: a.__setitem__(0, 10**6), "shuffle entries outside"),
])
def test_a_cache_with_out_of_range_values_is_rebuilt(tmp_path, name, change, reason):
    ix = write_indexed(tmp_path / "c", _six_docs())
    cfg = GPTDatasetConfig(seq_len=4)
    good = GPTDataset(ix, np.arange(6), 3, cfg)
    paths = good.cache_paths()
    arr = np.load(paths[name]).copy()
    change(arr)
    np.save(paths[name], arr)  # same shape and dtype, values no index of this data can hold
    with pytest.warns(UserWarning, match=r"do not fit the data \(" + re.escape(reason)):
        again = GPTDataset(ix, np.arange(6), 3, cfg)
    assert again.shuffle_index.tolist() == MEGATRON_SIX[3][2]
    assert [again[i]["input_ids"].tolist() for i in range(len(again))] == [good[i]["input_ids"].tolist() for i in range(len(good))]
    np.testing.assert_array_equal(np.load(paths[name]), getattr(good, name))  # the cache entry is written again


def test_unwritable_cache_warns(tmp_path):
    ix = write_indexed(tmp_path / "c", _six_docs())
    (tmp_path / "file").write_text("x")
    with pytest.warns(UserWarning, match="could not cache the indices"):
        ds = GPTDataset(ix, np.arange(6), 3, GPTDatasetConfig(seq_len=4, cache_dir=str(tmp_path / "file" / "sub")))
    assert len(ds) == 6


def test_a_million_samples_build():
    lengths = np.random.default_rng(0).integers(1, 2000, 100_000).astype(np.int32)
    d, s, p = build_indices(lengths, np.arange(len(lengths)), 128, 1_000_000, 1)
    assert len(p) >= 1_000_000 and s.shape == (len(p) + 1, 2)
