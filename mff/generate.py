"""Text generation over ``model.forward``.

:func:`greedy_generate` is the plain reference loop: each step runs the whole sequence again
(no KV cache), so it is exact and slow; a cached decoder is later work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from mff.model import Model

__all__ = ["greedy_generate"]


@torch.no_grad()
def greedy_generate(
    model: Model,
    params: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
) -> torch.Tensor:
    """Append up to ``max_new_tokens`` argmax tokens to ``input_ids`` (int64 [B, T]).

    Stops early when every row has produced an EOS id (rows that stopped keep emitting that
    EOS id). Returns int64 [B, T + n] with n <= ``max_new_tokens``.

    Raises:
        ValueError: ``max_new_tokens`` < 0 or a sequence longer than the model accepts.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    limit = model.config.max_position_embeddings
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_position_embeddings {limit}")
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    ids = input_ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = model.forward(params, {"input_ids": ids}).logits[:, -1]
        nxt = logits.argmax(-1)
        if eos:
            nxt = torch.where(done, ids[:, -1], nxt)
            done |= torch.isin(nxt, torch.tensor(sorted(eos), device=ids.device))
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if eos and bool(done.all()):
            break
    return ids
