"""The layout a plan is made for: mesh sizes, pipeline stages and micro-batches, resolved and
checked with the run's own rules, so a layout the planner accepts is one the training recipes
accept (and the planner refuses what they refuse, with the same messages).

- mesh: :func:`mff.parallel.mesh_shape` (``pp x dp_replicate x dp_shard x ep x tp`` must be the
  device count; ``--parallel.dp-shard -1`` takes the rest);
- the batch and training options: :func:`mff.train.loop.check_train_config` (``--batch-size``
  divisible by the data-parallel ranks times ``--grad-accum``, ``--seq-len`` within the model's
  positions, precision, activation checkpointing, optimizer);
- pipeline stages: :func:`mff.train.pipeline.plan_stages` (``--parallel.pp-layers`` or the
  balanced split), micro-batches :func:`mff.parallel.pp.check_microbatches`;
- param dims that do not divide their mesh axes: :func:`mff.plan.shards.param_shards` (the
  sharding rules themselves).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from mff.parallel.mesh import MESH_AXES, ParallelConfig, mesh_shape
from mff.parallel.pp_layout import StageLayout

__all__ = ["Layout", "check_devices", "check_mesh", "devices_message", "resolve_layout"]


def check_devices(devices: int) -> None:
    """Raise ValueError (one line naming ``--devices``) unless ``devices`` is an integer >= 1."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"--devices {devices!r}: must be an integer >= 1")


def devices_message(message: str) -> str:
    """A refusal of :func:`mff.parallel.mesh_shape` in the planner's words: the device count it
    calls ``WORLD_SIZE`` (and its processes) is what the planner's user gives as ``--devices``."""
    message = re.sub(r"\bWORLD_SIZE\b", "--devices", message)
    return message.replace(" processes, but --devices", " devices, but --devices")


def check_mesh(parallel: ParallelConfig, devices: int) -> tuple[int, int, int, int]:
    """:func:`mff.parallel.mesh_shape` of ``devices`` devices (``dp_replicate, dp_shard, ep,
    tp``), its refusals naming ``--devices`` (:func:`devices_message`). Needs no model.

    Raises:
        ValueError: a device count < 1, a mesh the run refuses (one line)."""
    check_devices(devices)
    try:
        return mesh_shape(parallel, devices)
    except ValueError as e:  # the run's message names WORLD_SIZE, which the planner's user gives as --devices
        raise ValueError(devices_message(str(e))) from None


@dataclass(frozen=True)
class Layout:
    """A resolved layout.

    Attributes:
        devices: all devices; ``sizes``: mesh axis -> size (``pp`` and :data:`MESH_AXES`).
        dp: data-parallel ranks (``dp_replicate x dp_shard x ep``).
        stages: the pipeline stages (one stage of every layer when pp = 1).
        microbatches: micro-batches of one pipeline pass (1 when pp = 1).
        passes: pipeline passes per step (``--grad-accum``); micro-batches per step and data-
            parallel rank are ``passes x microbatches``.
        rows: sequences of one micro-batch; ``seq_len``: tokens per sequence.
        schedule: the pipeline schedule.
    """

    devices: int
    sizes: dict[str, int]
    dp: int
    stages: StageLayout
    microbatches: int
    passes: int
    rows: int
    seq_len: int
    schedule: str

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on a device."""
        return self.rows * self.seq_len

    @property
    def steps_microbatches(self) -> int:
        """Micro-batches per step and data-parallel rank."""
        return self.passes * self.microbatches


def resolve_layout(model, parallel: ParallelConfig, devices: int, train_cfg) -> Layout:
    """The :class:`Layout` of ``model`` on ``devices`` devices with ``parallel`` and the options
    of ``train_cfg`` (a :class:`mff.train.config.TrainConfig`: seq_len, batch_size, grad_accum,
    precision, ac, optim).

    Raises:
        ValueError: a device count < 1, or any refusal of the functions named in the module
            docstring (one line naming the flag and what it needed).
    """
    from mff.train.loop import check_train_config

    shape = check_mesh(parallel, devices)
    sizes = {"pp": parallel.pp, **dict(zip(MESH_AXES, shape))}
    dp = shape[0] * shape[1] * shape[2]
    check_train_config(dataclasses.replace(train_cfg, parallel=parallel), model, dp)
    rows = train_cfg.batch_size // dp // train_cfg.grad_accum
    if parallel.pp == 1:
        L = model.config.num_hidden_layers
        return Layout(devices, sizes, dp, StageLayout((range(L),), 1, 1), 1, train_cfg.grad_accum, rows, train_cfg.seq_len, "none")
    from mff.parallel.pp import check_microbatches
    from mff.train.pipeline import plan_stages

    stages = plan_stages(model, parallel, train_cfg.seq_len)
    m = parallel.pp_microbatches if parallel.pp_microbatches is not None else stages.num_stages  # 0 is refused, not the default
    check_microbatches(parallel.pp_schedule, m, parallel.pp)
    if rows % m:
        raise ValueError(f"--parallel.pp-microbatches {m} does not divide the {rows} rows each pipeline gets per pass "
                         f"(--batch-size {train_cfg.batch_size} / {dp} data-parallel ranks / --grad-accum {train_cfg.grad_accum})")
    return Layout(devices, sizes, dp, stages, m, train_cfg.grad_accum, rows // m, train_cfg.seq_len, parallel.pp_schedule)
