"""A stand-in for ``torch_npu`` on CPU: each kernel checks the argument contract torch_npu
documents and raises (RuntimeError, as the real kernel) on a violation, computes its result with
reference math written here (not mff's twins), and records the call.

Passed to ``mff.backend.select_ops("npu", torch_npu_module=make_standin())``: nothing is patched
globally.
"""

from __future__ import annotations

import types

import torch

FLOAT = (torch.float16, torch.bfloat16, torch.float32)


class KernelContractError(RuntimeError):
    """What the real kernel would reject."""


def _require(ok: bool, what: str):
    if not ok:
        raise KernelContractError(what)


def make_standin(version: str = "2.6.0") -> types.ModuleType:
    """A fresh stand-in module; ``module.calls`` lists ``(kernel name, argument summary)``."""
    m = types.ModuleType("torch_npu")
    m.__version__ = version
    m.calls = []

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        _require(x.dtype in FLOAT and gamma.dtype == x.dtype, f"npu_rms_norm: dtypes {x.dtype}, {gamma.dtype}")
        _require(x.numel() > 0, "npu_rms_norm: empty input")
        _require(tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]), f"npu_rms_norm: gamma {tuple(gamma.shape)}")
        m.calls.append(("npu_rms_norm", tuple(x.shape)))
        x32 = x.float()
        rstd = 1.0 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) / x.shape[-1] + epsilon)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    def npu_grouped_matmul(x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **kwargs):
        _require(isinstance(x, list) and isinstance(weight, list) and len(x) == 1 and len(weight) == 1,
                 "npu_grouped_matmul: x and weight must be lists of one tensor for one grouped matmul")
        a, w = x[0], weight[0]
        _require(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1], f"npu_grouped_matmul: shapes {a.shape}, {w.shape}")
        _require(a.dtype in FLOAT and w.dtype == a.dtype, f"npu_grouped_matmul: dtypes {a.dtype}, {w.dtype}")
        _require(a.shape[0] > 0, "npu_grouped_matmul: empty x")
        _require(split_item in (2, 3) and group_type == 0, f"npu_grouped_matmul: split_item {split_item}, group_type {group_type}")
        _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1
                 and group_list.numel() == w.shape[0], f"npu_grouped_matmul: group_list {group_list!r}")
        g = group_list.tolist()
        if group_list_type == 1:  # counts
            _require(all(c >= 0 for c in g) and sum(g) == a.shape[0], f"npu_grouped_matmul: counts {g} for {a.shape[0]} rows")
            ends = [sum(g[: i + 1]) for i in range(len(g))]
        else:  # cumulative ends, non-decreasing, the last one the row count
            _require(all(x <= y for x, y in zip(g, g[1:])) and g[-1] == a.shape[0], f"npu_grouped_matmul: ends {g}")
            ends = g
        m.calls.append(("npu_grouped_matmul", (tuple(a.shape), tuple(w.shape), tuple(g))))
        rows, start = [], 0
        for e, end in enumerate(ends):
            for r in range(start, end):
                rows.append((a[r][:, None] * w[e]).sum(0))
            start = end
        return [torch.stack(rows)]

    def npu_swiglu(x, dim=-1):
        _require(x.dtype in FLOAT and 1 <= x.dim() <= 8 and x.numel() > 0, f"npu_swiglu: {x.dtype} {tuple(x.shape)}")
        _require(x.is_contiguous(), "npu_swiglu: non-contiguous input")
        _require(x.shape[dim] % 2 == 0, f"npu_swiglu: dim {dim} of size {x.shape[dim]} is odd")
        m.calls.append(("npu_swiglu", tuple(x.shape)))
        n = x.shape[dim] // 2
        a, b = x.narrow(dim, 0, n), x.narrow(dim, n, n)
        return a * torch.sigmoid(a) * b

    m.npu_rms_norm, m.npu_grouped_matmul, m.npu_swiglu = npu_rms_norm, npu_grouped_matmul, npu_swiglu
    return m
