"""A rank that stops answering: with ``--parallel.timeout-s 30`` the other rank leaves within
60 s, non-zero, with mff's message naming the collective it waited in (acceptance 4)."""

from __future__ import annotations

import re
import time

import pytest

from mff.parallel.watchdog import CollectiveTimeout, collective, set_timeout, timeout_s
from tests.cli_util import ROOT, make_corpus, tiny_args
from tests.dist_util import torchrun


@pytest.mark.slow
def test_stalled_rank_makes_the_other_fail_with_the_operation_named(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    args = tiny_args(corpus) + ["--steps", "4", "--ckpt-dir", str(tmp_path / "ck"), "--parallel.dp-shard", "2", "--parallel.timeout-s", "30"]
    r = torchrun(2, args, tmp_path / "cache", timeout=240, env={"STALL_RANK": "1", "STALL_STEP": "2"},
                 target=[str(ROOT / "tests" / "stall_driver.py")])
    ended = time.time()
    assert r.returncode != 0
    stalled = re.search(r"stalling at (\d+\.\d+)", r.stderr)
    assert stalled, r.stderr[-3000:]
    assert ("error: rank 0: all_reduce (target token counts) in step 2 timed out after 30 s waiting for the other ranks; "
            "a rank stopped answering") in r.stderr, r.stderr[-3000:]
    waited = ended - float(stalled.group(1))
    assert 30 <= waited < 60, waited
    assert "Timed out waiting" not in r.stderr  # gloo's own message is replaced by mff's


def test_collective_turns_backend_timeouts_into_named_errors():
    before = timeout_s()
    set_timeout(30)
    try:
        with pytest.raises(CollectiveTimeout, match=r"^(rank \d+: )?all_reduce \(grad norm\) in step 7 timed out after 30 s waiting"):
            with collective("step 7"), collective("all_reduce (grad norm)"):
                raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation to complete")
        with pytest.raises(CollectiveTimeout, match=r"forward/backward in step 3 failed: another rank closed its connection"):
            with collective("step 3"), collective("forward/backward"):
                raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
        with pytest.raises(RuntimeError, match="^shape mismatch$"):  # other errors pass through untouched
            with collective("step 1"):
                raise RuntimeError("shape mismatch")
        with pytest.raises(ValueError):
            with collective("step 1"):
                raise ValueError("Timed out")
    finally:
        set_timeout(before if before is not None else 1800)
