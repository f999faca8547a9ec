import numpy as np
import pytest

from mff.data import PackedTokens, document_ids, windows_to_examples


def test_windows_share_one_token_and_drop_tail():
    tokens = np.arange(12, dtype=np.uint16)  # 12 tokens, T=4 -> windows [0..4], [4..8]; tail 9..11 dropped
    data = PackedTokens(tokens, seq_len=4, eod_id=99)
    assert len(data) == 2
    np.testing.assert_array_equal(data[0], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(data[1], [4, 5, 6, 7, 8])
    assert data[0].dtype == np.int64
    assert data[0][-1] == data[1][0]
    np.testing.assert_array_equal(data[-1], data[1])
    np.testing.assert_array_equal(data.windows(np.array([1, 0, 1])), [[4, 5, 6, 7, 8], [0, 1, 2, 3, 4], [4, 5, 6, 7, 8]])
    with pytest.raises(IndexError):
        data[2]
    with pytest.raises(IndexError):
        data.windows(np.array([2]))


def test_exact_fit_window_count():
    # 9 tokens = 2 * 4 + 1: both windows fit exactly.
    assert len(PackedTokens(np.arange(9), 4, 0)) == 2
    assert len(PackedTokens(np.arange(8), 4, 0)) == 1
    assert len(PackedTokens(np.arange(5), 4, 0)) == 1


def test_too_short_names_split_count_and_window():
    with pytest.raises(ValueError, match=r"val split has 4 tokens.*seq_len \+ 1 = 5"):
        PackedTokens(np.arange(4), 4, 0, name="val")


def test_labels_aligned_and_document_ids_after_eod():
    eod = 0
    w = np.array([[7, 0, 5, 6, 0, 0, 9, 3]])
    ex = windows_to_examples(w, eod)
    np.testing.assert_array_equal(ex["input_ids"], [[7, 0, 5, 6, 0, 0, 9]])
    np.testing.assert_array_equal(ex["labels"], [[0, 5, 6, 0, 0, 9, 3]])
    # the EOD belongs to the document it ends; the id rises at the position after it
    np.testing.assert_array_equal(ex["document_ids"], [[0, 0, 1, 1, 1, 2, 3]])
    for v in ex.values():
        assert v.dtype == np.int64 and v.shape == (1, 7)


def test_document_ids_batch_and_edge_cases():
    ids = np.array([[0, 0, 0], [1, 2, 3], [1, 2, 0]])
    np.testing.assert_array_equal(document_ids(ids, 0), [[0, 1, 2], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(document_ids(np.array([[0]]), 0), [[0]])


def test_example_from_packed():
    tokens = np.array([3, 4, 5, 0, 6, 0, 7], dtype=np.uint16)
    data = PackedTokens(tokens, seq_len=3, eod_id=0)
    assert len(data) == 2
    ex = data.example(1)  # window [0, 6, 0, 7]
    np.testing.assert_array_equal(ex["input_ids"], [0, 6, 0])
    np.testing.assert_array_equal(ex["labels"], [6, 0, 7])
    np.testing.assert_array_equal(ex["document_ids"], [0, 1, 1])
