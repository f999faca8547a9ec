"""Evaluate a :class:`mff.eval.lm.LanguageModel` on tasks: requests, scoring, metrics.

Under ``torch.distributed`` (torchrun) the documents of each task are dealt round-robin to the
ranks, each rank scores its share, and the per-document results are gathered
(``all_gather_object``) and reassembled in document order before the metrics, so the numbers
are those of one process (up to the last bits of a log-likelihood that batching moves).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mff.eval.lm import GenerationRequest, LanguageModel
from mff.eval.metrics import choice_metrics, mean, mean_stderr, perplexity_metrics
from mff.eval.task import Generation, MultipleChoice, Perplexity, Task, fewshot_context, select_docs

__all__ = ["evaluate", "resolve_task", "check_fewshot", "TaskResult"]


@dataclass
class TaskResult:
    """Metrics of one task: ``metrics`` {name: value}, ``stderr`` {name: standard error},
    ``samples`` (documents scored), ``seconds``, ``counts`` (special cases met) and
    ``details`` (per-document results, in document order)."""

    task: str
    kind: str
    metrics: dict[str, float]
    stderr: dict[str, float]
    samples: int
    num_fewshot: int
    seconds: float
    source: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    details: list[dict] = field(default_factory=list)


def resolve_task(name: str) -> Task:
    """A task from its name: a built-in benchmark, ``oe:TASK/SET``, ``ppl:FILE`` or a ``.yaml``
    task file. Raises ValueError for an unknown name (listing the known ones)."""
    from mff.eval.benchmarks import get_benchmark
    from mff.eval.taskfile import perplexity_task, read_task_file

    if name.startswith("ppl:"):
        return perplexity_task(name)
    if name.endswith((".yaml", ".yml")):
        return read_task_file(name)
    return get_benchmark(name)


def check_fewshot(task: Task, k: int) -> None:
    """Raises ValueError when ``k`` > 0 examples are asked of a task without prompts of ours
    (a perplexity task, or ready-made prompts whose shots are in the file)."""
    if not k:
        return
    if isinstance(task, Perplexity):
        raise ValueError(f"--num-fewshot {k}: task {task.name} is a perplexity task (no prompts)")
    if getattr(task, "ready_made", False):
        raise ValueError(f"--num-fewshot {k}: task {task.name} holds ready-made prompts (their shots are part of the file)")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(mine: list[tuple[int, Any]], n: int) -> list[Any]:
    """Every rank's ``(doc index, result)`` pairs -> results in doc order (on every rank)."""
    rank, world = _world()
    if world > 1:
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, mine)
        mine = [x for part in parts for x in part]
    out: list[Any] = [None] * n
    for i, r in mine:
        out[i] = r
    return out


def _summarise(per_doc: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    keys = sorted({k for d in per_doc for k in d})
    metrics = {k: mean([d.get(k, 0.0) for d in per_doc]) for k in keys}
    stderr = {k: mean_stderr([d.get(k, 0.0) for d in per_doc]) for k in keys}
    return metrics, stderr


def evaluate(lm: LanguageModel, tasks: Sequence[Task], *, limit: int | None = None, num_fewshot: int | None = None, seed: int = 0,
             progress: Callable[[str, int, int], None] | None = None) -> list[TaskResult]:
    """Score ``lm`` on each task.

    Args:
        limit: documents per task (the first ones; evenly spaced for tasks sorted by subject).
        num_fewshot: examples per prompt (default: each task's own default).
        seed: few-shot draws and sampled generation.
        progress: ``(task name, requests done, requests)`` after each batch (each rank counts its own share).
    Returns:
        One :class:`TaskResult` per task, in order.
    Raises:
        ValueError: ``limit`` < 1, ``num_fewshot`` < 0 or larger than a task's pool, few-shot
            asked of a perplexity task, a task whose data is empty.
    """
    if num_fewshot is not None and (isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise ValueError(f"--num-fewshot {num_fewshot!r} must be an int >= 0")
    rank, world = _world()
    results = []
    for task in tasks:
        t0 = time.perf_counter()
        docs = task.load()
        if not docs:
            raise ValueError(f"task {task.name}: no documents")
        chosen = select_docs(docs, limit, task.spread)
        mine = chosen[rank::world]
        k = task.num_fewshot if num_fewshot is None else num_fewshot
        before = lm.stats.as_dict()
        tick = (lambda done, total, name=task.name: progress(name, done, total)) if progress else None
        check_fewshot(task, k)
        if isinstance(task, Perplexity):
            per_doc, metrics, stderr = _perplexity(lm, docs, mine, tick)
        else:
            pool = task.fewshot_load() if (k and task.fewshot_load is not None) else None
            prompts = {i: fewshot_context(task, docs, i, k, seed, pool) for i in mine}
            if isinstance(task, MultipleChoice):
                per_doc = _multiple_choice(lm, task, docs, prompts, mine, tick)
            else:
                per_doc = _generation(lm, task, docs, prompts, mine, tick)
            per_doc = [d for d in _gather(per_doc, len(docs)) if d is not None]
            metrics, stderr = _summarise([{k2: v for k2, v in d.items() if isinstance(v, float)} for d in per_doc])
        after = lm.stats.as_dict()
        counts = {k2: after[k2] - before[k2] for k2 in after}
        if world > 1:
            parts: list[Any] = [None] * world
            dist.all_gather_object(parts, counts)
            counts = {k2: sum(p[k2] for p in parts) for k2 in counts}
        results.append(TaskResult(task.name, task.kind, metrics, stderr, len(chosen), k, time.perf_counter() - t0, task.source,
                                  counts, per_doc))
    return results


def _multiple_choice(lm, task: MultipleChoice, docs, prompts, mine, tick) -> list[tuple[int, dict]]:
    reqs, owner = [], []
    for i in mine:
        for c in docs[i]["choices"]:
            reqs.append((prompts[i], task.target_delimiter + c))
            owner.append(i)
    lls = lm.loglikelihood(reqs, progress=tick)
    by_doc: dict[int, list[tuple[float, bool]]] = {}
    for i, r in zip(owner, lls):
        by_doc.setdefault(i, []).append(r)
    out = []
    for i in mine:
        d = docs[i]
        lp = [x[0] for x in by_doc[i]]
        out.append((i, {**choice_metrics(lp, d["choices"], d["gold"]), "loglikelihoods": lp, "gold": d["gold"]}))
    return out


def _generation(lm, task: Generation, docs, prompts, mine, tick) -> list[tuple[int, dict]]:
    reqs = [GenerationRequest(prompts[i], task.until, task.max_gen_toks) for i in mine]
    try:
        texts = lm.generate_until(reqs, progress=tick)
    except ValueError as e:
        raise ValueError(f"task {task.name}: {e}") from None
    out = []
    for i, text in zip(mine, texts):
        scores = {k: float(v) for k, v in task.score(docs[i], text).items()}
        out.append((i, {**scores, "completion": text}))
    return out


def _perplexity(lm, docs, mine, tick):
    """Text docs are encoded once (the token count is that of the scored sequence); token docs
    are scored as they are, after the prefix token when there is one."""
    prefix = lm.prefix_id
    seqs, counts = [], []
    for i in mine:
        d = docs[i]
        if "ids" in d:
            seqs.append(([prefix] if prefix is not None else []) + list(d["ids"]))
            counts.append((0, 0))
        else:
            seqs.append(lm.rolling_sequence(d["text"]))
            counts.append((len(re.split(r"\s+", d["text"])), len(d["text"].encode("utf-8"))))
    lls = lm.rolling_ids(seqs, progress=tick)
    per = [(i, {"loglikelihood": ll, "tokens": len(seq) - 1, "words": words, "bytes": nbytes})
           for i, ll, seq, (words, nbytes) in zip(mine, lls, seqs, counts)]
    per_doc = [d for d in _gather(per, len(docs)) if d is not None]
    metrics = perplexity_metrics([d["loglikelihood"] for d in per_doc], [d["tokens"] for d in per_doc],
                                 [d["words"] for d in per_doc], [d["bytes"] for d in per_doc])
    stderr = {k: math.nan for k in metrics}
    return per_doc, metrics, stderr
