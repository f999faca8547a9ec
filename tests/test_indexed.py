"""Megatron .bin/.idx indexed datasets: exact layout, reading, atomic writing, bad files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from mff.data.indexed import DTYPE_CODES, IndexedDataset, IndexedDatasetBuilder, best_dtype
from tests.data_util import write_indexed


def test_two_documents_layout(tmp_path):
    ds = write_indexed(tmp_path / "d", [[5, 6, 7, 0], [8, 0]])
    assert ds.sequence_lengths.tolist() == [4, 2]
    assert ds.sequence_pointers.tolist() == [0, 8]
    assert ds.document_indices.tolist() == [0, 1, 2]
    assert ds.dtype == np.uint16
    assert len(ds) == 2 and ds.num_documents == 2
    assert os.path.getsize(tmp_path / "d.bin") == 12
    assert ds[1].tolist() == [8, 0]
    assert ds[-2].tolist() == [5, 6, 7, 0]
    assert ds.get(0, offset=1, length=2).tolist() == [6, 7]
    assert ds.get(0, offset=3).tolist() == [0]


def test_idx_bytes_exact(tmp_path):
    write_indexed(tmp_path / "d", [[5, 6, 7, 0], [8, 0]])
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 2)  # sequences
        + struct.pack("<Q", 3)  # document indices
        + struct.pack("<2i", 4, 2)  # lengths
        + struct.pack("<2q", 0, 8)  # byte pointers
        + struct.pack("<3q", 0, 1, 2)  # document boundaries
    )
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<6H", 5, 6, 7, 0, 8, 0)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_every_dtype_round_trips(tmp_path, code):
    dtype = DTYPE_CODES[code]
    docs = [np.arange(5, dtype=dtype), np.array([], dtype=dtype), np.arange(3, dtype=dtype) + 1]
    ds = write_indexed(tmp_path / "d", docs, dtype)
    assert (tmp_path / "d.idx").read_bytes()[17] == code
    assert ds.dtype == dtype
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    assert ds.sequence_pointers.tolist() == [0, 5 * dtype.itemsize, 5 * dtype.itemsize]


def test_best_dtype():
    assert best_dtype(8192) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(151936) == np.int32


def test_empty_dataset(tmp_path):
    ds = write_indexed(tmp_path / "e", [])
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    with pytest.raises(IndexError):
        ds[0]


def test_get_out_of_range(tmp_path):
    ds = write_indexed(tmp_path / "d", [[1, 2, 3]])
    with pytest.raises(IndexError, match="sequence 1 out of range"):
        ds[1]
    with pytest.raises(IndexError, match=r"tokens \[2, 4\) are outside sequence 0 of length 3"):
        ds.get(0, 2, 2)


def test_token_out_of_dtype_range(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    with pytest.raises(ValueError, match="70000 does not fit uint16"):
        b.add_document([1, 70000])
    b.abort()


def test_unfinished_builder_leaves_nothing(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    b.add_document([1, 2])
    assert not (tmp_path / "d.bin").exists() and not (tmp_path / "d.idx").exists()
    b.abort()
    assert os.listdir(tmp_path) == []


def test_failed_build_keeps_previous_pair(tmp_path):
    write_indexed(tmp_path / "d", [[1, 2, 3]])
    before = {p: (tmp_path / p).read_bytes() for p in ("d.bin", "d.idx")}
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16) as b:
            b.add_document([9, 9, 9, 9])
            raise RuntimeError("killed")
    assert {p: (tmp_path / p).read_bytes() for p in ("d.bin", "d.idx")} == before
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_crash_between_renames_never_pairs_idx_with_wrong_bin(tmp_path, monkeypatch):
    write_indexed(tmp_path / "d", [[1, 2, 3]])
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".idx"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    b = IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    b.add_document([4, 5])
    with pytest.raises(OSError, match="simulated crash"):
        b.finalize()
    with pytest.raises(FileNotFoundError, match="d.idx does not exist"):
        IndexedDataset(str(tmp_path / "d"))


def test_finalize_replaces_previous_pair(tmp_path):
    write_indexed(tmp_path / "d", [[1, 2, 3]])
    ds = write_indexed(tmp_path / "d", [[4], [5, 6]])
    assert [ds[i].tolist() for i in range(len(ds))] == [[4], [5, 6]]


# -- bad files ---------------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path):
    write_indexed(tmp_path / "d", [[5, 6, 7, 0], [8, 0]])
    return tmp_path / "d"


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("missing", ["idx", "bin"])
def test_missing_file(pair, missing):
    os.remove(f"{pair}.{missing}")
    with pytest.raises(FileNotFoundError, match=rf"d\.{missing} does not exist"):
        IndexedDataset(str(pair))


def test_bad_magic(pair):
    _patch(pair.with_suffix(".idx"), 0, b"XXIDIDX")
    with pytest.raises(ValueError, match=r"d\.idx starts with b'XXIDIDX\\x00\\x00', expected the magic"):
        IndexedDataset(str(pair))


def test_unsupported_version(pair):
    _patch(pair.with_suffix(".idx"), 9, struct.pack("<Q", 2))
    with pytest.raises(ValueError, match=r"d\.idx has format version 2, only version 1"):
        IndexedDataset(str(pair))


def test_unknown_dtype_code(pair):
    _patch(pair.with_suffix(".idx"), 17, bytes([9]))
    with pytest.raises(ValueError, match=r"d\.idx has dtype code 9, expected one of \[1, 2, 3, 4, 5, 6, 7, 8\]"):
        IndexedDataset(str(pair))


def test_truncated_idx(pair):
    p = pair.with_suffix(".idx")
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"d\.idx has 79 bytes but its header \(2 sequences, 3 document indices\) describes 82 bytes"):
        IndexedDataset(str(pair))


def test_truncated_bin(pair):
    p = pair.with_suffix(".bin")
    p.write_bytes(p.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"d\.bin is truncated: it has 10 bytes but .*d\.idx needs 12 \(sequence 1 ends at byte 12\)"):
        IndexedDataset(str(pair))


def test_bin_of_another_idx(pair, tmp_path):
    write_indexed(tmp_path / "other", [[1, 2, 3, 4, 5, 6, 7]])
    os.replace(tmp_path / "other.bin", f"{pair}.bin")
    with pytest.raises(ValueError, match=r"d\.bin has 14 bytes but .*d\.idx describes 12; the \.bin and \.idx are not a pair"):
        IndexedDataset(str(pair))


def test_bad_document_indices(pair):
    _patch(pair.with_suffix(".idx"), 34 + 8 + 16 + 16, struct.pack("<q", 5))
    with pytest.raises(ValueError, match=r"d\.idx document indices run from 0 to 5, expected 0 to the sequence count 2"):
        IndexedDataset(str(pair))
