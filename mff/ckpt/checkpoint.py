"""Checkpoints in mff's one layout (DESIGN.md)::

    CKPT_DIR/step_00000100/model.safetensors   params, keys = param paths (one process)
    CKPT_DIR/step_00000100/optim.safetensors   optimizer state, keys = "<slot>/<param path>" (+ "step")
    CKPT_DIR/step_00000100/model-rank00003-of-00004.safetensors   (several processes: each rank's
    CKPT_DIR/step_00000100/optim-rank00003-of-00004.safetensors    own blocks, same keys)
    CKPT_DIR/step_00000100/meta.msgpack        format/version, step, tokens seen, data position,
                                               RNG states, family + config, mesh, placements, and
                                               the piece index ``layout`` (mff.ckpt.shards)
    CKPT_DIR/latest                            name of the newest complete step dir, written last

A step dir is written under a temporary name and renamed into place, then ``latest`` is
replaced atomically; a crash at any point leaves the previous checkpoint intact and ``latest``
pointing to a complete one. Older step dirs beyond ``keep_last`` are removed only after the new
one is complete. Under several processes every rank writes its own shard files into rank 0's
temp dir (one replica of each block), so no tensor is ever gathered; the index in the metadata
lets any mesh (or one process) read back exactly the blocks it needs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mff.ckpt.safetensors_io import write_safetensors
from mff.ckpt.shards import ShardedTensors, encode_placements, piece_file, shard_region, tensor_entry, writes_piece
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
    top = next((p for p in reversed([root, *root.parents]) if not p.exists()), None)  # the outermost folder this call makes
    _CREATED.append((root, top, not (root / ".lock").exists()))
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
    remove_stale_tmp(root)  # what writers killed mid-save left
    return handle


_CREATED: list[tuple[Path, Path | None, bool]] = []
"""What :func:`lock_dir` made in this process: ``(folder, the outermost folder it created (None:
the folder existed), whether it created the .lock file)``."""
_START_UP_FILES = ("run_config.json", "tokenizer.json", "tokenizer_config.json")


def discard_unused_dirs() -> None:
    """Remove the checkpoint folders :func:`lock_dir` created in this process that hold only what
    a run writes at start-up (``.lock``, ``run_config.json``, the tokenizer files): called when a
    run fails before its first checkpoint, so that nothing is left behind, with the empty parent
    folders made for them. A folder holding anything else (a step dir, ``latest``, a metrics file)
    is kept; of a folder that existed before, only the ``.lock`` file the run added is removed."""
    while _CREATED:
        root, top, new_lock = _CREATED.pop()
        if top is None:  # the user's folder: only the lock file this run added goes
            if new_lock and not (root / "latest").exists():
                (root / ".lock").unlink(missing_ok=True)
            continue
        try:
            names = [p.name for p in root.iterdir()]
        except OSError:
            continue
        if all(n == ".lock" or n in _START_UP_FILES or n.startswith(".probe-") for n in names):
            shutil.rmtree(root, ignore_errors=True)
            for parent in root.parents:  # and the empty parents it made for it
                if top not in (parent, *parent.parents):
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break


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
        raise CheckpointError(f"{latest} is not a file; it should hold the name of the newest step dir{_step_dirs_hint(root)}")
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except (UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{latest} is unreadable ({e}); it should hold a step dir name like 'step_00000100'"
                              f"{_step_dirs_hint(root)}") from None
    if not _STEP_RE.match(name):
        raise CheckpointError(f"{latest} holds {_short(name)}, not a step dir name like 'step_00000100'{_step_dirs_hint(root)}")
    path = root / name
    if not path.is_dir():
        raise CheckpointError(f"{latest} names {name}, which does not exist under {root}{_step_dirs_hint(root)}")
    return path


def _step_dirs_hint(root: Path) -> str:
    """What a user can resume from when ``latest`` is bad: the step dirs that are there."""
    steps = list_steps(root)
    if not steps:
        return "; there is no step dir under it"
    shown = ", ".join(step_dir_name(s) for s in steps[-5:])
    more = f" (and {len(steps) - 5} older)" if len(steps) > 5 else ""
    return (f"; step dirs there: {shown}{more} (to resume from one, write its name into latest, e.g. "
            f"`echo {step_dir_name(steps[-1])} > {root / 'latest'}`)")


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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    """Delete ``root/<pattern>`` dirs (named ``...-PID``) left by writers that died (their PID is
    gone), and the ``.latest.tmp-PID`` file of a ``latest`` update they did not finish."""
    for p in [*root.glob(pattern), *root.glob(".latest.tmp-*")]:
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.is_file():
                p.unlink(missing_ok=True)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(err: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed at ``what``; all then raise CheckpointError
    with the first failing rank's message (so no rank waits for one that gave up)."""
    rank, world = _rank_world()
    mine = None if err is None else (str(err) or type(err).__name__)
    everyone: list[str | None] = [mine]
    if world > 1:
        from mff.parallel.watchdog import collective

        everyone = [None] * world
        with collective(f"all_gather_object (checkpoint: {what})"):
            dist.all_gather_object(everyone, mine)
    for k, msg in enumerate(everyone):
        if msg is not None:
            raise CheckpointError(msg if k == rank or world == 1 else f"{what} failed on rank {k}: {msg}")


def _local_block(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().to("cpu").contiguous()


def _pieces_of_rank(items: list[tuple[str, torch.Tensor]], rank: int) -> dict[str, torch.Tensor]:
    """The blocks this rank writes: its local shard of each DTensor it is the lowest replica of,
    and (rank 0) the plain tensors."""
    out = {}
    for name, t in items:
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            coord = mesh.get_coordinate()
            if coord is not None and writes_piece(mesh.shape, coord, t.placements):
                out[name] = _local_block(t)
        elif rank == 0:
            out[name] = _local_block(t)
    return out


def _layout(groups: dict[str, list[tuple[str, torch.Tensor]]], world: int) -> dict:
    """The piece index of ``meta["layout"]`` (see :mod:`mff.ckpt.shards`)."""
    meshes: list[dict] = []
    index_of: dict[int, int] = {}  # id(mesh) -> index into meshes
    tensors: dict[str, dict] = {}
    for kind, items in groups.items():
        tensors[kind] = {}
        for name, t in items:
            index = None
            if isinstance(t, DTensor):
                mesh = t.device_mesh
                if id(mesh) not in index_of:
                    desc = {"axes": list(mesh.mesh_dim_names or ()), "shape": list(mesh.shape), "ranks": mesh.mesh.flatten().tolist()}
                    index_of[id(mesh)] = meshes.index(desc) if desc in meshes else len(meshes)
                    if index_of[id(mesh)] == len(meshes):
                        meshes.append(desc)
                index = index_of[id(mesh)]
            tensors[kind][name] = tensor_entry(kind, t, index, world)
    return {"world_size": world, "meshes": meshes, "tensors": tensors}


def _merge_layouts(layouts: list[dict]) -> dict:
    """One piece index from the ranks' own (ranks that hold different tensors: pipeline stages):
    meshes deduplicated, each tensor's entry taken from the first rank that has it (every
    rank holding a tensor lists all of its pieces, so their entries agree)."""
    meshes: list[dict] = []
    tensors: dict[str, dict] = {}
    for lay in layouts:
        index = {}
        for i, desc in enumerate(lay["meshes"]):
            if desc not in meshes:
                meshes.append(desc)
            index[i] = meshes.index(desc)
        for kind, entries in lay["tensors"].items():
            into = tensors.setdefault(kind, {})
            for name, e in entries.items():
                if name not in into:
                    into[name] = {**e, "mesh": index[e["mesh"]] if e["mesh"] is not None else None}
    return {"world_size": layouts[0]["world_size"], "meshes": meshes, "tensors": tensors}


def _global_layout(groups: dict[str, list[tuple[str, torch.Tensor]]], rank: int, world: int) -> dict | None:
    """The piece index of the whole checkpoint, on rank 0 (None elsewhere). When every rank
    holds the same tensors (data and tensor parallelism) rank 0's own index is the whole one;
    when they differ (pipeline stages) the ranks' indexes are gathered and merged."""
    mine = _layout(groups, world)
    if world == 1:
        return mine
    from mff.parallel.watchdog import collective

    names = sorted(f"{kind}/{name}" for kind, items in groups.items() for name, _ in items)
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()
    digests: list[str | None] = [None] * world
    with collective("all_gather_object (checkpoint: which tensors each rank holds)"):
        dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return mine if rank == 0 else None
    layouts: list[dict | None] = [None] * world if rank == 0 else None
    with collective("gather_object (checkpoint: the ranks' piece indexes)"):
        dist.gather_object(mine, layouts, dst=0)
    return _merge_layouts([lay for lay in layouts if lay is not None]) if rank == 0 else None


def _prepare_tmp(root: Path, final: Path) -> Path:
    """Rank 0: a fresh temp step dir next to ``final`` (refusing to overwrite a committed one)."""
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
    return tmp


def _previous(root: Path) -> str:
    last = latest_step_dir(root)
    return f"the last checkpoint, {last.name}, is unchanged" if last is not None else "no earlier checkpoint"


def _write_pieces(tmp: Path, kind: str, pieces: dict[str, torch.Tensor], rank: int, world: int) -> None:
    if not pieces:
        return
    path = tmp / piece_file(kind, rank, world)
    try:
        save_file(pieces, str(path), metadata={"format": "pt"})
    except SafetensorError as e:  # the library's wrapper of a failed write (disk full, file-size limit, I/O error)
        raise OSError(f"{path.name}: {str(e).removeprefix('Error while serializing: ')}") from None
    os.chmod(path, 0o666 & ~_umask())  # safetensors creates its files 0600; make all files alike
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _commit(root: Path, tmp: Path, final: Path, full_meta: dict, step: int, keep_last: int) -> None:
    """Rank 0, after every rank wrote its pieces: meta, fsync, rename, ``latest``, pruning."""
    _write_atomic(tmp / "meta.msgpack", msgpack.packb(full_meta, use_bin_type=True))
    os.chmod(tmp / "meta.msgpack", 0o666 & ~_umask())
    _fsync_dir(tmp)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / "latest", (final.name + "\n").encode())
    _fsync_dir(root)
    if keep_last > 0:
        for old in list_steps(root)[:-keep_last]:
            if old != step:
                shutil.rmtree(root / step_dir_name(old), ignore_errors=True)


def save(
    ckpt_dir: str | os.PathLike,
    step: int,
    params: Mapping[str, torch.Tensor],
    optim_state: Mapping[str, Any],
    meta: Mapping[str, Any],
    keep_last: int = 0,
) -> Path:
    """Write step ``step`` and make it ``latest``; returns its dir.

    Every rank must call this. Each rank writes the blocks of DTensors it holds (one replica
    of each block: see :mod:`mff.ckpt.shards`) to its own ``model-rankR-of-W.safetensors`` and
    ``optim-rankR-of-W.safetensors`` (``model.safetensors`` / ``optim.safetensors`` on one
    process) in a temp dir that rank 0 creates; rank 0 writes ``meta.msgpack`` with the piece
    index (``layout``), then renames the dir into place and moves ``latest``. No collective
    gathers a tensor: each rank's memory holds only its own shards.

    ``meta`` must be msgpack-serialisable; ``format``, ``version``, ``step`` and ``layout`` are
    added. ``keep_last`` > 0 removes the oldest step dirs beyond that many, after ``latest``
    moved.

    Raises:
        CheckpointError: a DTensor placed other than by Shard/Replicate (every rank, before
            writing), the step dir already exists (a checkpoint is never overwritten), or a
            rank could not write its files (on every rank, naming the failing one); the temp
            dir is then removed and ``latest`` is unchanged.
    """
    from mff.parallel.watchdog import collective

    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    rank, world = _rank_world()
    groups = {"model": list(params.items()),
              "optim": [(k, v) for k, v in flatten_with_paths(dict(optim_state)) if isinstance(v, torch.Tensor)]}
    for items in groups.values():
        for name, t in items:
            if isinstance(t, DTensor):
                try:
                    encode_placements(t.placements)
                except ValueError as e:
                    raise CheckpointError(f"cannot save {name!r}: {e}") from None
    tmp, err = None, None
    if rank == 0:
        try:
            tmp = _prepare_tmp(root, final)
        except (CheckpointError, OSError) as e:
            err = e
    agree(err, f"creating the temp folder of step {step}")
    if world > 1:
        box = [str(tmp) if tmp is not None else None]
        with collective(f"broadcast_object_list (checkpoint temp folder of step {step})"):
            dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
    assert tmp is not None
    err = None
    try:
        for kind, items in groups.items():
            _write_pieces(tmp, kind, _pieces_of_rank(items, rank), rank, world)
    except OSError as e:
        err = CheckpointError(f"cannot write shard files to {tmp}: {e.strerror or e} (the temp folder is removed; "
                              f"{_previous(root)})")
    except BaseException:  # Ctrl-C during the write: no half-written step folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        agree(err, f"writing the shard files of step {step}")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    err = None
    layout = _global_layout(groups, rank, world)
    if rank == 0:
        full_meta = {"format": FORMAT, "version": VERSION, **dict(meta), "step": step, "layout": layout}
        try:
            _commit(root, tmp, final, full_meta, step, keep_last)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = CheckpointError(f"cannot complete checkpoint {final}: {e.strerror or e}")
    agree(err, f"committing step {step}")
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
        CheckpointError: missing, unreadable, not an mff checkpoint of a known version,
            lacking one of the ``required`` keys, a key of the wrong type, or a step that is not
            the one its ``step_NNNNNNNN`` folder is named for.
    """
    path = Path(step_dir) / "meta.msgpack"
    try:
        meta = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {step_dir} has no meta.msgpack (incomplete or not an mff checkpoint)") from None
    except Exception as e:
        why = str(e) or ("nested too deeply" if type(e).__name__ == "StackError" else "not msgpack data")
        raise CheckpointError(f"checkpoint {path} is unreadable: {type(e).__name__}: {why}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mff checkpoint (format {meta.get('format') if isinstance(meta, dict) else None!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {meta.get('version')}; this mff reads version {VERSION}")
    missing = [k for k in ("step", *required) if k not in meta]
    if missing:
        raise CheckpointError(f"{path} lacks {missing}; it is incomplete or was written by another tool")
    for key, kinds, what in _META_TYPES:
        value = meta.get(key)
        if key in meta and (not isinstance(value, kinds) or isinstance(value, bool) or (kinds == int and value < 0)):
            raise CheckpointError(f"{path} is corrupt: {key} is {_short(value)}, expected {what}")
    named = re.fullmatch(r"step_(\d+)", Path(step_dir).name)
    if named and int(named.group(1)) != meta["step"]:
        raise CheckpointError(f"{path} is corrupt: step is {_short(meta['step'])} in a folder named {Path(step_dir).name}")
    return meta


_META_TYPES = (("step", int, "a step number >= 0"), ("tokens_seen", int, "a token count >= 0"), ("family", str, "a model family name"),
               ("recipe", str, "a recipe name"), ("config", dict, "the model config (a map)"), ("run", dict, "the run config (a map)"),
               ("data", dict, "the data loader's position (a map)"), ("rng", dict, "the RNG states (a map)"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def open_tensors(step_dir: str | os.PathLike, meta: Mapping[str, Any], kind: str) -> ShardedTensors:
    """The ``kind`` ("model" or "optim") tensors of a step dir, sharded or single-file, as a
    :class:`mff.ckpt.shards.ShardedTensors` (nothing is read until asked for).

    Raises:
        CheckpointError: a missing or corrupt file, or a malformed piece index.
    """
    try:
        return ShardedTensors(step_dir, meta, kind)
    except (FileNotFoundError, ValueError) as e:  # ShardIndexError is a ValueError
        raise CheckpointError(str(e)) from None


def _read_like(src: ShardedTensors, name: str, like: torch.Tensor) -> torch.Tensor:
    """Tensor ``name`` of ``src`` with the shape, dtype, device, DTensor placements and
    requires_grad of ``like``: a DTensor template gets only this rank's block, read from the
    overlapping slices of the pieces."""
    if name not in src.entries:
        raise CheckpointError(f"{src.where} has no tensor {name!r}")
    if src.shape(name) != tuple(like.shape):
        raise CheckpointError(f"{src.where}: {name!r} has shape {src.shape(name)}, the model expects {tuple(like.shape)}")
    stored = src.dtype(name)
    if stored is not None and stored != like.dtype:
        raise CheckpointError(f"{src.where}: {name!r} has dtype {stored}, the model expects {like.dtype}")
    try:
        if isinstance(like, DTensor):
            mesh = like.device_mesh
            bad = [p for p in like.placements if type(p) not in (Shard, Replicate)]
            if bad:
                raise CheckpointError(f"cannot load {name!r} onto placements {like.placements}: only Shard and Replicate are supported")
            offset, length = shard_region(like.shape, mesh.shape, mesh.get_coordinate(), like.placements)
            if tuple(length) != tuple(like.to_local().shape):
                raise CheckpointError(f"cannot load {name!r}: its block on this rank has shape {tuple(like.to_local().shape)}, "
                                      f"the sharding arithmetic gives {tuple(length)}")
            local = src.read_region(name, offset, length)
        else:
            local = src.read(name)
    except (ValueError, FileNotFoundError) as e:
        raise CheckpointError(str(e)) from None
    if local.dtype != like.dtype:
        raise CheckpointError(f"{src.where}: {name!r} has dtype {local.dtype}, the model expects {like.dtype}")
    # read_region allocates afresh: safetensors may hand back tensors at offsets inside one
    # buffer, and BLAS kernels can round differently on differently aligned inputs, which would
    # break bitwise-exact resume.
    if isinstance(like, DTensor):
        local = local.to(like.to_local().device)
        out = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
    else:
        out = local.to(like.device)
    return out.requires_grad_(like.requires_grad)


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
    model_params: Collection[str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict | None, dict]:
    """Read a step dir onto the placements of ``params_like`` (and ``optim_like``), on any mesh.

    Returns ``(params, optim_state or None, meta)``; tensors take the shape, dtype, device and
    DTensor placements of the templates. Each rank reads only the slices of the piece files
    that overlap its own blocks (no rank holds a whole sharded tensor), so a checkpoint saved
    on one mesh loads onto another. Single-file checkpoints (one process, or written before
    sharded saving) load the same way. No collectives. ``model_params``: every param path of
    the model when the templates are a part of it (a pipeline stage's): the checkpoint may hold
    the other paths (and their optimizer state), and only tensors outside the model are extra.

    Raises:
        CheckpointError: unreadable or truncated files, missing or extra tensors, or shape
            and dtype mismatches (each message names the tensor and both shapes).
    """
    step_dir = Path(step_dir)
    meta = read_meta(step_dir)
    src = open_tensors(step_dir, meta, "model")
    known = set(params_like) if model_params is None else set(model_params)
    extra = sorted(set(src.names) - known)
    if extra:
        raise CheckpointError(f"{src.where} has tensors the model does not: {extra[:5]}")
    params = {k: _read_like(src, k, v) for k, v in params_like.items()}
    src.close()
    state = None
    if optim_like is not None:
        src = open_tensors(step_dir, meta, "optim")
        items = flatten_with_paths(dict(optim_like))
        names = {k for k, _ in items}
        extra = sorted(n for n in set(src.names) - names if model_params is None or n.split("/", 1)[-1] not in known)
        if extra:
            raise CheckpointError(f"{src.where} has entries the optimizer does not: {extra[:5]}")
        state = unflatten_paths((k, _read_like(src, k, v)) for k, v in items)
        src.close()
    return params, state, meta
