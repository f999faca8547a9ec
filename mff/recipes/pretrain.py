"""Pretrain a model from scratch: ``python -m mff.recipes.pretrain --model deepseek3``.

backend -> mesh -> model and params -> data -> optimizer -> resume -> loop {step, log, eval,
checkpoint}. ``--model FAMILY --size NAME`` pick the model config; ``--model.<hf-field>``
overrides any of its fields; every other option is a flag (``--help`` lists them). Under
``torchrun`` the same command runs data-parallel (FSDP over ``--parallel.dp-shard``).
``--from-mindformers-yaml run.yaml`` starts from the flags a MindFormers pretraining YAML
translates to (printed, with the YAML keys it ignores; flags given too win; see
mff.recipes.mindformers_yaml).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

import torch
import torch.distributed as dist

from mff import ckpt
from mff.backend import DeviceUnavailable, init_distributed, resolve_device
from mff.ckpt.autoload import checkpoint_kind, tokenizer_folder
from mff.ckpt.autoload import load as load_checkpoint
from mff.data import (
    DataConfig,
    Loader,
    build_pretrain_data,
    eval_batches,
    split_microbatches,
    unigram_entropy,
)
from mff.data.megatron_source import SampleLoader, as_blend, batch_keys, build_megatron_data, sample_batches
from mff.models import build, get_family
from mff.models.common import config_from_dict
from mff.nn.blocks import AC_MODES
from mff.nn.moe import MoE
from mff.optim import OptimConfig, init_state, lr_at
from mff.optim.schedule import decay_steps_of
from mff.parallel import ParallelConfig, build_mesh, data_parallel_rank, data_parallel_size, placements_of
from mff.parallel.summary import placement_table
from mff.parallel.watchdog import CollectiveTimeout, collective
from mff.recipes.common import (
    RunLog,
    check_resume_config,
    config_to_dict,
    fail,
    parse_model_args,
    print0,
    restore_rng,
    rng_state,
)
from mff.recipes.mindformers_yaml import FLAG as MF_YAML_FLAG
from mff.recipes.mindformers_yaml import expand_argv as expand_mindformers_argv
from mff.train.metrics import available_memory_gib, device_peak_flops, memory_estimate_gib, mfu
from mff.train.precision import PRECISIONS, param_dtype
from mff.train.step import NonFiniteError, check_finite, eval_loss, train_step

C = TypeVar("C")


@dataclass(frozen=True)
class PretrainConfig(Generic[C]):
    """Pretraining run. ``--model FAMILY`` and ``--size NAME`` choose ``model``'s defaults."""

    model: C
    """Model config (HF field names), e.g. --model.num-hidden-layers 4. The family is chosen by --model FAMILY (deepseek3, telechat3, qwen3, qwen3_moe, glm4, glm4_moe, llama)."""
    size: str = "tiny"
    """Named size of the --model family whose config --model.* starts from (listed above)."""
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
    """Append one JSON object per step to this file (rank 0)."""
    threads: int | None = None
    """torch CPU threads (default: torch's choice)."""
    precision: Literal["fp32", "bf16-mixed", "bf16"] = "fp32"
    """fp32; bf16-mixed (fp32 params and optimizer state, bf16 compute); bf16 (bf16 params, fp32 optimizer state)."""
    ac: Literal["none", "full", "selective"] = "none"
    """Activation checkpointing per block: none, full (recompute the whole block in the backward) or selective (keep matmul and attention outputs, recompute the rest)."""
    compile: bool = False
    """Run each block through torch.compile (the first steps are slower while it compiles)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer (AdamW or Muon), clipping and lr schedule."""
    data: DataConfig = DataConfig()
    """Training data."""
    parallel: ParallelConfig = ParallelConfig()
    """Parallel sizes."""


def _check(cfg: PretrainConfig, model, dp_size: int) -> None:
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
    if cfg.compile and cfg.ac == "selective" and any(isinstance(m, MoE) for m in model.skeleton.modules()):
        raise ValueError("--ac selective with --compile is not supported for models with MoE layers (the grouped expert GEMMs run "
                         "eagerly, a graph break that selective recomputation cannot cross); use --ac full with --compile")
    cfg.optim.validate()
    if cfg.optim.warmup_steps > cfg.steps:
        raise ValueError(f"--optim.warmup-steps {cfg.optim.warmup_steps} exceeds --steps {cfg.steps}")
    decay_steps_of(cfg.optim.schedule, cfg.optim.warmup_steps, cfg.steps, cfg.optim.decay_ratio)  # wsd overlap check


def _rank_slices(batches: list[dict], rank: int, size: int) -> list[dict]:
    """This rank's rows of each batch: every rank runs the same number of forwards (FSDP's
    gathers are collectives)."""
    out = []
    for b in batches:
        parts = {k: torch.tensor_split(v, size)[rank] for k, v in b.items()}
        if parts["input_ids"].shape[0] == 0:
            raise ValueError(f"the validation split has {b['input_ids'].shape[0]} windows, fewer than the {size} data-parallel ranks")
        out.append(parts)
    return out


def _memory_check(cfg: PretrainConfig, model, device: torch.device, shard: int, dp_size: int) -> dict[str, float]:
    """Estimated memory per device; an error when it exceeds what the device has free."""
    shapes = model.param_shapes()
    numel = sum(math.prod(s) for s in shapes.values()) // shard
    trainable = sum(math.prod(s) for p, s in shapes.items() if model.is_trainable(p)) // shard
    mc = model.config
    mem = memory_estimate_gib(numel, 4, trainable, cfg.batch_size // dp_size // cfg.grad_accum * cfg.seq_len,
                              mc.hidden_size, mc.num_hidden_layers + getattr(mc, "num_nextn_predict_layers", 0),
                              mc.num_attention_heads, cfg.seq_len, 4)
    free = available_memory_gib(device)
    if free is not None and mem["total"] > free:
        raise ValueError(f"this run needs about {mem['total']:.1f} GiB per device (params {mem['params']:.1f}, optimizer "
                         f"{mem['optimizer']:.1f}, activations {mem['activations']:.1f}) but {device} has {free:.1f} GiB free; "
                         "use a smaller --size, --batch-size or --seq-len, or more devices")
    return mem


def _resumable(cfg: PretrainConfig, family: str, model):
    """The newest checkpoint folder of ``--ckpt-dir`` (None if there is none), once its model,
    sequence length, precision and optimizer are checked against this run; called before the
    data is read so that a wrong ``--ckpt-dir`` fails at once.

    Raises:
        CheckpointError: the checkpoint was made by a run this one cannot continue.
    """
    last = ckpt.latest_step_dir(cfg.ckpt_dir)
    if last is None:
        return None
    meta = ckpt.read_meta(last, required=("tokens_seen", "data", "rng", "family", "config", "run"))
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
    return last


def _resume(cfg: PretrainConfig, last, params, opt_state, loader):
    """Load the checkpoint folder ``last`` (from ``_resumable``; None: start at step 0);
    returns (params, state, step, tokens)."""
    if last is None:
        return params, opt_state, 0, 0
    params, opt_state, meta = ckpt.load(last, params, opt_state)
    loader.load_state_dict(meta["data"])
    restore_rng(meta["rng"])
    print0(f"resumed from {last} (step {meta['step']}, {meta['tokens_seen']:,} tokens seen)")
    saved_steps = meta["run"].get("steps")
    if saved_steps is not None and saved_steps != cfg.steps:
        print0(f"note: {last} was trained toward --steps {saved_steps}; this run has --steps {cfg.steps}, so the lr schedule "
               f"of the steps after {meta['step']} is the one of a {cfg.steps}-step run")
    return params, opt_state, meta["step"], meta["tokens_seen"]


def _save_tokenizer(ckpt_dir: str, tokenizer) -> None:
    """Keep the run's tokenizer as ``CKPT_DIR/tokenizer.json`` (for ``mff.recipes.generate``),
    written once, atomically."""
    path = Path(ckpt_dir) / "tokenizer.json"
    if not path.exists():
        _write_text_atomic(path, tokenizer.to_str())


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _checkpoint_tokenizer(path: str, dst: Path) -> bool:
    """Copy the tokenizer that comes with the ``--init-from`` checkpoint to ``dst``: an HF
    folder's tokenizer.json, an mff run's tokenizer.json, or a GGUF file's tokenizer. False
    when it has none."""
    if checkpoint_kind(path) == "gguf":
        from mff.ckpt.gguf import read_gguf

        tok = read_gguf(path).tokenizer
        text = tok.to_str() if tok is not None else None
    else:
        src = tokenizer_folder(path) / "tokenizer.json"
        text = src.read_text() if src.is_file() else None
    if text is None:
        return False
    _write_text_atomic(dst, text)
    return True


def _prepare_init(argv: list[str]):
    """Pre-parse ``--init-from`` (the checkpoint decides the model config before tyro parses the
    rest). Returns ``(base, params, tokenizer)``: ``base`` = ``(family, config)`` for
    :func:`parse_model_args`, the weights to start from (None when ``--ckpt-dir`` already holds
    a checkpoint: that run resumes instead), and the tokenizer.json the data must use."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--init-from", default=None)
    pre.add_argument("--ckpt-dir", default=PretrainConfig.__dataclass_fields__["ckpt_dir"].default)
    pre.add_argument("--data.tokenizer", dest="tokenizer", default=None)
    pre.add_argument("-h", "--help", action="store_true")
    known = pre.parse_known_args(list(argv))[0]
    if known.init_from is None or known.help:
        return None, None, None
    checkpoint_kind(known.init_from)  # a missing or unrecognised path is an error even when resuming
    tok_path = Path(known.ckpt_dir) / "tokenizer.json"
    last = ckpt.latest_step_dir(known.ckpt_dir)
    if last is not None:
        meta = ckpt.read_meta(last, required=("family", "config"))
        family = get_family(meta["family"])
        print0(f"--init-from {known.init_from} not loaded: {known.ckpt_dir} holds a checkpoint, which this run resumes")
        tokenizer = known.tokenizer or (str(tok_path) if tok_path.is_file() else None)
        return (family.name, config_from_dict(family.config_cls, meta["config"])), None, tokenizer
    model, params = load_checkpoint(known.init_from, dtype=torch.float32)
    # every rank writes the same file (atomic replace), so no rank reads a partial one
    if known.tokenizer is None and not _checkpoint_tokenizer(known.init_from, tok_path):
        raise ValueError(f"--init-from {known.init_from} comes with no tokenizer (no tokenizer.json); pass "
                         "--data.tokenizer with the tokenizer the weights were trained with")
    return (model.family.name, model.config), params, known.tokenizer or str(tok_path)


def _apply_init(params, loaded, where: str):
    """Copy ``loaded`` (plain tensors) onto the placements of ``params``; shapes must match and
    every loaded tensor must be used (a --model.* override that drops layers is refused)."""
    unused = sorted(set(loaded) - set(params))
    if unused:
        raise ckpt.CheckpointError(f"{where} has {len(unused)} tensors this model does not, e.g. {unused[:4]}: the --model.* "
                                   "overrides change the architecture; drop them")
    for name, like in params.items():
        params[name] = ckpt.place_like(name, loaded.get(name), like, where)
    return params


def _check_vocab(tokenizer_vocab: int | None, model_vocab: int) -> None:
    if tokenizer_vocab is not None and tokenizer_vocab > model_vocab:
        raise ValueError(f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {model_vocab}; raise --model.vocab-size")


def _data(cfg: PretrainConfig, model, dp_rank: int, dp_size: int, rank: int):
    """The training loader, this rank's validation batches, the validation unigram entropy and
    a summary line, from raw corpus files (tokenized and cached here) or from Megatron indexed
    datasets (``--data.path`` in blend syntax)."""
    vocab = model.config.vocab_size
    blend = as_blend(cfg.data.path)
    if blend is not None:
        data = build_megatron_data(cfg.data, blend, cfg.seq_len, cfg.seed, cfg.steps * cfg.batch_size, quiet=rank != 0)
        _check_vocab(data.vocab_size, vocab)
        if data.eod_id is not None and data.eod_id >= vocab:
            raise ValueError(f"the EOD id {data.eod_id} is outside the model's vocabulary [0, {vocab}); check --data.eod-id or raise --model.vocab-size")
        if rank == 0 and data.tokenizer is not None and hasattr(data.tokenizer, "to_str"):
            _save_tokenizer(cfg.ckpt_dir, data.tokenizer)
        keys = batch_keys(cfg.data)
        loader = SampleLoader(data.train, cfg.batch_size, keys, dp_rank=dp_rank, dp_size=dp_size)
        val_batches, entropy = [], None
        if cfg.eval_every and (data.val is None or len(data.val) == 0) and rank == 0:
            print(f"data: no validation samples (--data.split {cfg.data.split} leaves the valid part empty): validation is skipped", flush=True)
        if cfg.eval_every and data.val is not None and len(data.val):
            full = sample_batches(data.val, cfg.batch_size, cfg.eval_iters or max(1, len(data.val) // cfg.batch_size), keys)
            entropy = unigram_entropy(torch.cat([b["input_ids"].reshape(-1) for b in full]).numpy(), vocab)
            val_batches = _rank_slices(full, dp_rank, dp_size)
        line = (f"data: Megatron samples: train {len(data.train):,}, val {len(data.val) if data.val is not None else 0:,} of "
                f"{cfg.seq_len + 1} tokens; EOD id {data.eod_id}")
        return loader, val_batches, entropy, line
    data = build_pretrain_data(cfg.data, cfg.seq_len, quiet=rank != 0)
    _check_vocab(data.vocab_size, vocab)
    if rank == 0:
        _save_tokenizer(cfg.ckpt_dir, data.tokenizer)
    loader = Loader(data.train, cfg.batch_size, cfg.seed, shuffle=cfg.data.shuffle, dp_rank=dp_rank, dp_size=dp_size)
    n_val = cfg.eval_iters or max(1, len(data.val) // cfg.batch_size)
    val_batches = _rank_slices(eval_batches(data.val, cfg.batch_size, n_val), dp_rank, dp_size) if cfg.eval_every else []
    line = f"data: train {len(data.train):,} windows, val {len(data.val):,} windows of {cfg.seq_len + 1} tokens; vocab {data.vocab_size}"
    return loader, val_batches, unigram_entropy(data.val.tokens, data.vocab_size), line


def run(cfg: PretrainConfig, family: str, size: str, init_params=None) -> int:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # backend -> mesh
    dist_info = init_distributed(resolve_device(cfg.device), cfg.parallel.timeout_s)
    mesh = build_mesh(dist_info.device_type, cfg.parallel, dist_info.world_size)
    dp_size, dp_rank = data_parallel_size(mesh), data_parallel_rank(mesh)
    # model
    model = build(family, cfg.model).with_execution(cfg.ac, cfg.compile)
    _check(cfg, model, dp_size)
    _lock = ckpt.lock_dir(cfg.ckpt_dir) if dist_info.rank == 0 else None  # held until run() returns
    mem = _memory_check(cfg, model, dist_info.device, mesh["dp_shard"].size() * mesh["ep"].size() * mesh["tp"].size(), dp_size)
    last = _resumable(cfg, family, model)  # a checkpoint this run cannot continue fails here, before the data is read
    # params (a dim that does not divide its mesh axes fails here, before the data is read)
    with collective("distributing the initial params"):
        params = model.init(cfg.seed, dist_info.device, param_dtype(cfg.precision), mesh)
    # data
    loader, val_batches, val_entropy, data_line = _data(cfg, model, dp_rank, dp_size, dist_info.rank)
    # optimizer, then resume
    opt_state = init_state(cfg.optim, params)
    if init_params is not None and last is None:
        params = _apply_init(params, init_params, cfg.init_from)
        opt_state = init_state(cfg.optim, params)
        print0(f"initialised from {cfg.init_from} (fresh optimizer, step 0)")
    elif init_params is not None:
        print0(f"--init-from {cfg.init_from} ignored: resuming from {cfg.ckpt_dir}")
    init_params = None
    params, opt_state, start, tokens_seen = _resume(cfg, last, params, opt_state, loader)
    end = min(cfg.steps, cfg.stop_after or cfg.steps)

    counts = model.param_counts()
    peak, peak_src = device_peak_flops(dist_info.device)
    flops_per_token = model.train_flops_per_token(cfg.seq_len)
    placements = placements_of(params)
    mtp = (f"; without MTP {counts['total_no_mtp']:,} / {counts['activated_no_mtp']:,}"
           if counts["total_no_mtp"] != counts["total"] else "")
    print0(f"model {family}/{size}: {counts['total']:,} params ({counts['activated']:,} activated per token{mtp})")
    print0(f"device {dist_info.device} x {dist_info.world_size} ({dist_info.backend}), mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}")
    if len(set(placements.values())) == 1:
        print0(f"placements: {next(iter(placements.values()))} (all {len(placements)} params)")
    else:
        print0("placements:\n  " + "\n  ".join(placement_table(params)))
    print0("memory per device (estimate): " + ", ".join(f"{k} {v:.3f} GiB" for k, v in mem.items()))
    print0(f"{data_line}; peak {peak / 1e9:.1f} GFLOP/s ({peak_src}); {flops_per_token / 1e6:.1f} MFLOP/token")

    # loop
    log = RunLog(cfg.metrics_file, total=cfg.steps, initial=start)
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.__setitem__("signal", signum))
    meta_base = {"family": family, "size": size, "config": config_to_dict(model.config), "run": config_to_dict(cfg, skip=("model",)),
                 "mesh": {"axes": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}, "placements": placements}

    def save(step: int) -> None:
        meta = {**meta_base, "tokens_seen": tokens_seen, "data": loader.state_dict(), "rng": rng_state()}
        with collective(f"checkpoint of step {step}"):
            check_finite(params, opt_state)
            path = ckpt.save(cfg.ckpt_dir, step, params, opt_state, meta, cfg.keep_last)
        log.write(f"checkpoint {path}")

    if start >= end:
        print0(f"nothing to do: the checkpoint is at step {start} and the run ends at step {end}")
        log.close()
        return 0
    step = start
    try:
        for step in range(start + 1, end + 1):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.optim, cfg.steps)
            batch = {k: v.to(dist_info.device) for k, v in loader.next_batch().items()}
            with collective(f"step {step}"):
                stats = train_step(model, params, opt_state, split_microbatches(batch, cfg.grad_accum), lr, cfg.optim,
                                   getattr(model.config, "moe_router_bias_update_rate", 0.0), cfg.precision)
            tokens_seen += stats.tokens
            dt = time.perf_counter() - t0
            tps = stats.tokens / dt
            rec = {"step": step, "loss": stats.loss, "lm_loss": stats.losses.get("lm"), "balance_loss": stats.losses.get("balance", 0.0),
                   "mtp_loss": stats.losses.get("mtp", 0.0), "lr": lr, "grad_norm": stats.grad_norm, "tokens_per_s": tps,
                   "mfu": mfu(flops_per_token, tps, peak, dist_info.world_size)}
            if val_batches and (step % cfg.eval_every == 0 or step == cfg.steps):
                with collective(f"validation at step {step}"):
                    rec["val_loss"] = eval_loss(model, params, [{k: v.to(dist_info.device) for k, v in b.items()} for b in val_batches],
                                                cfg.precision)
            log.step(rec, val_entropy)
            if step == end or (cfg.save_every and step % cfg.save_every == 0) or stop["signal"]:
                save(step)
            if stop["signal"]:
                log.write(f"signal {stop['signal']}: checkpoint saved at step {step}; rerun the same command to resume")
                log.close()
                return 128 + int(stop["signal"])
    except NonFiniteError as e:
        log.close()
        last = ckpt.latest_step_dir(cfg.ckpt_dir)
        raise NonFiniteError(f"step {step}: {e}; nothing was saved for this step (last checkpoint: {last or 'none'})") from None
    log.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    owns_group = not dist.is_initialized()  # research code or a test may call main() inside its own group
    try:
        if any(a == MF_YAML_FLAG or a.startswith(MF_YAML_FLAG + "=") for a in argv):
            argv = expand_mindformers_argv(argv)
        base, init_params, tokenizer = _prepare_init(argv)
        family, size, cfg = parse_model_args(PretrainConfig, argv, prog="python -m mff.recipes.pretrain", description=__doc__, base=base)
        if tokenizer is not None and cfg.data.tokenizer is None:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
        return run(cfg, family, size, init_params)
    except (ValueError, TypeError, FileNotFoundError, DeviceUnavailable) as e:
        return fail(e, 2)
    except (ckpt.CheckpointError, NonFiniteError, OSError) as e:
        return fail(e, 1)
    except CollectiveTimeout as e:
        # the other ranks are gone or stuck: tearing the process group down (or letting the
        # interpreter do it) can block on them, so leave at once after the message is out
        fail(e, 1)
        sys.stdout.flush()
        os._exit(1)
    finally:
        # tear the process group down before the interpreter exits: leaving gloo's threads to
        # static destruction can abort a rank ("terminate called without an active exception")
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
