"""Gradient accumulation normalises by the step's total target count, not a mean of means."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mff.model import Family, Model, Output
from mff.nn.loss import count_targets, cross_entropy_sum
from mff.optim import OptimConfig, adamw
from mff.parallel.gather import gather
from mff.train.step import train_step


@dataclass(frozen=True)
class BigramConfig:
    vocab_size: int = 2
    max_position_embeddings: int = 16


class Bigram(nn.Module):
    """logits[t] = table[input_ids[t]]: a model whose per-token CE we can set exactly."""

    def __init__(self, cfg: BigramConfig):
        super().__init__()
        self.table = nn.Parameter(torch.empty(cfg.vocab_size, cfg.vocab_size))

    def forward(self, input_ids, labels=None, position_ids=None, document_ids=None, target_counts=None):
        logits = F.embedding(input_ids, gather(self.table))
        out = Output(logits)
        if labels is not None:
            counts = target_counts if target_counts is not None else {"lm": count_targets(labels)}
            out.losses["lm"] = cross_entropy_sum(logits, labels) / counts["lm"].clamp(min=1)
        return out


BIGRAM = Family(
    name="bigram", config_cls=BigramConfig, sizes={"tiny": BigramConfig()}, default_size="tiny", skeleton=Bigram,
    init_table=lambda cfg: [("**", ("zeros",))], sharding_table=[("table", (None, None))],
    count_targets=lambda cfg, b: {"lm": count_targets(b["labels"])} if "labels" in b else {},
    param_counts=lambda cfg, shapes: {}, train_flops_per_token=lambda cfg, shapes, t: 0.0,
)


def test_two_microbatches_weigh_tokens_equally():
    model = Model(BIGRAM, BigramConfig())
    a = math.log(math.exp(4.0) - 1.0)  # CE of target 0 under logits [0, a] is log(1 + e^a) = 4
    params = {"table": torch.tensor([[0.0, a], [100.0, -100.0]], requires_grad=True)}
    one_target = {"input_ids": torch.tensor([[0, 0]]), "labels": torch.tensor([[0, -100]])}
    three_targets = {"input_ids": torch.tensor([[1, 1, 1, 1]]), "labels": torch.tensor([[0, 0, 0, -100]])}
    assert model.forward(params, one_target).losses["lm"].item() == pytest.approx(4.0, abs=1e-6)
    assert model.forward(params, three_targets).losses["lm"].item() == pytest.approx(0.0, abs=1e-6)
    state = adamw.init(params)
    stats = train_step(model, params, state, [one_target, three_targets], lr=0.0, optim=OptimConfig(max_grad_norm=0.0))
    assert stats.loss == pytest.approx(1.0, abs=1e-6)  # (4 + 0 + 0 + 0) / 4, not (4 + 0) / 2


def test_microbatch_without_targets_contributes_nothing():
    model = Model(BIGRAM, BigramConfig())
    params = {"table": torch.zeros(2, 2, requires_grad=True)}
    empty = {"input_ids": torch.tensor([[0, 1]]), "labels": torch.tensor([[-100, -100]])}
    out = model.forward(params, empty)
    assert out.losses["lm"].item() == 0.0
    full = {"input_ids": torch.tensor([[0, 1]]), "labels": torch.tensor([[1, 0]])}
    stats = train_step(model, params, adamw.init(params), [empty, full], lr=0.0, optim=OptimConfig(max_grad_norm=0.0))
    assert stats.loss == pytest.approx(math.log(2), abs=1e-6)


def test_forward_rejects_bad_batches():
    model = Model(BIGRAM, BigramConfig())
    params = {"table": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="unknown batch keys"):
        model.forward(params, {"input_ids": torch.zeros(1, 2, dtype=torch.long), "mask": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="int64"):
        model.forward(params, {"input_ids": torch.zeros(1, 2, dtype=torch.int32)})
    with pytest.raises(RuntimeError):
        model.forward({}, {"input_ids": torch.zeros(1, 2, dtype=torch.long)})  # strict=True: missing params raise


def test_check_finite_names_the_bad_tensor():
    from mff.train.step import NonFiniteError, check_finite

    check_finite({"a": torch.ones(2)}, {"step": torch.tensor(3)})
    with pytest.raises(NonFiniteError, match="exp_avg/b holds NaN or inf"):
        check_finite({"a": torch.ones(2)}, {"exp_avg": {"b": torch.tensor([float("inf")])}})
