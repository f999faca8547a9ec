"""Corpus statistics used as baselines."""

from __future__ import annotations

import numpy as np


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy, in nats, of the empirical unigram distribution of `tokens`.

    This is the loss of the best model that ignores context, a baseline for validation loss
    (uniform over 4 tokens gives ln 4).

    Args:
        tokens: 1-D array of non-negative integer token ids, all < `vocab_size`.
        vocab_size: vocabulary size V.

    Raises:
        ValueError: `tokens` is empty, or holds an id outside ``0..vocab_size-1``.
    """
    t = np.asarray(tokens).reshape(-1)
    if t.size == 0:
        raise ValueError("data: unigram_entropy of an empty token array")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"data: token ids span {lo}..{hi}, outside the vocabulary 0..{vocab_size - 1}")
    counts = np.bincount(t, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / t.size
    return float(-(p * np.log(p)).sum())
