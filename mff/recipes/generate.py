"""Generate text from a checkpoint, streaming tokens as they come.

    python -m mff.recipes.generate --ckpt PATH --prompt "..." [--max-new-tokens N --temperature T
        --top-k K --top-p P --chat [--chat-template FILE]]

``--ckpt`` is an HF model folder (tokenizer.json and tokenizer_config.json beside the weights),
an mff checkpoint (the pretraining run folder holds the run's tokenizer.json; a fine-tuning run
also its chat template) or a .gguf file (tokenizer and chat template from its metadata).
``--adapter`` adds a LoRA adapter (a PEFT folder or an mff LoRA run) to the weights. ``--chat`` wraps the prompt in the tokenizer's
chat template (jinja2); ``--chat-template FILE`` (a Jinja file) replaces the checkpoint's, or
gives one to a checkpoint without. Decoding uses the KV cache (:func:`mff.generate.generate`); greedy by
default (``--temperature 0``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

from mff.backend import local_device, resolve_device
from mff.ckpt.tokenizer_files import read_chat_template_file
from mff.data.chat import render_chat_template
from mff.decode_timing import break_even_tokens, read_record, record_path, update_record
from mff.generate import cache_bucket, decode_layout, generate
from mff.peft.load import load_with_text
from mff.recipes.common import refuse_pipeline, run_recipe_main
from mff.sampling import SamplingConfig
from mff.train.state import config_to_dict

__all__ = ["GenerateConfig", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}


@dataclass(frozen=True)
class GenerateConfig:
    """Text generation from a checkpoint."""

    ckpt: str
    """An HF model folder, an mff checkpoint (run or step folder), a .gguf file, or a MindSpore .ckpt / MindFormers checkpoint with its HF config.json beside it."""
    prompt: str
    """The prompt text (with --chat: the user message)."""
    max_new_tokens: int = 128
    """Most tokens to generate."""
    temperature: float = 0.0
    """Sampling temperature; below 1e-5 (0 included) greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with mass >= top_p (1 = off)."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top probability (0 = off)."""
    repetition_penalty: float = 1.0
    """Divide positive / multiply negative logits of tokens already seen (1 = off)."""
    seed: int = 0
    """Sampling seed."""
    chat: bool = False
    """Apply the tokenizer's chat template to the prompt."""
    system: str | None = None
    """--chat: a system message."""
    chat_template: str | None = None
    """--chat: a Jinja chat template file that replaces the checkpoint's (or gives one to a checkpoint without)."""
    tokenizer: str | None = None
    """A tokenizer.json to use instead of the checkpoint's."""
    adapter: str | None = None
    """A LoRA adapter for --ckpt: a PEFT adapter folder or an mff LoRA run (merged into the weights before generating)."""
    device: str | None = None
    """cpu, cuda, npu or auto (default: $MF_DEVICE_TYPE, else auto)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Weights dtype (auto: as stored)."""
    threads: int | None = None
    """CPU threads for torch (default: torch's choice)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Decode with a torch.compile-d step: on, off, or auto (compile only where the timings recorded on this machine for this model say it pays back for --max-new-tokens; see README "Speed")."""


def _load(cfg: GenerateConfig, device: torch.device):
    """``(model, params, text)`` for --ckpt (and --adapter: merged into the weights)."""
    return load_with_text(Path(cfg.ckpt), device, DTYPES[cfg.dtype], adapter=cfg.adapter, tokenizer=cfg.tokenizer)


def _render(template: str, messages: list[dict], text, where: str) -> str:
    """The chat prompt; a template that does not parse or render is a ValueError naming ``where``."""
    return render_chat_template(template, messages, add_generation_prompt=True, what=where, bos_token=text.bos_token or "",
                                eos_token=text.eos_token or "")


def run(cfg: GenerateConfig) -> str:
    """Generate, streaming to stdout; returns the generated text.

    Raises:
        ValueError: bad sampling options, ``--system`` / ``--chat-template`` without ``--chat``,
            ``--chat`` without a chat template, a chat template that does not render, an empty
            prompt, token ids outside the model's vocabulary.
        FileNotFoundError: a missing ``--chat-template`` file; as :func:`mff.load` for ``--ckpt``.
    """
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.repetition_penalty)
    sampling.validate()
    if cfg.system is not None and not cfg.chat:
        raise ValueError("--system needs --chat (it is a chat-template message)")
    if cfg.chat_template is not None and not cfg.chat:
        raise ValueError(f"--chat-template {cfg.chat_template} needs --chat (the template wraps the prompt as a chat message)")
    template = read_chat_template_file(cfg.chat_template) if cfg.chat_template is not None else None
    if not 0 <= cfg.seed < 2**63:
        raise ValueError(f"--seed {cfg.seed} must be in [0, 2**63)")
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise ValueError(f"--threads {cfg.threads} must be >= 1")
        torch.set_num_threads(cfg.threads)
    device = local_device(resolve_device(cfg.device))
    model, params, text = _load(cfg, device)
    if cfg.chat:
        if template is None and not text.chat_template:
            raise ValueError(f"--chat: {cfg.ckpt} has no chat template (tokenizer_config.json chat_template, chat_template.jinja "
                             "or GGUF tokenizer.chat_template); pass --chat-template FILE")
        messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [{"role": "user", "content": cfg.prompt}]
        prompt = _render(template or text.chat_template, messages, text,
                         f"--chat-template {cfg.chat_template}" if template is not None
                         else f"the chat template of {text.chat_template_source or cfg.ckpt}")
        ids = text.tokenizer.encode(prompt, add_special_tokens=False).ids
    else:
        ids = text.tokenizer.encode(cfg.prompt).ids
    if not ids:
        raise ValueError("the prompt is empty (it encodes to no tokens)")
    vocab = model.config.vocab_size
    if max(ids) >= vocab:
        raise ValueError(f"the tokenizer produced id {max(ids)} but the model's vocab_size is {vocab}; use the model's own tokenizer")
    new: list[int] = []
    shown = ""

    def stream(tok: torch.Tensor) -> None:
        nonlocal shown
        t = int(tok[0])
        if t in text.eos_ids:
            return
        new.append(t)
        s = text.tokenizer.decode(new, skip_special_tokens=True)
        if not s.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(s[len(shown):])
            sys.stdout.flush()
            shown = s

    record = record_path({"family": model.family.name, "config": config_to_dict(model.config), "batch": 1,
                          "dtype": str(params["model.embed_tokens.weight"].dtype), "device": device.type,
                          "bucket": cache_bucket(len(ids) + cfg.max_new_tokens, model.config.max_position_embeddings),
                          "threads": torch.get_num_threads(), "torch": torch.__version__})
    compiled, note = _pick_compile(cfg, record)
    if not compiled:
        params = decode_layout(params)  # eager mat-vecs read W^T row-major (the loaded weights are freed)
    timings: dict[str, float] = {}
    generate(model, params, torch.tensor([ids], device=device), cfg.max_new_tokens, sampling=sampling,
             eos_token_id=text.eos_ids, seed=cfg.seed, on_token=stream, compile=compiled, timings=timings)
    final = text.tokenizer.decode(new, skip_special_tokens=True)
    sys.stdout.write(final[len(shown):] + "\n")
    sys.stdout.flush()
    if note:
        print(note, file=sys.stderr)
    if compiled:
        update_record(record, compiled_step_s=timings.get("step_s"), first_compiled_step_s=timings.get("first_step_s"))
    else:
        update_record(record, eager_step_s=timings.get("step_s"))
    return final


def _pick_compile(cfg: GenerateConfig, record) -> tuple[bool, str]:
    """``(compile?, note)``: ``--compile on/off`` as given (no note); ``auto`` compiles when this
    machine's recorded timings of this model (:mod:`mff.decode_timing`) put the break-even below
    the decode steps asked for, and the note (printed on stderr after the text) says which it
    picked and why."""
    if cfg.compile != "auto":
        return cfg.compile == "on", ""
    steps = max(0, cfg.max_new_tokens - 1)  # the first new token comes from the prefill
    be = break_even_tokens(read_record(record))
    if be is None:
        return False, ("decode: eager (--compile auto: compiled decoding of this model is not timed on this machine yet; "
                       "--compile on times it)")
    use = steps > be
    why = ("the compiled step was not faster here" if be == float("inf")
           else f"compiling pays back above {be:.0f} decode steps here; this call decodes up to {steps}")
    return use, f"decode: {'compiled' if use else 'eager'} (--compile auto: {why})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        refuse_pipeline(argv, "generate")
        run(tyro.cli(GenerateConfig, args=argv, prog="python -m mff.recipes.generate", description=__doc__))
        return 0

    return run_recipe_main(body)


if __name__ == "__main__":
    sys.exit(main())
