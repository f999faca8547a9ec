"""Convert checkpoints between formats.

    python -m mff.recipes.convert --src PATH --dst PATH --to hf|mff [--dtype auto|float32|bfloat16]

``--src`` is an HF model folder (config.json + safetensors, sharded or not, FP8 included), an
mff checkpoint (run or step folder) or a .gguf file. ``--to hf`` writes a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` loads (experts one tensor per expert);
A GGUF source also gives the HF folder its ``tokenizer.json`` and ``tokenizer_config.json``
(special tokens and the chat template from the GGUF metadata). ``--to mff`` writes a weights-only mff checkpoint (``DST/step_00000000``, ``DST/latest``) that
``mff.load`` and ``pretrain --init-from`` read. The source is read one shard at a time and the
output is streamed to disk, so peak memory stays near the model's size plus one shard. Outputs
are written under a temp name and renamed; an existing non-empty ``--dst`` is refused.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

from mff.ckpt.autoload import checkpoint_kind, load
from mff.ckpt.checkpoint import save_weights
from mff.ckpt.hf import save_hf
from mff.recipes.common import config_to_dict, fail

__all__ = ["ConvertConfig", "convert", "main"]

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ConvertConfig:
    """Checkpoint conversion."""

    src: str
    """Source: an HF model folder, an mff checkpoint folder or a .gguf file."""
    dst: str
    """Output folder (must not exist, or be empty)."""
    to: Literal["hf", "mff"]
    """Output format: hf (transformers-loadable folder) or mff (weights-only mff checkpoint)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Output dtype; auto keeps the stored dtypes (FP8 weights become bfloat16, GGUF float32)."""
    max_shard_size: str = "5GB"
    """--to hf: largest shard file (e.g. 5GB, 500MB)."""


def _gguf_tokenizer_files(path: str) -> dict[str, str] | None:
    """``tokenizer.json`` and ``tokenizer_config.json`` built from a GGUF file's tokenizer metadata."""
    from mff.ckpt.gguf import read_gguf

    g = read_gguf(path)
    if g.tokenizer is None:
        return None
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": g.bos_token, "eos_token": g.eos_token,
               "clean_up_tokenization_spaces": False}
    if g.chat_template:
        tok_cfg["chat_template"] = g.chat_template
    return {"tokenizer.json": g.tokenizer.to_str(), "tokenizer_config.json": json.dumps(tok_cfg, indent=2) + "\n"}


def convert(cfg: ConvertConfig) -> Path:
    """Run one conversion; returns the output folder. Errors as :func:`mff.load` and
    :func:`mff.save_hf` raise them."""
    dst = Path(cfg.dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"--dst {dst} exists and is not empty; choose a new folder")
    model, params = load(cfg.src, dtype=DTYPES[cfg.dtype])
    extra = _gguf_tokenizer_files(cfg.src) if cfg.to == "hf" and checkpoint_kind(cfg.src) == "gguf" else None
    total = sum(t.numel() * t.element_size() for t in params.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {cfg.to}", file=sys.stderr) as bar:
        if cfg.to == "hf":
            out = save_hf(model, params, dst, cfg.max_shard_size, progress=bar.update, extra_files=extra)
        else:
            if dst.exists():
                dst.rmdir()
            meta = {"family": model.family.name, "size": "converted", "config": config_to_dict(model.config), "source": str(cfg.src)}
            save_weights(dst, params, meta, progress=bar.update)
            out = dst
    print(f"wrote {out} ({model.family.name}, {total / 1e9:.3f} GB of weights)")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        convert(tyro.cli(ConvertConfig, args=argv, prog="python -m mff.recipes.convert", description=__doc__))
        return 0
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        return fail(e, 2)
    except OSError as e:
        return fail(e, 1)


if __name__ == "__main__":
    sys.exit(main())
