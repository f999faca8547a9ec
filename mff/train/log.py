"""Run output on rank 0: the progress bar, one line per step and the JSON metrics file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

__all__ = ["is_rank0", "print0", "RunLog"]


def is_rank0() -> bool:
    """True on rank 0, or when no process group exists."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any) -> None:
    """``print`` on rank 0 only, flushed."""
    if is_rank0():
        print(*args, flush=True)


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
        parts = [f"step {rec['step']:>5}/{self.bar.total}"]
        if rec.get("epoch") is not None:
            parts.append(f"epoch {rec['epoch']:.2f}")
        parts += [f"loss {rec['loss']:.4f}", f"lm {rec['lm_loss']:.4f}"]
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
