"""What to say when a layout does not fit: a lower bound on the memory per device that no layout
of the device count can go under, and which single changes of the run's options would lower the
need, each tried on paper.

Lower bound (:func:`state_bytes`): every param of the model, its gradient and its optimizer
state, in the run's dtypes (params and grads 4 bytes an element, or 2 in ``bf16``, the fp32
router weight and expert bias 4 in every precision; AdamW 8 bytes a trainable element, Muon 4 for
hidden matrices), divided over all devices: what a device would hold if the whole training state
were sharded evenly over every device, with no activations, no working copies and no copy held
twice. No layout needs less, so when that already exceeds the device's memory no layout of that
device count fits; the smallest device count at which it fits, ``ceil(state / capacity)``, is a
lower bound on the devices the run needs.

Suggestions (:func:`suggestions`): each option the layout does not already use at its limit is
changed alone (the others kept) and the plan's memory recomputed; a change is named with its
exact flags when it lowers the need, with the first value that fits or, when none does, the
value that needs least; when some fit only those are named. The options tried, in order: ``--ac`` (selective, full), smaller
micro-batches (``--parallel.pp-microbatches`` under pipelining, ``--grad-accum``), the 1F1B
schedule instead of GPipe, more ``--parallel.pp``, ``--parallel.ep``, ``--parallel.tp``, fewer
``--parallel.dp-replicate`` (its ranks sharding instead), ``--optim.name muon``, a precision with
fewer bytes, and more ``--devices``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mff.plan.shards import ParamShard

__all__ = ["Suggestion", "describe", "min_devices", "state_bytes", "suggestions"]


def state_bytes(shards: Sequence[ParamShard], precision: str, optim: str) -> float:
    """Bytes of the whole training state of the params ``shards`` (their ``shape``, not their
    shard): params, gradients and optimizer state in the run's dtypes (module docstring)."""
    storage = 2 if precision == "bf16" else 4
    total = 0.0
    for s in shards:
        n = math.prod(s.shape)
        b = 4 if s.fp32 else storage
        total += n * b
        if s.trainable:
            total += n * b + n * (4 if optim == "muon" and s.matrix else 8)
    return total


def min_devices(state: float, capacity: float) -> int:
    """The smallest device count whose even share of ``state`` bytes fits in ``capacity``."""
    return max(1, math.ceil(state / capacity))


@dataclass(frozen=True)
class Suggestion:
    """One change of the options: ``flags`` as typed, what it does (``what``), the need in bytes
    per device of the plan with it, and whether that fits."""

    flags: str
    what: str
    need: float
    fits: bool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _spread(values: list[int], most: int = 5) -> list[int]:
    """At most ``most`` of ``values`` (ascending), the first and last kept, evenly spread."""
    if len(values) <= most:
        return values
    step = (len(values) - 1) / (most - 1)
    return sorted({values[round(i * step)] for i in range(most)})


def suggestions(model, *, devices: int, sizes: dict[str, int], parallel, train_cfg, rows: int, microbatches: int,
                need: float, capacity: float, evaluate: Callable[[int, object, object], tuple[float, dict[str, int]]]) -> list[Suggestion]:
    """The single changes that lower ``need`` (bytes per device of the layout ``sizes``, ``rows``
    sequences a micro-batch, ``microbatches`` a pipeline pass), fitting ones first (module
    docstring). ``evaluate(devices, parallel, train_cfg)`` returns the need of another choice
    and its mesh sizes, or raises ValueError when the recipes refuse it."""
    pp, tp, ep, rep = sizes["pp"], sizes["tp"], sizes["ep"], sizes["dp_replicate"]
    dp = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["ep"]
    explicit = parallel.dp_shard != -1
    L = model.config.num_hidden_layers
    experts = next((layer.mlp.experts.num_experts for layer in model.skeleton.model.layers if hasattr(layer.mlp, "experts")), 0)
    rep_ = dataclasses.replace
    groups: list[tuple[str, list[tuple[str, int, object, object]]]] = []  # (what, [(flags, devices, parallel, train_cfg)])

    def par(**kw) -> object:
        return rep_(parallel, **kw, **({"dp_shard": -1} if explicit else {}))

    if train_cfg.ac != "full":
        acs = ["selective", "full"] if train_cfg.ac == "none" else ["full"]
        groups.append(("keep less for the backward", [(f"--ac {a}", devices, parallel, rep_(train_cfg, ac=a)) for a in acs]))
    if rows > 1:
        if pp > 1:
            per_pass = rows * microbatches
            ms = _spread([m for m in _divisors(per_pass) if m > microbatches])
            groups.append(("smaller micro-batches", [(f"--parallel.pp-microbatches {m}", devices, rep_(parallel, pp_microbatches=m), train_cfg)
                                                     for m in ms]))
        per_dp = train_cfg.batch_size // dp
        gs = _spread([g for g in _divisors(per_dp) if g > train_cfg.grad_accum and (per_dp // g) % microbatches == 0])
        groups.append(("smaller micro-batches", [(f"--grad-accum {g}", devices, parallel, rep_(train_cfg, grad_accum=g)) for g in gs]))
    if pp > 1 and parallel.pp_schedule == "gpipe":
        groups.append(("fewer micro-batches in flight", [("--parallel.pp-schedule 1f1b", devices, rep_(parallel, pp_schedule="1f1b"), train_cfg)]))
    if parallel.pp_layers is None:
        v = 2 if parallel.pp_schedule == "interleaved-1f1b" and parallel.pp_stages_per_rank is None else (parallel.pp_stages_per_rank or 1)
        rest = devices // (rep * ep * tp)
        pps = _spread([p for p in _divisors(rest) if p > pp and p * v <= L])
        groups.append(("more pipeline stages", [(f"--parallel.pp {p}", devices, par(pp=p), train_cfg) for p in pps]))
    if experts:
        eps = _spread([e for e in _divisors(experts) if e > ep and devices % (pp * rep * e * tp) == 0])
        groups.append(("more expert parallelism", [(f"--parallel.ep {e}", devices, par(ep=e), train_cfg) for e in eps]))
    tps = [t for t in (2, 4, 8, 16) if t > tp and devices % (pp * rep * ep * t) == 0]
    groups.append(("more tensor parallelism", [(f"--parallel.tp {t}", devices, par(tp=t), train_cfg) for t in tps]))
    if rep > 1:
        reps = sorted((r for r in _divisors(rep) if r < rep), reverse=True)
        groups.append(("shard over the replicas", [(f"--parallel.dp-replicate {r}", devices, par(dp_replicate=r), train_cfg) for r in reps]))
    if train_cfg.optim.name != "muon":
        groups.append(("one optimizer moment for the matrices",
                       [("--optim.name muon", devices, parallel, rep_(train_cfg, optim=rep_(train_cfg.optim, name="muon")))]))
    lower = {"fp32": ["bf16-mixed", "bf16"], "bf16-mixed": ["bf16"]}.get(train_cfg.precision, [])
    groups.append(("fewer bytes per value", [(f"--precision {p}", devices, parallel, rep_(train_cfg, precision=p)) for p in lower]))
    groups.append(("more devices", [(f"--devices {devices * k}", devices * k, par(), train_cfg) for k in (2, 4, 8, 16)]))

    found: list[Suggestion] = []
    for what, tries in groups:
        best = None
        for flags, n, p, t in tries:
            try:
                got, new_sizes = evaluate(n, p, t)
            except ValueError:
                continue
            if explicit and new_sizes["dp_shard"] != sizes["dp_shard"]:
                flags += f" --parallel.dp-shard {new_sizes['dp_shard']}"
            cand = Suggestion(flags, what, got, got <= capacity)
            if cand.fits:
                best = cand
                break
            if got < need and (best is None or got < best.need):
                best = cand
        if best is not None and best.need < need:
            found.append(best)
    return sorted(found, key=lambda s: not s.fits)


def describe(found: Sequence[Suggestion], gib: float) -> str:
    """The suggestions as one clause: the changes that fit (``try --ac full (...: 52.1 GiB) or
    ...``), else the ones that lower the need, least need first."""
    if not found:
        return ("no single change of --ac, the micro-batch size, --parallel.*, --optim.name, --precision or --devices (up to 16 "
                "times as many) lowers it")
    fit = [s for s in found if s.fits]
    pick = fit or sorted(found, key=lambda s: s.need)
    parts = [f"{s.flags} ({s.what}: {s.need / gib:.1f} GiB)" for s in pick]
    text = ", ".join(parts[:-1]) + (" or " if len(parts) > 1 else "") + parts[-1]
    return f"fits with {text}" if fit else f"no single change fits; each of these lowers it: {text}"
