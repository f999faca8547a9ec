"""cross_entropy_sum: a sum over target tokens in fp32, zero (not NaN) when nothing is a target."""

import math

import pytest
import torch

from mff.nn.loss import count_targets, cross_entropy_sum


def test_closed_form_value():
    # uniform logits over V=4: each target costs ln 4; two of three labels count
    logits = torch.zeros(1, 3, 4, dtype=torch.bfloat16)
    labels = torch.tensor([[1, -100, 3]])
    loss = cross_entropy_sum(logits, labels)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(2 * math.log(4), rel=1e-6)
    assert int(count_targets(labels)) == 2


def test_all_ignored_is_zero_and_bad_label_raises():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss = cross_entropy_sum(logits, torch.full((1, 3), -100))
    assert loss.item() == 0.0
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.count_nonzero(g) == 0
    with pytest.raises(IndexError, match="label 5 is outside the vocabulary"):
        cross_entropy_sum(logits, torch.tensor([[0, 5, 1]]))
