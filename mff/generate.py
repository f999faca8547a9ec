"""Text generation over ``model.forward`` with a KV cache.

:func:`generate` prefills the prompt (whole or in chunks) into a preallocated KV cache, then
decodes one token at a time: each step feeds only the new token, reads the cache, and samples
(:mod:`mff.sampling`). Rows of a batch may have different prompt lengths (left padding with
``attention_mask``); each row yields the same tokens as when generated alone. A row stops at
EOS or any stop id (keeping that token), then emits ``pad_token_id``.

:func:`greedy_generate` is the plain reference loop without a cache (each step runs the whole
sequence again): exact and slow, for tests.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from mff.model import Model
from mff.nn.layers import _side_by_side, is_plain
from mff.sampling import SamplingConfig, mark_seen, sample, seen_mask_from_ids

__all__ = ["cache_bucket", "decode_layout", "generate", "greedy_generate", "inference_mode_applies", "outside_inference_mode"]


def _ids(x: int | Iterable[int] | None, name: str = "eos_token_id") -> list[int]:
    if x is None:
        return []
    items = [x] if isinstance(x, int) else (list(x) if isinstance(x, (list, tuple, set)) else None)
    if items is None or any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise ValueError(f"{name}={x!r} must be an int or a list of ints")
    return items


def inference_mode_applies(params: Mapping[str, torch.Tensor], device: torch.device) -> bool:
    """Whether inference without autograd may run under ``torch.inference_mode`` rather than
    ``torch.no_grad``: every param a plain tensor (no DTensor or other subclass) and ``device`` a
    CPU or CUDA device (the only ones where it was measured and tested). Inference mode skips the
    version counters and view tracking that ``no_grad`` still keeps: measured 6-8% less time per
    eager decode step on the benchmark configs; for the serving engine (``mff.serve.Engine``,
    1 thread, 2026-12-06) 7% and 14% more tokens/s with one request on qwen3_bench and
    deepseek3_bench, -1% and +6% with 16."""
    return torch.device(device).type in ("cpu", "cuda") and all(is_plain(v) for v in params.values())


@contextlib.contextmanager
def outside_inference_mode() -> Iterator[None]:
    """For user callbacks called from code running under ``torch.inference_mode``: leave it and
    run under ``torch.no_grad``, so tensors the callback makes are ordinary ones it may keep or
    modify in place. Outside inference mode, the current grad mode is kept (nothing changes)."""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


def _without_autograd(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Run ``fn(model, params, input_ids, ...)`` under ``torch.inference_mode`` where
    :func:`inference_mode_applies` (``input_ids``' device), else under ``torch.no_grad``; its
    result is returned as an ordinary tensor (cloned outside inference mode)."""

    @functools.wraps(fn)
    def wrapper(model: Model, params: Mapping[str, torch.Tensor], input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        plain = (isinstance(input_ids, torch.Tensor) and isinstance(params, Mapping)
                 and inference_mode_applies(params, input_ids.device))  # anything else: generate's own checks raise
        with torch.inference_mode() if plain else torch.no_grad():
            ids = fn(model, params, input_ids, *args, **kwargs)
        return ids.clone()  # outside inference mode: an ordinary tensor the caller may modify in place

    return wrapper


@_without_autograd
def generate(
    model: Model,
    params: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    *,
    attention_mask: torch.Tensor | None = None,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    stop_token_ids: Iterable[int] = (),
    pad_token_id: int = 0,
    seed: int | None = None,
    prefill_chunk: int = 0,
    on_token: Callable[[torch.Tensor], None] | None = None,
    stop_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    compile: bool = False,
    timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """Continue ``input_ids`` by up to ``max_new_tokens`` tokens per row.

    Args:
        input_ids: int64 [B, T], left-padded when rows differ in length.
        attention_mask: [B, T], 0 at padding (default: no padding).
        sampling: temperature / top-k / top-p / min-p / repetition penalty; default greedy.
        eos_token_id, stop_token_ids: a row stops after emitting any of these ids.
        pad_token_id: emitted by rows that have stopped.
        seed: seeds the sampling generator (same seed, same tokens on the same device).
        prefill_chunk: prefill the prompt this many tokens at a time (0 = all at once).
        on_token: called with each step's ids int64 [B] (for streaming).
        stop_fn: called (after ``on_token``) with each step's ids int64 [B]; returns bool [B],
            the rows to stop now as if they had emitted EOS (stop strings, for evaluation).
        compile: run each decode step as one ``torch.compile``-d graph (same shapes at every
            position). The cache is allocated to :func:`cache_bucket` slots, so the graph is
            built once per model, batch size and bucket (powers of two from 256), whatever the
            prompt length and ``max_new_tokens``; the first call in a process traces it, and
            Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) spares later processes the
            kernel compilation. Mat-vecs then stream the weights in fused loops.
        timings: filled (when given) with the decode steps' wall times in seconds:
            ``first_step_s`` (the first step: it includes the compilation under ``compile``),
            ``step_s`` (the median of the later steps) and ``steps``; the device is
            synchronised around each step for it.
    Eager decoding reads ``params`` once, at the start (:meth:`Model.bind`): a callback that
    replaces tensors in that dict does not change the tokens (changing them in place does).
    Runs under ``torch.inference_mode`` (no autograd bookkeeping: measured 6-8% less time per
    eager decode step than ``torch.no_grad`` on the benchmark configs) when the params are plain
    tensors on a CPU or CUDA device; otherwise (DTensors and other tensor subclasses, whose
    Python dispatch cannot make views of inference tensors, and devices not tried with it, such
    as the NPU) under ``torch.no_grad``. ``on_token`` and
    ``stop_fn`` run outside it, under ``torch.no_grad``, and get ordinary tensors (copies of the
    step's ids, theirs to keep or modify); the returned ids are an ordinary tensor unless the
    caller itself runs under ``torch.inference_mode``.

    Returns:
        int64 [B, T + n], n <= ``max_new_tokens`` (fewer when every row stopped early).
    Raises:
        ValueError: an empty prompt, ``max_new_tokens`` < 0, a prompt plus ``max_new_tokens``
            longer than the model's context, a row of ``attention_mask`` with no token, bad
            sampling parameters (named), ``prefill_chunk`` < 0, right padding (a row whose mask
            ends in 0), ids outside the vocabulary, a ``pad_token_id`` outside it, a bad seed.
    """
    sampling = sampling or SamplingConfig(temperature=0.0)
    sampling.validate()
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"the prompt is empty or not [B, T] token ids: {shape}; give at least one token per row")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 0 (0 = the whole prompt at once)")
    B, T = input_ids.shape
    limit = model.config.max_position_embeddings
    if T + max_new_tokens > limit:
        raise ValueError(f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} exceeds the model's "
                         f"context (max_position_embeddings {limit})")
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask = attention_mask.bool()
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    if not bool(attention_mask.any(-1).all()):
        raise ValueError("a row of attention_mask has no token (an empty prompt)")
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("a row of attention_mask ends in padding: pad prompts on the left (generation continues from the last position)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int")
    V = model.config.vocab_size
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id < V:
        raise ValueError(f"pad_token_id={pad_token_id!r} must be an id in [0, vocab_size={V})")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**63)")
    model._check_inputs(params, {"input_ids": input_ids, "attention_mask": attention_mask}, None)  # the whole prompt, once
    stops = sorted(set(_ids(eos_token_id) + _ids(tuple(stop_token_ids), "stop_token_ids")))
    stop_t = torch.tensor(stops, dtype=torch.int64, device=device)
    dtype = params["model.embed_tokens.weight"].dtype
    capacity = cache_bucket(T + max_new_tokens, limit) if compile else T + max_new_tokens
    cache = model.init_cache(B, capacity, dtype=dtype, device=device)
    # greedy decoding draws nothing: no generator (a device without torch.Generator support still decodes)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None and not sampling.greedy else None
    seen = seen_mask_from_ids(input_ids.masked_fill(~attention_mask, -1), V) if sampling.repetition_penalty != 1.0 else None

    with contextlib.ExitStack() as stack:
        # eager: the params are swapped into the skeleton once for the whole call (Model.bind),
        # not twice per token; the compiled step takes them as inputs of its graph, and a
        # generate called from inside another one's callback (the model already bound) swaps per call
        forward = (functools.partial(model.forward, params, check=False) if compile or model.is_bound
                   else stack.enter_context(model.bind(params)))
        chunk = prefill_chunk or T
        logits = None
        for start in range(0, T, chunk):
            batch = {"input_ids": input_ids[:, start:start + chunk], "attention_mask": attention_mask[:, start:start + chunk]}
            out = forward(batch, cache, logits="last")
            cache, logits = out.cache, out.logits[:, -1]
        out_ids = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=device)
        step_fn = _compiled_step(model, device) if compile else _bound_step(forward)
        skip_guards = compile
        step_times: list[float] = []
        cache = {k: v for k, v in cache.items() if k != "offset"}  # capacity was checked above
        for step in range(max_new_tokens):
            nxt = sample(logits.float(), sampling, gen, seen)
            nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
            out_ids.append(nxt[:, None])
            if on_token is not None or stop_fn is not None:
                with outside_inference_mode():  # callbacks get ordinary tensors, as before
                    shown = nxt.clone()
                    if on_token is not None:
                        on_token(shown)
                    if stop_fn is not None:
                        stopped = stop_fn(shown.clone()).to(device=device, dtype=torch.bool)
                if stop_fn is not None:
                    done = done | stopped
            if stops:
                done = done | torch.isin(nxt, stop_t)
            if (stops or stop_fn is not None) and bool(done.all()):
                break
            if step == max_new_tokens - 1:
                break
            if seen is not None:
                seen = mark_seen(seen, nxt.clamp(0, V - 1))
            t0 = _clock(device) if timings is not None else 0.0
            if skip_guards and step >= 2:
                logits, cache, skip_guards = _step_skipping_guards(step_fn, params, nxt, cache)
            else:
                logits, cache = step_fn(params, nxt, cache)
            if timings is not None:
                step_times.append(_clock(device) - t0)
        if timings is not None:
            timings.update(_summary(step_times))
        return torch.cat(out_ids, dim=1)


def _step_skipping_guards(step_fn: Callable, params, nxt: torch.Tensor, cache) -> tuple[torch.Tensor, Any, bool]:
    """One compiled step with Dynamo's guards skipped (the loop's inputs keep their shapes, and
    the guards passed on the first two steps). Where no compiled graph serves the call without
    them (Dynamo's ``recompile_limit`` reached by earlier batch sizes, dtypes, buckets or models
    in this process, so that the first steps ran uncompiled; or an input a callback changed),
    Dynamo refuses the unsafe call before running anything: the step then runs again with its
    guards, which recompile or fall back to eager, and the returned flag (False) keeps them on
    for the rest of the loop. Returns (logits, cache, whether to keep skipping)."""
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            logits, cache = step_fn(params, nxt, cache)
        return logits, cache, True
    except RuntimeError as e:
        if "skip_guard_eval_unsafe" not in str(e):
            raise
    logits, cache = step_fn(params, nxt, cache)
    return logits, cache, False


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)
    return time.perf_counter()


def _summary(step_times: list[float]) -> dict[str, float]:
    if not step_times:
        return {"steps": 0}
    later = sorted(step_times[1:])
    out = {"steps": len(step_times), "first_step_s": step_times[0]}
    if later:
        out["step_s"] = later[len(later) // 2]
    return out


# projections that read the same input, laid side by side by decode_layout (mff.nn.layers.linears)
SIBLING_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
                       ("q_proj", "kv_a_proj_with_mqa"))


def decode_layout(params: Mapping[str, torch.Tensor], on_cpu_only: bool = True) -> dict[str, torch.Tensor]:
    """``params`` laid out for eager decoding: each 2-D projection weight ``W`` [out, in] (every
    2-D ``*.weight`` but the token embedding, which is looked up by rows) with more outputs than
    inputs becomes the transposed view of a contiguous ``W^T`` [in, out] copy, and so does each
    expert's matrix of a stacked routed-expert weight [E, out, in] of that shape; weights with
    ``out <= in`` keep their row-major ``W``. Shapes, dtypes and values are unchanged, so the
    model code is too. In a batch-1 mat-vec the CPU BLAS (MKL) streams a wide, short weight
    fastest as ``x @ W^T`` over a row-major ``W^T`` and a tall one (a down projection) fastest as
    row-major ``W``: on 2 cores, fp32, a 512 -> 1536 projection reads at 19.5 GB/s as ``W^T``
    and 10.3 as ``W``, a 1536 -> 512 one at 11.5 as ``W^T`` and 15.5 as ``W``; with the
    mat-vec split over threads (:func:`mff.nn.layers.threaded_matvec`) 25.5 and 27.5 GB/s.

    Projections of one module that read the same input (:data:`SIBLING_PROJECTIONS`: q/k/v,
    gate/up, MLA's q_a (or q) and kv_a) share one copy, each weight (and bias) a view of its
    part: ``[in, sum out]`` (``W^T`` side by side) when ``sum out > in``, else ``[sum out, in]``
    (``W`` stacked), so :func:`mff.nn.layers.linears` runs them as one mat-vec. With
    ``on_cpu_only`` (default) tensors on other devices are kept as they are.

    Returns a new dict (other params are the same tensor objects); the copies take as much
    memory as the weights they replace, whose memory is freed once nothing else holds them, and
    need no grad (made under ``torch.no_grad``). Params already laid out are kept, so a second
    call copies nothing. Meant for inference (``generate``): the params of training keep their
    own layout.
    """
    with torch.no_grad():
        return _decode_layout(params, on_cpu_only)


def _decode_layout(params: Mapping[str, torch.Tensor], on_cpu_only: bool) -> dict[str, torch.Tensor]:
    def movable(v: torch.Tensor) -> bool:
        return v.is_contiguous() and (v.device.type == "cpu" or not on_cpu_only)

    def plain(v: torch.Tensor) -> bool:
        return is_plain(v) and movable(v)

    out = dict(params)
    done: set[str] = set()
    for k in params:
        if not k.endswith(".weight"):
            continue
        module, _, _ = k[:-len(".weight")].rpartition(".")
        for names in SIBLING_PROJECTIONS:
            keys = [f"{module}.{n}.weight" for n in names]
            if k != keys[0] or not all(key in params for key in keys):
                continue
            ws = [params[key] for key in keys]
            bias_keys = [f"{module}.{n}.bias" for n in names]
            biases = [params.get(key) for key in bias_keys]
            has_bias = [b is not None for b in biases]
            if (not all(plain(w) and w.dim() == 2 for w in ws) or len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1
                    or any(has_bias) and not (all(has_bias) and all(plain(b) and b.dtype == ws[0].dtype for b in biases))):
                continue
            wide = sum(w.shape[0] for w in ws) > ws[0].shape[1]
            if not wide and _side_by_side(ws) is not None and (not any(has_bias) or _side_by_side(biases) is not None):
                continue  # stacked row-major in one storage already (a second call)
            joint = torch.cat([w.t() for w in ws], dim=1) if wide else torch.cat(ws)  # [in, sum out] or [sum out, in]
            joint_bias = torch.cat(biases) if all(has_bias) else None
            start = 0
            for i, w in enumerate(ws):
                out[keys[i]] = joint[:, start:start + w.shape[0]].t() if wide else joint[start:start + w.shape[0]]
                if joint_bias is not None:
                    out[bias_keys[i]] = joint_bias[start:start + w.shape[0]]
                start += w.shape[0]
            done.update(keys)
    for k, v in params.items():
        if k in done or not movable(v):
            continue
        if v.dim() < 2 or v.shape[-2] <= v.shape[-1]:  # out <= in: the row-major W it has
            continue
        if v.dim() == 2 and k.endswith(".weight") and k != "model.embed_tokens.weight":
            out[k] = v.t().contiguous().t()
        elif v.dim() == 3 and k.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[k] = v.transpose(1, 2).contiguous().transpose(1, 2)  # each expert's [out, in] as above
    return out


CACHE_BUCKET_MIN = 256


def cache_bucket(length: int, limit: int) -> int:
    """The KV-cache capacity a compiled decode step is built for: the smallest power of two
    >= ``length`` (at least :data:`CACHE_BUCKET_MIN`), at most ``limit`` (the model's
    context). Every prompt length and ``max_new_tokens`` that fits one bucket reuses the same
    compiled graph (same shapes); slots past the tokens are masked as ``valid`` False, so the
    tokens do not depend on the bucket."""
    cap = CACHE_BUCKET_MIN
    while cap < length:
        cap *= 2
    return min(cap, limit)


def _eager_step(model: Model):
    def step(params, tok, cache):
        out = model.forward(params, {"input_ids": tok[:, None]}, cache, check=False)
        return out.logits[:, -1], out.cache

    return step


def _bound_step(forward: Callable[..., Any]):
    """The eager step over ``forward`` from :meth:`Model.bind` (params already in the skeleton;
    the step's ``params`` argument is ignored)."""
    def step(params, tok, cache):
        out = forward({"input_ids": tok[:, None]}, cache)
        return out.logits[:, -1], out.cache

    return step


_COMPILED: dict[tuple[int, str], Callable] = {}


def _compiled_step(model: Model, device: torch.device):
    """One decode step (forward of one token per row against the cache) as a compiled graph,
    cached per model object and device type.

    Two Inductor options cut the host time around the step's kernels (in-process A/B on 2
    cores, 2026-12-07, the same tokens):

    - ``cpp_wrapper=True`` on a CPU: the code that calls the kernels is compiled instead of run
      as Python: step time -6% / -3% (fp32 / bf16) on deepseek3_bench, +1% / -2.5% on
      qwen3_bench (within the noise); the first compile of deepseek3_bench ~4 s longer (32.5
      against 28.5 s). Other devices keep the Python wrapper (unmeasured here).
    - ``size_asserts=False``, all devices: the wrapper does not re-check the size and stride of
      each of the step's inputs (every param and cache tensor, 111 on deepseek3_bench) on every
      call; Dynamo's guards check the same on the first two calls, after which :func:`generate`
      skips them for a loop whose inputs keep their shapes by construction. On top of the C++
      wrapper: step time -8% / -6% (fp32 / bf16) on both configs, single run pairs ranging from
      -25% to +20% on this noisy machine (a trivial step with the same 111 inputs: 117 -> 74 us
      a call)."""
    key = (id(model), device.type)
    if key not in _COMPILED:
        _COMPILED.clear()  # one model at a time: drop graphs of models that may be gone
        options = {"size_asserts": False, **({"cpp_wrapper": True} if device.type == "cpu" else {})}
        _COMPILED[key] = torch.compile(_eager_step(model), dynamic=False, options=options)
    return _COMPILED[key]


@torch.no_grad()
def greedy_generate(
    model: Model,
    params: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Iterable[int] | None = None,
) -> torch.Tensor:
    """Reference greedy loop without a cache: each step runs the full sequence.

    Stops early when every row has produced an EOS id (rows that stopped keep emitting that
    EOS id). Returns int64 [B, T + n] with n <= ``max_new_tokens``.

    Raises:
        ValueError: ``max_new_tokens`` < 0 or a sequence longer than the model accepts.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    limit = model.config.max_position_embeddings
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_position_embeddings {limit}")
    eos = set(_ids(eos_token_id))
    ids = input_ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        logits = model.forward(params, {"input_ids": ids}).logits[:, -1]
        nxt = logits.argmax(-1)
        if eos:
            nxt = torch.where(done, ids[:, -1], nxt)
            done |= torch.isin(nxt, torch.tensor(sorted(eos), device=ids.device))
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        if eos and bool(done.all()):
            break
    return ids
