import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import mff.data.pretrain as pretrain
from mff.data import DataConfig, Loader, build_pretrain_data, resolve_cache_dir

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def make_corpus(root: Path, n_docs: int = 40) -> Path:
    corpus = root / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i in range(n_docs):
        text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(30 + i)) + f"\nend {i}.\n"
        folder = corpus / "sub" if i % 3 else corpus
        (folder / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    with open(corpus / "more.jsonl", "w", encoding="utf-8") as fh:
        for i in range(30):
            fh.write(json.dumps({"text": f"json document {i}: " + " ".join(WORDS[: 5 + i % 7])}) + "\n")
    return corpus


def cfg_for(tmp_path: Path, **kw) -> DataConfig:
    if "path" not in kw:
        kw["path"] = (str(make_corpus(tmp_path)),)
    return DataConfig(cache_dir=str(tmp_path / "cache"), vocab_size=300, val_permille=100, **kw)


def entries(cache: Path) -> list[str]:
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_build_end_to_end(tmp_path):
    cfg = cfg_for(tmp_path)
    d = build_pretrain_data(cfg, seq_len=16, quiet=True)
    s = d.stats
    assert s["files"] == 41 and s["skipped_non_utf8"] == 0
    assert s["documents_train"] + s["documents_val"] == 70
    assert s["documents_val"] >= 1 and s["documents_train"] >= 1
    assert s["tokens_train"] == len(d.train.tokens) and s["tokens_val"] == len(d.val.tokens)
    assert s["bytes"] == s["bytes_train"] + s["bytes_val"]
    assert d.eod_id == 0 and d.vocab_size == d.tokenizer.get_vocab_size() == 300
    assert d.train.tokens.dtype == np.uint16
    # one EOD per document, and the stream ends with one
    assert int((np.asarray(d.train.tokens) == 0).sum()) == s["documents_train"]
    assert int((np.asarray(d.val.tokens) == 0).sum()) == s["documents_val"]
    assert d.train.tokens[-1] == 0 and d.val.tokens[-1] == 0
    # the stream decodes back to the documents, in sorted order
    first = (tmp_path / "corpus" / "doc00.txt").read_text()
    ids = np.asarray(d.train.tokens).tolist()
    docs = d.tokenizer.decode(ids, skip_special_tokens=False).split("<|endoftext|>")
    assert first in docs[:2]
    assert len(d.train) == (s["tokens_train"] - 1) // 16
    batch = Loader(d.train, batch_size=4, seed=0).next_batch()
    assert batch["input_ids"].shape == (4, 16)
    meta = json.loads((Path(d.cache_path) / "meta.json").read_text())
    assert meta["stats"] == s


def test_cache_reuse_does_not_rebuild(tmp_path, monkeypatch, capsys):
    cfg = cfg_for(tmp_path)
    first = build_pretrain_data(cfg, seq_len=16)
    assert not first.from_cache
    out = capsys.readouterr().out
    assert "data: training BPE tokenizer (vocab 300)" in out

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(pretrain, "train_bpe", boom)
    monkeypatch.setattr(pretrain, "encode_documents", boom)
    monkeypatch.setattr(pretrain, "read_documents", boom)
    second = build_pretrain_data(cfg, seq_len=16, quiet=True)
    assert capsys.readouterr().out == ""
    assert second.from_cache and second.cache_path == first.cache_path
    np.testing.assert_array_equal(second.train.tokens, first.train.tokens)
    np.testing.assert_array_equal(second.val.tokens, first.val.tokens)
    assert second.stats == first.stats
    assert second.tokenizer.to_str() == first.tokenizer.to_str()
    # another seq_len reuses the same token cache
    assert build_pretrain_data(cfg, seq_len=8, quiet=True).from_cache


def test_changed_input_rebuilds(tmp_path):
    cfg = cfg_for(tmp_path)
    a = build_pretrain_data(cfg, seq_len=16, quiet=True)
    (tmp_path / "corpus" / "doc00.txt").write_text("a changed document with new words\n")
    b = build_pretrain_data(cfg, seq_len=16, quiet=True)
    assert not b.from_cache and b.cache_path != a.cache_path
    assert len(entries(tmp_path / "cache")) == 2


def test_failure_leaves_no_partial_cache(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path)
    real = pretrain.save_npy

    def failing(folder, name, array):
        real(folder, name, array)
        if name == "val.npy":
            raise OSError("disk full (simulated)")

    monkeypatch.setattr(pretrain, "save_npy", failing)
    with pytest.raises(OSError, match="simulated"):
        build_pretrain_data(cfg, seq_len=16, quiet=True)
    assert entries(tmp_path / "cache") == []  # neither the entry nor its temp folder
    monkeypatch.setattr(pretrain, "save_npy", real)
    d = build_pretrain_data(cfg, seq_len=16, quiet=True)
    assert not d.from_cache
    assert sorted(os.listdir(d.cache_path)) == ["meta.json", "tokenizer.json", "train.npy", "val.npy"]


def test_given_tokenizer_with_eos_token(tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    path = tmp_path / "tok.json"
    tok.save(str(path))
    d = build_pretrain_data(cfg_for(tmp_path, tokenizer=str(path)), seq_len=8, quiet=True)
    assert d.eod_id == 1 and d.vocab_size == len(vocab)
    assert int((np.asarray(d.val.tokens) == 1).sum()) == d.stats["documents_val"]
    with pytest.raises(FileNotFoundError, match="nothere.json"):
        build_pretrain_data(cfg_for(tmp_path / "x", tokenizer=str(tmp_path / "nothere.json")), 8, quiet=True)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        build_pretrain_data(cfg_for(tmp_path, path=(str(tmp_path / "missing_dir"),)), 8, quiet=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "e.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        build_pretrain_data(cfg_for(tmp_path, path=(str(empty),)), 8, quiet=True)
    (empty / "e.txt").unlink()
    with pytest.raises(ValueError, match="empty corpus"):
        build_pretrain_data(cfg_for(tmp_path, path=(str(empty),)), 8, quiet=True)
    cfg = cfg_for(tmp_path)
    n_val = build_pretrain_data(cfg, 8, quiet=True).stats["tokens_val"]
    with pytest.raises(ValueError, match=rf"the val split has {n_val} tokens, fewer than one window of seq_len \+ 1 = {n_val + 1}"):
        build_pretrain_data(cfg, n_val, quiet=True)
    with pytest.raises(ValueError, match=r"the train split has \d+ tokens, fewer than one window of seq_len \+ 1 = 100001"):
        build_pretrain_data(cfg, 100_000, quiet=True)
    assert entries(tmp_path / "cache") and all(not e.startswith(".") for e in entries(tmp_path / "cache"))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MFF_CACHE_DIR", str(tmp_path / "envcache"))
    assert resolve_cache_dir(DataConfig()) == str(tmp_path / "envcache")
    assert resolve_cache_dir(DataConfig(cache_dir=str(tmp_path / "mine"))) == str(tmp_path / "mine")
    monkeypatch.delenv("MFF_CACHE_DIR")
    assert resolve_cache_dir(DataConfig()) == os.path.expanduser("~/.cache/mff")


DIST_WORKER = """
import json, sys
import torch.distributed as dist
from mff.data import DataConfig, build_pretrain_data
rank, init, corpus, cache, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
cfg = DataConfig(path=(corpus,), cache_dir=cache, vocab_size=300, val_permille=100)
try:
    d = build_pretrain_data(cfg, 8)
    res = {"from_cache": d.from_cache, "tokens": int(len(d.train.tokens)), "path": d.cache_path}
except Exception as e:
    res = {"error": f"{type(e).__name__}: {e}"}
with open(f"{out}.{rank}", "w") as fh:
    json.dump(res, fh)
dist.destroy_process_group()
"""


def run_two_ranks(tmp_path: Path, corpus: str, tag: str) -> tuple[list[dict], str]:
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(DIST_WORKER)
    init = f"file://{tmp_path / ('rdzv_' + tag)}"
    out = str(tmp_path / f"result_{tag}")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), init, corpus, str(tmp_path / "cache"), out],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)], logs[1]


def test_distributed_rank0_builds_others_load(tmp_path):
    corpus = str(make_corpus(tmp_path))
    (r0, r1), log1 = run_two_ranks(tmp_path, corpus, "ok")
    assert r0["from_cache"] is False and r1["from_cache"] is True
    assert r0["tokens"] == r1["tokens"] and r0["path"] == r1["path"]
    assert "data:" not in log1  # only rank 0 prints
    (e0, e1), _ = run_two_ranks(tmp_path, str(tmp_path / "absent"), "err")
    assert "FileNotFoundError" in e0["error"] and "absent" in e0["error"]
    assert e1["error"].startswith("RuntimeError: data: rank 0 failed") and "absent" in e1["error"]
