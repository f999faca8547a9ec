"""Shared fixtures: a 1-process gloo group and its mesh (the world_size == 1 case of many)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="session")
def dist1():
    """A DeviceMesh over one gloo process (axes dp_replicate, dp_shard, tp all of size 1)."""
    from mff.backend import init_distributed
    from mff.parallel import ParallelConfig, build_mesh

    os.environ.setdefault("MF_DEVICE_TYPE", "cpu")
    info = init_distributed("cpu")
    return build_mesh("cpu", ParallelConfig(), info.world_size)


# The longest files first, so that with two pytest-xdist workers (scripts/test.sh, --dist loadfile)
# they do not start last and leave one worker idle at the end; then the other files with slow
# tests; then the rest. Within a file the order is unchanged (tests/test_readme.py relies on it).
LONG_FIRST = ("test_pretrain_default.py", "test_readme.py", "test_finetune_smollm2.py", "test_eval_requests.py",
              "test_eval_harness_smollm2.py")


def pytest_collection_modifyitems(config, items):
    slow_files = {item.path.name for item in items if item.get_closest_marker("slow") is not None}

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in LONG_FIRST:
            return (0, LONG_FIRST.index(name))
        return (1, 0) if name in slow_files else (2, 0)

    items.sort(key=rank)  # stable: the collection order within each rank and file
