"""Cutting a token stream into fixed-length training windows and turning windows into examples.

Megatron GPT style: window i covers tokens ``[i*T, i*T + T + 1)``, so consecutive windows
share one token (the last label of one window is the first input of the next) and every token
but the very first is a label exactly once. Documents are packed back to back; `document_ids`
tell attention where they end.
"""

from __future__ import annotations

import numpy as np


class PackedTokens:
    """Non-overlapping windows of ``seq_len + 1`` tokens with stride `seq_len` over a stream.

    Args:
        tokens: 1-D integer array of token ids (any integer dtype; may be a memmap).
        seq_len: training sequence length T (>= 1).
        eod_id: the end-of-document token id.
        name: split name used in error messages.

    Attributes:
        tokens, seq_len, eod_id, name: as given.

    The tail that does not fill a whole window is dropped.

    Raises:
        ValueError: `tokens` is not 1-D, `seq_len` < 1, or the stream is shorter than one
            window (the message names the split, its token count and ``seq_len + 1``).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, eod_id: int, name: str = "tokens"):
        if tokens.ndim != 1:
            raise ValueError(f"data: {name} tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"data: seq_len must be >= 1, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"data: the {name} split has {len(tokens)} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}; use a shorter --seq-len, a bigger corpus"
                + (" or a larger --data.val-permille" if name == "val" else "")
            )
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.eod_id = int(eod_id)
        self.name = name
        self._n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        """Number of windows: ``(len(tokens) - 1) // seq_len``."""
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        """Window `i` (negative counts from the end): int64 array [seq_len + 1].

        Raises:
            IndexError: `i` out of range.
        """
        if not -self._n <= i < self._n:
            raise IndexError(f"data: window {i} out of range for {self._n} {self.name} windows")
        start = (i % self._n) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Several windows at once: int64 array [len(indices), seq_len + 1].

        Raises:
            IndexError: an index outside ``0..len(self) - 1``.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"data: window indices must be in 0..{self._n - 1} for the {self.name} split")
        offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)[None, :]
        return np.asarray(self.tokens[offsets], dtype=np.int64)

    def example(self, i: int) -> dict[str, np.ndarray]:
        """Window `i` as a training example; see `windows_to_examples`. Each value is [seq_len]."""
        return {k: v[0] for k, v in windows_to_examples(self[i][None, :], self.eod_id).items()}


def document_ids(input_ids: np.ndarray, eod_id: int) -> np.ndarray:
    """Per-position document index within each row, starting at 0.

    The index increases by one *after* each position whose input token is `eod_id`, so an EOD
    belongs to the document it ends. Example (EOD = 0): ``[5, 0, 7, 0, 0, 9] -> [0, 0, 1, 1, 2, 3]``.

    Args:
        input_ids: integer array [..., T].

    Returns:
        int64 array of the same shape.
    """
    is_eod = (np.asarray(input_ids) == eod_id).astype(np.int64)
    out = np.zeros(is_eod.shape, dtype=np.int64)
    np.cumsum(is_eod[..., :-1], axis=-1, out=out[..., 1:])
    return out


def windows_to_examples(windows: np.ndarray, eod_id: int) -> dict[str, np.ndarray]:
    """Turn windows into next-token-prediction examples.

    Args:
        windows: integer array [B, T + 1].
        eod_id: end-of-document token id.

    Returns:
        ``input_ids = w[:, :-1]``, ``labels = w[:, 1:]`` (labels[t] is the target of position t)
        and ``document_ids`` (see `document_ids`), each int64 [B, T].
    """
    w = np.asarray(windows, dtype=np.int64)
    input_ids = np.ascontiguousarray(w[:, :-1])
    labels = np.ascontiguousarray(w[:, 1:])
    return {"input_ids": input_ids, "labels": labels, "document_ids": document_ids(input_ids, eod_id)}
