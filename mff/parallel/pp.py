"""Pipeline schedules over pure stage functions, on ``torch.distributed.pipelining``.

A stage here is a function ``fn(*carry, **batch) -> outputs`` (the previous stage's outputs in,
this stage's out; the last stage returns the vector of its weighted loss terms), with its params
bound by the caller: there is no module to split or deep-copy, and no forward that must tolerate
deleted layers. Each function is wrapped in a parameter-free ``nn.Module`` so that
``torch.distributed.pipelining.PipelineStage`` can call it; the gradients of the params land on
the leaves the caller bound (``torch.autograd.backward`` accumulates into every leaf of the
graph), not on module parameters.

Shapes are static: the caller gives each stage's input and output examples, so the schedule runs
no shape-inference pass (which would run a real forward and backward of every stage once).

Schedules (``--parallel.pp-schedule``), with ``m`` micro-batches and ``p`` pp ranks:

- ``gpipe``: all m forwards, then all m backwards (GPipe, Huang et al. 2019); any m >= 1;
- ``1f1b``: p - r warm-up forwards on rank r, then one forward and one backward alternately
  (PipeDream-Flush, Narayanan et al. 2021); needs m >= p;
- ``interleaved-1f1b``: several stages per rank, looped placement (Megatron's virtual pipeline,
  Narayanan et al. 2021 section 2.2); m must be a multiple of ``max(1, m // p)`` (torch's
  flexible rounds), which holds for m <= 2p - 1 and for every multiple of p.

Gradients are not scaled by the micro-batch count (``scale_grads=False``): the caller's losses
are already normalised by the step's global target count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["StageFn", "check_microbatches", "build_schedule"]

StageFn = Callable[..., object]


class _StageModule(nn.Module):
    """A parameter-free module calling a stage function (what PipelineStage needs)."""

    def __init__(self, fn: StageFn):
        super().__init__()
        self.fn = fn

    def forward(self, *carry, **batch):
        return self.fn(*carry, **batch)


def check_microbatches(schedule: str, microbatches: int, pp: int) -> None:
    """Raise ValueError when ``microbatches`` cannot run ``schedule`` on ``pp`` ranks (message
    names the flag, the count and what the schedule needs)."""
    flag = "--parallel.pp-microbatches"
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"{flag} {microbatches!r}: must be an integer >= 1")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"{flag} {microbatches}: the 1f1b schedule needs at least one micro-batch per pipeline rank "
                         f"(>= --parallel.pp {pp}); use more micro-batches or --parallel.pp-schedule gpipe")
    if schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(f"{flag} {microbatches}: the interleaved-1f1b schedule runs micro-batches in rounds of "
                             f"--parallel.pp {pp}; use a multiple of {pp} (or fewer than {2 * pp})")


def build_schedule(schedule: str, stages: Sequence[tuple[int, StageFn, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]],
                   num_stages: int, microbatches: int, group: dist.ProcessGroup, device: torch.device,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """A ``torch.distributed.pipelining`` schedule running this rank's ``stages``.

    Args:
        schedule: ``gpipe``, ``1f1b`` or ``interleaved-1f1b``.
        stages: this rank's stages, in order: ``(stage index, function, input examples, output
            examples)``; the examples give one micro-batch's shapes and dtypes (the first stage's
            inputs are empty: it reads the batch keywords).
        num_stages: stages over all ranks.
        microbatches: micro-batches per :meth:`step`.
        group: the ``pp`` process group (its rank r holds stages r, r + p, ...).
        loss_fn: ``(last stage output, target) -> loss`` for each micro-batch.
    Raises:
        ValueError: an unknown schedule, several stages on a single-stage schedule, or a
            micro-batch count the schedule cannot run (:func:`check_microbatches`).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pp = dist.get_world_size(group)
    check_microbatches(schedule, microbatches, pp)
    made = [PipelineStage(_StageModule(fn), index, num_stages, device, input_args=inputs, output_args=outputs, group=group)
            for index, fn, inputs, outputs in stages]
    if schedule in ("gpipe", "1f1b"):
        if len(made) != 1:
            raise ValueError(f"the {schedule} schedule runs one stage per rank, not {len(made)}")
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        return cls(made[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(made, microbatches, loss_fn=loss_fn, scale_grads=False)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; expected gpipe, 1f1b or interleaved-1f1b")
