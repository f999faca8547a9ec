"""Token-level cross entropy as a sum and a count, so callers can normalise by any token
count (per micro-batch, or the global count of a step across micro-batches and ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "cross_entropy_sum", "count_targets"]

IGNORE_INDEX = -100


def count_targets(labels_BT: torch.Tensor) -> torch.Tensor:
    """Number of labels that are not ``IGNORE_INDEX`` (int64, 0-d)."""
    return (labels_BT != IGNORE_INDEX).sum()


def cross_entropy_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum over target tokens of ``-log softmax(logits)[label]``, computed in fp32 (0-d).

    Shapes: logits [..., V] (any float dtype), labels int64 [...]. Labels equal to
    ``IGNORE_INDEX`` (-100) contribute nothing; all ignored gives 0, never NaN.

    Raises:
        IndexError: a label outside [0, V) that is not ``IGNORE_INDEX``.
    """
    V = logits_BTV.shape[-1]
    labels = labels_BT.reshape(-1)
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        raise IndexError(f"label {int(labels[bad][0])} is outside the vocabulary [0, {V})")
    return F.cross_entropy(logits_BTV.reshape(-1, V).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
