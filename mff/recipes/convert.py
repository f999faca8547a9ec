"""Convert checkpoints between formats.

    python -m mff.recipes.convert --src PATH --dst PATH --to hf|mff|mindspore|peft [--dtype auto|float32|bfloat16]
                                  [--model FAMILY --config CONFIG] [--adapter ADAPTER] [--no-mtp]

``--src`` is an HF model folder (config.json + safetensors, sharded or not, FP8 included), an
mff checkpoint (run or step folder), a .gguf file, or a MindFormers checkpoint: a MindSpore
``.ckpt`` file or MindFormers safetensors (a ``{"format": "ms"}`` file or a folder of
``ms-model-*.safetensors``), Mcore or legacy names, training checkpoints included (optimizer
state and router buffers are skipped). A MindFormers checkpoint does not name its model: pass
``--config`` (the model's HF config.json, or a MindFormers config JSON / YAML) and, when that
config has no ``model_type``, ``--model FAMILY``; without ``--config`` the config.json beside the
checkpoint is used.

``--to hf`` writes a folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads
(experts one tensor per expert); ``--to mff`` writes a weights-only mff checkpoint
(``DST/step_00000000``, ``DST/latest``) that ``mff.load`` and ``pretrain --init-from`` read;
``--to mindspore`` writes ``DST/model.ckpt`` in MindFormers' Mcore names (``--ms-format
safetensors``: ``ms-model-*.safetensors`` + ``param_name_map.json``) and the HF ``config.json``,
which MindFormers reads as ``pretrained_model_dir`` and ``mff.load`` reads back.

LoRA: a ``--src`` that is an mff LoRA run (``mff.recipes.finetune --lora.r``) is its base with
the adapters merged in (``W + s B A``), for ``--to hf|mff|mindspore``; ``--adapter`` (a PEFT
folder or an mff LoRA run) merges an adapter into any other ``--src``. ``--to peft`` writes the
adapters themselves as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``,
stacked experts as ``target_parameters``) that ``peft.PeftModel.from_pretrained`` loads onto the
HF base.

The tokenizer travels along: an HF folder's tokenizer files (as they are), an mff run's
tokenizer.json and tokenizer_config.json, or a GGUF file's tokenizer and chat template. An
exported folder also gets what transformers needs to know the special tokens and to stop
generating: the source's BOS / EOS / pad ids in config.json where its config names none (a
pretraining run's EOS is its data's end-of-document token), a generation_config.json
(bos_token_id, eos_token_id, pad_token_id) and a tokenizer_config.json (tokenizer_class,
bos_token / eos_token / pad_token, model_max_length, chat_template) when the source has none.

``--no-mtp`` drops DeepSeek-V3's MTP layers (``model.layers.{num_hidden_layers + k}``) and writes
``num_nextn_predict_layers`` 0: transformers builds no MTP layers, so it loads the folder without
reporting them as unexpected keys.

The source is read one shard at a time and the output is streamed to disk, so peak memory
stays near the model's size plus one shard. The output is written into a temp folder beside
``--dst`` and renamed into place: an interrupted conversion leaves no half-written ``--dst``
(and the temp folder of a killed run is removed by the next one). An existing non-empty
``--dst`` is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

from mff.ckpt.autoload import checkpoint_kind, load_gguf, load_mindspore, tokenizer_folder
from mff.ckpt.checkpoint import CheckpointError, remove_stale_tmp, save_weights
from mff.ckpt.hf import save_hf
from mff.ckpt.mindformers import save_mindformers
from mff.ckpt.safetensors_io import parse_size
from mff.ckpt.staging import staged_folder
from mff.ckpt.tokenizer_files import TOKEN_ID_KEYS, hf_export_files, load_text_assets
from mff.model import Model
from mff.peft import save_peft, split_params
from mff.peft.load import is_lora_run, load_model, merge_adapter, run_adapters
from mff.recipes.common import config_to_dict, fail

__all__ = ["ConvertConfig", "convert", "main"]

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the files of an HF folder that describe the tokenizer and generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


@dataclass(frozen=True)
class ConvertConfig:
    """Checkpoint conversion."""

    src: str
    """Source: an HF model folder, an mff checkpoint folder, a .gguf file, or a MindSpore .ckpt / MindFormers safetensors checkpoint."""
    dst: str
    """Output folder (must not exist, or be empty)."""
    to: Literal["hf", "mff", "mindspore", "peft"]
    """Output format: hf (transformers-loadable folder), mff (weights-only mff checkpoint), mindspore (MindFormers Mcore .ckpt) or peft (the LoRA adapters of an mff LoRA run or of --adapter, as a PEFT folder)."""
    adapter: str | None = None
    """A LoRA adapter (PEFT folder or mff LoRA run) merged into --src (--to peft: re-saved as a PEFT folder)."""
    model: str | None = None
    """MindFormers source: the model family (qwen3, qwen3_moe, deepseek3, telechat3, glm4, glm4_moe, llama) when --config has no model_type."""
    config: str | None = None
    """MindFormers source: the model config (HF config.json, MindFormers config JSON or YAML); default: config.json beside --src."""
    ms_format: Literal["ckpt", "safetensors"] = "ckpt"
    """--to mindspore: a .ckpt file or MindFormers safetensors shards."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Output dtype; auto keeps the stored dtypes (FP8 weights become bfloat16, GGUF float32)."""
    max_shard_size: str = "5GB"
    """--to hf, --to mindspore --ms-format safetensors: largest shard file, in bytes or with a unit (5GB, 500MB)."""
    mtp: bool = True
    """Keep the MTP layers (DeepSeek-V3, TeleChat3: model.layers.{num_hidden_layers + k}). --no-mtp drops them and writes num_nextn_predict_layers 0: transformers builds no MTP layers and reports their tensors as unexpected keys otherwise."""


def _copied_tokenizer_files(src: str, kind: str) -> dict[str, str]:
    """The tokenizer files of the source's folder (name -> text; none for a GGUF file)."""
    if kind == "gguf":
        return {}
    folder = tokenizer_folder(src)
    out = {}
    for name in TOKENIZER_FILES:
        f = folder / name
        if f.is_file():
            try:
                out[name] = f.read_text(encoding="utf-8")
            except UnicodeDecodeError:  # a binary sentencepiece model: skipped (tokenizer.json covers fast tokenizers)
                continue
    return out


def _text_files(model: Model, src: str, kind: str, g=None) -> tuple[Model, dict[str, str]]:
    """The model with the source's special-token ids filled into its config where it has none,
    and the tokenizer files that go with it (:func:`mff.ckpt.tokenizer_files.hf_export_files`);
    ``g``: the source's :class:`mff.ckpt.gguf.GGUFCheckpoint` when it is a GGUF file."""
    text = load_text_assets(src, gguf=g)
    fields = {f.name for f in dataclasses.fields(model.config)} if dataclasses.is_dataclass(model.config) else set()
    config_ids = {k: getattr(model.config, k) for k in TOKEN_ID_KEYS if k in fields}
    ids, files = hf_export_files(text, config_ids, model.config.vocab_size, getattr(model.config, "max_position_embeddings", None),
                                 copied=_copied_tokenizer_files(src, kind), keep_tokenizer_config=kind in ("hf", "mindspore"))
    eos_cfg = config_ids.get("eos_token_id")
    eos_cfg = [eos_cfg] if isinstance(eos_cfg, int) else list(eos_cfg or ())
    if eos_cfg and text.eos_ids and not set(eos_cfg) & set(text.eos_ids):
        print(f"note: the config's eos_token_id {config_ids['eos_token_id']} is not the tokenizer's end token (id "
              f"{text.eos_ids[0]}); config.json keeps it and generation_config.json lists both", file=sys.stderr)
    ids = {k: v for k, v in ids.items() if k in fields}
    if ids:
        model = Model(model.family, dataclasses.replace(model.config, **ids))
    return model, files


def _drop_mtp(model: Model, params: dict, src: str) -> tuple[Model, dict]:
    """``--no-mtp``: the model and params without the MTP layers (num_nextn_predict_layers 0)."""
    n = getattr(model.config, "num_nextn_predict_layers", None)
    if not n:
        what = "num_nextn_predict_layers 0" if n == 0 else f"{model.family.name} has none"
        print(f"note: --no-mtp: {src} holds no MTP layers ({what}); nothing to drop", file=sys.stderr)
        return model, params
    model = Model(model.family, dataclasses.replace(model.config, num_nextn_predict_layers=0))
    keep = model.param_shapes()
    dropped = [p for p in params if p not in keep]
    if dropped:
        print(f"--no-mtp: dropped {n} MTP layer(s) ({len(dropped)} tensors)", file=sys.stderr)
    else:  # glm4_moe: its MTP layers are skipped on load
        print(f"--no-mtp: {src} came without its MTP layers; writing num_nextn_predict_layers 0", file=sys.stderr)
    return model, {p: t for p, t in params.items() if p in keep}


def convert(cfg: ConvertConfig) -> Path:
    """Run one conversion; returns the output folder.

    Raises:
        FileExistsError: ``--dst`` exists and is not an empty folder.
        PermissionError: ``--dst``'s parent folder is not writable.
        ValueError, FileNotFoundError, CheckpointError: as :func:`mff.load` raises them;
            a bad ``--max-shard-size``; a MindFormers source without a config (or one that
            does not fit its tensors: the tensor and both shapes named); ``--model`` /
            ``--config`` with a source that names its own model; ``--no-mtp`` with ``--to peft``;
            an unreadable tokenizer.json / tokenizer_config.json of the source.
    """
    dst = Path(cfg.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"--dst {dst} exists and is not an empty folder; choose a new folder")
    parent = dst.absolute().parent
    if parent.exists() and not parent.is_dir():
        raise FileExistsError(f"--dst {dst}: {parent} is a file, not a folder")
    parent.mkdir(parents=True, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"--dst {dst}: cannot write in {parent}")
    parse_size(cfg.max_shard_size)
    kind = checkpoint_kind(cfg.src)
    if kind != "mindspore" and (cfg.model is not None or cfg.config is not None):
        raise ValueError(f"--model / --config are for MindSpore/MindFormers checkpoints; {cfg.src} is an {kind} checkpoint "
                         "that names its own model")
    remove_stale_tmp(dst.absolute().parent, f".tmp-{dst.name}-*")  # temp folders of killed conversions into --dst
    if cfg.to == "peft":
        if not cfg.mtp:
            raise ValueError("--no-mtp is for --to hf|mff|mindspore: a PEFT adapter holds no MTP layers")
        return _convert_peft(cfg, dst)
    g = None
    if kind == "gguf":  # one read gives the weights and the tokenizer
        model, params, g = load_gguf(cfg.src, dtype=DTYPES[cfg.dtype])
        if cfg.adapter is not None:
            model, params = merge_adapter(model, params, cfg.adapter)
    elif kind == "mindspore":
        model, params = load_mindspore(cfg.src, cfg.model, cfg.config, dtype=DTYPES[cfg.dtype])
        if cfg.adapter is not None:
            model, params = merge_adapter(model, params, cfg.adapter)
    else:
        model, params = load_model(cfg.src, dtype=DTYPES[cfg.dtype], adapter=cfg.adapter)
    if not cfg.mtp:
        model, params = _drop_mtp(model, params, cfg.src)
    model, extra = _text_files(model, cfg.src, kind, g)
    total = sum(t.numel() * t.element_size() for t in params.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {cfg.to}", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        if cfg.to == "hf":
            out = save_hf(model, params, dst, parse_size(cfg.max_shard_size), progress=bar.update, extra_files=extra)
        else:
            with staged_folder(dst) as tmp:
                if cfg.to == "mff":
                    meta = {"family": model.family.name, "size": "converted", "config": config_to_dict(model.config), "source": str(cfg.src)}
                    save_weights(tmp, params, meta, progress=bar.update)
                    extra = {k: v for k, v in extra.items() if k in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}
                else:
                    _save_mindspore(tmp, model, params, cfg)
                    bar.update(total)
                for name, text in extra.items():
                    (tmp / name).write_text(text, encoding="utf-8")
            out = dst
    size = f"{total / 1e9:.2f} GB" if total >= 1e9 else f"{total / 1e6:.1f} MB"
    print(f"wrote {out} ({model.family.name}, {size} of weights)")
    return out


def _convert_peft(cfg: ConvertConfig, dst: Path) -> Path:
    """``--to peft``: the adapters of an mff LoRA run (``--src``), or ``--adapter`` over ``--src``, as a PEFT folder."""
    dtype = DTYPES[cfg.dtype]
    if is_lora_run(cfg.src):
        if cfg.adapter is not None:
            raise ValueError(f"--src {cfg.src} is a LoRA run (it carries its adapters); --adapter is for a base --src")
        lm, adapters, meta = run_adapters(cfg.src)  # the adapters alone: the base is not needed
        base_name = (meta.get("base") or {}).get("path")
    elif cfg.adapter is not None:
        lm, both = load_model(cfg.src, adapter=cfg.adapter, merged=False)
        _, adapters = split_params(both)
        base_name = str(Path(cfg.src).absolute())
    else:
        raise ValueError(f"--to peft needs LoRA adapters: --src {cfg.src} is no LoRA run (mff.recipes.finetune --lora.r) and no "
                         "--adapter was given")
    if base_name is not None and not (Path(base_name) / "config.json").is_file():
        base_name = None  # PEFT reads base_model_name_or_path as an HF folder or hub id: a .gguf or mff path would mislead it
    out = save_peft(lm, adapters, dst, base_model_name_or_path=base_name, dtype=dtype)
    n = sum(t.numel() for t in adapters.values())
    print(f"wrote {out} (PEFT LoRA adapter: r {lm.lora.r}, alpha {lm.lora.alpha:g} on {len(lm.lora.targets)} weights, {n:,} params)")
    return out


def _save_mindspore(folder: Path, model, params, cfg: ConvertConfig) -> None:
    """``folder/model.ckpt`` (or MindFormers safetensors shards) in Mcore names + the HF config.json."""
    if model.family.to_hf_config is None:
        raise ValueError(f"family {model.family.name} has no HF config mapping")
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.ms_format == "ckpt":
        save_mindformers(folder / "model.ckpt", model, params, format="ckpt")
    else:
        save_mindformers(folder, model, params, format="safetensors", max_shard_size=cfg.max_shard_size)
    (folder / "config.json").write_text(json.dumps(model.family.to_hf_config(model.config), indent=2) + "\n")


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _terminate)  # clean the temp folder up on kill too
    try:
        convert(tyro.cli(ConvertConfig, args=argv, prog="python -m mff.recipes.convert", description=__doc__))
        return 0
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written to --dst", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, PermissionError) as e:
        return fail(e, 2)
    except (CheckpointError, OSError) as e:
        return fail(e, 1)


if __name__ == "__main__":
    sys.exit(main())
