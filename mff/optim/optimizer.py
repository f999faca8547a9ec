"""The optimizer a run's :class:`~mff.optim.config.OptimConfig` names, as one pair of pure
functions: ``init_state(cfg, params)`` and ``apply_update(cfg, params, grads, state, lr)``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mff.optim import adamw, muon
from mff.optim.config import OptimConfig

__all__ = ["init_state", "apply_update", "muon_hyper"]


def muon_hyper(cfg: OptimConfig) -> muon.MuonHyper:
    """The Muon hyperparameters of ``cfg`` (``--optim.muon-*``)."""
    return muon.MuonHyper(momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, adjust_lr=cfg.muon_adjust_lr)


def init_state(cfg: OptimConfig, params: Mapping[str, torch.Tensor]) -> dict:
    """Zero optimizer state for the params with ``requires_grad``: AdamW's
    ``{step, exp_avg, exp_avg_sq}``, or Muon's, which adds ``momentum_buffer`` for its matrices.

    Raises:
        ValueError: an unknown ``cfg.name``.
    """
    if cfg.name == "adamw":
        return adamw.init(params)
    if cfg.name == "muon":
        return muon.init(params, cfg.muon_adamw_params)
    raise ValueError(f"--optim.name {cfg.name!r}; expected adamw or muon")


def apply_update(cfg: OptimConfig, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], state: dict, lr: float) -> None:
    """One optimizer step at learning rate ``lr``, in place on ``params`` and ``state``.

    Raises:
        KeyError: a param with state has no gradient.
        ValueError: an unknown ``cfg.name``.
    """
    if cfg.name == "adamw":
        adamw.update(params, grads, state, lr, cfg)
    elif cfg.name == "muon":
        muon.update(params, grads, state, lr, hyper=muon_hyper(cfg), adamw_cfg=cfg)
    else:
        raise ValueError(f"--optim.name {cfg.name!r}; expected adamw or muon")
