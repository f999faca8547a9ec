"""Pretraining on Megatron indexed data (issue 4, acceptance 5 and 6): the exact data position
is checkpointed, so a resumed run sees the same token ids, also after the data wraps; the
pretrain recipe takes --data.path in Megatron's blend syntax; preprocess then pretrain runs end
to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mff.data.config import DataConfig
from mff.data.megatron_source import SampleLoader, as_blend, batch_keys, build_megatron_data
from mff.data.tokenizer import train_bpe
from tests.cli_util import ROOT, make_corpus, run_cli, tiny_args
from tests.data_util import write_indexed


def _write(prefix, docs, eod=0):
    write_indexed(prefix, [list(d) + [eod] for d in docs])


@pytest.mark.parametrize("built", [8, 5])
def test_resume_gives_the_same_token_ids_across_a_wrap(tmp_path, built):
    # 21 tokens: one pass is (21 - 1) // 4 = 5 samples of seq_len 4; 8 steps of batch 1 wrap once:
    # inside the indices (8 samples asked: Megatron builds two shuffled epochs), or in the loader
    # (5 built, as when a resumed run is extended past the samples it first built)
    _write(tmp_path / "d", [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17]])
    cfg = DataConfig(path=(str(tmp_path / "d"),), split="1,0,0", eod_id=0)

    def loader():
        data = build_megatron_data(cfg, as_blend(cfg.path), seq_len=4, seed=3, train_samples=built, quiet=True)
        return SampleLoader(data.train, 1, batch_keys(cfg))

    ref = loader()
    stream = [ref.next_batch()["input_ids"].tolist() for _ in range(8)]
    assert len(ref.samples) == (10 if built == 8 else 5)
    if built == 5:
        assert stream[5:] == stream[:3]
    got, state = [], None
    for stop in (3, 6, 8):
        ld = loader()
        if state is not None:
            ld.load_state_dict(state)
        while len(got) < stop:
            got.append(ld.next_batch()["input_ids"].tolist())
        state = json.loads(json.dumps(ld.state_dict()))
    assert got == stream


def test_blend_paths_are_recognised(tmp_path):
    _write(tmp_path / "a", [[1, 2]])
    _write(tmp_path / "b", [[3]])
    assert as_blend([str(tmp_path / "a")]).weights is None
    assert as_blend(["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")]).weights == (0.7, 0.3)
    assert as_blend([f"0.7 {tmp_path / 'a'} 0.3 {tmp_path / 'b'}"]).prefixes == (str(tmp_path / "a"), str(tmp_path / "b"))
    corpus = make_corpus(tmp_path / "corpus", n_docs=2)
    assert as_blend([str(corpus)]) is None
    with pytest.raises(ValueError, match="missing weight|weight"):
        as_blend([str(tmp_path / "a"), "0.3", str(tmp_path / "b")])
    with pytest.raises(FileNotFoundError, match="no indexed dataset"):
        as_blend(["0.5", str(tmp_path / "a"), "0.5", str(tmp_path / "nope")])
    with pytest.raises(ValueError, match="mixes raw corpus paths"):
        as_blend(["0.5", str(tmp_path / "a"), "0.5", str(corpus)])
    assert batch_keys(DataConfig(reset_position_ids=True, reset_attention_mask=True)) == ("input_ids", "labels", "position_ids",
                                                                                         "document_ids")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    """A trained BPE and two indexed datasets made by the preprocess recipe from tiny corpora."""
    root = tmp_path_factory.mktemp("megatron")
    corpus_a, corpus_b = make_corpus(root / "ca", n_docs=40, seed=1), make_corpus(root / "cb", n_docs=20, seed=2)
    tok = train_bpe([p.read_text() for p in sorted(corpus_a.glob("*.txt"))], 512)
    tok.save(str(root / "tokenizer.json"))
    for name, corpus in (("a", corpus_a), ("b", corpus_b)):
        r = subprocess.run([sys.executable, "-m", "mff.recipes.preprocess", "--input", str(corpus), "--tokenizer", str(root / "tokenizer.json"),
                            "--output-prefix", str(root / name), "--workers", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    return root


def _args(data_args: list[str], vocab: int = 512) -> list[str]:
    """tiny_args with --data.path replaced by ``data_args`` and no --data.vocab-size."""
    args = tiny_args(ROOT)
    i = args.index("--data.vocab-size")
    del args[i:i + 2]
    i = args.index("--data.path")
    args[i + 1:i + 2] = data_args
    args[args.index("--model.vocab-size") + 1] = str(vocab)
    return args


def _records(path):
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in map(json.loads, path.read_text().splitlines()) if "event" not in r]


def test_pretrain_on_a_blend_resumes_exactly(prefixes, tmp_path):
    root = prefixes
    args = _args(["0.7", str(root / "a"), "0.3", str(root / "b")])
    args += ["--data.tokenizer", str(root / "tokenizer.json"), "--data.split", "90,10,0", "--data.reset-position-ids",
             "--data.reset-attention-mask", "--data.eod-mask-loss", "--steps", "6", "--eval-every", "3", "--eval-iters", "2"]
    full = run_cli(args + ["--ckpt-dir", str(tmp_path / "a"), "--metrics-file", str(tmp_path / "a.jsonl")], tmp_path / "cache", timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "Megatron samples: train 25," in full.stdout  # ceil(24 x 0.7) + ceil(24 x 0.3), as Megatron
    for extra in (["--stop-after", "3"], []):
        r = run_cli(args + extra + ["--ckpt-dir", str(tmp_path / "b"), "--metrics-file", str(tmp_path / "b.jsonl")], tmp_path / "cache",
                    timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = _records(tmp_path / "a.jsonl"), _records(tmp_path / "b.jsonl")
    assert [x[0] for x in a] == list(range(1, 7)) and a == b
    assert a[2][3] is not None and a[5][3] is not None  # validation on the valid split
    # a raw-corpus run cannot resume a Megatron-data checkpoint
    raw = run_cli(tiny_args(make_corpus(tmp_path / "raw", n_docs=5)) + ["--steps", "6", "--ckpt-dir", str(tmp_path / "a")],
                  tmp_path / "cache", timeout=600)
    assert raw.returncode != 0 and "trained on Megatron indexed data" in raw.stderr


def test_reset_options_need_an_eod_id(prefixes, tmp_path):
    r = run_cli(_args([str(prefixes / "a")]) + ["--data.reset-attention-mask", "--steps", "2", "--ckpt-dir", str(tmp_path / "c")], tmp_path / "cache", timeout=600)
    assert r.returncode == 2 and "need the EOD id" in r.stderr


@pytest.mark.slow
def test_preprocess_default_corpus_then_pretrain(tmp_path):
    """Acceptance 6: python -m mff.recipes.preprocess on the default corpus (the stdlib), then
    pretraining on the prefix."""
    from mff.data.corpus import discover_files

    files = discover_files(())[0][:200]
    tok = train_bpe([open(f.path, encoding="utf-8", errors="replace").read() for f in files], 1024)
    tok.save(str(tmp_path / "tokenizer.json"))
    r = subprocess.run([sys.executable, "-m", "mff.recipes.preprocess", "--tokenizer", str(tmp_path / "tokenizer.json"), "--output-prefix",
                        str(tmp_path / "stdlib"), "--workers", "2"], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "stdlib.bin").stat().st_size > 1_000_000
    t = run_cli(_args([str(tmp_path / "stdlib")], vocab=1024) + ["--data.tokenizer", str(tmp_path / "tokenizer.json"), "--steps", "4", "--eval-every", "4", "--eval-iters", "1",
                        "--ckpt-dir", str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "m.jsonl")], tmp_path / "cache", timeout=600)
    assert t.returncode == 0, t.stderr[-3000:]
    recs = [r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines()) if "event" not in r]
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and recs[-1]["val_loss"] is not None
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert torch.isfinite(torch.tensor([x["loss"] for x in recs])).all()


@pytest.mark.parametrize("eod,message", [("-1", "--data.eod-id -1 must be a token id >= 0"),
                                         ("600", "the EOD id 600 is outside the model's vocabulary [0, 512)")])
def test_bad_eod_id_is_refused(prefixes, tmp_path, eod, message):
    r = run_cli(_args([str(prefixes / "a")]) + ["--data.eod-id", eod, "--data.reset-attention-mask", "--steps", "2",
                                                 "--ckpt-dir", str(tmp_path / "e")], tmp_path / "cache", timeout=600)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def test_empty_valid_split_skips_validation(prefixes, tmp_path):
    r = run_cli(_args([str(prefixes / "a")]) + ["--data.split", "1,0,0", "--eval-every", "2", "--steps", "2", "--ckpt-dir", str(tmp_path / "f"),
                                                 "--metrics-file", str(tmp_path / "f.jsonl")], tmp_path / "cache", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no validation samples" in r.stdout
    assert all("val_loss" not in json.loads(x) for x in (tmp_path / "f.jsonl").read_text().splitlines())
