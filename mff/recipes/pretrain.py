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

import dataclasses
import sys
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from mff import ckpt
from mff.backend import cpu_threads, init_distributed, launch_world_size, resolve_device
from mff.data import (
    DataConfig,
    Loader,
    build_pretrain_data,
    eval_batches,
    unigram_entropy,
)
from mff.data.megatron_source import SampleLoader, as_blend, batch_keys, build_megatron_data, sample_batches
from mff.model import check_model_fits
from mff.models import build, get_family
from mff.optim import init_state
from mff.parallel import build_mesh, data_parallel_rank, data_parallel_size, mesh_shape, placements_of
from mff.parallel.watchdog import collective
from mff.recipes.common import config_to_dict, parse_model_args, print0, run_training_main
from mff.recipes.init_from import apply_init, prepare_init, save_tokenizer
from mff.recipes.mindformers_yaml import FLAG as MF_YAML_FLAG
from mff.recipes.mindformers_yaml import expand_argv as expand_mindformers_argv
from mff.train.config import TrainConfig, fit_default_precision, fit_default_warmup
from mff.train.loop import Loop, check_train_config, memory_check, print_run_header, rank_slices, resumable, resume, train_loop
from mff.train.metrics import device_peak_flops
from mff.train.pipeline import Pipeline
from mff.train.precision import compute_dtype, param_dtype

C = TypeVar("C")


@dataclass(frozen=True)
class PretrainConfig(TrainConfig[C], Generic[C]):
    """Pretraining run. ``--model FAMILY`` and ``--size NAME`` choose ``model``'s defaults."""

    size: str = "tiny"
    """Named size of the --model family whose config --model.* starts from (listed above)."""
    data: DataConfig = DataConfig()
    """Training data."""


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
            save_tokenizer(cfg.ckpt_dir, data.tokenizer)
        keys = batch_keys(cfg.data)
        loader = SampleLoader(data.train, cfg.batch_size, keys, dp_rank=dp_rank, dp_size=dp_size)
        val_batches, entropy = [], None
        if cfg.eval_every and (data.val is None or len(data.val) == 0) and rank == 0:
            print(f"data: no validation samples (--data.split {cfg.data.split} leaves the valid part empty): validation is skipped", flush=True)
        if cfg.eval_every and data.val is not None and len(data.val):
            full = sample_batches(data.val, cfg.batch_size, cfg.eval_iters or max(1, len(data.val) // cfg.batch_size), keys)
            entropy = unigram_entropy(torch.cat([b["input_ids"].reshape(-1) for b in full]).numpy(), vocab)
            val_batches = rank_slices(full, dp_rank, dp_size)
        line = (f"data: Megatron samples: train {len(data.train):,}, val {len(data.val) if data.val is not None else 0:,} of "
                f"{cfg.seq_len + 1} tokens; EOD id {data.eod_id}")
        return loader, val_batches, entropy, line
    data = build_pretrain_data(cfg.data, cfg.seq_len, quiet=rank != 0)
    _check_vocab(data.vocab_size, vocab)
    if rank == 0:
        save_tokenizer(cfg.ckpt_dir, data.tokenizer)
    loader = Loader(data.train, cfg.batch_size, cfg.seed, shuffle=cfg.data.shuffle, dp_rank=dp_rank, dp_size=dp_size)
    n_val = cfg.eval_iters or max(1, len(data.val) // cfg.batch_size)
    val_batches = rank_slices(eval_batches(data.val, cfg.batch_size, n_val), dp_rank, dp_size) if cfg.eval_every else []
    line = f"data: train {len(data.train):,} windows, val {len(data.val):,} windows of {cfg.seq_len + 1} tokens; vocab {data.vocab_size}"
    return loader, val_batches, unigram_entropy(data.val.tokens, data.vocab_size), line


def run(cfg: PretrainConfig, family: str, size: str, init_params=None) -> int:
    threads, why = cpu_threads(cfg.threads, resolve_device(cfg.device))
    if threads is not None:
        torch.set_num_threads(threads)
    # backend -> mesh (a layout that cannot fit the launched processes fails before the ranks connect)
    mesh_shape(cfg.parallel, launch_world_size())
    dist_info = init_distributed(resolve_device(cfg.device), cfg.parallel.timeout_s)
    if threads is not None:
        print0(f"threads: {threads} ({why})")
    mesh = build_mesh(dist_info.device_type, cfg.parallel, dist_info.world_size)
    dp_size, dp_rank = data_parallel_size(mesh), data_parallel_rank(mesh)
    # model (a config whose params cannot fit, even split over every process, fails before its skeleton is built)
    check_model_fits(get_family(family), cfg.model, dist_info.device, param_dtype(cfg.precision), "--model", shards=dist_info.world_size)
    model = build(family, cfg.model).with_execution(cfg.ac, cfg.compile)
    check_train_config(cfg, model, dp_size)
    # pipeline stages: this rank's part of the layers (a split or micro-batch count that cannot run fails here)
    pipe = Pipeline(model, cfg.parallel, mesh, cfg.seq_len, cfg.batch_size // dp_size // cfg.grad_accum, dist_info.device,
                    cfg.precision) if cfg.parallel.pp > 1 else None
    _lock = ckpt.lock_dir(cfg.ckpt_dir) if dist_info.rank == 0 else None  # held until run() returns
    mem = memory_check(cfg, model, dist_info.device, mesh["dp_shard"].size() * mesh["ep"].size() * mesh["tp"].size() * cfg.parallel.pp,
                       dp_size)
    last = resumable(cfg, family, model)  # a checkpoint this run cannot continue fails here, before the data is read
    # params (a dim that does not divide its mesh axes fails here, before the data is read)
    with collective("distributing the initial params"):
        params = model.init(cfg.seed, dist_info.device, param_dtype(cfg.precision), mesh, keys=pipe.keys if pipe else None)
    # data
    loader, val_batches, val_entropy, data_line = _data(cfg, model, dp_rank, dp_size, dist_info.rank)
    # optimizer, then resume
    opt_state = init_state(cfg.optim, params)
    if init_params is not None and last is None:
        params = apply_init(params, init_params, cfg.init_from, model.param_shapes())
        opt_state = init_state(cfg.optim, params)
        print0(f"initialised from {cfg.init_from} (fresh optimizer, step 0)")
    elif init_params is not None:
        print0(f"--init-from {cfg.init_from} ignored: resuming from {cfg.ckpt_dir}")
    init_params = None
    params, opt_state, start, tokens_seen = resume(cfg, last, params, opt_state, loader, model.param_shapes() if pipe else None)
    saved = {k: params[k] for k in pipe.owned} if pipe else params  # a shared embedding is saved from the first stage

    peak, peak_src = device_peak_flops(dist_info.device, dtype=compute_dtype(cfg.precision))
    flops_per_token = model.train_flops_per_token(cfg.seq_len)
    print_run_header(f"{family}/{size}", model, dist_info, mesh, params, mem, data_line, peak, peak_src, flops_per_token)
    meta = {"recipe": "pretrain", "family": family, "size": size, "config": config_to_dict(model.config), "run": config_to_dict(cfg, skip=("model",)),
            "mesh": {"axes": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}, "placements": placements_of(params)}
    if pipe is not None:
        print0(pipe.describe())
        meta["mesh"] = {"axes": ["pp", *mesh.mesh_dim_names], "shape": [cfg.parallel.pp, *mesh.shape]}
        meta["pipeline"] = pipe.meta()
    return train_loop(Loop(cfg, model, params, saved, opt_state, loader, val_batches, val_entropy, meta, dist_info.device,
                           dist_info.world_size, start, tokens_seen, getattr(model.config, "moe_router_bias_update_rate", 0.0),
                           flops_per_token, peak, pipeline=pipe))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = expand_mindformers_argv(argv) if any(a == MF_YAML_FLAG or a.startswith(MF_YAML_FLAG + "=") for a in argv) else argv
        base, init_params, tokenizer = prepare_init(args, PretrainConfig.__dataclass_fields__["ckpt_dir"].default)
        family, size, cfg = parse_model_args(PretrainConfig, args, prog="python -m mff.recipes.pretrain", description=__doc__, base=base)
        cfg = fit_default_precision(fit_default_warmup(cfg, args), args, resolve_device(cfg.device))
        if tokenizer is not None and cfg.data.tokenizer is None:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
        return run(cfg, family, size, init_params)

    return run_training_main(body)


if __name__ == "__main__":
    sys.exit(main())
