"""The accelerators the planner knows: peak dense bf16 FLOP/s, HBM size and bandwidth, and the
bandwidth of the links between devices, inside a node and across nodes.

Units: FLOP/s, GiB, bytes/s. Link bandwidths are per device and per direction (a data sheet's
NVLink figure is the sum of both directions: H100 SXM5's 900 GB/s is 450 GB/s each way). The
inter-node figure is not a property of the chip but of the usual server built around it (one
400 Gb/s InfiniBand NDR NIC per GPU in NVIDIA's HGX/DGX designs: 50 GB/s each way).

HBM capacity: a data sheet's "80 GB" of HBM is read as 80 GiB (HBM stacks are sized in binary
units: an H100 80GB reports 81,559 MiB), of which the CUDA context and the communication
library's buffers take a little that the planner does not count.

``source`` says where each row comes from: ``data sheet`` (the vendor's published
specification of that exact product) or ``publicly cited, unverified`` (the Ascend parts:
figures as cited in public material, not checked against a vendor document in this project,
which has had no NPU). :data:`mff.train.metrics.PEAK_FLOPS` (MFU) reads its peaks of these
parts from this table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "DEVICES", "get_device"]

GB = 1e9


@dataclass(frozen=True)
class Device:
    """One accelerator as the planner models it.

    Attributes:
        key: the ``--hardware`` name (``h800``).
        name: the exact product (``H800 SXM5 80GB``).
        peak_flops: dense bf16 FLOP/s (no sparsity).
        hbm_gib: device memory, GiB.
        hbm_bw: device memory bandwidth, bytes/s.
        intra_bw: bytes/s per device each way to devices of the same node (NVLink, HCCS, UB).
        inter_bw: bytes/s per device each way to other nodes (InfiniBand, RoCE).
        per_node: devices that share the intra-node links.
        links: the link names, for the report.
        source: ``data sheet`` or ``publicly cited, unverified``, and what it is.
    """

    key: str
    name: str
    peak_flops: float
    hbm_gib: float
    hbm_bw: float
    intra_bw: float
    inter_bw: float
    per_node: int
    links: str
    source: str


_NVIDIA_IB = "InfiniBand NDR 400 Gb/s per GPU (HGX/DGX server design)"

DEVICES: dict[str, Device] = {d.key: d for d in (
    Device("h100", "H100 SXM5 80GB", 989e12, 80, 3.35e12, 450 * GB, 50 * GB, 8, f"NVLink 4 900 GB/s; {_NVIDIA_IB}",
           "data sheet: NVIDIA H100 SXM5, 989 TFLOP/s dense BF16 (1,979 with sparsity), 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s"),
    Device("h800", "H800 SXM5 80GB", 989e12, 80, 3.35e12, 200 * GB, 50 * GB, 8, f"NVLink 400 GB/s; {_NVIDIA_IB}",
           "data sheet: NVIDIA H800 SXM5, H100 SXM5's compute and memory (989 TFLOP/s dense BF16, 80 GB HBM3, 3.35 TB/s) "
           "with NVLink cut to 400 GB/s"),
    Device("h200", "H200 SXM 141GB", 989e12, 141, 4.8e12, 450 * GB, 50 * GB, 8, f"NVLink 4 900 GB/s; {_NVIDIA_IB}",
           "data sheet: NVIDIA H200 SXM, 989 TFLOP/s dense BF16, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s"),
    Device("b200", "B200 (HGX B200)", 2.25e15, 180, 8e12, 900 * GB, 50 * GB, 8, f"NVLink 5 1.8 TB/s; {_NVIDIA_IB}",
           "data sheet: NVIDIA HGX B200 (8 GPUs), 36 PFLOP/s BF16 with sparsity = 2.25 PFLOP/s dense per GPU, 1,440 GB and "
           "64 TB/s HBM3e = 180 GB and 8 TB/s per GPU, NVLink 1.8 TB/s per GPU"),
    Device("910b", "Atlas 800T A2 (Ascend 910B)", 313e12, 64, 1.6e12, 196 * GB, 25 * GB, 8, "HCCS 392 GB/s; RoCE 200 Gb/s per NPU",
           "publicly cited, unverified: 2.5 PFLOP/s FP16 per 8-NPU server (313 TFLOP/s per NPU), 64 GB HBM2e at about 1.6 TB/s, "
           "HCCS full mesh 392 GB/s per NPU, one 200 GbE RoCE port per NPU"),
    Device("910c", "Atlas 900 A3 SuperPoD (Ascend 910C, per die)", 376e12, 64, 1.6e12, 196 * GB, 25 * GB, 768,
           "UB (unified bus) inside the 384-chip SuperPoD; RoCE 400 Gb/s per chip",
           "publicly cited, unverified: per 910C die as torch_npu sees it (two dies per chip): about 752 TFLOP/s FP16 and 128 GB "
           "HBM at 3.2 TB/s per chip, halved; UB about 392 GB/s each way per chip inside the SuperPoD of 384 chips (768 dies); "
           "400 Gb/s RoCE per chip to other SuperPoDs"),
)}

_ALIASES = {
    "h100-sxm": "h100", "h100-sxm5": "h100", "h800-sxm": "h800", "h800-sxm5": "h800", "h200-sxm": "h200", "hgx-b200": "b200",
    "ascend910b": "910b", "atlas-800t-a2": "910b", "atlas800ta2": "910b", "ascend910c": "910c", "atlas-900-a3": "910c",
    "atlas900a3": "910c",
}


def get_device(name: str) -> Device:
    """The :class:`Device` called ``name`` (case-insensitive; ``h800``, ``H800-SXM5``, ``910b``,
    ``atlas-800t-a2``, ...).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in DEVICES:
        known = ", ".join(f"{d.key} ({d.name})" for d in DEVICES.values())
        raise ValueError(f"--hardware {name!r}: unknown device; known: {known}")
    return DEVICES[key]
