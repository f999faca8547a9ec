"""The three kinds of evaluation task and how their prompts are built.

A task is data plus a rule to turn each document into requests:

- :class:`MultipleChoice`: docs ``{"query", "choices", "gold"}``; one log-likelihood request
  per choice (``context = few-shot examples + query``, ``continuation = target_delimiter +
  choice``); metrics ``acc``, ``acc_norm``, ``acc_bytes`` (:func:`mff.eval.metrics.choice_metrics`).
- :class:`Generation`: docs ``{"query", "target", ...}``; one ``generate_until`` request per doc,
  scored by the task's ``score(doc, completion) -> {metric: value}``.
- :class:`Perplexity`: docs ``{"text"}`` or ``{"ids"}``; one rolling log-likelihood per doc.

Few-shot prompts follow lm-evaluation-harness (``lm_eval/api/task.py`` ``fewshot_context``):
``description + (query + target_delimiter + target) * k joined by fewshot_delimiter +
fewshot_delimiter + query``. The ``k`` examples are drawn (seeded, per document) from the task's
few-shot pool, which is its own documents less the one being asked when it has no other split.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MultipleChoice", "Generation", "Perplexity", "Task", "fewshot_context", "select_docs"]


@dataclass
class _Prompted:
    """What prompted tasks share: ``load() -> docs``; ``description(doc) -> str`` starts every
    prompt; ``fewshot_load``: a separate few-shot pool (default: the other docs), drawn within
    the docs' ``fewshot_group`` field when set; ``spread``: ``--limit`` takes evenly spaced docs."""

    name: str
    load: Callable[[], list[dict]]
    description: Callable[[dict], str] = field(default=lambda doc: "", kw_only=True)
    target_delimiter: str = field(default=" ", kw_only=True)
    fewshot_delimiter: str = field(default="\n\n", kw_only=True)
    num_fewshot: int = field(default=0, kw_only=True)
    fewshot_load: Callable[[], list[dict]] | None = field(default=None, kw_only=True)
    fewshot_group: str | None = field(default=None, kw_only=True)
    spread: bool = field(default=False, kw_only=True)
    source: str = field(default="", kw_only=True)


@dataclass
class MultipleChoice(_Prompted):
    """A multiple-choice task over docs ``{"query", "choices", "gold"}``; ``ready_made``: the
    queries are finished prompts (their few-shot examples included), so no shots are added."""

    ready_made: bool = field(default=False, kw_only=True)
    kind: str = field(default="multiple_choice", init=False)

    def target(self, doc: dict) -> str:
        return doc["choices"][doc["gold"]]


@dataclass
class Generation(_Prompted):
    """A generation task: ``score(doc, completion) -> {metric: 0/1 or value}``, the text
    generated until one of ``until`` (or ``max_gen_toks`` tokens)."""

    score: Callable[[dict, str], dict[str, float]]
    until: tuple[str, ...] = field(default=(), kw_only=True)
    max_gen_toks: int = field(default=256, kw_only=True)
    kind: str = field(default="generate_until", init=False)

    def target(self, doc: dict) -> str:
        return doc["target"]


@dataclass
class Perplexity:
    """Rolling log-likelihood over documents ``{"text"}`` (text) or ``{"ids"}`` (token ids)."""

    name: str
    load: Callable[[], list[dict]]
    source: str = ""
    num_fewshot: int = 0
    spread: bool = False
    kind: str = field(default="loglikelihood_rolling", init=False)


Task = MultipleChoice | Generation | Perplexity


def select_docs(docs: Sequence[Any], limit: int | None, spread: bool = False) -> list[int]:
    """Indices of the docs to evaluate: all, the first ``limit``, or with ``spread`` ``limit``
    evenly spaced ones (for data sorted by subject, such as MMLU). Raises ValueError for
    ``limit`` < 1."""
    n = len(docs)
    if limit is None or limit >= n:
        return list(range(n))
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"--limit {limit!r} must be an int >= 1 (the number of documents per task)")
    if spread:
        return [i * n // limit for i in range(limit)]
    return list(range(limit))


def fewshot_context(task: MultipleChoice | Generation, docs: Sequence[dict], i: int, k: int, seed: int,
                    pool: Sequence[dict] | None = None) -> str:
    """The prompt of document ``i`` with ``k`` examples (see the module docstring).

    Raises:
        ValueError: ``k`` larger than the pool (the task, its size and the largest ``k`` named).
    """
    doc = docs[i]
    shots: list[dict] = []
    if k > 0:
        if pool is None:
            cands = [j for j in range(len(docs)) if j != i]
            if task.fewshot_group is not None:
                cands = [j for j in cands if docs[j].get(task.fewshot_group) == doc.get(task.fewshot_group)]
            items = [docs[j] for j in cands]
        else:
            items = [d for d in pool if task.fewshot_group is None or d.get(task.fewshot_group) == doc.get(task.fewshot_group)]
        if k > len(items):
            scope = f" in its {task.fewshot_group} {doc.get(task.fewshot_group)!r}" if task.fewshot_group else ""
            raise ValueError(f"--num-fewshot {k} is larger than the few-shot pool of {task.name} ({len(items)} examples{scope}); "
                             f"use at most {len(items)}")
        shots = random.Random(f"{seed}:{task.name}:{i}").sample(items, k)
    parts = [d["query"] + task.target_delimiter + task.target(d) for d in shots]
    return task.description(doc) + "".join(p + task.fewshot_delimiter for p in parts) + doc["query"]
