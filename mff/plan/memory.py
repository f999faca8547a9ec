"""Memory per device at its peak in a training step, for one pp rank: params, optimizer state,
the unsharded working copies of the params, gradients and activations.

Stored state (between steps), from each param's local shard (:mod:`mff.plan.shards`):

- params: 4 bytes an element (fp32, bf16-mixed) or 2 (bf16); the router weight and expert bias
  stay fp32 in every precision (:mod:`mff.train.precision`).
- optimizer: AdamW two fp32 moments (8 bytes an element); Muon one fp32 momentum (4) for the
  hidden matrices and AdamW's two for the rest (:mod:`mff.optim.muon`); trainable params only
  (the MoE expert bias has none).
- grads: the param's dtype, trainable params only.

Working copies, as mff's runtimes make them:

- one pipeline stage (pp = 1, :func:`mff.train.step.train_step`): FSDP gathers each weight where
  a block uses it (:func:`mff.parallel.gather.gather`); the gathered weight is kept by autograd
  until the block's backward, so without activation checkpointing every block weight is held
  whole (over the data axes; tp and ep splits kept) in the compute dtype at the start of the
  backward; with checkpointing, one block's weights and their gradients at a time. bf16-mixed
  adds a bf16 cast of each local shard, held through the forward (and until the block's
  backward under checkpointing, as the checkpoint's inputs).
- pipeline parallelism (pp > 1, :mod:`mff.train.pipeline`): each param is gathered over the data
  axes once per step and kept whole for the step (``gather_for_step``: in the param's dtype),
  its gradient accumulates whole over the step's micro-batches (param dtype) and is
  reduce-scattered once at the end (FSDP with ``reshard_after_forward`` off, as torchtitan runs
  it under pipeline parallelism); bf16-mixed casts the whole copies to bf16 once per step. With
  dp_shard = ep = 1 nothing is gathered and the whole copies are the params themselves.

Activations (:mod:`mff.plan.activations`) are held for as many micro-batches as the schedule keeps
in flight on that rank (:mod:`mff.plan.schedule`), plus the larger of one layer rebuilt under
activation checkpointing and the head's transients (the rank holding the last stage).

The peak is the larger of two moments, and the rows name what is held at the one that wins
(the other moment's total is kept beside it, ``other_total``):

- the start of the last micro-batch's backward: activations, working copies and the gradients
  already made: for pp = 1 the sum of the earlier micro-batches' of ``--grad-accum``; under
  pipelining those of params that are not gathered, which accumulate from the first backward
  on (the whole gradients of the gathered params are counted in the working copies);
- the end of a backward. pp = 1: :func:`mff.train.step.train_step` takes each micro-batch's
  gradients with ``torch.autograd.grad``, which returns them all at once, and only then adds
  them to the sum of the earlier micro-batches'; so from the second micro-batch of
  ``--grad-accum`` on, the micro-batch's gradients (row ``new grads``) and that sum (row
  ``grads``) are both held whole for a moment, twice the gradient memory, while activations and
  gathered weights are freed by then. With small micro-batches (little activation memory) this
  is the peak. Under pipelining: the reduced gradient shards beside the whole copies.

The optimizer update is in place and needs no more. Not counted: the CUDA context, the
communication library's buffers, allocator fragmentation, and the small tensors of the step
(losses, counts, expert loads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mff.plan.activations import StageActivations
from mff.plan.shards import ParamShard

__all__ = ["GIB", "ROWS", "RankMemory", "rank_memory"]

GIB = 1024**3


@dataclass(frozen=True)
class RankMemory:
    """Bytes per device of one pp rank at its peak. ``rows`` name what is held at that moment
    (they sum to ``total``; :data:`ROWS` in that order); ``moment`` says which moment it is and
    ``why`` what is held then and why; ``notes`` explain rows whose meaning depends on the
    moment; ``other_moment`` / ``other_total`` the moment that is not the peak and its total;
    ``activations_per_mb`` maps ``none``/``kept`` to one micro-batch's activations over the
    rank's stages without checkpointing and under the run's ``ac``; ``in_flight`` counts the
    micro-batches whose activations are held (summed over the rank's stages)."""

    rows: dict[str, float]
    total: float
    moment: str
    why: str
    notes: dict[str, str]
    other_moment: str
    other_total: float
    activations_per_mb: dict[str, float]
    in_flight: int
    grads_full: float


ROWS = ("params", "optimizer", "grads", "new grads", "working copies", "activations")

_START = "the start of the last micro-batch's backward"


def _bytes(s: ParamShard, n: int, storage: int) -> float:
    return n * (4 if s.fp32 else storage)


def rank_memory(shards: Mapping[str, ParamShard], keys: Sequence[str], blocks: Mapping[str, int], *, precision: str, optim: str,
                pipelined: bool, ac: str, grad_accum: int, tokens: int, stages: Mapping[int, StageActivations],
                held: Mapping[int, int], none_stages: Mapping[int, StageActivations]) -> RankMemory:
    """Peak bytes of a device holding the params ``keys`` (shards from
    :func:`mff.plan.shards.param_shards`).

    Args:
        blocks: param path -> decoder block index, for params inside a checkpointed block.
        precision: fp32, bf16-mixed or bf16; ``optim``: adamw or muon.
        pipelined: pp > 1 (whole copies for the step) or not (gather on use).
        ac: none, full or selective; ``grad_accum``: micro-batches summed before the step on
            one pipeline pass (pp = 1) or pipeline passes (pp > 1).
        tokens: tokens of one micro-batch on this device.
        stages: this rank's stages' activations under ``ac``; ``none_stages`` the same without
            checkpointing (for the report); ``held``: micro-batches of each stage held at once.
    Raises:
        ValueError: an unknown precision, optimizer or ``ac``.
    """
    if precision not in ("fp32", "bf16-mixed", "bf16") or optim not in ("adamw", "muon") or ac not in ("none", "full", "selective"):
        raise ValueError(f"precision {precision!r}, optimizer {optim!r}, ac {ac!r}: expected fp32/bf16-mixed/bf16, adamw/muon, "
                         "none/full/selective")
    storage = 2 if precision == "bf16" else 4
    c = 4 if precision == "fp32" else 2
    own = [shards[k] for k in keys]
    params = sum(_bytes(s, s.local, storage) for s in own)
    train = [s for s in own if s.trainable]
    grads = sum(_bytes(s, s.local, storage) for s in train)
    optimizer = sum(s.local * (4 if optim == "muon" and s.matrix else 8) for s in train)
    cast = [s for s in own if not s.fp32 and c != storage]
    sharded = [s for s in own if s.gathered > s.local]
    if pipelined:
        whole_grads = sum(_bytes(s, s.gathered, storage) for s in sharded if s.trainable)
        working = sum(_bytes(s, s.gathered, storage) for s in sharded) + sum(s.gathered * c for s in cast) + whole_grads
        during = sum(_bytes(s, s.local, storage) for s in train if s.gathered == s.local)  # the leaf's own gradient
        grads_full = whole_grads + during
    else:
        casts = sum(s.local * c for s in cast)
        in_block = [s for s in sharded if s.path in blocks]
        if ac == "none":
            gathered = sum((4 if s.fp32 else c) * s.gathered for s in in_block)
        else:  # one block's gathered weights and their whole gradients at a time
            per_block: dict[int, float] = {}
            for s in in_block:
                per_block[blocks[s.path]] = per_block.get(blocks[s.path], 0.0) + 2 * (4 if s.fp32 else c) * s.gathered
            gathered = max(per_block.values(), default=0.0)
        working = casts + gathered
        during = grads if grad_accum > 1 else 0.0
        grads_full = grads
    acts = sum(held[s] * stages[s].kept(tokens) for s in stages) + max((max(st.rebuilt * tokens, st.transient) for st in stages.values()),
                                                                     default=0.0)
    start = {"params": params, "optimizer": optimizer, "grads": during, "new grads": 0.0, "working copies": working, "activations": acts}
    start_notes = {"grads": "the sum of the earlier micro-batches' gradients" if not pipelined and grad_accum > 1 else
                   "the gradients of the params that are not gathered" if pipelined else ""}
    start_why = ("every micro-batch's activations the schedule holds, the working copies, and the gradients made so far"
                 if pipelined else "the micro-batch's activations and working copies" +
                 (", beside the sum of the earlier micro-batches' gradients" if grad_accum > 1 else ""))
    if pipelined:  # activations freed; the reduced gradients of the gathered params arrive
        end = {"params": params, "optimizer": optimizer, "grads": grads, "new grads": 0.0, "working copies": working, "activations": 0.0}
        end_moment = "the end of the step's last backward"
        end_why = "the reduced gradient shards beside the whole copies and their whole gradients, before the optimizer update"
        end_notes = {"grads": "the reduced gradient shards"}
    elif grad_accum > 1:  # torch.autograd.grad returns the micro-batch's gradients whole; then they are added to the sum
        end = {"params": params, "optimizer": optimizer, "grads": during, "new grads": grads, "working copies": 0.0, "activations": 0.0}
        end_moment = (f"the end of each micro-batch's backward after the first of --grad-accum {grad_accum}, when its gradients "
                      "are held beside the sum of the earlier ones'")
        end_why = ("torch.autograd.grad returns a micro-batch's gradients all at once and only then are they added to the sum; "
                   "activations and gathered weights are freed by then")
        end_notes = {"grads": "the sum of the earlier micro-batches' gradients",
                     "new grads": "this micro-batch's gradients, until they are added to the sum"}
    else:
        end = {"params": params, "optimizer": optimizer, "grads": grads, "new grads": 0.0, "working copies": 0.0, "activations": 0.0}
        end_moment = "the end of the backward"
        end_why = "every gradient made; activations and gathered weights freed"
        end_notes = {"grads": "every gradient of the step"}
    if sum(start.values()) >= sum(end.values()):
        rows, moment, why, notes, other, other_moment = start, _START, start_why, start_notes, end, end_moment
    else:
        rows, moment, why, notes, other, other_moment = end, end_moment, end_why, end_notes, start, _START
    per_mb = {"none": sum(st.kept(tokens) for st in none_stages.values()), "kept": sum(st.kept(tokens) for st in stages.values())}
    return RankMemory(rows=rows, total=sum(rows.values()), moment=moment, why=why, notes={k: v for k, v in notes.items() if v},
                      other_moment=other_moment, other_total=sum(other.values()), activations_per_mb=per_mb,
                      in_flight=sum(held.values()), grads_full=grads_full)
