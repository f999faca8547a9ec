"""Pieces every recipe shares: two-pass CLI parsing (``--model``/``--size`` then tyro), run
logging (progress bar, one line per step, JSON metrics), config <-> checkpoint metadata, RNG
state, and the one-line error exit."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

from mff.ckpt import CheckpointError
from mff.models import FAMILIES, get_family, size_config

__all__ = ["parse_model_args", "RunLog", "config_to_dict", "check_resume_config", "rng_state", "restore_rng", "fail", "print0", "is_rank0"]


def is_rank0() -> bool:
    """True on rank 0, or when no process group exists."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any) -> None:
    """``print`` on rank 0 only, flushed."""
    if is_rank0():
        print(*args, flush=True)


def fail(err: BaseException, code: int) -> int:
    """Print ``error: <message>`` (one line, no traceback) to stderr and return ``code``; under
    several processes the message starts with ``rank N:`` (every rank prints its own)."""
    msg = str(err).strip() or type(err).__name__
    if isinstance(err, FileNotFoundError) and err.filename and str(err.filename) not in msg:
        msg = f"{msg}: {err.filename}"
    if dist.is_initialized() and dist.get_world_size() > 1 and not msg.startswith(f"rank {dist.get_rank()}:"):
        msg = f"rank {dist.get_rank()}: {msg}"
    sys.stderr.write(f"error: {msg}\n")  # one write: ranks sharing an unbuffered stderr do not interleave mid-line
    sys.stderr.flush()
    return code


def parse_model_args(config_cls: type, argv: Sequence[str], prog: str, description: str | None = None,
                     base: tuple[str, Any] | None = None) -> tuple[str, str, Any]:
    """Parse ``--model FAMILY`` and ``--size NAME`` first, then every other flag with tyro
    against ``config_cls[FamilyConfig]`` whose ``model`` default is that size's config.

    ``base``: ``(family name, config)`` of weights the run starts from (``--init-from``); the
    model config then starts from that config instead of a named size, ``--model`` must name
    the same family (or be left out) and ``--size`` must be left out.

    Returns ``(family name, size name, parsed config)``. Raises ValueError for an unknown model
    or size (listing the valid ones) or a conflict with ``base``; tyro exits with a usage
    message for bad flags.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model", default=None)
    pre.add_argument("--size", default=None)
    known, rest = pre.parse_known_args(list(argv))
    if base is not None:
        if known.model is not None and known.model != base[0]:
            raise ValueError(f"--init-from holds a {base[0]} model but --model is {known.model}; drop --model or pass --model {base[0]}")
        if known.size is not None:
            raise ValueError("--size conflicts with --init-from: the model config comes from the checkpoint (override fields with --model.*)")
        family, size, model_cfg = get_family(base[0]), "init-from", base[1]
    else:
        family = get_family(known.model or "deepseek3")
        size = known.size or family.default_size
        model_cfg = size_config(family, size)
    doc = (description or "").strip()
    doc += (
        f"\n\n--model {{{','.join(sorted(FAMILIES))}}} (default deepseek3) and --size NAME "
        f"(for {family.name}: {', '.join(family.sizes)}; default {family.default_size}) choose the model; "
        "--model.<field> then overrides single fields."
    )
    cfg = tyro.cli(config_cls[family.config_cls], default=config_cls(model=model_cfg, size=size), args=rest, prog=prog, description=doc)
    return family.name, size, cfg


def config_to_dict(cfg: Any, skip: Sequence[str] = ()) -> dict:
    """A dataclass as plain msgpack/JSON types (nested dicts, lists), without fields ``skip``."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v

    return {k: v for k, v in plain(cfg).items() if k not in skip}


def check_resume_config(meta: dict, family: str, config: Any) -> None:
    """Raise CheckpointError when a checkpoint was made for another family or model config
    (the message lists each differing field with both values)."""
    if meta.get("family") != family:
        raise CheckpointError(f"the checkpoint holds a {meta.get('family')!r} model, this run builds {family!r}; use another --ckpt-dir")
    saved, now = meta.get("config", {}), config_to_dict(config)
    diffs = []
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)!r}, this run {now.get(key)!r}")
    if diffs:
        raise CheckpointError("the checkpoint's model config differs from this run's: " + "; ".join(diffs) + " (use another --ckpt-dir)")


def rng_state() -> dict:
    """The torch RNG states (CPU, and CUDA when used) as bytes, for checkpoint metadata."""
    state = {"torch_cpu": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch_cpu"]), dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["torch_cuda"]), dtype=torch.uint8))


class RunLog:
    """Progress bar, one printed line per step and a JSON-lines metrics file (rank 0 only)."""

    def __init__(self, metrics_file: str | None, total: int, initial: int = 0):
        self.rank0 = is_rank0()
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None if self.rank0 else True, leave=False)
        self.metrics = None
        if metrics_file and self.rank0:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(metrics_file, "a")

    def write(self, line: str) -> None:
        """Print a line above the progress bar (rank 0)."""
        if self.rank0:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()

    def step(self, rec: dict, val_entropy: float | None = None) -> None:
        """Log one step record (``step``, ``loss``, ``lm_loss``, ... see the recipes)."""
        if not self.rank0:
            return
        parts = [f"step {rec['step']:>5}/{self.bar.total}", f"loss {rec['loss']:.4f}", f"lm {rec['lm_loss']:.4f}"]
        if rec.get("mtp_loss"):
            parts.append(f"mtp {rec['mtp_loss']:.4f}")
        if rec.get("balance_loss"):
            parts.append(f"balance {rec['balance_loss']:.2e}")
        parts += [f"lr {rec['lr']:.2e}", f"grad {rec['grad_norm']:.3f}", f"{rec['tokens_per_s']:,.0f} tok/s", f"MFU {100 * rec['mfu']:.2f}%"]
        self.write(" | ".join(parts))
        if "val_loss" in rec:
            extra = f" (validation unigram entropy {val_entropy:.4f})" if val_entropy is not None else ""
            self.write(f"step {rec['step']:>5} | val_loss {rec['val_loss']:.4f}{extra}")
        if self.metrics:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar and the metrics file."""
        self.bar.close()
        if self.metrics:
            self.metrics.close()
