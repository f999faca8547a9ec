import math

import numpy as np
import pytest

from mff.data import unigram_entropy


def test_uniform_over_four_is_ln4():
    t = np.array([0, 1, 2, 3] * 5, dtype=np.uint16)
    assert unigram_entropy(t, vocab_size=10) == pytest.approx(math.log(4), abs=1e-12)


def test_single_token_is_zero_and_closed_form():
    assert unigram_entropy(np.array([5, 5, 5]), 6) == 0.0
    # p = (1/2, 1/4, 1/4): H = 1.5 ln 2
    assert unigram_entropy(np.array([0, 0, 1, 2], dtype=np.uint32), 3) == pytest.approx(1.5 * math.log(2))


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        unigram_entropy(np.array([], dtype=np.int64), 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        unigram_entropy(np.array([0, 4]), 4)
