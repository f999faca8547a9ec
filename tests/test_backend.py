"""Device choice, communication backend and fused-op dispatch (the NPU path is tested by its
dispatch only: there is no NPU here)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from mff import backend


def test_flag_wins_over_env_and_env_is_read():
    assert backend.resolve_device("cpu", env={"MF_DEVICE_TYPE": "npu"}) == "cpu"
    assert backend.resolve_device(None, env={"MF_DEVICE_TYPE": "CPU"}) == "cpu"
    assert backend.resolve_device(None, env={}) in ("cpu", "cuda", "npu")


def test_unknown_device_names_valid_ones():
    with pytest.raises(ValueError, match="auto, cpu, cuda, npu"):
        backend.resolve_device("tpu", env={})
    with pytest.raises(ValueError, match="MF_DEVICE_TYPE='tpu'"):
        backend.resolve_device(None, env={"MF_DEVICE_TYPE": "tpu"})


def test_missing_npu_and_cuda_say_what_to_install(monkeypatch):
    monkeypatch.setattr(backend, "_import_torch_npu", lambda: None)
    with pytest.raises(backend.DeviceUnavailable, match="torch_npu is not installed.*pip install"):
        backend.resolve_device("npu", env={})
    with pytest.raises(backend.DeviceUnavailable, match="torch_npu"):
        backend.resolve_device(None, env={"MF_DEVICE_TYPE": "Ascend"})
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(backend.DeviceUnavailable, match="CPU-only build"):
        backend.resolve_device("cuda", env={})


def test_auto_prefers_npu_then_cuda(monkeypatch):
    fake = types.ModuleType("torch_npu")
    monkeypatch.setattr(backend, "_import_torch_npu", lambda: fake)
    monkeypatch.setattr(backend, "_npu_count", lambda m: 2)
    assert backend.resolve_device("auto", env={}) == "npu"
    monkeypatch.setattr(backend, "_npu_count", lambda m: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backend.resolve_device("auto", env={}) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.resolve_device("auto", env={}) == "cpu"


def test_comm_backend():
    assert [backend.comm_backend(d) for d in ("npu", "cuda", "cpu")] == ["hccl", "nccl", "gloo"]
    with pytest.raises(ValueError):
        backend.comm_backend("tpu")


def test_rms_norm_matches_hf_formula():
    x, w = torch.randn(2, 3, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    x32 = x.float()
    ref = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(backend.rms_norm_torch(x, w, 1e-6), ref)


def test_cli_reports_missing_device_in_one_line():
    for dev, needle in (("npu", "torch_npu"), ("cuda", "cuda")):
        if dev == "cuda" and torch.cuda.is_available():
            continue
        r = subprocess.run([sys.executable, "-m", "mff.recipes.pretrain", "--device", dev], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: --device {dev}") and needle in lines[0], r.stderr
        assert "Traceback" not in r.stderr
