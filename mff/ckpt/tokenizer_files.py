"""The tokenizer, chat template and end-of-sequence ids that come with a checkpoint.

- an HF folder (or a MindSpore checkpoint's folder): ``tokenizer.json``, ``tokenizer_config.json``
  (``chat_template``, ``bos_token``, ``eos_token``), ``chat_template.jinja``,
  ``generation_config.json`` / ``config.json`` (``eos_token_id``);
- a ``.gguf`` file: its tokenizer and ``tokenizer.chat_template`` metadata;
- an mff run folder: the ``tokenizer.json`` a run keeps (and the ``tokenizer_config.json``
  fine-tuning keeps beside it); without a chat template the end of a document (the data's EOD
  token) ends generation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from mff.ckpt.autoload import checkpoint_kind, resolve_mff_step_dir, tokenizer_folder
from mff.ckpt.checkpoint import read_meta

__all__ = ["TextAssets", "load_text_assets", "read_tokenizer", "text_asset_files"]


@dataclass
class TextAssets:
    """A checkpoint's text side. ``tokenizer`` is None when it has none; ``eos_ids`` are the ids
    that end a generated answer (the config's ``eos_token_id`` and the EOS token's id)."""

    tokenizer: Tokenizer | None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_ids: list[int] = field(default_factory=list)

    def add_eos_token_id(self) -> None:
        """Append the EOS token's id to ``eos_ids`` (when the tokenizer knows it)."""
        if self.eos_token is not None and self.tokenizer is not None:
            eid = self.tokenizer.token_to_id(self.eos_token)
            if eid is not None and eid not in self.eos_ids:
                self.eos_ids.append(eid)


def _special(value) -> str | None:
    if isinstance(value, dict):  # HF AddedToken serialisation
        return value.get("content")
    return value


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(i) for i in x]


def read_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json. Raises FileNotFoundError / ValueError (unreadable)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist or is not a file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer.json the tokenizers library can read: {e}") from None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


def _folder_assets(folder: Path, eos_ids: list[int]) -> TextAssets:
    tok_file = folder / "tokenizer.json"
    tok_cfg = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if (folder / "generation_config.json").is_file():
        eos_ids = _as_list(_read_json(folder / "generation_config.json").get("eos_token_id")) or eos_ids
    tok = read_tokenizer(tok_file) if tok_file.is_file() else None
    return TextAssets(tok, template, _special(tok_cfg.get("bos_token")), _special(tok_cfg.get("eos_token")), list(eos_ids))


def load_text_assets(path: str | os.PathLike, gguf=None) -> TextAssets:
    """The :class:`TextAssets` of the checkpoint at ``path`` (see the module docstring).

    ``gguf``: the :class:`mff.ckpt.gguf.GGUFCheckpoint` of a ``.gguf`` ``path`` already read
    (else it is read again, without its tensors). Raises as :func:`mff.load` for a path that is
    no checkpoint, ValueError for an unreadable tokenizer.json or JSON file.
    """
    kind = checkpoint_kind(path)
    p = Path(path)
    if kind == "gguf":
        if gguf is None:
            from mff.ckpt.gguf import read_gguf

            gguf = read_gguf(p, with_tokenizer=True)
        out = TextAssets(gguf.tokenizer, gguf.chat_template, gguf.bos_token, gguf.eos_token, _as_list(gguf.config.get("eos_token_id")))
    elif kind in ("hf", "mindspore"):
        folder = p if p.is_dir() else p.parent
        cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
        out = _folder_assets(folder, _as_list(cfg.get("eos_token_id")))
    else:
        folder = tokenizer_folder(p)
        out = _folder_assets(folder, [])
        if out.chat_template is None and out.eos_token is None and out.tokenizer is not None:
            # a pretraining run: generation ends at its data's end-of-document token
            from mff.data.tokenizer import find_eod_id

            eod = ((read_meta(resolve_mff_step_dir(p)).get("run") or {}).get("data") or {}).get("eod_token")
            try:
                out.eos_ids = [find_eod_id(out.tokenizer, eod)]
            except ValueError:
                pass
    out.add_eos_token_id()
    return out


def text_asset_files(assets: TextAssets) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (chat template, BOS / EOS tokens) texts
    that carry ``assets`` into a folder (an mff run, an exported HF folder)."""
    out = {}
    if assets.tokenizer is not None:
        out["tokenizer.json"] = assets.tokenizer.to_str()
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if assets.bos_token is not None:
        cfg["bos_token"] = assets.bos_token
    if assets.eos_token is not None:
        cfg["eos_token"] = assets.eos_token
    if assets.chat_template:
        cfg["chat_template"] = assets.chat_template
    if len(cfg) > 2:
        out["tokenizer_config.json"] = json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"
    return out
