"""Which layers each pipeline stage holds: the split of a model's decoder layers into stages and
the placement of stages on pp ranks.

A run with ``pp`` ranks and ``v`` stages per rank has ``S = pp v`` stages. Stage ``s`` holds a
contiguous run of decoder layers; the first stage also holds the token embedding, the last the
final norm, the output head, the loss and the MTP depths (DeepSeek-V3's MTP modules sit after
the last layer, so they go with the head). Stages are placed round-robin ("loop" order, as
torch.distributed.pipelining's interleaved schedules and Megatron's virtual pipeline expect):
rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``.

The split is given by hand (``--parallel.pp-layers 3,5``: layers per stage) or balanced: each
layer has a cost (its param count or its training FLOPs per token), the embedding adds to the
first stage's cost and the head and MTP depths to the last stage's, and the split minimises the
most expensive stage (the pipeline runs at the pace of its slowest stage), every stage keeping at
least one layer. This is the "linear partition" problem, solved exactly by binary search over
the bottleneck with a greedy check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StageLayout", "parse_pp_layers", "balanced_split", "stage_layout", "stages_per_rank", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class StageLayout:
    """Stages of a pipeline: ``layers[s]`` the decoder layer indices ``range`` of stage ``s``
    (MTP depths are not counted: they go with the last stage), ``pp`` ranks, ``per_rank``
    stages per rank. Stage ``s`` lives on pp rank ``s % pp``."""

    layers: tuple[range, ...]
    pp: int
    per_rank: int

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def rank_of(self, stage: int) -> int:
        """The pp rank that holds ``stage``."""
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The stages pp rank ``rank`` holds, in order."""
        return list(range(rank, self.num_stages, self.pp))


def stages_per_rank(schedule: str, given: int | None) -> int:
    """Stages per pp rank: ``given``, else 2 for ``interleaved-1f1b`` and 1 otherwise.

    Raises:
        ValueError: an unknown schedule, ``given`` < 1, more than one stage per rank for a
            schedule that runs one (gpipe, 1f1b).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"--parallel.pp-schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if given is None:
        return 2 if schedule == "interleaved-1f1b" else 1
    if not isinstance(given, int) or given < 1:
        raise ValueError(f"--parallel.pp-stages-per-rank {given!r}: must be an integer >= 1")
    if given > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"--parallel.pp-stages-per-rank {given}: the {schedule} schedule runs one stage per rank; "
                         "use --parallel.pp-schedule interleaved-1f1b for several")
    return given


def parse_pp_layers(text: str, num_stages: int, num_layers: int) -> list[int]:
    """Layers per stage from ``--parallel.pp-layers`` text (``"3,5"``).

    Raises:
        ValueError: not comma-separated integers, a count other than ``num_stages``, a stage
            with fewer than one layer, or a sum other than ``num_layers`` (the message names the
            layers left out or the excess).
    """
    flag = "--parallel.pp-layers"
    try:
        counts = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated layer counts, one per stage (e.g. 3,5)") from None
    if len(counts) != num_stages:
        raise ValueError(f"{flag} {text!r} gives {len(counts)} stages; the pipeline has {num_stages} (pp x stages per rank)")
    if min(counts) < 1:
        raise ValueError(f"{flag} {text!r}: every stage needs at least one layer")
    total = sum(counts)
    if total != num_layers:
        if total < num_layers:
            raise ValueError(f"{flag} {text!r} covers {total} layers; the model has {num_layers}, so layers "
                             f"{total}..{num_layers - 1} would be in no stage")
        raise ValueError(f"{flag} {text!r} covers {total} layers; the model has only {num_layers}")
    return counts


def balanced_split(costs: Sequence[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layers per stage minimising the largest stage cost.

    ``costs[i]`` is layer i's cost; ``first_extra`` is added to the first stage (embedding),
    ``last_extra`` to the last (final norm, head, MTP depths). Every stage gets at least one
    layer; among splits with the same bottleneck the greedy fill puts layers as early as
    possible. Exact for non-negative costs.

    Raises:
        ValueError: fewer layers than stages, or a negative cost.
    """
    n = len(costs)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"{n} layers cannot fill {num_stages} pipeline stages (each stage needs at least one layer)")
    if min(costs, default=0) < 0 or first_extra < 0 or last_extra < 0:
        raise ValueError("layer costs must be >= 0")

    def fill(limit: float) -> list[int] | None:
        """Greedy: each stage but the last takes layers while it stays within ``limit``, leaving
        one layer for each later stage; the last takes the rest. None when that exceeds ``limit``."""
        out, i = [], 0
        for s in range(num_stages - 1):
            cost, start = (first_extra if s == 0 else 0.0), i
            while i < n - (num_stages - 1 - s) and (i == start or cost + costs[i] <= limit):
                cost += costs[i]
                i += 1
            if cost > limit:
                return None
            out.append(i - start)
        if sum(costs[i:]) + last_extra + (first_extra if num_stages == 1 else 0.0) > limit:
            return None
        return [*out, n - i]

    lo = max(max(costs), first_extra + costs[0], last_extra + costs[-1])
    hi = sum(costs) + first_extra + last_extra
    best = fill(hi)
    assert best is not None
    for _ in range(100):  # bisection on the bottleneck (floats): 100 halvings reach machine precision
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return best


def stage_layout(num_layers: int, pp: int, per_rank: int, layers_text: str | None = None, costs: Sequence[float] | None = None,
                 first_extra: float = 0.0, last_extra: float = 0.0) -> StageLayout:
    """The stages of ``num_layers`` decoder layers on ``pp`` ranks with ``per_rank`` stages
    each: from ``layers_text`` (``--parallel.pp-layers``) when given, else balanced over
    ``costs`` (default: every layer costs 1) with the embedding and head costs.

    Raises:
        ValueError: ``pp`` or ``per_rank`` < 1, more stages than layers (the message names both
            and the flags), or a bad ``layers_text`` (:func:`parse_pp_layers`).
    """
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"--parallel.pp {pp!r}: must be an integer >= 1")
    stages = pp * per_rank
    if stages > num_layers:
        per = f" x {per_rank} stages per rank" if per_rank > 1 else ""
        raise ValueError(f"--parallel.pp {pp}{per} makes {stages} pipeline stages, more than the model's {num_layers} layers "
                         "(each stage needs at least one layer)")
    if layers_text is not None:
        counts = parse_pp_layers(layers_text, stages, num_layers)
    else:
        counts = balanced_split(list(costs) if costs is not None else [1.0] * num_layers, stages, first_extra, last_extra)
    bounds, start = [], 0
    for c in counts:
        bounds.append(range(start, start + c))
        start += c
    return StageLayout(tuple(bounds), pp, per_rank)
