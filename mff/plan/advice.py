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

Before a skeleton (:func:`config_state`): the same bound from the config alone, for a planner
that refuses an absurd config (a million layers) in milliseconds instead of building a skeleton
of every layer. As :func:`mff.model.estimate_param_count` counts params, it measures meta
skeletons of a few layers: the first five layers whole, then each kind of layer once (a dense and
a MoE one, from 1- and 2-layer skeletons whose every layer is of that kind) and one MTP depth of
each kind, and multiplies by how many of each the config's rule makes (one ``is_moe_layer`` call
per layer). Exact when no ``--optim.muon-adamw-params`` pattern names a layer index; beyond
:data:`EXACT_LAYERS` layers (or with such a pattern under Muon) a lower bound: every layer past
the fifth counted as the lighter kind (every hidden matrix as Muon's).

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
from mff.tree import matches

__all__ = ["EXACT_LAYERS", "ConfigState", "Suggestion", "config_state", "describe", "min_devices", "no_layout", "state_bytes",
           "suggestions"]

EXACT_LAYERS = 1_000_000
"""Layers (MTP depths included) up to which :func:`config_state` counts each layer's kind;
beyond, it gives a lower bound."""


def _state(n: int, fp32: bool, trainable: bool, matrix: bool, precision: str, optim: str) -> float:
    """Bytes of ``n`` elements of one param with its gradient and optimizer state (module docstring)."""
    b = 4 if fp32 else (2 if precision == "bf16" else 4)
    return n * b + (n * b + n * (4 if optim == "muon" and matrix else 8) if trainable else 0)


def state_bytes(shards: Sequence[ParamShard], precision: str, optim: str) -> float:
    """Bytes of the whole training state of the params ``shards`` (their ``shape``, not their
    shard): params, gradients and optimizer state in the run's dtypes (module docstring)."""
    return float(sum(_state(math.prod(s.shape), s.fp32, s.trainable, s.matrix, precision, optim) for s in shards))


def min_devices(state: float, capacity: float) -> int:
    """The smallest device count whose even share of ``state`` bytes fits in ``capacity``."""
    return max(1, math.ceil(state / capacity))


def no_layout(state: float, devices: int, capacity: float, gib: float, beyond: str = "", bound: bool = False) -> str:
    """The clause that says no layout of ``devices`` devices fits ``state`` bytes of training
    state in ``capacity`` bytes each (``beyond``: words after the need, e.g. the device's size;
    ``bound``: ``state`` is itself a lower bound, said as "at least")."""
    least = "at least " if bound else ""
    return (f"no layout of {devices:,} devices fits: the params, grads and optimizer state alone need {least}"
            f"{state / devices / gib:,.1f} GiB per device even sharded over all of them{beyond}; at least "
            f"{min_devices(state, capacity):,} devices (a lower bound: activations and working copies come on top)")


@dataclass(frozen=True)
class ConfigState:
    """What :func:`config_state` finds: ``params`` (elements), ``state`` (bytes of the params,
    grads and optimizer state), ``exact`` (False: both are lower bounds), ``blocks`` (the
    decoder layers and MTP depths the skeleton would build)."""

    params: int
    state: float
    exact: bool
    blocks: int


def config_state(family, config, *, precision: str, optim: str, adamw_patterns: Sequence[str]) -> ConfigState:
    """The params and training-state bytes of ``family`` (an :class:`mff.model.Family`) with
    ``config``, from skeletons of a few layers (module docstring): milliseconds for any layer
    count. The config is validated first.

    Raises:
        ValueError: the config's own refusal (its ``validate``).
    """
    import torch

    from mff.model import _forced

    if hasattr(config, "validate"):
        config.validate()
    L = int(config.num_hidden_layers)
    has_mtp = "num_nextn_predict_layers" in getattr(config, "__dataclass_fields__", {})
    mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0) if has_mtp else 0
    rule = getattr(config, "is_moe_layer", None)
    index_free = not any(ch.isdigit() for p in adamw_patterns for ch in p)
    muon_all = optim == "muon" and not index_free  # a pattern names a layer: count every hidden matrix as Muon's (a bound)
    frozen, fp32 = tuple(getattr(family, "frozen_params", ())), tuple(getattr(family, "fp32_params", ()))
    blocks: list[int] = []  # the block count of each skeleton measured

    def measure(cfg) -> tuple[int, float]:
        with torch.device("meta"):
            skeleton = family.skeleton(cfg)
        n = b = 0
        blocks.append(len(getattr(getattr(skeleton, "model", None), "layers", ())))
        for path, p in skeleton.named_parameters():
            k = p.numel()
            matrix = p.dim() >= 2 and (muon_all or not any(matches(a, path) for a in adamw_patterns))
            n += k
            b += _state(k, any(matches(f, path) for f in fp32), not any(matches(f, path) for f in frozen), matrix, precision, optim)
        return n, b

    def variant(layers: int, depths: int, kind: bool | None):
        """``config`` with ``layers`` layers and ``depths`` MTP depths, every one of ``kind``
        (None: as the config's rule makes them)."""
        if kind is None:
            return dataclasses.replace(config, num_hidden_layers=layers, **({"num_nextn_predict_layers": depths} if has_mtp else {}))
        out = _forced(config, kind, layers)
        if has_mtp:
            out.__dict__["num_nextn_predict_layers"] = depths
        return out

    if not dataclasses.is_dataclass(config) or (L <= 5 and mtp <= 5):
        n, b = measure(config)
        return ConfigState(n, b, not muon_all, blocks[-1])
    kinds = (False, True) if rule is not None else (None,)

    def diff(more, fewer) -> tuple[int, float]:
        (n1, b1), (n0, b0) = measure(more), measure(fewer)
        return n1 - n0, b1 - b0

    head = min(L, 5)
    n, b = measure(variant(head, 0, None))  # the first layers as the config makes them, no MTP
    if rule is None:  # one kind: every layer past the fourth has the shape of the fifth
        layer = {None: diff(variant(5, 0, None), variant(4, 0, None))}
    else:  # a dense and a MoE layer, each measured on skeletons of only that kind
        layer = {k: diff(variant(2, 0, k), variant(1, 0, k)) for k in kinds}
    depth = {k: diff(variant(1, 1, k), variant(1, 0, k)) for k in kinds} if mtp else {k: (0, 0.0) for k in kinds}
    kind_of = rule if rule is not None else (lambda i: None)
    exact = not muon_all and L + mtp <= EXACT_LAYERS
    if exact:
        for i in range(head, L):
            n, b = n + layer[kind_of(i)][0], b + layer[kind_of(i)][1]
        for j in range(mtp):
            n, b = n + depth[kind_of(L + j)][0], b + depth[kind_of(L + j)][1]
    else:  # a lower bound: every layer past the first ones and every MTP depth of the lighter kind
        n += (L - head) * min(v[0] for v in layer.values()) + mtp * min(v[0] for v in depth.values())
        b += (L - head) * min(v[1] for v in layer.values()) + mtp * min(v[1] for v in depth.values())
    built = any(v[0] for v in depth.values())  # the skeleton builds MTP depths (DeepSeek-V3), or skips them (GLM-4.5)
    return ConfigState(int(n), float(b), exact, L + (mtp if built else 0))


@dataclass(frozen=True)
class Suggestion:
    """One change of the options: ``flags`` as typed, what it does (``what``), the need in bytes
    per device of the plan with it, and whether that fits."""

    flags: str
    what: str
    need: float
    fits: bool


def _divisors(n: int, most: int = 10**6) -> list[int]:
    """The divisors of ``n`` (ascending), found by trial division up to ``min(sqrt(n), most)``
    (each with its cofactor): all of them below 10**12, milliseconds for any ``n``."""
    small = [d for d in range(1, min(math.isqrt(n), most) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


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
