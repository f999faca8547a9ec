"""Device and communication backend: device choice, process-group bootstrap, fused-op dispatch.

One codebase runs on Ascend NPU (``torch_npu``, HCCL), CUDA (NCCL) and CPU (gloo). The device
comes from ``--device`` (``auto|cpu|cuda|npu``), else from the ``MF_DEVICE_TYPE`` environment
variable that MindFormers users know, else ``auto``: NPU when ``torch_npu`` imports and reports
a device, else CUDA when available, else CPU.

The process group is always initialised, also for one process: without ``torchrun`` the
environment is filled with ``RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``; under ``torchrun`` its variables are used as they are.

Fused ops go through :data:`ops`, a small table filled per device: on an NPU the guarded
``torch_npu`` kernels of :mod:`mff.backend.npu` (RMSNorm, grouped matmul, SwiGLU, fusion
attention, rotary, MoE token permute), pure torch otherwise. The NPU entries are written against torch_npu's
documented signatures and limits but have not run on an NPU in this project: CPU CI checks them
through a stand-in module that enforces the documented contracts (``tests/npu_standin.py``).
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from mff.backend import npu as npu_ops
from mff.backend.npu import swiglu_torch
from mff.parallel.watchdog import set_timeout

__all__ = [
    "launch_world_size",
    "available_memory_gib",
    "check_group_counts",
    "is_transposed_stack",
    "DEVICES",
    "DeviceUnavailable",
    "DistInfo",
    "resolve_device",
    "init_distributed",
    "local_device",
    "comm_backend",
    "ops",
    "select_ops",
    "swiglu_torch",
    "cpu_threads",
]

DEVICES = ("auto", "cpu", "cuda", "npu")
_ENV_ALIASES = {"ascend": "npu", "npu": "npu", "gpu": "cuda", "cuda": "cuda", "cpu": "cpu", "auto": "auto"}
_COMM = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


class DeviceUnavailable(RuntimeError):
    """The requested device cannot be used here; the message says what is missing and how to install it."""


def _import_torch_npu() -> ModuleType | None:
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # ImportError, or a torch_npu built for another torch
        return None


def _npu_count(torch_npu: ModuleType | None) -> int:
    if torch_npu is None:
        return 0
    try:
        return int(torch.npu.device_count())  # torch_npu registers torch.npu
    except Exception:
        return 0


def cpu_threads(requested: int | None, device_type: str, local_world_size: int | None = None,
                load: float | None = None, cores: int | None = None) -> tuple[int | None, str]:
    """The torch CPU thread count a run uses, and why (a phrase for the log).

    ``requested`` (``--threads``) wins. On CPU without it: the cores this process may use,
    split between the ``local_world_size`` processes of this machine (``LOCAL_WORLD_SIZE`` from
    torchrun), and never more than the cores the 1-minute load average leaves free (at least
    1): on a 2-core machine that other work keeps busy, 1 thread trained the quick-start model
    1.5x faster than 2 (``python bench/threads.py``, README "Threads"). Other devices: None
    (torch's default). ``load`` / ``cores`` replace the measured ones (tests).

    Raises:
        ValueError: ``requested`` < 1.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads {requested} must be >= 1")
        return requested, "--threads"
    if device_type != "cpu":
        return None, "torch's default"
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    share = max(1, cores // max(1, local_world_size))
    free = max(1, int(cores - load + 0.5))
    n = min(share, free)
    why = f"{cores} cores / {local_world_size} process{'es' if local_world_size > 1 else ''}"
    if free < share:
        why += f", load average {load:.1f} from other work"
    return n, why + "; --threads N to set"


def resolve_device(flag: str | None = None, env: dict[str, str] | None = None) -> str:
    """Pick the device type: ``"cpu"``, ``"cuda"`` or ``"npu"``.

    Args:
        flag: the ``--device`` value (``auto|cpu|cuda|npu``) or None when not given.
        env: the environment to read ``MF_DEVICE_TYPE`` from (default ``os.environ``).
            The flag wins over the variable; values ``Ascend``/``GPU`` are accepted in the
            variable as MindFormers spells them.

    Raises:
        ValueError: an unknown device name (the message lists the valid ones).
        DeviceUnavailable: ``npu`` without torch_npu or without a visible NPU, ``cuda``
            without a CUDA build of torch or without a visible GPU.
    """
    env = os.environ if env is None else env
    if flag is None or flag == "":
        raw = env.get("MF_DEVICE_TYPE", "").strip() or "auto"
        choice = _ENV_ALIASES.get(raw.lower())
        if choice is None:
            raise ValueError(f"MF_DEVICE_TYPE={raw!r} is not a device; expected one of auto, cpu, cuda (GPU), npu (Ascend)")
        source = f"MF_DEVICE_TYPE={raw}"
    else:
        choice = flag.strip().lower()
        if choice not in DEVICES:
            raise ValueError(f"--device {flag!r} is not a device; expected one of {', '.join(DEVICES)}")
        source = f"--device {choice}"

    if choice == "auto":
        if _npu_count(_import_torch_npu()) > 0:
            return "npu"
        if torch.cuda.is_available():
            return "cuda"
        return "cpu"
    if choice == "npu":
        torch_npu = _import_torch_npu()
        if torch_npu is None:
            raise DeviceUnavailable(
                f"{source}: torch_npu is not installed; install the Ascend CANN toolkit, then the torch_npu release of "
                f"this torch: `pip install 'torch-npu=={torch.__version__.split('+')[0]}.*'` (an unpinned torch-npu "
                "replaces torch with its own release), or use --device cpu"
            )
        if _npu_count(torch_npu) == 0:
            raise DeviceUnavailable(f"{source}: torch_npu imports but sees no NPU (check the driver and ASCEND_RT_VISIBLE_DEVICES)")
        return "npu"
    if choice == "cuda":
        if torch.version.cuda is None:
            raise DeviceUnavailable(
                f"{source}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build "
                "(see https://pytorch.org/get-started/locally/), or use --device cpu"
            )
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"{source}: torch has CUDA but sees no GPU (check the driver and CUDA_VISIBLE_DEVICES)")
        return "cuda"
    return "cpu"


def comm_backend(device_type: str) -> str:
    """The torch.distributed backend of a device type: npu -> hccl, cuda -> nccl, cpu -> gloo."""
    try:
        return _COMM[device_type]
    except KeyError:
        raise ValueError(f"no communication backend for device type {device_type!r}; expected cpu, cuda or npu") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs: ``rank``/``world_size``/``local_rank`` from the process group,
    ``device`` the torch device of this rank, ``device_type`` cpu|cuda|npu, ``backend`` its
    collective library."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_type: str
    backend: str


def local_device(device_type: str) -> torch.device:
    """This process's device, made current, with the op table filled for it: ``LOCAL_RANK``'s GPU
    or NPU (``torch.cuda.set_device`` / ``torch.npu.set_device``, which torch_npu needs before any
    process group or mesh; ``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` decide which
    physical device that index is), or the CPU. Used by :func:`init_distributed` and by the
    single-process recipes (generate, eval)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    elif device_type == "npu":
        _import_torch_npu()
        torch.npu.set_device(local_rank)
        device = torch.device("npu", local_rank)
    else:
        device = torch.device("cpu")
    select_ops(device_type)
    return device


def launch_world_size() -> int:
    """The process count the launcher (torchrun) announces in ``WORLD_SIZE`` (1 without one),
    known before the ranks connect: a layout that cannot fit it can fail on every rank alike
    instead of on the first rank while the others are still connecting.

    Raises:
        ValueError: a ``WORLD_SIZE`` that is not a positive integer."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"WORLD_SIZE={text!r} in the environment is not a positive integer (torchrun sets it)")
    return n


def init_distributed(device_type: str, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise (or reuse) the default process group for ``device_type``.

    Without torchrun the single-process environment is filled in (see module doc). The
    device of this rank is set before the group is created (torch_npu requires that before
    ``init_device_mesh``). Collectives time out after ``timeout_s`` seconds.

    Raises:
        ValueError: ``timeout_s`` not a finite number >= 1 (shorter ones break the rendezvous itself).
    """
    if not (timeout_s >= 1 and timeout_s != float("inf")):
        raise ValueError(f"collective timeout {timeout_s} s must be a finite number >= 1 second (--parallel.timeout-s)")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = local_device(device_type)
    backend = comm_backend(device_type)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        set_timeout(timeout_s)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        device_type=device_type,
        backend=backend,
    )


# ----------------------------------------------------------------------------------------
# fused-op table


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF transformers computes it (``LlamaRMSNorm``): statistics in fp32, the
    normalised input cast back to ``x.dtype``, then scaled by ``weight``.

    Shapes: x [..., D], weight [D]; returns [..., D] in the promoted dtype of weight and x.
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def is_transposed_stack(w_EDF: torch.Tensor) -> bool:
    """Whether ``w_EDF`` ([E, D, F]) is the ``transpose(1, 2)`` view of a contiguous [E, F, D]
    stack: how the experts pass their ``[E, out, in]`` params to a grouped GEMM. A weight
    gradient made in the [E, F, D] layout then comes out in the param's own layout."""
    return w_EDF.dim() == 3 and not w_EDF.is_contiguous() and w_EDF.transpose(1, 2).is_contiguous()


def grouped_mm_loop(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per-expert matmul over contiguous row groups: rows ``[sum(counts[:e]), sum(counts[:e+1]))``
    of ``x_ND`` times ``w_EDF[e]`` ([D, F]). Returns [N, F]. A plain loop, the reference for
    :func:`grouped_mm_fused`.

    The experts come from one ``unbind``: its backward stacks the E gradients once, where
    indexing ``w_EDF[e]`` per expert would allocate and zero-fill a whole [E, D, F] gradient for
    each expert (a fixed cost per forward that dominated short micro-batches). When ``w_EDF`` is
    the transposed view of a contiguous [E, F, D] stack (the experts' ``[E, out, in]`` params),
    the unbind is of that stack, so the stacked gradient comes out in the param's own layout
    (a transposed one would keep the fused AdamW kernel from taking it)."""
    if is_transposed_stack(w_EDF):
        w_e = [w.t() for w in w_EDF.transpose(1, 2).unbind(0)]
    else:
        w_e = w_EDF.unbind(0)
    outs = [x.matmul(w_e[e]) for e, x in enumerate(x_ND.split(counts, dim=0)) if counts[e]]
    if not outs:
        return x_ND.new_zeros(x_ND.shape[0], w_EDF.shape[-1])
    return torch.cat(outs, dim=0)


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def check_group_counts(counts: list[int], rows: int, experts: int) -> None:
    """Raises ValueError unless ``counts`` has one entry per expert, none negative, summing to
    ``rows`` (``torch._grouped_mm`` does not check: past the last offset its output rows are
    left uninitialised)."""
    if len(counts) != experts or any(c < 0 for c in counts) or sum(counts) != rows:
        shown = counts if len(counts) <= 16 else f"{counts[:16]}... ({len(counts)} entries)"
        raise ValueError(f"grouped GEMM group counts {shown} must be {experts} non-negative ints summing to the {rows} rows")


def _aligned16(t: torch.Tensor) -> bool:
    return all((s * t.element_size()) % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_fused(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same product through ``torch._grouped_mm`` (one kernel for all experts).

    ``torch._grouped_mm`` takes float32, bfloat16 or float16 (one dtype for both) with strides
    that are multiples of 16 bytes; other dtypes and shapes take the per-expert loop. Raises
    ValueError for counts that do not split the rows over the experts. It also rejects a non-contiguous output gradient in its backward (seen on
    torch 2.13 CPU), so the output's gradient is made contiguous by a hook.
    """
    if not (x_ND.dtype == w_EDF.dtype and x_ND.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _aligned16(x_ND) and _aligned16(w_EDF) and (w_EDF.shape[-1] * w_EDF.element_size()) % 16 == 0):
        return grouped_mm_loop(x_ND, w_EDF, counts)
    check_group_counts(counts, x_ND.shape[0], w_EDF.shape[0])
    offs = torch.tensor(counts, device=x_ND.device, dtype=torch.int64).cumsum(0).to(torch.int32)
    return _contiguous_grad(torch._grouped_mm(x_ND, w_EDF, offs=offs))


def _grouped_mm_runs(device_type: str) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        dev = torch.device(device_type)
        x = torch.randn(4, 8, device=dev, requires_grad=True)
        w = torch.randn(2, 8, 4, device=dev, requires_grad=True)
        y = grouped_mm_fused(x, w, [1, 3])
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        ref = grouped_mm_loop(x.detach(), w.detach(), [1, 3])
        return bool(torch.allclose(y.detach(), ref, atol=1e-5)) and gx is not None and gw is not None
    except Exception:
        return False


@dataclass
class OpTable:
    """The kernels in use. ``names`` says which implementation each entry is, for logs and tests.

    - ``rms_norm(x [..., D], weight [D], eps) -> [..., D]``;
    - ``grouped_mm(x [N, D], w [E, D, F], counts: E ints summing to N) -> [N, F]``;
    - ``swiglu(x [..., 2F]) -> [..., F]``: ``silu(gate) * up`` on gate-first halves;
    - ``attention(q [B, T, H, D], k [B, S, K, D], v [B, S, K, E], scale, mask, twin) -> [B, T, H, E]``
      or None: None is mff's torch attention (:func:`mff.nn.attention.causal_attention`), which
      an entry takes as ``twin`` where its kernel cannot run;
    - ``rope(x [B, T, H, D], cos [B, T, R], sin [B, T, R], layout, twin) -> [B, T, H, D]`` or None
      (:func:`mff.nn.rope.apply_rope`, likewise);
    - ``moe_permute(x [N, D], idx [N, K]) -> (x [N*K, D], sorted_indices [N*K])`` and
      ``moe_unpermute(y [N*K, D], sorted_indices, w [N, K]) -> [N, D]``, or None: the token slots
      sorted by expert and combined back (None: :mod:`mff.nn.moe`'s own index path).
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm_torch
    grouped_mm: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor] = grouped_mm_loop
    swiglu: Callable[[torch.Tensor], torch.Tensor] = swiglu_torch
    attention: Callable | None = None
    rope: Callable | None = None
    moe_permute: Callable | None = None
    moe_unpermute: Callable | None = None
    names: dict[str, str] | None = None


_TORCH_NAMES = {"rms_norm": "torch", "swiglu": "torch", "attention": "torch", "rope": "torch", "moe_permute": "torch"}
ops = OpTable(names=dict(_TORCH_NAMES, grouped_mm="loop"))

_NPU_NAMES = {"rms_norm": "npu_rms_norm", "grouped_mm": "npu_grouped_matmul", "swiglu": "npu_swiglu",
              "attention": "npu_fusion_attention", "rope": "npu_rotary_mul", "moe_permute": "npu_moe_token_permute"}


def select_ops(device_type: str, *, torch_npu_module: ModuleType | None = None, grouped_mm: str = "auto",
               env: dict[str, str] | None = None) -> OpTable:
    """Fill :data:`ops` for ``device_type`` and return it.

    npu with torch_npu importable (or ``torch_npu_module``, a stand-in for tests): the guarded
    kernels of :mod:`mff.backend.npu` (``npu_rms_norm``, ``npu_grouped_matmul``,
    ``npu_swiglu``, ``npu_fusion_attention``, ``npu_rotary_mul``, ``npu_moe_token_permute`` /
    ``unpermute``) for the ops ``MFF_NPU_FUSED`` (read from ``env``, default ``os.environ``)
    keeps fused, the torch twin for the others (``MFF_NPU_FUSED`` is checked on every device,
    used on the NPU only). Elsewhere the pure torch RMSNorm and SwiGLU,
    and ``torch._grouped_mm`` when a probe forward+backward runs on this device
    (``grouped_mm="auto"``), the per-expert loop otherwise; ``grouped_mm`` may force
    ``"fused"`` or ``"loop"``.

    Raises:
        ValueError: an unknown ``grouped_mm`` or ``MFF_NPU_FUSED`` value.
    """
    if grouped_mm not in ("auto", "fused", "loop"):
        raise ValueError(f"grouped_mm={grouped_mm!r}; expected auto, fused or loop")
    wanted = npu_ops.fused_ops_wanted(env)  # checked on every device: a bad value is an error, not ignored
    npu = torch_npu_module if torch_npu_module is not None else (_import_torch_npu() if device_type == "npu" else None)
    ops.rms_norm, ops.swiglu = rms_norm_torch, swiglu_torch
    ops.attention = ops.rope = ops.moe_permute = ops.moe_unpermute = None
    ops.names = dict(_TORCH_NAMES)
    if device_type == "npu" and npu is not None:
        kernels = npu_ops.npu_kernels(npu, rms_norm_torch, grouped_mm_loop)
        ops.grouped_mm, ops.names["grouped_mm"] = grouped_mm_loop, "loop"
        for name in npu_ops.NPU_OPS:
            if name in wanted:
                setattr(ops, name, kernels[name])
                ops.names[name] = _NPU_NAMES[name]
        if "moe_permute" in wanted:
            ops.moe_unpermute = kernels["moe_unpermute"]
        return ops
    use_fused = grouped_mm == "fused" or (grouped_mm == "auto" and _grouped_mm_runs(device_type if device_type != "npu" else "cpu"))
    ops.grouped_mm = grouped_mm_fused if use_fused else grouped_mm_loop
    ops.names["grouped_mm"] = "torch._grouped_mm" if use_fused else "loop"
    return ops


def available_memory_gib(device: torch.device) -> float | None:
    """Free memory of ``device`` in GiB: ``MemAvailable`` of /proc/meminfo on CPU (Linux),
    ``mem_get_info`` on CUDA/NPU; None when it cannot be read."""
    try:
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024 / 1024**3
            return None
        mod = torch.cuda if device.type == "cuda" else getattr(torch, device.type)
        return mod.mem_get_info(device)[0] / 1024**3
    except Exception:
        return None
