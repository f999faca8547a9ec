"""Fine-tune a checkpoint on chat or instruction rows (SFT), in full or with LoRA adapters.

    python -m mff.recipes.finetune --init-from PATH --data.path chat.jsonl --ckpt-dir runs/sft            # full fine-tuning
    python -m mff.recipes.finetune --init-from PATH --data.path chat.jsonl --lora.r 16 --lora.alpha 32   # LoRA

backend -> mesh -> model (+ adapters) and params -> data -> optimizer -> resume -> the step loop
of pretraining (:mod:`mff.train.loop`). ``--init-from`` is any checkpoint mff loads (HF folder,
mff checkpoint or LoRA run, .gguf file, MindSpore/MindFormers checkpoint); its tokenizer and chat
template encode the rows (``--data.*``), and the loss is on the assistant tokens only
(``--data.train-on``). Without ``--steps`` the run makes ``--epochs`` passes over the training
rows. Under ``torchrun`` any mesh pretraining takes works (``--parallel.*``).

LoRA (``--lora.r`` > 0, or ``--lora.init-from ADAPTER``): the base weights are frozen (no
gradients, no optimizer state; stored in the compute dtype) and the checkpoints hold only the
adapters, their optimizer state, and the base's path and fingerprint, so a rerun resumes with
the same ``--init-from``. Export: ``python -m mff.recipes.convert --src CKPT_DIR --to peft|hf|mindspore``.
The expert-bias update of aux-loss-free MoE routing runs in full fine-tuning only (LoRA keeps
the base, bias included, frozen). MFU counts 4 instead of 6 FLOPs per frozen weight and token
under LoRA (no weight gradients).

``--from-mindformers-yaml finetune.yaml`` starts from the flags a MindFormers finetune YAML
translates to (printed, with the YAML keys it ignores; flags given too win).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from mff import ckpt
from mff.backend import cpu_threads, init_distributed, launch_world_size, resolve_device
from mff.ckpt.autoload import checkpoint_kind, load_gguf
from mff.ckpt.tokenizer_files import TextAssets, load_text_assets, read_tokenizer, save_text_assets
from mff.data.sft import SFTDataConfig, SFTLoader, build_sft_data, read_chat_template, sft_eval_batches
from mff.data.stats import unigram_entropy
from mff.models import build, get_family
from mff.models.common import config_from_dict
from mff.optim import OptimConfig, init_state
from mff.parallel import build_mesh, data_parallel_rank, data_parallel_size, mesh_shape, placements_of
from mff.parallel.watchdog import collective
from mff.peft import LoraConfig, init_adapters, lora_spec
from mff.peft.load import base_fingerprint, load_model, lora_meta, read_adapter, spec_from_meta
from mff.recipes.common import config_to_dict, parse_model_args, print0, run_training_main
from mff.recipes.init_from import apply_init
from mff.recipes.mindformers_yaml import FLAG as MF_YAML_FLAG
from mff.recipes.mindformers_yaml import expand_argv as expand_mindformers_argv
from mff.train.config import TrainConfig, fit_default_precision
from mff.train.loop import Loop, check_train_config, memory_check, print_run_header, rank_slices, resumable, resume, train_loop
from mff.train.metrics import device_peak_flops
from mff.train.precision import compute_dtype, param_dtype
from mff.train.state import check_resume_recipe

__all__ = ["FinetuneConfig", "main", "run"]

C = TypeVar("C")

LORA_LR = 1e-4


@dataclass(frozen=True)
class FinetuneConfig(TrainConfig[C], Generic[C]):
    """Fine-tuning run. The model config comes from --init-from (--model.* fields override it)."""

    model: C
    """Model config of the --init-from checkpoint (HF field names); --model.<field> overrides a field that keeps every tensor's shape. (--help without --init-from lists DeepSeek-V3's fields.)"""
    steps: int | None = None
    """Optimizer steps of the whole run; default: --epochs passes over the training rows."""
    seq_len: int = 1024
    """Tokens per row (a conversation longer than --seq-len + 1 is truncated or dropped, --data.overlong)."""
    batch_size: int = 8
    """Global batch in rows per optimizer step (split over data-parallel ranks and micro-batches)."""
    ckpt_dir: str = "runs/finetune"
    """Checkpoint folder; a run with a complete checkpoint there resumes from it."""
    eval_every: int = 50
    """Validate on the held-out rows every N steps and at the last step (0 = never)."""
    optim: OptimConfig = OptimConfig(lr=1e-5, beta2=0.999, weight_decay=0.0, min_lr_ratio=0.0, warmup_steps=0)
    """Optimizer and lr schedule (fine-tuning defaults: lr 1e-5, or 1e-4 with LoRA, when --optim.lr is not given; cosine to 0)."""
    epochs: float = 3.0
    """Passes over the training rows when --steps is not given."""
    warmup_ratio: float = 0.03
    """Linear warmup over this share of the steps (unless --optim.warmup-steps is given)."""
    data: SFTDataConfig = SFTDataConfig()
    """Fine-tuning rows."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters (off unless --lora.r > 0 or --lora.init-from)."""


@dataclass
class _Init:
    """What the pre-parse of ``--init-from`` found: the model config, the weights (None when a
    full fine-tuning run resumes: its checkpoint holds them), the text assets, the resumable
    checkpoint's metadata."""

    base: tuple[str, object]
    params: dict | None
    text: TextAssets
    meta: dict | None


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _prepare(argv: list[str]) -> _Init | None:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--init-from", default=None)
    pre.add_argument("--ckpt-dir", default=FinetuneConfig.__dataclass_fields__["ckpt_dir"].default)
    pre.add_argument("-h", "--help", action="store_true")
    known = pre.parse_known_args(list(argv))[0]
    if known.help:
        return None  # --help: the options of the default family (the checkpoint is not read)
    if known.init_from is None:
        raise ValueError("--init-from is required: the checkpoint to fine-tune (an HF folder, an mff checkpoint, a .gguf file "
                         "or a MindSpore/MindFormers checkpoint)")
    kind = checkpoint_kind(known.init_from)
    last = ckpt.latest_step_dir(known.ckpt_dir)
    meta = ckpt.read_meta(last, required=("family", "config")) if last is not None else None
    if meta is not None:
        check_resume_recipe(meta, "finetune", last)  # before a pretraining run's folder is read as a fine-tuning run's
    if meta is not None and "lora" not in meta:  # full fine-tuning resumes: the weights are in the checkpoint
        family = get_family(meta["family"])
        print0(f"--init-from {known.init_from} not loaded: {known.ckpt_dir} holds a checkpoint, which this run resumes")
        text = load_text_assets(known.ckpt_dir)
        return _Init((family.name, config_from_dict(family.config_cls, meta["config"])), None, text, meta)
    if kind == "gguf":
        model, params, g = load_gguf(known.init_from, dtype=torch.float32)
        text = load_text_assets(known.init_from, gguf=g)
    else:
        model, params = load_model(known.init_from, dtype=torch.float32)  # a LoRA run comes merged
        text = load_text_assets(known.init_from)
    return _Init((model.family.name, model.config), params, text, meta)


def _text(cfg: FinetuneConfig, init: _Init) -> TextAssets:
    """The tokenizer and chat template the rows are encoded with (and the run keeps): the
    checkpoint's, or ``--data.tokenizer`` / ``--data.chat-template``."""
    text = init.text
    if cfg.data.tokenizer is not None:
        text = dataclasses.replace(text, tokenizer=read_tokenizer(cfg.data.tokenizer))
        text.add_eos_token_id()
    if text.tokenizer is None:
        raise ValueError(f"--init-from {cfg.init_from} comes with no tokenizer (no tokenizer.json); pass --data.tokenizer")
    if cfg.data.chat_template is not None:
        text = dataclasses.replace(text, chat_template=read_chat_template(cfg.data.chat_template),
                                   chat_template_source=f"--data.chat-template {cfg.data.chat_template}")
    if cfg.data.template == "chat" and text.chat_template and "eos_token" in text.chat_template and not text.eos_token:
        print0("note: the chat template writes eos_token, but the checkpoint names none (tokenizer_config.json eos_token): "
               "answers are trained without that end token")
    return text


def _resolve(cfg: FinetuneConfig, argv: list[str], train_rows: int) -> FinetuneConfig:
    """``--steps`` from ``--epochs``, the warmup from ``--warmup-ratio``, the LoRA lr default."""
    if not (math.isfinite(cfg.epochs) and cfg.epochs > 0):
        raise ValueError(f"--epochs {cfg.epochs} must be > 0")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ValueError(f"--warmup-ratio {cfg.warmup_ratio} must be in [0, 1)")
    steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * train_rows / cfg.batch_size))
    optim = cfg.optim
    if not _given(argv, "--optim.warmup-steps"):
        optim = dataclasses.replace(optim, warmup_steps=int(cfg.warmup_ratio * steps))
    if cfg.lora.enabled and not _given(argv, "--optim.lr"):
        optim = dataclasses.replace(optim, lr=LORA_LR)
    return dataclasses.replace(cfg, steps=steps, optim=optim)


def _check_lora(cfg: FinetuneConfig) -> None:
    if cfg.parallel.pp > 1:
        raise ValueError(f"--parallel.pp {cfg.parallel.pp}: pipeline parallelism is built for pretraining only; fine-tune with "
                         "--parallel.dp-shard, --parallel.tp and --parallel.ep")
    cfg.lora.validate()
    if not cfg.lora.enabled:
        return
    if cfg.optim.name == "muon":
        raise ValueError("--optim.name muon is for full fine-tuning: with --lora.r the adapters train with AdamW (Muon orthogonalises "
                         "whole weight matrices, not rank-r factors)")
    if cfg.lora.dropout > 0 and cfg.parallel.tp > 1:
        raise ValueError("--lora.dropout > 0 with --parallel.tp > 1 is not supported (the tp ranks would draw different masks)")


def _lora_check(spec, base_fp: str | None):
    """The resume check of a LoRA run: the same adapters on the same base."""

    def check(meta: dict, folder: Path) -> None:
        saved = meta.get("lora")
        if spec is None:
            if saved is not None:
                raise ckpt.CheckpointError(f"{folder} holds LoRA adapters (r {saved['r']}); this run is full fine-tuning (no --lora.r): "
                                           "pass the same --lora.* flags, or use another --ckpt-dir")
            return
        if saved is None:
            raise ckpt.CheckpointError(f"{folder} holds a full fine-tuning run; this run trains LoRA adapters: use another --ckpt-dir")
        if spec_from_meta(saved) != spec:
            raise ckpt.CheckpointError(f"{folder} holds LoRA adapters r {saved['r']}, alpha {saved['alpha']} on {len(saved['targets'])} "
                                       f"weights; this run has r {spec.r}, alpha {spec.alpha} on {len(spec.targets)}: pass the same "
                                       "--lora.* flags, or use another --ckpt-dir")
        want = (meta.get("base") or {}).get("fingerprint")
        if want is not None and base_fp is not None and want != base_fp:
            raise ckpt.CheckpointError(f"{folder} was trained on another base than --init-from (base {meta['base'].get('path')}); "
                                       "pass that base, or use another --ckpt-dir")

    return check


def _lora_flops(model, seq_len: int) -> float:
    counts = model.param_counts()
    embed = model.param_shapes().get("model.embed_tokens.weight")
    lookup = 0 if embed is None or model.config.tie_word_embeddings else embed[0] * embed[1]
    frozen = counts["activated"] - lookup
    adapters = sum(math.prod(s) for s in model.adapter_shapes().values())
    return model.train_flops_per_token(seq_len) - 2.0 * frozen + 6.0 * adapters


def run(cfg: FinetuneConfig, family: str, init: _Init, argv: list[str]) -> int:
    """The fine-tuning run; a failure before the first checkpoint leaves no ``--ckpt-dir`` behind
    (when this run created it)."""
    created = not Path(cfg.ckpt_dir).exists()
    try:
        return _run(cfg, family, init, argv)
    except BaseException:
        if created and (not dist.is_initialized() or dist.get_rank() == 0) and not ckpt.list_steps(cfg.ckpt_dir):
            shutil.rmtree(cfg.ckpt_dir, ignore_errors=True)
        raise


def _run(cfg: FinetuneConfig, family: str, init: _Init, argv: list[str]) -> int:
    threads, why = cpu_threads(cfg.threads, resolve_device(cfg.device))
    if threads is not None:
        torch.set_num_threads(threads)
    _check_lora(cfg)
    # backend -> mesh (a layout that cannot fit the launched processes fails before the ranks connect)
    mesh_shape(cfg.parallel, launch_world_size())
    dist_info = init_distributed(resolve_device(cfg.device), cfg.parallel.timeout_s)
    if threads is not None:
        print0(f"threads: {threads} ({why})")
    mesh = build_mesh(dist_info.device_type, cfg.parallel, dist_info.world_size)
    dp_size, dp_rank = data_parallel_size(mesh), data_parallel_rank(mesh)
    # model and adapters
    model = build(family, cfg.model).with_execution(cfg.ac, cfg.compile)
    loaded_adapters = None
    if cfg.lora.init_from is not None:
        spec, loaded_adapters = read_adapter(cfg.lora.init_from, model)
        if cfg.lora.dropout:
            spec = dataclasses.replace(spec, dropout=cfg.lora.dropout)
        model = model.with_lora(spec)
        print0(f"adapters from {cfg.lora.init_from}: r {spec.r}, alpha {spec.alpha:g} on {len(spec.targets)} weights")
    elif cfg.lora.enabled:
        model = model.with_lora(lora_spec(model, cfg.lora))
    lora = model.lora
    if lora is not None:
        narrow = [t for t in lora.targets if lora.rank_of(t) > min(model.param_shapes()[t][-2:])]
        if narrow:
            print0(f"note: LoRA rank {lora.r} exceeds a dim of {len(narrow)} target weights (e.g. {narrow[0]} "
                   f"{tuple(model.param_shapes()[narrow[0]])}): their adapters are not low-rank")
    mpe = model.config.max_position_embeddings
    if not 2 <= cfg.seq_len <= mpe:
        raise ValueError(f"--seq-len {cfg.seq_len} must be in [2, {mpe}] (the model's max_position_embeddings)")
    # data (its row count decides --steps)
    text = _text(cfg, init)
    pad = text.eos_ids[0] if text.eos_ids else 0
    data = build_sft_data(cfg.data, text.tokenizer, cfg.seq_len, text.chat_template, text.bos_token, text.eos_token, pad_id=pad,
                          chat_template_source=text.chat_template_source)
    top = max(int(r["input_ids"].max()) for r in data.train.rows)
    if top >= model.config.vocab_size:
        raise ValueError(f"the tokenizer gives id {top} but the model's vocab_size is {model.config.vocab_size}; use the checkpoint's tokenizer")
    cfg = _resolve(cfg, argv, len(data.train))
    check_train_config(cfg, model, dp_size)
    if cfg.batch_size > len(data.train):
        print0(f"note: --batch-size {cfg.batch_size} exceeds the {len(data.train)} training rows: every batch repeats rows")
    base_dtype = compute_dtype(cfg.precision) if lora is not None else param_dtype(cfg.precision)
    trainable = sum(math.prod(s) for s in model.adapter_shapes().values()) if lora is not None else None
    mem = memory_check(cfg, model, dist_info.device, mesh["dp_shard"].size() * mesh["ep"].size() * mesh["tp"].size(), dp_size,
                       trainable=trainable, param_bytes=torch.tensor([], dtype=base_dtype).element_size())
    _lock = ckpt.lock_dir(cfg.ckpt_dir) if dist_info.rank == 0 else None  # held until run() returns
    # params: the base (frozen under LoRA, in the compute dtype) and the trainable leaves
    with collective("distributing the initial params"):
        params = model.init(cfg.seed, dist_info.device, base_dtype, mesh)
    base_fp = base_fingerprint(init.params) if lora is not None and init.params is not None else None
    if init.params is not None:
        params = apply_init(params, {k: v.to(params[k].dtype) if k in params else v for k, v in init.params.items()}, cfg.init_from)
    init.params = None
    if lora is not None:
        for t in params.values():
            t.requires_grad_(False)
        adapters = init_adapters(model, cfg.seed, dist_info.device, param_dtype(cfg.precision), mesh)
        if loaded_adapters is not None:
            adapters = apply_init(adapters, {k: v.to(adapters[k].dtype) for k, v in loaded_adapters.items()}, cfg.lora.init_from)
        saved = adapters
    else:
        saved = params
    last = resumable(cfg, family, model, _lora_check(lora, base_fp), recipe="finetune")
    if dist_info.rank == 0:  # the tokenizer and chat template travel with the run (generate --chat, convert)
        save_text_assets(cfg.ckpt_dir, text)
    loader = SFTLoader(data.train, cfg.batch_size, cfg.seed, shuffle=cfg.data.shuffle, dp_rank=dp_rank, dp_size=dp_size)
    val_full = sft_eval_batches(data.val, cfg.batch_size, cfg.eval_iters) if cfg.eval_every else []
    val_batches = rank_slices(val_full, dp_rank, dp_size) if val_full else []
    val_entropy = (unigram_entropy(torch.cat([b["labels"][b["labels"] >= 0] for b in val_full]).numpy(), model.config.vocab_size)
                   if val_full else None)
    if cfg.eval_every and not val_full:
        print0("data: no held-out rows (--data.val-permille 0): validation is skipped")
    # optimizer, then resume
    opt_state = init_state(cfg.optim, saved)
    saved, opt_state, start, tokens_seen = resume(cfg, last, saved, opt_state, loader)
    params = {**params, **saved} if lora is not None else saved

    peak, peak_src = device_peak_flops(dist_info.device, dtype=compute_dtype(cfg.precision))
    flops = _lora_flops(model, cfg.seq_len) if lora is not None else model.train_flops_per_token(cfg.seq_len)
    extra = (f"; LoRA r {lora.r}, alpha {lora.alpha:g} (scale {lora.scale:g}) on {len(lora.targets)} weights: "
             f"{sum(t.numel() for t in saved.values()):,} trainable params" if lora is not None else "; full fine-tuning")
    print_run_header(f"{family} from {cfg.init_from}", model, dist_info, mesh, params, mem, data.summary(), peak, peak_src, flops, extra)
    print0(f"steps {cfg.steps} ({cfg.steps * cfg.batch_size / len(data.train):.2f} epochs of {len(data.train):,} rows), "
           f"lr {cfg.optim.lr:g}, warmup {cfg.optim.warmup_steps}")
    meta = {"recipe": "finetune", "family": family, "size": "init-from", "config": config_to_dict(model.config), "run": config_to_dict(cfg, skip=("model",)),
            "mesh": {"axes": list(mesh.mesh_dim_names), "shape": list(mesh.shape)}, "placements": placements_of(saved),
            "source": str(Path(cfg.init_from).absolute())}
    if lora is not None:
        meta["lora"] = lora_meta(lora)
        meta["base"] = {"path": str(Path(cfg.init_from).absolute()), "fingerprint": base_fp}
    rate = getattr(model.config, "moe_router_bias_update_rate", 0.0) if lora is None else 0.0
    code = train_loop(Loop(cfg, model, params, saved, opt_state, loader, val_batches, val_entropy, meta, dist_info.device,
                           dist_info.world_size, start, tokens_seen, rate, flops, peak, epoch=lambda: loader.epoch))
    if code == 0 and (cfg.stop_after is None or cfg.stop_after >= cfg.steps):
        to = "peft" if lora is not None else "hf"
        print0(f"export: python -m mff.recipes.convert --src {cfg.ckpt_dir} --to {to} --dst OUT")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        args = argv
        if any(a == MF_YAML_FLAG or a.startswith(MF_YAML_FLAG + "=") for a in args):
            args = expand_mindformers_argv(args, recipe="finetune")
        init = _prepare(args)
        family, _, cfg = parse_model_args(FinetuneConfig, args, prog="python -m mff.recipes.finetune", description=__doc__,
                                          base=init.base if init is not None else None)
        if init is None:  # --help: parse_model_args printed it and exited
            return 0
        return run(fit_default_precision(cfg, args, resolve_device(cfg.device)), family, init, args)

    return run_training_main(body)


if __name__ == "__main__":
    sys.exit(main())
