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


def _masked_softmax_attention(q_NTD, k_NSD, v_NSD, visible_TS, scale):
    """Per-head attention in fp32 from first principles: scores, -inf where not visible, softmax, weighted sum."""
    scores = (q_NTD.float() @ k_NSD.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible_TS, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v_NSD.float()).to(q_NTD.dtype)


def make_standin(version: str = "2.6.0", rotary_mode: bool = True) -> types.ModuleType:
    """A fresh stand-in module; ``module.calls`` lists ``(kernel name, argument summary)``.

    ``rotary_mode=False`` models a torch_npu whose ``npu_rotary_mul(x, r1, r2)`` has no mode
    argument (half only, D = 128, cos/sin of batch 1)."""
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

    def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                             scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                             prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                             sync=False):
        _require(input_layout in ("BSND", "TND"), f"npu_fusion_attention: layout {input_layout!r} is not one mff uses")
        _require(query.dtype in FLOAT and key.dtype == query.dtype and value.dtype == query.dtype,
                 f"npu_fusion_attention: dtypes {query.dtype}, {key.dtype}, {value.dtype}")
        dims = 4 if input_layout == "BSND" else 3
        _require(query.dim() == dims and key.dim() == dims and value.dim() == dims, f"npu_fusion_attention: {input_layout} dims")
        _require(tuple(value.shape) == tuple(key.shape), f"npu_fusion_attention: value {tuple(value.shape)} != key {tuple(key.shape)}")
        D = query.shape[-1]
        _require(key.shape[-1] == D and D % 16 == 0 and D <= 512, f"npu_fusion_attention: head dim {D}")
        N1, N2 = query.shape[-2], key.shape[-2]
        _require(head_num == N1 and N1 <= 256 and N1 % N2 == 0, f"npu_fusion_attention: head_num {head_num}, heads {N1}/{N2}")
        _require(pse is None and padding_mask is None and keep_prob == 1.0 and prefix is None, "npu_fusion_attention: unused options set")
        _require(atten_mask is None or atten_mask.dtype == torch.bool, f"npu_fusion_attention: mask dtype {atten_mask.dtype}")
        if sparse_mode == 3:
            _require(atten_mask is not None and tuple(atten_mask.shape) == (2048, 2048)
                     and torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool, device=atten_mask.device).triu(1)),
                     "npu_fusion_attention: sparse_mode 3 takes the compressed 2048x2048 upper-triangle mask")
        else:
            _require(sparse_mode == 0, f"npu_fusion_attention: sparse_mode {sparse_mode}")
        rep = N1 // N2
        if input_layout == "TND":
            _require(sparse_mode == 3, "npu_fusion_attention: TND here is the per-document causal case")
            T = query.shape[0]
            for name, ends in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
                _require(isinstance(ends, list) and all(isinstance(e, int) for e in ends) and ends
                         and all(a < b for a, b in zip([0] + ends, ends)) and ends[-1] == T,
                         f"npu_fusion_attention: {name} {ends!r} must increase and end at T={T}")
            _require(actual_seq_qlen == actual_seq_kvlen and key.shape[0] == T, "npu_fusion_attention: TND self-attention lengths")
            m.calls.append(("npu_fusion_attention", ("TND", tuple(query.shape), tuple(key.shape), tuple(actual_seq_qlen))))
            pieces, start = [], 0
            for end in actual_seq_qlen:
                L = end - start
                causal = torch.ones(L, L, dtype=torch.bool).tril()
                q_ = query[start:end].transpose(0, 1)  # [N1, L, D]
                k_ = key[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)
                v_ = value[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)
                pieces.append(_masked_softmax_attention(q_, k_, v_, causal, scale).transpose(0, 1))
                start = end
            return (torch.cat(pieces, dim=0), None, None, None, 0, 0, 0)
        B, Sq, _, _ = query.shape
        Skv = key.shape[1]
        _require(key.shape[0] == B, "npu_fusion_attention: batch of key")
        if sparse_mode == 3:  # causal, aligned bottom-right
            i = torch.arange(Sq)[:, None] + (Skv - Sq)
            visible = (torch.arange(Skv)[None, :] <= i)[None, None]
        else:
            _require(atten_mask is not None and atten_mask.dim() in (2, 4), "npu_fusion_attention: sparse_mode 0 needs a mask here")
            shape = tuple(atten_mask.shape)
            _require(shape in ((B, N1, Sq, Skv), (B, 1, Sq, Skv), (1, 1, Sq, Skv), (Sq, Skv)),
                     f"npu_fusion_attention: mask shape {shape} for B={B} N={N1} Sq={Sq} Skv={Skv}")
            visible = ~atten_mask if atten_mask.dim() == 4 else ~atten_mask[None, None]
            _require(bool(visible.any(-1).all()), "npu_fusion_attention: a query row with every key masked has no defined output")
        m.calls.append(("npu_fusion_attention", ("BSND", tuple(query.shape), tuple(key.shape), sparse_mode,
                                                 None if atten_mask is None else tuple(atten_mask.shape))))
        q_ = query.transpose(1, 2)  # [B, N1, Sq, D]
        k_ = key.transpose(1, 2).repeat_interleave(rep, dim=1)
        v_ = value.transpose(1, 2).repeat_interleave(rep, dim=1)
        return (_masked_softmax_attention(q_, k_, v_, visible, scale).transpose(1, 2), None, None, None, 0, 0, 0)

    def _rotary(x, r1, r2, mode):
        _require(x.dim() == 4 and r1.dim() == 4 and tuple(r1.shape) == tuple(r2.shape), f"npu_rotary_mul: shapes {x.shape}, {r1.shape}")
        _require(x.dtype in FLOAT and r1.dtype == x.dtype and r2.dtype == x.dtype, f"npu_rotary_mul: dtypes {x.dtype}, {r1.dtype}")
        B, S, N, D = x.shape
        _require(tuple(r1.shape) in ((1, S, 1, D), (B, S, 1, D), (B, S, N, D)), f"npu_rotary_mul: r1 {tuple(r1.shape)} for x {tuple(x.shape)}")
        _require(bool(r1.abs().max() <= 1) and bool(r2.abs().max() <= 1), "npu_rotary_mul: r1/r2 outside [-1, 1]")
        _require(x.is_contiguous(), "npu_rotary_mul: non-contiguous input")
        if rotary_mode:
            _require(D % 2 == 0 and D < 896, f"npu_rotary_mul: D {D}")
            _require((B * N < 1000) if mode == "interleave" else (B < 1000 and N < 1000), f"npu_rotary_mul: B {B}, N {N}")
        else:
            _require(D == 128 and r1.shape[0] == 1 and B <= 1000 and N <= 1000, f"npu_rotary_mul (no rotary_mode): D {D}, r1 {tuple(r1.shape)}")
        m.calls.append(("npu_rotary_mul", (tuple(x.shape), mode)))
        if mode == "half":
            x1, x2 = x[..., : D // 2], x[..., D // 2:]
            rotated = torch.cat((-x2, x1), dim=-1)
        else:
            _require(mode == "interleave", f"npu_rotary_mul: rotary_mode {mode!r}")
            rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
        return r1 * x + r2 * rotated

    if rotary_mode:
        def npu_rotary_mul(input, r1, r2, rotary_mode="half"):  # noqa: A002 (the documented name)
            return _rotary(input, r1, r2, rotary_mode)
    else:
        def npu_rotary_mul(x, r1, r2):
            return _rotary(x, r1, r2, "half")

    def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
        _require(tokens.dim() == 2 and tokens.dtype in FLOAT and tokens.shape[0] > 0, f"npu_moe_token_permute: tokens {tokens.dtype} {tuple(tokens.shape)}")
        _require(indices.dtype in (torch.int32, torch.int64) and indices.dim() in (1, 2) and indices.shape[0] == tokens.shape[0],
                 f"npu_moe_token_permute: indices {indices.dtype} {tuple(indices.shape)}")
        K = indices.shape[1] if indices.dim() == 2 else 1
        _require(K <= 512 and not padded_mode and num_out_tokens in (None, 0), "npu_moe_token_permute: options")
        m.calls.append(("npu_moe_token_permute", (tuple(tokens.shape), K)))
        flat = indices.reshape(-1).tolist()
        order = sorted(range(len(flat)), key=lambda i: (flat[i], i))  # stable by expert id
        position = [0] * len(order)
        for row, slot in enumerate(order):
            position[slot] = row
        permuted = torch.stack([tokens[slot // K] for slot in order])
        return permuted, torch.tensor(position, dtype=torch.int32)

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        _require(sorted_indices.dtype == torch.int32 and sorted_indices.dim() == 1
                 and sorted_indices.numel() == permuted_tokens.shape[0] > 0, f"npu_moe_token_unpermute: sorted_indices {sorted_indices.dtype}")
        _require(probs is not None and probs.dtype == permuted_tokens.dtype and probs.numel() == sorted_indices.numel(),
                 f"npu_moe_token_unpermute: probs {None if probs is None else (probs.dtype, tuple(probs.shape))}")
        _require(not padded_mode and restore_shape is None, "npu_moe_token_unpermute: options")
        m.calls.append(("npu_moe_token_unpermute", tuple(permuted_tokens.shape)))
        N, K = probs.shape
        rows = [sum(probs[n, k] * permuted_tokens[int(sorted_indices[n * K + k])] for k in range(K)) for n in range(N)]
        return torch.stack(rows)

    m.npu_rms_norm, m.npu_grouped_matmul, m.npu_swiglu = npu_rms_norm, npu_grouped_matmul, npu_swiglu
    m.npu_fusion_attention, m.npu_rotary_mul = npu_fusion_attention, npu_rotary_mul
    m.npu_moe_token_permute, m.npu_moe_token_unpermute = npu_moe_token_permute, npu_moe_token_unpermute
    return m


class _HostBackedTensor(torch.Tensor):
    """A tensor on the stand-in ``npu`` device whose data is a CPU tensor (``.host``): every op
    on it runs on the CPU copy and its tensor results come back on ``npu`` (a transfer to the
    CPU comes back as a plain CPU tensor)."""

    @staticmethod
    def __new__(cls, host: torch.Tensor, index: int = 0):
        t = torch.Tensor._make_wrapper_subclass(cls, host.size(), strides=host.stride(), storage_offset=host.storage_offset(),
                                                dtype=host.dtype, device=torch.device("npu", index), requires_grad=False)
        t.host = host
        return t

    def __repr__(self):
        return f"npu stand-in tensor({self.host!r})"

    def tolist(self):  # torch refuses .tolist() on subclasses; a device tensor's is its host copy's
        return self.host.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _on_host(func, args, kwargs or {})


def _on_host(func, args, kwargs):
    from torch.utils._pytree import tree_map

    wanted = kwargs.get("device")
    to_cpu = wanted is not None and torch.device(wanted).type == "cpu"

    def down(x):
        if isinstance(x, _HostBackedTensor):
            return x.host
        if isinstance(x, torch.device) and x.type == "npu":
            return torch.device("cpu")
        if isinstance(x, str) and x.startswith("npu"):
            return "cpu"
        return x

    out = func(*tree_map(down, args), **tree_map(down, kwargs))
    if to_cpu:
        return out
    return tree_map(lambda x: _HostBackedTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, _HostBackedTensor) else x, out)


def register_device_standin(name: str = "Ascend910B3", count: int = 1) -> types.ModuleType:
    """Make this process an Ascend node in miniature, the way importing torch_npu does: ``npu``
    becomes torch's PrivateUse1 device, with a stand-in ``torch.npu`` module (device count and
    name, ``set_device``, memory info) and tensors on it whose data lives on the CPU (every op
    runs there); a ``torch_npu`` stand-in with the kernels of :func:`make_standin` is importable;
    and an ``hccl`` process-group backend exists (gloo underneath). ``module.events`` records
    ``set_device`` and the HCCL group's creation in order. It changes torch's global state for
    good: for a subprocess."""
    import sys

    import torch.distributed as dist
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    m = make_standin()
    m.events = []
    dev = types.ModuleType("torch_npu.npu")
    state = {"current": 0}

    def set_device(index):
        index = index.index if isinstance(index, torch.device) else int(index)
        if not 0 <= index < count:
            raise RuntimeError(f"set_device: invalid device {index} of {count}")
        state["current"] = index
        m.events.append(("set_device", index))

    dev.set_device = set_device
    dev.device_count = lambda: count
    dev.is_available = lambda: count > 0
    dev.current_device = lambda: state["current"]
    dev.get_device_name = lambda device=None: name
    dev.is_initialized = lambda: True
    dev.synchronize = lambda device=None: None
    dev.mem_get_info = lambda device=None: (32 * 1024**3, 64 * 1024**3)
    dev.max_memory_allocated = lambda device=None: 0
    dev.reset_peak_memory_stats = lambda device=None: None
    dev.manual_seed = lambda seed: None
    dev.manual_seed_all = lambda seed: None
    m.npu = dev
    _setup_privateuseone_for_python_backend(rename="npu", backend_module=dev)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(lambda op, *args, **kwargs: _on_host(op, args, kwargs), dispatch_key="PrivateUse1", with_keyset=False)
    aten = torch.library.Library("aten", "IMPL")

    def copy_(self, src, non_blocking=False):  # torch.tensor(..., device=npu) copies with the Python key off
        self.host.copy_(src.host if isinstance(src, _HostBackedTensor) else src)
        return self

    aten.impl("copy_", copy_, "PrivateUse1")
    m._libraries = (lib, aten)  # kept alive with the module
    sys.modules["torch_npu"] = m

    def hccl(store, rank, size, timeout):
        m.events.append(("hccl process group", rank, size, state["current"]))
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("hccl", hccl, devices=["cpu", "npu"])
    return m
