"""Pieces every recipe shares: two-pass CLI parsing (``--model``/``--size`` then tyro) and the
one-line error exit. Run logging (:mod:`mff.train.log`) and the checkpoint metadata helpers
(:mod:`mff.train.state`) are re-exported here for the recipes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import tyro

from mff.models import FAMILIES, get_family, size_config
from mff.train.log import RunLog, is_rank0, print0
from mff.train.state import check_resume_config, config_to_dict, restore_rng, rng_state

__all__ = ["parse_model_args", "RunLog", "config_to_dict", "check_resume_config", "rng_state", "restore_rng", "fail", "print0", "is_rank0",
           "run_training_main", "run_recipe_main"]


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
    fields = getattr(config_cls, "__dataclass_fields__", {})
    if "size" in fields:
        doc += (
            f"\n\n--model {{{','.join(sorted(FAMILIES))}}} (default deepseek3) and --size NAME "
            f"(for {family.name}: {', '.join(family.sizes)}; default {family.default_size}) choose the model; "
            "--model.<field> then overrides single fields."
        )
    default = config_cls(model=model_cfg, size=size) if "size" in fields else config_cls(model=model_cfg)
    cfg = tyro.cli(config_cls[family.config_cls], default=default, args=rest, prog=prog, description=doc)
    return family.name, size, cfg


def run_recipe_main(body: Callable[[], int]) -> int:
    """Run a recipe's ``body`` and turn its errors into one-line exits: bad input 2,
    checkpoint / numeric / OS errors 1, Ctrl-C 130; a collective timeout leaves at once (the other ranks are
    gone or stuck, so tearing the group down could block on them). A process group this call
    did not find already set up (research code or a test may run a recipe inside its own) is
    destroyed at the end: leaving gloo's threads to static destruction can abort a rank."""
    from mff.backend import DeviceUnavailable
    from mff.ckpt import CheckpointError
    from mff.parallel.watchdog import CollectiveTimeout
    from mff.train.step import NonFiniteError

    owns_group = not dist.is_initialized()
    try:
        return body()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, DeviceUnavailable) as e:
        return fail(e, 2)
    except (CheckpointError, NonFiniteError, OSError) as e:
        return fail(e, 1)
    except CollectiveTimeout as e:
        fail(e, 1)
        sys.stdout.flush()
        os._exit(1)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


run_training_main = run_recipe_main  # the name the training recipes use
