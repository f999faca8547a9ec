"""mff's Megatron data path against megatron-core itself (skipped when megatron-core is absent).

Same files, seed and config on both sides: the .bin/.idx bytes, the document, sample and shuffle
indices of every split, the blending indices, and the samples (tokens, labels, positions,
attention masks) must be identical.

Run it with megatron-core installed (its wheel ships the compiled ``helpers_cpp``)::

    python -m venv /tmp/mcore && . /tmp/mcore/bin/activate
    pip install torch==2.13.0 megatron-core optree tyro msgpack safetensors tokenizers tqdm gguf jinja2 pytest
    PYTHONPATH=. python -m pytest tests/test_megatron_compat.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core.datasets.helpers_cpp")

import torch  # noqa: E402
from megatron.core.datasets import helpers  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MGPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexedDataset  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MIndexedDatasetBuilder  # noqa: E402

from mff.data.blend import build_blended_gpt_datasets, build_blending_indices  # noqa: E402
from mff.data.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets  # noqa: E402
from mff.data.indexed import IndexedDataset  # noqa: E402

EOD = 1
VOCAB = 1000
from tests.data_util import write_indexed


class _Tokenizer:
    """The little of a tokenizer that megatron's GPTDataset reads."""

    vocab_size = VOCAB
    eod = EOD
    unique_identifiers = {"class": "StubTokenizer", "vocab_size": VOCAB, "eod": EOD}


def _docs(seed, n, max_len=40):
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = int(rng.integers(0, max_len))
        body = rng.integers(2, VOCAB, size=length).tolist()
        docs.append([] if rng.random() < 0.05 else body + [EOD])
    return docs


def _write(prefix, docs):
    write_indexed(prefix, docs)


def _mconfig(tmp_path, blend, seq_len, seed, split="969,30,1", flags=False, cache=True):
    return MGPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=blend,
        split=split,
        path_to_cache=str(tmp_path / "mcache") if cache else None,
        tokenizer=_Tokenizer(),
        reset_position_ids=flags,
        reset_attention_mask=flags,
        eod_mask_loss=flags,
    )


def _mconfig_mff(tmp_path, seq_len, seed, split="969,30,1", flags=False):
    return GPTDatasetConfig(
        seq_len=seq_len, seed=seed, split=split, eod_id=EOD, reset_position_ids=flags,
        reset_attention_mask=flags, eod_mask_loss=flags, cache_dir=str(tmp_path / "cache"),
    )


def _same_indices(mine: GPTDataset, theirs: MGPTDataset):
    for name in ("document_index", "sample_index", "shuffle_index"):
        a, b = getattr(mine, name), getattr(theirs, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert len(mine) == len(theirs)


def _same_samples(mine, theirs, flags):
    for i in range(min(len(mine), 400)):
        ex, ref = mine[i], theirs[i]
        np.testing.assert_array_equal(ex["input_ids"], ref["tokens"].numpy())
        np.testing.assert_array_equal(ex["position_ids"], ref["position_ids"].numpy())
        keep = ref["loss_mask"].numpy() > 0
        np.testing.assert_array_equal(ex["labels"] != -100, keep)
        np.testing.assert_array_equal(ex["labels"][keep], ref["labels"].numpy()[keep])
        doc = ex["document_ids"]
        t = len(doc)
        masked = np.triu(np.ones((t, t), bool), 1) | (doc[:, None] != doc[None, :])
        np.testing.assert_array_equal(masked, ref["attention_mask"][0].numpy())


def test_bin_idx_bytes_identical(tmp_path):
    docs = _docs(0, 50)
    _write(tmp_path / "mff", docs)
    mb = MIndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for d in docs:
        mb.add_document(torch.tensor(d, dtype=torch.int64), [len(d)])
    mb.finalize(str(tmp_path / "meg.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"mff.{ext}").read_bytes() == (tmp_path / f"meg.{ext}").read_bytes()
    theirs, mine = MIndexedDataset(str(tmp_path / "mff")), IndexedDataset(str(tmp_path / "meg"))
    for i, d in enumerate(docs):
        assert theirs[i].tolist() == d == mine[i].tolist()
        if len(d) > 3:
            np.testing.assert_array_equal(theirs.get(i, 1, 2), mine.get(i, 1, 2))


@pytest.mark.parametrize(
    "seq_len,seed,sizes,split",
    [
        (8, 1234, (None, None, None), "969,30,1"),  # one epoch per split; the test split is empty
        (16, 7, (40, 3, 1), "90,8,2"),  # within one epoch
        (16, 3, (2000, 50, 10), "90,8,2"),  # many epochs
        (33, 0, (200, 10, 2), "80,15,5"),
    ],
)
@pytest.mark.parametrize("flags", [False, True])
def test_gpt_dataset_splits_identical(tmp_path, seq_len, seed, sizes, split, flags):
    _write(tmp_path / "corpus", _docs(seed + 1, 400))
    prefix = str(tmp_path / "corpus")
    theirs = BlendedMegatronDatasetBuilder(
        MGPTDataset, list(sizes), lambda: True, _mconfig(tmp_path, ([prefix], None), seq_len, seed, split, flags)
    ).build()
    mine = build_gpt_datasets(prefix, sizes, _mconfig_mff(tmp_path, seq_len, seed, split, flags))
    for m, t in zip(mine, theirs):
        _same_indices(m, t)
        _same_samples(m, t, flags)


def test_separate_final_epoch_identical(tmp_path):
    docs = _docs(5, 60)
    _write(tmp_path / "c", docs)
    tokens = sum(len(d) for d in docs)
    seq_len = 10
    per_epoch = (tokens - 1) // seq_len
    for n in (per_epoch + 1, per_epoch + per_epoch // 2, 2 * per_epoch, 3 * per_epoch + 5):
        theirs = BlendedMegatronDatasetBuilder(
            MGPTDataset, [n, 0, 0], lambda: True, _mconfig(tmp_path, ([str(tmp_path / "c")], None), seq_len, 99, split="1,0,0")
        ).build()[0]
        mine = build_gpt_datasets(str(tmp_path / "c"), (n, 0, 0), _mconfig_mff(tmp_path, seq_len, 99, split="1,0,0"))[0]
        _same_indices(mine, theirs)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1.0, 1.0, 1.0], [7.0, 2.0, 1.0], [1e-6, 1.0, 0.999999]])
def test_blend_identical(tmp_path, weights):
    prefixes = []
    for k, n in enumerate((80, 120, 40)):
        _write(tmp_path / f"p{k}", _docs(10 + k, n))
        prefixes.append(str(tmp_path / f"p{k}"))
    sizes = (300, 30, 4)
    theirs = BlendedMegatronDatasetBuilder(
        MGPTDataset, list(sizes), lambda: True, _mconfig(tmp_path, (prefixes, weights), 12, 1234, "90,8,2", cache=False)
    ).build()
    spec = " ".join(f"{w!r} {p}" for w, p in zip(weights, prefixes))
    mine = build_blended_gpt_datasets(spec, sizes, _mconfig_mff(tmp_path, 12, 1234, "90,8,2"))
    for m, t in zip(mine, theirs):
        np.testing.assert_array_equal(m.dataset_index, t.dataset_index)
        np.testing.assert_array_equal(m.dataset_sample_index, t.dataset_sample_index)
        assert m.dataset_index.dtype == t.dataset_index.dtype
        for md, td in zip(m.datasets, t.datasets):
            _same_indices(md, td)
        for i in range(len(m)):
            np.testing.assert_array_equal(m[i]["input_ids"], t[i]["tokens"].numpy())


def test_blending_indices_identical():
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 5, 8):
        for _ in range(5):
            w = rng.random(k) ** 3 + 1e-9
            w = (w / w.sum()).tolist()
            size = int(rng.integers(0, 3000))
            di = np.zeros(size, dtype=np.int16)
            dsi = np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(di, dsi, w, k, size, False)
            a, b = build_blending_indices(w, size)
            np.testing.assert_array_equal(a, di)
            np.testing.assert_array_equal(b, dsi)


def test_megatron_stops_where_mff_rebuilds_bigger(tmp_path):
    """Uneven weights over a small split: megatron's blend oversamples, mff's does not."""
    prefixes = []
    for k, docs in enumerate(([[5, 6, 1]] * 3, [[7, 8, 9, 10, 1]], [[11, 1]] * 2, [[12, 13, 1]] * 2)):
        _write(tmp_path / f"p{k}", docs)
        prefixes.append(str(tmp_path / f"p{k}"))
    weights = [1e-6, 1.0, 1e-6, 1e-6]
    with pytest.raises(IndexError, match="oversamples"):
        BlendedMegatronDatasetBuilder(
            MGPTDataset, [1, 0, 0], lambda: True, _mconfig(tmp_path, (prefixes, weights), 2, 1234, "1,0,0", cache=False)
        ).build()
    spec = " ".join(f"{w!r} {p}" for w, p in zip(weights, prefixes))
    train = build_blended_gpt_datasets(spec, (1, 0, 0), _mconfig_mff(tmp_path, 2, 1234, "1,0,0"))[0]
    assert len(train) == 4 and all(train.tokens(i).shape == (3,) for i in range(4))
