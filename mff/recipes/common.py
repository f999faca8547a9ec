"""Pieces every recipe shares: two-pass CLI parsing (``--model``/``--size`` then tyro) and the
one-line error exit. Run logging (:mod:`mff.train.log`) and the checkpoint metadata helpers
(:mod:`mff.train.state`) are re-exported here for the recipes."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import tyro

from mff.models import FAMILIES, get_family, size_config
from mff.train.log import RunLog, is_rank0, print0
from mff.train.state import check_resume_config, config_to_dict, restore_rng, rng_state

__all__ = ["parse_model_args", "RunLog", "config_to_dict", "check_resume_config", "rng_state", "restore_rng", "fail", "print0", "is_rank0",
           "run_training_main", "run_recipe_main", "refuse_pipeline"]


def refuse_pipeline(argv: Sequence[str], recipe: str) -> None:
    """Raise ValueError when ``argv`` asks ``recipe`` (generate, eval) for pipeline parallelism,
    which only training runs (its checkpoints are keyed by global param paths, so a pipeline-
    trained checkpoint is generated from and evaluated as it is)."""
    for a in argv:
        if a == "--parallel.pp" or a.startswith(("--parallel.pp=", "--parallel.pp-", "--parallel-pp")):
            raise ValueError(f"{a.split('=')[0]}: {recipe} does not run pipeline parallelism (pipeline stages are for training: "
                             f"python -m mff.recipes.pretrain --parallel.pp N); {recipe} reads a pipeline run's checkpoint as any other")


def _launched_rank() -> int | None:
    """This process's rank under several processes (from the process group, or from torchrun's
    RANK before the group exists); None on one process."""
    if dist.is_initialized():
        return dist.get_rank() if dist.get_world_size() > 1 else None
    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return rank if world > 1 else None


def fail(err: BaseException, code: int) -> int:
    """Print ``error: <message>`` (one line, no traceback) to stderr and return ``code``; under
    several processes the message starts with ``rank N:`` (every rank prints its own)."""
    msg = str(err).strip() or type(err).__name__
    if isinstance(err, FileNotFoundError) and err.filename and str(err.filename) not in msg:
        msg = f"{msg}: {err.filename}"
    rank = _launched_rank()
    if rank is not None and not msg.startswith(f"rank {rank}:"):
        msg = f"rank {rank}: {msg}"
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
    or size (listing the valid ones), an unknown option (naming the nearest one) or a conflict
    with ``base``; tyro exits with code 2 and a usage message for other bad flags.
    """
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model", default=None)
    pre.add_argument("--size", default=None)
    known, rest = pre.parse_known_args(list(argv))
    if known.model is not None:
        known.model = get_family(known.model).name  # HF model_type spellings (deepseek_v3) name their family
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
        aliases = sorted(t for f in FAMILIES.values() for t in f.hf_model_types if t not in FAMILIES)
        doc += (
            "\n\nOptions read before the table below:\n"
            f"  --model FAMILY    {' | '.join(sorted(FAMILIES))} (default deepseek3; HF model_type spellings such as "
            f"{', '.join(aliases[:3])} are accepted)\n"
            f"  --size NAME       named config of the family ({family.name}: {', '.join(family.sizes)}; default {family.default_size}); "
            "--model.<field> then overrides single fields\n"
            f"  {MINDFORMERS_YAML_FLAG} FILE    start from the flags a MindFormers YAML translates to (printed; flags given too win)"
        )
    default = config_cls(model=model_cfg, size=size) if "size" in fields else config_cls(model=model_cfg)
    check_known_options(config_cls[family.config_cls], default, rest, prog)
    cfg = tyro.cli(config_cls[family.config_cls], default=default, args=rest, prog=prog, description=doc)
    return family.name, size, cfg


MINDFORMERS_YAML_FLAG = "--from-mindformers-yaml"

# names other trainers use (Megatron, HF Trainer, torchtitan) -> mff's last flag component
_SYNONYMS = {"learning-rate": "lr", "max-steps": "steps", "train-iters": "steps", "training-steps": "steps", "seq-length": "seq-len",
             "max-seq-len": "seq-len", "seq-len": "seq-len", "global-batch-size": "batch-size", "lr-warmup-iters": "warmup-steps",
             "warmup-iters": "warmup-steps", "warmup": "warmup-steps", "clip-grad": "max-grad-norm", "gradient-accumulation-steps":
             "grad-accum", "save": "ckpt-dir", "output-dir": "ckpt-dir"}


def nearest_option(flag: str, options: Sequence[str]) -> str | None:
    """The option of ``options`` a mistyped ``flag`` most likely meant: a known synonym of its
    last component (``--optim.learning-rate`` -> ``--optim.lr``, Megatron's ``--train-iters`` ->
    ``--steps``), else the closest spelling (difflib), preferring options under the same prefix."""
    import difflib

    name = flag.lstrip("-").replace("_", "-")
    head, _, last = name.rpartition(".")
    longs = [o for o in options if o.startswith("--")]
    target = _SYNONYMS.get(last)
    if target is not None:
        same = [o for o in longs if o == f"--{head + '.' if head else ''}{target}"]
        anywhere = [o for o in longs if o.rpartition(".")[2].lstrip("-") == target]
        if same or anywhere:
            return (same or sorted(anywhere, key=len))[0]
    group = [o for o in longs if head and o.startswith(f"--{head}.")]
    for pool, cutoff in ((group, 0.5), (longs, 0.6)):
        hit = difflib.get_close_matches("--" + name, pool, n=1, cutoff=cutoff)
        if hit:
            return hit[0]
    return None


def check_known_options(cli_type: Any, default: Any, args: Sequence[str], prog: str) -> None:
    """Refuse an option the CLI does not have, naming the nearest one, before tyro's own
    message (which suggests nothing). Raises ValueError (exit code 2 through
    :func:`run_recipe_main`). Skipped where tyro cannot describe its parser."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parser = tyro.extras.get_parser(cli_type, default=default, prog=prog)
    except Exception:  # noqa: BLE001 - a tyro without get_parser: tyro reports unknown options itself
        return
    options = list(parser._option_string_actions)
    for arg in args:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if flag in options or flag.replace("_", "-") in options:
            continue
        hint = nearest_option(flag, options)
        raise ValueError(f"unknown option {flag}" + (f"; did you mean {hint}?" if hint else f"; {prog} --help lists the options"))


def run_recipe_main(body: Callable[[], int]) -> int:
    """Run a recipe's ``body`` and turn its errors into one-line exits: bad input 2,
    checkpoint / numeric / OS errors 1, Ctrl-C 130; a collective timeout leaves at once (the other ranks are
    gone or stuck, so tearing the group down could block on them). A process group this call
    did not find already set up (research code or a test may run a recipe inside its own) is
    destroyed at the end, after a barrier when the run ended normally (or stopped by a signal, which
    every rank agrees on): leaving gloo's threads to static destruction, or closing a rank's pairs
    while a peer still has work on them, can abort a rank. A run that fails before its first
    checkpoint removes the checkpoint folder it created (:func:`mff.ckpt.checkpoint.discard_unused_dirs`)."""
    from mff.backend import DeviceUnavailable
    from mff.ckpt import CheckpointError
    from mff.ckpt.checkpoint import discard_unused_dirs
    from mff.parallel.watchdog import CollectiveTimeout
    from mff.train.step import NonFiniteError

    owns_group = not dist.is_initialized()
    code = 1
    try:
        code = body()
        return code
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
        if code != 0:  # a run that failed before its first checkpoint leaves no folder behind
            discard_unused_dirs()
        if owns_group and dist.is_initialized():
            if code in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM):
                # every rank finished the same steps: meet before tearing down, so that no rank closes its
                # gloo pairs while a peer still has work in flight on them (an abort at exit otherwise)
                try:
                    dist.barrier()
                except RuntimeError:
                    pass
            dist.destroy_process_group()


run_training_main = run_recipe_main  # the name the training recipes use
