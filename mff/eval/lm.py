"""A checkpoint's model and tokenizer behind the three requests evaluation makes.

- :meth:`LanguageModel.loglikelihood`: ``(context, continuation)`` strings -> ``(log p, is_greedy)``;
- :meth:`LanguageModel.loglikelihood_rolling`: a text -> the sum of the log-probabilities of
  all its tokens (windows of the model's length, every token scored once, the first one
  conditioned on the prefix token);
- :meth:`LanguageModel.generate_until`: a prompt -> the generated text, cut at the first stop string.

The definitions are lm-evaluation-harness's (``lm_eval/api/model.py``, ``lm_eval/models/huggingface.py``),
so the same requests give the same numbers here and through lm-eval (:mod:`mff.eval.harness`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from mff.eval.scoring import ScoreOptions, score_continuations
from mff.eval.tokens import EncodeStats, encode_pair, window_requests
from mff.generate import generate
from mff.model import Model
from mff.sampling import SamplingConfig

__all__ = ["LanguageModel", "GenerationRequest"]


@dataclass(frozen=True)
class GenerationRequest:
    """One ``generate_until`` request: the prompt, the stop strings (the text is cut before the
    first), the most new tokens, and sampling (``temperature`` 0 = greedy)."""

    context: str
    until: tuple[str, ...] = ()
    max_gen_toks: int = 256
    temperature: float = 0.0

    def __post_init__(self):
        if isinstance(self.until, str):  # one stop string, not its characters
            object.__setattr__(self, "until", (self.until,))


@dataclass
class LanguageModel:
    """``model`` + ``params`` + a ``tokenizers.Tokenizer``, scored in batches of ``batch_size``.

    ``prefix_token``: the token that stands for an empty context and starts every rolling
    window sequence (default: the BOS token, else the EOS token, as lm-eval's ``hf`` backend).
    ``eos_ids``: ids that end a generation. ``max_length``: tokens per request (default the
    model's ``max_position_embeddings``). ``stats`` counts merged continuations and truncated
    contexts over the requests made so far.
    """

    model: Model
    params: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    eos_ids: Sequence[int] = ()
    batch_size: int = 32
    max_length: int | None = None
    seed: int = 0
    stats: EncodeStats = field(default_factory=EncodeStats)

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} must be an int >= 1")
        limit = self.model.config.max_position_embeddings
        if self.max_length is not None and not 2 <= self.max_length <= limit:
            raise ValueError(f"max_length={self.max_length} must be in [2, max_position_embeddings={limit}]")

    @property
    def length(self) -> int:
        return self.max_length or self.model.config.max_position_embeddings

    @property
    def prefix_id(self) -> int | None:
        for tok in (self.bos_token, self.eos_token):
            if tok is not None and self.tokenizer.token_to_id(tok) is not None:
                return self.tokenizer.token_to_id(tok)
        return self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` None: the tokenizer's post-processor
        runs (it may add BOS) unless the text already starts with the prefix token."""
        if add_special_tokens is None:
            prefix = self.prefix_id
            add_special_tokens = not (prefix is not None and text.startswith(self.tokenizer.id_to_token(prefix) or "\0"))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _score(self, pairs: Sequence[tuple[list[int], list[int]]], progress: Callable[[int, int], None] | None) -> list[tuple[float, bool]]:
        out, cut = score_continuations(self.model, self.params, pairs, ScoreOptions(self.batch_size, self.max_length), progress=progress)
        self.stats.truncated += cut
        return out

    def encode_requests(self, requests: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        """``(context, continuation)`` strings -> token id pairs (see :mod:`mff.eval.tokens`)."""
        prefix = self.prefix_id
        return [encode_pair(self.encode, ctx, cont, prefix, self.stats) for ctx, cont in requests]

    def loglikelihood(self, requests: Sequence[tuple[str, str]], progress: Callable[[int, int], None] | None = None) -> list[tuple[float, bool]]:
        """``[(log p(continuation | context), is_greedy)]`` per ``(context, continuation)``.

        Raises:
            ValueError: an empty continuation, a continuation with no tokens.
        """
        return self._score(self.encode_requests(requests), progress)

    def rolling_ids(self, sequences: Sequence[Sequence[int]], window: int | None = None, stride: int | None = None,
                    progress: Callable[[int, int], None] | None = None) -> list[float]:
        """Rolling log-likelihood (natural log) of token sequences: positions ``1 .. n-1`` of each
        scored once (:func:`mff.eval.tokens.rolling_windows`, ``window`` default the model's length)."""
        window = self.length if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an int >= 1")
        if window > self.length:
            raise ValueError(f"window={window} exceeds the model's length {self.length}")
        pairs, owner = [], []
        for i, ids in enumerate(sequences):
            for pair in window_requests(ids, window, stride):
                pairs.append(pair)
                owner.append(i)
        sums = [0.0] * len(sequences)
        for i, (lp, _) in zip(owner, self._score(pairs, progress)):
            sums[i] += lp
        return sums

    def loglikelihood_rolling(self, texts: Sequence[str], window: int | None = None, stride: int | None = None,
                              progress: Callable[[int, int], None] | None = None) -> list[float]:
        """Sum of the log-probabilities of every token of each text, the first conditioned on the
        prefix token (lm-eval's ``loglikelihood_rolling``). Raises ValueError when the tokenizer has
        no BOS or EOS token to start with."""
        return self.rolling_ids([self.rolling_sequence(t) for t in texts], window, stride, progress)

    def rolling_sequence(self, text: str) -> list[int]:
        """``[prefix id] + encode(text)``: the sequence :meth:`loglikelihood_rolling` scores from
        position 1. Raises ValueError when the tokenizer has no BOS or EOS token."""
        prefix = self.prefix_id
        if prefix is None:
            raise ValueError("rolling log-likelihood needs a BOS or EOS token to condition the first token on; the tokenizer has neither")
        return [prefix] + self.encode(text)

    def generate_until(self, requests: Sequence[GenerationRequest], progress: Callable[[int, int], None] | None = None) -> list[str]:
        """The text generated for each request, cut before its first stop string.

        Prompts longer than ``length - max_gen_toks`` keep their last tokens (counted in
        ``stats.truncated``). Rows are batched by prompt length; each batch stops when every row
        has met EOS, a stop string or ``max_gen_toks``.

        Raises:
            ValueError: ``max_gen_toks`` < 1 or not below the model's length, an empty prompt.
        """
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].context))
        out: list[str | None] = [None] * len(requests)
        done = 0
        if progress is not None:
            progress(0, len(requests))
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            # one batch generates with one setting: split when they differ
            keys = {(requests[i].max_gen_toks, requests[i].temperature) for i in idx}
            for key in sorted(keys):
                part = [i for i in idx if (requests[i].max_gen_toks, requests[i].temperature) == key]
                for i, text in zip(part, self._generate([requests[i] for i in part], *key)):
                    out[i] = text
            done += len(idx)
            if progress is not None:
                progress(done, len(requests))
        return out  # type: ignore[return-value]

    def _generate(self, reqs: Sequence[GenerationRequest], max_gen_toks: int, temperature: float) -> list[str]:
        if isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or not 1 <= max_gen_toks < self.length:
            raise ValueError(f"max_gen_toks={max_gen_toks!r} must be an int in [1, {self.length})")
        keep = self.length - max_gen_toks
        prompts = []
        for r in reqs:
            ids = self.encode(r.context) if r.context else ([self.prefix_id] if self.prefix_id is not None else [])
            if not ids:
                raise ValueError("an empty prompt and no BOS or EOS token to start from")
            if len(ids) > keep:
                ids = ids[-keep:]
                self.stats.truncated += 1
            prompts.append(ids)
        T = max(len(p) for p in prompts)
        device = self.params["model.embed_tokens.weight"].device
        ids = torch.zeros(len(prompts), T, dtype=torch.int64)
        mask = torch.zeros(len(prompts), T, dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, T - len(p):] = torch.tensor(p)
            mask[r, T - len(p):] = True
        new: list[list[int]] = [[] for _ in reqs]
        stops = [tuple(s for s in r.until if s) for r in reqs]
        eos = set(self.eos_ids)
        finished = [False] * len(reqs)

        def stop_fn(tok: torch.Tensor) -> torch.Tensor:
            for r, t in enumerate(tok.tolist()):
                if finished[r]:
                    continue
                if t in eos:
                    finished[r] = True
                    continue
                new[r].append(t)
                if stops[r]:
                    text = self.tokenizer.decode(new[r][-64:], skip_special_tokens=False)
                    finished[r] = any(s in text for s in stops[r])
            return torch.tensor(finished)

        generate(self.model, self.params, ids.to(device), max_gen_toks, attention_mask=mask.to(device),
                 sampling=SamplingConfig(temperature=temperature), eos_token_id=list(eos), seed=self.seed, stop_fn=stop_fn)
        texts = []
        for r, toks in enumerate(new):
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            cut = min((text.find(s) for s in stops[r] if s in text), default=len(text))
            texts.append(text[:cut])
        return texts
