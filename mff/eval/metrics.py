"""Metrics and their standard errors, as lm-evaluation-harness computes them.

- ``acc``: the choice with the highest log-likelihood is the gold one; ``acc_norm``: the same
  with each log-likelihood divided by the choice's length in characters, ``acc_bytes`` by its
  length in UTF-8 bytes (``lm_eval/api/task.py`` ``ConfigurableTask.process_results``: lm-eval
  0.4's ``acc_norm`` counts characters, its ``acc_bytes`` bytes);
- the standard error of a mean is the sample standard deviation (n - 1) over sqrt(n)
  (``lm_eval/api/metrics.py`` ``mean_stderr``);
- perplexities of rolling log-likelihoods: ``word_perplexity = exp(-sum ll / words)``,
  ``byte_perplexity = exp(-sum ll / bytes)``, ``bits_per_byte = -sum ll / bytes / ln 2``
  (``weighted_perplexity``, ``bits_per_byte``), plus the token perplexity ``exp(-sum ll / tokens)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["mean", "mean_stderr", "choice_metrics", "perplexity_metrics"]


def mean(xs: Sequence[float]) -> float:
    """Mean; raises ValueError on no values."""
    if not xs:
        raise ValueError("no values to average")
    return sum(xs) / len(xs)


def mean_stderr(xs: Sequence[float]) -> float:
    """Standard error of the mean: sample stddev (n - 1) / sqrt(n); NaN for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return float("nan")
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def _argmax(xs: Sequence[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # the first of equal maxima, as numpy.argmax


def choice_metrics(logprobs: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
    """``{"acc", "acc_norm", "acc_bytes"}`` (1.0 or 0.0) for one multiple-choice question
    (``choices`` without the delimiter that joins them to the context).

    Raises ValueError when ``gold`` is not an index of ``choices`` or the counts differ."""
    if len(logprobs) != len(choices) or not choices:
        raise ValueError(f"{len(logprobs)} log-likelihoods for {len(choices)} choices")
    if not 0 <= gold < len(choices):
        raise ValueError(f"gold index {gold} outside the {len(choices)} choices")
    norm = [lp / max(len(c), 1) for lp, c in zip(logprobs, choices)]
    per_byte = [lp / max(len(c.encode("utf-8")), 1) for lp, c in zip(logprobs, choices)]
    return {"acc": float(_argmax(logprobs) == gold), "acc_norm": float(_argmax(norm) == gold),
            "acc_bytes": float(_argmax(per_byte) == gold)}


def perplexity_metrics(logprobs: Sequence[float], tokens: Sequence[int], words: Sequence[int], bytes_: Sequence[int]) -> dict[str, float]:
    """Corpus perplexities from per-document rolling log-likelihoods (natural log) and each
    document's token, word and byte counts (word and byte counts 0 for token-only data: those
    metrics are then left out)."""
    ll = sum(logprobs)
    out = {"token_perplexity": math.exp(-ll / sum(tokens)) if sum(tokens) else float("nan"), "loglikelihood": ll, "tokens": sum(tokens)}
    if sum(words):
        out["word_perplexity"] = math.exp(-ll / sum(words))
    if sum(bytes_):
        out["byte_perplexity"] = math.exp(-ll / sum(bytes_))
        out["bits_per_byte"] = -ll / sum(bytes_) / math.log(2)
    return out
