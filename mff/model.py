"""The model object: a family's config and meta skeleton, with pure ``init`` and ``forward``.

``model.init(seed, device, dtype, mesh) -> params`` makes the param pytree (a flat
``dict[path, Tensor]``, DTensors on ``mesh`` when one is given); ``model.forward(params,
batch) -> Output`` runs the skeleton through ``torch.func.functional_call`` (every param path required, none extra).
Nothing is stored on the model between calls: routing statistics come out in the Output and
the step function applies the expert-bias update.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.utils.stateless import _reparametrize_module

from mff.backend import available_memory_gib
from mff.nn.blocks import BlockExecution
from mff.nn.lora import adapter_path, attach_lora, skeleton_path
from mff.parallel.sharding import DEFAULT_AXIS_MAP, AxisMap, ShardingTable, shard_params
from mff.tree import first_match, matches

__all__ = ["Output", "Family", "Model", "LoRASpec", "BATCH_KEYS", "path_seed", "is_adapter_path", "estimate_param_count",
           "check_model_fits"]

BATCH_KEYS = ("input_ids", "labels", "position_ids", "document_ids", "attention_mask")

InitSpec = tuple  # ("normal", std) | ("ones",) | ("zeros",)


@dataclass
class Output:
    """What ``forward`` returns.

    - ``logits``: [B, T, V] in the compute dtype; None when ``forward(..., logits=False)`` was
      asked for the losses only (training: the loss then never materialises the logits). Under
      tensor parallelism every tp rank gets the full V (all-gathered from the vocab-parallel
      head: for evaluation and generation; the losses never gather them).
    - ``losses``: named terms, each already weighted (``lm``, ``balance``, ``mtp``), present
      when labels are given; their sum is the training loss.
    - ``expert_load``: MoE layer path -> int64 [E] token slots routed to each expert.
    - ``cache``: the updated KV cache when one was passed (generation).
    """

    logits: torch.Tensor | None
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    expert_load: dict[str, torch.Tensor] = field(default_factory=dict)
    cache: Any = None

    @property
    def loss(self) -> torch.Tensor:
        """The sum of all loss terms (0-d). Raises KeyError when no labels were given."""
        if not self.losses:
            raise KeyError("no losses: pass labels in the batch")
        return sum(self.losses.values())


@dataclass(frozen=True)
class Family:
    """What a model file exports (see DESIGN.md, "A model family")."""

    name: str
    config_cls: type
    sizes: Mapping[str, Any]
    default_size: str
    skeleton: Callable[[Any], nn.Module]
    init_table: Callable[[Any], Sequence[tuple[str, InitSpec]]]
    sharding_table: ShardingTable | Callable[[Any], ShardingTable]
    count_targets: Callable[[Any, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    param_counts: Callable[[Any, Mapping[str, torch.Size]], dict[str, int]]
    train_flops_per_token: Callable[[Any, Mapping[str, torch.Size], int], float]
    fp32_params: tuple[str, ...] = ()
    frozen_params: tuple[str, ...] = ()
    hf_model_types: tuple[str, ...] = ()
    from_hf_config: Callable[[dict], Any] | None = None
    to_hf_config: Callable[[Any], dict] | None = None
    description: str = ""


@dataclass(frozen=True)
class LoRASpec:
    """Which weights carry LoRA adapters and how they compute (see :mod:`mff.nn.lora`).

    Attributes:
        targets: the adapted weights' param paths (2-D ``[F, D]`` linear weights or stacked
            experts ``[E, F, D]``).
        r: the rank.
        alpha: the scale numerator: ``s = alpha / r``, or ``alpha / sqrt(r)`` with ``rslora``.
        dropout: dropout probability on the low-rank path's input (training only).
        overrides: ``(target, r, alpha)`` for targets with their own rank and alpha (PEFT's
            ``rank_pattern`` / ``alpha_pattern``).
    """

    targets: tuple[str, ...]
    r: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False
    overrides: tuple[tuple[str, int, float], ...] = ()

    @property
    def scale(self) -> float:
        """``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA), of the targets without an override."""
        return self.alpha / (self.r ** 0.5 if self.rslora else self.r)

    def rank_of(self, target: str) -> int:
        """The rank of ``target``'s adapter."""
        return next((r for p, r, _ in self.overrides if p == target), self.r)

    def scale_of(self, target: str) -> float:
        """The scale of ``target``'s adapter (its override's alpha over its rank, if it has one)."""
        for p, r, a in self.overrides:
            if p == target:
                return a / (r ** 0.5 if self.rslora else r)
        return self.scale


def is_adapter_path(path: str) -> bool:
    """True for ``<weight path>.lora_A`` / ``.lora_B``."""
    return path.endswith(".lora_A") or path.endswith(".lora_B")


def path_seed(seed: int, path: str) -> int:
    """A 63-bit seed for one param, from sha256 of ``"{seed}:{path}"`` (stable across runs,
    platforms and world sizes; independent of the order params are made in)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "big") >> 1


def _fill(shape: torch.Size, spec: InitSpec, gen: torch.Generator) -> torch.Tensor:
    kind = spec[0]
    if kind == "normal":
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, float(spec[1]), generator=gen)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.float32)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch.float32)
    raise ValueError(f"unknown init {spec!r}")


class Model:
    """A family + config + meta skeleton, exposing pure functions over param pytrees."""

    def __init__(self, family: Family, config: Any, execution: BlockExecution | None = None, lora: LoRASpec | None = None):
        if not isinstance(config, family.config_cls):
            raise TypeError(f"{family.name} needs a {family.config_cls.__name__}, got {type(config).__name__}")
        if hasattr(config, "validate"):
            config.validate()
        self.family = family
        self.config = config
        with torch.device("meta"):
            self.skeleton = family.skeleton(config)
        self.execution = execution or BlockExecution()
        self.skeleton.execution = self.execution
        # a skeleton written without the option (research code) always returns its logits
        self._takes_return_logits = "return_logits" in inspect.signature(self.skeleton.forward).parameters
        self._shapes = {name: p.shape for name, p in self.skeleton.named_parameters()}
        if list(self.skeleton.buffers()):
            raise AssertionError(f"{family.name} skeleton holds buffers; skeletons must be buffer-free")
        self.lora = lora
        self._adapter_shapes: dict[str, torch.Size] = {}
        self._adapter_names: dict[str, str] = {}  # adapter path -> skeleton param name
        if lora is not None:
            self._attach(lora)
        named = list(self.skeleton.named_parameters(remove_duplicate=False))  # adapter slots included
        self._tied = len({id(p) for _, p in named}) != len(named)  # one Parameter under two names
        self._param_names = frozenset(n for n, _ in named)
        self._bound = False  # inside a bind block (bind blocks do not nest)

    def _attach(self, lora: LoRASpec) -> None:
        if lora.r < 1:
            raise ValueError(f"LoRA rank r={lora.r} must be >= 1")
        if not lora.alpha > 0:
            raise ValueError(f"LoRA alpha={lora.alpha} must be > 0")
        if not 0 <= lora.dropout < 1:
            raise ValueError(f"LoRA dropout={lora.dropout} must be in [0, 1)")
        slots = {}
        for path in lora.targets:
            shape = self._shapes.get(path)
            if shape is None:
                raise ValueError(f"LoRA target {path!r} is not a param of {self.family.name}")
            r = lora.rank_of(path)
            if len(shape) == 2:
                a, b = (r, shape[1]), (shape[0], r)
            elif len(shape) == 3:
                a, b = (shape[0], r, shape[2]), (shape[0], shape[1], r)
            else:
                raise ValueError(f"LoRA target {path!r} has shape {tuple(shape)}; only 2-D weights and 3-D stacked experts take adapters")
            slots[path] = (a, b, lora.scale_of(path))
            for which, shp in (("A", a), ("B", b)):
                name = adapter_path(path, which)
                self._adapter_shapes[name] = torch.Size(shp)
                self._adapter_names[name] = skeleton_path(name)
        attach_lora(self.skeleton, slots, lora.dropout)

    def __repr__(self) -> str:
        extra = f", lora r={self.lora.r} on {len(self.lora.targets)} weights" if self.lora is not None else ""
        return f"Model({self.family.name}, {self.config}{extra})"

    def with_lora(self, lora: LoRASpec | None) -> Model:
        """The same model whose ``lora.targets`` weights carry LoRA adapters (None: none). A new
        skeleton is built (meta device); the base params and their numerics are unchanged.
        ``forward`` then needs the adapters (:meth:`adapter_shapes`) beside the base params.

        Raises:
            ValueError: a target that is not a 2-D or 3-D param; r < 1, alpha <= 0, dropout
                outside [0, 1).
        """
        return Model(self.family, self.config, self.execution, lora)

    def adapter_shapes(self) -> dict[str, torch.Size]:
        """``{adapter path: shape}`` of the LoRA factors (empty without LoRA): for a target
        ``[F, D]`` weight ``W``, ``W.lora_A`` [r, D] and ``W.lora_B`` [F, r]; for stacked experts
        ``[E, F, D]``, [E, r, D] and [E, F, r]."""
        return dict(self._adapter_shapes)

    def with_execution(self, ac: str = "none", compile: bool = False) -> Model:
        """The same model with its blocks run under activation checkpointing (``ac``: none,
        full or selective) and/or ``torch.compile`` (see :mod:`mff.nn.blocks`). Params and
        numerics are unchanged; a new skeleton is built (on the meta device, no storage).

        Raises:
            ValueError: an unknown ``ac`` mode.
            TypeError: ``compile`` is not a bool.
        """
        return Model(self.family, self.config, BlockExecution(ac=ac, compile=compile), self.lora)

    # ---- structure -------------------------------------------------------------------
    def param_shapes(self) -> dict[str, torch.Size]:
        """``{path: shape}`` of every param, in the skeleton's order."""
        return dict(self._shapes)

    @property
    def sharding_table(self) -> ShardingTable:
        """The family's sharding table for this config (a family may make it from the config,
        e.g. to name the head width its ``heads`` dims split by)."""
        table = self.family.sharding_table
        return table(self.config) if callable(table) else table

    def is_trainable(self, path: str) -> bool:
        """False for params updated outside the optimizer (the MoE expert bias)."""
        return not any(matches(p, path) for p in self.family.frozen_params)

    def is_block_param(self, path: str) -> bool:
        """True for params of the main decoder layers (``model.layers.{i}.`` with i below
        ``num_hidden_layers``; LoRA adapter paths of those layers too): the ones a block uses only
        inside its own run (:func:`mff.nn.blocks.run_block`). MTP depths' layers are not: their
        input projection and head norm run outside the block."""
        if not path.startswith("model.layers."):
            return False
        index = path.split(".", 3)[2]
        return index.isdigit() and int(index) < int(self.config.num_hidden_layers)

    def is_fp32(self, path: str) -> bool:
        """True for params kept in fp32 whatever the model dtype (router weight and bias)."""
        return any(matches(p, path) for p in self.family.fp32_params)

    def param_counts(self) -> dict[str, int]:
        """Param counts: ``total``, ``activated`` (per token), each also ``_no_mtp``; see the family."""
        return self.family.param_counts(self.config, self.param_shapes())

    def train_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_len``, for MFU."""
        return self.family.train_flops_per_token(self.config, self.param_shapes(), seq_len)

    # ---- params ----------------------------------------------------------------------
    def init(
        self,
        seed: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        mesh: DeviceMesh | None = None,
        axis_map: AxisMap = DEFAULT_AXIS_MAP,
        keys: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fresh params from the family's init table, deterministic per (seed, path).

        Each param is drawn on the CPU in fp32 from its own generator (:func:`path_seed`), then
        cast to ``dtype`` (fp32 params stay fp32) and moved to ``device``. With ``mesh`` every
        leaf becomes a DTensor placed by the family's sharding table. Trainable leaves have
        ``requires_grad=True``. ``keys``: only these paths (a pipeline stage's), each drawn as
        in the whole model.

        Raises:
            ValueError: a param no init-table row matches; sharding errors (see
                :func:`mff.parallel.sharding.resolve_placements`).
        """
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        table = self.family.init_table(self.config)
        params = {}
        shapes = self.param_shapes()
        if keys is not None:
            unknown = sorted(set(keys) - set(shapes))
            if unknown:
                raise ValueError(f"{self.family.name} has no params {unknown[:3]}")
            shapes = {k: shapes[k] for k in keys}
        for path, shape in shapes.items():
            hit = first_match(path, table)
            if hit is None:
                raise ValueError(f"param {path!r}: no row of {self.family.name}'s init table matches it")
            gen = torch.Generator().manual_seed(path_seed(seed, path))
            t = _fill(shape, hit[1], gen)
            t = t.to(device=device, dtype=torch.float32 if self.is_fp32(path) else dtype)
            params[path] = t.requires_grad_(self.is_trainable(path))
        if mesh is not None:
            params = shard_params(params, self.sharding_table, mesh, axis_map)
        return params

    def cast(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Params cast to ``dtype`` except the fp32 ones (router weight, expert bias)."""
        out = {}
        for path, t in params.items():
            target = torch.float32 if self.is_fp32(path) else dtype
            out[path] = t if t.dtype == target else t.detach().to(target).requires_grad_(t.requires_grad)
        return out

    # ---- compute ---------------------------------------------------------------------
    def _check_inputs(self, params, batch, target_counts) -> None:
        def desc(v: Any) -> str:
            return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__

        if not isinstance(batch, Mapping):
            raise TypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if unknown:
            raise ValueError(f"unknown batch keys {unknown}; expected a subset of {list(BATCH_KEYS)}")
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2:
            raise ValueError(f"batch['input_ids'] must be a torch int64 tensor [B, T], got {desc(ids)}")
        if ids.numel() == 0:
            raise ValueError(f"batch['input_ids'] is empty: shape {tuple(ids.shape)}")
        for key in BATCH_KEYS[1:]:
            v = batch.get(key)
            ok_dtypes = (torch.int64, torch.int32, torch.bool) if key == "attention_mask" else (torch.int64, torch.int32)
            if v is not None and (not isinstance(v, torch.Tensor) or v.dtype not in ok_dtypes or v.shape != ids.shape):
                raise ValueError(f"batch[{key!r}] must be an integer tensor shaped like input_ids {tuple(ids.shape)}, got {desc(v)}")
        pos = batch.get("position_ids")
        lo_hi = [ids.min(), ids.max()] + ([pos.min(), pos.max()] if pos is not None else [])
        bounds = torch.stack(lo_hi).tolist()  # one host sync for all range checks
        vocab = self.config.vocab_size
        if bounds[0] < 0 or bounds[1] >= vocab:
            bad = bounds[0] if bounds[0] < 0 else bounds[1]
            raise ValueError(f"batch['input_ids'] holds token id {bad}, outside the vocabulary [0, {vocab})")
        if pos is not None and (bounds[2] < 0 or bounds[3] >= self.config.max_position_embeddings):
            bad = bounds[2] if bounds[2] < 0 else bounds[3]
            raise ValueError(f"batch['position_ids'] holds position {bad}, outside [0, max_position_embeddings={self.config.max_position_embeddings})")
        for path, shape in (*self._shapes.items(), *self._adapter_shapes.items()):
            p = params.get(path)
            if p is not None and tuple(p.shape) != tuple(shape):
                raise ValueError(f"param {path!r} has shape {tuple(p.shape)}, the model expects {tuple(shape)}")
        if target_counts is not None and "labels" in batch:
            missing = sorted(set(self.count_targets(batch)) - set(target_counts))
            if missing:
                raise ValueError(f"target_counts lacks {missing} (from model.count_targets over the step's batches)")

    # ---- pipeline stages -------------------------------------------------------------
    def stage_keys(self, layers: range, first: bool, last: bool) -> list[str]:
        """The param paths a pipeline stage computes with: the decoder layers ``layers``
        (``model.layers.{i}.*``), with ``first`` the token embedding, with ``last`` the final
        norm, the head and the MTP depths (``model.layers.{i}.*`` for i >= num_hidden_layers),
        plus the token embedding when the last stage needs it too (a head tied to it, or MTP,
        which embeds the shifted tokens): see :meth:`shared_keys`."""
        cache = self.__dict__.setdefault("_stage_keys", {})
        if (layers, first, last) in cache:
            return list(cache[layers, first, last])
        L = self.config.num_hidden_layers
        shared = set(self.shared_keys())
        out = []
        for path in self._shapes:
            parts = path.split(".")
            if parts[:2] == ["model", "layers"]:
                i = int(parts[2])
                keep = i in layers if i < L else last
            elif parts[:2] == ["model", "embed_tokens"]:
                keep = first or (last and path in shared)
            else:
                keep = last
            if keep:
                out.append(path)
        cache[layers, first, last] = tuple(out)
        return out

    def mtp_layers(self) -> list[int]:
        """Layer indices of the MTP depths the skeleton holds (``model.layers.{i}`` with i >=
        num_hidden_layers; empty for families without MTP or with it off)."""
        L = self.config.num_hidden_layers
        return sorted({int(p.split(".")[2]) for p in self._shapes if p.startswith("model.layers.") and int(p.split(".")[2]) >= L})

    def shared_keys(self) -> list[str]:
        """Params both the first and the last pipeline stage use: the token embedding when the
        head is tied to it or the model has MTP depths (Megatron's "shared embedding" under
        pipeline parallelism: each stage keeps a copy, their gradients are summed, and the
        first stage's copy is the one saved)."""
        if not (getattr(self.config, "tie_word_embeddings", False) or self.mtp_layers()):
            return []
        return [p for p in self._shapes if p.startswith("model.embed_tokens.")]

    def stage_forward(self, params: Mapping[str, torch.Tensor], carry: tuple[torch.Tensor, ...], layers: range, first: bool, last: bool,
                      batch: Mapping[str, torch.Tensor], target_counts: Mapping[str, torch.Tensor] | None = None):
        """One pipeline stage of :meth:`forward` with the stage's params (exactly
        :meth:`stage_keys`): the skeleton's ``pipeline_stage`` on ``carry`` (the previous
        stage's output; empty for the first stage). Returns ``(carry for the next stage, or the
        weighted loss terms {name: 0-d} for the last; expert loads {MoE layer path: [E]})``.

        ``batch`` as for :meth:`forward` (``labels`` required; every stage gets the whole batch:
        positions and masks are recomputed per stage, the last stage reads the labels).

        Raises:
            ValueError: params that are not the stage's (missing or extra paths named); a skeleton
                without ``pipeline_stage``; LoRA adapters (pipeline stages take base params only).
        """
        if self._adapter_names:
            raise ValueError("pipeline stages do not take LoRA adapters (fine-tuning under pipeline parallelism is not supported)")
        if not hasattr(self.skeleton, "pipeline_stage"):
            raise ValueError(f"the {self.family.name} skeleton has no pipeline_stage: it cannot run under pipeline parallelism")
        want = self.stage_keys(layers, first, last)
        if set(params) != set(want):
            missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
            raise ValueError(f"stage params differ from the stage's paths: missing {missing[:3]}, extra {extra[:3]}")
        with _reparametrize_module(self.skeleton, dict(params), strict=False):
            return self.skeleton.pipeline_stage(carry, layers, first, last, **dict(batch), target_counts=target_counts)

    def count_targets(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-loss-term counts of this batch (``lm`` targets, ``mtp.k`` targets, ``balance``
        rows), int64 0-d tensors. Summed over micro-batches and ranks they are the
        ``target_counts`` that make losses normalise by the global count."""
        return self.family.count_targets(self.config, batch)

    def init_cache(self, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> dict[str, Any]:
        """An empty KV cache for generation, preallocated to ``max_len`` slots.

        A pytree: ``{"offset": int (slots filled, shared by all rows; a host counter for the
        capacity check), "pos": int64 0-d (the same, as a tensor: what the compute uses),
        "valid": bool [B, S] (slots holding real tokens; left padding and unfilled slots are
        not), "next_pos": int64 [B] (each row's next position id), "layers": [per-layer
        tensors]}``. GQA layers hold ``k``/``v`` [B, S, Hkv,
        Dh]; MLA layers the latent ``c`` [B, S, kv_lora_rank] and ``k_rot`` [B, S,
        qk_rope_head_dim] only. ``forward(params, batch, cache)`` writes the new slots in place
        and returns the cache to pass to the next call in ``Output.cache``.

        Raises:
            ValueError: ``max_len`` outside [1, max_position_embeddings], ``batch_size`` < 1.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        limit = self.config.max_position_embeddings
        if not 1 <= max_len <= limit:
            raise ValueError(f"cache length {max_len} must be in [1, max_position_embeddings={limit}]")
        layers = [{k: torch.zeros(shape, dtype=dtype, device=device) for k, shape in shapes.items()}
                  for shapes in self.skeleton.cache_shapes(batch_size, max_len)]
        return {"offset": 0, "pos": torch.zeros((), dtype=torch.int64, device=device),
                "valid": torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
                "next_pos": torch.zeros(batch_size, dtype=torch.int64, device=device), "layers": layers}

    def init_paged_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> dict[str, Any]:
        """An empty paged KV cache (:mod:`mff.nn.paged`): ``{"layers": [per layer {name: pool
        [num_blocks, block_size, ...]}]}`` (GQA ``k``/``v`` [.., Hkv, Dh], MLA ``c`` [.., C] and
        ``k_rot`` [.., R]). A forward over it adds ``"paged"``: the step's
        :class:`mff.nn.paged.PagedBatch` (the serving engine, :mod:`mff.serve.engine`, builds it).

        Raises:
            ValueError: ``num_blocks`` < 2 or ``block_size`` < 1.
        """
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 and block_size={block_size} >= 1")
        layers = [{k: torch.zeros(shape, dtype=dtype, device=device) for k, shape in shapes.items()}
                  for shapes in self.skeleton.cache_shapes(num_blocks, block_size)]
        return {"layers": layers}

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of KV cache one token takes over all layers (GQA: 2 x Hkv x Dh per layer; MLA:
        kv_lora_rank + qk_rope_head_dim per layer)."""
        per = sum(math.prod(shape[2:]) for shapes in self.skeleton.cache_shapes(1, 1) for shape in shapes.values())
        return per * torch.empty((), dtype=dtype).element_size()

    def generate(self, params: Mapping[str, torch.Tensor], input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Token ids [B, T + n] continuing ``input_ids``; see :func:`mff.generate.generate` for the options."""
        from mff.generate import generate

        return generate(self, params, input_ids, **kwargs)

    def forward(
        self,
        params: Mapping[str, torch.Tensor],
        batch: Mapping[str, torch.Tensor],
        cache: Any = None,
        *,
        target_counts: Mapping[str, torch.Tensor] | None = None,
        check: bool = True,
        logits: bool | str | torch.Tensor = True,
    ) -> Output:
        """Run the model on ``batch`` with ``params``.

        Args:
            params: every param path of the model (missing or extra paths raise); with LoRA
                (:meth:`with_lora`) also every adapter path (``<weight>.lora_A`` / ``.lora_B``).
            batch: ``input_ids`` int64 [B, T]; optional ``labels`` int64 [B, T] (aligned:
                target of position t, -100 ignored), ``position_ids`` int64 [B, T],
                ``document_ids`` int [B, T] (attention and MTP targets stay within a document),
                ``attention_mask`` bool/int [B, T] (0 = padding: never attended to; positions
                count real tokens only, so left-padded rows match unpadded ones).
            cache: a KV cache from :meth:`init_cache` (generation); the new tokens are appended
                after its filled slots and ``Output.cache`` is the cache to pass next. Or a paged
                cache (:meth:`init_paged_cache` plus the step's ``"paged"`` layout): ``input_ids``
                [1, N] then packs the new tokens of several sequences (the serving engine).
            target_counts: denominators of the loss terms (from :meth:`count_targets`, summed
                over a step's micro-batches and ranks); default: this batch's own counts, so
                each term is a mean over this batch.
            check: validate the inputs (one host sync for the id and position ranges); the
                decode loop turns it off after checking the prompt.
            logits: False skips ``Output.logits`` when labels are given (None then): the loss
                terms are computed chunk by chunk from the hidden states
                (:func:`mff.nn.loss.linear_cross_entropy_sum`), so no [B, T, V] tensor exists.
                ``"last"``: ``Output.logits`` is the last position's only, [B, 1, V] (a prefill).
                An int64 [K] tensor of positions: those positions' logits only, [B, K, V] (the
                ends of the sequences packed in a paged batch).
        Returns:
            :class:`Output`.
        Raises:
            TypeError: ``batch`` is not a dict of tensors.
            ValueError: unknown batch keys; ``input_ids`` not int64 [B, T] or empty; other
                batch tensors not integer [B, T]; token ids outside [0, vocab_size); positions
                outside [0, max_position_embeddings); a param of the wrong shape (named);
                ``target_counts`` lacking a term of this batch; a full cache.
            RuntimeError: missing or unexpected param paths (named).
        """
        if check:
            self._check_inputs(params, batch, target_counts)
        params = self._skeleton_params(params)
        return self._call_skeleton(params, self._skeleton_kwargs(batch, cache, target_counts, logits))

    def _skeleton_kwargs(self, batch: Mapping[str, torch.Tensor], cache: Any, target_counts: Any,
                         logits: bool | str | torch.Tensor) -> dict[str, Any]:
        if isinstance(logits, torch.Tensor):
            if logits.dtype != torch.int64 or logits.dim() != 1:
                raise ValueError(f"logits positions must be an int64 [K] tensor, got {logits.dtype} {tuple(logits.shape)}")
        elif logits not in (True, False, "last"):
            raise ValueError(f"logits={logits!r}; expected True, False, 'last' or an int64 [K] tensor of positions")
        kwargs = dict(batch)
        kwargs["target_counts"] = target_counts
        if self._takes_return_logits:
            kwargs["return_logits"] = logits
        if cache is not None:
            kwargs["cache"] = cache
        return kwargs

    def _check_param_names(self, params: Mapping[str, torch.Tensor]) -> None:
        names = self._param_names
        if params.keys() != names:
            missing, unexpected = sorted(names - params.keys()), sorted(params.keys() - names)
            raise RuntimeError(f"params do not match the model's param paths: {len(missing)} missing {missing[:3]}, "
                               f"{len(unexpected)} unexpected {unexpected[:3]}")

    def _call_skeleton(self, params: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> Any:
        """``torch.func.functional_call(self.skeleton, params, kwargs=kwargs)`` with the params
        checked against the skeleton's param names (listed in ``__init__``; the skeleton is fixed
        after construction). Without tied params (one Parameter under two names) the call skips
        ``strict`` and ``tie_weights``, whose module walks cost about 0.45 ms per call on the
        benchmark configs (6% of an eager decode step); with them it is the strict call."""
        if self._tied:
            return torch.func.functional_call(self.skeleton, params, args=(), kwargs=kwargs, strict=True)
        self._check_param_names(params)
        return torch.func.functional_call(self.skeleton, params, args=(), kwargs=kwargs, strict=False, tie_weights=False)

    @contextlib.contextmanager
    def bind(self, params: Mapping[str, torch.Tensor]) -> Iterator[Callable[..., Output]]:
        """Bind ``params`` to the skeleton for a block of calls; yields ``forward(batch, cache=None,
        *, target_counts=None, logits=True) -> Output``, :meth:`forward` without its ``params``
        and its input checks (``check=False``).

        :meth:`forward` swaps the params into the skeleton and back on every call
        (``torch.func.functional_call``); a decode loop calls it once per token, and the two swaps
        of a few hundred tensors cost about 5% of an eager batch-1 decode step on the benchmark
        configs. Here they are swapped in once on entry and restored on exit (also on an
        exception), with the same path checks as :meth:`forward` (shapes are not checked). The
        tensors are read once, on entry: replacing a tensor in ``params`` inside the block has no
        effect (changing one in place does). Calls of :meth:`forward` inside the block, with these
        or other params, work as usual (they swap theirs in and restore these). Blocks do not
        nest or overlap on one model (see :attr:`is_bound`), and the skeleton is shared: no other
        thread may run this model inside the block.

        Raises:
            ValueError / RuntimeError: as :meth:`forward` for missing, extra or stray adapter paths.
            RuntimeError: the model is already inside a bind block; the yielded ``forward``
                called after its block has ended.
        """
        if self._bound:
            raise RuntimeError("this model is already inside a bind block: bind blocks do not nest or overlap "
                               "(they would mix params); call model.forward(params, ...) inside it instead")
        params = self._skeleton_params(params)
        if not self._tied:
            self._check_param_names(params)
        live = [True]

        def forward(batch: Mapping[str, torch.Tensor], cache: Any = None, *, target_counts: Any = None,
                    logits: bool | str | torch.Tensor = True) -> Output:
            if not live[0]:
                raise RuntimeError("this forward came from a Model.bind block that has ended; its params are no longer "
                                   "bound (call it inside the with block, or use model.forward(params, ...))")
            return self.skeleton(**self._skeleton_kwargs(batch, cache, target_counts, logits))

        with _reparametrize_module(self.skeleton, params, tie_weights=self._tied, strict=self._tied):
            self._bound = True
            try:
                yield forward
            finally:
                self._bound = False
                live[0] = False

    @property
    def is_bound(self) -> bool:
        """True inside a :meth:`bind` block of this model (where another ``bind`` raises)."""
        return self._bound

    def _skeleton_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` keyed as the skeleton names them: adapter paths become their slots'
        names. Raises ValueError for adapters the model has no slot for, or missing ones."""
        if not self._adapter_names:
            stray = [k for k in params if is_adapter_path(k)]
            if stray:
                raise ValueError(f"params hold LoRA adapters ({stray[0]!r}, ...) but the model has none: "
                                 "build it with model.with_lora(spec) (mff.peft)")
            return dict(params)
        out = {}
        found = 0
        for k, v in params.items():
            name = self._adapter_names.get(k)
            if name is not None:
                out[name] = v
                found += 1
            elif is_adapter_path(k):
                raise ValueError(f"adapter {k!r} has no LoRA slot in this model (targets: {len(self.lora.targets)} weights)")
            else:
                out[k] = v
        if found != len(self._adapter_names):
            missing = sorted(set(self._adapter_names) - set(params))
            raise ValueError(f"the model carries LoRA adapters but params lack {len(missing)} of them, e.g. {missing[:3]}; pass "
                             "the adapters with the base params ({**params, **adapters})")
        return out


def _skeleton_params(family: Family, config: Any) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in family.skeleton(config).parameters())


def estimate_param_count(family: Family, config: Any) -> int:
    """Params of ``family``/``config`` without building the whole skeleton: a 5-layer skeleton
    (meta tensors) gives the embeddings, head, MTP and the first layers; the rest are counted
    by kind: a config with ``is_moe_layer(idx)`` (the MoE families) has the size of a dense and of
    a MoE layer measured on 1- and 2-layer skeletons and times how many of each its rule makes;
    otherwise every layer past the fourth has the shape of the fifth. Exact for every supported
    family; a config of at most 5 layers is counted whole. Milliseconds for any layer count the
    memory could hold (one ``is_moe_layer`` call per layer)."""
    import dataclasses

    if hasattr(config, "validate"):
        config.validate()
    L = int(config.num_hidden_layers)
    if L <= 5 or not dataclasses.is_dataclass(config):
        return _skeleton_params(family, config)
    p5 = _skeleton_params(family, dataclasses.replace(config, num_hidden_layers=5))
    if not hasattr(config, "is_moe_layer"):
        p4 = _skeleton_params(family, dataclasses.replace(config, num_hidden_layers=4))
        return p5 + (L - 5) * (p5 - p4)
    # dense and MoE layers mixed by the config's rule (first_k_dense_replace, decoder_sparse_step,
    # mlp_only_layers, moe_layer_freq): the size of each kind, times how many layers of it there are
    size = {kind: _skeleton_params(family, _forced(config, kind, 2)) - _skeleton_params(family, _forced(config, kind, 1))
            for kind in (False, True)}
    n_moe = sum(1 for i in range(5, L) if config.is_moe_layer(i))
    total = p5 + n_moe * size[True] + (L - 5 - n_moe) * size[False]
    mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)  # MTP depths take the kind of layer L + k
    moved = sum(int(config.is_moe_layer(L + k)) - int(config.is_moe_layer(5 + k)) for k in range(mtp))
    return total + moved * (size[True] - size[False])


def _forced(config: Any, moe: bool, layers: int) -> Any:
    """``config`` with ``layers`` layers, every one (MTP depths included) dense or MoE: an instance
    of a subclass whose ``is_moe_layer`` answers ``moe`` (its fields copied, not re-validated)."""
    cls = type(config)
    sub = type(f"{cls.__name__}AllMoE" if moe else f"{cls.__name__}AllDense", (cls,), {"is_moe_layer": lambda self, idx: moe})
    out = object.__new__(sub)
    out.__dict__.update(config.__dict__)
    out.__dict__["num_hidden_layers"] = layers
    return out


def check_model_fits(family: Family, config: Any, device: torch.device | str, dtype: torch.dtype | None, where: str,
                     shards: int = 1) -> None:
    """Refuse a config whose params alone would not fit in the free memory of ``device``
    (checked before the skeleton is built or a tensor read: a config.json claiming a million
    layers fails in milliseconds, naming its sizes). ``shards``: the most ways the params can be
    split over devices (the process count of a sharded run); each device holds a 1/shards part.

    Raises:
        ValueError: the estimate (:func:`estimate_param_count` x the bytes of ``dtype``, 4 for
            None, / ``shards``) exceeds the free memory.
    """
    n = estimate_param_count(family, config)
    need = n * (torch.empty((), dtype=dtype).element_size() if dtype is not None else 4) / 1024**3 / max(1, shards)
    free = available_memory_gib(torch.device(device))
    if free is not None and need > free:
        sizes = ", ".join(f"{k} {getattr(config, k)}" for k in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size",
                                                              "n_routed_experts", "num_experts") if hasattr(config, k))
        part = f" (1/{shards} of them per device)" if shards > 1 else ""
        raise ValueError(f"{where}: the config ({sizes}) makes {n:,} params, {need:,.1f} GiB{part} in "
                         f"{str(dtype or torch.float32).replace('torch.', '')}, more than the {free:,.1f} GiB free on {device}")
