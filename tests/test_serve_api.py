"""The OpenAI-compatible HTTP layer (mff.serve.api) on a real uvicorn over a tiny random qwen3
checkpoint with a ChatML tokenizer: the official ``openai`` client, streaming, stop strings,
echo + logprobs against ``model.forward``, lm-eval's ``local-completions`` against the in-process
mff backend, 200+ malformed requests, disconnects, queue-full, timeouts, shutdown, and the
``python -m mff.recipes.serve`` CLI.

References: greedy tokens come from :func:`mff.generate.generate` on the request alone; log-
probabilities from ``log_softmax`` of ``model.forward``'s logits over the whole sequence."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

from mff.generate import generate  # noqa: E402
from mff.serve.engine import EngineConfig  # noqa: E402
from tests.serve_util import LiveServer, sse_events  # noqa: E402
from tests.sft_util import make_chat_checkpoint  # noqa: E402

PROMPT = "alpha beta gamma delta"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt", "qwen3", seed=3)


@pytest.fixture(scope="module")
def server(ckpt):
    torch.manual_seed(0)
    with LiveServer(ckpt, EngineConfig(num_blocks=256, max_num_seqs=8)) as s:
        yield s


@pytest.fixture(scope="module")
def slow(ckpt):
    """One running sequence and one waiting at most, 20 ms per engine step, 5 s request timeout."""
    with LiveServer(ckpt, EngineConfig(num_blocks=64, max_num_seqs=1, max_waiting=1), request_timeout_s=5.0, step_delay_s=0.02) as s:
        yield s


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def _greedy(server, ids: list[int], n: int, eos: bool = True) -> list[int]:
    out = generate(server.model, server.params, torch.tensor([ids]), n, eos_token_id=server.text.eos_ids if eos else None)
    return out[0, len(ids):].tolist()


def _decode(server, ids: list[int]) -> str:
    eos = set(server.text.eos_ids)
    if ids and ids[-1] in eos:
        ids = ids[:-1]
    return server.text.tokenizer.decode(ids, skip_special_tokens=True)


def _post(server, path: str, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(server.base + path, data=data, headers={"Content-Type": "application/json"}, timeout=120, **kw)


def _chat_ids(server, messages) -> list[int]:
    from mff.data.chat import render_chat_template

    text = render_chat_template(server.text.chat_template, messages, add_generation_prompt=True)
    return server.text.tokenizer.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------------------------- openai client
def test_openai_completion_is_the_greedy_generation(server):
    client = _client(server)
    ids = server.text.tokenizer.encode(PROMPT).ids
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    ref = _greedy(server, ids, 12)
    assert r.choices[0].text == _decode(server, ref)
    assert r.choices[0].finish_reason == ("stop" if len(ref) < 12 else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(ref), len(ids) + len(ref))
    assert r.model == "tiny" and r.object == "text_completion"


def test_openai_completion_of_token_prompts_and_n(server):
    """Two token-id prompts x n=2 (seeded sampling): 4 choices, index p * n + i; choice i equals a
    lone request with seed + i; usage counts each prompt once and every generated token."""
    client = _client(server)
    prompts = [[5, 6, 7, 8], [300, 301]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=1.0, seed=11, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    for p, prompt in enumerate(prompts):
        for i in range(2):
            solo = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=11 + i,
                                             extra_body={"ignore_eos": True})
            assert solo.choices[0].text == by_index[p * 2 + i]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 4 * 6


def test_openai_chat_is_the_greedy_generation_of_the_template(server):
    client = _client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    ids = _chat_ids(server, messages)
    ref = _greedy(server, ids, 10)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == _decode(server, ref)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)
    assert r.object == "chat.completion"


def test_openai_streams_the_same_text(server):
    client = _client(server)
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "gamma"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs_are_the_forward_log_softmax(server):
    messages = [{"role": "user", "content": "delta"}]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True,
                                                "top_logprobs": 3, "ignore_eos": True}).json()
    ids = _chat_ids(server, messages)
    gen = _greedy(server, ids, 4, eos=False)
    lsm = server.model.forward(server.params, {"input_ids": torch.tensor([ids + gen])}).logits[0].float().log_softmax(-1)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for j, entry in enumerate(content):
        row = lsm[len(ids) - 1 + j]
        assert entry["logprob"] == pytest.approx(float(row[gen[j]]), abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


# ------------------------------------------------------------------------------------- stop strings
def _stop_case(server) -> tuple[str, str, int]:
    """A greedy text of 24 tokens, a 2-character stop string first found at index k >= 2 (and no
    earlier prefix of it ends the text before k)."""
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}).json()
    full = r["choices"][0]["text"]
    for k in range(2, len(full) - 2):
        stop = full[k:k + 2]
        if "\ufffd" not in stop and full.find(stop) == k:
            return full, stop, k
    raise AssertionError(f"no usable stop string in {full!r}")


def test_stop_string_cuts_the_text(server):
    full, stop, k = _stop_case(server)
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                          "stop": [stop, "never seen here"]}).json()
    c = r["choices"][0]
    assert c["text"] == full[:k] and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert r["usage"]["completion_tokens"] < 24  # the engine stopped generating, not only the text was cut
    ids = server.text.tokenizer.encode(PROMPT).ids
    third = _greedy(server, ids, 3, eos=False)[2]  # stop_token_ids: stop_reason is the id; at max_tokens it is null
    by_id = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                              "stop_token_ids": [third]}).json()["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == third
    plain = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}).json()
    assert plain["choices"][0]["stop_reason"] is None
    client = _client(server)
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert one.choices[0].text == full[:k]


def test_streaming_never_shows_a_stop_string(server):
    full, stop, k = _stop_case(server)
    resp = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                             "stop": stop, "stream": True}, stream=True)
    events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    text = ""
    for e in events[:-1]:
        text += e["choices"][0]["text"]
        assert stop not in text and full.startswith(text)
    assert text == full[:k] and events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["choices"][0]["stop_reason"] == stop


def test_stream_holds_back_stop_prefixes_and_partial_characters(server):
    """Choice.delta on hand-made outputs: a possible start of a stop string and half a UTF-8
    character are held back until decided."""
    from mff.serve.request import EngineRequest, RequestOutput
    from mff.serve.text import Choice, Codec

    codec = Codec(server.text, server.engine.vocab_size)
    tok = server.text.tokenizer
    a, b, c = tok.token_to_id("a"), tok.token_to_id("b"), tok.token_to_id("c")
    e1, e2 = tok.token_to_id("Ã"), tok.token_to_id("©")  # the two bytes of "é" (byte-level alphabet)
    assert None not in (a, b, c, e1, e2)
    req = EngineRequest("x", [1], 8)

    def feed(choice, ids, last):
        shown = []
        for j, t in enumerate(ids):
            done = last and j == len(ids) - 1
            choice.add(RequestOutput("x", [t], finished=done, finish_reason="stop" if done else None))
            shown.append(choice.delta(codec))
        return shown

    assert feed(Choice(0, req, [], ["bc"], ""), [a, b, c], True) == ["", "a", ""]
    assert feed(Choice(0, req, [], [], ""), [a, e1, e2, b], True) == ["a", "", "é", "b"]
    assert feed(Choice(0, req, [], ["xyz"], ""), [a, b, a], False) == ["", "", "a"]


# ------------------------------------------------------------------------------------- echo + logprobs
def test_echo_logprobs_are_the_forward_log_softmax(server):
    """The lm-eval contract: one entry per prompt token plus the generated one, the first null;
    values = log_softmax of model.forward (1e-4); tokens[i] is a key of top_logprobs[i] exactly
    when it is the argmax; text_offset counts the token strings."""
    from mff.serve.text import Codec

    codec = Codec(server.text, server.engine.vocab_size)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, server.engine.vocab_size, (40,), generator=g).tolist()  # ids past the tokenizer's included
    body = {"prompt": [ids], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 3, "seed": 1234}
    lp = _post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    lsm = server.model.forward(server.params, {"input_ids": torch.tensor([ids])}).logits[0].float().log_softmax(-1)
    new = int(lsm[-1].argmax())
    assert lp["tokens"] == [codec.token_str(t) for t in ids + [new]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids) + 1):
        row, tok = lsm[i - 1], (ids + [new])[i]
        assert lp["token_logprobs"][i] == pytest.approx(float(row[tok]), abs=1e-4)
        top = lp["top_logprobs"][i]
        vals, idx = row.topk(3)
        for t, v in zip(idx.tolist(), vals.tolist()):
            assert top[codec.token_str(t)] == pytest.approx(v, abs=1e-4)
        is_greedy = tok == int(row.argmax())
        assert (lp["token_logprobs"][i] == max(top.values())) == is_greedy  # lm-eval's greediness test
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids) + 1)]

    zero = _post(server, "/v1/completions", dict(body, max_tokens=0)).json()
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    assert zero["usage"]["completion_tokens"] == 0 and zero["choices"][0]["finish_reason"] == "length"

    events = sse_events(_post(server, "/v1/completions", dict(body, stream=True), stream=True).iter_lines())
    streamed = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


# ------------------------------------------------------------------------------------- lm-eval
def test_lm_eval_local_completions_matches_the_mff_backend(server, ckpt, tmp_path, monkeypatch):
    for name in ("lm_eval", "tenacity", "aiohttp"):  # lm-eval's API models need lm-eval[api]
        pytest.importorskip(name)
    import lm_eval

    # registers local-completions (the mff backend's registration leaves the registry non-empty, and
    # lm-eval imports its own models only into an empty one)
    import lm_eval.models.openai_completions  # noqa: F401
    from lm_eval.tasks import TaskManager

    from mff.eval.harness import MffLM
    from tests.eval_util import write_mc_task

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    write_mc_task(tmp_path, n=12)

    def evaluate(model, model_args=None):
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc"], log_samples=True, bootstrap_iters=0,
                                       task_manager=TaskManager(include_path=str(tmp_path)), random_seed=0, numpy_random_seed=0,
                                       torch_random_seed=0)

    ours = evaluate(MffLM(pretrained=str(ckpt), dtype="float32", batch_size=8, device="cpu"))
    before = server.engine.metrics()["generated_tokens"]
    api = evaluate("local-completions", f"model=tiny,base_url={server.base}/v1/completions,tokenizer={ckpt},"
                                        "tokenized_requests=True,num_concurrent=4,max_retries=1")
    assert server.engine.metrics()["generated_tokens"] - before == 12 * 4  # every request went to the server (max_tokens 1)
    for metric in ("acc,none", "acc_norm,none"):
        assert api["results"]["tiny_mc"][metric] == ours["results"]["tiny_mc"][metric]

    def responses(out):
        samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
        return [[r[0] if isinstance(r, list) else r for r in s["resps"]] for s in samples]

    a, b = responses(ours), responses(api)
    assert len(a) == 12 and all(len(x) == 4 for x in a)
    for ra, rb in zip(a, b):
        for (lp_a, greedy_a), (lp_b, greedy_b) in zip(ra, rb):
            assert abs(float(lp_a) - float(lp_b)) < 1e-4
            assert bool(greedy_a) == bool(greedy_b)
    server.wait_idle()


# ------------------------------------------------------------------------------------- bad input
def _bad_requests() -> list[tuple[str, str, object, int, str | None]]:
    """(method, path, body, status, param): >= 200 malformed requests."""
    comp = {"prompt": "alpha", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "alpha"}], "max_tokens": 2}
    field_cases = {
        "prompt": [None, 1, 1.5, True, {}, [], [[]], [1.5], [-1], [[1, -2]], ["a", 1], [[1], "a"], [99999], [[512]], [[0] * 600], "",
                   [True], [[True]], [[1], []]],
        "max_tokens": [-1, -100, 1.5, "10", True, 10**6, [], {}],
        "temperature": [-1, -0.001, "0", True, [], None],
        "top_p": [0, -0.5, 1.5, "1", None],
        "top_k": [-2, 1.5, "5", True],
        "min_p": [-0.1, 1, 1.5, "0"],
        "repetition_penalty": [0, -1, "1", None],
        "presence_penalty": [0.5, "0"],
        "frequency_penalty": [1, -1],
        "stop": [1, [1], [""], "", ["a"] * 100, ["x" * 1001], {"a": 1}, [None]],
        "stop_token_ids": [[-1], [512], [1.5], "1", 1, [10**9]],
        "seed": [-1, 2**63, 1.5, "1", True],
        "n": [0, -1, 10**6, 17, 1.5, "2"],
        "echo": ["yes", 1, None],
        "logprobs": [-3, 21, 1.5, "1", True, 10**6],
        "stream": ["true", 1, None],
        "ignore_eos": ["no", 0],
        "model": [1, [], {}],
        "best_of": [2, 0, "1"],
        "logit_bias": [{"1": 5}, [1], "x"],
        "suffix": ["tail", 1],
        "user": [1, []],
    }
    out = []
    for field, values in field_cases.items():
        for v in values:
            out.append(("POST", "/v1/completions", dict(comp, **{field: v}), 400, field))
    for extra in ({"foo": 1}, {"max_token": 5}, {"prompt_logprobs": 1}, {"Prompt": "x"}, {"stream_options": {"include_usage": True}}):
        out.append(("POST", "/v1/completions", dict(comp, **extra), 400, None))
    for so in ({"include_usage": "yes"}, {"foo": 1}, 1, []):
        out.append(("POST", "/v1/completions", dict(comp, stream=True, stream_options=so), 400, "stream_options"))
    out.append(("POST", "/v1/completions", dict(comp, prompt=["a"] * 20, n=16), 400, "prompt"))
    out.append(("POST", "/v1/completions", dict(comp, model="other-model"), 404, "model"))

    chat_cases = {
        "messages": [[], None, "hi", [{}], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 1}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": "x", "extra": 1}], [1], [{"role": "user", "content": [{"type": "text"}]}],
                     [{"role": "user", "content": "alpha " * 1000}], [{"content": "x"}]],
        "max_tokens": [-1, 1.5, 10**6],
        "max_completion_tokens": [-1, "3"],
        "logprobs": ["yes", 1],
        "top_logprobs": [-1, 21, "2"],
        "temperature": [-1, "x"],
        "top_p": [0, 2],
        "n": [10**6, 0],
        "stop": [["a"] * 100, 5],
        "seed": [-5],
        "model": ["other-model"],
        "add_generation_prompt": ["yes"],
    }
    for field, values in chat_cases.items():
        for v in values:
            status = 404 if v == "other-model" else 400
            out.append(("POST", "/v1/chat/completions", dict(chat, **{field: v}), status, field))
    for extra in ({"tools": []}, {"functions": []}, {"prompt": "x"}, {"top_logprobs": 2}, {"max_tokens": 3, "max_completion_tokens": 4}):
        out.append(("POST", "/v1/chat/completions", dict(chat, **extra), 400, None))

    for body in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, {"prompt": 1}, {"messages": []},
                 {"prompt": "x", "add_special_tokens": "no"}, {"prompt": "x", "foo": 1}, {"tokens": [1]}):
        out.append(("POST", "/tokenize", body, 400, None))
    out.append(("POST", "/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"))
    for body in ({"tokens": [-1]}, {"tokens": [400]}, {"tokens": [10**9]}, {"tokens": "1 2"}, {"tokens": [1.5]}, {}, {"prompt": "x"}):
        out.append(("POST", "/detokenize", body, 400, None))
    out.append(("POST", "/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"))

    raw = ["", "{", "not json", "[1,2]", "null", "1", '"str"', '{"prompt": NaN}', '{"prompt": "x", "temperature": Infinity}',
           '{"prompt": "x", "max_tokens": 1e400}', b"\xff\xfe\x00", '{"prompt": "x",}', "{'prompt': 'x'}"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for body in raw:
            out.append(("POST", path, body, 400, None))
    out += [("GET", "/v1/completions", None, 405, None), ("POST", "/v1/nothing", {}, 404, None), ("GET", "/v1/models/other", None, 404, "model"),
            ("GET", "/metrics?format=xml", None, 400, "format"), ("DELETE", "/v1/models", None, 405, None)]
    return out


def test_malformed_requests_get_openai_errors(server):
    cases = _bad_requests()
    assert len(cases) >= 200
    before = server.engine.metrics()["generated_tokens"]
    for method, path, body, status, param in cases:
        data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        r = requests.request(method, server.base + path, data=data, headers={"Content-Type": "application/json"}, timeout=60)
        where = f"{method} {path} {str(body)[:120]!r}"
        assert r.status_code == status, f"{where}: HTTP {r.status_code} {r.text[:300]}"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, where
        assert isinstance(err["message"], str) and len(err["message"]) > 10, where
        if param is not None:
            assert err["param"] == param, f"{where}: param {err['param']!r}, message {err['message']!r}"
    assert server.engine.metrics()["generated_tokens"] == before  # nothing bad reached the engine's sampler
    ok = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    server.wait_idle()


def test_errors_name_the_numbers(server):
    long = _post(server, "/v1/completions", {"prompt": [[1] * 500], "max_tokens": 20}).json()["error"]
    assert "500" in long["message"] and "20" in long["message"] and "512" in long["message"] and long["param"] == "max_tokens"
    vocab = _post(server, "/v1/completions", {"prompt": [3, 512]}).json()["error"]
    assert "prompt[1]" in vocab["message"] and "512" in vocab["message"]
    for prompt, where, got in (([1, -1], "prompt[1]", "-1"), ([[1, 2], [3, 2.5]], "prompt[1][1]", "2.5"), (["a", None], "prompt[1]", "null")):
        item = _post(server, "/v1/completions", {"prompt": prompt}).json()["error"]
        assert item["message"].startswith(where + ": expected") and f"(got {got})" in item["message"] and item["param"] == "prompt", item
    neg = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": -1}).json()["error"]
    assert neg["param"] == "max_tokens" and "-1" in neg["message"]


def test_body_limits_and_method_errors(server):
    """A body over the limit gets 413 (by its Content-Length, and counted when sent chunked); a
    prompt of ~1 MB (tokenized off the event loop) gets the context 400; 405 names the allowed
    method; a temperature too small for fp32 decodes greedily; a request whose choices could
    never wait together is a 400, not a 429."""
    limit = server.app.state.max_body_bytes
    server.app.state.max_body_bytes = 2000
    try:
        r = _post(server, "/v1/completions", {"prompt": "x" * 3000})
        assert r.status_code == 413 and "3014 bytes" in r.json()["error"]["message"] and "2000" in r.json()["error"]["message"]
        chunked = requests.post(server.base + "/v1/completions", data=iter([b'{"prompt": "', b"y" * 3000, b'"}']), timeout=60)
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413
    finally:
        server.app.state.max_body_bytes = limit
    big = _post(server, "/v1/completions", {"prompt": "alpha beta " * 50_000, "max_tokens": 1})
    assert big.status_code == 400 and "model's context of 512" in big.json()["error"]["message"]
    wrong = requests.get(server.base + "/v1/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    ids = server.text.tokenizer.encode(PROMPT).ids
    tiny_t = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 1e-39, "ignore_eos": True}).json()
    assert tiny_t["choices"][0]["text"] == _decode(server, _greedy(server, ids, 6, eos=False))
    pen = _post(server, "/v1/completions", {"prompt": PROMPT, "repetition_penalty": 1e-320}).json()["error"]
    assert pen["param"] == "repetition_penalty"
    server.wait_idle()


def test_tokenize_detokenize_info_models_metrics(server):
    ids = server.text.tokenizer.encode(PROMPT).ids
    r = _post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 512 and len(r["token_strs"]) == len(ids)
    messages = [{"role": "user", "content": "hi"}]
    assert _post(server, "/tokenize", {"messages": messages}).json()["tokens"] == _chat_ids(server, messages)
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == server.text.tokenizer.decode(ids, skip_special_tokens=False)
    info = requests.get(server.base + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == server.text.chat_template
    models = requests.get(server.base + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 512
    assert requests.get(server.base + "/health", timeout=30).status_code == 200
    text = requests.get(server.base + "/metrics", timeout=30).text
    assert re.search(r"^mff_serve_blocks_total 255\.0$", text, re.M) and "# TYPE mff_serve_generated_tokens_total counter" in text
    assert "# HELP mff_serve_blocks_used KV-cache blocks held by requests." in text
    as_json = requests.get(server.base + "/metrics?format=json", timeout=30).json()
    assert as_json["blocks_total"] == 255


# ------------------------------------------------------------------------------------- aborts and limits
def _open_stream(server, body: dict) -> socket.socket:
    """A raw HTTP connection that sent ``body`` to /v1/completions and read its first data chunk."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    if body.get("stream"):
        got = b""
        while b"data: {" not in got:
            got += s.recv(4096)
    return s


def _new_ids(server, before: set[str], timeout_s: float = 20.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = {k: v for k, v in server.finished.items() if k not in before}
        if new:
            return new
        time.sleep(0.05)
    raise AssertionError("no request finished")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(slow, stream):
    """A client gone mid-request: the engine request ends with ``abort`` and its blocks are freed
    (500 tokens at >= 20 ms a step would take >= 10 s)."""
    before = set(slow.finished)
    s = _open_stream(slow, {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": stream})
    time.sleep(0.3)
    s.close()
    t = time.monotonic()
    assert set(_new_ids(slow, before).values()) == {"abort"}
    assert time.monotonic() - t < 5
    m = slow.wait_idle()
    assert m["blocks_used"] == 0 and m["running"] == 0


def test_queue_full_is_429_and_closing_is_503(slow):
    a = _open_stream(slow, {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True})
    result = {}
    waiting = threading.Thread(target=lambda: result.update(r=_post(slow, "/v1/completions", {"prompt": "beta", "max_tokens": 3})))
    waiting.start()
    deadline = time.monotonic() + 10
    while slow.engine.metrics()["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    full = _post(slow, "/v1/completions", {"prompt": "gamma", "max_tokens": 3})
    assert full.status_code == 429 and full.json()["error"]["code"] == 429
    a.close()
    waiting.join(30)
    assert result["r"].status_code == 200
    slow.wait_idle()
    slow.app.state.closing = True
    try:
        assert requests.get(slow.base + "/health", timeout=30).status_code == 503
        r = _post(slow, "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        slow.app.state.closing = False
    assert requests.get(slow.base + "/health", timeout=30).status_code == 200


def test_choices_are_queued_together(slow):
    """The choices of one request wait all together or not at all: more of them than
    --engine.max-waiting (1 here) can never be queued (400); one fits an idle server."""
    r = _post(slow, "/v1/completions", {"prompt": ["x", "y", "z"], "max_tokens": 2})
    assert r.status_code == 400 and "3 choices" in r.json()["error"]["message"] and "--engine.max-waiting" in r.json()["error"]["message"]
    assert _post(slow, "/v1/completions", {"prompt": ["x"], "max_tokens": 2}).status_code == 200
    slow.wait_idle()


def test_request_timeout(slow):
    """Past --request-timeout-s (5 s here): 504 for a plain request, an error event then [DONE]
    for a stream; both engine requests are aborted."""
    before = set(slow.finished)
    out = {}
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    streamer = threading.Thread(target=lambda: out.update(s=sse_events(_post(slow, "/v1/completions", dict(body, stream=True),
                                                                             stream=True).iter_lines())))
    streamer.start()
    deadline = time.monotonic() + 10
    while slow.engine.metrics()["running"] < 1 and time.monotonic() < deadline:  # one waiting request at most
        time.sleep(0.02)
    plain = _post(slow, "/v1/completions", body)
    streamer.join(30)
    assert plain.status_code == 504 and plain.json()["error"]["code"] == 504
    assert out["s"][-1] == "[DONE]" and out["s"][-2]["error"]["code"] == 504
    slow.wait_idle()
    assert set(v for k, v in slow.finished.items() if k not in before) == {"abort"}


# ------------------------------------------------------------------------------------- the CLI
def _ready_line(p: subprocess.Popen) -> str:
    """The server's ``mff serve: http://...`` line (after ``mff serve: loading ...``), or the last line read at EOF."""
    line = p.stdout.readline()
    while line.startswith("mff serve: loading"):
        line = p.stdout.readline()
    return line

def test_serve_cli_serves_and_stops_on_sigterm(ckpt):
    from tests.cli_util import ROOT

    p = subprocess.Popen([sys.executable, "-m", "mff.recipes.serve", "--ckpt", str(ckpt), "--port", "0", "--threads", "1",
                          "--engine.num-blocks", "64", "--model-name", "cli"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT)
    try:
        line = _ready_line(p)
        m = re.match(r"mff serve: (http://127\.0\.0\.1:\d+)/v1 \(model cli;", line)
        assert m, line + p.stderr.read() if p.poll() is not None else line
        base = m.group(1)
        assert requests.get(base + "/v1/models", timeout=30).json()["data"][0]["id"] == "cli"
        r = requests.post(base + "/v1/completions", json={"model": "cli", "prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert "mff serve: stopped" in out and "Traceback" not in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_cli_shutdown_aborts_requests_in_flight_with_503(ckpt):
    """SIGTERM while requests run: after --shutdown-grace-s the engine aborts them; a plain
    request gets a 503 error object, a stream an error event and [DONE]; no traceback."""
    from tests.cli_util import ROOT

    p = subprocess.Popen([sys.executable, "-m", "mff.recipes.serve", "--ckpt", str(ckpt), "--port", "0", "--threads", "1",
                          "--engine.num-blocks", "128", "--engine.max-num-seqs", "1", "--shutdown-grace-s", "0.3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = _ready_line(p)
        m = re.match(r"mff serve: (http://127\.0\.0\.1:\d+)/v1", line)
        assert m, line + p.stderr.read() if p.poll() is not None else line
        base = m.group(1)
        body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "n": 3}
        out = {}
        plain = threading.Thread(target=lambda: out.update(plain=requests.post(base + "/v1/completions", json=body, timeout=120)))
        streamed = threading.Thread(target=lambda: out.update(stream=sse_events(requests.post(
            base + "/v1/completions", json=dict(body, stream=True), stream=True, timeout=120).iter_lines())))
        plain.start()
        streamed.start()
        deadline = time.monotonic() + 30
        while requests.get(base + "/metrics?format=json", timeout=30).json()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        plain.join(60)
        streamed.join(60)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0 and "Traceback" not in err, err
        assert out["plain"].status_code == 503, out["plain"].text[:300]
        assert out["plain"].json()["error"]["type"] == "service_unavailable"
        assert out["stream"][-1] == "[DONE]" and out["stream"][-2]["error"]["code"] == 503
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("args,needle", [
    (["--engine.block-size", "0"], "--engine.block-size 0: must be an integer >= 1"),
    (["--engine.num-blocks", "1000000000000"], "--engine.num-blocks 1000000000000: could not allocate the KV cache"),
    (["--max-body-mb", "0"], "--max-body-mb 0"),
    (["--port", "70000"], "--port 70000"),
    (["--request-timeout-s", "0"], "--request-timeout-s 0"),
])
def test_serve_cli_bad_flags(ckpt, args, needle):
    from tests.cli_util import ROOT

    r = subprocess.run([sys.executable, "-m", "mff.recipes.serve", "--ckpt", str(ckpt), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
