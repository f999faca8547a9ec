"""Plan a training run on paper: what a layout needs per device for a model size, without
running it.

    python -m mff.recipes.plan --model deepseek3 --size v3-671b --devices 2048 --hardware h800 \\
        --parallel.pp 16 --parallel.ep 64 --seq-len 4096 --batch-size 15360 --ac full

Prints the memory per device of the most loaded pp rank at its peak moment (params, gradients,
optimizer state, the working copies of the params, activations of one micro-batch with and
without activation checkpointing and of the micro-batches the pipeline schedule keeps in
flight), the compute and communication per step of the slowest pp rank (the one the step
estimate uses), every pp rank's totals, the pipeline bubble, and an estimated step time,
tokens/s per device and MFU from the device table (:mod:`mff.plan`); ``--json FILE`` writes the
same as one JSON object. A layout the recipes would refuse is refused with their message. A
layout whose most loaded device needs more memory than the device has is refused (exit code 2)
saying by how much, at which moment of the step, and which single change of the options fits
(each tried on paper), or that no layout of that device count can fit and at least how many
devices it takes; ``--show-anyway`` prints the whole plan all the same. The last refusal comes
first, before the model's skeleton is built, from skeletons of a few layers (a million layers
are refused in seconds); a config of more than :data:`mff.plan.MAX_LAYERS` layers is refused.
Every option is checked before it is used (one line ``error: ...``, exit code 2), and ``--json``
is written through a temp file renamed over it (``error: --json PATH: <reason>`` when it
cannot be, leaving nothing behind).

What the planner reads: --model / --size / --model.<field> (the shapes), --devices, --hardware,
--seq-len, --batch-size, --grad-accum, --precision, --ac, --optim.name, --optim.muon-ns-steps,
--optim.muon-adamw-params, every --parallel.* size and pipeline option, --compute-efficiency,
--overlap, --json, --show-anyway. The training recipes' other --optim.* fields and
--parallel.timeout-s are accepted, so that a training command line plans as it is, and checked as
training checks them, but change nothing in a plan (their help says so).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Generic, Literal, TypeVar

import tyro

from mff.optim import OptimConfig
from mff.parallel import ParallelConfig
from mff.plan import format_plan, get_device, make_plan
from mff.recipes.common import parse_model_args, run_recipe_main

__all__ = ["PlanConfig", "PlanOptimConfig", "PlanParallelConfig", "main"]

C = TypeVar("C")

IGNORED = "Not read by the planner (accepted so that a training command line plans as it is)."


def _planner_view(cls: type, read: set[str], name: str, doc: str) -> type:
    """A subclass of the dataclass ``cls`` whose fields outside ``read`` say in their --help that
    the planner does not read them (:data:`IGNORED`); parsing, defaults and checks are ``cls``'s."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in read:
            continue
        default = {"default": f.default} if f.default is not dataclasses.MISSING else {"default_factory": f.default_factory}
        fields.append((f.name, Annotated[hints[f.name], tyro.conf.arg(help=IGNORED)], dataclasses.field(**default)))
    view = dataclasses.make_dataclass(name, fields, bases=(cls,), frozen=True, namespace={"__doc__": doc, "__module__": __name__})
    return view


PlanOptimConfig = _planner_view(OptimConfig, {"name", "muon_ns_steps", "muon_adamw_params"}, "PlanOptimConfig",
                                "The training recipes' optimizer options; the planner reads --optim.name (AdamW keeps two fp32 "
                                "moments, Muon one for the hidden matrices), --optim.muon-adamw-params and --optim.muon-ns-steps.")
PlanParallelConfig = _planner_view(ParallelConfig, {f.name for f in dataclasses.fields(ParallelConfig)} - {"timeout_s"},
                                   "PlanParallelConfig", "Parallel sizes and the pipeline schedule (as the training recipes take "
                                   "them; --parallel.timeout-s is not read by the planner).")


@dataclass(frozen=True)
class PlanConfig(Generic[C]):
    """A training run to plan. ``--model FAMILY`` and ``--size NAME`` choose ``model``'s defaults."""

    model: C
    """Model config (HF field names), e.g. --model.num-hidden-layers 4. The family is chosen by --model FAMILY."""
    size: str = "tiny"
    """Named size of the --model family whose config --model.* starts from (listed above)."""
    devices: int = 8
    """Devices of the run (WORLD_SIZE): --parallel.pp x dp-replicate x dp-shard x ep x tp."""
    hardware: str = "h100"
    """Device kind: h100, h800, h200, b200, 910b (Atlas 800T A2), 910c (Atlas 900 A3 SuperPoD, per die)."""
    seq_len: int = 4096
    """Tokens per sequence."""
    batch_size: int = 1024
    """Global batch in sequences per optimizer step (split over data-parallel ranks, --grad-accum and pipeline micro-batches)."""
    grad_accum: int = 1
    """Micro-batches (pipeline passes under --parallel.pp) per optimizer step on each data-parallel rank."""
    precision: Literal["fp32", "bf16-mixed", "bf16"] = "bf16-mixed"
    """fp32; bf16-mixed (fp32 params and optimizer state, bf16 compute); bf16 (bf16 params, fp32 optimizer state)."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing per block: none, full (keep each block's input) or selective (keep matmul and attention outputs)."""
    optim: PlanOptimConfig = PlanOptimConfig()  # type: ignore[valid-type]
    """Optimizer: --optim.name adamw (two fp32 moments) or muon (one for hidden matrices), --optim.muon-adamw-params, --optim.muon-ns-steps; the other --optim.* fields do not change a plan."""
    parallel: PlanParallelConfig = PlanParallelConfig()  # type: ignore[valid-type]
    """Parallel sizes and the pipeline schedule (--parallel.timeout-s does not change a plan)."""
    compute_efficiency: float = 0.5
    """Fraction of the device's peak FLOP/s the compute is assumed to reach (an assumption, not a measurement)."""
    overlap: Literal["none", "fsdp", "all"] = "none"
    """Communication hidden behind compute: none (mff's runtime: every collective waits), fsdp (FSDP/HSDP hidden, as torchtitan prefetches), all (every collective hidden)."""
    json: str | None = None
    """Also write the plan as one JSON object to this file ('-' = standard output, instead of the text)."""
    show_anyway: bool = False
    """Print (and write with --json) the whole plan even when the layout does not fit, its first line saying so (exit code still 2)."""


def _train_config(cfg: PlanConfig):
    from mff.train.config import TrainConfig

    return TrainConfig(model=cfg.model, seq_len=cfg.seq_len, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
                       precision=cfg.precision, ac=cfg.ac, optim=cfg.optim, parallel=cfg.parallel)


def _check_json(path: str | None) -> None:
    """Refuse a ``--json`` value that names no file before the plan is made (one line naming
    the flag and the value)."""
    if path is None or path == "-":
        return
    where = Path(path)
    if not path.strip():
        raise ValueError(f"--json {path!r}: expected a file name (or - for standard output)")
    if where.is_dir():
        raise ValueError(f"--json {path}: is a folder; expected a file name (or - for standard output)")
    parent = next((q for q in where.absolute().parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--json {path}: {parent} is not a folder")


def _write_json(path: str, plan: dict) -> None:
    """Write ``plan`` to ``path`` through a temp file beside it renamed over it (never a half-
    written or emptied file; the folder is made when missing).

    Raises:
        ValueError: ``--json PATH: <reason>`` when the file cannot be written (a full disk, no
            permission, ...); nothing is left behind.
    """
    from mff.ckpt.tokenizer_files import write_text_atomic

    try:
        write_text_atomic(path, json.dumps(plan, indent=1) + "\n")
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise ValueError(f"--json {path}: {reason[:1].lower()}{reason[1:]}") from None


def run(cfg: PlanConfig, family: str, size: str) -> int:
    from mff.models import build, get_family
    from mff.plan import check_config
    from mff.plan.estimate import check_efficiency, check_overlap
    from mff.plan.layout import check_mesh

    # options first, then the config's size from a few layers (milliseconds), and only then its skeleton
    check_efficiency(cfg.compute_efficiency)
    check_overlap(cfg.overlap)
    _check_json(cfg.json)
    get_device(cfg.hardware)
    check_mesh(cfg.parallel, cfg.devices)
    train_cfg = _train_config(cfg)
    check_config(get_family(family), size, cfg.model, hardware=cfg.hardware, devices=cfg.devices, train_cfg=train_cfg,
                 refuse=not cfg.show_anyway)
    model = build(family, cfg.model)  # a meta skeleton: no storage
    plan = make_plan(model, family=family, size=size, hardware=cfg.hardware, devices=cfg.devices, parallel=cfg.parallel,
                     train_cfg=train_cfg, compute_efficiency=cfg.compute_efficiency, overlap=cfg.overlap,
                     refuse=not cfg.show_anyway)
    code = 0 if plan["memory_gib"]["fits"] else 2
    if cfg.json == "-":
        print(json.dumps(plan, indent=1))
        return code
    if cfg.json is not None:
        _write_json(cfg.json, plan)
    print(format_plan(plan))
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        family, size, cfg = parse_model_args(PlanConfig, argv, prog="python -m mff.recipes.plan", description=__doc__)
        return run(cfg, family, size)

    return run_recipe_main(body)


if __name__ == "__main__":
    sys.exit(main())
