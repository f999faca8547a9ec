"""Multi-Token Prediction: target shifting at document boundaries (closed form) and the MTP
loss against HF transformers' MtpLayer wrapped around a DeepseekV3DecoderLayer."""

from __future__ import annotations

import pytest
import torch

import mff
from mff.models.deepseek3 import DeepseekV3Config
from mff.nn.mtp import mtp_labels
from mff.nn.rope import RopeParameters


def test_mtp_labels_never_cross_documents():
    # tokens x0..x5, labels[t] = x_{t+1}; positions 0-2 are document 0, 3-4 document 1: labels[2] = x3
    # is document 1's first token, so no depth at positions 0-2 may target it or anything after it
    labels = torch.tensor([[1, 2, 3, 4, 5]])
    docs = torch.tensor([[0, 0, 0, 1, 1]])
    assert mtp_labels(labels, docs, 1).tolist() == [[2, -100, -100, 5, -100]]
    assert mtp_labels(labels, docs, 2).tolist() == [[-100, -100, -100, -100, -100]]
    assert mtp_labels(labels, None, 2).tolist() == [[3, 4, 5, -100, -100]]
    assert mtp_labels(labels, None, 9).tolist() == [[-100] * 5]
    with pytest.raises(ValueError):
        mtp_labels(labels, None, 0)


def test_count_targets_matches_mtp_labels():
    model = mff.build("deepseek3", size="tiny")
    labels = torch.tensor([[1, 2, -100, 4, 5, 6]])
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    c = model.count_targets({"input_ids": labels.clamp(min=0), "labels": labels, "document_ids": docs})
    assert int(c["lm"]) == 5 and int(c["mtp.1"]) == 1 and int(c["balance"]) == 1


def _brute_force_mtp_targets(tokens, docs, depth):
    """Position t of a row of T inputs (tokens holds T + 1) targets tokens[t + depth + 1] iff that
    token lies in t's document (the token past the row counts as the last position's)."""
    T = len(docs)
    doc_of = list(docs) + [docs[-1]]
    return [tokens[t + depth + 1] if t + depth < T and doc_of[t + depth + 1] == docs[t] else -100 for t in range(T)]


def test_mtp_targets_of_megatron_samples_stay_in_their_document():
    """Megatron samples with reset_attention_mask on and eod_mask_loss off: the EOD's main label
    is the next document's first token; no MTP target of the earlier document may be."""
    from mff.data.gpt_dataset import GPTDatasetConfig, sample_fields

    EOD = 0
    tokens = torch.tensor([5, 6, 7, EOD, 8, 9, EOD, 10, 11, 12, 13, EOD, 14])
    cfg = GPTDatasetConfig(seq_len=12, eod_id=EOD, reset_attention_mask=True, eod_mask_loss=False)
    fields = sample_fields(tokens.numpy(), cfg)
    labels, docs = torch.from_numpy(fields["labels"])[None], torch.from_numpy(fields["document_ids"])[None]
    assert labels[0, 3].item() == 8 and docs[0, 3] != docs[0, 4]  # the case: EOD's label is the next document's token
    for depth in (1, 2, 3):
        got = mtp_labels(labels, docs, depth)[0].tolist()
        assert got == _brute_force_mtp_targets(tokens.tolist(), docs[0].tolist(), depth)
        assert 8 not in got[:4] and 10 not in got[:7]


ARCH = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.5,
            kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=2, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64)


def test_mtp_loss_matches_hf_mtp_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hfm

    from tests.hf_util import hf_state, init_o1

    hf_cfg = transformers.DeepseekV3Config(**ARCH, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                           num_mtp_layers=1, attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    mtp = MtpLayer(hf_cfg, hfm.DeepseekV3DecoderLayer, hfm.DeepseekV3RMSNorm, layer_idx=2).eval()
    init_o1(hf, seed=4, bias_scale=0.2)
    init_o1(mtp, seed=5, bias_scale=0.2)

    cfg = DeepseekV3Config(**ARCH, rope_parameters=RopeParameters(), num_nextn_predict_layers=1,
                           aux_loss_alpha=0.0, mtp_loss_scaling_factor=1.0)
    model = mff.build("deepseek3", cfg)
    params = hf_state(hf)
    for k, v in hf_state(mtp).items():
        name = k.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        params[f"model.layers.2.{name}"] = v
    assert set(params) == set(model.param_shapes())

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ARCH["vocab_size"], (2, 12), generator=g)
    docs = torch.zeros(2, 12, dtype=torch.long)  # one document per row: HF's main model has no document mask
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with torch.no_grad():
        out = model.forward(params, {"input_ids": ids, "labels": labels, "document_ids": docs})
        # HF reference: main model's last pre-norm hidden state, then the MTP layer on Emb(x_{t+1})
        seen = []
        hook = hf.model.layers[-1].register_forward_hook(lambda mod, args, out: seen.append(out))
        hf.model(input_ids=ids)
        hook.remove()
        h_last = seen[0]  # the last layer's output, before the final norm
        pos = torch.arange(12)[None].expand(2, 12)
        cos_sin = hf.model.rotary_emb(h_last, pos)
        mask = torch.zeros(2, 1, 12, 12).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
        emb_next = hf.model.embed_tokens(torch.roll(ids, -1, 1))
        h1 = mtp(inputs_embeds=emb_next, previous_hidden_state=h_last, position_embeddings=cos_sin,
                 attention_mask=mask, position_ids=pos, cache=None)
        logits = hf.lm_head(h1)
        target = labels.clone()
        target[:, :-1] = labels[:, 1:]
        target[:, -1] = -100
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, ARCH["vocab_size"]), target.reshape(-1), ignore_index=-100)
    assert out.losses["mtp"].item() == pytest.approx(ref.item(), abs=1e-5)
    assert set(out.expert_load) == {"model.layers.1.mlp", "model.layers.2.mlp"}  # the MTP layer's MoE is counted


def test_packed_documents_equal_separate_runs():
    """With document_ids, each document of a packed row gives the logits it gives alone."""
    model = mff.build("deepseek3", DeepseekV3Config(**ARCH, rope_parameters=RopeParameters(), num_nextn_predict_layers=1))
    params = model.init(seed=1)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 61, (1, 5), generator=g), torch.randint(0, 61, (1, 7), generator=g)
    packed = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        both = model.forward(params, {"input_ids": packed, "document_ids": docs}).logits
        la = model.forward(params, {"input_ids": a}).logits
        lb = model.forward(params, {"input_ids": b}).logits  # positions restart at 0; RoPE is relative
    torch.testing.assert_close(both[:, :5], la, atol=1e-5, rtol=0)
    torch.testing.assert_close(both[:, 5:], lb, atol=1e-4, rtol=0)
