"""MindFormers parameter names and tensor layouts <-> mff param paths.

Every MindFormers tensor of a model is one :class:`MFTensor`: its name, its stored shape, the
views of the mff params it covers (``parts``) and two exact inverse functions, ``split``
(MindFormers tensor -> one piece per part) and ``join`` (pieces -> MindFormers tensor). All
transforms are reshapes, slices, transposes and row permutations, so a round trip is
bit-exact and the same tables map optimizer moments (``adam_m.*`` / ``adam_v.*``).

Sources of every layout: ``docs/mindformers_formats.md`` §3 (read from the
MindFormers 2.0.0 wheel and the mindspore-lab/mindformers repository):

- §3.1 Mcore dense / GQA (``mf:models/qwen3/utils.py``, ``mf:checkpoint/converter/convert_op.py``
  ``QKVConvertOp`` / ``ConcatConvertOp``): fused KV-group-interleaved ``linear_qkv``, row-interleaved
  ``linear_fc1``, no transposes for dense layers, no ``output_layer`` when embeddings are tied.
- §3.2 Mcore DeepSeek-V3 (``repo:toolkit/weight_convert/deepseekv3/``): fused (``linear_qkv`` =
  [q_a; kv_a_with_mqa], ``linear_qb``, ``linear_kvb``, ``k_layernorm``) and unfused MLA names,
  ``weight1`` / ``weight2`` transposed stacked experts, router ``expert_bias`` kept fp32, MTP
  ``mtp.layers.{j}.*``.
- §3.3 legacy names (``mf:models/llama/convert_weight.py``, ``repo:research/deepseek3/convert_weight.py``):
  Llama-family ``attention.wq``... and DeepSeek-V3 ``q2l_proj`` / ``kv2l_*`` with the rope-row
  permutation.

Names without a verified source (§3.4; Megatron-consistent choices, unverified against a real
MindFormers file): GLM-4's sandwich norms ``post_self_attn_layernorm`` / ``post_mlp_layernorm``
(Megatron-Core ``TransformerLayer`` submodule names, also used by mbridge's GLM-4 bridge), biases
``linear_qkv.bias`` / ``linear_proj.bias`` / ``linear_fc1.bias`` / ``linear_fc2.bias`` beyond the
Qwen-style q/k/v bias, MLA without q-LoRA ``linear_q_proj``, GLM-4-MoE as DeepSeek-V3's MoE names
(MindFormers 2.0 trains neither GLM family). GLM-4's partial rotary needs no weight change: like
DeepSeek-V3 in Mcore (§3.2, "RoPE rows": no row permutation), the pair layout is a runtime
switch (Megatron ``rotary_interleaved``).

Shape legend: H hidden_size, nh query heads, ng KV heads (groups), r = nh / ng, d head_dim,
F an MLP width, E routed experts, N / R / V MLA nope / rope / value head dims, C kv_lora_rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mff.model import Model

__all__ = ["MFTensor", "McoreLayout", "LegacyLayout", "mcore_tensors", "legacy_tensors", "MindFormersLayoutError"]

Tensor = torch.Tensor
View = Callable[[Tensor], Tensor]


class MindFormersLayoutError(ValueError):
    """A model the requested MindFormers layout cannot express (the message says why)."""


@dataclass(frozen=True)
class MFTensor:
    """One MindFormers tensor and the mff param views it covers.

    Attributes:
        name: the MindFormers tensor name.
        shape: the shape it is written with.
        parts: ``(param path, view)`` pairs; ``view(param)`` is the region of the param this
            tensor fills (a view, so copying into it fills the param).
        split: MindFormers tensor -> pieces, one per part, each shaped like its view.
        join: pieces (the views' contents) -> the MindFormers tensor, shaped ``shape``.
        alt_shapes: other stored shapes ``split`` accepts (e.g. 3-D ``weight1``).
        fp32: written as float32 whatever the params' dtype (router weight and expert bias).
    """

    name: str
    shape: tuple[int, ...]
    parts: tuple[tuple[str, View], ...]
    split: Callable[[Tensor], list[Tensor]]
    join: Callable[[list[Tensor]], Tensor]
    alt_shapes: tuple[tuple[int, ...], ...] = ()
    fp32: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        """The mff params this tensor covers (in part order, repeats removed)."""
        return tuple(dict.fromkeys(p for p, _ in self.parts))

    def accepts(self, shape: Sequence[int]) -> bool:
        """Whether a stored tensor of ``shape`` can be split into the parts."""
        shape = tuple(shape)
        return shape == self.shape or shape in self.alt_shapes


@dataclass(frozen=True)
class McoreLayout:
    """The options of the Mcore (Megatron-Core style, ``use_legacy: False``) layout.

    Attributes:
        qkv: ``"interleaved"`` (per KV group ``[q heads, k, v]``, default), ``"contiguous"``
            (``[Q; K; V]``, MindFormers ``use_contiguous_weight_layout_attention: True``) or
            ``"separate"`` (``linear_q`` / ``linear_k`` / ``linear_v``, MindFormers inference names).
        fc1: ``"interleaved"`` (rows ``[g0, u0, g1, u1, ...]``, default), ``"contiguous"``
            (``[gate; up]``, ``use_interleaved_weight_layout_mlp: False``) or ``"separate"``
            (``gating`` / ``hidden``, inference names).
        mla_fused: DeepSeek-V3 attention with ``mla_qkv_concat: True`` names (default) or the
            unfused toolkit names.
        experts_3d: write ``weight1`` / ``weight2`` as ``[E, H, 2F]`` / ``[E, F, H]`` instead of
            the 2-D ``[E*H, 2F]`` / ``[E*F, H]``; both are read either way.
    """

    qkv: str = "interleaved"
    fc1: str = "interleaved"
    mla_fused: bool = True
    experts_3d: bool = False

    def __post_init__(self):
        for key in ("qkv", "fc1"):
            if getattr(self, key) not in ("interleaved", "contiguous", "separate"):
                raise ValueError(f"McoreLayout.{key}={getattr(self, key)!r}; expected interleaved, contiguous or separate")


@dataclass(frozen=True)
class LegacyLayout:
    """Options of the legacy layout (MindFormers <= 1.x, ``use_legacy: True``).

    Attributes:
        qkv_concat: Llama family fused ``attention.w_qkv`` (KV-group layout) and
            ``feed_forward.w_gate_hidden`` (row-interleaved), as ``qkv_concat: True`` builds them.
        expert_gemm: DeepSeek-V3 routed experts stored ``[E, in, out]`` (``--use_gemm``) instead of
            ``[E, out, in]``; None = decide by shape (square experts, F == H, then read as
            ``[E, out, in]``).
    """

    qkv_concat: bool = False
    expert_gemm: bool | None = None


# ------------------------------------------------------------------------------------------
# transforms


def _ident(t: Tensor) -> Tensor:
    return t


def _rename(name: str, path: str, shape: Sequence[int], fp32: bool = False) -> MFTensor:
    return MFTensor(name, tuple(shape), ((path, _ident),), lambda t: [t], lambda p: p[0], fp32=fp32)


def _concat(name: str, parts: Sequence[tuple[str, View]], sizes: Sequence[int], rest: Sequence[int]) -> MFTensor:
    """Pieces stacked along dim 0 (``[a; b; ...]``), each ``sizes[i]`` rows."""
    sizes = list(sizes)
    return MFTensor(name, (sum(sizes), *rest), tuple(parts), lambda t: list(t.split(sizes, 0)), lambda p: torch.cat(p, 0))


def _qkv(name: str, parts: Sequence[tuple[str, View]], nh: int, ng: int, d: int, rest: Sequence[int], interleaved: bool) -> MFTensor:
    """Fused QKV (weight ``rest = (H,)`` or bias ``rest = ()``). Interleaved (§3.1 ``QKVConvertOp``):
    per KV group ``[r*d q rows, d k rows, d v rows]``; contiguous: ``[Q; K; V]``."""
    rest = tuple(rest)
    if not interleaved:
        return _concat(name, parts, (nh * d, ng * d, ng * d), rest)
    r = nh // ng

    def split(t: Tensor) -> list[Tensor]:
        q, k, v = t.reshape(ng, (r + 2) * d, *rest).split([r * d, d, d], 1)
        return [q.reshape(nh * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)]

    def join(p: list[Tensor]) -> Tensor:
        q, k, v = p
        return torch.cat([q.reshape(ng, r * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], 1).reshape(-1, *rest)

    return MFTensor(name, ((nh + 2 * ng) * d, *rest), tuple(parts), split, join)


def _fc1(name: str, parts: Sequence[tuple[str, View]], F: int, rest: Sequence[int], interleaved: bool) -> MFTensor:
    """Gate and up of a SwiGLU MLP in one tensor. Interleaved (§3.1 ``concat_linear_fc1_interleaved``):
    rows ``[g0, u0, g1, u1, ...]`` (``reshape(F, 2, ...)``); contiguous: ``[gate; up]``."""
    rest = tuple(rest)
    if not interleaved:
        return _concat(name, parts, (F, F), rest)

    def split(t: Tensor) -> list[Tensor]:
        return list(t.reshape(F, 2, *rest).unbind(1))

    def join(p: list[Tensor]) -> Tensor:
        return torch.stack(p, 1).reshape(2 * F, *rest)

    return MFTensor(name, (2 * F, *rest), tuple(parts), split, join)


def _experts_w1(name: str, path: str, E: int, F: int, H: int, three_d: bool) -> MFTensor:
    """mff ``experts.gate_up_proj`` [E, 2F, H] (gate rows, then up rows) <-> ``weight1``
    (§3.2: per expert ``[H, 2F]``, columns ``[gate | up]``; stored ``[E*H, 2F]``)."""
    shape, alt = ((E, H, 2 * F), (E * H, 2 * F)) if three_d else ((E * H, 2 * F), (E, H, 2 * F))
    return MFTensor(name, shape, ((path, _ident),), lambda t: [t.reshape(E, H, 2 * F).transpose(1, 2)],
                    lambda p: p[0].transpose(1, 2).reshape(shape), alt_shapes=(alt,))


def _experts_w2(name: str, path: str, E: int, F: int, H: int, three_d: bool) -> MFTensor:
    """mff ``experts.down_proj`` [E, H, F] <-> ``weight2`` (§3.2: per expert ``[F, H]``; stored ``[E*F, H]``)."""
    shape, alt = ((E, F, H), (E * F, H)) if three_d else ((E * F, H), (E, F, H))
    return MFTensor(name, shape, ((path, _ident),), lambda t: [t.reshape(E, F, H).transpose(1, 2)],
                    lambda p: p[0].transpose(1, 2).reshape(shape), alt_shapes=(alt,))


def _rope_unpermute(t: Tensor, heads: int, R: int) -> Tensor:
    """Undo the legacy DeepSeek-V3 rope-row permutation (§3.3): within each head the R rows were
    reordered from interleaved pairs to half-split, ``reshape(heads, R/2, 2, -1).permute(0, 2, 1, 3)``
    (legacy row ``j*R/2 + i`` = HF row ``2i + j``). ``t``: [heads*R, in] -> [heads*R, in]."""
    return t.reshape(heads, 2, R // 2, -1).permute(0, 2, 1, 3).reshape(heads * R, -1)


def _rope_permute(t: Tensor, heads: int, R: int) -> Tensor:
    """The legacy permutation itself (inverse of :func:`_rope_unpermute`)."""
    return t.reshape(heads, R // 2, 2, -1).permute(0, 2, 1, 3).reshape(heads * R, -1)


def _rows(a: int, b: int) -> View:
    return lambda t: t[a:b]


def _heads(n: int, width: int, a: int, b: int) -> View:
    """Rows ``a:b`` of every head of a ``[n*width, in]`` param, as ``[n, b-a, in]``."""
    return lambda t: t.view(n, width, -1)[:, a:b]


# ------------------------------------------------------------------------------------------
# model walk


@dataclass
class _Walk:
    """Collects entries and checks that every param is covered exactly once."""

    shapes: dict[str, torch.Size]
    out: list[MFTensor] = field(default_factory=list)
    covered: dict[str, str] = field(default_factory=dict)

    def has(self, path: str) -> bool:
        return path in self.shapes

    def shape(self, path: str) -> tuple[int, ...]:
        return tuple(self.shapes[path])

    def add(self, e: MFTensor, shared: bool = False) -> None:
        for p in e.params:
            if p in self.covered and not shared:
                raise AssertionError(f"{p} covered by both {self.covered[p]} and {e.name}")
            self.covered[p] = e.name
        self.out.append(e)

    def rename(self, name: str, path: str, fp32: bool = False) -> None:
        self.add(_rename(name, path, self.shape(path), fp32))

    def done(self, layout: str) -> list[MFTensor]:
        left = [p for p in self.shapes if p not in self.covered]
        if left:
            raise MindFormersLayoutError(f"the {layout} MindFormers layout has no names for {len(left)} params of this model, "
                                         f"e.g. {left[:5]}")
        return self.out


def _layer_ids(model: Model) -> list[int]:
    ids = {int(m.group(1)) for p in model.param_shapes() if (m := re.match(r"model\.layers\.(\d+)\.", p))}
    return sorted(ids)


def _is_mla(w: _Walk, i: int) -> bool:
    return w.has(f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight")


def mcore_tensors(model: Model, layout: McoreLayout = McoreLayout()) -> list[MFTensor]:
    """The Mcore MindFormers tensors of ``model`` (any family), in MindFormers' save order
    (embedding, layers, final norm, head, MTP layers).

    Raises:
        MindFormersLayoutError: a param the layout has no name for.
    """
    cfg = model.config
    w = _Walk(model.param_shapes())
    w.rename("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    L = cfg.num_hidden_layers
    mtp_ids = []
    for i in _layer_ids(model):
        if i >= L:
            mtp_ids.append(i)
            continue
        _mcore_layer(w, model, i, f"decoder.layers.{i}.", layout)
    w.rename("decoder.final_layernorm.weight", "model.norm.weight")
    if w.has("lm_head.weight"):
        w.rename("output_layer.weight", "lm_head.weight")
    for i in mtp_ids:
        hf, mf = f"model.layers.{i}.", f"mtp.layers.{i - L}."
        w.rename(mf + "enorm.weight", hf + "enorm.weight")
        w.rename(mf + "hnorm.weight", hf + "hnorm.weight")
        w.rename(mf + "eh_proj.weight", hf + "eh_proj.weight")
        w.rename(mf + "final_layernorm.weight", hf + "shared_head.norm.weight")
        _mcore_layer(w, model, i, mf + "transformer_layer.", layout)
    return w.done("Mcore")


def _mcore_layer(w: _Walk, model: Model, i: int, mf: str, layout: McoreLayout) -> None:
    cfg, hf = model.config, f"model.layers.{i}."
    w.rename(mf + "input_layernorm.weight", hf + "input_layernorm.weight")
    w.rename(mf + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight")
    for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):  # GLM-4 sandwich norms (unverified names)
        if w.has(hf + f"{norm}.weight"):
            w.rename(mf + f"{norm}.weight", hf + f"{norm}.weight")
    if _is_mla(w, i):
        _mcore_mla(w, cfg, hf + "self_attn.", mf + "self_attention.", layout.mla_fused)
    else:
        _mcore_gqa(w, cfg, hf + "self_attn.", mf + "self_attention.", layout.qkv)
    _mcore_mlp(w, hf + "mlp.", mf + "mlp.", layout)


def _mcore_gqa(w: _Walk, cfg, hf: str, mf: str, qkv: str) -> None:
    nh, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for kind, rest in (("weight", (cfg.hidden_size,)), ("bias", ())):
        paths = [f"{hf}{p}_proj.{kind}" for p in "qkv"]
        if not w.has(paths[0]):
            continue
        if qkv == "separate":
            for p, path in zip("qkv", paths):
                w.rename(f"{mf}linear_{p}.{kind}", path)
        else:
            w.add(_qkv(f"{mf}linear_qkv.{kind}", [(p, _ident) for p in paths], nh, ng, d, rest, qkv == "interleaved"))
    for kind in ("weight", "bias"):
        if w.has(f"{hf}o_proj.{kind}"):
            w.rename(f"{mf}linear_proj.{kind}", f"{hf}o_proj.{kind}")
    if w.has(hf + "q_norm.weight"):
        w.rename(mf + "q_layernorm.weight", hf + "q_norm.weight")
        w.rename(mf + "k_layernorm.weight", hf + "k_norm.weight")


def _mcore_mla(w: _Walk, cfg, hf: str, mf: str, fused: bool) -> None:
    for kind in ("weight", "bias"):
        q_a, kv_a = f"{hf}q_a_proj.{kind}", f"{hf}kv_a_proj_with_mqa.{kind}"
        if fused and w.has(q_a):
            rest = w.shape(q_a)[1:]
            w.add(_concat(f"{mf}linear_qkv.{kind}", [(q_a, _ident), (kv_a, _ident)], (w.shape(q_a)[0], w.shape(kv_a)[0]), rest))
            continue
        if w.has(q_a):
            w.rename(f"{mf}linear_q_down_proj.{kind}", q_a)
        if w.has(kv_a):
            w.rename(f"{mf}linear_kv_down_proj.{kind}", kv_a)
    if w.has(hf + "q_proj.weight"):  # no q-LoRA (unverified name)
        w.rename(mf + "linear_q_proj.weight", hf + "q_proj.weight")
    else:
        w.rename(mf + ("linear_qb.weight" if fused else "linear_q_up_proj.weight"), hf + "q_b_proj.weight")
        w.rename(mf + "q_layernorm.weight", hf + "q_a_layernorm.weight")
    w.rename(mf + ("k_layernorm.weight" if fused else "kv_layernorm.weight"), hf + "kv_a_layernorm.weight")
    w.rename(mf + ("linear_kvb.weight" if fused else "linear_kv_up_proj.weight"), hf + "kv_b_proj.weight")
    for kind in ("weight", "bias"):
        if w.has(f"{hf}o_proj.{kind}"):
            w.rename(f"{mf}linear_proj.{kind}", f"{hf}o_proj.{kind}")


def _mcore_gated(w: _Walk, hf: str, mf: str, fc1: str) -> None:
    """A SwiGLU MLP (dense or shared experts): gate/up (or GLM's fused gate_up_proj) -> linear_fc1, down -> linear_fc2."""
    for kind in ("weight", "bias"):
        gate, up, fused = f"{hf}gate_proj.{kind}", f"{hf}up_proj.{kind}", f"{hf}gate_up_proj.{kind}"
        if w.has(fused):
            F = w.shape(fused)[0] // 2
            parts = [(fused, _rows(0, F)), (fused, _rows(F, 2 * F))]
            rest = w.shape(fused)[1:]
        elif w.has(gate):
            F, rest = w.shape(gate)[0], w.shape(gate)[1:]
            parts = [(gate, _ident), (up, _ident)]
        else:
            continue
        if fc1 == "separate":
            w.add(MFTensor(f"{mf}gating.{kind}", (F, *rest), (parts[0],), lambda t: [t], lambda p: p[0]))
            w.add(MFTensor(f"{mf}hidden.{kind}", (F, *rest), (parts[1],), lambda t: [t], lambda p: p[0]), shared=True)
        else:
            w.add(_fc1(f"{mf}linear_fc1.{kind}", parts, F, rest, fc1 == "interleaved"))
        if w.has(f"{hf}down_proj.{kind}"):
            w.rename(f"{mf}linear_fc2.{kind}", f"{hf}down_proj.{kind}")


def _mcore_mlp(w: _Walk, hf: str, mf: str, layout: McoreLayout) -> None:
    if not w.has(hf + "experts.gate_up_proj"):
        _mcore_gated(w, hf, mf, layout.fc1)
        return
    w.rename(mf + "router.weight", hf + "gate.weight", fp32=True)
    if w.has(hf + "gate.e_score_correction_bias"):
        w.rename(mf + "router.expert_bias", hf + "gate.e_score_correction_bias", fp32=True)
    E, F2, H = w.shape(hf + "experts.gate_up_proj")
    w.add(_experts_w1(mf + "experts.weight1", hf + "experts.gate_up_proj", E, F2 // 2, H, layout.experts_3d))
    w.add(_experts_w2(mf + "experts.weight2", hf + "experts.down_proj", E, F2 // 2, H, layout.experts_3d))
    if w.has(hf + "shared_experts.gate_proj.weight"):
        _mcore_gated(w, hf + "shared_experts.", mf + "shared_experts.", layout.fc1)


# ------------------------------------------------------------------------------------------
# legacy names (MindFormers <= 1.x)


def legacy_tensors(model: Model, layout: LegacyLayout = LegacyLayout()) -> list[MFTensor]:
    """The legacy MindFormers tensors of ``model``: the Llama-family names (§3.3
    ``name_replace``) for GQA models without q/k norms or sandwich norms (mff's ``llama``
    family: Llama, Qwen2), the DeepSeek-V3 research names for MLA models.

    Raises:
        MindFormersLayoutError: a param the legacy layout has no name for (e.g. Qwen3's q/k
            norms: Qwen3 has only the Mcore layout).
    """
    cfg = model.config
    w = _Walk(model.param_shapes())
    w.rename("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight")
    L = cfg.num_hidden_layers
    mtp_ids = []
    for i in _layer_ids(model):
        hf, mf = f"model.layers.{i}.", f"model.layers.{i}."
        w.rename(mf + "attention_norm.weight", hf + "input_layernorm.weight")
        w.rename(mf + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        if _is_mla(w, i):
            _legacy_mla(w, cfg, hf + "self_attn.", mf + "attention.")
        else:
            _legacy_gqa(w, cfg, hf + "self_attn.", mf + "attention.", layout.qkv_concat)
        _legacy_mlp(w, hf + "mlp.", mf + "feed_forward.", layout)
        if i >= L:
            mtp_ids.append(i)
            j = i - L
            w.rename(f"model.mtp_hidden_fusers.{j}.norm_emb.weight", hf + "enorm.weight")
            w.rename(f"model.mtp_hidden_fusers.{j}.norm.weight", hf + "hnorm.weight")
            w.rename(f"model.mtp_hidden_fusers.{j}.dense.weight", hf + "eh_proj.weight")
    # the legacy MTP blocks share the final norm (the converter drops shared_head.norm)
    norms = ["model.norm.weight"] + [f"model.layers.{i}.shared_head.norm.weight" for i in mtp_ids]
    shape = w.shape("model.norm.weight")
    w.add(MFTensor("model.norm_out.weight", shape, tuple((p, _ident) for p in norms), lambda t: [t] * len(norms), lambda p: p[0]))
    if w.has("lm_head.weight"):
        w.rename("lm_head.weight", "lm_head.weight")
    return w.done("legacy")


def _legacy_gqa(w: _Walk, cfg, hf: str, mf: str, fused: bool) -> None:
    nh, ng, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for kind, rest in (("weight", (cfg.hidden_size,)), ("bias", ())):
        paths = [f"{hf}{p}_proj.{kind}" for p in "qkv"]
        if not w.has(paths[0]):
            continue
        if fused:
            w.add(_qkv(f"{mf}w_qkv.{kind}", [(p, _ident) for p in paths], nh, ng, d, rest, True))
        else:
            for p, path in zip(("wq", "wk", "wv"), paths):
                w.rename(f"{mf}{p}.{kind}", path)
    for kind in ("weight", "bias"):
        if w.has(f"{hf}o_proj.{kind}"):
            w.rename(f"{mf}wo.{kind}", f"{hf}o_proj.{kind}")


def _legacy_mla(w: _Walk, cfg, hf: str, mf: str) -> None:
    nh, N, R, V, C = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if not w.has(hf + "q_b_proj.weight"):
        raise MindFormersLayoutError("the legacy DeepSeek-V3 layout needs q_lora_rank (q2l_proj / l2q_*); this config has q_lora_rank=None")
    if w.has(hf + "q_a_proj.bias"):
        raise MindFormersLayoutError("the legacy DeepSeek-V3 layout has no attention biases; this config sets attention_bias=True")
    # rows of HF DeepSeek-V3 (rope_interleave=True) are pair-interleaved; the legacy model has no
    # runtime de-interleave, so its rope rows are stored half-split. A config with
    # rope_interleave=False already expects half-split rows.
    permuted = getattr(cfg, "rope_interleave", True)
    unperm = (lambda t, n: _rope_unpermute(t, n, R)) if permuted else (lambda t, n: t)
    perm = (lambda t, n: _rope_permute(t, n, R)) if permuted else (lambda t, n: t)
    Q = w.shape(hf + "q_b_proj.weight")[1]
    w.rename(mf + "q2l_proj.weight", hf + "q_a_proj.weight")
    w.rename(mf + "lq_norm.weight", hf + "q_a_layernorm.weight")
    q_b = hf + "q_b_proj.weight"
    w.add(MFTensor(mf + "l2q_nope_proj.weight", (nh * N, Q), ((q_b, _heads(nh, N + R, 0, N)),),
                   lambda t: [t.reshape(nh, N, Q)], lambda p: p[0].reshape(nh * N, Q)))
    w.add(MFTensor(mf + "l2q_pe_proj.weight", (nh * R, Q), ((q_b, _heads(nh, N + R, N, N + R)),),
                   lambda t: [unperm(t, nh).reshape(nh, R, Q)], lambda p: perm(p[0].reshape(nh * R, Q), nh)), shared=True)
    kv_a, H = hf + "kv_a_proj_with_mqa.weight", cfg.hidden_size
    w.add(MFTensor(mf + "kv2l_latent_kv.weight", (C, H), ((kv_a, _rows(0, C)),), lambda t: [t], lambda p: p[0]))
    w.add(MFTensor(mf + "kv2l_k_pe.weight", (R, H), ((kv_a, _rows(C, C + R)),), lambda t: [unperm(t, 1)], lambda p: perm(p[0], 1)),
          shared=True)
    w.rename(mf + "lkv_norm.weight", hf + "kv_a_layernorm.weight")
    kv_b = hf + "kv_b_proj.weight"
    w.add(MFTensor(mf + "lkv2kv_k_nope.weight", (nh * N, C), ((kv_b, _heads(nh, N + V, 0, N)),),
                   lambda t: [t.reshape(nh, N, C)], lambda p: p[0].reshape(nh * N, C)))
    w.add(MFTensor(mf + "lkv2kv_v.weight", (nh * V, C), ((kv_b, _heads(nh, N + V, N, N + V)),),
                   lambda t: [t.reshape(nh, V, C)], lambda p: p[0].reshape(nh * V, C)), shared=True)
    w.rename(mf + "wo.weight", hf + "o_proj.weight")


def _legacy_gated(w: _Walk, hf: str, mf: str, fused: bool) -> None:
    for kind in ("weight", "bias"):
        gate, up = f"{hf}gate_proj.{kind}", f"{hf}up_proj.{kind}"
        if not w.has(gate):
            continue
        if fused:
            w.add(_fc1(f"{mf}w_gate_hidden.{kind}", [(gate, _ident), (up, _ident)], w.shape(gate)[0], w.shape(gate)[1:], True))
        else:
            w.rename(f"{mf}w1.{kind}", gate)
            w.rename(f"{mf}w3.{kind}", up)
        w.rename(f"{mf}w2.{kind}", f"{hf}down_proj.{kind}")


def _legacy_experts(name: str, path: str, E: int, rows: int, cols: int, lo: int, gemm: bool | None) -> MFTensor:
    """A stacked legacy expert tensor ``[E, rows, cols]`` (``[E, out, in]``) or, with
    ``--use_gemm``, ``[E, cols, rows]``, filling rows ``lo:lo+rows`` of the mff param."""
    shape, alt = (E, rows, cols), (E, cols, rows)

    def split(t: Tensor) -> list[Tensor]:
        transposed = gemm if gemm is not None else (tuple(t.shape) == alt and alt != shape)
        return [t.transpose(1, 2) if transposed else t]

    def join(p: list[Tensor]) -> Tensor:
        return p[0].transpose(1, 2) if gemm else p[0]

    return MFTensor(name, alt if gemm else shape, ((path, lambda t: t[:, lo:lo + rows]),), split, join, alt_shapes=(shape, alt))


def _legacy_mlp(w: _Walk, hf: str, mf: str, layout: LegacyLayout) -> None:
    if not w.has(hf + "experts.gate_up_proj"):
        _legacy_gated(w, hf, mf, layout.qkv_concat)
        return
    w.rename(mf + "routed_experts.router.dense.weight", hf + "gate.weight", fp32=True)
    if w.has(hf + "gate.e_score_correction_bias"):
        w.rename(mf + "routed_experts.router.router.topk_bias", hf + "gate.e_score_correction_bias", fp32=True)
    E, F2, H = w.shape(hf + "experts.gate_up_proj")
    F, gu, dn, g = F2 // 2, hf + "experts.gate_up_proj", hf + "experts.down_proj", layout.expert_gemm
    w.add(_legacy_experts(mf + "routed_experts.ffn.w1.weight", gu, E, F, H, 0, g))
    w.add(_legacy_experts(mf + "routed_experts.ffn.w3.weight", gu, E, F, H, F, g), shared=True)
    w.add(_legacy_experts(mf + "routed_experts.ffn.w2.weight", dn, E, H, F, 0, g))
    if w.has(hf + "shared_experts.gate_proj.weight"):
        _legacy_gated(w, hf + "shared_experts.", mf + "shared_experts.", False)
