"""Run output on rank 0: the progress bar, one line per step, the JSON metrics file and TensorBoard."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

__all__ = ["is_rank0", "print0", "RunLog", "METRICS_FIELDS", "format_duration"]


def is_rank0() -> bool:
    """True on rank 0, or when no process group exists."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any) -> None:
    """``print`` on rank 0 only, flushed."""
    if is_rank0():
        print(*args, flush=True)


def format_duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m05s`` / ``7s`` of a duration in seconds."""
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


# The fields of a --metrics-file record, their units, and the console's name for each
METRICS_FIELDS = {
    "step": ("optimizer step (1-based)", "step"),
    "loss": ("total loss the optimizer minimises: lm + mtp + balance, each already weighted (nats per target token)", "loss"),
    "lm_loss": ("language-model cross entropy (nats per target token)", "lm"),
    "mtp_loss": ("MTP loss, weighted by mtp_loss_scaling_factor (nats); 0 without MTP", "mtp"),
    "balance_loss": ("MoE balance loss, weighted by its coefficient; 0 without one", "balance"),
    "lr": ("learning rate of the step", "lr"),
    "grad_norm": ("global grad norm before clipping", "grad"),
    "tokens_per_s": ("tokens per second of the step, all ranks together", "tok/s"),
    "mfu_percent": ("model FLOPs utilisation in percent of the peak the header prints (capped at 100)", "MFU"),
    "elapsed_s": ("seconds since this process's first step started", "elapsed"),
    "eta_s": ("estimated seconds to the run's last step (mean step time so far x steps left)", "eta"),
    "epoch": ("passes over the training rows (fine-tuning)", "epoch"),
    "val_loss": ("validation LM cross entropy (nats per target token; no MTP or balance term), on validation steps", "val_loss"),
}


class RunLog:
    """Progress bar, one printed line per step, a JSON-lines metrics file and optional
    TensorBoard scalars (rank 0 only). The bar is drawn only on a terminal, so a log written to a
    file holds the step lines once each."""

    def __init__(self, metrics_file: str | None, total: int, initial: int = 0, tensorboard: str | None = None,
                 resumed_from: str | None = None):
        self.rank0 = is_rank0()
        interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                        disable=not (self.rank0 and interactive), leave=False)
        self.total = total
        self.metrics = None
        self.tb = None
        self.capped_note = False
        if metrics_file and self.rank0:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(metrics_file, "a")
            if resumed_from is not None and self.metrics.tell() > 0:
                # the steps after the checkpoint come again: a reader keeps the last record of each step
                self.metrics.write(json.dumps({"event": "resume", "resumed_from": resumed_from, "next_step": initial + 1,
                                               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
                self.metrics.flush()
        if tensorboard and self.rank0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("--metrics.tensorboard needs the tensorboard package: pip install tensorboard") from e
            self.tb = SummaryWriter(tensorboard)

    def write(self, line: str) -> None:
        """Print a line above the progress bar (rank 0)."""
        if self.rank0:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()

    def step(self, rec: dict, val_entropy: float | None = None) -> None:
        """Log one step record (the keys of :data:`METRICS_FIELDS`)."""
        if not self.rank0:
            return
        rec = dict(rec)
        raw_mfu = rec.pop("mfu", None)
        if raw_mfu is not None:
            rec["mfu_percent"] = min(100.0, 100.0 * raw_mfu) if raw_mfu == raw_mfu else raw_mfu
        parts = [f"step {rec['step']:>5}/{self.total}"]
        if rec.get("epoch") is not None:
            parts.append(f"epoch {rec['epoch']:.2f}")
        parts += [f"loss {rec['loss']:.4f}", f"lm {rec['lm_loss']:.4f}"]
        if rec.get("mtp_loss"):
            parts.append(f"mtp {rec['mtp_loss']:.4f}")
        if rec.get("balance_loss"):
            parts.append(f"balance {rec['balance_loss']:.2e}")
        parts += [f"lr {rec['lr']:.2e}", f"grad {rec['grad_norm']:.3f}", f"{rec['tokens_per_s']:,.0f} tok/s"]
        if "mfu_percent" in rec:
            parts.append(f"MFU {rec['mfu_percent']:.2f}%")
        if "elapsed_s" in rec:
            parts.append(f"elapsed {format_duration(rec['elapsed_s'])}")
        if "eta_s" in rec:
            parts.append(f"eta {format_duration(rec['eta_s'])}")
        self.write(" | ".join(parts))
        if raw_mfu is not None and raw_mfu > 1.0 and not self.capped_note:
            self.capped_note = True
            self.write(f"note: MFU capped at 100%: step {rec['step']} ran {100 * raw_mfu:.0f}% of the measured peak, "
                       "so that peak was measured while other work loaded the machine")
        if "val_loss" in rec:
            extra = f" (validation unigram entropy {val_entropy:.4f})" if val_entropy is not None else ""
            self.write(f"step {rec['step']:>5} | val_loss {rec['val_loss']:.4f}{extra}")
        if self.metrics:
            self.metrics.write(json.dumps(rec) + "\n")
            self.metrics.flush()
        if self.tb is not None:
            for key in ("loss", "lm_loss", "mtp_loss", "balance_loss", "lr", "grad_norm", "tokens_per_s", "mfu_percent", "val_loss"):
                value = rec.get(key)
                if isinstance(value, (int, float)) and value == value:
                    self.tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, rec["step"])
            self.tb.flush()
        self.bar.update(1)

    def close(self) -> None:
        """Close the bar, the metrics file and the TensorBoard writer."""
        self.bar.close()
        if self.metrics:
            self.metrics.close()
        if self.tb is not None:
            self.tb.close()
