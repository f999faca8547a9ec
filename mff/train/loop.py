"""The one step loop every training recipe runs, and the checks and resume logic around it.

A recipe (``pretrain``, ``finetune``) builds the mesh, the model, the params, the data and the
optimizer state, then calls :func:`train_loop` with a :class:`Loop`: per step it takes the next
batch, runs :func:`mff.train.step.train_step`, logs the losses, lr, grad norm, tokens/s and MFU,
validates every ``--eval-every`` steps and at the last step, and writes a checkpoint every
``--save-every`` steps, at the end, at ``--stop-after`` and on SIGTERM. What differs between
recipes is data: which params the optimizer trains (those with ``requires_grad``), which of them
a checkpoint holds (``Loop.saved``: every param when pretraining, the adapters only for LoRA),
the loader and the checkpoint metadata.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mff import ckpt
from mff.backend import available_memory_gib
from mff.ckpt.tokenizer_files import write_text_atomic
from mff.data import split_microbatches
from mff.model import Model
from mff.nn.blocks import AC_MODES
from mff.nn.moe import Experts
from mff.optim import lr_at
from mff.optim.schedule import decay_steps_of
from mff.parallel import placements_of
from mff.parallel.mesh import pipeline_size
from mff.parallel.summary import placement_table
from mff.parallel.watchdog import collective
from mff.train.config import TrainConfig
from mff.train.log import RunLog, is_rank0, print0
from mff.train.metrics import measure_matmul_flops, memory_estimate_gib, mfu
from mff.train.precision import PRECISIONS, compute_dtype, param_dtype
from mff.train.state import check_resume_config, check_resume_recipe, check_run_meta, restore_rng, rng_state
from mff.train.step import NonFiniteError, check_finite, eval_loss, train_step

__all__ = ["Loop", "train_loop", "check_train_config", "memory_check", "resumable", "resume", "rank_slices", "print_run_header"]


def check_train_config(cfg: TrainConfig, model: Model, dp_size: int) -> None:
    """Raise ValueError naming the first option of ``cfg`` that cannot run with ``model`` on
    ``dp_size`` data-parallel ranks (sequence length, steps, batch split, intervals, precision,
    activation checkpointing, optimizer and schedule)."""
    mc = model.config
    if cfg.seq_len < 1 or cfg.seq_len > mc.max_position_embeddings:
        raise ValueError(f"--seq-len {cfg.seq_len} must be in [1, {mc.max_position_embeddings}] (the model's max_position_embeddings)")
    if cfg.steps < 1:
        raise ValueError(f"--steps {cfg.steps} must be >= 1")
    if cfg.stop_after is not None and not 1 <= cfg.stop_after <= cfg.steps:
        raise ValueError(f"--stop-after {cfg.stop_after} must be in [1, --steps {cfg.steps}]")
    if cfg.grad_accum < 1:
        raise ValueError(f"--grad-accum {cfg.grad_accum} must be >= 1")
    if cfg.batch_size < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} must be >= 1")
    if cfg.batch_size % (dp_size * cfg.grad_accum):
        raise ValueError(
            f"--batch-size {cfg.batch_size} must be divisible by data-parallel ranks {dp_size} x --grad-accum {cfg.grad_accum} = {dp_size * cfg.grad_accum}"
        )
    for flag, value in (("--save-every", cfg.save_every), ("--keep-last", cfg.keep_last), ("--eval-every", cfg.eval_every)):
        if value < 0:
            raise ValueError(f"{flag} {value} must be >= 0")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads {cfg.threads} must be >= 1")
    if cfg.eval_iters < 0:
        raise ValueError(f"--eval-iters {cfg.eval_iters} must be >= 0 (0 = the whole validation split)")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"--precision {cfg.precision!r} must be one of {PRECISIONS}")
    if cfg.ac not in AC_MODES:
        raise ValueError(f"--ac {cfg.ac!r} must be one of {AC_MODES}")
    if cfg.compile and cfg.ac == "selective" and cfg.parallel.ep > 1 and any(isinstance(m, Experts) for m in model.skeleton.modules()):
        raise ValueError("--ac selective with --compile is not supported with --parallel.ep > 1 (the all-to-all expert dispatch "
                         "runs eagerly, a graph break that selective recomputation cannot cross); use --ac full with --compile")
    cfg.optim.validate()
    if cfg.optim.warmup_steps > cfg.steps:
        raise ValueError(f"--optim.warmup-steps {cfg.optim.warmup_steps} exceeds --steps {cfg.steps}")
    decay_steps_of(cfg.optim.schedule, cfg.optim.warmup_steps, cfg.steps, cfg.optim.decay_ratio)  # wsd overlap check


def rank_slices(batches: list[dict], rank: int, size: int) -> list[dict]:
    """This rank's rows of each batch: every rank runs the same number of forwards (FSDP's
    gathers are collectives). Raises ValueError when a batch has fewer rows than ranks."""
    out = []
    for b in batches:
        if b["input_ids"].shape[0] < size:  # checked on every rank (not only on those left without rows), so all stop alike
            raise ValueError(f"the validation split has {b['input_ids'].shape[0]} windows, fewer than the {size} data-parallel ranks; "
                             "give it more documents (--data.val-permille; --data.split for Megatron data) or use --eval-every 0")
        out.append({k: torch.tensor_split(v, size)[rank] for k, v in b.items()})
    return out


def memory_check(cfg: TrainConfig, model: Model, device: torch.device, shard: int, dp_size: int,
                 trainable: int | None = None, param_bytes: float = 4) -> dict[str, float]:
    """Estimated memory per device (GiB: params, optimizer, activations, total); raises
    ValueError when it exceeds what the device has free. ``trainable``: params with optimizer
    state (default: every trainable param of the model); ``param_bytes``: bytes per stored param."""
    shapes = model.param_shapes()
    numel = sum(math.prod(s) for s in shapes.values()) // shard
    if trainable is None:
        trainable = sum(math.prod(s) for p, s in shapes.items() if model.is_trainable(p))
    mc = model.config
    mem = memory_estimate_gib(numel, param_bytes, trainable // shard, cfg.batch_size // dp_size // cfg.grad_accum * cfg.seq_len,
                              mc.hidden_size, mc.num_hidden_layers + getattr(mc, "num_nextn_predict_layers", 0),
                              mc.num_attention_heads, cfg.seq_len, 4)
    free = available_memory_gib(device)
    if free is not None and mem["total"] > free:
        raise ValueError(f"this run needs about {mem['total']:.1f} GiB per device (params {mem['params']:.1f}, optimizer "
                         f"{mem['optimizer']:.1f}, activations {mem['activations']:.1f}) but {device} has {free:.1f} GiB free; "
                         "use a smaller --size, --batch-size or --seq-len, or more devices")
    return mem


@contextlib.contextmanager
def _previous_step_hint(last: Path):
    """A CheckpointError raised inside (the newest step ``last`` is corrupt) also says which earlier
    step is still there and how to resume from it."""
    try:
        yield
    except ckpt.CheckpointError as e:
        root = last.parent
        older = [s for s in ckpt.list_steps(root) if ckpt.step_dir_name(s) < last.name]
        if not older:
            raise
        prev = ckpt.step_dir_name(older[-1])
        raise ckpt.CheckpointError(f"{e}; the previous checkpoint {root / prev} is still there: to resume from it, move {last} "
                                   f"out of {root} and write '{prev}' into {root / 'latest'}") from None


def resumable(cfg: TrainConfig, family: str, model: Model, check: Callable[[dict, Path], None] | None = None,
              recipe: str = "pretrain") -> Path | None:
    """The newest checkpoint folder of ``--ckpt-dir`` (None if there is none), once its recipe
    (``recipe``: ``"pretrain"`` or ``"finetune"``), model, sequence length, precision and
    optimizer (and whatever ``check(meta, folder)`` checks) are checked against this run; called
    before the data is read so that a wrong ``--ckpt-dir`` fails at once.

    Raises:
        CheckpointError: the checkpoint was made by a run this one cannot continue.
    """
    last = ckpt.latest_step_dir(cfg.ckpt_dir)
    if last is None:
        return None
    with _previous_step_hint(last):
        meta = ckpt.read_meta(last, required=("tokens_seen", "data", "rng", "family", "config", "run"))
        check_run_meta(meta, last / "meta.msgpack", model.config)
    check_resume_recipe(meta, recipe, last)
    check_resume_config(meta, family, model.config)
    saved_len = meta["run"].get("seq_len")
    if saved_len != cfg.seq_len:
        raise ckpt.CheckpointError(f"{last} was trained with --seq-len {saved_len}; this run has --seq-len {cfg.seq_len} "
                                   "(the sample stream would differ; use another --ckpt-dir)")
    saved_precision = meta["run"].get("precision", "fp32")
    if param_dtype(saved_precision) != param_dtype(cfg.precision):
        raise ckpt.CheckpointError(f"{last} was trained with --precision {saved_precision} (params stored in "
                                   f"{str(param_dtype(saved_precision)).replace('torch.', '')}); this run has --precision {cfg.precision}. "
                                   "fp32 and bf16-mixed can resume each other's checkpoints; bf16 only its own")
    saved_optim = (meta["run"].get("optim") or {}).get("name", "adamw")
    if saved_optim != cfg.optim.name:
        raise ckpt.CheckpointError(f"{last} holds {saved_optim} optimizer state; this run has --optim.name {cfg.optim.name} "
                                   "(use the same optimizer to resume, or another --ckpt-dir with --init-from)")
    if check is not None:
        check(meta, last)
    return last


def resume(cfg: TrainConfig, last: Path | None, saved: dict[str, torch.Tensor], opt_state: dict, loader,
           model_params: Collection[str] | None = None) -> tuple[dict, dict, int, int]:
    """Load the checkpoint folder ``last`` (from :func:`resumable`; None: start at step 0) onto
    the templates ``saved`` (the params a checkpoint holds) and ``opt_state``, and the loader's
    position and the RNG states; returns ``(saved params, optimizer state, step, tokens seen)``.
    ``model_params``: every param path of the model, when ``saved`` holds a part of them (this
    rank's pipeline stages)."""
    if last is None:
        return saved, opt_state, 0, 0
    where = f"{last / 'meta.msgpack'}"
    with _previous_step_hint(last):
        loaded, err = None, None
        try:
            loaded = ckpt.load(last, saved, opt_state, model_params)
        except ckpt.CheckpointError as e:
            err = e
        ckpt.agree(err, f"reading {last}")  # a rank that cannot read its pieces stops every rank (each reads only its own)
        saved, opt_state, meta = loaded
        try:
            loader.load_state_dict(meta["data"])
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as e:
            if isinstance(e, ValueError) and str(e).startswith("data:"):  # a position of another data stream: the loader says which
                raise ValueError(f"{where}: {e}") from None
            raise ckpt.CheckpointError(f"{where} is corrupt: its data position cannot be restored ({type(e).__name__}: {e})") from None
        restore_rng(meta["rng"], where)
    print0(f"resumed from {last} (step {meta['step']}, {meta['tokens_seen']:,} tokens seen)")
    saved_steps = meta["run"].get("steps")
    if saved_steps is not None and saved_steps != cfg.steps:
        print0(f"note: {last} was trained toward --steps {saved_steps}; this run has --steps {cfg.steps}, so the lr schedule "
               f"of the steps after {meta['step']} is the one of a {cfg.steps}-step run")
    for flag, saved_value, now in (("--batch-size", meta["run"].get("batch_size"), cfg.batch_size),
                                   ("--optim.lr", (meta["run"].get("optim") or {}).get("lr"), cfg.optim.lr)):
        if saved_value is not None and saved_value != now:
            print0(f"note: {last} was trained with {flag} {saved_value}; this run continues with {flag} {now}")
    return saved, opt_state, meta["step"], meta["tokens_seen"]


def print_run_header(name: str, model: Model, dist_info, mesh, params: Mapping[str, torch.Tensor], mem: dict[str, float],
                     data_line: str, peak: float, peak_src: str, flops_per_token: float, extra: str = "") -> None:
    """The start-up lines (rank 0): model and param counts, device and mesh, placements, the
    memory estimate, the data summary and the FLOP figures."""
    counts = model.param_counts()
    placements = placements_of(params)
    mtp = (f"; without MTP {counts['total_no_mtp']:,} / {counts['activated_no_mtp']:,}"
           if counts["total_no_mtp"] != counts["total"] else "")
    print0(f"model {name}: {counts['total']:,} params ({counts['activated']:,} activated per token{mtp}){extra}")
    axes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    if pipeline_size(mesh) > 1:
        axes = {"pp": pipeline_size(mesh), **axes}
    print0(f"device {dist_info.device} x {dist_info.world_size} ({dist_info.backend}), mesh {axes}")
    scope = " of pp rank 0's stages" if pipeline_size(mesh) > 1 else ""  # each pp rank holds its stages' params only
    if len(set(placements.values())) == 1:
        print0(f"placements: {next(iter(placements.values()))} (all {len(placements)} params{scope})")
    else:
        print0(f"placements{scope}:\n  " + "\n  ".join(placement_table(params)))
    print0("memory per device (estimate): " + ", ".join(f"{k} {v:.3f} GiB" for k, v in mem.items()))
    print0(f"{data_line}; peak {peak / 1e9:.1f} GFLOP/s ({peak_src}); {flops_per_token / 1e6:.1f} MFLOP/token")


def print_run_plan(cfg: TrainConfig, run: "Loop") -> None:
    """The resolved run on rank 0, before the first step: global batch, tokens per step and in
    all, the lr schedule, precision and optimizer; and the resolved options and model config
    written to ``CKPT_DIR/run_config.json`` (temp name, then rename), with the device, process
    count and CPU threads the run picked under ``resolved``."""
    tokens_per_step = cfg.batch_size * cfg.seq_len
    o = cfg.optim
    sched = f"{o.schedule} (warmup {o.warmup_steps}"
    if o.schedule in ("cosine", "linear", "wsd"):
        sched += f", to {o.min_lr_ratio:g} x peak"
    if o.schedule == "wsd":
        sched += f", last {o.decay_ratio:g} of the steps decay ({o.decay_type})"
    sched += ")"
    print0(f"run: {cfg.steps:,} steps x global batch {cfg.batch_size} x {cfg.seq_len} tokens = {tokens_per_step:,} tokens/step, "
           f"{cfg.steps * tokens_per_step:,} tokens in all (grad accum {cfg.grad_accum}); {o.name} lr {o.lr:g} {sched}, "
           f"clip {o.max_grad_norm:g}; precision {cfg.precision}; ac {cfg.ac}; compile {cfg.compile}; seed {cfg.seed}; "
           f"checkpoints {cfg.ckpt_dir} every {cfg.save_every or 'end'}")
    if not is_rank0():
        return
    doc = {"family": run.meta.get("family"), "size": run.meta.get("size"), "run": run.meta.get("run"), "config": run.meta.get("config"),
           "mesh": run.meta.get("mesh"), "resolved": {"device": str(run.device), "world_size": run.world_size,
                                                      "threads": torch.get_num_threads(), "warmup_steps": o.warmup_steps}}
    write_text_atomic(Path(cfg.ckpt_dir) / "run_config.json", json.dumps(doc, indent=2, default=str) + "\n")


@dataclass
class Loop:
    """What :func:`train_loop` runs.

    Attributes:
        cfg: the run's options (steps, stop-after, intervals, precision, optimizer, ckpt dir).
        model: the model (with its LoRA slots when adapters are trained).
        params: every tensor the forward needs; the optimizer updates those with
            ``requires_grad`` (with ``opt_state`` over exactly them).
        saved: the params a checkpoint holds (the same tensors as in ``params``).
        opt_state: the optimizer state.
        loader: ``next_batch() -> dict`` of this rank's rows, ``state_dict()``.
        val_batches: this rank's validation batches ([] = no validation).
        val_entropy: the validation unigram entropy (printed beside the validation loss) or None.
        meta: checkpoint metadata besides the per-step fields (family, config, run options, ...).
        device, world_size: where the batches go; the processes (for MFU).
        start, tokens_seen: the step the run continues from and the tokens seen so far.
        bias_update_rate: the expert-bias step (aux-loss-free balancing; 0 = off).
        flops_per_token, peak_flops: for MFU.
        epoch: ``loader position -> epochs`` for the log (None: not shown).
        pipeline: this rank's pipeline stages (:class:`mff.train.pipeline.Pipeline`) under
            pipeline parallelism, which then runs the steps and the validation; None otherwise.
    """

    cfg: TrainConfig
    model: Model
    params: dict[str, torch.Tensor]
    saved: dict[str, torch.Tensor]
    opt_state: dict
    loader: Any
    val_batches: list[dict]
    val_entropy: float | None
    meta: dict
    device: torch.device
    world_size: int
    start: int = 0
    tokens_seen: int = 0
    bias_update_rate: float = 0.0
    flops_per_token: float = 0.0
    peak_flops: float = 1.0
    epoch: Callable[[], float] | None = None
    extra_meta: Callable[[], dict] = field(default_factory=lambda: dict)
    pipeline: Any = None


def _remeasure_peak(run: Loop, log: RunLog, step: int, tps: float) -> float:
    """A step ran above the CPU peak measured at start-up, so that measurement met a loaded
    machine: measure the matmul again now (about 0.25 s, best of repeated timings) and keep the
    higher peak, saying so. Returns the step's MFU against the peak now in use."""
    again = measure_matmul_flops(run.device, compute_dtype(run.cfg.precision), seconds=0.25)
    if again > run.peak_flops:
        log.write(f"note: peak re-measured at step {step}: {again / 1e9:.1f} GFLOP/s (start-up: {run.peak_flops / 1e9:.1f}, "
                  "measured while other work loaded the machine); MFU is against the new peak from here on")
        run.peak_flops = again
    return mfu(run.flops_per_token, tps, run.peak_flops, run.world_size)


def train_loop(run: Loop) -> int:
    """Steps ``run.start + 1 .. min(--steps, --stop-after)``; returns the exit code (0, or 128 +
    the signal when SIGTERM or Ctrl-C (SIGINT) stopped it: the step in progress is finished
    and saved; a second Ctrl-C leaves at once, without it, as KeyboardInterrupt).

    Raises:
        NonFiniteError: a non-finite loss, grad norm or param (nothing is saved for that step;
            the message names the last checkpoint).
    """
    cfg = run.cfg
    end = min(cfg.steps, cfg.stop_after or cfg.steps)
    print_run_plan(cfg, run)
    log = RunLog(cfg.metrics_file, total=cfg.steps, initial=run.start, tensorboard=cfg.metrics.tensorboard,
                 resumed_from=str(Path(cfg.ckpt_dir) / ckpt.step_dir_name(run.start)) if 0 < run.start < end else None)
    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: leave now, without the checkpoint
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _steps(run, cfg, end, log, stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop_signal(stop: dict, world_size: int, device: torch.device) -> int | None:
    """The signal that stops the run after this step, agreed by every rank (a signal may reach
    the ranks on either side of a step's end; without agreeing, one rank would save while the
    others went on into the next step's collectives)."""
    if world_size <= 1:
        return stop["signal"]
    import torch.distributed as dist

    flag = torch.tensor([stop["signal"] or 0], dtype=torch.int64, device=device)
    with collective("stop-signal check"):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) or None


def _steps(run: Loop, cfg: TrainConfig, end: int, log: RunLog, stop: dict) -> int:
    tokens_seen = run.tokens_seen

    def save(step: int) -> None:
        meta = {**run.meta, **run.extra_meta(), "tokens_seen": tokens_seen, "data": run.loader.state_dict(), "rng": rng_state()}
        with collective(f"checkpoint of step {step}"):
            check_finite(run.saved, run.opt_state)
            state = run.pipeline.saved_state(run.opt_state) if run.pipeline is not None else run.opt_state
            path = ckpt.save(cfg.ckpt_dir, step, run.saved, state, meta, cfg.keep_last)
        log.write(f"checkpoint {path}")

    if run.start >= end:
        print0(f"nothing to do: the checkpoint is at step {run.start} and the run ends at step {end}")
        log.close()
        return 0
    step = run.start
    remeasures = 0  # of the CPU peak, when a step ran above it (it was measured under load)
    t_first = time.perf_counter()
    try:
        for step in range(run.start + 1, end + 1):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.optim, cfg.steps)
            batch = {k: v.to(run.device) for k, v in run.loader.next_batch().items()}
            with collective(f"step {step}"):
                micro = split_microbatches(batch, cfg.grad_accum)
                if run.pipeline is not None:
                    stats = run.pipeline.step(run.params, run.opt_state, micro, lr, cfg.optim, run.bias_update_rate)
                else:
                    stats = train_step(run.model, run.params, run.opt_state, micro, lr, cfg.optim, run.bias_update_rate, cfg.precision)
            tokens_seen += stats.tokens
            dt = time.perf_counter() - t0
            tps = stats.tokens / dt
            rec = {"step": step, "loss": stats.loss, "lm_loss": stats.losses.get("lm"), "balance_loss": stats.losses.get("balance", 0.0),
                   "mtp_loss": stats.losses.get("mtp", 0.0), "lr": lr, "grad_norm": stats.grad_norm, "tokens_per_s": tps,
                   "mfu": mfu(run.flops_per_token, tps, run.peak_flops, run.world_size)}
            if rec["mfu"] > 1.0 and remeasures < 3 and run.device.type == "cpu" and is_rank0():
                remeasures += 1
                rec["mfu"] = _remeasure_peak(run, log, step, tps)
            elapsed = time.perf_counter() - t_first
            rec["elapsed_s"] = elapsed
            rec["eta_s"] = elapsed / (step - run.start) * (end - step)
            if run.epoch is not None:
                rec["epoch"] = run.epoch()
            if run.val_batches and (step % cfg.eval_every == 0 or step == cfg.steps):
                with collective(f"validation at step {step}"):
                    val = [{k: v.to(run.device) for k, v in b.items()} for b in run.val_batches]
                    if run.pipeline is not None:
                        rec["val_loss"] = run.pipeline.eval_loss(run.params, val)
                    else:
                        rec["val_loss"] = eval_loss(run.model, run.params, val, cfg.precision)
            log.step(rec, run.val_entropy)
            signum = _stop_signal(stop, run.world_size, run.device)
            if step == end or (cfg.save_every and step % cfg.save_every == 0) or signum:
                save(step)
            if signum:
                log.write(f"{signal.Signals(signum).name}: checkpoint saved at step {step} in {cfg.ckpt_dir}; "
                          "rerun the same command to resume")
                log.close()
                return 128 + signum
    except NonFiniteError as e:
        log.close()
        last = ckpt.latest_step_dir(cfg.ckpt_dir)
        raise NonFiniteError(f"step {step}: {e}; nothing was saved for this step (last checkpoint: {last or 'none'})") from None
    log.close()
    return 0
