"""The lm-evaluation-harness backend ``mff``: any checkpoint mff loads, scored by lm-eval's tasks.

    lm_eval --model mff --model_args pretrained=PATH[,adapter=DIR,dtype=float32,max_length=N] --tasks ...
    python -m mff.recipes.eval --harness -- --model mff --model_args pretrained=PATH --tasks ...

:class:`MffLM` is a ``lm_eval.api.model.TemplateLM``: lm-eval tokenises the requests with
:meth:`MffLM.tok_encode` and mff scores the token pairs (:func:`mff.eval.scoring.score_continuations`:
a context shared by several continuations runs once). Importing this module registers the
name ``mff``; the package also declares it as the ``lm_eval.models`` entry point
``mff = "mff.eval.harness:MffLM"`` for lm-eval releases that read entry points (0.4.13 does
not: use the ``--harness`` form). Needs ``pip install 'mff[eval]'``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from mff.eval.lm import GenerationRequest, LanguageModel
from mff.eval.tokens import encode_pair

__all__ = ["MffLM"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}


def _int(name: str, value: Any, default: int | None) -> int | None:
    if value is None or value == "auto":
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be an integer") from None


def _device(flag: str | None) -> torch.device:
    """``cpu``, ``cuda[:N]``, ``npu[:N]`` or ``auto``. lm-eval's CLI passes ``cuda:0`` unless told
    otherwise; as its ``hf`` backend, an accelerator that is not there falls back to the CPU (with a warning)."""
    from mff.backend import DeviceUnavailable, resolve_device

    kind, _, index = (flag or "auto").partition(":")
    try:
        kind = resolve_device(kind)
    except DeviceUnavailable as e:
        print(f"warning: {e}; running on the CPU", file=sys.stderr)
        return torch.device("cpu")
    return torch.device(kind, int(index)) if index and kind != "cpu" else torch.device(kind)


@register_model("mff")
class MffLM(TemplateLM):
    """lm-eval model over mff: ``MffLM(pretrained=PATH, adapter=None, tokenizer=None,
    batch_size=32, max_length=None, device=None, dtype="float32")``, or ``MffLM(lm=LanguageModel)``
    around a model already in memory.

    Raises:
        ValueError: no ``pretrained`` and no ``lm``, a bad ``dtype`` / ``batch_size`` / ``max_length``.
        As :func:`mff.peft.load.load_with_text` for the checkpoint.
    """

    def __init__(self, pretrained: str | None = None, adapter: str | None = None, tokenizer: str | None = None,
                 batch_size: int | str | None = 32, max_length: int | str | None = None, device: str | None = None,
                 dtype: str = "float32", lm: LanguageModel | None = None, seed: int = 0, max_batch_size: Any = None, **unknown: Any):
        super().__init__()
        if unknown:
            raise ValueError(f"unknown --model_args for the mff backend: {', '.join(sorted(unknown))}; known: pretrained, adapter, "
                             "tokenizer, batch_size, max_length, device, dtype, seed")
        if lm is None:
            if pretrained is None:
                raise ValueError("the mff backend needs --model_args pretrained=PATH (a checkpoint mff loads)")
            if dtype not in DTYPES:
                raise ValueError(f"dtype={dtype!r}; expected one of {', '.join(DTYPES)}")
            from mff.peft.load import load_with_text

            dev = _device(device)
            model, params, text = load_with_text(pretrained, dev, DTYPES[dtype], adapter=adapter, tokenizer=tokenizer)
            lm = LanguageModel(model, params, text.tokenizer, text.bos_token, text.eos_token, list(text.eos_ids),
                               batch_size=_int("batch_size", batch_size, 32), max_length=_int("max_length", max_length, None),
                               seed=_int("seed", seed, 0))
        self.lm = lm

    @property
    def eot_token_id(self) -> int:
        if self.lm.eos_ids:
            return int(self.lm.eos_ids[0])
        pid = self.lm.prefix_id
        if pid is None:
            raise ValueError("the tokenizer has no EOS or BOS token")
        return pid

    @property
    def prefix_token_id(self) -> int:
        pid = self.lm.prefix_id
        return self.eot_token_id if pid is None else pid

    @property
    def max_length(self) -> int:
        return self.lm.length

    @property
    def batch_size(self) -> int:
        return self.lm.batch_size

    @property
    def device(self):
        return self.lm.params["model.embed_tokens.weight"].device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.lm.encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.lm.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # lm-eval's split, plus mff's fallback when the continuation merges into the context's last token
        return encode_pair(self.tok_encode, context, continuation, self.prefix_token_id, self.lm.stats)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        pairs, empty = [], []
        for n, (_, ctx, cont) in enumerate(requests):
            if cont:
                pairs.append((list(ctx), list(cont)))
            else:  # lm-eval's empty-context rule can leave nothing to score: log p = 0
                empty.append(n)
        bar = tqdm(total=len(pairs), disable=disable_tqdm or self.rank != 0, desc="mff loglikelihood")
        last = [0]

        def tick(done: int, total: int) -> None:
            bar.update(done - last[0])
            last[0] = done

        scored = iter(self.lm._score(pairs, tick))
        bar.close()
        skip = set(empty)
        out = [(0.0, True) if n in skip else next(scored) for n in range(len(requests))]
        for (key, _, _), res in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        out = self.lm.loglikelihood_rolling(texts)
        for t, ll in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (t,), ll)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        reqs = []
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos and eos not in until:
                until.append(eos)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            max_gen = _int("max_gen_toks", kwargs.get("max_gen_toks"), 256)
            reqs.append(GenerationRequest(context, tuple(until), max_gen, temperature))
        out = self.lm.generate_until(reqs)
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out
