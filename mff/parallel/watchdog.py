"""Collectives under the run's timeout, named: a rank that stops answering makes the others fail
with mff's own message naming the operation they waited in, not the backend's.

The timeout itself is the process group's (``init_process_group(timeout=...)``, set from
``--parallel.timeout-s`` by :func:`mff.backend.init_distributed`): a blocked gloo collective
raises ``RuntimeError("... Timed out waiting 30000ms for recv operation ...")`` after it, and
one whose peer died raises ``"Connection closed by peer"``. Wrapping the code that issues
collectives in :func:`collective` turns those errors into :class:`CollectiveTimeout`, whose
message names the operation (nested names read innermost first: ``all_reduce (grad norm) in
step 2``) and the timeout. DTensor redistributions inside a forward/backward are collectives
too; wrapping the whole forward/backward names them all at once.

(NCCL and HCCL enforce their timeouts from a watchdog thread that aborts the process instead
of raising; there the backend's own message is what the log shows.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["CollectiveTimeout", "collective", "set_timeout", "timeout_s"]

_state = threading.local()
_timeout: list[float | None] = [None]

_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused", "socket closed")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``--parallel.timeout-s`` for the other ranks, or lost its
    connection to one; the message names the operation."""


def set_timeout(seconds: float) -> None:
    """Record the process group's collective timeout (for the messages)."""
    _timeout[0] = float(seconds)


def timeout_s() -> float | None:
    """The collective timeout recorded by :func:`set_timeout` (None before)."""
    return _timeout[0]


def _stack() -> list[str]:
    if not hasattr(_state, "names"):
        _state.names = []
    return _state.names


def _kind(err: BaseException) -> str | None:
    msg = str(err).lower()
    if any(w in msg for w in _TIMEOUT_WORDS):
        return "timeout"
    if any(w in msg for w in _PEER_WORDS):
        return "peer"
    return None


def _message(kind: str, op: str) -> str:
    rank = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
    if kind == "timeout":
        t = timeout_s()
        after = f" after {t:g} s" if t is not None else ""
        return (f"{rank}{op} timed out{after} waiting for the other ranks; a rank stopped answering (see its log) "
                "or is far slower than this one (raise --parallel.timeout-s if that is expected)")
    return f"{rank}{op} failed: another rank closed its connection (it exited or crashed; see its log)"


@contextmanager
def collective(name: str) -> Iterator[None]:
    """Run the body as the named operation: a backend timeout (or a lost peer) raised inside
    becomes :class:`CollectiveTimeout` naming ``name`` and the enclosing operations.

    Args:
        name: what the ranks do together, e.g. ``"all_reduce (grad norm)"``,
            ``"forward/backward"``, ``"step 2"``.
    Raises:
        CollectiveTimeout: from a ``RuntimeError`` (``torch.distributed.DistBackendError``
            included) whose message says the collective timed out or lost a peer; other errors
            pass through unchanged.
    """
    names = _stack()
    names.append(name)
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as e:
        kind = _kind(e)
        if kind is None:
            raise
        raise CollectiveTimeout(_message(kind, " in ".join(reversed(names)))) from None
    finally:
        names.pop()
