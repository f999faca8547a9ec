"""Test driver (not a test): ``python -m mff.recipes.pretrain``, except that one rank stops
answering before a step's collectives, as a hung or descheduled process would.

Environment: ``STALL_RANK`` (the rank that stalls) and ``STALL_STEP`` (before which step). The
stalling rank prints ``stalling at <unix time>`` to stderr, restores SIGTERM's default action
(so torchrun can stop it like a stuck process) and sleeps.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import mff.recipes.pretrain as pretrain
import mff.train.loop as loop

_real_step = loop.train_step
_calls = [0]


def _stalling_step(*args, **kwargs):
    _calls[0] += 1
    if _calls[0] == int(os.environ["STALL_STEP"]) and os.environ.get("RANK") == os.environ["STALL_RANK"]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(f"stalling at {time.time():.3f}", file=sys.stderr, flush=True)
        time.sleep(600)
    return _real_step(*args, **kwargs)


if __name__ == "__main__":
    loop.train_step = _stalling_step
    sys.exit(pretrain.main(sys.argv[1:]))
