"""Activation memory: the bytes autograd keeps for the backward, per token of a micro-batch,
for each decoder layer of a model as mff computes it.

Method: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4, eq. 2) count, for a GPT layer, every tensor the backward needs (``34 s b h``
bytes with 2-byte activations and no attention scores kept, the figure of
:func:`mff.train.metrics.memory_estimate_gib`). This module applies the same count to mff's own
ops, which differ from that GPT layer: RMSNorm keeps an fp32 copy of its input and its 1/rms
(:func:`mff.backend.rms_norm_torch`), SwiGLU instead of GeLU, no dropout, MLA's low-rank
projections, and MoE layers whose routed experts see K copies of each token. Per token, with
``c`` the compute dtype's bytes (4 fp32, 2 bf16), D hidden, and local (per tp rank) widths:

- RMSNorm of width W: ``4 W + 4 + c W`` (fp32 input copy, 1/rms, normalised input); a linear
  layer reading its output keeps that output too (``c W``).
- MLA (H heads, N/R/Vd head dims, q_lora q, kv_lora C): input norm and its output, the q latent
  norm and its output, the kv latent norm and its output, SDPA's q, k, v and output (each
  ``c H (N + R)``: V is zero-padded to the q/k width so SDPA takes its flash kernel) and
  log-sum-exp (``4 H``), and the o_proj input ``c H Vd`` (a copy: the padding is cut off).
- GQA (H, Hkv heads of Dh): input norm and output, the per-head q/k norms (Qwen3, GLM-4.5:
  no output kept, RoPE keeps only cos/sin), SDPA's q, k and v (K/V repeated to H heads) and
  output ``4 c H Dh`` and log-sum-exp ``4 H``.
- Gated MLP of local width I (dense layers, shared experts): ``4 c I`` (gate and up outputs,
  silu(gate), their product), plus its input norm and output.
- MoE, K experts per token, expert width I, E experts: the router (fp32 input copy in bf16
  ``4 D``, scores ``4 E``, top-k indices and weights ``12 K + 4``, group-limited routing's
  group scores ``16 G + 8 topk_group + E``), and per token slot (K per token) the slot's input
  ``c D``, the gate/up output ``2 c I``, silu(gate) and the SwiGLU output ``2 c I``, the expert
  output ``c D``, its gate-weighted fp32 product ``4 D``, the weight and indices ``20``.
- Once per micro-batch of a stage: RoPE's cos and sin ``2 c R``; the first stage the token ids
  (8); a stage of a pipeline the hidden states it received and those it sent (``c D`` each,
  kept by ``torch.distributed.pipelining`` for the backward); the last stage
  the final norm, and per head use (the main head and each MTP depth) the fused
  linear-cross-entropy's saved gradients: ``c D`` per token plus ``c V D`` per micro-batch (the
  head's gradient is computed in the forward, :mod:`mff.nn.loss`; V is the local vocabulary),
  and while the head runs, one chunk's logits and softmax gradient and, in bf16, the fp32
  accumulator of the head's gradient ``4 V D`` (a transient, not kept).

Activation checkpointing (:mod:`mff.nn.blocks`): ``full`` keeps each layer's input ``c D``,
and one layer's activations are rebuilt at a time in the backward; ``selective`` keeps the
layer input and the outputs of its matmuls and attention (the ops it saves), and rebuilds the
rest of one layer at a time. The head, the embedding and MTP's own norms and projection are
outside the checkpointed blocks.

Checked against what autograd really keeps (``torch.autograd.graph.saved_tensors_hooks`` on
one-process forwards of every family, fp32 and bf16-mixed, ``tests/test_plan.py``). Not
counted: gradients of activations alive during a layer's backward, the CUDA kernels' own
workspaces, routing imbalance (a device whose experts get more than K slots per token), and on a
CPU the attention probabilities that its blockwise training attention keeps instead of the
flash kernel's log-sum-exp (:mod:`mff.nn.block_attention`, about ``c H T / 2`` more per token
and layer; the test measures with :func:`mff.nn.attention.cpu_block_attention` off).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mff.nn.loss import default_chunk_rows

__all__ = ["LayerActivations", "LayerKinds", "StageActivations", "layer_activations", "stage_activations"]

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class LayerKinds:
    """The skeleton's decoder blocks (MTP depths included) grouped by kind: blocks whose params
    have the same names and shapes (a dense and a MoE layer, say) are counted alike, so a plan
    computes each kind's activations once, not once per layer and pp rank. ``rep[i]`` is the
    first block of block i's kind; :meth:`activations` memoises :func:`layer_activations` per
    kind."""

    def __init__(self, model):
        sig: dict[int, list] = {}
        for path, shape in model.param_shapes().items():
            m = _BLOCK.match(path)
            if m:
                sig.setdefault(int(m.group(1)), []).append((m.group(2), tuple(shape)))
        first: dict[tuple, int] = {}
        self.rep = {i: first.setdefault(tuple(v), i) for i, v in sorted(sig.items())}
        self.blocks = model.skeleton.model.layers
        self._memo: dict[tuple[int, int, int], LayerActivations] = {}

    def activations(self, i: int, c: int, tp: int) -> LayerActivations:
        """:func:`layer_activations` of block ``i`` (computed once per kind)."""
        key = (self.rep.get(i, i), c, tp)
        if key not in self._memo:
            self._memo[key] = layer_activations(self.blocks[key[0]], c, tp)
        return self._memo[key]


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token of one decoder layer: ``none`` all it keeps without checkpointing,
    ``selective`` what ``--ac selective`` keeps, ``full`` what ``--ac full`` keeps (its input)."""

    none: float
    selective: float
    full: float

    def kept(self, ac: str) -> float:
        """Bytes per token kept until the layer's backward under ``ac`` (none, selective, full)."""
        return {"none": self.none, "selective": self.selective, "full": self.full}[ac]

    def rebuilt(self, ac: str) -> float:
        """Bytes per token recomputed for this layer's backward under ``ac`` (0 for none)."""
        return 0.0 if ac == "none" else self.none - self.kept(ac) + self.full


def _norm(width: float, c: int) -> float:
    """RMSNorm: fp32 copy of the input, fp32 1/rms, the normalised input in the compute dtype."""
    return 4 * width + 4 + c * width


def _mla(attn, c: int, tp: int) -> tuple[float, float]:
    D = attn.kv_a_proj_with_mqa.weight.shape[1]
    H, N, R, Vd, C, q = attn.num_heads // tp, attn.nope, attn.rope, attn.v_dim, attn.kv_lora_rank, attn.q_lora_rank
    qk = N + R
    vw = qk if Vd < qk else Vd
    none = _norm(D, c) + c * D + 4 * C + (4 * R if c == 4 else 0) + 4 + 2 * c * C
    none += (_norm(q, c) + c * q) if q else 0
    none += c * H * (2 * qk + 2 * vw) + 4 * H + (c * H * Vd if Vd < qk else 0)
    sel = c * ((q or 0) + H * qk + C + R + H * (N + Vd) + D) + c * H * vw + 4 * H
    return none, sel


def _gqa(attn, c: int, tp: int) -> tuple[float, float]:
    D = attn.q_proj.weight.shape[1]
    Dh = attn.head_dim
    H, Hkv = attn.q_proj.weight.shape[0] // Dh // tp, attn.k_proj.weight.shape[0] // Dh // tp
    none = _norm(D, c) + c * D + 4 * c * H * Dh + 4 * H
    if attn.q_norm is not None:
        none += 4 * (H + Hkv) * Dh + 4 * (H + Hkv) + c * (H + Hkv) * Dh
    sel = c * (H * Dh + 2 * Hkv * Dh + D) + c * H * Dh + 4 * H
    return none, sel


def _gated(mlp, c: int, tp: int) -> tuple[float, float]:
    if hasattr(mlp, "gate_up_proj"):
        width, D = mlp.gate_up_proj.weight.shape[0] // 2, mlp.gate_up_proj.weight.shape[1]
    else:
        width, D = mlp.gate_proj.weight.shape
    I = width // tp  # noqa: E741 - the expert/MLP width's usual name
    return 4 * c * I, c * (2 * I + D)


def _moe(mlp, c: int, tp: int) -> tuple[float, float]:
    E, D, I = mlp.experts.down_proj.shape  # noqa: E741
    K = mlp.gate.top_k
    groups = getattr(mlp.gate, "n_group", 1)
    none = (4 * D if c != 4 else 0) + 4 * E + 12 * K + 4 + 4  # router, top-k, balance-loss statistics
    if groups > 1:
        none += 16 * groups + 8 * mlp.gate.topk_group + E
    none += K * (2 * c * D + 4 * c * I + 4 * D + 20)
    sel = 4 * E + K * c * (2 * I + D)
    if mlp.shared_experts is not None:
        n, s = _gated(mlp.shared_experts, c, tp)
        none, sel = none + n, sel + s
    return none, sel


def layer_activations(layer, c: int, tp: int = 1) -> LayerActivations:
    """:class:`LayerActivations` of a decoder ``layer`` of a skeleton (meta tensors are enough:
    only its param shapes and head counts are read) computing in a dtype of ``c`` bytes, its
    heads and MLP width split over ``tp`` ranks. MTP depths count their block only."""
    attn = layer.self_attn
    D = layer.input_layernorm.weight.shape[0]
    a_none, a_sel = _mla(attn, c, tp) if hasattr(attn, "kv_a_proj_with_mqa") else _gqa(attn, c, tp)
    m_none, m_sel = _moe(layer.mlp, c, tp) if hasattr(layer.mlp, "experts") else _gated(layer.mlp, c, tp)
    sandwich = sum(_norm(D, c) for name in ("post_self_attn_layernorm", "post_mlp_layernorm") if getattr(layer, name, None) is not None)
    none = a_none + _norm(D, c) + c * D + m_none + sandwich
    return LayerActivations(none=none, selective=c * D + a_sel + m_sel, full=c * D)


@dataclass(frozen=True)
class StageActivations:
    """Activations of one pipeline stage for one micro-batch of ``t`` tokens:
    ``per_token * t + per_microbatch`` bytes kept until the micro-batch's backward,
    ``rebuilt * t`` bytes more while one checkpointed layer is recomputed (0 without AC), and
    ``transient`` bytes while the head computes its loss and gradients in the forward."""

    per_token: float
    per_microbatch: float
    rebuilt: float
    transient: float = 0.0

    def kept(self, tokens: int) -> float:
        """Bytes kept for a micro-batch of ``tokens`` tokens."""
        return self.per_token * tokens + self.per_microbatch


def stage_activations(model, layers: range, first: bool, last: bool, c: int, tp: int = 1, ac: str = "none",
                      received: bool = False, sent: bool = False, kinds: LayerKinds | None = None) -> StageActivations:
    """:class:`StageActivations` of the stage of ``model`` holding decoder ``layers`` (with the
    embedding when ``first``; the final norm, head and MTP depths when ``last``; ``received``:
    its input comes from another stage; ``sent``: its output goes to another, which the pipeline
    keeps until the micro-batch's backward), computing in ``c``-byte activations with heads split
    over ``tp`` and activation checkpointing ``ac`` (none, full, selective). ``kinds``: the
    model's :class:`LayerKinds`, to compute each kind of layer once (a plan's many stages).

    Raises:
        ValueError: an unknown ``ac``.
    """
    if ac not in ("none", "full", "selective"):
        raise ValueError(f"--ac {ac!r}: expected none, full or selective")
    skel = model.skeleton
    blocks = skel.model.layers
    L = model.config.num_hidden_layers
    D = skel.model.norm.weight.shape[0]
    rotary = 2 * len(skel._inv_freq)
    one = kinds.activations if kinds is not None else (lambda i, c, tp: layer_activations(blocks[i], c, tp))
    acts = [one(i, c, tp) for i in layers]
    extra = 0.0
    per_mb = transient = 0.0
    if last:
        shapes = model.param_shapes()
        V = -(-shapes["lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"][0] // tp)
        heads = 1
        for k in range(L, len(blocks)):  # MTP depths: enorm, hnorm, eh_proj's input, the block, shared_head.norm
            acts.append(one(k, c, tp))
            extra += 3 * _norm(D, c) + 2 * c * D
            heads += 1
        extra += _norm(D, c) + heads * c * D
        per_mb += heads * c * V * D
        rows = default_chunk_rows(V)  # one chunk's logits, their fp32 copy, the softmax gradient and its cast; the fp32 weight gradient
        transient = (c + 4 + (4 + c if c != 4 else 0)) * rows * V + (4 * V * D if c != 4 else 0)
    per_token = sum(a.kept(ac) for a in acts) + extra + 2 * c * rotary + (8 if first else 0) + c * D * (received + sent)
    rebuilt = max((a.rebuilt(ac) for a in acts), default=0.0)
    return StageActivations(per_token=per_token, per_microbatch=per_mb, rebuilt=rebuilt, transient=transient)
