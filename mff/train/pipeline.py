"""The training step under pipeline parallelism: the same step as :func:`mff.train.step.train_step`
(global-count loss normalisation, clipping on the global grad norm, the optimizer, the
expert-bias update), with the model's layers split into stages over the ``pp`` ranks and the
micro-batches run by a ``torch.distributed.pipelining`` schedule (:mod:`mff.parallel.pp`).

A stage is a partition of the param paths (:meth:`mff.model.Model.stage_keys`) plus the same
pure block functions the one-process forward runs (:meth:`mff.model.Model.stage_forward`).
Each rank holds only its stages' params; the token embedding is also held by the last stage
when the head is tied to it or the model has MTP depths (its two copies get the sum of both
stages' gradients and the same update; the first stage's copy is the one saved).

What crosses stages: the hidden states, and the running sum of the MoE balance loss's statistics
(so each MoE layer's balance term is counted once, whatever stage it is on). Expert loads and
the loss terms for the log are outputs of the stage functions collected by the step and summed
over the pp and data-parallel ranks (loads of every stage, MTP depths included, feed the
expert-bias update).

Per step, each param is gathered over its data-parallel axes once (FSDP with resharding after
the forward off, as torchtitan runs FSDP under pipeline parallelism), every micro-batch computes
with that copy, and its gradient is reduce-scattered once at the end of the step
(:func:`mff.parallel.gather.gather_for_step`, :func:`mff.parallel.gather.reduce_step_grad`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mff.model import Model
from mff.nn.loss import count_targets
from mff.optim.clip import clip_grads_
from mff.optim.config import OptimConfig
from mff.optim.optimizer import apply_update
from mff.parallel.gather import gather_for_step, local_grads, reduce_step_grad
from mff.parallel.mesh import ParallelConfig, data_parallel_group, pipeline_group, pipeline_pair_group, pipeline_rank, pipeline_size
from mff.parallel.pp import build_schedule, check_microbatches
from mff.parallel.pp_layout import StageLayout, stage_layout, stages_per_rank
from mff.parallel.watchdog import collective
from mff.train.precision import compute_params
from mff.train.step import NonFiniteError, StepStats, global_counts, update_expert_bias
from mff.tree import first_match

__all__ = ["TERMS", "Pipeline", "plan_stages", "layer_costs"]

TERMS = ("lm", "mtp", "balance")
"""The loss terms a model may return, in the order the last stage's output vector holds them."""


def layer_costs(model: Model, balance: str, seq_len: int) -> tuple[list[float], float, float]:
    """Per decoder layer the cost a stage split balances, and the extra costs of the first stage
    (the embedding) and of the last (final norm, head, MTP depths).

    ``balance``: ``params`` (param counts; the embedding counts on the first stage) or ``flops``
    (training FLOPs per token: 6 per activated param, routed experts at K/E of their size, plus
    each layer's share of the causal attention term of the family's ``train_flops_per_token``,
    found as ``(f(T) - f(T - 1)) (T + 1)`` since that term grows with ``T + 1``; the embedding
    lookup costs nothing, the head 6 V D per prediction: the main one and one per MTP depth).

    Raises:
        ValueError: an unknown ``balance``.
    """
    if balance not in ("params", "flops"):
        raise ValueError(f"--parallel.pp-balance {balance!r}: expected params or flops")
    cfg = model.config
    L = cfg.num_hidden_layers
    flops = balance == "flops"
    layer = [0.0] * L
    first = last = 0.0
    mtp_layers: set[int] = set()
    head = 0.0
    for path, shape in model.param_shapes().items():
        n = float(math.prod(shape))
        if flops and ".experts." in path:
            n *= _expert_fraction(model)
        parts = path.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) < L:
            layer[int(parts[2])] += n
        elif parts[:2] == ["model", "embed_tokens"]:
            first += 0.0 if flops else n
            head = n if getattr(cfg, "tie_word_embeddings", False) else head
        else:
            if parts[:2] == ["model", "layers"]:
                mtp_layers.add(int(parts[2]))
            if path == "lm_head.weight":
                head = n
            else:
                last += n
    if not flops:
        return layer, first, last + head
    attn_total = (model.train_flops_per_token(seq_len) - model.train_flops_per_token(max(0, seq_len - 1))) * (seq_len + 1) / 6.0
    attn = attn_total / (L + len(mtp_layers))
    costs = [6.0 * (c + attn) for c in layer]
    return costs, 0.0, 6.0 * (last + len(mtp_layers) * attn + head * (1 + len(mtp_layers)))


def _expert_fraction(model: Model) -> float:
    """K / E: the share of the routed experts' params one token activates (1 without experts)."""
    cfg = model.config
    E = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None)
    K = getattr(cfg, "num_experts_per_tok", None)
    return K / E if E and K else 1.0


def plan_stages(model: Model, parallel: ParallelConfig, seq_len: int) -> StageLayout:
    """The stages of ``model`` for ``parallel`` (``--parallel.pp-layers`` by hand, else
    balanced by ``--parallel.pp-balance``). Raises ValueError as
    :func:`mff.parallel.pp_layout.stage_layout`."""
    per_rank = stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)
    L = model.config.num_hidden_layers
    if parallel.pp_layers is not None:
        return stage_layout(L, parallel.pp, per_rank, parallel.pp_layers)
    if parallel.pp * per_rank > L:  # named before the costs are computed
        return stage_layout(L, parallel.pp, per_rank)
    costs, first, last = layer_costs(model, parallel.pp_balance, seq_len)
    return stage_layout(L, parallel.pp, per_rank, costs=costs, first_extra=first, last_extra=last)


@dataclass
class _Step:
    """What the stage functions of the step in progress read and write."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] | None = None
    loads: dict[str, torch.Tensor] = field(default_factory=dict)
    terms: torch.Tensor | None = None
    present: set[str] = field(default_factory=set)


class Pipeline:
    """This rank's pipeline stages of ``model`` and their schedule.

    Args:
        model: the model (its skeleton must have ``pipeline_stage``).
        parallel: the run's parallel options (pp, schedule, micro-batches, split).
        mesh: the run's mesh (from :func:`mff.parallel.build_mesh` with ``pp`` > 1).
        seq_len: tokens per row; ``rows``: rows of each ``step`` call's batch on this rank.
        device: where the stages compute; ``precision``: as the run's.
    Raises:
        ValueError: a split or micro-batch count the model or schedule cannot take (one line
            naming the flag), rows that do not divide into the micro-batches.
    """

    def __init__(self, model: Model, parallel: ParallelConfig, mesh, seq_len: int, rows: int, device: torch.device,
                 precision: str = "fp32"):
        self.model, self.mesh, self.device, self.precision = model, mesh, device, precision
        self.layout = plan_stages(model, parallel, seq_len)
        self.microbatches = parallel.pp_microbatches if parallel.pp_microbatches is not None else self.layout.num_stages
        check_microbatches(parallel.pp_schedule, self.microbatches, parallel.pp)
        self.rows = rows
        if rows % self.microbatches:
            raise ValueError(f"--parallel.pp-microbatches {self.microbatches} does not divide the {rows} rows each pipeline gets per "
                             "step (--batch-size / data-parallel ranks / --grad-accum)")
        self.rank, self.pp = pipeline_rank(mesh), pipeline_size(mesh)
        self.group = pipeline_group(mesh)
        self.local = self.layout.stages_of(self.rank)
        last = self.layout.num_stages - 1
        self.stage_keys = {s: model.stage_keys(self.layout.layers[s], s == 0, s == last) for s in self.local}
        self.keys = sorted({k for ks in self.stage_keys.values() for k in ks})
        shared = model.shared_keys()
        first_rank, last_rank = self.layout.rank_of(0), self.layout.rank_of(last)
        self.shared = [k for k in shared if k in self.keys] if first_rank != last_rank else []
        # the pair group of the two ranks holding the shared params (every rank takes part in making it)
        self.pair = pipeline_pair_group(mesh, first_rank, last_rank) if shared and first_rank != last_rank else None
        self.owned = [k for k in self.keys if not (k in self.shared and self.rank != first_rank)]
        self._state = _Step()
        self._moe = _moe_layers(model)
        mb_rows = rows // self.microbatches
        specs = [self._stage_spec(s, mb_rows, seq_len) for s in self.local]
        self._fns = {s: fn for s, fn, _, _ in specs}
        self.schedule = build_schedule(parallel.pp_schedule, specs, self.layout.num_stages, self.microbatches, self.group, device, self._loss)
        self.schedule_name = parallel.pp_schedule

    def describe(self) -> str:
        """One line: the schedule, micro-batches and each stage's layers and rank."""
        last = self.layout.num_stages - 1
        tail = ["head", "loss"] + (["MTP"] if self.model.mtp_layers() else [])
        parts = []
        for s, r in enumerate(self.layout.layers):
            extra = (["embedding"] if s == 0 else []) + (tail if s == last else [])
            span = f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"
            parts.append(f"stage {s} (rank {self.layout.rank_of(s)}): {span}" + (f" + {', '.join(extra)}" if extra else ""))
        return (f"pipeline: {self.schedule_name}, {self.layout.num_stages} stages on {self.pp} ranks, "
                f"{self.microbatches} micro-batches; " + "; ".join(parts))

    def meta(self) -> dict:
        """The pipeline layout for the checkpoint metadata (informative: a checkpoint is keyed by
        global param paths and resumes on any layout)."""
        return {"pp": self.pp, "schedule": self.schedule_name, "microbatches": self.microbatches,
                "stages": [[r.start, r.stop] for r in self.layout.layers]}

    def saved_state(self, opt_state: dict) -> dict:
        """The optimizer state a checkpoint holds from this rank: that of the params it owns
        (a shared param's state is saved from the first stage's copy only)."""
        owned = set(self.owned)
        return {slot: {k: v for k, v in tree.items() if k in owned} if isinstance(tree, dict) else tree
                for slot, tree in opt_state.items()}

    # ---- stages ----------------------------------------------------------------------
    def _carry(self, rows: int, seq_len: int, requires_grad: bool) -> list[torch.Tensor]:
        """Empty tensors shaped as a non-last stage's output for ``rows`` x ``seq_len`` tokens."""
        dtype = torch.bfloat16 if self.precision in ("bf16", "bf16-mixed") else torch.float32
        return [torch.empty(shape, dtype=dtype if hidden else torch.float32, device=self.device, requires_grad=requires_grad)
                for shape, hidden in self.model.skeleton.pipeline_carry_shapes(rows, seq_len)]

    def _stage_spec(self, s: int, mb_rows: int, seq_len: int):
        first, last = s == 0, s == self.layout.num_stages - 1
        layers = self.layout.layers[s]
        keys = self.stage_keys[s]
        # examples of one micro-batch's carry; requires_grad: the gradients travel back through them
        carry = self._carry(mb_rows, seq_len, requires_grad=True)
        inputs = () if first else tuple(carry)
        outputs = (torch.empty(len(TERMS), dtype=torch.float32, device=self.device, requires_grad=True),) if last else tuple(carry)

        def fn(*carry_in, **batch):
            st = self._state
            out, loads = self.model.stage_forward({k: st.params[k] for k in keys}, carry_in, layers, first, last, batch, st.counts)
            for k, v in loads.items():
                st.loads[k] = st.loads.get(k, 0) + v.to(torch.int64)
            if not last:
                return out
            st.present.update(out)
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            return torch.stack([out[t].float().reshape(()) if t in out else zero for t in TERMS])

        return s, fn, inputs, outputs

    def _loss(self, terms: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        st = self._state
        st.terms = terms.detach() if st.terms is None else st.terms + terms.detach()
        return terms.sum()

    def _run(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Each batch (a grad-accumulation chunk of the rows given at construction) through the
        schedule, which cuts it into the pipeline's micro-batches.

        Raises:
            ValueError: a batch of another row count (the stages' shapes are static)."""
        for i, batch in enumerate(batches):
            rows = batch["input_ids"].shape[0]
            if rows != self.rows:
                raise ValueError(f"the pipeline was built for batches of {self.rows} rows, got {rows}")
            with collective(f"pipeline step (pass {i + 1}/{len(batches)})"), local_grads():
                self.schedule.step(target=batch["labels"], return_outputs=False, **batch)

    @torch.no_grad()
    def _forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """``batch`` (any rows) forward through the stages in order, the carry sent from rank to
        rank by point-to-point; the last stage's loss-term vector on the rank holding it, else
        None. Forward only (validation): no schedule, so any batch shape runs."""
        rows, seq_len = batch["input_ids"].shape
        carry: tuple[torch.Tensor, ...] = ()
        last = self.layout.num_stages - 1
        peer = lambda s: dist.get_global_rank(self.group, self.layout.rank_of(s))  # noqa: E731
        for s in self.local:
            if s > 0 and self.layout.rank_of(s - 1) != self.rank:
                carry = tuple(self._carry(rows, seq_len, requires_grad=False))
                for t in carry:
                    dist.recv(t, src=peer(s - 1), group=self.group)
            out = self._fns[s](*carry, **batch)
            if s == last:
                return out
            if self.layout.rank_of(s + 1) != self.rank:
                for t in out:
                    dist.send(t.contiguous(), dst=peer(s + 1), group=self.group)
            else:
                carry = out
        return None

    # ---- the step --------------------------------------------------------------------
    def step(self, params: dict[str, torch.Tensor], opt_state: dict, batches: Sequence[Mapping[str, torch.Tensor]], lr: float,
             optim: OptimConfig, bias_update_rate: float = 0.0) -> StepStats:
        """Forward/backward of ``batches`` (the step's grad-accumulation chunks, each of the rows
        given at construction) through the pipeline, then clipping, the optimizer and the
        expert-bias update, in place on ``params`` (this rank's stage params) and ``opt_state``.

        Raises:
            NonFiniteError: a non-finite loss or grad norm (checked before anything is updated).
        """
        dp = data_parallel_group(self.mesh)
        counts = global_counts(self.model, batches, dp)  # the counts add up over rows: the batches' are the micro-batches' sum
        keep = {k: _kept_axes(self.model, k) for k in params}
        leaves = {k: gather_for_step(v, keep[k]) for k, v in params.items()}
        self._state = _Step(params=compute_params(self.model, leaves, self.precision), counts=counts)
        self._run(batches)
        st = self._state
        self._state = _Step()
        names = [k for k, v in params.items() if v.requires_grad]
        with collective("reducing the pipeline stages' grads"):
            grads = {k: reduce_step_grad(leaves[k], params[k]) for k in names}
            for k in names:
                if grads[k] is None:  # a param no micro-batch reached (cannot happen in a stage's own keys)
                    grads[k] = torch.zeros_like(params[k])
            if self.pair is not None:
                with torch.no_grad():
                    for k in self.shared:
                        if k in grads:
                            dist.all_reduce(grads[k].to_local() if hasattr(grads[k], "to_local") else grads[k], group=self.pair)
        for k in names:
            assert getattr(grads[k], "placements", None) == getattr(params[k], "placements", None), k
        losses = self._reduce_terms(st, dp)
        loss = sum(losses.values())
        with collective("grad norm and clipping"):
            norm = clip_grads_(grads, optim.max_grad_norm, self.group, counted=set(self.owned))
        if not math.isfinite(loss) or not math.isfinite(norm):
            raise NonFiniteError(f"non-finite {'loss' if not math.isfinite(loss) else 'grad norm'}: loss={loss}, grad_norm={norm} ({losses})")
        with collective("optimizer update"):
            apply_update(optim, params, grads, opt_state, lr)
        loads = self._reduce_loads(st.loads, dp)
        update_expert_bias(params, loads, bias_update_rate)
        tokens = torch.tensor(sum(b["input_ids"].numel() for b in batches), device=self.device)
        _all_reduce(tokens, dp)
        return StepStats(loss=loss, losses=losses, grad_norm=norm, tokens=int(tokens), expert_load=loads)

    @torch.no_grad()
    def eval_loss(self, params: Mapping[str, torch.Tensor], batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
        """Mean LM loss per target token over ``batches`` and all ranks (the main head only), as
        :func:`mff.train.step.eval_loss` computes it, through the pipeline (forward only)."""
        dp = data_parallel_group(self.mesh)
        compute = compute_params(self.model, params, self.precision)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for b in batches:
            n = count_targets(b["labels"])
            self._state = _Step(params=compute, counts={k: n for k in self.model.count_targets(b)})
            with collective("pipeline validation forward"):
                terms = self._forward(b)
            if terms is not None:
                total[0] += float(terms[0]) * float(n)
            total[1] += float(n)
        self._state = _Step()
        if not self._holds_last():
            total.zero_()
        with collective("validation loss over the pipeline"):
            _all_reduce(total, self.group)
            _all_reduce(total, dp)
        return float(total[0] / total[1].clamp(min=1))

    # ---- reductions --------------------------------------------------------------------
    def _holds_last(self) -> bool:
        return self.layout.rank_of(self.layout.num_stages - 1) == self.rank

    def _reduce_terms(self, st: _Step, dp) -> dict[str, float]:
        """The step's loss terms (held by the last stage's rank) summed over the data-parallel
        ranks and given to every pp rank; only the terms the model has."""
        vec = torch.zeros(2 * len(TERMS), dtype=torch.float64, device=self.device)
        if self._holds_last():
            if st.terms is not None:
                vec[:len(TERMS)] = st.terms.double()
            vec[len(TERMS):] = torch.tensor([float(t in st.present) for t in TERMS], dtype=torch.float64)
            _all_reduce(vec, dp)
        with collective("loss terms over the pipeline"):
            _all_reduce(vec, self.group)
        present = vec[len(TERMS):] > 0
        return {t: float(vec[i]) for i, t in enumerate(TERMS) if present[i]}

    def _reduce_loads(self, loads: Mapping[str, torch.Tensor], dp) -> dict[str, torch.Tensor]:
        """Every MoE layer's expert loads (of every stage) summed over the data-parallel and pp ranks."""
        if not self._moe:
            return {}
        E = max(e for _, e in self._moe)
        table = torch.zeros(len(self._moe), E, dtype=torch.int64, device=self.device)
        for i, (path, e) in enumerate(self._moe):
            if path in loads:
                table[i, :e] = loads[path].to(self.device)
        with collective("expert loads over the pipeline"):
            _all_reduce(table, dp)
            _all_reduce(table, self.group)
        return {path: table[i, :e].cpu() for i, (path, e) in enumerate(self._moe)}


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _moe_layers(model: Model) -> list[tuple[str, int]]:
    """``(MoE layer path, experts)`` of every MoE layer, MTP depths included, in order."""
    out = []
    for path, shape in model.param_shapes().items():
        if path.endswith(".mlp.experts.gate_up_proj"):
            out.append((path[: -len(".experts.gate_up_proj")], int(shape[0])))
    return out


def _kept_axes(model: Model, path: str) -> tuple[str, ...]:
    """Data-parallel axes on which param ``path`` stays split for the step: ``ep`` for the
    stacked experts (their ``expert`` dim is expert parallelism, not FSDP)."""
    hit = first_match(path, model.sharding_table)
    return ("ep",) if hit is not None and "expert" in hit[1] else ()
