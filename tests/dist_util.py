"""Launching recipes under torchrun (gloo on the CPU) from tests."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.cli_util import ROOT, cli_env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for ``--master_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, target: list[str], launcher: list[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node=N [launcher flags] TARGET...``;
    ``target`` is a script path or ``["-m", module]`` followed by its arguments."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}", *launcher, *target]


def torchrun(nproc: int, args: list[str], cache: Path, timeout: float = 300, env: dict | None = None,
             launcher: list[str] = (), target: list[str] = ("-m", "mff.recipes.pretrain")) -> subprocess.CompletedProcess:
    """Run ``target`` (default: ``-m mff.recipes.pretrain``) with ``args`` on ``nproc`` processes."""
    return subprocess.run(torchrun_cmd(nproc, [*target, *args], launcher), capture_output=True, text=True,
                          env={**cli_env(cache), **(env or {})}, cwd=ROOT, timeout=timeout)


def torchrun_rank_stderr(nproc: int, args: list[str], tmp_path: Path, timeout: float = 180,
                         target: list[str] = ("-m", "mff.recipes.pretrain")) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``torchrun`` with per-rank stderr files (under ``tmp_path/logs``); returns the result and
    each rank's stderr text."""
    logs = tmp_path / "logs"
    r = torchrun(nproc, args, tmp_path / "cache", timeout=timeout, target=target,
                 launcher=["--log-dir", str(logs), "--redirects", "2", "--monitor-interval", "1"])
    return r, [next(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text() for rank in range(nproc)]
