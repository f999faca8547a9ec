"""Step time, tokens/s per device and MFU on paper.

For pp rank r with F_r training FLOPs per token and device (its stages' share of the model's
``train_flops_per_token``, split as :func:`mff.train.pipeline.layer_costs` splits it, divided by tp except
the routed experts, which every tp rank computes whole), a micro-batch of t tokens takes

    compute_r = t F_r a / (eta P)

on a device of peak P (dense bf16 FLOP/s, :mod:`mff.plan.devices`) reaching a fraction eta of it
(``--compute-efficiency``, default 0.5: an assumption, not a measurement), where a = 4/3 on the
decoder layers under ``--ac full`` (their forward runs twice: 2 + 4 + 2 of 6 units) and 1
otherwise (``selective`` recomputes no matmul). Its communication per micro-batch comm_r is the
rank's per-micro-batch rows of :mod:`mff.plan.comm` at the links' bandwidth; what of it is
hidden behind the compute is ``--overlap``:

- ``none`` (mff's runtime as written: DTensor gathers, the expert all-to-all and the pipeline's
  sends run on the compute stream's path and wait): ``t_r = compute_r + comm_r``;
- ``fsdp`` (torchtitan's FSDP2 prefetches the next layer's gather and overlaps the
  reduce-scatter): FSDP/HSDP hidden up to the compute time, the rest exposed;
- ``all`` (DualPipe's aim: every collective under some compute): ``t_r = max(compute_r, comm_r)``.

The pipeline runs at its slowest rank and idles for the bubble b (:mod:`mff.plan.schedule`):

    T = passes m max_r t_r / (1 - b) + T_once + T_opt

with ``passes`` = ``--grad-accum``, m micro-batches a pass (pp = 1: m = 1, b = 0); T_once the
collectives paid once a step (FSDP under pp > 1, the shared-embedding all-reduce; exposed under
``none``, hidden under ``fsdp`` and ``all`` up to the pipeline time), T_opt the optimizer update:
memory-bound, reading the params, grads and state and writing params and state at the HBM
bandwidth, plus Muon's Newton-Schulz iterations (5 steps of ``4 a^2 b + 2 a^3`` FLOPs on each a x
b matrix, a <= b, on every rank that holds a piece of a matrix split along its rows or columns:
:mod:`mff.optim.muon` gathers those whole) at eta P. Then, with B sequences of s tokens per step
on N devices and F the model's FLOPs per token,

    tokens/s per device = B s / (T N)
    MFU = F x tokens/s per device / P

(model FLOPs only: recomputation is not useful work; PaLM's MFU definition, Chowdhery et al.
2022, appendix B). Not modelled: expert-routing imbalance, stragglers, kernel launch overheads,
the CPU side, and link contention between axes that share a link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mff.plan.comm import CommRow, comm_seconds
from mff.plan.devices import Device
from mff.plan.shards import ParamShard

__all__ = ["OVERLAPS", "Estimate", "check_efficiency", "check_overlap", "stage_flops_per_token", "optimizer_seconds", "estimate_step"]

OVERLAPS = ("none", "fsdp", "all")


def check_efficiency(efficiency: float) -> None:
    """Raise ValueError (one line naming ``--compute-efficiency`` and its value) unless
    ``efficiency`` is a number in (0, 1]: not nan, inf, 0, negative or above 1."""
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"--compute-efficiency {efficiency!r}: expected a fraction of the peak FLOP/s in (0, 1], e.g. 0.5")


def check_overlap(overlap: str) -> None:
    """Raise ValueError (one line) unless ``overlap`` is one of :data:`OVERLAPS`."""
    if overlap not in OVERLAPS:
        raise ValueError(f"--overlap {overlap!r}: expected one of {', '.join(OVERLAPS)}")


def stage_flops_per_token(model, stages: Sequence[range], seq_len: int) -> list[tuple[float, float]]:
    """Training FLOPs per token of each stage as ``(decoder layers, the rest)``: the stage's
    layers ``stages[s]``, and the embedding (first stage) or the head and MTP depths (last
    stage): the costs the pipeline balances its stages by (:func:`mff.train.pipeline.layer_costs`
    with ``flops``); over all stages they sum to ``model.train_flops_per_token(seq_len)``."""
    from mff.train.pipeline import layer_costs

    costs, first, last = layer_costs(model, "flops", seq_len)
    out = [[sum(costs[i] for i in r), 0.0] for r in stages]
    out[0][1] += first
    out[-1][1] += last
    return [(a, b) for a, b in out]


def optimizer_seconds(shards: Sequence[ParamShard], device: Device, *, precision: str, optim: str, ns_steps: int,
                      efficiency: float) -> float:
    """Seconds of one optimizer update on a device holding ``shards`` (module docstring).
    Raises ValueError for an ``efficiency`` outside (0, 1] (:func:`check_efficiency`)."""
    check_efficiency(efficiency)
    storage = 2 if precision == "bf16" else 4
    moved = 0.0
    flops = 0.0
    for s in shards:
        if not s.trainable:
            continue
        b = 4 if s.fp32 else storage
        muon = optim == "muon" and s.matrix
        moved += s.local * (2 * b + b + 2 * (4 if muon else 8))
        if muon:
            a, w = sorted(s.shape[-2:])
            whole = tuple(s.local_shape[-2:]) != tuple(s.shape[-2:])
            count = 1
            for n in (s.shape if whole else s.local_shape)[:-2]:
                count *= n
            flops += count * ns_steps * (4 * a * a * w + 2 * a**3)
    return moved / device.hbm_bw + flops / (efficiency * device.peak_flops)


@dataclass(frozen=True)
class Estimate:
    """Seconds of one step and its parts, tokens/s per device, MFU (0..1).

    ``slowest_rank``: the pp rank whose time per micro-batch sets the pipeline's pace (its
    compute and per-micro-batch communication are ``compute_s`` and part of ``comm_s``);
    ``once_rank``: the pp rank whose once-a-step collectives take longest (the step waits for
    it); ``per_rank``: per pp rank, seconds per step of ``compute`` (recomputation included),
    ``comm`` (per-micro-batch collectives, before overlap), ``once`` (once-a-step collectives)
    and ``busy`` (compute and what is exposed of ``comm``)."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    once_s: float
    optimizer_s: float
    tokens_per_s_per_device: float
    mfu: float
    slowest_rank: int
    once_rank: int
    per_rank: list[dict[str, float]]


def _fsdp(row: CommRow) -> bool:
    return row.axes[0] in ("dp_shard", "dp_replicate")


def estimate_step(*, rank_flops: Sequence[float], rank_rows: Sequence[Sequence[CommRow]], once_rows: Sequence[Sequence[CommRow]],
                  optimizer_s: float, device: Device, sizes: Mapping[str, int], tokens: int, micro_batches: int, passes: int,
                  bubble: float, ac_factor: Sequence[float], overlap: str, efficiency: float, model_flops: float,
                  step_tokens: int, devices: int) -> Estimate:
    """The :class:`Estimate` (module docstring).

    Args:
        rank_flops: per pp rank, training FLOPs per token of its stages; ``ac_factor``: per pp
            rank, the recomputation factor of that work (4/3 on the layers under ac full).
        rank_rows: per pp rank, its per-micro-batch comm rows (bytes summed over the step's
            micro-batches); ``once_rows``: per pp rank, the rows it pays once a step (the step
            waits for the rank that takes longest).
        tokens: tokens of a micro-batch on a device; ``micro_batches``: per pass; ``passes``:
            pipeline passes (grad accumulation).
        bubble: the schedule's idle fraction; ``overlap``: none, fsdp or all;
            ``efficiency``: the fraction of the peak the compute reaches.
        model_flops: the model's training FLOPs per token; ``step_tokens``: tokens per step over
            all devices; ``devices``: the device count.
    Raises:
        ValueError: an unknown ``overlap``, an efficiency outside (0, 1].
    """
    check_overlap(overlap)
    check_efficiency(efficiency)
    n_mb = micro_batches * passes
    per_rank = []
    for r, (f, rows) in enumerate(zip(rank_flops, rank_rows)):
        compute = tokens * f * ac_factor[r] / (efficiency * device.peak_flops)
        secs = [(row, comm_seconds(row, sizes, device.intra_bw, device.inter_bw, device.per_node) / n_mb) for row in rows]
        comm = sum(t for _, t in secs)
        if overlap == "none":
            t = compute + comm
        elif overlap == "fsdp":
            hidden = sum(t for row, t in secs if _fsdp(row))
            t = max(compute, hidden) + comm - hidden
        else:
            t = max(compute, comm)
        per_rank.append((t, compute, comm))
    slow = max(range(len(per_rank)), key=lambda r: per_rank[r][0])
    t_mb, compute, comm = per_rank[slow]
    busy = n_mb * t_mb
    pipe = busy / (1 - bubble)
    onces = [sum(comm_seconds(row, sizes, device.intra_bw, device.inter_bw, device.per_node) for row in rows) for rows in once_rows]
    once_rank = max(range(len(onces)), key=lambda r: onces[r]) if onces else slow
    once = onces[once_rank] if onces else 0.0
    once_exposed = once if overlap == "none" else max(0.0, once - pipe)
    step = pipe + once_exposed + optimizer_s
    tps = step_tokens / step / devices
    table = [{"compute": n_mb * c, "comm": n_mb * m, "once": onces[r] if onces else 0.0, "busy": n_mb * t}
             for r, (t, c, m) in enumerate(per_rank)]
    return Estimate(step_s=step, compute_s=n_mb * compute, comm_s=n_mb * comm + once, exposed_comm_s=busy - n_mb * compute + once_exposed,
                    bubble_s=pipe - busy, once_s=once_exposed, optimizer_s=optimizer_s, tokens_per_s_per_device=tps,
                    mfu=model_flops * tps / device.peak_flops, slowest_rank=slow, once_rank=once_rank, per_rank=table)
