"""Muon (momentum + Newton-Schulz orthogonalisation) as pure init/update over param pytrees.

Muon updates the hidden weight matrices; every other param (embeddings, output heads, norms,
biases: anything 1-D or matched by ``adamw_patterns``) takes an AdamW step with the math of
:mod:`mff.optim.adamw`. Stacked expert weights ``[E, out, in]`` are a batch of E matrices, each
orthogonalised on its own.

Numerics follow ``torch.optim.Muon`` (torch 2.9+, ``torch/optim/_muon.py``), which follows
Keller Jordan's reference (blog post "Muon: An optimizer for hidden layers in neural networks",
2024; quintic Newton-Schulz with coefficients (3.4445, -4.7750, 2.0315), 5 steps, run in
bfloat16). Per Muon param, with ``mu`` = momentum, ``wd`` = ``OptimConfig.weight_decay``::

    buf = lerp(buf, g, 1 - mu)                      # buf = mu buf + (1 - mu) g
    u   = lerp(g, buf, mu) if nesterov else buf     # u = (1 - mu) g + mu buf
    O   = NS(u)                                     # ~ U V^T of u = U S V^T
    p  *= 1 - lr * wd                               # decoupled, unadjusted lr
    p  -= adjust_lr(lr, p.shape) * O

``adjust_lr``: "original" (Keller Jordan) scales lr by ``sqrt(max(1, out / in))``;
"match_rms_adamw" (Moonlight, "Muon is Scalable for LLM Training", arXiv 2502.16982) by
``0.2 * sqrt(max(out, in))`` so the update RMS is about ``0.2 * lr`` like AdamW's and AdamW's lr
and weight decay can be reused.

State (one flat-slot dict, saved by ``mff.ckpt`` as ``"<slot>/<param path>"``)::

    {"step": 0-d int64, "momentum_buffer": {path: T}, "exp_avg": {path: T}, "exp_avg_sq": {path: T}}

with ``momentum_buffer`` for Muon params and ``exp_avg``/``exp_avg_sq`` for AdamW params, only
for params with ``requires_grad``; state tensors have the param's shape, device and DTensor
placements, in fp32 when the param is bf16/fp16. ``step`` counts update calls (AdamW's bias
correction uses it).

DTensor params: the update is elementwise except the orthogonalisation, which needs whole
matrices. When the (momentum-mixed) grad is sharded only along batch dims (dims before the last
two) or replicated, each rank orthogonalises its local matrices; otherwise the whole tensor is
gathered (``full_tensor``), orthogonalised on every rank, and each rank keeps its own slice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from mff.optim.adamw import _adamw_group, _zeros_state, decays
from mff.optim.config import DEFAULT_ADAMW_PATTERNS, OptimConfig
from mff.tree import matches

__all__ = [
    "DEFAULT_ADAMW_PATTERNS",
    "MuonHyper",
    "zeropower_via_newtonschulz",
    "adjust_lr",
    "is_muon_param",
    "init",
    "update",
]

_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class MuonHyper:
    """Muon hyperparameters (defaults: ``torch.optim.Muon``'s). Weight decay comes from
    ``OptimConfig.weight_decay``."""

    momentum: float = 0.95
    """Momentum buffer decay ``mu``: ``buf = mu buf + (1 - mu) g``."""
    nesterov: bool = True
    """Orthogonalise ``(1 - mu) g + mu buf`` instead of ``buf``."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """Quintic Newton-Schulz coefficients (a, b, c)."""
    eps: float = 1e-7
    """Floor of the Frobenius norm the matrix is divided by before the iterations."""
    adjust_lr: str = "original"
    """Per-matrix lr scale: "original" (sqrt(max(1, out/in))) or "match_rms_adamw" (0.2 sqrt(max(out, in)))."""
    ns_dtype: str = "bfloat16"
    """Dtype of the Newton-Schulz iterations: "bfloat16" (torch.optim.Muon's) or "float32"."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it must be."""
        checks = [
            (0 <= self.momentum < 1, f"momentum {self.momentum} must be in [0, 1)"),
            (1 <= self.ns_steps < 100, f"ns_steps {self.ns_steps} must be in [1, 100)"),
            (len(self.ns_coefficients) == 3, f"ns_coefficients {self.ns_coefficients} must be 3 numbers"),
            (self.eps > 0, f"eps {self.eps} must be > 0"),
            (self.adjust_lr in ("original", "match_rms_adamw"), f"adjust_lr {self.adjust_lr!r} must be 'original' or 'match_rms_adamw'"),
            (self.ns_dtype in _NS_DTYPES, f"ns_dtype {self.ns_dtype!r} must be one of {sorted(_NS_DTYPES)}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def zeropower_via_newtonschulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalise each matrix of ``G``: ``U S' V^T`` where ``G = U S V^T`` and
    the diagonal ``S'`` lies roughly in 0.5..1.5 (Keller Jordan; about 0.68..1.16 for a Gaussian
    matrix with the default coefficients).

    ``G`` is a plain tensor ``[m, n]`` or a batch ``[..., m, n]`` (each matrix on its own), any
    float dtype. Each matrix is cast to ``dtype``, transposed when tall (m > n) so the Gram
    matrix is the small side, divided by its own Frobenius norm (floored at ``eps``), then
    iterated ``steps`` times ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, and transposed
    back. Returns a new tensor of ``G``'s shape in ``dtype`` (``G`` is not modified). With the
    default bf16 this is bitwise ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` per matrix.

    Raises:
        ValueError: ``G`` has fewer than 2 dims, or ``steps`` < 0.
    """
    if G.dim() < 2:
        raise ValueError(f"Newton-Schulz needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    if steps < 0:
        raise ValueError(f"steps {steps} must be >= 0")
    a, b, c = coefficients
    shape = G.shape
    X = G.to(dtype)
    if X.dim() > 3:
        X = X.reshape(-1, *shape[-2:])
    tall = shape[-2] > shape[-1]
    if tall:
        X = X.mT
    if X.dim() == 2:
        X = X / X.norm().clamp(min=eps)
        for _ in range(steps):
            A = X @ X.mT
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            A = X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.reshape(shape)


def adjust_lr(lr: float, shape: Sequence[int], mode: str = "original") -> float:
    """``lr`` scaled for one matrix of ``shape`` (``[out, in]`` or stacked ``[..., out, in]``:
    the last two dims are used, unlike torch.optim.Muon which reads the first two).

    "original": ``lr * sqrt(max(1, out / in))`` (Keller Jordan); "match_rms_adamw":
    ``lr * 0.2 * sqrt(max(out, in))`` (Moonlight, arXiv 2502.16982).

    Raises:
        ValueError: ``mode`` is neither, or ``shape`` has fewer than 2 dims.
    """
    if len(shape) < 2:
        raise ValueError(f"adjust_lr needs a matrix shape, got {tuple(shape)}")
    rows, cols = shape[-2], shape[-1]
    if mode == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr mode {mode!r} must be 'original' or 'match_rms_adamw'")


def is_muon_param(path: str, tensor: torch.Tensor, adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS) -> bool:
    """True when ``tensor`` is >= 2-D and no pattern of ``adamw_patterns`` matches ``path``
    (``mff.tree.matches`` syntax); 1-D (and 0-D) params always take AdamW."""
    return tensor.dim() >= 2 and not any(matches(p, path) for p in adamw_patterns)


def init(params: Mapping[str, torch.Tensor], adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS) -> dict:
    """Zero state for every param with ``requires_grad``: a momentum buffer for Muon params
    (:func:`is_muon_param`), AdamW moments for the rest, and ``step`` 0 (see the module doc)."""
    trained = {k: v for k, v in params.items() if v.requires_grad}
    muon = {k: v for k, v in trained.items() if is_muon_param(k, v, adamw_patterns)}
    other = {k: v for k, v in trained.items() if k not in muon}
    return {
        "step": torch.zeros((), dtype=torch.int64),
        "momentum_buffer": {k: _zeros_state(v) for k, v in muon.items()},
        "exp_avg": {k: _zeros_state(v) for k, v in other.items()},
        "exp_avg_sq": {k: _zeros_state(v) for k, v in other.items()},
    }


def _orthogonalise(u: torch.Tensor, hyper: MuonHyper) -> torch.Tensor:
    """:func:`zeropower_via_newtonschulz` of ``u``; a DTensor comes back with ``u``'s placements."""

    def ns(x: torch.Tensor) -> torch.Tensor:
        return zeropower_via_newtonschulz(x, hyper.ns_steps, hyper.ns_coefficients, hyper.eps, _NS_DTYPES[hyper.ns_dtype])

    if not isinstance(u, DTensor):
        return ns(u)
    nd = u.dim()
    local_ok = all(pl.is_replicate() or (pl.is_shard() and pl.dim % nd < nd - 2) for pl in u.placements)
    if local_ok:  # every local shard holds whole matrices
        return DTensor.from_local(ns(u.to_local()), u.device_mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride())
    # every rank holds the same full result: keep the local slice, no communication
    return distribute_tensor(ns(u.full_tensor()), u.device_mesh, u.placements, src_data_rank=None)


@torch.no_grad()
def update(
    params: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    state: dict,
    lr: float,
    *,
    hyper: MuonHyper = MuonHyper(),
    adamw_cfg: OptimConfig = OptimConfig(),
    adamw_lr: float | None = None,
) -> tuple[Mapping[str, torch.Tensor], dict]:
    """One Muon + AdamW step, in place on ``params`` and ``state``; returns them.

    ``grads`` has a tensor for every path in ``state["momentum_buffer"]`` and
    ``state["exp_avg"]`` (same shape and placements as the param; any float dtype). Muon params
    use ``lr`` (adjusted per :attr:`MuonHyper.adjust_lr`) and decay by
    ``adamw_cfg.weight_decay`` unless a ``adamw_cfg.no_decay`` pattern matches; AdamW params
    take :func:`mff.optim.adamw.update`'s step with ``adamw_lr`` (default ``lr``) and
    ``adamw_cfg``. A slot missing from ``state`` (a checkpoint drops empty slots) counts as empty.

    Raises:
        KeyError: a grad is missing (the first paths are named).
    """
    bufs = state.get("momentum_buffer", {})
    exp_avg, exp_avg_sq = state.get("exp_avg", {}), state.get("exp_avg_sq", {})
    missing = [k for k in (*bufs, *exp_avg) if k not in grads]
    if missing:
        raise KeyError(f"no gradient for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state["step"] += 1
    t = int(state["step"])

    keys = list(bufs)
    if keys:
        b = [bufs[k] for k in keys]
        g = [grads[k] if grads[k].dtype == bufs[k].dtype else grads[k].to(bufs[k].dtype) for k in keys]
        torch._foreach_lerp_(b, g, 1 - hyper.momentum)
        decayed = [params[k] for k in keys if decays(k, params[k], adamw_cfg.no_decay)]
        if decayed and adamw_cfg.weight_decay:
            torch._foreach_mul_(decayed, 1 - lr * adamw_cfg.weight_decay)
        for k, gk, bk in zip(keys, g, b):
            u = gk.lerp(bk, hyper.momentum) if hyper.nesterov else bk
            p = params[k]
            p.add_(_orthogonalise(u, hyper), alpha=-adjust_lr(lr, p.shape, hyper.adjust_lr))
    if exp_avg:
        # fp32 moments of a bf16/fp16 param take its grad in fp32 (foreach lerp needs one dtype)
        g_adamw = {k: grads[k] if grads[k].dtype == m.dtype else grads[k].to(m.dtype) for k, m in exp_avg.items()}
        _adamw_group(params, g_adamw, exp_avg, exp_avg_sq, list(exp_avg), t, lr if adamw_lr is None else adamw_lr, adamw_cfg)
    return params, state
