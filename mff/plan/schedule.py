"""Pipeline schedules on paper: each pp rank's order of forwards and backwards, how many
micro-batches' activations a rank holds at once, and the bubble.

Notation: ``p`` pp ranks, ``v`` stages per rank, ``m`` micro-batches per pipeline pass, rank
``r`` in ``0 .. p-1``; an action is ``(kind, stage, micro-batch)`` with kind ``F`` or ``B`` and
the global stage index (rank r holds stages ``r, r + p, ...``).

The orders are those of ``torch.distributed.pipelining`` (torch 2.13, ``schedules.py``), which
mff's pipeline runs (:mod:`mff.parallel.pp`):

- ``gpipe`` (``ScheduleGPipe``): all m forwards, then all m backwards.
- ``1f1b`` (``Schedule1F1B``): ``min(m, p - r)`` warm-up forwards, then a backward and a forward
  alternately, then the remaining backwards.
- ``interleaved-1f1b`` (``ScheduleInterleaved1F1B``, ``_get_warmup_ops`` and
  ``_get_1f1b_rank_ops``): micro-batches run in rounds of ``q = m // max(1, m // p)``;
  ``w = min((v - 1) q + 2 (p - 1 - r), v m)`` warm-up forwards (Megatron-LM's interleaved
  warm-up), then a forward and a backward alternately, then the remaining backwards; the k-th
  forward of the rank is for local stage ``(k // q) mod v``, the k-th backward for local stage
  ``v - 1 - (k // q) mod v``.

Activations held at once (:func:`in_flight`, in stage-micro-batches: one micro-batch through one
of the rank's stages): gpipe ``v m``; 1f1b ``min(m, p - r)``; interleaved ``min(w + 1, v m)``
(the forward that opens the steady state runs before the first backward frees anything).

Bubble (:func:`bubble_fraction`): the share of the step's time a rank is idle, with forward and
backward times equal on every stage and free point-to-point transfers: ``(p - 1) / (m + p - 1)``
for gpipe and 1f1b, ``(p - 1) / (v m + p - 1)`` for interleaved 1F1B (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2:
bubble time ``(p - 1)(t_f + t_b) / v`` against ``m (t_f + t_b)`` of work; the fraction of the
total is ``x / (1 + x)`` of their ratio x). ``tests/test_plan.py`` checks both closed forms
against a simulation of these orders with dependencies, and the interleaved order against
torch's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

__all__ = ["SCHEDULES", "rank_actions", "in_flight", "bubble_fraction", "peak_by_stage", "peak_held"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _check(schedule: str, p: int, m: int, v: int, r: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"--parallel.pp-schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if min(p, m, v) < 1 or not 0 <= r < p:
        raise ValueError(f"pipeline of p={p} ranks, m={m} micro-batches, v={v} stages per rank has no rank {r}")
    if v > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"the {schedule} schedule runs one stage per rank, not {v}")


def _warmup(p: int, m: int, v: int, r: int) -> tuple[int, int]:
    q = m // max(1, m // p)
    return min((v - 1) * q + 2 * (p - 1 - r), v * m), q


def rank_actions(schedule: str, p: int, m: int, v: int = 1, r: int = 0) -> list[tuple[str, int, int]]:
    """The order of pp rank ``r``'s actions ``(kind, global stage, micro-batch)``, as
    ``torch.distributed.pipelining`` runs them (module docstring).

    Raises:
        ValueError: an unknown schedule, sizes < 1, ``r`` outside ``0 .. p-1``, ``v`` > 1 on a
            one-stage schedule.
    """
    _check(schedule, p, m, v, r)
    return list(_actions(schedule, p, m, v, r))


def _actions(schedule: str, p: int, m: int, v: int, r: int) -> Iterator[tuple[str, int, int]]:
    """:func:`rank_actions` one at a time (unchecked)."""
    if schedule == "gpipe":
        yield from (("F", r, i) for i in range(m))
        yield from (("B", r, i) for i in range(m))
        return
    if schedule == "1f1b":
        w = min(m, p - r)
        yield from (("F", r, i) for i in range(w))
        for i in range(m - w):
            yield ("B", r, i)
            yield ("F", r, w + i)
        yield from (("B", r, i) for i in range(m - w, m))
        return
    w, q = _warmup(p, m, v, r)
    f_next, b_next = [0] * v, [0] * v

    def fwd(k: int) -> tuple[str, int, int]:
        s = (k // q) % v
        f_next[s] += 1
        return ("F", s * p + r, f_next[s] - 1)

    def bwd(k: int) -> tuple[str, int, int]:
        s = v - 1 - (k // q) % v
        b_next[s] += 1
        return ("B", s * p + r, b_next[s] - 1)

    for k in range(w):
        yield fwd(k)
    for k in range(v * m - w):
        yield fwd(w + k)
        yield bwd(k)
    for k in range(v * m - w, v * m):
        yield bwd(k)


def peak_held(schedule: str, p: int, m: int, v: int, r: int, weight: dict[int, float]) -> dict[int, int]:
    """:func:`peak_by_stage` of pp rank ``r``'s order, in time and memory independent of ``m``
    for long orders: one stage a rank holds :func:`in_flight` micro-batches at its peak; under
    interleaved 1F1B only the warm-up and the first ``q v`` pairs of the steady state are
    replayed. That is enough: the warm-up only adds; in the steady state the k-th pair's forward
    is the rank's (w + k)-th, its backward the k-th, and both cycle through the rank's stages in
    blocks of q, so after ``q v`` more pairs every stage has q more forwards and q more
    backwards and the micro-batches held by stage repeat; a backward never raises the total, and
    the last backwards only lower it. Raises ValueError as :func:`rank_actions`."""
    _check(schedule, p, m, v, r)
    if v == 1:
        return {r: in_flight(schedule, p, m, v, r)}
    w, q = _warmup(p, m, v, r)
    return peak_by_stage(list(islice(_actions(schedule, p, m, v, r), w + 2 * min(q * v, v * m - w))), weight)


def in_flight(schedule: str, p: int, m: int, v: int = 1, r: int = 0) -> int:
    """Most stage-micro-batches whose activations pp rank ``r`` holds at once (closed form,
    module docstring). Raises ValueError as :func:`rank_actions`."""
    _check(schedule, p, m, v, r)
    if schedule == "gpipe":
        return v * m
    if schedule == "1f1b":
        return min(m, p - r)
    w, _ = _warmup(p, m, v, r)
    return min(w + 1, v * m)


def peak_by_stage(actions: list[tuple[str, int, int]], weight: dict[int, float]) -> dict[int, int]:
    """How many micro-batches of each stage are held at the moment the held activations weigh
    most, ``weight[stage]`` being one micro-batch's activations of that stage (a plain replay of
    ``actions``: a forward adds its micro-batch, a backward frees it; the first such moment).
    Time linear in the actions: the running total is kept, and the counts rebuilt once for the
    moment found."""
    total, best_total, best_at = 0.0, 0.0, -1
    for k, (kind, s, _) in enumerate(actions):
        total += weight[s] if kind == "F" else -weight[s]
        if total > best_total or best_at < 0:
            best_total, best_at = total, k
    live = {s: 0 for s in weight}
    for kind, s, _ in actions[:best_at + 1]:
        live[s] += 1 if kind == "F" else -1
    return live


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a pipeline step's time (module docstring): ``(p - 1) / (m + p - 1)``
    for gpipe and 1f1b, ``(p - 1) / (v m + p - 1)`` for interleaved 1F1B; 0 for p = 1.
    Raises ValueError as :func:`rank_actions`."""
    _check(schedule, p, m, v, 0)
    return (p - 1) / (v * m + p - 1)
