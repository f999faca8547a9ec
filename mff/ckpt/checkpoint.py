"""Checkpoints in mff's one layout (DESIGN.md)::

    CKPT_DIR/step_00000100/model.safetensors   params, keys = param paths
    CKPT_DIR/step_00000100/optim.safetensors   optimizer state, keys = "<slot>/<param path>" (+ "step")
    CKPT_DIR/step_00000100/meta.msgpack        format/version, step, tokens seen, data position,
                                               RNG states, family + config, mesh, placements
    CKPT_DIR/latest                            name of the newest complete step dir, written last

A step dir is written under a temporary name and renamed into place, then ``latest`` is
replaced atomically; a crash at any point leaves the previous checkpoint intact and ``latest``
pointing to a complete one. Older step dirs beyond ``keep_last`` are removed only after the new
one is complete. DTensor params are gathered to full tensors (every rank joins the gather;
rank 0 writes), so a checkpoint loads onto any mesh.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from mff.ckpt.safetensors_io import write_safetensors
from mff.tree import flatten_with_paths, unflatten_paths

__all__ = ["FORMAT", "VERSION", "CheckpointError", "step_dir_name", "list_steps", "latest_step_dir", "lock_dir", "save", "load", "read_meta"]

FORMAT = "mff-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"step_(\d{8,})\Z")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, incomplete, or made for another model."""


def lock_dir(ckpt_dir: str | os.PathLike):
    """Create ``ckpt_dir`` if needed, check it is a writable folder, and take an exclusive lock
    on ``ckpt_dir/.lock`` for this process (released when the returned file is closed or the
    process ends). Call on one rank only.

    Raises:
        CheckpointError: an empty path, a path that is not a folder, a folder that cannot be
            written, or a lock held by another run.
    """
    if not str(ckpt_dir):
        raise CheckpointError("the checkpoint folder is empty ('')")
    root = Path(ckpt_dir)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint folder {root} exists and is not a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / ".lock", "a+")
    except OSError as e:
        raise CheckpointError(f"checkpoint folder {root} cannot be written: {e.strerror or e}") from None
    try:
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        handle.close()
        raise CheckpointError(f"checkpoint folder {root} cannot be written: {e.strerror or e}") from None
    try:
        import fcntl

        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # not POSIX: no locking
        pass
    except OSError:
        handle.close()
        raise CheckpointError(f"checkpoint folder {root} is in use by another run (lock {root / '.lock'})") from None
    return handle


def step_dir_name(step: int) -> str:
    """``step_00000100`` for step 100."""
    return f"step_{step:08d}"


def list_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete-looking step dirs under ``ckpt_dir``, ascending (temp dirs ignored)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step_dir(ckpt_dir: str | os.PathLike) -> Path | None:
    """The step dir ``latest`` names, or None when there is no ``latest`` file.

    Raises:
        CheckpointError: ``latest`` names a missing dir or is malformed.
    """
    root = Path(ckpt_dir)
    latest = root / "latest"
    if not latest.exists():
        return None
    if not latest.is_file():
        raise CheckpointError(f"{latest} is not a file; it should hold the name of the newest step dir")
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except (UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{latest} is unreadable ({e}); it should hold a step dir name like 'step_00000100'") from None
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{latest} holds {name!r}, not a step dir name like 'step_00000100'")
    path = root / name
    if not path.is_dir():
        raise CheckpointError(f"{latest} names {name}, which does not exist under {root}")
    return path


def _full_cpu(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _latest_name(root: Path) -> str | None:
    try:
        return (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (the owner of a temp file or folder is still writing it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_tmp(root: Path, pattern: str = ".tmp-step_*-*") -> None:
    """Delete ``root/<pattern>`` dirs (named ``...-PID``) left by writers that died (their PID is gone)."""
    for p in root.glob(pattern):
        pid = p.name.rsplit("-", 1)[-1]
        if p.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    params: Mapping[str, torch.Tensor],
    optim_state: Mapping[str, Any],
    meta: Mapping[str, Any],
    keep_last: int = 0,
) -> Path:
    """Write step ``step`` and make it ``latest``; returns its dir.

    Every rank must call this (DTensors are gathered with collectives); rank 0 writes.
    ``meta`` must be msgpack-serialisable; ``format``, ``version`` and ``step`` are added.
    ``keep_last`` > 0 removes the oldest step dirs beyond that many, after ``latest`` moved.

    Raises:
        CheckpointError: the step dir already exists (a checkpoint is never overwritten).
    """
    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    model_t = {k: _full_cpu(v) for k, v in params.items()}
    optim_t = {k: _full_cpu(v) for k, v in flatten_with_paths(dict(optim_state)) if isinstance(v, torch.Tensor)}
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(root)
        if final.exists():
            if _latest_name(root) == final.name or not final.is_dir():
                raise CheckpointError(f"{final} already exists; refusing to overwrite a checkpoint")
            # renamed into place but never made `latest` (a crash between the two): not a
            # committed checkpoint, so it is replaced
            shutil.rmtree(final)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file(model_t, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        save_file(optim_t, str(tmp / "optim.safetensors"), metadata={"format": "pt"})
        full_meta = {"format": FORMAT, "version": VERSION, **dict(meta), "step": step}
        _write_atomic(tmp / "meta.msgpack", msgpack.packb(full_meta, use_bin_type=True))
        mode = 0o666 & ~_umask()
        for f in tmp.iterdir():
            os.chmod(f, mode)  # safetensors creates its files 0600; make all files alike
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / "latest", (final.name + "\n").encode())
        _fsync_dir(root)
        if keep_last > 0:
            for old in list_steps(root)[:-keep_last]:
                if old != step:
                    shutil.rmtree(root / step_dir_name(old), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def save_weights(
    ckpt_dir: str | os.PathLike,
    params: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    step: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write a weights-only checkpoint (no optimizer state) as step ``step`` of ``ckpt_dir``
    and make it ``latest``: what ``mff.recipes.convert --to mff`` writes and ``mff.load`` or
    ``--init-from`` read. Single process. Tensors stream to disk one at a time (no second copy
    of the model in memory); the step dir is written under a temp name and renamed.

    Raises:
        CheckpointError: the step dir already exists.
    """
    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    if final.exists():
        raise CheckpointError(f"{final} already exists; refusing to overwrite a checkpoint")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors = {k: _full_cpu(v) for k, v in params.items()}
        write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
        if progress is not None:
            progress(sum(t.numel() * t.element_size() for t in tensors.values()))
        del tensors
        _write_atomic(tmp / "meta.msgpack", msgpack.packb({"format": FORMAT, "version": VERSION, **dict(meta), "step": step}, use_bin_type=True))
        mode = 0o666 & ~_umask()
        for f in tmp.iterdir():
            os.chmod(f, mode)
        _fsync_dir(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _write_atomic(root / "latest", (final.name + "\n").encode())
    _fsync_dir(root)
    return final


def read_meta(step_dir: str | os.PathLike, required: tuple[str, ...] = ()) -> dict:
    """The ``meta.msgpack`` of a step dir.

    Raises:
        CheckpointError: missing, unreadable, not an mff checkpoint of a known version, or
            lacking one of the ``required`` keys.
    """
    path = Path(step_dir) / "meta.msgpack"
    try:
        meta = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {step_dir} has no meta.msgpack (incomplete or not an mff checkpoint)") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mff checkpoint (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {meta.get('version')}; this mff reads version {VERSION}")
    missing = [k for k in ("step", *required) if k not in meta]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; it is incomplete or was written by another tool")
    return meta


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except Exception as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {e}") from None


def place_like(name: str, loaded: torch.Tensor | None, like: torch.Tensor, where: str | Path) -> torch.Tensor:
    """``loaded`` as a fresh tensor with the shape, dtype, device, DTensor placements and
    requires_grad of ``like``. Raises CheckpointError naming ``name`` when it is missing or its
    shape or dtype differs (both named)."""
    if loaded is None:
        raise CheckpointError(f"{where} has no tensor {name!r}")
    if tuple(loaded.shape) != tuple(like.shape):
        raise CheckpointError(f"{where}: {name!r} has shape {tuple(loaded.shape)}, the model expects {tuple(like.shape)}")
    if loaded.dtype != like.dtype:
        raise CheckpointError(f"{where}: {name!r} has dtype {loaded.dtype}, the model expects {like.dtype}")
    # A fresh allocation: safetensors may hand back tensors at offsets inside one buffer, and
    # BLAS kernels can round differently on differently aligned inputs, which would break
    # bitwise-exact resume.
    loaded = loaded.clone()
    if isinstance(like, DTensor):
        out = distribute_tensor(loaded.to(like.device_mesh.device_type), like.device_mesh, like.placements)
    else:
        out = loaded.to(like.device)
    return out.requires_grad_(like.requires_grad)


def load(
    step_dir: str | os.PathLike,
    params_like: Mapping[str, torch.Tensor],
    optim_like: Mapping[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], dict | None, dict]:
    """Read a step dir onto the placements of ``params_like`` (and ``optim_like``).

    Returns ``(params, optim_state or None, meta)``; tensors take the shape, dtype, device and
    DTensor placements of the templates.

    Raises:
        CheckpointError: unreadable or truncated files, missing or extra tensors, or shape
            and dtype mismatches (each message names the tensor and both shapes).
    """
    step_dir = Path(step_dir)
    meta = read_meta(step_dir)
    model_file = step_dir / "model.safetensors"
    loaded = _read_tensors(model_file)
    extra = sorted(set(loaded) - set(params_like))
    if extra:
        raise CheckpointError(f"{model_file} has tensors the model does not: {extra[:5]}")
    params = {k: place_like(k, loaded.get(k), v, model_file) for k, v in params_like.items()}
    state = None
    if optim_like is not None:
        optim_file = step_dir / "optim.safetensors"
        loaded = _read_tensors(optim_file)
        items = flatten_with_paths(dict(optim_like))
        extra = sorted(set(loaded) - {k for k, _ in items})
        if extra:
            raise CheckpointError(f"{optim_file} has entries the optimizer does not: {extra[:5]}")
        state = unflatten_paths((k, place_like(k, loaded.get(k), v, optim_file)) for k, v in items)
    return params, state, meta
