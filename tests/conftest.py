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
