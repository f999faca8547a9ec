"""One optimizer step over micro-batches: functional forward (in the run's precision),
``torch.autograd.grad`` over the param leaves, global-count loss normalisation, clipping, the
optimizer update (AdamW or Muon), and the expert-bias update.

Loss normalisation: every loss term is divided by its count over the whole step (all
micro-batches, all data-parallel ranks), computed before the first forward from the labels
(:meth:`mff.model.Model.count_targets`); so two micro-batches with 1 and 3 target tokens weigh
each token equally, not each micro-batch (torchtitan's rule, not a mean of means).

Aux-loss-free balancing (DeepSeek-V3 section 2.1.2): after the update, each MoE layer's
``e_score_correction_bias`` moves by ``rate * sign(mean(load) - load)``, with the load summed
over the step's micro-batches and the data-parallel ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mff.model import Model
from mff.nn.loss import count_targets
from mff.optim.clip import clip_grads_
from mff.optim.config import OptimConfig
from mff.optim.optimizer import apply_update
from mff.parallel.mesh import data_parallel_group
from mff.parallel.watchdog import collective
from mff.train.precision import compute_params, forward_params
from mff.tree import flatten_with_paths

__all__ = ["NonFiniteError", "StepStats", "check_finite", "global_counts", "train_step", "update_expert_bias", "eval_loss"]


class NonFiniteError(FloatingPointError):
    """A loss, grad norm or param is NaN or inf. Raised by :func:`train_step` before anything
    is updated, and by :func:`check_finite` before a checkpoint is written."""


@dataclass
class StepStats:
    """Results of one step: ``loss`` (sum of the weighted terms), ``losses`` per term, the grad
    norm before clipping, tokens processed over all ranks, and the summed expert loads."""

    loss: float
    losses: dict[str, float]
    grad_norm: float
    tokens: int
    expert_load: dict[str, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def check_finite(*trees: Mapping) -> None:
    """Raise NonFiniteError naming the first param or state tensor holding NaN or inf (checked
    before a checkpoint is written, so a saved checkpoint never holds them)."""
    bad = None
    for tree in trees:
        for path, t in flatten_with_paths(dict(tree)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                local = t.to_local() if isinstance(t, DTensor) else t
                if not bool(torch.isfinite(local).all()):
                    bad = path
                    break
        if bad:
            break
    # every rank must agree, or the others would wait in the checkpoint's collectives
    if _all_reduce_sum(torch.tensor(int(bad is not None)), "non-finite check before saving") > 0:
        raise NonFiniteError(f"{bad or 'a shard on another rank'} holds NaN or inf; not saving a checkpoint")


def _all_reduce_sum(t: torch.Tensor, what: str, group=None) -> torch.Tensor:
    """``t`` summed over the ranks of ``group`` (default: all), in place; a timeout names ``all_reduce (what)``."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        with collective(f"all_reduce ({what})"):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _dp_group(params: Mapping[str, torch.Tensor]):
    """The data-parallel group of the params' mesh: counts, losses and loads are summed over
    the ranks that read different tokens, not over tensor-parallel copies of the same ones."""
    mesh = next((p.device_mesh for p in params.values() if isinstance(p, DTensor)), None)
    return data_parallel_group(mesh)


def global_counts(model: Model, micro_batches: Sequence[Mapping[str, torch.Tensor]], group=None) -> dict[str, torch.Tensor]:
    """Loss-term counts summed over ``micro_batches`` and the ranks of ``group`` (default: all;
    the step passes the data-parallel group) as int64 0-d CPU tensors."""
    total: dict[str, torch.Tensor] = {}
    for mb in micro_batches:
        for k, v in model.count_targets(mb).items():
            total[k] = total.get(k, 0) + v.cpu()
    if not total:
        return {}
    keys = sorted(total)
    stacked = _all_reduce_sum(torch.stack([total[k] for k in keys]), "target token counts", group)
    return dict(zip(keys, stacked.unbind()))


@torch.no_grad()
def update_expert_bias(params: Mapping[str, torch.Tensor], loads: Mapping[str, torch.Tensor], rate: float) -> None:
    """``bias += rate * sign(mean(load) - load)`` for each MoE layer with an expert bias.

    ``loads``: MoE layer path -> token counts [E] (already summed over ranks). The bias is at
    ``<layer>.gate.e_score_correction_bias`` (fp32, replicated); layers without one are skipped.
    """
    if rate == 0:
        return
    for layer, load in loads.items():
        bias = params.get(f"{layer}.gate.e_score_correction_bias")
        if bias is None:
            continue
        local = bias.to_local() if isinstance(bias, DTensor) else bias
        load = load.to(device=local.device, dtype=torch.float32)
        local.add_(rate * torch.sign(load.mean() - load))


def train_step(
    model: Model,
    params: dict[str, torch.Tensor],
    opt_state: dict,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    lr: float,
    optim: OptimConfig,
    bias_update_rate: float = 0.0,
    precision: str = "fp32",
) -> StepStats:
    """Forward/backward over ``micro_batches``, then clip, the optimizer and the expert-bias update.

    Each micro-batch dict is a model batch (see :meth:`mff.model.Model.forward`) with labels.
    ``params`` and ``opt_state`` are updated in place. ``precision`` (see
    :mod:`mff.train.precision`): ``bf16-mixed`` computes each forward with a bf16 cast of the
    fp32 params; the grads, clipping and update stay fp32. The forward skips the logits (the
    loss is computed chunk by chunk from the hidden states).

    Raises:
        NonFiniteError: a non-finite loss or grad norm (checked before anything is updated).
        AssertionError: a gradient whose placements differ from its param's.
    """
    group = _dp_group(params)
    counts = global_counts(model, micro_batches, group)
    names = [k for k, v in params.items() if v.requires_grad]
    leaves = [params[k] for k in names]
    grads: list[torch.Tensor] | None = None
    terms: dict[str, torch.Tensor] = {}
    loads: dict[str, torch.Tensor] = {}
    tokens = 0
    for i, mb in enumerate(micro_batches):
        # the forward/backward's DTensor redistributions are collectives too
        with collective(f"forward/backward of micro-batch {i + 1}/{len(micro_batches)}"):
            with forward_params(model, params, precision) as compute:
                out = model.forward(compute, mb, target_counts=counts, logits=False)
            del compute
            g = torch.autograd.grad(out.loss, leaves)
        if grads is None:
            grads = list(g)
        else:
            torch._foreach_add_(grads, list(g))
        for k, v in out.losses.items():
            terms[k] = terms.get(k, 0) + v.detach().float().cpu()
        for k, v in out.expert_load.items():
            loads[k] = loads.get(k, 0) + v.cpu()
        tokens += mb["input_ids"].numel()
    assert grads is not None, "train_step needs at least one micro-batch"
    for name, p, g in zip(names, leaves, grads):
        if isinstance(p, DTensor):
            assert isinstance(g, DTensor) and g.placements == p.placements, f"grad of {name}: {getattr(g, 'placements', None)} != {p.placements}"

    keys = sorted(terms)
    reduced = _all_reduce_sum(torch.stack([terms[k] for k in keys]), "loss terms", group) if keys else torch.zeros(0)
    losses = {k: float(v) for k, v in zip(keys, reduced)}
    loss = sum(losses.values())
    grad_map = dict(zip(names, grads))
    with collective("grad norm and clipping"):
        norm = clip_grads_(grad_map, optim.max_grad_norm)
    if not math.isfinite(loss) or not math.isfinite(norm):
        raise NonFiniteError(f"non-finite {'loss' if not math.isfinite(loss) else 'grad norm'}: loss={loss}, grad_norm={norm} ({losses})")
    with collective("optimizer update"):
        apply_update(optim, params, grad_map, opt_state, lr)
    for k in sorted(loads):
        loads[k] = _all_reduce_sum(loads[k], f"expert loads of {k}", group)
    update_expert_bias(params, loads, bias_update_rate)
    tokens_t = _all_reduce_sum(torch.tensor(tokens), "token count", group)
    return StepStats(loss=loss, losses=losses, grad_norm=norm, tokens=int(tokens_t), expert_load=loads)


@torch.no_grad()
def eval_loss(model: Model, params: Mapping[str, torch.Tensor], batches: Sequence[Mapping[str, torch.Tensor]],
              precision: str = "fp32") -> float:
    """Mean LM loss per target token over ``batches`` and all ranks (sum of token losses over
    their count; the main head only, no MTP or balance terms), computed in ``precision``."""
    total = torch.zeros(2, dtype=torch.float64)
    compute = compute_params(model, params, precision)
    for b in batches:
        n = count_targets(b["labels"])
        with collective("validation forward"):
            out = model.forward(compute, b, target_counts={k: n for k in model.count_targets(b)}, logits=False)
        total[0] += float(out.losses["lm"]) * float(n)
        total[1] += float(n)
    total = _all_reduce_sum(total, "validation loss", _dp_group(params))
    return float(total[0] / total[1].clamp(min=1))
