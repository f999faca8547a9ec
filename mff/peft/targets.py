"""Which weights of a model take LoRA adapters: target names and patterns -> weight paths."""

from __future__ import annotations

import difflib
import re

from mff.model import Model
from mff.nn.layers import Linear
from mff.nn.moe import Experts
from mff.tree import matches

__all__ = ["candidate_weights", "resolve_targets"]

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def candidate_weights(model: Model) -> list[str]:
    """Every weight that can take an adapter, in param order: the ``weight`` [F, D] of each
    linear layer (attention and MLP projections, shared experts, MTP's ``eh_proj``) and the
    stacked routed experts ``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I]. Not the
    embedding, the output head, norms or routers."""
    out = set()
    for name, module in model.skeleton.named_modules():
        if isinstance(module, Linear):
            out.add(f"{name}.weight")
        elif isinstance(module, Experts):
            out.update((f"{name}.gate_up_proj", f"{name}.down_proj"))
    return [p for p in model.param_shapes() if p in out]


def _main_layer(model: Model, path: str) -> bool:
    m = _LAYER.match(path)
    return m is not None and int(m.group(1)) < model.config.num_hidden_layers


def _owner_and_param(path: str) -> tuple[str, str]:
    owner, _, param = path.rpartition(".")
    return owner.rpartition(".")[2], param


def resolve_targets(model: Model, targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The weight paths ``targets`` select, in param order.

    Each entry is ``"all"`` (every candidate weight of the decoder layers; MTP layers are
    left out), a bare module or param name as PEFT takes them (``q_proj`` selects every
    ``*.q_proj.weight``; ``gate_up_proj`` the fused MLP weights and the stacked experts;
    ``experts`` both stacked expert weights), or a param path pattern (:mod:`mff.tree` syntax:
    ``**.self_attn.*.weight``); ``a|b|c`` selects what any of its alternatives selects (those that
    match nothing in this family are skipped: ``q_proj|q_a_proj`` fits GQA and MLA models alike).

    Raises:
        ValueError: an entry that selects nothing (the message lists the nearest param paths),
            or one that matches params which cannot take an adapter (norms, embeddings, routers:
            named).
    """
    cands = candidate_weights(model)
    every = list(model.param_shapes())
    chosen: set[str] = set()
    for entry in targets:
        entry = str(entry).strip()
        if "|" in entry:  # alternatives: every one that matches counts; at least one must
            hits = []
            for alt in entry.split("|"):
                try:
                    hits += resolve_targets(model, (alt,))
                except ValueError:
                    continue
            if not hits:
                near = difflib.get_close_matches(entry.split("|")[0], every, n=5, cutoff=0.0)
                raise ValueError(f"LoRA target {entry!r}: none of its alternatives matches a weight of this {model.family.name} model; "
                                 f"nearest param paths: {', '.join(near)}")
            chosen.update(hits)
            continue
        t = entry
        if not t:
            raise ValueError("a LoRA target is empty; give a module name (q_proj), a path pattern (**.q_proj.weight) or 'all'")
        if t == "all":
            hit = [p for p in cands if _main_layer(model, p)]
        elif "." not in t and "*" not in t:
            hit = [p for p in cands if t in _owner_and_param(p) or (t == "experts" and ".experts." in p)]
            if not hit:
                others = sorted({p for p in every if t in _owner_and_param(p)})
                if others:
                    raise ValueError(f"LoRA target {t!r} names {others[0]!r}, which is not a linear weight or stacked experts "
                                     "(LoRA adapts projections; not norms, embeddings, the head or routers)")
        else:
            try:
                hit = [p for p in cands if matches(t, p)]
                others = [p for p in every if matches(t, p) and p not in cands]
            except (re.error, ValueError) as e:
                raise ValueError(f"LoRA target {t!r} is not a valid path pattern: {e}") from None
            if others and not hit:
                raise ValueError(f"LoRA target {t!r} matches {others[0]!r}, which is not a linear weight or stacked experts "
                                 "(LoRA adapts projections; not norms, embeddings, the head or routers)")
        if not hit:
            near = difflib.get_close_matches(t, every, n=5, cutoff=0.0)
            raise ValueError(f"LoRA target {t!r} matches no weight of this {model.family.name} model; nearest param paths: "
                             f"{', '.join(near)} (a bare name like q_proj, a pattern like **.q_proj.weight, or 'all')")
        chosen.update(hit)
    return tuple(p for p in cands if p in chosen)
