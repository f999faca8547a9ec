"""Log-likelihood of token continuations, batched, with each shared context run once.

:func:`score_continuations` takes ``(context ids, continuation ids)`` pairs and returns
``(sum of log p(continuation token | everything before), is_greedy)`` per pair, the quantity
lm-evaluation-harness's ``loglikelihood`` defines (``lm_eval/api/model.py``; ``is_greedy``: every
continuation token is the argmax of its prediction).

How: pairs with the same context (the choices of one question) form a group. A batch of groups
prefills its contexts once into a KV cache (left-padded, :meth:`mff.model.Model.init_cache`);
the last context position predicts every continuation's first token; the cache rows are then
repeated per continuation and all continuations of the batch run in one more forward
(right-padded). So a 4-choice question costs one context pass, not four. Pairs longer than the
model's length keep their last ``max_length + 1`` tokens (the context is cut from the left, as
lm-eval's ``hf`` backend does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mff.model import Model

__all__ = ["score_continuations", "truncate_pair", "ScoreOptions"]


@dataclass(frozen=True)
class ScoreOptions:
    """``batch_size``: continuations per forward; ``max_length``: tokens the model sees per
    request (default: its ``max_position_embeddings``)."""

    batch_size: int = 32
    max_length: int | None = None


def truncate_pair(ctx: Sequence[int], cont: Sequence[int], max_length: int) -> tuple[list[int], list[int], bool]:
    """Keep the last ``max_length + 1`` tokens of ``ctx + cont`` (the model is fed all but the
    last). Returns ``(ctx, cont, truncated)``; ``cont`` keeps at most ``max_length`` tokens and
    ``ctx`` at least one."""
    whole = list(ctx) + list(cont)
    if len(whole) <= max_length + 1:
        return list(ctx), list(cont), False
    keep = whole[-(max_length + 1):]
    n_cont = min(len(cont), max_length)
    return keep[:len(keep) - n_cont], keep[len(keep) - n_cont:], True


def _batches(groups: list[tuple[tuple[int, ...], list[int]]], conts: Sequence[list[int]], batch_size: int, limit: int):
    """Consecutive groups whose continuations fit ``batch_size`` rows and whose longest
    context + longest continuation fit the cache (``limit`` slots)."""
    batch: list[tuple[tuple[int, ...], list[int]]] = []
    rows = ctx_len = cont_len = 0
    for ctx, members in groups:
        for i in range(0, len(members), batch_size):
            part = members[i:i + batch_size]
            c = max(len(conts[j]) for j in part)
            if batch and (rows + len(part) > batch_size or max(ctx_len, len(ctx)) + max(cont_len, c) - 1 > limit):
                yield batch
                batch, rows, ctx_len, cont_len = [], 0, 0, 0
            batch.append((ctx, part))
            rows += len(part)
            ctx_len, cont_len = max(ctx_len, len(ctx)), max(cont_len, c)
    if batch:
        yield batch


def _repeat_rows(cache: dict, index: torch.Tensor) -> dict:
    """The cache with row ``index[r]`` as row ``r`` (every per-row tensor has the batch first)."""
    return {"offset": cache["offset"], "pos": cache["pos"], "valid": cache["valid"].index_select(0, index),
            "next_pos": cache["next_pos"].index_select(0, index),
            "layers": [{k: v.index_select(0, index) for k, v in layer.items()} for layer in cache["layers"]]}


@torch.no_grad()
def score_continuations(model: Model, params: Mapping[str, torch.Tensor], pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                        options: ScoreOptions = ScoreOptions(), *, device: torch.device | str | None = None,
                        progress: Callable[[int, int], None] | None = None) -> tuple[list[tuple[float, bool]], int]:
    """Log-likelihood of each continuation given its context.

    Args:
        pairs: ``(context ids, continuation ids)``, both non-empty lists of token ids in
            ``[0, vocab_size)``.
        options: batch size and length limit (:class:`ScoreOptions`).
        device: where the ids go (default: the embedding's device).
        progress: called with ``(pairs finished, pairs)`` after each batch.
    Returns:
        ``([(logprob (natural log, float64 sum of fp32 log-softmax values), is_greedy)], number
        of pairs truncated)``, in the order of ``pairs``.
    Raises:
        ValueError: an empty context or continuation, an id outside the vocabulary, a batch size
            or length < 1 (named).
    """
    limit = model.config.max_position_embeddings
    max_length = options.max_length or limit
    if options.batch_size < 1 or isinstance(options.batch_size, bool):
        raise ValueError(f"batch_size={options.batch_size!r} must be >= 1")
    if not 1 <= max_length <= limit:
        raise ValueError(f"max_length={max_length} must be in [1, max_position_embeddings={limit}]")
    V = model.config.vocab_size
    ctxs, conts, truncated = [], [], 0
    for i, (ctx, cont) in enumerate(pairs):
        if len(ctx) == 0 or len(cont) == 0:
            raise ValueError(f"request {i}: empty {'context' if len(ctx) == 0 else 'continuation'} (give the prefix token as the context)")
        ctx, cont, cut = truncate_pair(ctx, cont, max_length)
        bad = [t for t in ctx + cont if not 0 <= t < V]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]} outside the vocabulary [0, {V}); use the model's own tokenizer")
        truncated += cut
        ctxs.append(tuple(ctx))
        conts.append(cont)
    by_ctx: dict[tuple[int, ...], list[int]] = {}
    for i, ctx in enumerate(ctxs):
        by_ctx.setdefault(ctx, []).append(i)
    # longest first: the batches are then of similar lengths, and the first shows the peak memory
    groups = sorted(by_ctx.items(), key=lambda g: -(len(g[0]) + max(len(conts[j]) for j in g[1])))
    device = torch.device(device) if device is not None else params["model.embed_tokens.weight"].device
    dtype = params["model.embed_tokens.weight"].dtype
    results: list[tuple[float, bool] | None] = [None] * len(ctxs)
    done = 0
    if progress is not None:
        progress(0, len(ctxs))  # the clock starts before the first (largest) batch
    for batch in _batches(groups, conts, options.batch_size, limit):
        G = len(batch)
        Tc = max(len(ctx) for ctx, _ in batch)
        Lc = max(len(conts[j]) for _, part in batch for j in part)
        ids = torch.zeros(G, Tc, dtype=torch.int64)
        mask = torch.zeros(G, Tc, dtype=torch.bool)
        for g, (ctx, _) in enumerate(batch):
            ids[g, Tc - len(ctx):] = torch.tensor(ctx)
            mask[g, Tc - len(ctx):] = True
        cache = model.init_cache(G, Tc + Lc - 1, dtype=dtype, device=device)
        out = model.forward(params, {"input_ids": ids.to(device), "attention_mask": mask.to(device)}, cache, check=False, logits="last")
        first = torch.log_softmax(out.logits[:, -1].float(), dim=-1)  # [G, V]
        rows = [(g, j) for g, (_, part) in enumerate(batch) for j in part]
        R = len(rows)
        cont_ids = torch.zeros(R, Lc, dtype=torch.int64)
        for r, (_, j) in enumerate(rows):
            cont_ids[r, :len(conts[j])] = torch.tensor(conts[j])
        group_of = torch.tensor([g for g, _ in rows], dtype=torch.int64)
        lp = torch.empty(R, Lc, dtype=torch.float32)
        greedy = torch.empty(R, Lc, dtype=torch.bool)
        first_rows = first.cpu().index_select(0, group_of)
        lp[:, 0] = first_rows.gather(1, cont_ids[:, :1])[:, 0]
        greedy[:, 0] = first_rows.argmax(-1) == cont_ids[:, 0]
        if Lc > 1:
            cmask = torch.zeros(R, Lc - 1, dtype=torch.bool)
            for r, (_, j) in enumerate(rows):
                cmask[r, :len(conts[j]) - 1] = True
            rest = model.forward(params, {"input_ids": cont_ids[:, :-1].to(device), "attention_mask": cmask.to(device)},
                                 _repeat_rows(out.cache, group_of.to(device)), check=False)
            logits = rest.logits.float()  # [R, Lc-1, V]; log p = logit - logsumexp, without a second [R, Lc-1, V] tensor
            tgt = cont_ids[:, 1:].to(logits.device)
            lp[:, 1:] = (logits.gather(2, tgt[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)).cpu()
            greedy[:, 1:] = (logits.argmax(-1) == tgt).cpu()
            del logits, rest
        for r, (_, j) in enumerate(rows):
            n = len(conts[j])
            results[j] = (float(lp[r, :n].double().sum()), bool(greedy[r, :n].all()))
        done += R
        if progress is not None:
            progress(done, len(ctxs))
    return results, truncated  # type: ignore[return-value]
