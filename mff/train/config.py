"""The options every training recipe shares (pretrain, finetune): parsed by tyro as flags, read
by the step loop (:mod:`mff.train.loop`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from mff.optim import OptimConfig
from mff.parallel import ParallelConfig

__all__ = ["TrainConfig", "MetricsConfig", "fit_default_warmup", "fit_default_precision", "flag_given"]

C = TypeVar("C")


@dataclass(frozen=True)
class MetricsConfig:
    """Where step metrics go besides the console and --metrics-file."""

    tensorboard: str | None = None
    """Write TensorBoard scalars (train/loss, train/lm_loss, ..., val/loss) to this folder (needs the tensorboard package)."""


@dataclass(frozen=True)
class TrainConfig(Generic[C]):
    """A training run: the model config, the step count, checkpoints, logging, precision and parallelism."""

    model: C
    """Model config (HF field names), e.g. --model.num-hidden-layers 4. The family is chosen by --model FAMILY (deepseek3, telechat3, qwen3, qwen3_moe, glm4, glm4_moe, llama)."""
    device: str | None = None
    """Device type: auto, cpu, cuda or npu; default: $MF_DEVICE_TYPE, else auto (npu, then cuda, then cpu)."""
    steps: int = 300
    """Optimizer steps of the whole run (the lr schedule spans them)."""
    stop_after: int | None = None
    """End after this step with a checkpoint, as a preemption would; rerun to continue."""
    seq_len: int = 256
    """Tokens per sequence."""
    batch_size: int = 16
    """Global batch in sequences per optimizer step (split over data-parallel ranks and micro-batches)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    seed: int = 0
    """Seed of the param init and the data order."""
    init_from: str | None = None
    """Start from these weights (an HF model folder, an mff checkpoint, a .gguf file, or a MindSpore .ckpt / MindFormers checkpoint
    with its HF config.json beside it) with a fresh optimizer and step 0; the model
    config is the checkpoint's (--model.* fields override it). Ignored when --ckpt-dir already holds a checkpoint (that resumes)."""
    ckpt_dir: str = "runs/pretrain"
    """Checkpoint folder; a run with a complete checkpoint there resumes from it."""
    save_every: int = 100
    """Save a checkpoint every N steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0 = all)."""
    eval_every: int = 100
    """Validate every N steps and at the last step (0 = never)."""
    eval_iters: int = 0
    """Validation batches per evaluation (0 = the whole validation split)."""
    metrics_file: str | None = None
    """Append one JSON object per step to this file (rank 0); README "Logging" lists the fields and units."""
    metrics: MetricsConfig = MetricsConfig()
    """Other metric outputs (TensorBoard)."""
    threads: int | None = None
    """torch CPU threads; default on CPU: the cores this process may use, split between the machine's torchrun processes, no more than the load average leaves free (printed at start)."""
    precision: Literal["fp32", "bf16-mixed", "bf16"] = "fp32"
    """fp32; bf16-mixed (fp32 params and optimizer state, bf16 compute); bf16 (bf16 params, fp32 optimizer state). The default below is for CPU and CUDA; on an NPU, --precision not given means bf16-mixed."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing per block: none, full (recompute the whole block in the backward) or selective (keep matmul and attention outputs, recompute the rest)."""
    compile: bool = False
    """Run each block through torch.compile (the first steps are slower while it compiles)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer (AdamW or Muon), clipping and lr schedule."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallel sizes."""


def flag_given(argv: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` (``--optim.warmup-steps``, also spelt with underscores or ``=VALUE``) is in ``argv``."""
    spellings = {flag, flag.replace("-", "_").replace("__", "--", 1)}
    return any(a.split("=", 1)[0] in spellings for a in argv)


def fit_default_warmup(cfg: TrainConfig, argv: Sequence[str]) -> TrainConfig:
    """``cfg`` with a default warmup that fits the run: when ``--optim.warmup-steps`` was not
    given and its default exceeds ``--steps``, the warmup is half the steps (``--steps 5``
    warms up over 2). A warmup given on the command line is kept as it is, and
    :func:`mff.train.loop.check_train_config` refuses it when it exceeds ``--steps``."""
    if flag_given(argv, "--optim.warmup-steps") or cfg.optim.warmup_steps <= cfg.steps:
        return cfg
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, warmup_steps=cfg.steps // 2))


def fit_default_precision(cfg: TrainConfig, argv: Sequence[str], device_type: str) -> TrainConfig:
    """``cfg`` with bf16-mixed precision on an NPU when ``--precision`` was not given (what
    MindFormers runs on Ascend: bf16 compute, fp32 params; the NPU's matrix units have no fast
    fp32 path). Given on the command line, or on another device, the precision is kept."""
    if device_type != "npu" or flag_given(argv, "--precision"):
        return cfg
    return dataclasses.replace(cfg, precision="bf16-mixed")
