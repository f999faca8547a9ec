"""Communication volume per device and step, by mesh axis and collective, and its time on the
device's links.

Volumes are the bytes one device sends (as many arrive) with the usual algorithms: all-gather
and reduce-scatter of a tensor of S bytes whole over n ranks move ``(n - 1) / n S`` (the device's
whole copy minus its shard), all-reduce ``2 (n - 1) / n S`` (ring), all-to-all the
``(n - 1) / n`` of its data that goes to other ranks (uniform routing), point-to-point the tensor.
For one micro-batch of t tokens on a device (tp ranks read the same tokens), with c the compute
dtype's bytes:

- FSDP over ``dp_shard`` (and ``ep`` for dense params, whose hidden dim both split): pp = 1
  gathers every weight where it is used, in the compute dtype (the bf16 cast is gathered), once
  per micro-batch (twice for an embedding tied to the head) and again in the backward of a
  checkpointed block, and reduce-scatters its gradient once per gather
  (:func:`mff.parallel.gather.gather`); pp > 1 gathers each
  param once per step in its own dtype and reduce-scatters its gradient once per step
  (``gather_for_step`` / ``reduce_step_grad``).
- HSDP over ``dp_replicate``: the reduced gradient shard is all-reduced (per micro-batch for
  pp = 1, per step for pp > 1).
- TP over ``tp`` (Megatron-LM's layers, :mod:`mff.parallel.tp`): per layer and micro-batch, the
  forward all-reduces the row-parallel outputs (attention's o_proj, the dense or shared-expert
  down_proj: ``t D c`` each) and the backward the input gradients of every column-parallel
  projection (GQA q, k, v and gate, up: ``t D c`` each; MLA the q latent, the kv latent and the
  rotary key); the vocabulary-parallel embedding all-reduces its output, the head its input
  gradient and two fp32 numbers per token. Checkpointed blocks repeat their forward's.
- EP over ``ep`` (:mod:`mff.parallel.ep`): per MoE layer and micro-batch, four all-to-alls of
  the ``t K`` token slots of D values (dispatch and combine, forward and backward; six with a
  checkpointed block), ``(ep - 1) / ep`` of them leaving the device.
- PP over ``pp``: per micro-batch, each stage sends its output hidden states ``t D c`` to the next
  stage and the gradient of its input to the previous one; the token embedding shared by the
  first and the last stage (tied head or MTP) is all-reduced between them once per step.

Not counted: the small collectives of the step (token counts, loss terms, grad norm, expert
loads), GLM-4's fused ``gate_up_proj`` gather over tp, Muon's gathers of sharded matrices.

Time (:func:`comm_seconds`): an axis group whose ranks all sit in one node (the mesh puts ``tp``
innermost, then ``ep``, ``dp_shard``, ``dp_replicate``, ``pp``; a group spans the product of its
size and the sizes inside it) runs at the intra-node bandwidth; a group spanning nodes runs
ring collectives at the inter-node bandwidth, and all-to-all at the inter-node bandwidth for
the share of peers in other nodes and the intra-node one for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mff.plan.shards import ParamShard

__all__ = ["CommRow", "fsdp_rows", "layer_rows", "pp_rows", "comm_seconds", "axis_span"]

_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "tp")


@dataclass(frozen=True)
class CommRow:
    """``bytes`` one device sends per step over the mesh ``axes`` by ``op``; ``per`` says
    whether it is paid per micro-batch (inside the pipeline) or once per step."""

    axes: tuple[str, ...]
    op: str
    bytes: float
    per: str  # "micro-batch" (bytes summed over the step's micro-batches) or "step"


def axis_span(axes: Sequence[str], sizes: Mapping[str, int]) -> tuple[int, int]:
    """``(ranks in the group, span)`` of a group over mesh ``axes``: the span is how many
    consecutive global ranks the group's block covers (its size times the sizes inside it)."""
    inner = min(_ORDER.index(a) for a in axes)
    n, span = 1, 1
    for a in _ORDER[inner:]:
        span *= sizes[a]
        if a in axes:
            n *= sizes[a]
    return n, span


def fsdp_rows(shards: Sequence[ParamShard], *, pipelined: bool, precision: str, micro_batches: int, ac: str,
              blocks: Mapping[str, int], sizes: Mapping[str, int], uses: Mapping[str, int] | None = None) -> list[CommRow]:
    """FSDP and HSDP rows for the params ``shards`` of one device (module docstring); ``uses``:
    params gathered more than once a forward when pp = 1 (an embedding tied to the head: 2)."""
    storage = 2 if precision == "bf16" else 4
    c = 4 if precision == "fp32" else 2
    rows: dict[tuple[tuple[str, ...], str], float] = {}

    def add(axes, op, n):
        if n > 0:
            rows[(axes, op)] = rows.get((axes, op), 0.0) + n

    for s in shards:
        expert = ".experts." in s.path
        axes = tuple(a for a in (("dp_shard",) if expert else ("dp_shard", "ep")) if sizes[a] > 1) or ("dp_shard",)
        gather_b = 4 if s.fp32 else (storage if pipelined else c)
        grad_b = 4 if s.fp32 else (storage if pipelined else c)
        times = 1 if pipelined else micro_batches * (uses or {}).get(s.path, 1)
        regather = 2 if (not pipelined and ac != "none" and s.path in blocks) else 1
        add(axes, "all-gather params", (s.gathered - s.local) * gather_b * times * regather)
        if s.trainable:
            add(axes, "reduce-scatter grads", (s.gathered - s.local) * grad_b * times)
            n = sizes["dp_replicate"]
            add(("dp_replicate",), "all-reduce grads", 2 * (n - 1) / n * s.local * grad_b * times)
    per = "step" if pipelined else "micro-batch"
    return [CommRow(axes, op, b, per) for (axes, op), b in rows.items()]


def layer_rows(model, layers: Sequence[int], *, tokens: int, micro_batches: int, precision: str, ac: str, sizes: Mapping[str, int],
               first: bool, last: bool) -> list[CommRow]:
    """TP and EP rows of one device computing decoder ``layers`` (indices into the skeleton's
    blocks, MTP depths included) of ``model``, plus the embedding (``first``) and head
    (``last``), for ``micro_batches`` micro-batches of ``tokens`` tokens each."""
    c = 4 if precision == "fp32" else 2
    tp, ep = sizes["tp"], sizes["ep"]
    ar = 2 * (tp - 1) / tp
    fwd = 2 if ac != "none" else 1  # a checkpointed block runs its forward twice
    tp_bytes = ep_bytes = 0.0
    blocks = model.skeleton.model.layers
    for i in layers:
        layer = blocks[i]
        D = layer.input_layernorm.weight.shape[0]
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "kv_a_proj_with_mqa"):
            back = [attn.q_lora_rank or D, attn.kv_lora_rank, attn.rope]
        else:
            back = [D, D, D]
        fwd_widths = [D]
        moe = hasattr(mlp, "experts")
        if not moe or mlp.shared_experts is not None:
            fwd_widths.append(D)
            back += [D, D]
        tp_bytes += ar * tokens * c * (fwd * sum(fwd_widths) + sum(back))
        if moe and ep > 1:
            K = mlp.gate.top_k
            ep_bytes += (2 * fwd + 2) * tokens * K * D * c * (ep - 1) / ep
    D = model.skeleton.model.norm.weight.shape[0]
    if first:
        tp_bytes += ar * tokens * D * c
    if last:
        heads = 1 + max(0, len(blocks) - model.config.num_hidden_layers)
        tp_bytes += heads * tokens * (ar * D * c + (tp - 1) * 2 * 4)
    rows = []
    if tp > 1:
        rows.append(CommRow(("tp",), "all-reduce activations", tp_bytes * micro_batches, "micro-batch"))
    if ep_bytes:
        rows.append(CommRow(("ep",), "all-to-all token slots", ep_bytes * micro_batches, "micro-batch"))
    return rows


def pp_rows(stages: Sequence[int], num_stages: int, *, tokens: int, micro_batches: int, hidden: int, precision: str,
            shared_bytes: float) -> list[CommRow]:
    """Point-to-point rows of one pp rank holding ``stages`` of ``num_stages``, and the all-reduce
    of ``shared_bytes`` of params shared by the first and last stage (when this rank holds one)."""
    c = 4 if precision == "fp32" else 2
    sends = sum((s < num_stages - 1) + (s > 0) for s in stages)
    rows = []
    if sends:
        rows.append(CommRow(("pp",), "send/recv activations", sends * tokens * hidden * c * micro_batches, "micro-batch"))
    if shared_bytes:
        rows.append(CommRow(("pp",), "all-reduce shared embedding grads", shared_bytes, "step"))
    return rows


def comm_seconds(row: CommRow, sizes: Mapping[str, int], intra_bw: float, inter_bw: float, per_node: int) -> float:
    """Seconds ``row`` takes on links of ``intra_bw`` and ``inter_bw`` bytes/s per device each
    way, ``per_node`` devices a node (module docstring)."""
    n, span = axis_span(row.axes, sizes)
    if row.op.startswith("send"):  # neighbours on the pp axis: two ranks its inner sizes apart
        n, span = 2, 2 * span // sizes["pp"]
    if span <= per_node or n == 1:
        return row.bytes / intra_bw
    if row.op.startswith("all-to-all"):
        peers_in_node = max(1, n * per_node // span)  # ranks of the group in one node
        outside = (n - peers_in_node) / max(1, n - 1)
        return row.bytes * (outside / inter_bw + (1 - outside) / intra_bw)
    return row.bytes / inter_bw
