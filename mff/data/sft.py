"""Supervised fine-tuning data: chat rows -> training examples (``input_ids``, ``labels`` with
-100 on every token not trained on, ``position_ids``, ``document_ids``), a held-out split and a
resumable loader.

Pipeline (:func:`build_sft_data`): read the rows (:mod:`mff.data.sft_rows`), split them by a
stable hash of ``file name:row index`` (``--data.val-permille``), encode each conversation with
the checkpoint's chat template or MindFormers' alpaca format (:mod:`mff.data.sft_encode`),
truncate or drop conversations longer than ``seq_len + 1`` tokens (``--data.overlong``), and
either pack several conversations into each row of ``seq_len`` positions (``--data.pack``:
first-fit by decreasing length; positions restart at 0 and attention stays inside each
conversation through ``document_ids``, so a packed row computes each conversation as if it
were alone) or keep one conversation per row, right-padded per batch to the batch's longest.

A conversation of n tokens gives n - 1 positions: input token t predicts token t + 1, and the
label is -100 unless token t + 1 is trained on (the answers and each answer's end token).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from mff.data.chat import read_chat_template_file
from mff.data.loader import Loader, eval_bounds
from mff.data.sft_encode import TRAIN_ON, ChatTemplateEncoder, Encoded, MindFormersAlpacaEncoder
from mff.data.sft_rows import FORMATS, Row, read_rows, to_messages

__all__ = ["SFTDataConfig", "SFTExamples", "SFTData", "SFTLoader", "build_sft_data", "held_out", "pack_examples", "read_chat_template",
           "sft_eval_batches"]

IGNORE = -100


@dataclass(frozen=True)
class SFTDataConfig:
    """Fine-tuning rows, how they become token ids, and the held-out split."""

    path: tuple[str, ...] = ()
    """.json / .jsonl files of rows, or folders of them (alpaca, sharegpt or openai rows)."""
    format: Literal["auto", "alpaca", "sharegpt", "openai"] = "auto"
    """Row format; auto tells them apart by their keys (messages, conversations, instruction)."""
    template: Literal["chat", "mindformers-alpaca"] = "chat"
    """chat: the checkpoint's chat template (or --data.chat-template); mindformers-alpaca: MindFormers' AlpacaInstructDataHandler text ("USER: ... ASSISTANT: ...</s>"), to reproduce a MindFormers run."""
    chat_template: str | None = None
    """A Jinja chat template file to use instead of the checkpoint's."""
    system: str | None = None
    """A system message put first in every conversation that has none."""
    train_on: Literal["assistant", "last", "all"] = "assistant"
    """Tokens trained on: assistant (every answer and its end token), last (the final answer only), all (every token)."""
    pack: bool = False
    """Pack several conversations into each row of --seq-len (positions and attention stay per conversation); False: one conversation per row, padded per batch."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """A conversation longer than --seq-len + 1 tokens: truncate (keep its head) or drop it."""
    val_permille: int = 50
    """Share of rows held out for validation, per mille, chosen by a stable hash of file name and row index (0 = none)."""
    limit: int | None = None
    """Read only the first N rows (MindFormers' take handler)."""
    shuffle: bool = True
    """Shuffle the training rows (a new order per epoch, seeded by --seed)."""
    tokenizer: str | None = None
    """A tokenizer.json to use instead of the checkpoint's."""


@dataclass
class SFTExamples:
    """Rows of examples: ``input_ids``, ``labels``, ``position_ids``, ``document_ids`` (int64
    numpy arrays each, one per row; packed rows hold several conversations). ``pad_id`` fills
    padded positions (label -100)."""

    rows: list[dict[str, np.ndarray]]
    pad_id: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def targets(self) -> int:
        """Positions with a label (tokens trained on)."""
        return int(sum((r["labels"] != IGNORE).sum() for r in self.rows))

    def examples(self, idx: np.ndarray, pad_to: int | None = None) -> dict[str, np.ndarray]:
        """Rows ``idx`` stacked, right-padded to ``pad_to`` (default: their longest): int64 [len(idx), T]."""
        chosen = [self.rows[int(i)] for i in idx]
        T = pad_to or max(len(r["input_ids"]) for r in chosen)
        out = {"input_ids": np.full((len(chosen), T), self.pad_id, np.int64), "labels": np.full((len(chosen), T), IGNORE, np.int64),
               "position_ids": np.zeros((len(chosen), T), np.int64), "document_ids": np.zeros((len(chosen), T), np.int64)}
        for j, r in enumerate(chosen):
            n = len(r["input_ids"])
            for k in out:
                out[k][j, :n] = r[k]
            if n < T:  # padding: its own document, positions continuing from 0
                out["document_ids"][j, n:] = r["document_ids"][-1] + 1 if n else 0
                out["position_ids"][j, n:] = np.arange(T - n)
        return out

    def lengths(self, idx: np.ndarray) -> int:
        """The longest of rows ``idx``."""
        return max(len(self.rows[int(i)]["input_ids"]) for i in idx)


def _example(enc: Encoded, doc: int = 0) -> dict[str, np.ndarray]:
    ids = np.asarray(enc.ids, np.int64)
    mask = np.asarray(enc.mask, bool)
    labels = np.where(mask[1:], ids[1:], IGNORE)
    n = len(ids) - 1
    return {"input_ids": ids[:-1], "labels": labels, "position_ids": np.arange(n, dtype=np.int64), "document_ids": np.full(n, doc, np.int64)}


def pack_examples(examples: list[dict[str, np.ndarray]], seq_len: int) -> list[dict[str, np.ndarray]]:
    """Pack single-conversation examples (each at most ``seq_len`` positions) into rows of at
    most ``seq_len``: first fit by decreasing length (ties in input order), conversations of a
    row numbered 0, 1, ... in ``document_ids``, positions kept per conversation."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]["input_ids"]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(examples[i]["input_ids"])
        for b in range(len(bins)):
            if room[b] >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(seq_len - n)
    rows = []
    for b in bins:
        parts = [examples[i] for i in b]
        row = {k: np.concatenate([p[k] for p in parts]) for k in ("input_ids", "labels", "position_ids")}
        row["document_ids"] = np.concatenate([np.full(len(p["input_ids"]), d, np.int64) for d, p in enumerate(parts)])
        rows.append(row)
    return rows


@dataclass
class SFTData:
    """What :func:`build_sft_data` returns: the train and validation examples and the counts it
    prints (``rows``, ``train_rows``, ``val_rows``, ``truncated``, ``dropped``, ``merges``, ...)."""

    train: SFTExamples
    val: SFTExamples
    counts: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line with the counts."""
        c = self.counts
        parts = [f"{c['rows']:,} rows ({c['train_rows']:,} train, {c['val_rows']:,} held out)"]
        if c.get("packed_rows") is not None:
            parts.append(f"packed into {c['packed_rows']:,} train rows")
        parts.append(f"{c['train_tokens']:,} train tokens, {c['train_targets']:,} trained on")
        if c["truncated"] or c["dropped"]:
            parts.append(f"{c['truncated']:,} truncated, {c['dropped']:,} dropped (longer than --seq-len + 1)")
        if c["merges"]:
            parts.append(f"{c['merges']:,} prompt/answer joins merged by the tokenizer (encoded piece by piece)")
        return "data: " + "; ".join(parts)


def _is_val(key: str, permille: int) -> bool:
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") % 1000 < permille


def read_chat_template(path: str) -> str:
    """The text of a ``--data.chat-template`` file (:func:`mff.data.chat.read_chat_template_file`).
    Raises FileNotFoundError / ValueError (not a file, not UTF-8, empty), naming the file."""
    return read_chat_template_file(path, flag="--data.chat-template")


def held_out(rows: list[Row], val_permille: int) -> list[bool]:
    """Per row, whether it is held out: ``sha1(row.key) mod 1000 < val_permille``; never every
    row, and at least one row when ``val_permille`` > 0 and there are two or more."""
    flags = [_is_val(r.key, val_permille) for r in rows]
    if val_permille and not any(flags) and len(rows) > 1:
        flags[-1] = True
    if flags and all(flags):
        flags[0] = False
    return flags


def _encoder(cfg: SFTDataConfig, tokenizer, chat_template: str | None, bos: str | None, eos: str | None,
             chat_template_source: str | None = None):
    if cfg.template == "mindformers-alpaca":
        return MindFormersAlpacaEncoder(tokenizer)
    if cfg.template != "chat":
        raise ValueError(f"--data.template {cfg.template!r}; expected chat or mindformers-alpaca")
    what = f"the chat template of {chat_template_source}" if chat_template_source else "the checkpoint's chat template"
    if cfg.chat_template is not None:
        chat_template = read_chat_template(cfg.chat_template)
        what = f"--data.chat-template {cfg.chat_template}"
    if not chat_template:
        raise ValueError("the checkpoint has no chat template (tokenizer_config.json chat_template, chat_template.jinja or the GGUF's "
                         "tokenizer.chat_template); pass --data.chat-template FILE, or --data.template mindformers-alpaca")
    return ChatTemplateEncoder(tokenizer, chat_template, bos, eos, cfg.train_on, what)


def build_sft_data(cfg: SFTDataConfig, tokenizer, seq_len: int, chat_template: str | None = None, bos_token: str | None = None,
                   eos_token: str | None = None, pad_id: int = 0, chat_template_source: str | None = None) -> SFTData:
    """Read, split, encode, truncate and (optionally) pack the rows of ``cfg.path``.

    ``chat_template_source`` names where ``chat_template`` was read (a file and key) in errors.

    Raises:
        FileNotFoundError, ValueError: unreadable or empty files, bad rows (file and line
            named), an unknown format or role, a row with no assistant turn, a missing chat
            template, a template that fails on a row or renders turns inconsistently, no rows left to train on,
            a bad ``--data.val-permille`` / ``--data.limit``.
    """
    if cfg.format not in ("auto", *FORMATS):
        raise ValueError(f"--data.format {cfg.format!r}; expected auto, {', '.join(FORMATS)}")
    if cfg.train_on not in TRAIN_ON:
        raise ValueError(f"--data.train-on {cfg.train_on!r}; expected one of {', '.join(TRAIN_ON)}")
    if cfg.overlong not in ("truncate", "drop"):
        raise ValueError(f"--data.overlong {cfg.overlong!r}; expected truncate or drop")
    if not 0 <= cfg.val_permille < 1000:
        raise ValueError(f"--data.val-permille {cfg.val_permille} must be in [0, 1000)")
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"--data.limit {cfg.limit} must be >= 1")
    rows = read_rows(cfg.path)
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    enc = _encoder(cfg, tokenizer, chat_template, bos_token, eos_token, chat_template_source)
    counts = {"rows": len(rows), "truncated": 0, "dropped": 0, "merges": 0}
    split: dict[str, list[dict[str, np.ndarray]]] = {"train": [], "val": []}
    val_flags = held_out(rows, cfg.val_permille)
    for row, is_val in zip(rows, val_flags):
        e = _encode_row(enc, cfg, row)
        counts["merges"] += e.merges
        if len(e.ids) > seq_len + 1:
            if cfg.overlong == "drop":
                counts["dropped"] += 1
                continue
            e = Encoded(e.ids[: seq_len + 1], e.mask[: seq_len + 1], e.merges)
            if not any(e.mask[1:]):
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
        if len(e.ids) < 2 or not any(e.mask[1:]):
            counts["dropped"] += 1
            continue
        split["val" if is_val else "train"].append(_example(e))
    counts["train_rows"], counts["val_rows"] = len(split["train"]), len(split["val"])
    if not split["train"]:
        raise ValueError(f"no training rows left of {len(rows)} (held out {counts['val_rows']}, dropped {counts['dropped']}); "
                         "add rows, raise --seq-len or lower --data.val-permille")
    counts["train_tokens"] = int(sum(len(x["input_ids"]) for x in split["train"]))
    train_rows = split["train"]
    val_rows = split["val"]
    if cfg.pack:
        train_rows, val_rows = pack_examples(train_rows, seq_len), pack_examples(val_rows, seq_len) if val_rows else []
        counts["packed_rows"] = len(train_rows)
    train, val = SFTExamples(train_rows, pad_id), SFTExamples(val_rows, pad_id)
    counts["train_targets"] = train.targets()
    return SFTData(train, val, counts)


def _encode_row(enc, cfg: SFTDataConfig, row: Row) -> Encoded:
    if isinstance(enc, MindFormersAlpacaEncoder):
        if cfg.format not in ("auto", "alpaca"):
            raise ValueError(f"--data.template mindformers-alpaca reads alpaca rows; --data.format is {cfg.format}")
        return enc.encode_row(row.data, row.where)
    msgs = to_messages(row, cfg.format)
    if cfg.system is not None and msgs[0]["role"] != "system":
        msgs = [{"role": "system", "content": cfg.system}, *msgs]
    return enc.encode(msgs, row.where)


class SFTLoader(Loader):
    """:class:`mff.data.loader.Loader` over :class:`SFTExamples`: the same seeded, resumable,
    epoch-wrapping order; each global batch is padded to its longest row (every rank pads alike,
    so the result does not depend on the rank count)."""

    def next_batch(self) -> dict[str, torch.Tensor]:
        """This rank's rows of the next global batch (int64 tensors [batch_size // dp_size, T])."""
        everything = self.indices(self.position, self.batch_size)
        T = self.data.lengths(everything)
        mine = everything[self.dp_rank * self.local_batch_size:(self.dp_rank + 1) * self.local_batch_size]
        self.position += self.batch_size
        return {k: torch.from_numpy(v) for k, v in self.data.examples(mine, pad_to=T).items()}

    @property
    def epochs_per_step(self) -> float:
        """Epochs one optimizer step consumes."""
        return self.batch_size / len(self.data)


def sft_eval_batches(data: SFTExamples, batch_size: int, n_batches: int = 0) -> list[dict[str, torch.Tensor]]:
    """The held-out rows in order as whole batches of ``batch_size`` (fewer rows than that: one
    batch of all of them), each padded to its longest row; ``n_batches`` > 0 keeps the first
    that many. Empty when there are no held-out rows."""
    if len(data) == 0:
        return []
    bounds = eval_bounds(len(data), batch_size, n_batches if n_batches > 0 else max(1, len(data)))
    return [{k: torch.from_numpy(v) for k, v in data.examples(np.arange(a, b)).items()} for a, b in bounds]
