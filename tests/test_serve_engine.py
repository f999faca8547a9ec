"""The serving engine (issue 18): continuous batching over a paged KV cache, in process.

The reference for every token is :func:`mff.generate.generate` on the request alone (dense cache,
batch 1, same seed); for log-probabilities, ``log_softmax`` of ``model.forward``'s logits over
the whole prompt.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from layout_worker import tiny

from mff.generate import generate
from mff.nn.paged import paged_batch
from mff.sampling import SamplingConfig
from mff.serve.blocks import BlockPool
from mff.serve.engine import Engine, EngineConfig
from mff.serve.request import EngineRequest, QueueFullError

FAMILIES = ["qwen3", "deepseek3", "qwen3_moe", "glm4_moe", "telechat3"]
_MODELS: dict[str, tuple] = {}


def _model(family: str):
    if family not in _MODELS:
        model = tiny(family)
        _MODELS[family] = (model, model.init(seed=0))
    return _MODELS[family]


def _requests(vocab: int, count: int = 16, seed: int = 1, stop_every: int = 0) -> list[EngineRequest]:
    """Prompts of 1-40 tokens, 1-30 new tokens; even requests greedy, odd ones seeded sampling (a
    quarter with a repetition penalty); with ``stop_every``, every such request also stops at an id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 40, (), generator=g)),), generator=g).tolist()
        sampling = (SamplingConfig(temperature=0.0) if i % 2 == 0 else
                    SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1 if i % 4 == 1 else 1.0))
        stops = tuple(torch.randint(0, vocab, (8,), generator=g).tolist()) if stop_every and i % stop_every == 0 else ()
        out.append(EngineRequest(f"r{i}", prompt, int(torch.randint(1, 30, (), generator=g)), sampling, seed=100 + i,
                                 stop_token_ids=stops))
    return out


def _solo(model, params, req: EngineRequest) -> list[int]:
    ids = generate(model, params, torch.tensor([list(req.prompt_ids)]), req.max_tokens, sampling=req.sampling, seed=req.seed,
                   eos_token_id=list(req.stop_token_ids) or None)
    return ids[0, len(req.prompt_ids):].tolist()


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_request_yields_its_solo_tokens(family):
    """16 requests of different lengths, greedy and seeded sampling, some with stop ids, batched
    with chunked prefills: each yields exactly what generate gives it alone."""
    model, params = _model(family)
    reqs = _requests(model.config.vocab_size, stop_every=3)
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=400, max_num_batched_tokens=48))
    outs = engine.run(reqs)
    for r in reqs:
        assert _tokens(outs[r.request_id]) == _solo(model, params, r), r.request_id
        last = outs[r.request_id][-1]
        assert last.finished and last.finish_reason in ("stop", "length")
        assert last.num_generated_tokens == len(_tokens(outs[r.request_id]))
    m = engine.metrics()
    assert m["preemptions"] == 0 and m["blocks_used"] == 0 and m["running"] == m["waiting"] == 0
    assert m["steps"] < sum(len(r.prompt_ids) + r.max_tokens for r in reqs) / 4  # requests really shared steps


@pytest.mark.parametrize("family", ["qwen3", "deepseek3"])
def test_a_small_cache_preempts_and_every_request_still_gets_its_tokens(family):
    model, params = _model(family)
    reqs = _requests(model.config.vocab_size, seed=2)
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=24, max_num_batched_tokens=32))
    start_free = engine.pool.num_free()
    outs = engine.run(reqs)
    for r in reqs:
        assert _tokens(outs[r.request_id]) == _solo(model, params, r), r.request_id
    assert engine.metrics()["preemptions"] > 0
    assert engine.pool.num_free() == start_free and engine.pool.num_used() == 0


def test_shared_prefixes_reuse_cached_blocks():
    model, params = _model("qwen3")
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, V, (21,), generator=g).tolist()
    reqs = [EngineRequest(f"p{i}", system + torch.randint(0, V, (3 + i,), generator=g).tolist(), 6) for i in range(6)]
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=200, max_num_seqs=1))  # one at a time: later ones find it
    outs = engine.run(reqs)
    for r in reqs:
        assert _tokens(outs[r.request_id]) == _solo(model, params, r)
    assert [outs[r.request_id][-1].num_cached_tokens for r in reqs] == [0] + [20] * 5  # 5 full blocks of the shared 21
    assert engine.metrics()["prefix_cache_hit_tokens"] == 100
    off = Engine(model, params, EngineConfig(block_size=4, num_blocks=200, max_num_seqs=1, prefix_caching=False))
    assert off.run(reqs[:2])["p1"][-1].num_cached_tokens == 0


@pytest.mark.parametrize("family", ["qwen3", "deepseek3"])
def test_prompt_and_token_logprobs_are_the_forward_log_softmax(family):
    model, params = _model(family)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=100, max_num_batched_tokens=8))  # 4 prefill chunks
    outs = engine.run([EngineRequest("a", prompt, 3, logprobs=2, prompt_logprobs=3),
                       EngineRequest("b", prompt[:5], 0, prompt_logprobs=0)])
    gen = _tokens(outs["a"])
    full = torch.tensor([prompt + gen])
    with torch.no_grad():
        lsm = model.forward(params, {"input_ids": full}).logits[0].float().log_softmax(-1)
    plp = outs["a"][0].prompt_logprobs
    assert len(plp) == 30 and plp[0] is None
    for i in range(1, 30):
        assert plp[i].token_id == prompt[i]
        assert plp[i].logprob == pytest.approx(float(lsm[i - 1, prompt[i]]), abs=1e-4)
        top = lsm[i - 1].topk(3)
        assert list(plp[i].top) == top.indices.tolist()
    got = [lp for o in outs["a"] for lp in (o.new_logprobs or [])]
    assert [lp.token_id for lp in got] == gen
    for j, lp in enumerate(got):
        assert lp.logprob == pytest.approx(float(lsm[29 + j, gen[j]]), abs=1e-4)
        assert list(lp.top) == lsm[29 + j].topk(2).indices.tolist()
    b = outs["b"]
    assert len(b) == 1 and b[0].finish_reason == "length" and b[0].new_token_ids == []
    assert [lp.token_id for lp in b[0].prompt_logprobs[1:]] == prompt[1:5]


def test_stop_check_ends_the_request_after_the_token():
    model, params = _model("qwen3")
    req = EngineRequest("s", [1, 2, 3], 20)
    solo = _solo(model, params, req)
    req.stop_check = lambda generated: len(generated) == 4
    out = Engine(model, params, EngineConfig(num_blocks=50)).run([req])["s"]
    assert _tokens(out) == solo[:4] and out[-1].finish_reason == "stop"


def test_paged_batch_layout():
    pb = paged_batch([[3, 5], [7]], [5, 0], [2, 3], block_size=4)
    assert pb.position_ids.tolist() == [[5, 6, 0, 1, 2]]
    assert pb.write_slots.tolist() == [5 * 4 + 1, 5 * 4 + 2, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]
    assert pb.read_slots.tolist() == [[12, 13, 14, 15, 20, 21, 22, 23], [28, 29, 30, 31, 0, 1, 2, 3]]
    assert pb.mask.shape == (2, 1, 3, 8)
    assert pb.mask[0, 0, 0].tolist() == [True] * 6 + [False] * 2 and not pb.mask[0, 0, 2].any()  # row 0 has 2 queries
    assert pb.mask[1, 0, 1].tolist() == [True, True] + [False] * 6
    with pytest.raises(ValueError, match="sequence 0 has 5 cached \\+ 4 new tokens but its block table holds 8"):
        paged_batch([[3, 5]], [5], [4], block_size=4)


def test_block_pool_counts_and_eviction():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert {a, b, c} == {1, 2, 3} and pool.allocate() is None
    pool.register(a, b"k")
    pool.release([a, b])
    assert pool.num_free() == 2 and pool.lookup([b"k", b"x"]) == [a]  # the registered block comes back, held
    pool.release([a])
    assert pool.allocate() == b and pool.allocate() == a and pool.lookup([b"k"]) == []  # evicted last, then forgotten
    with pytest.raises(RuntimeError, match="block 2 released but not held"):
        pool.release([b, b])
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)


def test_background_thread_abort_and_shutdown():
    model, params = _model("qwen3")
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=100))
    engine.start()
    try:
        done = {i: threading.Event() for i in range(4)}
        got: dict[int, list] = {i: [] for i in range(4)}

        def sink(i):
            def on(out):
                got[i].append(out)
                if out.finished:
                    done[i].set()
            return on

        for i in range(4):  # from several threads at once
            threading.Thread(target=engine.add_request,
                             args=(EngineRequest(f"t{i}", [i + 1] * (5 + i), 200, ignore_eos=True), sink(i))).start()
        deadline = time.monotonic() + 60
        while not all(got[i] for i in range(4)) and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.abort("t1")
        engine.abort("t3")
        for i in range(4):
            assert done[i].wait(120), i
        assert got[1][-1].finish_reason == got[3][-1].finish_reason == "abort"
        assert got[0][-1].finish_reason == "length" and len(_tokens(got[0])) == 200
        assert engine.metrics()["blocks_used"] == 0
        late: list = []
        engine.add_request(EngineRequest("late", [1], 100, ignore_eos=True), late.append)
    finally:
        engine.shutdown()
    assert late[-1].finished and late[-1].finish_reason in ("abort", "length")  # shutdown ends what is left
    assert engine.metrics()["blocks_used"] == 0 and engine.metrics()["running"] == 0
    with pytest.raises(ValueError, match="shutting down"):
        engine.add_request(EngineRequest("after", [1], 1), late.append)


def test_bad_requests_are_refused_naming_the_field():
    model, params = _model("qwen3")
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=10, max_waiting=2))
    V, ctx = model.config.vocab_size, model.config.max_position_embeddings
    cases = [
        (EngineRequest("", [1], 1), "request_id ''"),
        (EngineRequest("x", [], 1), "the prompt is empty"),
        (EngineRequest("x", [V], 1), f"prompt token {V} is not an id in \\[0, vocab_size={V}\\)"),
        (EngineRequest("x", [1], -1), "max_tokens -1"),
        (EngineRequest("x", [1] * 10, ctx), f"exceeds the model's context of {ctx}"),
        (EngineRequest("x", [1] * 10, 40), "needs 13 cache blocks of 4 tokens but the cache has 9"),
        (EngineRequest("x", [1], 1, SamplingConfig(temperature=-1.0)), "temperature=-1.0"),
        (EngineRequest("x", [1], 1, seed=-5, sampling=SamplingConfig(temperature=1.0)), "seed -5"),
        (EngineRequest("x", [1], 1, stop_token_ids=(V + 3,)), f"stop_token_ids: {V + 3}"),
        (EngineRequest("x", [1], 1, logprobs=21), "logprobs 21"),
    ]
    for req, needle in cases:
        with pytest.raises(ValueError, match=needle):
            engine.add_request(req, lambda o: None)
    engine.add_request(EngineRequest("a", [1], 1), lambda o: None)
    with pytest.raises(ValueError, match="request_id 'a' is already in the engine"):
        engine.add_request(EngineRequest("a", [1], 1), lambda o: None)
    engine.add_request(EngineRequest("b", [1], 1), lambda o: None)
    with pytest.raises(QueueFullError, match="2 requests are waiting"):
        engine.add_request(EngineRequest("c", [1], 1), lambda o: None)
    with pytest.raises(ValueError, match="--engine.block-size 0"):
        Engine(model, params, EngineConfig(block_size=0))
    with pytest.raises(ValueError, match="--engine.cache-memory-gib nan"):
        Engine(model, params, EngineConfig(cache_memory_gib=float("nan")))


def test_a_failing_consumer_or_forward_ends_only_its_requests(monkeypatch):
    model, params = _model("qwen3")
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=100))

    def bad_check(generated):
        raise KeyError("boom")

    outs = engine.run([EngineRequest("bad", [1, 2], 10, stop_check=bad_check), EngineRequest("good", [3, 4], 10)])
    assert outs["bad"][-1].finish_reason == "stop" and len(_tokens(outs["bad"])) == 1
    assert _tokens(outs["good"]) == _solo(model, params, EngineRequest("good", [3, 4], 10))
    assert "stop_check of 'bad': KeyError" in engine.last_error
    real = model.forward
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    first = engine.run([EngineRequest("x", [5], 3)])
    assert first["x"][-1].finish_reason == "abort" and "device lost" in engine.last_error
    second = engine.run([EngineRequest("y", [5], 3)])
    assert _tokens(second["y"]) == _solo(model, params, EngineRequest("y", [5], 3))
    assert engine.metrics()["blocks_used"] == 0


def test_metrics_can_be_read_while_the_engine_thread_runs():
    model, params = _model("qwen3")
    engine = Engine(model, params, EngineConfig(block_size=4, num_blocks=400))
    done = threading.Event()
    engine.start()
    try:
        for i in range(8):
            engine.add_request(EngineRequest(f"m{i}", [i + 1] * 3, 60, ignore_eos=True),
                               lambda o: done.set() if o.finished and o.request_id == "m7" else None)
        reads = 0
        while not done.is_set():
            m = engine.metrics()  # never "deque mutated during iteration"
            reads += 1
            time.sleep(0.0002)  # lets go of the GIL: a reader that never does starves the engine thread
        assert reads > 100 and m["generated_tokens"] > 0
    finally:
        engine.shutdown()


def test_steps_run_in_inference_mode_with_plain_params():
    """With plain CPU params each step's forward runs under torch.inference_mode (as generate's
    decode does); the engine's cache stays an ordinary tensor and the tokens are unchanged."""
    model, params = _model("qwen3")
    req = _requests(model.config.vocab_size, count=2)
    modes, callback_modes = [], []
    req[0] = dataclasses.replace(req[0], stop_check=lambda toks: callback_modes.append(
        (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.zeros(1).is_inference())) or False)
    hook = model.skeleton.register_forward_pre_hook(lambda *_: modes.append(torch.is_inference_mode_enabled()))
    try:
        engine = Engine(model, params, EngineConfig(num_blocks=64))
        outs = {}
        for r in req:
            outs[r.request_id] = []
            engine.add_request(r, lambda o, rid=r.request_id: (outs[rid].append(o), callback_modes.append(
                (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.zeros(1).is_inference()))))
        while engine.has_work():
            engine.step()
    finally:
        hook.remove()
    assert modes and all(modes)
    # callbacks run outside inference mode, under no_grad, and make ordinary tensors
    assert len(callback_modes) > len(req) and all(m == (False, False, False) for m in callback_modes)
    assert not any(t.is_inference() for layer in engine.cache["layers"] for t in layer.values())
    for r in req:
        assert _tokens(outs[r.request_id]) == _solo(model, params, r)
