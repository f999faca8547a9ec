"""Multi-Token Prediction (MTP), DeepSeek-V3 (arXiv 2412.19437 section 2.2).

Depth k (1..D) combines the previous depth's hidden state h^{k-1}_t with the embedding of
token t+k: ``h'_t = eh_proj([enorm(Emb(x_{t+k})); hnorm(h^{k-1}_t)])`` (embedding first, the
order of DeepSeek's released checkpoints and of HF ``MtpLayer``; the paper's equation lists the
hidden state first), runs one transformer block, and predicts x_{t+k+1} through the shared
output head after its own final norm ``shared_head.norm``. The embedding and head are the main
model's. The loss is ``lambda / D * sum_k CE_k``.

Param names follow DeepSeek's checkpoints: ``model.layers.{num_hidden_layers + k - 1}.`` +
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and the block's own names.
"""

from __future__ import annotations

import torch
from torch import nn

from mff.nn.layers import Linear, RMSNorm
from mff.nn.loss import IGNORE_INDEX

__all__ = ["mtp_labels", "SharedHead", "add_mtp_params", "mtp_block_input"]


def mtp_labels(labels_BT: torch.Tensor, document_ids_BT: torch.Tensor | None, depth: int) -> torch.Tensor:
    """Targets of MTP depth ``depth`` >= 1: ``labels[t + depth]`` at position t.

    ``labels`` are aligned (``labels[t]`` is the token at position t + 1). A target is
    ``IGNORE_INDEX`` past the end of the row, where ``labels[t + depth]`` is ignored, and where
    the target token lies in another document than position t. The target token's document is
    that of position ``t + depth + 1`` (the last position's label, whose token is past the row,
    counts as the last position's document), so no target crosses a document boundary whatever
    the labels hold: with Megatron's ``reset_attention_mask`` on and ``eod_mask_loss`` off, the
    main label of a document's EOD is the next document's first token, and no MTP depth of the
    earlier positions may predict it. Returns int64 [B, T].
    """
    if depth < 1:
        raise ValueError(f"MTP depth must be >= 1, got {depth}")
    B, T = labels_BT.shape
    out = torch.full_like(labels_BT, IGNORE_INDEX)
    if depth >= T:
        return out
    shifted = labels_BT[:, depth:]
    if document_ids_BT is not None:
        label_doc = torch.cat((document_ids_BT[:, 1:], document_ids_BT[:, -1:]), dim=1)  # document of labels[t]'s token
        same_doc = label_doc[:, depth:] == document_ids_BT[:, :-depth]
        shifted = shifted.masked_fill(~same_doc, IGNORE_INDEX)
    out[:, : T - depth] = shifted
    return out


class SharedHead(nn.Module):
    """Holds the MTP depth's final norm (``shared_head.norm``); the head matrix is the main model's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


def add_mtp_params(block: nn.Module, hidden_size: int, eps: float) -> nn.Module:
    """Give a decoder block the MTP params ``enorm``, ``hnorm``, ``eh_proj`` [D, 2D], ``shared_head.norm``."""
    block.enorm = RMSNorm(hidden_size, eps)
    block.hnorm = RMSNorm(hidden_size, eps)
    block.eh_proj = Linear(2 * hidden_size, hidden_size)
    block.shared_head = SharedHead(hidden_size, eps)
    return block


def mtp_block_input(block: nn.Module, h_prev_BTD: torch.Tensor, emb_next_BTD: torch.Tensor) -> torch.Tensor:
    """``eh_proj([enorm(emb); hnorm(h_prev)])`` [B, T, D]: the input of the depth's block."""
    return block.eh_proj(torch.cat((block.enorm(emb_next_BTD), block.hnorm(h_prev_BTD)), dim=-1))
