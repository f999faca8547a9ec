"""Mixture of Experts, dropless, DeepSeek-V3 style (arXiv 2412.19437 sections 2.1.2 and 2.1.3).

- Router (``gate``): sigmoid affinities ``s = sigmoid(x W_g^T)`` in fp32; the expert bias
  ``e_score_correction_bias`` [E] (fp32, not trained by gradients) is added for *selection
  only*; optional group limit (``n_group`` groups scored by the sum of their top-2 biased
  scores, ``topk_group`` kept); top-k; gate weights are the unbiased scores of the chosen
  experts, normalised to sum 1 when ``norm_topk_prob``, times ``routed_scaling_factor``.
  Matches HF ``DeepseekV3TopkRouter``.
- Routed experts stacked as HF v5 stores them: ``gate_up_proj`` [E, 2I, D] (gate rows first,
  then up rows) and ``down_proj`` [E, D, I]. Token slots are sorted by expert and multiplied
  with a grouped GEMM (``mff.backend.ops.grouped_mm``: ``torch._grouped_mm`` or a per-expert
  loop); no token is dropped.
- Shared experts: one gated MLP of width ``moe_intermediate_size * n_shared_experts``.
- Softmax routing (Qwen3-MoE, HF ``Qwen3MoeTopKRouter``): ``p = softmax(x W_g^T)`` in fp32,
  top-k of p, optionally renormalised (``norm_topk_prob``); no bias, no groups.
- Outputs for the step function: per-expert token counts (the load used by aux-loss-free
  balancing) and the router scores and choices, from which the family computes its balance
  loss (DeepSeek-V3's sequence-wise loss, eq. 17-20, or Switch-style, :func:`switch_balance_loss`).

Shape legend: B batch, T sequence, N = B*T tokens, D hidden, E experts, K top-k, I expert width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mff.backend import ops
from mff.nn import grouped_gemm  # noqa: F401  (registers the mff::grouped_mm custom ops)
from mff.nn.layers import linear, matvec_input
from mff.nn.lora import slot_name
from mff.nn.mlp import GatedMLP
from mff.parallel.ep import all_to_all, exchange_counts, expert_group, plan_receive, plan_send
from mff.parallel.gather import gather

__all__ = ["select_experts", "sequence_balance_loss", "switch_balance_loss", "switch_balance_stats", "switch_balance_from_stats", "Router", "SoftmaxRouter", "Experts", "MoE"]


def select_experts(
    scores_NE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token from sigmoid scores (DeepSeek-V3 routing).

    Args:
        scores_NE: affinities in [0, 1], fp32, [N, E].
        bias_E: the expert bias added for selection only, or None.
        n_group, topk_group: group-limited routing (E must divide into n_group groups).
    Returns:
        weights_NK (fp32) and indices_NK (int64).
    Raises:
        ValueError: E not divisible by n_group, topk_group > n_group, or top_k larger than the
            experts left after the group limit.
    """
    N, E = scores_NE.shape
    choice = scores_NE if bias_E is None else scores_NE + bias_E
    if n_group > 1:
        if E % n_group or topk_group > n_group:
            raise ValueError(f"group-limited routing needs E % n_group == 0 and topk_group <= n_group; got E={E}, n_group={n_group}, topk_group={topk_group}")
        per_group = E // n_group
        if top_k > topk_group * per_group:
            raise ValueError(f"top_k {top_k} exceeds the {topk_group * per_group} experts in {topk_group} groups")
        grouped = choice.view(N, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
    idx_NK = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    w_NK = scores_NE.gather(1, idx_NK)
    if norm_topk_prob:
        w_NK = w_NK / (w_NK.sum(dim=-1, keepdim=True) + 1e-20)
    return w_NK * routed_scaling_factor, idx_NK


def sequence_balance_loss(scores_BTE: torch.Tensor, idx_BTK: torch.Tensor) -> torch.Tensor:
    """Sequence-wise balance loss per sequence, before alpha (DeepSeek-V3 eq. 17-20).

    ``f_i = E / (K T) * #{t : i in TopK(t)}``, ``P_i = mean_t s_{i,t} / sum_j s_{j,t}``,
    returns ``sum_i f_i P_i`` [B] in fp32. Equals 1 for perfectly uniform routing.
    """
    B, T, E = scores_BTE.shape
    K = idx_BTK.shape[-1]
    counts_BE = torch.zeros(B, E, dtype=scores_BTE.dtype, device=scores_BTE.device)
    counts_BE.scatter_add_(1, idx_BTK.reshape(B, T * K), torch.ones(B, T * K, dtype=scores_BTE.dtype, device=scores_BTE.device))
    f_BE = counts_BE * (E / (K * T))
    p_BE = (scores_BTE / scores_BTE.sum(-1, keepdim=True)).mean(1)
    return (f_BE * p_BE).sum(-1)


def switch_balance_stats(probs: list[torch.Tensor], indices: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """The additive statistics of the Switch balance loss over some MoE layers: ``[2 E + 1]``
    fp32 holding the token slots routed to each expert, the summed router probability of each
    expert, and the number of (layer, token) rows, all summed over the given layers. Statistics
    of disjoint sets of layers add up (pipeline stages sum theirs); :func:`switch_balance_from_stats`
    turns the total into the loss.

    ``probs``: per layer, router softmax probabilities [N, E]; ``indices``: per layer the chosen
    experts [N, K]. Only the probability sums carry a gradient."""
    device = probs[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    psum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for p, idx in zip(probs, indices):
        counts.scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.float32, device=device))
        psum = psum + p.float().sum(0)
        rows += p.shape[0]
    return torch.cat((counts, psum, torch.tensor([float(rows)], device=device)))


def switch_balance_from_stats(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` (fp32, 0-d) from :func:`switch_balance_stats` summed over every MoE
    layer: ``f_e`` the share of token slots routed to e over all layers and tokens (summing to K),
    ``P_e`` the mean probability of e (Fedus et al. 2021, eq. 4-6; HF's ``load_balancing_loss_func``
    without an attention mask). K for perfectly uniform routing."""
    E = num_experts
    rows = stats[2 * E]
    return E * ((stats[:E] / rows) * (stats[E:2 * E] / rows)).sum()


def switch_balance_loss(probs: list[torch.Tensor], indices: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """Switch-Transformer balance loss over all MoE layers at once, as HF's
    ``load_balancing_loss_func`` (Fedus et al. 2021, eq. 4-6) computes it without an attention mask.

    ``probs``: per layer, router softmax probabilities [N, E] (fp32); ``indices``: per layer the
    chosen experts [N, K]. With ``f_e`` the share of token slots routed to e over all layers and
    tokens (summing to K) and ``P_e`` the mean probability of e, returns ``E * sum_e f_e P_e``
    (fp32, 0-d; K for perfectly uniform routing). Computed from the per-layer statistics
    (:func:`switch_balance_stats`), as a pipeline computes it from its stages' sums.
    """
    return switch_balance_from_stats(switch_balance_stats(probs, indices, num_experts), num_experts)


class Router(nn.Module):
    """``weight`` [E, D] and ``e_score_correction_bias`` [E], both fp32.

    ``forward(x [N, D]) -> scores [N, E] (fp32 sigmoid), weights [N, K], indices [N, K]``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x_ND.float(), gather(self.weight).float())
        scores = logits.sigmoid()
        bias = gather(self.e_score_correction_bias).detach().float()
        w, idx = select_experts(scores, bias, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)
        return scores, w, idx


class SoftmaxRouter(nn.Module):
    """Softmax top-k router (Qwen3-MoE); ``weight`` [E, D] kept fp32.

    ``forward(x [N, D]) -> probs [N, E] (fp32 softmax), weights [N, K] (fp32), indices [N, K]``.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x_ND.float(), gather(self.weight).float()), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return probs, w, idx



class ExpertLoRA(NamedTuple):
    """The LoRA factors of one stacked expert weight [E, F, D], as the experts compute with them:
    ``A`` [E, r, D], ``B`` [E, F, r] (this rank's experts under ep), the scale and the dropout."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    dropout: float


def _expert_lora(slot, keep: tuple[str, ...] = ()) -> ExpertLoRA | None:
    if slot is None:
        return None
    return ExpertLoRA(gather(slot.A, keep=keep), gather(slot.B, keep=keep), slot.scale, slot.dropout)


def _grouped_low_rank(mm, x_SD: torch.Tensor, lora: ExpertLoRA, counts: list[int]) -> torch.Tensor:
    """``s (x A_e^T) B_e^T`` per expert group: two narrow grouped GEMMs (rank r in between), no
    [E, F, D] delta."""
    if lora.dropout > 0 and torch.is_grad_enabled():
        x_SD = F.dropout(x_SD, lora.dropout, training=True)
    return mm(mm(x_SD, (lora.A * lora.scale).transpose(1, 2), counts), lora.B.transpose(1, 2), counts)  # s on the small A


def _expert_mlp(x_SD: torch.Tensor, gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor, counts: list[int] | torch.Tensor,
                lora_gate_up: ExpertLoRA | None = None, lora_down: ExpertLoRA | None = None) -> torch.Tensor:
    """The gated expert MLP on rows grouped by expert (``counts[e]`` consecutive rows for
    expert e): one grouped GEMM per projection (``ops.grouped_mm`` for a list of counts; the
    ``mff::grouped_mm`` custom op of :mod:`mff.nn.grouped_gemm` for an int64 tensor of them, the
    compiled path), plus each projection's LoRA path when it has one. Returns [S, D].

    With no rows (an ep rank whose experts were routed no token) the result is still made from
    ``x_SD`` and the weights, so that the backward reaches the all-to-all on every rank alike
    (``torch._grouped_mm``'s backward also rejects zero rows)."""
    mm = (torch.ops.mff.grouped_mm if isinstance(counts, torch.Tensor) else ops.grouped_mm) if x_SD.shape[0] else _no_rows_mm
    h = mm(x_SD, gate_up_EFD.transpose(1, 2), counts)  # [S, 2I]
    if lora_gate_up is not None:
        h = h + _grouped_low_rank(mm, x_SD, lora_gate_up, counts)
    a = ops.swiglu(h)  # gate-first halves; npu_swiglu on an NPU
    y = mm(a, down_EDI.transpose(1, 2), counts)
    if lora_down is not None:
        y = y + _grouped_low_rank(mm, a, lora_down, counts)
    return y


def _no_rows_mm(x_0D: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[0, F] from [0, D] rows, differentiable (zero gradients) to both inputs."""
    return x_0D.matmul(w_EDF[0])


def _combine(y_SD: torch.Tensor, w_NK: torch.Tensor, order: torch.Tensor, token_of_slot: torch.Tensor, x_ND: torch.Tensor) -> torch.Tensor:
    """``y_n = sum_k w[n, k] y_slot(n, k)`` from the expert outputs of the sorted slots."""
    y_SD = y_SD * w_NK.reshape(-1)[order, None]
    out = torch.zeros(x_ND.shape, dtype=y_SD.dtype, device=x_ND.device).index_add_(0, token_of_slot, y_SD)
    return out.to(x_ND.dtype)


def _expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token slots per expert, [E] int64: a bincount of fixed length (a static shape under
    ``torch.compile``, where ``torch.bincount``'s length depends on the data)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _permuted_experts(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EFD: torch.Tensor,
                      down_EDI: torch.Tensor, lora: tuple[ExpertLoRA | None, ExpertLoRA | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """An NPU, eagerly: npu_moe_token_permute / unpermute around the grouped GEMMs, in the stable
    expert order of :func:`_grouped_experts` (compiled, the torch sort and combine are used
    instead, so the block stays one graph)."""
    counts_E = _expert_counts(idx_NK.reshape(-1), gate_up_EFD.shape[0])
    x_SD, sorted_indices = ops.moe_permute(x_ND, idx_NK)
    y_SD = _expert_mlp(x_SD, gate_up_EFD, down_EDI, counts_E.tolist(), *lora)
    return ops.moe_unpermute(y_SD, sorted_indices, w_NK).to(x_ND.dtype), counts_E


def _grouped_experts(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_EFD: torch.Tensor,
                     down_EDI: torch.Tensor, lora: tuple[ExpertLoRA | None, ExpertLoRA | None] = (None, None)
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token slots sorted by expert (stable argsort), then one grouped GEMM per projection.

    Eagerly the group sizes go to ``ops.grouped_mm`` as a list (one host sync per layer). Under
    ``torch.compile`` they stay a tensor and the GEMMs are the ``mff::grouped_mm`` custom op
    (:mod:`mff.nn.grouped_gemm`: a fake rule gives the output shape), so the MoE block compiles
    as one graph with no break and selective checkpointing works across it; on an NPU the
    eager path uses the token permutation kernels and the compiled one the torch sort.
    Returns ``(y [N, D], counts [E] int64)``."""
    if ops.moe_permute is not None and not torch.compiler.is_compiling():
        return _permuted_experts(x_ND, w_NK, idx_NK, gate_up_EFD, down_EDI, lora)
    K = idx_NK.shape[1]
    flat = idx_NK.reshape(-1)
    counts_E = _expert_counts(flat, gate_up_EFD.shape[0])
    order = torch.argsort(flat, stable=True)
    token_of_slot = order // K
    groups = counts_E if torch.compiler.is_compiling() else counts_E.tolist()  # tolist: host sync for the group sizes
    y_SD = _expert_mlp(x_ND[token_of_slot], gate_up_EFD, down_EDI, groups, *lora)
    return _combine(y_SD, w_NK, order, token_of_slot, x_ND), counts_E


@torch.compiler.disable
def _dispatched_experts(x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, gate_up_local: torch.Tensor,
                        down_local: torch.Tensor, num_experts: int, group,
                        lora: tuple[ExpertLoRA | None, ExpertLoRA | None] = (None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallelism (:mod:`mff.parallel.ep`): this rank's token slots go by all-to-all
    to the ep ranks holding their experts, ``gate_up_local`` [E/P, 2I, D] and ``down_local``
    [E/P, D, I] run on the slots received, and the outputs come back and are combined as in
    :func:`_grouped_experts`. Every rank of ``group`` must call it (collectives).
    Returns ``(y [N, D], counts [E] int64: this rank's slots per expert)``."""
    P = dist.get_world_size(group)
    if gate_up_local.shape[0] * P != num_experts or down_local.shape[0] != gate_up_local.shape[0]:
        raise ValueError(f"local experts gate_up {gate_up_local.shape[0]} / down {down_local.shape[0]} x ep {P} != {num_experts} "
                         "routed experts: both stacked expert weights must be split by expert over ep")
    send = plan_send(idx_NK, num_experts, P)
    recv = plan_receive(exchange_counts(send.counts, group))
    x_recv = all_to_all(x_ND[send.token_of_slot], recv.recv_splits, send.send_splits, group)
    y_local = _expert_mlp(x_recv[recv.local_order], gate_up_local, down_local, recv.local_counts, *lora)
    back = torch.empty_like(recv.local_order)
    back[recv.local_order] = torch.arange(back.numel(), device=back.device)
    y_SD = all_to_all(y_local[back], send.send_splits, recv.recv_splits, group)
    return _combine(y_SD, w_NK, send.order, send.token_of_slot, x_ND), send.counts


class Experts(nn.Module):
    """Stacked routed experts. ``forward(x [N, D], weights [N, K], indices [N, K]) -> (y [N, D], counts [E])``.

    ``y_n = sum_k weights[n, k] * down_e(silu(gate_e(x_n)) * up_e(x_n))`` with ``e = indices[n, k]``;
    ``counts`` are this rank's token slots per expert (int64). With at most E token slots
    (decoding) the chosen experts' weights are gathered per slot instead (no host sync).

    Expert parallelism: when the stacked weights are DTensors split by expert over a mesh axis
    ``ep`` of size P > 1, each rank keeps its E/P experts (``gather(w, keep=("ep",))``) and the
    token slots travel to them by all-to-all (:func:`_dispatched_experts`); every ep rank must
    then run the layer together.

    LoRA (:mod:`mff.nn.lora`): a ``lora_gate_up_proj`` / ``lora_down_proj`` slot adds one
    ``A``/``B`` pair per expert to that projection, computed per expert group with two grouped
    GEMMs through rank r (split by expert over ep like the weights).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def _lora(self, keep: tuple[str, ...] = ()) -> tuple[ExpertLoRA | None, ExpertLoRA | None]:
        slots = self.__dict__["_modules"]
        return _expert_lora(slots.get(slot_name("gate_up_proj")), keep), _expert_lora(slots.get(slot_name("down_proj")), keep)

    def forward(self, x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, D = x_ND.shape
        K = idx_NK.shape[1]
        group = expert_group(self.gate_up_proj)
        if group is not None:
            w1, w2 = gather(self.gate_up_proj, keep=("ep",)), gather(self.down_proj, keep=("ep",))
            return _dispatched_experts(x_ND, w_NK, idx_NK, w1, w2, self.num_experts, group, self._lora(keep=("ep",)))
        if N * K <= self.num_experts:
            return self._gathered(x_ND, w_NK, idx_NK)
        return _grouped_experts(x_ND, w_NK, idx_NK, gather(self.gate_up_proj), gather(self.down_proj), self._lora())

    def _gathered(self, x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Few token slots (decoding): each slot's expert weights and batched mat-vecs (on an
        accelerator: gathered, no host sync; on a CPU: read in place, one mat-vec per slot).
        Only the chosen experts are read."""
        N, D = x_ND.shape
        K = idx_NK.shape[1]
        flat = idx_NK.reshape(-1)
        x_SD = x_ND.repeat_interleave(K, dim=0)
        w1, w2 = gather(self.gate_up_proj), gather(self.down_proj)
        lora_gu, lora_dn = self._lora()
        if lora_gu is not None or lora_dn is not None:
            return self._gathered_lora(x_SD, flat, w1, w2, lora_gu, lora_dn, w_NK, x_ND.dtype)
        if torch.compiler.is_compiling():
            # fused by the compiler into one pass over the chosen experts' rows (no gathered copy)
            g, u = (matvec_input(x_SD)[:, None, :] * w1[flat]).sum(-1).chunk(2, dim=-1)  # [S, I] each
            y = (matvec_input(F.silu(g) * u)[:, None, :] * w2[flat]).sum(-1)  # [S, D]
        elif x_SD.device.type == "cpu" and not torch.is_grad_enabled():
            # decoding eagerly on a CPU: one mat-vec per slot on its expert's weights in place; the
            # indexing below would copy the chosen experts' weights first (a host sync here costs
            # nothing; with grads each slot's select would make a whole [E, ...] gradient)
            rows = []
            for s, e in enumerate(flat.tolist()):
                g, u = linear(x_SD[s], w1[e]).chunk(2, dim=-1)  # [I] each
                rows.append(linear(F.silu(g) * u, w2[e]))
            y = torch.stack(rows)  # [S, D]
        else:
            g, u = torch.bmm(x_SD[:, None, :], w1[flat].transpose(1, 2)).chunk(2, dim=-1)  # [S, 1, I]
            y = torch.bmm(F.silu(g) * u, w2[flat].transpose(1, 2)).squeeze(1)  # [S, D]
        y = (y * w_NK.reshape(-1, 1)).view(N, K, D).sum(1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        return y.to(x_ND.dtype), counts  # scatter_add, not bincount: a fixed output shape (no graph break)

    def _gathered_lora(self, x_SD, flat, w1, w2, lora_gu, lora_dn, w_NK, dtype):
        """:meth:`_gathered` with LoRA on either projection: per slot ``x W_e^T + s (x A_e^T) B_e^T``
        as batched mat-vecs over the chosen experts' factors."""
        S, D = x_SD.shape
        N, K = w_NK.shape

        def proj(x_S1D, w, lora):
            y = torch.bmm(x_S1D, w[flat].transpose(1, 2))
            if lora is not None:
                x_in = F.dropout(x_S1D, lora.dropout, training=True) if lora.dropout > 0 and torch.is_grad_enabled() else x_S1D
                z = torch.bmm(x_in, lora.A[flat].transpose(1, 2))
                y = y + torch.bmm(z, lora.B[flat].transpose(1, 2)) * lora.scale
            return y

        g, u = proj(x_SD[:, None, :], w1, lora_gu).chunk(2, dim=-1)  # [S, 1, I]
        y = proj(F.silu(g) * u, w2, lora_dn).squeeze(1)  # [S, D]
        y = (y * w_NK.reshape(-1, 1)).view(N, K, D).sum(1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        return y.to(dtype), counts


class MoE(nn.Module):
    """Router (``gate``) + routed experts + optional shared experts.

    ``scoring_func``: ``"sigmoid"`` (DeepSeek-V3 / GLM-4.5: :class:`Router` with the expert
    bias, groups and scaling) or ``"softmax"`` (Qwen3-MoE: :class:`SoftmaxRouter`).
    ``forward(x [B, T, D]) -> (y [B, T, D], load [E] int64, scores [N, E] fp32, indices [N, K])``.
    """

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int,
                 n_shared_experts: int = 0, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, scoring_func: str = "sigmoid"):
        super().__init__()
        if scoring_func == "sigmoid":
            self.gate = Router(hidden_size, num_experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
        elif scoring_func == "softmax":
            self.gate = SoftmaxRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        else:
            raise ValueError(f"scoring_func {scoring_func!r}; expected 'sigmoid' or 'softmax'")
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_experts = GatedMLP(hidden_size, intermediate_size * n_shared_experts) if n_shared_experts else None

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        scores, w, idx = self.gate(x_ND)
        y, load = self.experts(x_ND, w, idx)
        y = y.view(B, T, D)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_BTD)
        return y, load, scores, idx
