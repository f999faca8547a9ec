"""Megatron-LM data blends: ``"0.7 prefixA 0.3 prefixB"`` -> one sample stream mixing datasets.

Sources (Megatron-LM ``megatron/core/datasets/``): ``utils.py`` (``normalize``,
``get_blend_from_list``), ``blended_megatron_dataset_builder.py``
(``_build_blended_dataset_splits``, ``_get_size_per_split_per_dataset``), ``blended_dataset.py``
(``BlendedDataset``) and ``helpers.cpp`` (``build_blending_indices``).

For a split of n samples and normalised weights w, dataset k is asked for
``ceil(ceil(n * w_k) * 1.005)`` samples (Megatron's 0.5% ``mid_level_dataset_surplus``) and the
blend holds ``sum_k ceil(n * w_k)`` samples, at least n. Sample i of the blend comes from the
dataset whose share lags its weight most: ``argmax_k w_k * max(i, 1) - count_k`` (ties to the
lowest k), and is that dataset's ``count_k``-th sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .gpt_dataset import SPLIT_NAMES, GPTDataset, GPTDatasetConfig, build_gpt_datasets, make_dataset, split_ranges
from .indexed import open_indexed

SURPLUS = 0.005
"""Megatron's ``mid_level_dataset_surplus``: extra share of samples each blended dataset builds."""


@dataclass(frozen=True)
class Blend:
    """A parsed blend.

    Attributes:
        prefixes: dataset path prefixes, in order.
        weights: their weights as written (not normalised); None for a single bare prefix
            (weight 1, and no blending, as Megatron's ``--data-path PREFIX``).
    """

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None


def _number(tok: str) -> float | None:
    try:
        return float(tok)
    except ValueError:
        return None


def parse_blend(spec: str | Sequence[str]) -> Blend:
    """Parse Megatron's ``--data-path`` syntax: ``PREFIX`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Args:
        spec: one string (split on whitespace) or its tokens.

    Raises:
        ValueError: an empty blend, a missing weight (a prefix where a weight belongs), a weight
            with no prefix after it, a number where a prefix belongs, or a weight that is not a
            finite positive number. The message names the token and its position.
    """
    tokens = spec.split() if isinstance(spec, str) else [str(t) for t in spec]
    if not tokens:
        raise ValueError("blend: empty; expected 'PREFIX' or 'WEIGHT PREFIX [WEIGHT PREFIX ...]'")
    if len(tokens) == 1:
        if _number(tokens[0]) is not None:
            raise ValueError(f"blend {' '.join(tokens)!r}: weight {tokens[0]!r} (token 1) has no prefix after it")
        return Blend((tokens[0],), None)
    prefixes, weights = [], []
    for i in range(0, len(tokens), 2):
        wtok = tokens[i]
        w = _number(wtok)
        if w is None:
            raise ValueError(
                f"blend {' '.join(tokens)!r}: missing weight: token {i + 1} {wtok!r} is not a number; "
                f"expected 'WEIGHT PREFIX' pairs"
            )
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"blend {' '.join(tokens)!r}: weight {wtok!r} (token {i + 1}) must be a finite number > 0")
        if i + 1 >= len(tokens):
            raise ValueError(
                f"blend {' '.join(tokens)!r}: weight {wtok!r} (token {i + 1}) has no prefix after it "
                f"(odd number of tokens: {len(tokens)})"
            )
        ptok = tokens[i + 1]
        if _number(ptok) is not None:
            raise ValueError(
                f"blend {' '.join(tokens)!r}: token {i + 2} {ptok!r} should be the prefix after weight {wtok!r}, "
                f"but it is a number"
            )
        weights.append(w)
        prefixes.append(ptok)
    return Blend(tuple(prefixes), tuple(weights))


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64 (Megatron's ``utils.normalize``)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def samples_per_dataset(weights: Sequence[float], num_samples: int, surplus: float = SURPLUS) -> tuple[list[int], list[int]]:
    """Samples each dataset contributes and builds (Megatron's ``_get_size_per_split_per_dataset``).

    Args:
        weights: normalised weights.
        num_samples: samples wanted from the blend.

    Returns:
        (targets, buffers): ``ceil(n * w_k)`` and ``ceil(ceil(n * w_k) * (1 + surplus))``.
    """
    targets = [int(math.ceil(num_samples * w)) for w in weights]
    buffers = [int(math.ceil(t * (1 + surplus))) for t in targets]
    return targets, buffers


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, each blended sample is (``helpers.cpp:build_blending_indices``).

    `weights` are normalised here first (as Megatron's ``BlendedDataset`` does). Sample i goes to
    ``argmax_k w_k * max(i, 1) - count_k`` (first maximum on ties); it is that dataset's sample
    ``count_k``, then ``count_k`` grows by one. A Python loop: about 1 s per million samples.

    Returns:
        dataset_index int16 [size], dataset_sample_index int64 [size].

    Raises:
        ValueError: no weights, a weight that is not > 0, more than 32767 datasets, or size < 0.
    """
    if not len(weights) or any(not (w > 0) for w in weights):
        raise ValueError(f"blend: weights must be a non-empty list of numbers > 0, got {list(weights)}")
    if len(weights) > 32767:
        raise ValueError(f"blend: at most 32767 datasets, got {len(weights)}")
    if size < 0:
        raise ValueError(f"blend: size must be >= 0, got {size}")
    w = normalize_weights(weights)
    k = len(w)
    if k == 1:
        return np.zeros(size, np.int16), np.arange(size, dtype=np.int64)
    counts = [0] * k
    which = [0] * size
    nth = [0] * size
    rest = range(1, k)
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_err = 0, w[0] * x - counts[0]
        for j in rest:
            err = w[j] * x - counts[j]
            if err > best_err:
                best, best_err = j, err
        which[i] = best
        nth[i] = counts[best]
        counts[best] += 1
    return np.array(which, dtype=np.int16), np.array(nth, dtype=np.int64)


class BlendedDataset:
    """Samples drawn from several datasets by precomputed blending indices.

    Args:
        datasets: the datasets (each indexable by sample number, with ``len``).
        dataset_index: int [N], which dataset sample i comes from.
        dataset_sample_index: int [N], which sample of that dataset.

    Raises:
        ValueError: the indices ask a dataset for a sample it does not have (names the dataset,
            the sample and its length).
    """

    def __init__(self, datasets: Sequence, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        self.datasets = list(datasets)
        self.dataset_index = np.asarray(dataset_index)
        self.dataset_sample_index = np.asarray(dataset_sample_index)
        if len(self.dataset_index):
            for k, ds in enumerate(self.datasets):
                sel = self.dataset_sample_index[self.dataset_index == k]
                if sel.size and sel.max() >= len(ds):
                    raise ValueError(f"blend: dataset {k} has {len(ds)} samples but the blend asks for sample {int(sel.max())}")

    def __len__(self) -> int:
        """Number of blended samples N."""
        return len(self.dataset_index)

    def source(self, i: int) -> tuple[int, int]:
        """(dataset number, sample number in it) of blended sample `i`."""
        if not 0 <= i < len(self):
            raise IndexError(f"blend: sample {i} out of range for {len(self)} samples")
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])

    def tokens(self, i: int) -> np.ndarray:
        """Token ids of blended sample `i` (see `GPTDataset.tokens`)."""
        k, j = self.source(i)
        return self.datasets[k].tokens(j)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Blended sample `i` as a training example (see `GPTDataset.__getitem__`)."""
        k, j = self.source(i)
        return self.datasets[k][j]


def build_blended_gpt_datasets(blend: str | Sequence[str] | Blend, num_samples: tuple[int | None, int | None, int | None],
                               config: GPTDatasetConfig) -> list[BlendedDataset | GPTDataset | None]:
    """Train, valid and test datasets of a blend (Megatron's ``_build_blended_dataset_splits``).

    A single bare prefix gives plain `GPTDataset` splits (`build_gpt_datasets`). Otherwise each
    prefix is split by ``config.split``, dataset k of split s is asked for
    ``ceil(ceil(n_s * w_k) * 1.005)`` samples as in Megatron, and split s blends
    ``sum_k ceil(n_s * w_k)`` samples. Where the blend takes more samples from a dataset than
    it then holds (Megatron stops there with "the blend oversamples"; it happens with uneven
    weights over small splits), that dataset is built again asked for exactly what is taken, so
    any weights work.

    Args:
        blend: see `parse_blend`.
        num_samples: samples wanted per split; with weights, each split of weight > 0 needs one.
        config: see `GPTDatasetConfig`.

    Returns:
        three datasets (None for a split of weight 0).

    Raises:
        ValueError: a bad blend or split, a weighted split without a sample count, or samples
            asked of a dataset whose part of a split holds no token (names the prefix and split).
        FileNotFoundError: a prefix whose files are missing.
    """
    b = blend if isinstance(blend, Blend) else parse_blend(blend)
    if b.weights is None:
        return build_gpt_datasets(b.prefixes[0], num_samples, config)
    weights = normalize_weights(b.weights)
    indexed = [open_indexed(p) for p in b.prefixes]
    ranges = [split_ranges(config.split, len(ds)) for ds in indexed]
    out: list[BlendedDataset | GPTDataset | None] = []
    for s, name in enumerate(SPLIT_NAMES):
        if ranges[0][s] is None:
            out.append(None)
            continue
        n = num_samples[s]
        if n is None:
            raise ValueError(f"blend: the {name} split needs a sample count when the blend has weights")
        targets, buffers = samples_per_dataset(weights, int(n))
        dataset_index, dataset_sample_index = build_blending_indices(weights, sum(targets))
        taken = np.bincount(dataset_index, minlength=len(weights)) if len(dataset_index) else np.zeros(len(weights), np.int64)
        parts = []
        for k, ds in enumerate(indexed):
            a, e = ranges[k][s]
            docs = np.arange(a, e, dtype=np.int32)
            part = make_dataset(ds, docs, buffers[k], config, name)
            if len(part) < taken[k]:  # where Megatron stops with "the blend oversamples"
                part = make_dataset(ds, docs, int(taken[k]), config, name)
            parts.append(part)
        out.append(BlendedDataset(parts, dataset_index, dataset_sample_index))
    return out
