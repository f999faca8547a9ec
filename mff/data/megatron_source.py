"""Pretraining from Megatron indexed datasets: ``--data.path`` in Megatron's blend syntax.

A blend entry may also be MindRecord data (a ``.mindrecord`` file, folder or glob), read through
:mod:`mff.data.mindrecord_source` with the same samples, blending and resume.

``--data.path PREFIX`` or ``--data.path 0.7 PREFIX_A 0.3 PREFIX_B`` (each prefix names a
``PREFIX.bin``/``PREFIX.idx`` pair, e.g. written by ``python -m mff.recipes.preprocess``) gives
Megatron's GPT samples (:mod:`mff.data.gpt_dataset`, :mod:`mff.data.blend`): split by document
with ``--data.split``, ``steps x batch_size`` training samples (more than one pass of the data
repeats it in new shuffled epochs, as Megatron does), the valid split feeding ``--eval-every``.

:class:`SampleLoader` reads the training samples in order, each data-parallel rank its rows of
each global batch. Its state is the global sample position and the sample count the indices
were built for; a resumed run rebuilds the same indices (cached beside the data) and continues
at the saved position, so it sees the same tokens. A run extended past the built samples
(a larger ``--steps`` on resume) wraps around to sample 0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .blend import Blend, build_blended_gpt_datasets, parse_blend
from .config import DataConfig
from .gpt_dataset import GPTDatasetConfig, split_ranges
from .indexed import bin_path, idx_path, open_indexed
from .loader import MAX_POSITION, check_batch_split, eval_bounds
from .mindrecord import is_mindrecord
from .tokenizer import find_eod_id, load_tokenizer

__all__ = ["MegatronData", "SampleLoader", "as_blend", "batch_keys", "build_megatron_data", "sample_batches"]


def _is_prefix(p: str) -> bool:
    return os.path.isfile(idx_path(p)) or os.path.isfile(bin_path(p)) or is_mindrecord(p)


def as_blend(paths: Sequence[str]) -> Blend | None:
    """The blend ``paths`` spell, or None when they are raw corpus files/folders.

    ``paths`` are the ``--data.path`` values; an element holding spaces is split (so
    ``"0.7 A 0.3 B"`` works quoted or not). They are Megatron data when any of them is a number,
    a path prefix with a ``.bin``/``.idx`` beside it, or MindRecord data (a ``.mindrecord`` file,
    a folder or glob of them; see :mod:`mff.data.mindrecord_source`).

    Raises:
        ValueError: a malformed blend (see :func:`mff.data.blend.parse_blend`), or raw corpus
            paths mixed with indexed-dataset prefixes.
        FileNotFoundError: a blend prefix without its ``.bin``/``.idx`` files.
    """
    tokens = [t for p in paths for t in str(p).split()]
    if not tokens:
        return None
    numbers = [t for t in tokens if _number(t)]
    prefixes = [t for t in tokens if not _number(t) and _is_prefix(t)]
    if not numbers and not prefixes:
        return None
    blend = parse_blend(tokens)
    for p in blend.prefixes:
        if not _is_prefix(p):
            if os.path.exists(p):
                raise ValueError(f"--data.path mixes raw corpus paths ({p!r}) with Megatron indexed datasets {prefixes}; use one kind")
            raise FileNotFoundError(f"--data.path: no indexed dataset {p!r} (expected {idx_path(p)} and {bin_path(p)}, "
                                    "or a .mindrecord file, a folder or glob of them)")
    return blend


def _number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return not os.path.exists(tok)


@dataclass
class MegatronData:
    """The data side of a run on Megatron indexed datasets.

    Attributes:
        blend: the parsed ``--data.path``.
        train: training samples (``GPTDataset`` or ``BlendedDataset``), ``steps x batch``
            of them (Megatron's count for ``train_iters x global_batch_size``).
        val: valid-split samples (one pass of a single prefix's valid split; for a weighted
            blend the sum of the datasets' one-pass counts, blended by weight), or None when
            the split gives the valid part no weight.
        eod_id: the end-of-document id (from ``--data.tokenizer`` or ``--data.eod-id``), or None.
        tokenizer: the tokenizer of ``--data.tokenizer``, or None.
        vocab_size: the tokenizer's vocabulary size, or None without a tokenizer.
        stats: ``documents``, ``tokens`` per prefix summed, ``train_samples``, ``val_samples``.
    """

    blend: Blend
    train: Any
    val: Any
    eod_id: int | None
    tokenizer: Any
    vocab_size: int | None
    stats: dict[str, int] = field(default_factory=dict)


def _one_pass(prefix: str, cfg: GPTDatasetConfig) -> int:
    """Samples in one pass of ``prefix``'s valid split: ``(tokens - 1) // seq_len`` (each sample
    takes seq_len + 1 tokens, consecutive ones sharing one), counted from the sequence lengths
    without building any index; the row count for MindRecord rows that are packed samples."""
    ds = open_indexed(prefix)
    rng = split_ranges(cfg.split, len(ds))[1]
    if rng is None:
        return 0
    if getattr(ds, "rows_are_samples", None) and ds.rows_are_samples(cfg.seq_len):
        return rng[1] - rng[0]  # packed MindRecord rows: one sample each
    return max(0, (int(ds.sequence_lengths[rng[0]:rng[1]].sum()) - 1) // cfg.seq_len)


def build_megatron_data(cfg: DataConfig, blend: Blend, seq_len: int, seed: int, train_samples: int, quiet: bool = False) -> MegatronData:
    """Train and valid samples of ``blend`` for ``train_samples`` training samples.

    ``seed`` seeds Megatron's shuffles (pass Megatron's ``--seed``, default 1234, for its exact
    samples). The reset and masking options come from ``cfg`` (``--data.reset-position-ids``,
    ``--data.reset-attention-mask``, ``--data.eod-mask-loss``) and need the EOD id.

    Raises:
        ValueError: one of the options above without an EOD id; a bad split; see
            :func:`mff.data.blend.build_blended_gpt_datasets`.
        FileNotFoundError: a missing prefix or tokenizer.
    """
    if cfg.eod_id is not None and cfg.eod_id < 0:
        raise ValueError(f"--data.eod-id {cfg.eod_id} must be a token id >= 0")
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    eod_id = cfg.eod_id
    if tokenizer is not None:
        tok_eod = find_eod_id(tokenizer, cfg.eod_token)
        if eod_id is None:
            eod_id = tok_eod
        elif eod_id != tok_eod and not quiet:
            print(f"data: note: --data.eod-id {eod_id} is used, not the tokenizer's EOD id {tok_eod}", flush=True)
    needs_eod = cfg.reset_position_ids or cfg.reset_attention_mask or cfg.eod_mask_loss
    if needs_eod and eod_id is None:
        raise ValueError("--data.reset-position-ids, --data.reset-attention-mask and --data.eod-mask-loss need the EOD id: "
                         "pass --data.tokenizer (the tokenizer the data was made with) or --data.eod-id")
    gcfg = GPTDatasetConfig(seq_len=seq_len, seed=seed, split=cfg.split, eod_id=eod_id, reset_position_ids=cfg.reset_position_ids,
                            reset_attention_mask=cfg.reset_attention_mask, eod_mask_loss=cfg.eod_mask_loss, shuffle=cfg.shuffle)
    if blend.weights is None:
        n_val = None
    else:
        n_val = sum(_one_pass(p, gcfg) for p in blend.prefixes)
    train, val, _ = build_blended_gpt_datasets(blend, (train_samples, n_val, 0), gcfg)
    if train is None or len(train) == 0:
        raise ValueError(f"--data.split {cfg.split!r} leaves no training samples in {' '.join(blend.prefixes)}")
    indexed = [open_indexed(p) for p in blend.prefixes]
    stats = {"documents": sum(ds.num_documents for ds in indexed), "tokens": sum(int(ds.sequence_lengths.sum()) for ds in indexed),
             "train_samples": len(train), "val_samples": len(val) if val is not None else 0}
    if not quiet:
        kind = "MindRecord" if all(is_mindrecord(p) for p in blend.prefixes) else "Megatron indexed"
        unit = "rows" if kind == "MindRecord" else "documents"
        print(f"data: {kind} data {' '.join(blend.prefixes)}: {stats['documents']:,} {unit}, {stats['tokens']:,} tokens; "
              f"split {cfg.split}: {stats['train_samples']:,} train samples, {stats['val_samples']:,} valid samples of {seq_len + 1} tokens",
              flush=True)
    vocab = tokenizer.get_vocab_size() if tokenizer is not None else None
    return MegatronData(blend, train, val, eod_id, tokenizer, vocab, stats)


def _stack(samples: list[dict[str, np.ndarray]], keys: Sequence[str]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in keys}


def batch_keys(cfg: DataConfig) -> tuple[str, ...]:
    """The batch keys a run on ``cfg`` feeds the model: ``input_ids``, ``labels``, and
    ``position_ids`` / ``document_ids`` when the reset options are on."""
    keys = ["input_ids", "labels"]
    if cfg.reset_position_ids:
        keys.append("position_ids")
    if cfg.reset_attention_mask:
        keys.append("document_ids")
    return tuple(keys)


class SampleLoader:
    """Global batches of samples ``position .. position + batch_size - 1`` (mod the sample
    count), data-parallel rank r taking rows ``[r*b, (r+1)*b)`` with ``b = batch_size // dp_size``.

    Args:
        samples: a ``GPTDataset`` or ``BlendedDataset`` (already shuffled by its indices).
        batch_size: global batch size in samples.
        keys: batch keys to emit (``input_ids``, ``labels``, and ``position_ids`` /
            ``document_ids`` when the reset options are on).

    Raises:
        ValueError: ``batch_size`` < 1, a bad ``dp_rank``/``dp_size``, ``batch_size`` not
            divisible by ``dp_size``, an empty dataset.
    """

    def __init__(self, samples, batch_size: int, keys: Sequence[str] = ("input_ids", "labels"), dp_rank: int = 0, dp_size: int = 1):
        check_batch_split(batch_size, dp_rank, dp_size)
        if len(samples) == 0:
            raise ValueError("data: the training dataset has no samples")
        self.samples = samples
        self.batch_size = batch_size
        self.keys = tuple(keys)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch (int64 tensors [batch_size // dp_size,
        seq_len]); advances by ``batch_size`` samples."""
        b = self.batch_size // self.dp_size
        start = self.position + self.dp_rank * b
        n = len(self.samples)
        rows = [self.samples[(start + i) % n] for i in range(b)]
        self.position += self.batch_size
        return _stack(rows, self.keys)

    def state_dict(self) -> dict:
        """``{"kind": "megatron", "position": samples consumed globally, "num_samples": samples built}``."""
        return {"kind": "megatron", "position": self.position, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position.

        Raises:
            ValueError: a state from another kind of loader, a position outside ``[0, 2**62)``, or a sample
                count that differs (the indices, hence the stream, would differ).
        """
        if state.get("kind") != "megatron":
            raise ValueError("data: the checkpoint was trained on raw corpus files, this run reads Megatron indexed data "
                             "(the sample stream would differ; use another --ckpt-dir)")
        if not 0 <= int(state["position"]) < MAX_POSITION:
            raise ValueError(f"data: loader position must be in [0, 2**62), got {state['position']}")
        if int(state["num_samples"]) != len(self.samples):
            raise ValueError(f"data: the checkpoint's indices hold {state['num_samples']} training samples, this run's {len(self.samples)} "
                             "(the sample count is --steps x --batch-size of the first run; keep them to resume)")
        self.position = int(state["position"])


def sample_batches(samples, batch_size: int, n_batches: int, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """The first ``n_batches`` whole batches of ``samples`` in order (at least one batch, of all
    samples when there are fewer than ``batch_size``), for validation.

    Raises:
        ValueError: ``batch_size`` or ``n_batches`` < 1, or no samples.
    """
    bounds = eval_bounds(len(samples), batch_size, n_batches)
    if len(samples) == 0:
        raise ValueError("data: the validation split has no samples; lower --eval-every to 0 or change --data.split")
    return [_stack([samples[i] for i in range(a, e)], keys) for a, e in bounds]
