"""The decode-timing records behind ``generate --compile auto`` (mff/decode_timing.py) and the
CLI's pick (tests/test_generate_cli.py runs it)."""

from __future__ import annotations

import math

import pytest

from mff.decode_timing import break_even_tokens, read_record, record_path, update_record


def test_break_even_is_the_compile_cost_over_the_saving_per_step():
    assert break_even_tokens({"eager_step_s": 0.07, "compiled_step_s": 0.02, "first_compiled_step_s": 10.0}) == pytest.approx(200.0)
    assert break_even_tokens({"eager_step_s": 0.02, "compiled_step_s": 0.03, "first_compiled_step_s": 10.0}) == math.inf
    assert break_even_tokens({"eager_step_s": 0.07}) is None


def test_records_keep_the_latest_step_times_and_the_cheapest_first_call(tmp_path, monkeypatch):
    monkeypatch.setenv("MFF_CACHE_DIR", str(tmp_path))
    path = record_path({"config": {"hidden_size": 64}, "batch": 1})
    assert path.parent == tmp_path / "decode-timing" and read_record(path) == {}
    assert record_path({"batch": 1, "config": {"hidden_size": 64}}) == path  # key order does not matter
    assert record_path({"config": {"hidden_size": 65}, "batch": 1}) != path
    update_record(path, eager_step_s=0.08)
    update_record(path, compiled_step_s=0.03, first_compiled_step_s=120.0)  # cold Inductor cache
    update_record(path, compiled_step_s=0.02, first_compiled_step_s=12.0)   # warm
    update_record(path, first_compiled_step_s=15.0, eager_step_s=float("nan"))
    assert read_record(path) == {"eager_step_s": 0.08, "compiled_step_s": 0.02, "first_compiled_step_s": 12.0}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    path.write_text("{not json")
    assert read_record(path) == {}


def test_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MFF_CACHE_DIR", str(blocker))  # a file where the folder should be
    path = record_path({"a": 1})
    assert update_record(path, eager_step_s=0.1) == {"eager_step_s": 0.1} and not path.exists()


def test_hostile_records_count_as_unknown(tmp_path):
    """A record nested past the JSON parser's recursion, a FIFO (would block), an oversized file
    and figures a real run cannot produce (a bool, 1e300 s, 1e-308 s) are all ignored."""
    import json
    import os

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"eager_step_s": 0.1, "pad": "x" * 10_000}))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"eager_step_s": True, "compiled_step_s": 1e-308, "first_compiled_step_s": 1e300}))
    assert [read_record(p) for p in (deep, fifo, big, odd)] == [{}, {}, {}, {}]
