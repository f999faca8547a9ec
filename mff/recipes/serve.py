"""Serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching, paged KV cache).

    python -m mff.recipes.serve --ckpt PATH [--adapter DIR] [--host 127.0.0.1 --port 8000
        --model-name NAME --engine.max-num-seqs 16 --engine.cache-memory-gib 1 --request-timeout-s 600]

``--ckpt`` is anything ``python -m mff.recipes.generate`` reads (an HF folder, an mff run, a
.gguf file); its tokenizer and chat template serve ``/v1/completions`` and
``/v1/chat/completions`` (:mod:`mff.serve.api` lists the endpoints). Once the server listens it
prints one line, ``mff serve: http://HOST:PORT/v1 (model NAME; context and cache sizes)``
(``--port 0`` picks a free port, shown there). SIGINT / SIGTERM stop it: the server stops
accepting connections, new requests on open connections get 503, requests in flight get up to
``--shutdown-grace-s`` seconds to finish, and the rest are then aborted with a 503 error object
(an error event and ``[DONE]`` on a stream). Needs ``pip install mff[serve]`` (FastAPI and uvicorn).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro

from mff.backend import local_device, resolve_device
from mff.ckpt.tokenizer_files import read_chat_template_file
from mff.peft.load import load_with_text
from mff.recipes.common import refuse_pipeline, run_recipe_main
from mff.serve.engine import Engine, EngineConfig

__all__ = ["ServeConfig", "default_cpu_threads", "main", "run"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}


@dataclass(frozen=True)
class ServeConfig:
    """An OpenAI-compatible server over one checkpoint."""

    ckpt: str
    """An HF model folder, an mff checkpoint (run or step folder), a .gguf file, or a MindSpore .ckpt / MindFormers checkpoint with its HF config.json beside it."""
    adapter: str | None = None
    """A LoRA adapter for --ckpt: a PEFT adapter folder or an mff LoRA run (merged into the weights before serving)."""
    tokenizer: str | None = None
    """A tokenizer.json to use instead of the checkpoint's."""
    chat_template: str | None = None
    """A Jinja chat template file for /v1/chat/completions that replaces the checkpoint's (or gives one to a checkpoint without)."""
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """TCP port (0: a free one, printed when ready)."""
    model_name: str | None = None
    """The model name clients send (GET /v1/models); default: the --ckpt folder or file name."""
    device: str | None = None
    """cpu, cuda, npu or auto (default: $MF_DEVICE_TYPE, else auto)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Weights and KV-cache dtype (auto: as stored)."""
    threads: int | None = None
    """CPU threads for torch (default on CPU: all cores but one, which the HTTP side gets; elsewhere torch's choice)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """KV cache and scheduling limits."""
    request_timeout_s: float = 600.0
    """A request still generating after this many seconds is aborted (HTTP 504)."""
    shutdown_grace_s: float = 5.0
    """On SIGINT / SIGTERM, seconds requests in flight get to finish before they are aborted (503)."""
    max_body_mb: float = 32.0
    """Largest request body accepted, in MB (10^6 bytes); a larger one gets HTTP 413."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"
    """uvicorn's log level (info: one line per request)."""


def default_cpu_threads() -> int:
    """Torch threads when serving on CPU: every core this process may run on but one (at least 1). The
    HTTP thread (and clients on the same machine) then do not take cores from torch's intra-op
    threads, which stall a whole parallel region when one of them is descheduled; on 2 cores this
    measured faster at 1 and 4 streaming clients and the same at 16 (README "Serving")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def _check(cfg: ServeConfig) -> None:
    """Raise ValueError naming the first bad flag."""
    if not 0 <= cfg.port <= 65535:
        raise ValueError(f"--port {cfg.port}: must be in [0, 65535] (0: a free port)")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads {cfg.threads} must be >= 1")
    if not 0 < cfg.request_timeout_s < math.inf:
        raise ValueError(f"--request-timeout-s {cfg.request_timeout_s}: must be a finite number > 0")
    if not 0 <= cfg.shutdown_grace_s < math.inf:
        raise ValueError(f"--shutdown-grace-s {cfg.shutdown_grace_s}: must be a finite number >= 0")
    if not 1e-6 <= cfg.max_body_mb < math.inf:
        raise ValueError(f"--max-body-mb {cfg.max_body_mb}: must be a finite number >= 1e-6 (one byte)")
    if cfg.model_name is not None and not cfg.model_name.strip():
        raise ValueError("--model-name is empty; give a name or leave it out")
    cfg.engine.validate()


def _server(app, engine: Engine, cfg: ServeConfig, details: str):
    """A uvicorn server that prints the URL (and ``details``) once listening and, on SIGINT /
    SIGTERM, marks the app closing (new requests: 503) and shuts the engine down after
    ``--shutdown-grace-s`` seconds, so that the requests still in flight end with a 503 error
    object before uvicorn's own graceful-shutdown limit (the grace plus a margin) cancels
    anything."""
    import uvicorn

    class Server(uvicorn.Server):
        abort_timer: threading.Timer | None = None

        def handle_exit(self, sig, frame):
            if not app.state.closing:
                app.state.closing = True
                self.abort_timer = threading.Timer(cfg.shutdown_grace_s, engine.shutdown)
                self.abort_timer.daemon = True
                self.abort_timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT / SIGTERM stop the server gracefully (uvicorn's own handler re-raises the
            signal afterwards, which would kill the process before the engine stops)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else cfg.port
                host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
                print(f"mff serve: http://{host}:{port}/v1 (model {app.state.model_name}; {details})", flush=True)

    return Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                 timeout_graceful_shutdown=cfg.shutdown_grace_s + SHUTDOWN_MARGIN_S, lifespan="on"))


SHUTDOWN_MARGIN_S = 5.0
"""Seconds past ``--shutdown-grace-s`` that aborted requests get to send their 503 before uvicorn
cancels them."""


def run(cfg: ServeConfig) -> None:
    """Load --ckpt, start the engine and serve until SIGINT / SIGTERM.

    Raises:
        ValueError: a bad flag, an engine config the cache cannot hold, FastAPI or uvicorn
            missing (``pip install mff[serve]``).
        FileNotFoundError, CheckpointError: as :func:`mff.peft.load.load_with_text`.
        OSError: the address cannot be bound.
    """
    _check(cfg)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"serving needs FastAPI and uvicorn: pip install 'mff[serve]' ({e})") from None
    from mff.serve.api import build_app

    device = local_device(resolve_device(cfg.device))
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    elif device.type == "cpu":
        torch.set_num_threads(default_cpu_threads())
    template = read_chat_template_file(cfg.chat_template) if cfg.chat_template is not None else None
    print(f"mff serve: loading {cfg.ckpt} ...", flush=True)
    model, params, text = load_with_text(Path(cfg.ckpt), device, DTYPES[cfg.dtype], adapter=cfg.adapter, tokenizer=cfg.tokenizer)
    if template is not None:
        text.chat_template, text.chat_template_source = template, cfg.chat_template
    try:
        engine = Engine(model, params, cfg.engine, eos_token_ids=text.eos_ids)
    except (RuntimeError, MemoryError) as e:
        if "alloc" not in str(e) and not isinstance(e, MemoryError):
            raise
        flag = (f"--engine.num-blocks {cfg.engine.num_blocks}" if cfg.engine.num_blocks is not None
                else f"--engine.cache-memory-gib {cfg.engine.cache_memory_gib}")
        raise ValueError(f"{flag}: could not allocate the KV cache ({str(e).splitlines()[0][:200]}); give a smaller cache") from None
    name = cfg.model_name or Path(cfg.ckpt).resolve().name
    app = build_app(engine, text, name, request_timeout_s=cfg.request_timeout_s, max_body_bytes=int(cfg.max_body_mb * 1e6))
    blocks = engine.metrics()["blocks_total"]
    cache_gib = blocks * cfg.engine.block_size * engine.metrics()["cache_bytes_per_token"] / 2**30
    details = (f"context {engine.max_model_len} tokens, {blocks} cache blocks of {cfg.engine.block_size} tokens, "
               f"{cache_gib:.2f} GiB")
    if blocks * cfg.engine.block_size < engine.max_model_len:
        details += (f"; the cache holds {blocks * cfg.engine.block_size} tokens, less than one full context: a request that "
                    "needs more (a prompt without max_tokens included) gets HTTP 400")
    engine.start()
    server = _server(app, engine, cfg, details)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind (after logging why)
        if server.started:
            raise
    finally:
        app.state.closing = True
        if server.abort_timer is not None:
            server.abort_timer.cancel()
        engine.shutdown()
    if not server.started:
        raise OSError(f"could not listen on {cfg.host}:{cfg.port} (see the message above)")
    print("mff serve: stopped", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> int:
        refuse_pipeline(argv, "serve")
        run(tyro.cli(ServeConfig, args=argv, prog="python -m mff.recipes.serve", description=__doc__))
        return 0

    return run_recipe_main(body)


if __name__ == "__main__":
    sys.exit(main())
