"""Reading GGUF checkpoints (llama.cpp's single-file format) as HF-named float tensors.

`read_gguf(path)` returns a `GGUFCheckpoint`: an HF ``config.json``-style dict, the weights under
Hugging Face parameter names in HF's ``[out, in]`` layout (dequantised to float), a
`tokenizers.Tokenizer` rebuilt from the file's tokenizer metadata, and the chat template.

Format facts used here, with their sources:

- File layout (ggml ``docs/gguf.md``): the file starts with the magic ``b"GGUF"``, a version, the
  tensor count and the metadata key/value pairs, then a table of tensor infos, then the aligned
  tensor data. A tensor's dims are listed innermost first (``ne[0]`` is the length of a
  contiguous row), so an HF ``[out, in]`` matrix is stored with dims ``[in, out]``; quantised
  types pack each row in blocks (Q8_0: 32 values, one fp16 scale and 32 int8).
  Parsing and dequantisation are done by the ``gguf`` package (``gguf.GGUFReader``,
  ``gguf.quants.dequantize``), which is maintained in llama.cpp's ``gguf-py``.
- Tensor names (llama.cpp ``gguf-py/gguf/tensor_mapping.py`` and ``constants.py``):
  ``token_embd``, ``output_norm``, ``output`` and per block ``blk.N.attn_norm``,
  ``attn_q/k/v``, ``attn_output``, ``attn_q_norm/attn_k_norm`` (Qwen3), ``ffn_norm``,
  ``ffn_gate/up/down``. A file without ``output.weight`` ties the LM head to the embedding.
- Q/K row permutation (llama.cpp ``convert_hf_to_gguf.py``, ``LlamaModel.permute``): for the
  ``llama`` architecture the converter reorders the rows of ``q_proj`` (with ``n_head`` heads)
  and ``k_proj`` (with ``n_head_kv`` heads) so that within each head of ``d`` rows, row
  ``2i + j`` of the file is row ``j * d/2 + i`` of the HF weight (``j`` in {0, 1}): HF's
  rotate-half rotary pairs ``(i, i + d/2)`` become llama.cpp's adjacent pairs ``(2i, 2i+1)``.
  `read_gguf` undoes it. Qwen2/Qwen3 files are not permuted (llama.cpp runs them in NeoX
  rotary mode).
- Tokenizer (llama.cpp ``src/llama-vocab.cpp``): ``tokenizer.ggml.model == "gpt2"`` is a
  byte-level BPE whose ``tokens`` are spelled in GPT-2's byte alphabet and whose ``merges`` are
  ``"left right"`` strings; ``token_type`` 3 marks control (special) tokens and 4 user-defined
  added tokens; ``tokenizer.ggml.pre`` names the pre-tokenizer, a list of regexes applied one
  after another, each splitting every piece into its matches and the text between them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = ["GGUF_MAGIC", "SUPPORTED_ARCHITECTURES", "GGUFCheckpoint", "is_gguf", "read_gguf"]

GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""``general.architecture`` values `read_gguf` maps to HF names."""


@dataclass
class GGUFCheckpoint:
    """What `read_gguf` gets out of one GGUF file.

    Attributes:
        config: an HF ``config.json``-style dict (``model_type``, ``architectures``,
            ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
            ``rope_theta``, ``rope_parameters`` (HF v5 form of the same), ``max_position_embeddings``,
            ``tie_word_embeddings``, ``attention_bias``, ``hidden_act``, ``bos_token_id``,
            ``eos_token_id``, ``pad_token_id`` (None where the file gives none)).
        tensors: HF parameter name -> tensor in HF's layout (``[out, in]`` for linear weights),
            in the dtype passed to `read_gguf`. ``lm_head.weight`` is present only when the
            head is untied.
        tokenizer: the tokenizer the file describes, or None when it carries none (or
            ``with_tokenizer=False`` was passed).
        chat_template: the ``tokenizer.chat_template`` Jinja template, or None.
        bos_token, eos_token: the text of the BOS / EOS tokens, or None.
        metadata: every metadata key of the file except the large tokenizer arrays
            (``tokenizer.ggml.tokens``, ``merges``, ``token_type``, ``scores``), decoded to Python values.
        tensor_types: HF parameter name -> the GGML type name it was stored in (``"Q4_1"``, ``"F32"``...).
    """

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)


def is_gguf(path: str | os.PathLike) -> bool:
    """True when `path` is a file that starts with the GGUF magic ``b"GGUF"`` (ggml docs/gguf.md).

    Never raises: a missing or unreadable path, or a folder, gives False.
    """
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _check_layout(reader, file_size: int, path) -> None:
    """The tensors' byte ranges do not overlap and the file ends where the last one does (after
    its alignment padding, as GGUF writers pad every tensor): bytes inserted into or appended to
    the data would otherwise shift or hide tensors silently.

    Raises:
        ValueError: naming the overlapping tensors, or the file size and where the layout ends.
    """
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    for (_, end, name), (start, _, nxt) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{path}: corrupt GGUF file: tensor {nxt!r} starts at byte {start}, inside tensor {name!r} (ends at {end})")
    if spans:
        align = int(getattr(reader, "alignment", 32) or 32)
        last = spans[-1][1]
        padded = -(-last // align) * align
        if not last <= file_size <= padded:
            raise ValueError(f"{path}: corrupt GGUF file: it has {file_size} bytes but its tensor layout ends at byte {last} "
                             f"(at most {padded} with padding); bytes were inserted or appended")


def read_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, with_tokenizer: bool = True) -> GGUFCheckpoint:
    """Read a GGUF checkpoint into HF-named, dequantised tensors, an HF config and a tokenizer.

    Every tensor type the ``gguf`` package can dequantise is accepted (F32, F16, BF16, Q4_0 ...
    Q8_0, the K-quants, the IQ types); values are dequantised to float32 by ``gguf.quants.dequantize``,
    reshaped with GGUF's innermost-first dims reversed (so a linear weight is ``[out, in]``), the
    llama Q/K permutation is undone, and the result is cast to `dtype`.

    Args:
        path: the ``.gguf`` file.
        dtype: floating dtype of the returned tensors.
        with_tokenizer: False skips building the tokenizer (``tokenizer`` is then None).

    Returns:
        A `GGUFCheckpoint`.

    Raises:
        OSError: the file cannot be opened.
        ValueError: (the message starts with the path) the file does not start with ``b"GGUF"``;
            it cannot be parsed or ends before its tensor data does (truncated or corrupt); its
            architecture is not one of `SUPPORTED_ARCHITECTURES`; a tensor name has no HF
            mapping for that architecture (all such names are listed); a tensor the
            architecture needs is missing; a shape disagrees with the metadata; a tensor type
            cannot be dequantised; the tokenizer kind or pre-tokenizer is not supported;
            `dtype` is not a floating dtype.
    """
    path = os.fspath(path)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"read_gguf: dtype must be a floating torch dtype, got {dtype!r}")
    reader = _open_reader(path)
    meta = _Metadata(reader, path)

    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; read_gguf maps {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(dense Llama-style decoders) to HF names"
        )

    file_size = os.path.getsize(path)
    by_name = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size:
            raise ValueError(f"{path}: truncated GGUF file: tensor {t.name!r} ends at byte {end}, the file has {file_size} bytes")
        by_name[t.name] = t
    _check_layout(reader, file_size, path)

    config = _config(meta, arch, by_name, path)
    hf_names = _map_names(arch, config, list(by_name), path)

    tensors: dict[str, torch.Tensor] = {}
    tensor_types: dict[str, str] = {}
    for gguf_name, hf_name in hf_names.items():
        t = by_name[gguf_name]
        value = _dequantize(t, path)
        if arch == "llama" and hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            value = _unpermute_rows(value, config["num_attention_heads"], gguf_name, path)
        elif arch == "llama" and hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            value = _unpermute_rows(value, config["num_key_value_heads"], gguf_name, path)
        tensors[hf_name] = value.to(dtype)
        tensor_types[hf_name] = t.tensor_type.name
    _check_shapes(config, tensors, path)

    tokenizer = bos_token = eos_token = None
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        bos_token = _token_text(tokens, meta.get("tokenizer.ggml.bos_token_id"))
        eos_token = _token_text(tokens, meta.get("tokenizer.ggml.eos_token_id"))
        if with_tokenizer:
            tokenizer = _build_tokenizer(meta, tokens, path)

    return GGUFCheckpoint(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos_token,
        eos_token=eos_token,
        metadata=meta.small_values(),
        tensor_types=tensor_types,
    )


# ---------------------------------------------------------------------------------------------
# File and metadata


def _open_reader(path: str):
    import gguf

    with open(path, "rb") as fh:  # OSError (missing file, folder, permissions) propagates as is
        head = fh.read(4)
    if head != GGUF_MAGIC:
        size = os.path.getsize(path)
        if size < 4:
            raise ValueError(f"{path}: not a GGUF file: it has {size} bytes, fewer than the 4-byte magic {GGUF_MAGIC!r}")
        raise ValueError(f"{path}: not a GGUF file: it starts with {head!r}, not the magic {GGUF_MAGIC!r}")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        size = os.path.getsize(path)
        raise ValueError(
            f"{path}: cannot parse this GGUF file ({size} bytes): it is truncated or corrupt ({type(e).__name__}: {e})"
        ) from e


# Tokenizer arrays are big (tens of thousands of strings) and only decoded on demand.
_LARGE_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


class _Metadata:
    """Lazy, cached decoding of a GGUFReader's key/value fields into Python values."""

    def __init__(self, reader, path: str):
        self._fields = reader.fields
        self._path = path
        self._cache: dict[str, Any] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            return default
        if key not in self._cache:
            try:
                self._cache[key] = _field_value(self._fields[key])
            except (ValueError, IndexError) as e:
                raise ValueError(f"{self._path}: cannot decode GGUF metadata {key!r}: {e}") from e
        return self._cache[key]

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self._path}: GGUF metadata {key!r} is missing")
        return value

    def small_values(self) -> dict[str, Any]:
        return {k: self.get(k) for k in self._fields if k not in _LARGE_KEYS and not k.startswith("GGUF.")}


def _field_value(f) -> Any:
    """Decode one ReaderField (uses ``parts``/``data``/``types``, present in every gguf-py release)."""
    from gguf import GGUFValueType

    if not f.types:
        return None
    kind = f.types[0]
    if kind == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if kind == GGUFValueType.ARRAY:
        sub = f.types[1] if len(f.types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        if sub is None or sub == GGUFValueType.ARRAY:
            return None  # empty or nested arrays: nothing here uses them
        if len(f.data) == 0:
            return []
        return _scalar_list(np.concatenate([f.parts[i] for i in f.data]), sub)
    return _scalar_list(f.parts[f.data[0]], kind)[0]


def _scalar_list(values: np.ndarray, kind) -> list:
    from gguf import GGUFValueType

    if kind == GGUFValueType.BOOL:
        return [bool(v) for v in values]
    if kind == GGUFValueType.FLOAT32:
        # Shortest decimal that rounds to the same float32 (1e-05 rather than 9.999999747378752e-06),
        # the value the HF config had before conversion.
        return [float(str(v)) for v in values.astype(np.float32)]
    return values.tolist()


def _token_text(tokens: list[str], token_id: Any) -> str | None:
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


# ---------------------------------------------------------------------------------------------
# Config


def _config(meta: _Metadata, arch: str, by_name: dict, path: str) -> dict:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = int(meta.require(key("embedding_length")))
    n_head = _uniform(meta.require(key("attention.head_count")), key("attention.head_count"), path)
    n_kv = _uniform(meta.get(key("attention.head_count_kv"), n_head), key("attention.head_count_kv"), path)
    head_dim = int(meta.get(key("attention.key_length"), hidden // n_head if n_head else 0))
    value_dim = int(meta.get(key("attention.value_length"), head_dim))
    if n_head <= 0 or n_kv <= 0 or n_head % n_kv:
        raise ValueError(f"{path}: head counts {n_head} (query) and {n_kv} (key/value) must be positive, the first a multiple of the second")
    if value_dim != head_dim:
        raise ValueError(f"{path}: attention.key_length {head_dim} != attention.value_length {value_dim}; HF {arch} needs them equal")
    rope_dim = meta.get(key("rope.dimension_count"))
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{path}: rope.dimension_count {rope_dim} != head dim {head_dim}; partial rotary is not supported for {arch}")

    embd = by_name.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(embd.shape[-1])  # innermost-first dims: [hidden, vocab]
    meta_vocab = meta.get(key("vocab_size"))
    if meta_vocab is not None and int(meta_vocab) != vocab:
        raise ValueError(f"{path}: {key('vocab_size')} is {meta_vocab} but token_embd.weight has {vocab} rows")

    theta = float(meta.get(key("rope.freq_base"), 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get(key("rope.scaling.type"), "none")
    factor = meta.get(key("rope.scaling.factor"))
    if scaling in ("linear", "yarn") and factor is not None and float(factor) != 1.0:
        rope.update(rope_type=scaling, factor=float(factor))
        orig = meta.get(key("rope.scaling.original_context_length"))
        if orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
    elif scaling not in ("none", "linear", "yarn"):
        raise ValueError(f"{path}: rope scaling type {scaling!r} is not supported (none, linear, yarn)")

    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(key("feed_forward_length"))),
        "num_hidden_layers": int(meta.require(key("block_count"))),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.require(key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": int(meta.get(key("context_length"), 2048)),
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": arch == "qwen2",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        config["mlp_bias"] = False
    return config


def _uniform(value: Any, name: str, path: str) -> int:
    """A head count: an int, or a per-layer list whose entries must all be equal."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ValueError(f"{path}: {name} varies per layer ({value}); only uniform head counts are supported")
        value = value[0]
    return int(value)


# ---------------------------------------------------------------------------------------------
# Tensor names and values

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_ARCH_BLOCK_NAMES = {
    "llama": _BLOCK_NAMES,
    "qwen2": {
        **_BLOCK_NAMES,
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "qwen3": {
        **_BLOCK_NAMES,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
}


def _map_names(arch: str, config: dict, names: list[str], path: str) -> dict[str, str]:
    """GGUF tensor name -> HF name; every name must map and every needed tensor be present."""
    block_names = _ARCH_BLOCK_NAMES[arch]
    n_layers = config["num_hidden_layers"]
    out: dict[str, str] = {}
    unknown = []
    for name in names:
        if name in _GLOBAL_NAMES:
            out[name] = _GLOBAL_NAMES[name]
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layers and parts[2] in block_names:
            out[name] = f"model.layers.{int(parts[1])}.{block_names[parts[2]]}"
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"{path}: {len(unknown)} GGUF tensor(s) have no HF name for architecture {arch!r} with {n_layers} layers: "
            f"{', '.join(sorted(unknown))}"
        )
    needed = ["token_embd.weight", "output_norm.weight"]
    needed += [f"blk.{i}.{suffix}" for i in range(n_layers) for suffix in block_names]
    missing = [n for n in needed if n not in out]
    if missing:
        shown = ", ".join(missing[:20]) + (f", ... ({len(missing)} in all)" if len(missing) > 20 else "")
        raise ValueError(f"{path}: GGUF file lacks tensor(s) that architecture {arch!r} needs: {shown}")
    return out


def _dequantize(t, path: str) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor with HF's (outermost-first) dims."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    qtype = GGMLQuantizationType(t.tensor_type)
    try:
        if qtype == GGMLQuantizationType.F64:
            arr = np.asarray(t.data).view(np.float64)
        else:
            arr = dequantize(t.data, qtype)
        arr = np.asarray(arr).reshape(shape)
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name!r} is stored as {qtype.name}, which the gguf package cannot dequantise ({e})") from e
    except ValueError as e:
        raise ValueError(f"{path}: tensor {t.name!r} ({qtype.name}, dims {shape}) cannot be read; the file is corrupt: {e}") from e
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{path}: tensor {t.name!r} is stored as the integer type {qtype.name}; weights must be floating point")
    return torch.from_numpy(np.array(arr, dtype=np.float32))  # copy: the reader's arrays view a read-only memory map


def _unpermute_rows(w: torch.Tensor, n_heads: int, name: str, path: str) -> torch.Tensor:
    """Undo convert_hf_to_gguf's llama Q/K permutation: per head of d rows, file row 2i+j -> HF row j*d/2+i."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{path}: tensor {name!r} has {rows} rows, not a multiple of 2 x {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _check_shapes(config: dict, tensors: dict[str, torch.Tensor], path: str) -> None:
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    expect = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "lm_head.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    for name, t in tensors.items():
        want = expect.get(name)
        if want is None:
            want = per_layer[name.split(".", 3)[3]]
        if tuple(t.shape) != want:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(t.shape)}, the metadata implies {want}")


# ---------------------------------------------------------------------------------------------
# Tokenizer

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# tokenizer.ggml.pre -> (regexes applied in order, BPE ignore_merges), after llama.cpp's llama-vocab.cpp.
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    # llama.cpp's fallback for files written before tokenizer.ggml.pre existed
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"), False),
    **{name: ((_GPT2_SPLIT,), False) for name in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais")},
    # StarCoder-style vocabularies (SmolLM among them): every digit on its own, then GPT-2's split
    **{name: ((r"\p{N}", _GPT2_SPLIT), False) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{name: ((_LLAMA3_SPLIT,), True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}

_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _build_tokenizer(meta: _Metadata, tokens: list[str], path: str) -> Tokenizer | None:
    kind = meta.get("tokenizer.ggml.model")
    if kind in (None, "none", "no_vocab"):
        return None
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer kind {kind!r} (tokenizer.ggml.model) is not supported; read_gguf builds byte-level BPE "
            "('gpt2') tokenizers. Pass with_tokenizer=False to read the weights only."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; known: {', '.join(sorted(_PRE_TOKENIZERS))}. "
            "Pass with_tokenizer=False to read the weights only."
        )
    splits, ignore_merges = _PRE_TOKENIZERS[pre]

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a repeated spelling keeps its first id, as a lookup by text would
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        pair = m.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{path}: BPE merge {m!r} is not two tokens separated by one space")
        merges.append((pair[0], pair[1]))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers raises its own Exception type for a merge naming an unknown token
        raise ValueError(f"{path}: the GGUF BPE vocabulary and merges are inconsistent: {e}") from e

    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _TOKEN_CONTROL]
    added = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if added:
        tok.add_tokens(added)

    # BOS/EOS are added only where the file says so (llama.cpp's add_bos_token / add_eos_token).
    bos = _token_text(tokens, meta.get("tokenizer.ggml.bos_token_id"))
    eos = _token_text(tokens, meta.get("tokenizer.ggml.eos_token_id"))
    pre_ids = [bos] if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None else []
    post_ids = [eos] if meta.get("tokenizer.ggml.add_eos_token", False) and eos is not None else []
    if pre_ids or post_ids:
        single = pre_ids + ["$A"] + post_ids
        pair = single + pre_ids + ["$B:1"] + post_ids
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=[(t, vocab[t]) for t in dict.fromkeys(pre_ids + post_ids)]
        )
    return tok
