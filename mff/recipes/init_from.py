"""Starting a run from existing weights (``--init-from``) and keeping its tokenizer, chat
template and special tokens in the run folder: shared by the training recipes."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mff import ckpt
from mff.ckpt.autoload import checkpoint_kind, load_gguf
from mff.ckpt.tokenizer_files import load_text_assets, save_text_assets, write_text_atomic
from mff.models import get_family
from mff.models.common import config_from_dict
from mff.peft.load import load_model
from mff.train.log import print0

__all__ = ["write_text_atomic", "save_tokenizer", "prepare_init", "apply_init"]


def save_tokenizer(ckpt_dir: str, tokenizer) -> None:
    """Keep the run's tokenizer as ``CKPT_DIR/tokenizer.json`` (for ``mff.recipes.generate``),
    written once, atomically."""
    path = Path(ckpt_dir) / "tokenizer.json"
    if not path.exists():
        write_text_atomic(path, tokenizer.to_str())


def prepare_init(argv: list[str], default_ckpt_dir: str):
    """Pre-parse ``--init-from`` (the checkpoint decides the model config before tyro parses the
    rest). Returns ``(base, params, tokenizer)``: ``base`` = ``(family, config)`` for
    :func:`parse_model_args`, the weights to start from (None when ``--ckpt-dir`` already holds
    a checkpoint: that run resumes instead), and the tokenizer.json the data must use. Without
    ``--data.tokenizer`` the checkpoint's ``tokenizer.json`` and ``tokenizer_config.json`` (chat
    template, BOS / EOS / pad tokens) are written to ``--ckpt-dir``
    (:func:`mff.ckpt.tokenizer_files.save_text_assets`). ``default_ckpt_dir``: the recipe's
    ``--ckpt-dir`` default.

    Raises:
        ValueError: the checkpoint has no tokenizer and no ``--data.tokenizer`` is given; its
            tokenizer files are unreadable; as :func:`mff.load` for the checkpoint itself.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--init-from", default=None)
    pre.add_argument("--ckpt-dir", default=default_ckpt_dir)
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
    keep_text = known.tokenizer is None  # --data.tokenizer: the checkpoint's text side belongs to another tokenizer
    if checkpoint_kind(known.init_from) == "gguf":  # one read gives the weights and the tokenizer
        model, params, g = load_gguf(known.init_from, dtype=torch.float32, with_tokenizer=keep_text)
        text = load_text_assets(known.init_from, gguf=g) if keep_text else None
    else:
        model, params = load_model(known.init_from, dtype=torch.float32)  # a LoRA run comes merged
        text = load_text_assets(known.init_from) if keep_text else None
    if text is not None:
        if text.tokenizer is None:
            raise ValueError(f"--init-from {known.init_from} comes with no tokenizer (no tokenizer.json); pass "
                             "--data.tokenizer with the tokenizer the weights were trained with")
        # tokenizer.json and tokenizer_config.json (chat template, special tokens) travel with the
        # run, as in fine-tuning; every rank writes the same files (atomic replace), so no rank
        # reads a partial one
        written = save_text_assets(known.ckpt_dir, text, overwrite=True)
        if "tokenizer_config.json" not in written:  # a fresh run: no stale template of an earlier attempt
            (Path(known.ckpt_dir) / "tokenizer_config.json").unlink(missing_ok=True)
    return (model.family.name, model.config), params, known.tokenizer or str(tok_path)


def apply_init(params, loaded, where: str, model_params=None):
    """Copy ``loaded`` (plain tensors) onto the placements of ``params``; shapes must match and
    every loaded tensor must be a param of the model (a --model.* override that drops layers is
    refused). ``model_params``: every param path of the model, when ``params`` holds a part of
    them (a pipeline stage's)."""
    unused = sorted(set(loaded) - set(params if model_params is None else model_params))
    if unused:
        raise ckpt.CheckpointError(f"{where} has {len(unused)} tensors this model does not, e.g. {unused[:4]}: the --model.* "
                                   "overrides change the architecture; drop them")
    for name, like in params.items():
        params[name] = ckpt.place_like(name, loaded.get(name), like, where)
    return params
