"""model.forward / model.init reject bad inputs with messages that name the value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mff


@pytest.fixture(scope="module")
def tiny():
    model = mff.build("deepseek3", size="tiny")
    return model, model.init(seed=0)


def _ids(*shape):
    return torch.zeros(*shape, dtype=torch.long)


@pytest.mark.parametrize(
    "batch,err,needle",
    [
        ({"input_ids": _ids(1, 4) + 8192}, ValueError, "token id 8192, outside the vocabulary [0, 8192)"),
        ({"input_ids": _ids(1, 4) - 1}, ValueError, "token id -1"),
        ({"input_ids": _ids(1, 0)}, ValueError, "is empty: shape (1, 0)"),
        ({"input_ids": np.zeros((1, 4), dtype=np.int64)}, ValueError, "got ndarray"),
        ({"input_ids": _ids(1, 4).int()}, ValueError, "int64 tensor [B, T], got torch.int32 (1, 4)"),
        ({"input_ids": _ids(1, 4), "labels": _ids(1, 3)}, ValueError, "batch['labels'] must be an integer tensor shaped like input_ids (1, 4)"),
        ({"input_ids": _ids(1, 4), "position_ids": _ids(1, 4) + 4096}, ValueError, "position 4096, outside [0, max_position_embeddings=4096)"),
        ({"input_ids": _ids(1, 4), "mask": _ids(1, 4)}, ValueError, "unknown batch keys ['mask']"),
    ],
)
def test_bad_batches(tiny, batch, err, needle):
    model, params = tiny
    with pytest.raises(err) as e:
        model.forward(params, batch)
    assert needle in str(e.value)


def test_bad_params_and_counts(tiny):
    model, params = tiny
    with pytest.raises(TypeError, match="batch must be a dict of tensors, got Tensor"):
        model.forward(params, _ids(1, 4))
    wrong = dict(params, **{"model.embed_tokens.weight": torch.zeros(10, 256)})
    with pytest.raises(ValueError, match=r"param 'model.embed_tokens.weight' has shape \(10, 256\), the model expects \(8192, 256\)"):
        model.forward(wrong, {"input_ids": _ids(1, 4)})
    with pytest.raises(ValueError, match=r"target_counts lacks \['mtp.1'\]"):
        model.forward(params, {"input_ids": _ids(1, 4), "labels": _ids(1, 4)}, target_counts={"lm": torch.tensor(4), "balance": torch.tensor(1)})
    with pytest.raises(TypeError, match="seed must be an int, got str"):
        model.init("abc")
    with pytest.raises(ValueError, match="sequence length 5000 exceeds max_position_embeddings 4096"):
        model.forward(params, {"input_ids": _ids(1, 5000)})


def test_missing_or_extra_params_are_named(tiny):
    """forward checks the param paths against the skeleton's (also with check=False, which
    skips only the batch checks): a missing or an extra path raises and names it."""
    model, params = tiny
    batch = {"input_ids": _ids(1, 4)}
    fewer = {k: v for k, v in params.items() if k != "model.norm.weight"}
    with pytest.raises(RuntimeError, match=r"1 missing \['model.norm.weight'\], 0 unexpected"):
        model.forward(fewer, batch, check=False)
    more = {**params, "model.extra.weight": torch.zeros(2)}
    with pytest.raises(RuntimeError, match=r"0 missing \[\], 1 unexpected \['model.extra.weight'\]"):
        model.forward(more, batch, check=False)
    assert model.forward(params, batch, check=False).logits.shape == (1, 4, model.config.vocab_size)
