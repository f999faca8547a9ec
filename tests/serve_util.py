"""A real uvicorn serving :mod:`mff.serve.api` in a thread, over a tiny checkpoint, for tests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch

from mff.peft.load import load_with_text
from mff.serve.engine import Engine, EngineConfig


class LiveServer:
    """``build_app`` over an :class:`Engine` of ``ckpt`` on a free loopback port (uvicorn in a
    daemon thread). ``finished`` maps each engine request id to its finish reason (recorded
    from the outputs the engine hands out). ``step_delay_s`` > 0 slows every engine step (to
    make a request outlast a disconnect or a timeout)."""

    def __init__(self, ckpt: Path, config: EngineConfig = EngineConfig(num_blocks=128), *, model_name: str = "tiny",
                 request_timeout_s: float | None = 600.0, step_delay_s: float = 0.0,
                 max_body_bytes: int = 32_000_000):
        import uvicorn

        from mff.serve.api import build_app

        self.model, self.params, self.text = load_with_text(ckpt, "cpu", torch.float32)
        self.engine = Engine(self.model, self.params, config, eos_token_ids=self.text.eos_ids)
        self.finished: dict[str, str] = {}
        self._record_outputs()
        if step_delay_s > 0:
            step = self.engine.step
            self.engine.step = lambda: (time.sleep(step_delay_s), step())[1]
        self.app = build_app(self.engine, self.text, model_name, request_timeout_s=request_timeout_s, max_body_bytes=max_body_bytes)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _record_outputs(self) -> None:
        add = self.engine.add_requests

        def recorder(on_output):
            def record(out):
                if out.finished:
                    self.finished[out.request_id] = out.finish_reason
                on_output(out)
            return record

        self.engine.add_requests = lambda items: add([(req, recorder(on_output)) for req, on_output in items])

    def __enter__(self) -> LiveServer:
        self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start within 60 s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()

    def wait_idle(self, timeout_s: float = 20.0) -> dict:
        """Wait until the engine runs and queues nothing and holds no cache block; returns its metrics.
        Raises AssertionError (with the metrics) past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.engine.metrics()
            if m["running"] == 0 and m["waiting"] == 0 and m["blocks_used"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is not idle after {timeout_s} s: {m}")
            time.sleep(0.05)


def sse_events(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream (``lines``: str or bytes lines), parsed
    as JSON; the final ``[DONE]`` kept as the string. Raises AssertionError on a line that is not
    ``data: ...`` or blank."""
    out = []
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
