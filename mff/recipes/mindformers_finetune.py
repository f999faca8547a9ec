"""The fine-tuning parts of a MindFormers YAML -> ``python -m mff.recipes.finetune`` flags (used by
:func:`mff.recipes.mindformers_yaml.translate` with ``recipe="finetune"``).

- Weights: ``load_checkpoint``, else ``pretrained_model_dir`` -> ``--init-from`` (when mff can
  load it here); the model config then comes from that checkpoint, so ``model.model_config``
  keys are not translated (listed as ignored).
- ``model.model_config.pet_config`` (or ``model.pet_config``) with ``pet_type: lora``:
  ``lora_rank`` -> ``--lora.r``, ``lora_alpha`` -> ``--lora.alpha``, ``lora_dropout`` ->
  ``--lora.dropout``, ``target_modules`` (a regex of Mcore or legacy names, ``.*linear_qkv|.*linear_proj``)
  -> ``--lora.targets`` in HF names: ``linear_qkv`` -> q/k/v (MLA: q_a_proj, kv_a_proj_with_mqa),
  ``linear_proj`` -> o_proj, ``linear_fc1`` -> gate/up (fused gate_up and the routed experts'
  gate_up_proj), ``linear_fc2`` -> down_proj, ``linear_q_up_proj`` / ``linear_qb`` -> q_b_proj,
  ``linear_kv_up_proj`` / ``linear_kvb`` -> kv_b_proj, ``linear_q_down_proj`` -> q_a_proj,
  ``linear_kv_down_proj`` -> kv_a_proj_with_mqa, legacy ``wq wk wv wo w1 w2 w3``.
  ``word_embeddings`` / ``output_layer`` (LoRA on the embedding or head) are left out, with a note.
- ``train_dataset.data_loader`` of type ``HFDataLoader`` with ``path: json`` and ``data_files``
  -> ``--data.path``; handlers: ``take`` -> ``--data.limit``, ``AlpacaInstructDataHandler`` ->
  ``--data.template mindformers-alpaca`` (its ``seq_length`` -> ``--seq-len`` when the model
  config has none), ``PackingHandler`` (``pack_strategy: pack``) -> ``--data.pack``;
  ``shuffle`` -> ``--data.shuffle``.
- ``runner_config.epochs`` -> ``--epochs`` (with ``lr_schedule.total_steps: -1``),
  ``lr_schedule.warmup_ratio`` -> ``--warmup-ratio``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MCORE_LORA_NAMES", "lora_targets", "weights_flags", "lora_flags", "hf_loader_flags"]

MCORE_LORA_NAMES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"),
    "linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj", "gate_up_proj"),
    "linear_fc2": ("down_proj",),
    "gating": ("gate_proj",), "hidden": ("up_proj",),
    "linear_q_proj": ("q_proj",), "linear_q_down_proj": ("q_a_proj",), "linear_q_up_proj": ("q_b_proj",), "linear_qb": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",), "linear_kv_up_proj": ("kv_b_proj",), "linear_kvb": ("kv_b_proj",),
    # legacy (MindFormers <= 1.x Llama-family names)
    "wq": ("q_proj",), "wk": ("k_proj",), "wv": ("v_proj",), "wo": ("o_proj",),
    "w1": ("gate_proj",), "w3": ("up_proj",), "w2": ("down_proj",), "w_gate_hidden": ("gate_up_proj",),
}
_UNSUPPORTED = {"word_embeddings": "LoRA on the embedding", "output_layer": "LoRA on the output head", "router": "LoRA on a router",
                "tok_embeddings": "LoRA on the embedding"}


def lora_targets(regex: str) -> tuple[tuple[str, ...], list[str]]:
    """``--lora.targets`` entries for a MindFormers ``target_modules`` regex (one per MindFormers
    name, as ``a|b|c`` alternatives of HF names: the model's family decides which exist), and the
    alternatives left out.

    Raises:
        ValueError: an alternative that names no module mff knows.
    """
    groups: list[str] = []
    left: list[str] = []
    for alt in str(regex).split("|"):
        core = re.sub(r"^[.*\\^(]+|[$)]+$", "", alt.strip())
        last = core.replace("\\.", ".").split(".")[-1].strip("*")
        if last in _UNSUPPORTED:
            left.append(f"{alt.strip()} ({_UNSUPPORTED[last]} is not supported)")
            continue
        mapped = MCORE_LORA_NAMES.get(last)
        if mapped is None:
            raise ValueError(f"target_modules: {alt.strip()!r} names no module mff maps; known: {', '.join(sorted(MCORE_LORA_NAMES))}")
        group = "|".join(mapped)
        if group not in groups:
            groups.append(group)
    return tuple(groups), left


def weights_flags(t, loadable) -> list[str]:
    """``--init-from`` from ``load_checkpoint`` or ``pretrained_model_dir`` (the first that
    ``loadable(path)`` accepts; the other is noted)."""
    for key in ("load_checkpoint", "pretrained_model_dir"):
        path = t.get(key, use=False)
        if path == "":
            t.used.add(key)  # set to nothing
        if not path:
            continue
        err = loadable(str(path))
        if err is None:
            t.used.add(key)
            return ["--init-from", str(path)]
        t.skip(key, f"not loadable by --init-from here: {err}")
    return []


def _pet_config(t) -> tuple[str | None, dict]:
    for p in ("model.model_config.pet_config", "model.pet_config", "pet_config"):
        v = t.get(p, use=False)
        if isinstance(v, dict):
            return p, v
    return None, {}


def lora_flags(t) -> list[str]:
    """``--lora.*`` from the YAML's ``pet_config`` (none without one).

    Raises:
        ValueError: a ``pet_type`` other than lora; a bad rank, alpha or target.
    """
    path, pet = _pet_config(t)
    if path is None:
        return []
    kind = str(pet.get("pet_type", "lora")).lower()
    if kind != "lora":
        raise t.error(f"{path}.pet_type", f"{pet.get('pet_type')!r} is not supported; mff trains LoRA adapters (pet_type: lora)")
    t.used.add(f"{path}.pet_type")
    flags: list[str] = []
    for key, flag in (("lora_rank", "--lora.r"), ("lora_alpha", "--lora.alpha"), ("lora_dropout", "--lora.dropout")):
        v = t.get(f"{path}.{key}")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise t.error(f"{path}.{key}", f"{v!r} must be a number")
        flags += [flag, str(int(v)) if key == "lora_rank" else repr(float(v))]
    targets = t.get(f"{path}.target_modules")
    if targets:
        names, left = lora_targets(targets)
        t.notes += [f"{path}.target_modules: {x}" for x in left]
        if names:
            flags += ["--lora.targets", *names]
    if t.get(f"{path}.lora_b_init", use=False) in ("zeros", "zero"):
        t.used.add(f"{path}.lora_b_init")
    if t.get(f"{path}.lora_a_init", use=False) is not None:
        t.skip(f"{path}.lora_a_init", "mff draws A as PEFT does: U(-1/sqrt(in), 1/sqrt(in))")
    if t.get(f"{path}.freeze_include", use=False) == ["*"] and t.get(f"{path}.freeze_exclude", use=False) in (["*lora*"], ["*lora_*"]):
        t.used.update((f"{path}.freeze_include", f"{path}.freeze_exclude"))  # what LoRA does: all frozen but the adapters
    return flags


def _handlers(dl: dict) -> list[dict]:
    h = dl.get("handler")
    if isinstance(h, dict):
        return [h]
    return [x for x in h or [] if isinstance(x, dict)]


def hf_loader_flags(t, dl_path: str, dl: dict, seq_len: Any) -> list[str]:
    """``--data.*`` (and ``--seq-len`` when the model config had none) from an ``HFDataLoader``.

    Raises:
        ValueError: a loader that reads from a hub (``path`` other than json / a local file), a
            handler type mff has no counterpart for, a pack strategy other than ``pack``.
    """
    flags: list[str] = []
    source = dl.get("path")
    files = dl.get("data_files")
    if source in ("json", "jsonl") and files:
        items = files if isinstance(files, list) else [files]
        flags += ["--data.path", *[str(x) for x in items]]
        t.used.update((f"{dl_path}.path", f"{dl_path}.data_files"))
    elif source and str(source).endswith((".json", ".jsonl")):
        flags += ["--data.path", str(source)]
        t.used.add(f"{dl_path}.path")
    else:
        raise t.error(f"{dl_path}.path", f"{source!r}: mff reads local files only (path: json with data_files: FILE); download the "
                                         "dataset and point data_files at it")
    if t.get(f"{dl_path}.load_func", use=False) in ("load_dataset", None):
        t.used.add(f"{dl_path}.load_func")
    if t.get(f"{dl_path}.split", use=False) == "train":
        t.used.add(f"{dl_path}.split")
    handlers = _handlers(dl)
    for i, h in enumerate(handlers):
        base = f"{dl_path}.handler" if isinstance(dl.get("handler"), dict) else f"{dl_path}.handler.{i}"
        kind = h.get("type")
        used = [f"{base}.type"]
        if kind == "take":
            flags += ["--data.limit", str(int(h.get("n", 0)))]
            used.append(f"{base}.n")
        elif kind == "AlpacaInstructDataHandler":
            flags += ["--data.template", "mindformers-alpaca"]
            if h.get("seq_length") is not None:
                if seq_len is None:
                    flags += ["--seq-len", str(int(h["seq_length"]))]
                    seq_len = h["seq_length"]
                if h["seq_length"] == seq_len:
                    used.append(f"{base}.seq_length")
            if h.get("padding") is not None:
                t.notes.append(f"{base}.padding (mff pads each batch to its longest row)")
            if h.get("tokenizer") is not None:
                t.notes.append(f"{base}.tokenizer (mff uses the --init-from checkpoint's tokenizer, or --data.tokenizer)")
            for key in sorted(set(h) - {"type", "seq_length", "padding", "tokenizer"}):
                t.notes.append(f"{base}.{key}")
        elif kind == "PackingHandler":
            strategy = h.get("pack_strategy", "pack")
            if strategy != "pack":
                raise t.error(f"{base}.pack_strategy", f"{strategy!r} is not supported; mff packs conversations whole (pack)")
            flags += ["--data.pack"]
            used.append(f"{base}.pack_strategy")
            if h.get("seq_length") is not None and h.get("seq_length") == seq_len:
                used.append(f"{base}.seq_length")
        else:
            raise t.error(f"{base}.type", f"{kind!r} is not supported; mff maps take, AlpacaInstructDataHandler and PackingHandler")
        if kind in ("take", "PackingHandler"):
            t.notes += [f"{base}.{k}" for k in sorted(set(h) - {"type", "n", "seq_length", "pack_strategy"})]
        t.used.update(used)
    if handlers:
        t.used.add(f"{dl_path}.handler")  # a list: its items are accounted for above
    sh = dl.get("shuffle")
    if sh is not None:
        flags += ["--data.shuffle" if sh else "--data.no-shuffle"]
        t.used.add(f"{dl_path}.shuffle")
    return flags
