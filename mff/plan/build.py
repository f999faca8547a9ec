"""A whole plan: the layout, per pp rank its memory, communication and FLOPs, the bubble and the
step estimate, as one JSON-ready dict (what ``python -m mff.recipes.plan`` prints and writes).

Every pp rank's memory, FLOPs and communication are computed. The memory section is the most
loaded rank's (``memory_gib.pp_rank``); the compute and communication sections are the slowest
rank's (``communication.pp_rank``, ``compute.pp_rank``): the one whose time per micro-batch the
step estimate runs the pipeline at (``estimate.slowest_pp_rank``); ``per_pp_rank`` lists every
rank's totals. A layout that does not fit raises :class:`PlanDoesNotFit` with the need, the
excess and what to change (:mod:`mff.plan.advice`), or, with ``refuse=False``, is planned anyway
and says so (``memory_gib.fits``, ``memory_gib.does_not_fit``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mff.parallel.mesh import MESH_AXES, ParallelConfig
from mff.plan.activations import LayerKinds, stage_activations
from mff.plan.advice import ConfigState, config_state, describe, no_layout, state_bytes, suggestions
from mff.plan.comm import CommRow, comm_seconds, fsdp_rows, layer_rows, pp_rows
from mff.plan.devices import Device, get_device
from mff.plan.estimate import check_efficiency, check_overlap, estimate_step, optimizer_seconds, stage_flops_per_token
from mff.plan.layout import check_devices, check_mesh, resolve_layout
from mff.plan.memory import GIB, ROWS, RankMemory, rank_memory
from mff.plan.schedule import bubble_fraction, peak_held
from mff.plan.shards import param_shards

__all__ = ["MAX_LAYERS", "PlanDoesNotFit", "check_config", "make_plan", "stage_text"]

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")

MAX_LAYERS = 10_000
"""The most decoder layers (MTP depths included) the planner plans: it builds a meta skeleton of
every layer (about a millisecond each) before it plans them. Published models have at most a few
hundred."""


class PlanDoesNotFit(ValueError):
    """The layout needs more memory per device than the device has (the message says how much,
    and what would fit or that no layout of the device count can)."""


def _a(name: str) -> str:
    """``name`` with its indefinite article as it is read aloud: "an H800", "an Atlas", "a B200"."""
    spelled = len(name) > 1 and (name[1].isdigit() or name[1].isupper())  # a letter read as its name: H800, SXM
    vowel = name[:1].upper() in ("AEFHILMNORSX" if spelled else "AEIOU")
    return f"{'an' if vowel else 'a'} {name}"


_SIZES = ("num_hidden_layers", "num_nextn_predict_layers", "hidden_size", "vocab_size", "intermediate_size", "moe_intermediate_size",
          "n_routed_experts", "num_experts")


def _state_message(family: str, size: str, config, st: ConfigState, devices: int, device: Device) -> str:
    """No layout of ``devices`` fits the model's training state (:func:`mff.plan.advice.no_layout`),
    naming the config's sizes and its param count."""
    sizes = ", ".join(f"{k} {getattr(config, k)}" for k in _SIZES if hasattr(config, k))
    least = "" if st.exact else "at least "
    return (f"{family} {size} as configured ({sizes}) has {least}{st.params:,} params; "
            + no_layout(st.state, devices, device.hbm_gib * GIB, GIB, beyond=f", more than the {device.hbm_gib:g} GiB of {_a(device.name)}",
                        bound=not st.exact))


def check_config(family, size: str, config, *, hardware: str, devices: int, train_cfg, refuse: bool = True) -> ConfigState:
    """Refuse a config before its skeleton is built, in milliseconds whatever its layer count:
    ``refuse``: when its params, grads and optimizer state (:func:`mff.plan.advice.config_state`)
    exceed the memory of ``devices`` devices of ``hardware`` even sharded evenly over all of them
    (no layout fits); and a config of more than :data:`MAX_LAYERS` layers. ``family``: an
    :class:`mff.model.Family`; ``train_cfg``: its precision and optimizer are read.

    Raises:
        ValueError: an unknown hardware, a device count < 1, the config's own refusal, more
            than :data:`MAX_LAYERS` layers.
        PlanDoesNotFit: (``refuse``) no layout of ``devices`` devices fits the training state.
    """
    device = get_device(hardware)
    check_devices(devices)
    st = config_state(family, config, precision=train_cfg.precision, optim=train_cfg.optim.name,
                      adamw_patterns=train_cfg.optim.muon_adamw_params)
    if refuse and st.state / devices > device.hbm_gib * GIB:
        raise PlanDoesNotFit(_state_message(family.name, size, config, st, devices, device))
    if st.blocks > MAX_LAYERS:
        L = config.num_hidden_layers
        what = f"--model.num-hidden-layers {L}" + (f" + --model.num-nextn-predict-layers {st.blocks - L}" if st.blocks > L else "")
        raise ValueError(f"{what}: {st.blocks:,} layers, more than the {MAX_LAYERS:,} the planner plans (it builds a meta skeleton of "
                         "every layer before planning them; published models have at most a few hundred)")
    return st


class _Index:
    """Lookups over the model's params made once per plan, so that the many stages, pp ranks
    and layouts a plan and its advice try cost in proportion to their layers, not to every
    param of the model each: the param paths as runs of one group each (a decoder layer, the
    embedding, the rest), the params shared by the first and last stage, and the layers' kinds."""

    def __init__(self, model):
        self.model, self.shapes = model, model.param_shapes()
        L = model.config.num_hidden_layers
        self.shared = list(model.shared_keys())
        shared = set(self.shared)
        self.runs: list[tuple[object, list[str]]] = []
        for path in self.shapes:
            parts = path.split(".", 3)
            if parts[:2] == ["model", "layers"]:
                group: object = int(parts[2]) if int(parts[2]) < L else "last"
            elif parts[:2] == ["model", "embed_tokens"]:
                group = "shared" if path in shared else "embed"
            else:
                group = "last"
            if self.runs and self.runs[-1][0] == group:
                self.runs[-1][1].append(path)
            else:
                self.runs.append((group, [path]))
        self.layer_runs: dict[int, list[int]] = {}
        self.other_runs: list[int] = []
        for pos, (group, _) in enumerate(self.runs):
            (self.layer_runs.setdefault(group, []) if isinstance(group, int) else self.other_runs).append(pos)
        self.kinds = LayerKinds(model)
        self._routed: dict[int, float] = {}

    def stage_keys(self, layers: range, first: bool, last: bool) -> list[str]:
        """:meth:`mff.model.Model.stage_keys`, in the same order."""
        keep = {"embed": first, "shared": first or last, "last": last}
        pos = [p for i in layers for p in self.layer_runs.get(i, ())] + [p for p in self.other_runs if keep[self.runs[p][0]]]
        return [path for p in sorted(pos) for path in self.runs[p][1]]

    def routed_flops(self, i: int) -> float:
        """:func:`_routed_flops` of block ``i`` (once per kind)."""
        rep = self.kinds.rep.get(i, i)
        if rep not in self._routed:
            self._routed[rep] = _routed_flops(self.model.skeleton.model.layers[rep])
        return self._routed[rep]


@dataclass(frozen=True)
class _Rank:
    keys: list[str]
    layers: list[int]
    stages: list[int]
    memory: RankMemory
    flops: float
    ac_factor: float
    rows: list[CommRow]
    once: list[CommRow]


def _memory(model, layout, r: int, shards, blocks, cfg, c: int, index: _Index) -> tuple[list[str], list[int], list[int], RankMemory]:
    S, pp, L = layout.stages.num_stages, layout.sizes["pp"], model.config.num_hidden_layers
    local = list(layout.stages.stages_of(r))
    n_blocks = len(model.skeleton.model.layers)
    keys: dict[str, None] = {}
    layers, stages, none_stages = [], {}, {}
    for s in local:
        first, last = s == 0, s == S - 1
        rng = layout.stages.layers[s]
        keys.update(dict.fromkeys(index.stage_keys(rng, first, last) if pp > 1 else index.shapes))
        layers += list(rng) + (list(range(L, n_blocks)) if last else [])
        stages[s] = stage_activations(model, rng, first, last, c, layout.sizes["tp"], cfg.ac, received=s > 0, sent=s < S - 1,
                                      kinds=index.kinds)
        none_stages[s] = stage_activations(model, rng, first, last, c, layout.sizes["tp"], "none", received=s > 0, sent=s < S - 1,
                                           kinds=index.kinds)
    if pp == 1:
        held = {0: 1}
    else:
        weights = {s: stages[s].kept(layout.tokens) for s in local}
        held = peak_held(layout.schedule, pp, layout.microbatches, layout.stages.per_rank, r, weights)
    mem = rank_memory(shards, keys, blocks, precision=cfg.precision, optim=cfg.optim.name, pipelined=pp > 1, ac=cfg.ac,
                      grad_accum=layout.passes, tokens=layout.tokens, stages=stages, held=held, none_stages=none_stages)
    return list(keys), layers, local, mem


def _rank(model, layout, r: int, shards, blocks, flops, cfg, c: int, index: _Index) -> _Rank:
    S, pp = layout.stages.num_stages, layout.sizes["pp"]
    keys, layers, local, mem = _memory(model, layout, r, shards, blocks, cfg, c, index)
    n_mb = layout.steps_microbatches
    mesh = {a: layout.sizes[a] for a in ("pp", *MESH_AXES)}
    rows = layer_rows(model, layers, tokens=layout.tokens, micro_batches=n_mb, precision=cfg.precision, ac=cfg.ac, sizes=mesh,
                      first=0 in local, last=S - 1 in local)
    own = [shards[k] for k in keys]
    tied = {"model.embed_tokens.weight": 2} if getattr(model.config, "tie_word_embeddings", False) else {}
    fsdp = fsdp_rows(own, pipelined=pp > 1, precision=cfg.precision, micro_batches=n_mb, ac=cfg.ac, blocks=blocks, sizes=mesh, uses=tied)
    held = set(keys)
    shared = [k for k in index.shared if k in held] if pp > 1 and layout.stages.rank_of(0) != layout.stages.rank_of(S - 1) else []
    storage = 2 if cfg.precision == "bf16" else 4
    once = pp_rows(local, S, tokens=layout.tokens, micro_batches=n_mb, hidden=model.config.hidden_size, precision=cfg.precision,
                   shared_bytes=sum(shards[k].local * storage for k in shared))
    per_mb = [row for row in once if row.per == "micro-batch"]
    once = [row for row in once if row.per == "step"]
    if pp > 1:
        once += fsdp
    else:
        rows += fsdp
    layer_f, rest_f = sum(flops[s][0] for s in local), sum(flops[s][1] for s in local)
    factor = (layer_f * 4 / 3 + rest_f) / (layer_f + rest_f) if cfg.ac == "full" and layer_f + rest_f > 0 else 1.0
    routed = sum(index.routed_flops(i) for i in layers)
    per_device = (layer_f + rest_f - routed) / layout.sizes["tp"] + routed  # tp splits all but the routed experts
    return _Rank(keys, layers, local, mem, per_device, factor, rows + per_mb, once)


def stage_text(model, layout, s: int) -> str:
    """What pipeline stage ``s`` holds, in words: ``layers 0-3 + embedding``, ``layer 60 + head,
    MTP depth``."""
    r = layout.stages.layers[s]
    out = "no decoder layer" if len(r) == 0 else f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"
    extra = ["embedding"] if s == 0 else []
    if s == layout.stages.num_stages - 1:
        depths = len(model.skeleton.model.layers) - model.config.num_hidden_layers
        extra += ["head"] + ([f"{depths} MTP depth{'s' if depths > 1 else ''}"] if depths else [])
    return out + (f" + {', '.join(extra)}" if extra else "")


class _Shards:
    """param_shards per mesh, computed once for the plan and the layouts its advice tries."""

    def __init__(self, model):
        self.model, self.cache = model, {}

    def __call__(self, layout, train_cfg):
        return self.mesh({a: layout.sizes[a] for a in MESH_AXES}, train_cfg)

    def mesh(self, mesh: dict[str, int], train_cfg):
        key = (tuple(mesh.get(a, 1) for a in MESH_AXES), tuple(train_cfg.optim.muon_adamw_params))
        if key not in self.cache:
            self.cache[key] = param_shards(self.model, mesh, adamw_patterns=train_cfg.optim.muon_adamw_params)
        return self.cache[key]

    def flags(self, train_cfg) -> list:
        """Every param's shape and flags (a mesh of one device: nothing split)."""
        return list(self.mesh({}, train_cfg).values())


def _blocks(shards) -> dict[str, int]:
    return {k: int(m.group(1)) for k in shards if (m := _BLOCK.match(k))}


def _does_not_fit(model, device, devices: int, parallel, train_cfg, layout, mem: RankMemory, worst: int, shards, get_shards,
                  index: _Index) -> str:
    capacity = device.hbm_gib * GIB
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.rows.items() if v >= 0.05 * GIB)
    where = f"pp rank {worst}: " if layout.sizes["pp"] > 1 else ""
    head = (f"needs {mem.total / GIB:.1f} GiB per device at {mem.moment} ({where}{parts} GiB), {(mem.total - capacity) / GIB:.1f} GiB "
            f"more than the {device.hbm_gib:g} GiB of {_a(device.name)}")
    state = state_bytes(list(shards.values()), train_cfg.precision, train_cfg.optim.name)
    if state / devices > capacity:
        return f"{head}; {no_layout(state, devices, capacity, GIB)}"

    def evaluate(n: int, p: ParallelConfig, t) -> tuple[float, dict[str, int]]:
        lay = resolve_layout(model, p, n, t)
        sh = get_shards(lay, t)
        c = 4 if t.precision == "fp32" else 2
        bl = _blocks(sh)
        need = max(_memory(model, lay, r, sh, bl, t, c, index)[3].total for r in range(lay.sizes["pp"]))
        return need, lay.sizes

    found = suggestions(model, devices=devices, sizes=layout.sizes, parallel=parallel, train_cfg=train_cfg, rows=layout.rows,
                        microbatches=layout.microbatches, need=mem.total, capacity=capacity, evaluate=evaluate)
    return f"{head}; {describe(found, GIB)}"


def _routed_flops(layer) -> float:
    """Training FLOPs per token of a layer's routed experts (6 per activated param: K of E
    experts), which tensor parallelism does not split (every tp rank computes them whole)."""
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        return 0.0
    e = mlp.experts
    return 6.0 * (e.gate_up_proj.numel() + e.down_proj.numel()) * mlp.gate.top_k / e.num_experts


def make_plan(model, *, family: str, size: str, hardware: str, devices: int, parallel: ParallelConfig, train_cfg,
              compute_efficiency: float = 0.5, overlap: str = "none", refuse: bool = True) -> dict:
    """The plan of training ``model`` (an :class:`mff.model.Model`, a meta skeleton is enough)
    on ``devices`` devices of ``hardware`` with ``parallel`` and ``train_cfg``'s options (a
    :class:`mff.train.config.TrainConfig`: seq_len, batch_size, grad_accum, precision, ac,
    optim), as a JSON-ready dict; sizes in GiB (memory), GB (communication, 1e9 bytes),
    seconds, FLOP/s, tokens/s.

    ``refuse=False`` plans a layout that does not fit anyway: ``memory_gib.fits`` is false and
    ``memory_gib.does_not_fit`` holds the message :class:`PlanDoesNotFit` would carry.

    Raises:
        ValueError: an unknown hardware name (listing the known ones), a layout or option the
            training recipes refuse (:mod:`mff.plan.layout`), sizes that do not divide.
        PlanDoesNotFit: (``refuse``) when the params, grads and optimizer state alone exceed the
            memory even sharded over every device, at once, before any layout is planned: that
            no layout of ``devices`` fits and at least how many devices the run needs
            (:mod:`mff.plan.advice`); else when the most loaded device needs more than the
            device's memory: the need, the moment of the step, the excess, the device, the
            largest parts, and the single changes that would lower the need (each with its flags
            and need).
    """
    check_efficiency(compute_efficiency)
    check_overlap(overlap)
    device = get_device(hardware)
    check_mesh(parallel, devices)
    get_shards = _Shards(model)
    if refuse:  # no layout of the device count fits: said before any layout is planned, as check_config says it
        whole = get_shards.flags(train_cfg)
        state = state_bytes(whole, train_cfg.precision, train_cfg.optim.name)
        if state / devices > device.hbm_gib * GIB:
            st = ConfigState(sum(math.prod(s.shape) for s in whole), state, True, len(model.skeleton.model.layers))
            raise PlanDoesNotFit(_state_message(family, size, model.config, st, devices, device))
    layout = resolve_layout(model, parallel, devices, train_cfg)
    c = 4 if train_cfg.precision == "fp32" else 2
    index = _Index(model)
    shards = get_shards(layout, train_cfg)
    blocks = _blocks(shards)
    flops = stage_flops_per_token(model, layout.stages.layers, layout.seq_len)
    pp = layout.sizes["pp"]
    ranks = [_rank(model, layout, r, shards, blocks, flops, train_cfg, c, index) for r in range(pp)]
    worst = max(range(pp), key=lambda r: ranks[r].memory.total)
    mem = ranks[worst].memory
    capacity = device.hbm_gib * GIB
    message = None
    if mem.total > capacity:
        message = _does_not_fit(model, device, devices, parallel, train_cfg, layout, mem, worst, shards, get_shards, index)
        if refuse:
            raise PlanDoesNotFit(message)
    m, v = layout.microbatches, layout.stages.per_rank
    bubble = bubble_fraction(layout.schedule, pp, m, v) if pp > 1 else 0.0
    sizes = {a: layout.sizes[a] for a in ("pp", *MESH_AXES)}
    opt_s = max(optimizer_seconds([shards[k] for k in rk.keys], device, precision=train_cfg.precision, optim=train_cfg.optim.name,
                                  ns_steps=train_cfg.optim.muon_ns_steps, efficiency=compute_efficiency) for rk in ranks)
    est = estimate_step(rank_flops=[rk.flops for rk in ranks], rank_rows=[rk.rows for rk in ranks], once_rows=[rk.once for rk in ranks],
                        optimizer_s=opt_s, device=device, sizes=sizes, tokens=layout.tokens, micro_batches=m,
                        passes=layout.passes, bubble=bubble, ac_factor=[rk.ac_factor for rk in ranks], overlap=overlap,
                        efficiency=compute_efficiency, model_flops=model.train_flops_per_token(layout.seq_len),
                        step_tokens=train_cfg.batch_size * layout.seq_len, devices=devices)
    slow = est.slowest_rank

    def comm(rows: list[CommRow]) -> list[dict]:
        return [{"axes": " x ".join(row.axes), "op": row.op, "per": row.per, "gb": row.bytes / 1e9,
                 "seconds": comm_seconds(row, sizes, device.intra_bw, device.inter_bw, device.per_node)} for row in rows]

    slow_rows = comm(ranks[slow].rows + ranks[slow].once)
    counts = model.param_counts()
    per_rank = [{"pp_rank": r, "stages": rk.stages, "holds": ", ".join(stage_text(model, layout, s) for s in rk.stages),
                 "memory_gib": rk.memory.total / GIB, "flops_per_token_per_device": rk.flops, "recompute_factor": rk.ac_factor,
                 "compute_s": est.per_rank[r]["compute"], "comm_s": est.per_rank[r]["comm"], "once_comm_s": est.per_rank[r]["once"],
                 "comm_gb": sum(row.bytes for row in rk.rows + rk.once) / 1e9}
                for r, rk in enumerate(ranks)]
    return {
        "model": {"family": family, "size": size, "params": counts["total"], "activated_params": counts["activated"],
                  "train_flops_per_token": model.train_flops_per_token(layout.seq_len)},
        "hardware": {"key": device.key, "name": device.name, "peak_flops": device.peak_flops, "hbm_gib": device.hbm_gib,
                     "hbm_bytes_per_s": device.hbm_bw, "intra_node_bytes_per_s": device.intra_bw,
                     "inter_node_bytes_per_s": device.inter_bw, "devices_per_node": device.per_node, "links": device.links,
                     "source": device.source},
        "layout": {"devices": devices, "mesh": sizes, "data_parallel": layout.dp, "schedule": layout.schedule if pp > 1 else None,
                   "stages": [[r.start, r.stop] for r in layout.stages.layers], "stages_per_rank": v,
                   "microbatches_per_pass": m, "passes": layout.passes, "microbatch_sequences": layout.rows, "seq_len": layout.seq_len,
                   "precision": train_cfg.precision, "ac": train_cfg.ac, "optimizer": train_cfg.optim.name},
        "memory_gib": {"pp_rank": worst, "which": "the most loaded pp rank" if pp > 1 else "every device",
                       "moment": mem.moment, "why": mem.why, "notes": {k.replace(" ", "_"): n for k, n in mem.notes.items()},
                       **{k.replace(" ", "_"): mem.rows[k] / GIB for k in ROWS},
                       "total": mem.total / GIB, "capacity": device.hbm_gib, "fits": message is None, "does_not_fit": message,
                       "other_moment": mem.other_moment, "other_moment_total": mem.other_total / GIB,
                       "in_flight_microbatches": mem.in_flight,
                       "activations_per_microbatch_no_ac": mem.activations_per_mb["none"] / GIB,
                       "activations_per_microbatch": mem.activations_per_mb["kept"] / GIB,
                       "per_pp_rank_total": [rk.memory.total / GIB for rk in ranks]},
        "compute": {"pp_rank": slow, "which": "the slowest pp rank (the step estimate's)" if pp > 1 else "every device",
                    "flops_per_token_per_device": ranks[slow].flops, "recompute_factor": ranks[slow].ac_factor,
                    "seconds": est.compute_s},
        "communication": {"pp_rank": slow, "which": "the slowest pp rank (the step estimate's)" if pp > 1 else "every device",
                          "rows": slow_rows, "total_gb": sum(r["gb"] for r in slow_rows),
                          "total_seconds": sum(r["seconds"] for r in slow_rows)},
        "per_pp_rank": per_rank,
        "pipeline": {"bubble_fraction": bubble,
                     "definition": "idle share of the step time: (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1)"},
        "estimate": {"step_s": est.step_s, "compute_s": est.compute_s, "comm_s": est.comm_s, "exposed_comm_s": est.exposed_comm_s,
                     "exposed_once_comm_s": est.once_s, "bubble_s": est.bubble_s, "optimizer_s": est.optimizer_s,
                     "tokens_per_s_per_device": est.tokens_per_s_per_device,
                     "mfu": est.mfu, "compute_efficiency": compute_efficiency, "overlap": overlap, "slowest_pp_rank": slow,
                     "once_pp_rank": est.once_rank},
    }
