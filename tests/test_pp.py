"""Issue 17 (pipeline parallelism), acceptance 1-3 and 5, on gloo under torchrun.

1. Three fp32 steps of tiny 4-layer deepseek3 (MoE, MTP, balance loss) and qwen3 (tied
   embeddings) equal the one-process run (losses, grad norms, every final param within 1e-5)
   under pp=2 GPipe and 1F1B, pp=2 Interleaved 1F1B with 2 stages per rank, pp=2 x dp-shard=2,
   pp=2 x ep=2 and pp=2 x tp=2 (tests/pp_worker.py); qwen3_moe (a Switch balance loss over every layer)
   under 1F1B and Interleaved. Under pp x dp-shard the FSDP gradients are reduce-scattered once
   per step, not once per micro-batch.
2. The expert loads of every step (both stages and the MTP depth) and the expert bias after the
   bias updates equal the one-process run exactly.
3. A pp=2 checkpoint resumes on 1 process and at dp-shard=2, a 1-process checkpoint at pp=2,
   each with the next-step loss of the uninterrupted run.
5. Bad input stops every rank with one line: pp larger than the layer count, a
   ``--parallel.pp-layers`` split that leaves layers out, fewer micro-batches than 1F1B needs,
   and pipeline parallelism asked of generate and eval.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from mff.parallel.pp_layout import balanced_split, stage_layout
from tests.cli_util import ROOT, cli_env, make_corpus, run_cli, tiny_args
from tests.dist_util import free_port, torchrun, torchrun_rank_stderr

WORKER = str(ROOT / "tests" / "pp_worker.py")
TOL = 1e-5
LAYOUTS = [
    pytest.param(2, ["--schedule", "gpipe"], ("deepseek3", "qwen3"), id="pp2-gpipe"),
    pytest.param(2, ["--schedule", "1f1b"], ("deepseek3", "qwen3", "qwen3_moe"), id="pp2-1f1b"),
    pytest.param(2, ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2"], ("deepseek3", "qwen3", "qwen3_moe"),
                 id="pp2-interleaved-2-per-rank"),
    pytest.param(4, ["--dp-shard", "2"], ("deepseek3", "qwen3"), id="pp2xdp_shard2"),
    pytest.param(4, ["--ep", "2"], ("deepseek3", "qwen3"), id="pp2xep2"),
    pytest.param(4, ["--tp", "2"], ("deepseek3", "qwen3"), id="pp2xtp2"),
]


def _launch(out, families, nproc: int, flags: list[str]) -> list[dict]:
    if nproc == 1:
        cmd = [sys.executable, WORKER]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}", WORKER]
    r = subprocess.run([*cmd, str(out), "--families", ",".join(families), *flags], capture_output=True, text=True,
                       env=cli_env(out.parent / "cache"), cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(f"{out}.rank{k}", weights_only=False) for k in range(nproc)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run: the same micro-batches of 2 rows, one after the other."""
    return _launch(tmp_path_factory.mktemp("ref") / "ref", ("deepseek3", "qwen3", "qwen3_moe"), 1, ["--micro-rows", "2"])[0]


@pytest.mark.parametrize("nproc,flags,families", LAYOUTS)
def test_pipeline_layout_matches_one_process(reference, tmp_path, nproc, flags, families):
    ranks = _launch(tmp_path / "got", families, nproc, ["--pp", "2", "--micro-rows", "2", *flags])
    opts = dict(zip(flags[::2], flags[1::2]))
    for axis in ("dp_shard", "ep", "tp"):
        assert ranks[0]["mesh"][axis] == int(opts.get(f"--{axis.replace('_', '-')}", 1)), ranks[0]["mesh"]
    assert (sum(r["ep_dispatches"] for r in ranks) > 0) == ("--ep" in opts)  # real expert parallelism: tokens sent by all-to-all
    for family in families:
        ref, got = reference[family], [r[family] for r in ranks]
        stages = got[0]["stages"]
        assert f"{4 if 'interleaved' in str(flags) else 2} stages on 2 ranks" in stages, stages
        params = {}
        for g in got:
            assert g["losses"] == pytest.approx(ref["losses"], abs=TOL), family
            assert g["grad_norms"] == pytest.approx(ref["grad_norms"], abs=TOL), family
            for step, (a, b) in enumerate(zip(ref["loads"], g["loads"])):  # acceptance 2: every stage's loads, MTP included
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (family, step)
            params.update(g["params"])
        assert sorted(params) == sorted(ref["params"]), family  # the stages together hold every param once
        for k, v in params.items():
            diff = (v - ref["params"][k]).abs().max().item()
            assert diff <= TOL, f"{family} {k}: {diff}"
            if k.endswith("e_score_correction_bias"):
                assert torch.equal(v, ref["params"][k]), f"{family} {k}: the expert-bias update differs"  # acceptance 2
        if family == "deepseek3":
            assert ref["loads"][0].keys() == {f"model.layers.{i}.mlp" for i in (1, 2, 3, 4)}  # 3 MoE layers + the MTP depth
            assert any(not torch.equal(ref["params"][k], torch.zeros_like(ref["params"][k])) for k in ref["params"]
                       if k.endswith("e_score_correction_bias"))  # the bias did move
        if "--dp-shard" in opts:
            for g in got:  # FSDP: one reduce-scatter per sharded param per step, whatever the micro-batch count
                assert g["microbatches"] == 2 and g["reduce_scatters"] == [g["fsdp_params"]] * 3 and g["fsdp_params"] > 0, family


# ---- acceptance 3: checkpoints resume across layouts ---------------------------------------

STEPS = 4


def _args(corpus, ckpt, metrics) -> list[str]:
    return [*tiny_args(corpus), "--model.num-hidden-layers", "4", "--steps", str(STEPS), "--ckpt-dir", str(ckpt),
            "--metrics-file", str(metrics)]


def _losses(metrics) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted one-process run (two micro-batches of 2 rows, as the pipeline's) and
    checkpoints at step 2 of a pp=2 run and of a one-process run."""
    root = tmp_path_factory.mktemp("pp_resume")
    corpus, cache = make_corpus(root / "corpus"), root / "cache"
    r = run_cli(_args(corpus, root / "ref", root / "ref.jsonl") + ["--grad-accum", "2"], cache, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = torchrun(2, _args(corpus, root / "pp2", root / "pp2.jsonl") + ["--parallel.pp", "2", "--stop-after", "2"], cache, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    assert "pipeline: 1f1b, 2 stages on 2 ranks, 2 micro-batches" in r.stdout
    files = sorted(p.name for p in (root / "pp2" / "step_00000002").iterdir())
    assert files == ["meta.msgpack", "model-rank00000-of-00002.safetensors", "model-rank00001-of-00002.safetensors",
                     "optim-rank00000-of-00002.safetensors", "optim-rank00001-of-00002.safetensors"]
    r = run_cli(_args(corpus, root / "one", root / "one.jsonl") + ["--grad-accum", "2", "--stop-after", "2"], cache, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return root, corpus, cache, _losses(root / "ref.jsonl")


@pytest.mark.parametrize("source,nproc,flags", [
    pytest.param("pp2", 1, ["--grad-accum", "2"], id="pp2-to-one-process"),
    pytest.param("pp2", 2, ["--parallel.dp-shard", "2"], id="pp2-to-dp_shard2"),
    pytest.param("one", 2, ["--parallel.pp", "2"], id="one-process-to-pp2"),
])
def test_checkpoint_resumes_on_another_layout(runs, tmp_path, source, nproc, flags):
    root, corpus, cache, ref = runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / source, ckpt)
    args = _args(corpus, ckpt, tmp_path / "m.jsonl") + flags
    r = run_cli(args, cache, timeout=600) if nproc == 1 else torchrun(nproc, args, cache, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    assert f"resumed from {ckpt / 'step_00000002'}" in r.stdout
    got = _losses(tmp_path / "m.jsonl")
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(ref[step], abs=TOL), (step, got, ref)


def test_a_rank_that_cannot_read_its_pieces_stops_every_rank(runs, tmp_path):
    """Resuming reads each rank's own pieces; a truncated piece file of one rank stops both ranks
    at start-up with one line naming it (not one rank, the other failing later in a collective)."""
    root, corpus, cache, _ = runs
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "pp2", ckpt)
    piece = ckpt / "step_00000002" / "model-rank00001-of-00002.safetensors"
    piece.write_bytes(piece.read_bytes()[:100])
    r, per_rank = torchrun_rank_stderr(2, _args(corpus, ckpt, tmp_path / "m.jsonl") + ["--parallel.pp", "2"], tmp_path)
    assert r.returncode != 0
    for rank, err in enumerate(per_rank):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: rank {rank}: ") and piece.name in lines[0], err
    assert "step     3" not in r.stdout


# ---- acceptance 5: bad input, one line each ------------------------------------------------

@pytest.mark.parametrize("extra, cause", [
    (["--parallel.pp", "2", "--model.num-hidden-layers", "1"],
     "--parallel.pp 2 makes 2 pipeline stages, more than the model's 1 layers (each stage needs at least one layer)"),
    (["--parallel.pp", "2", "--model.num-hidden-layers", "4", "--parallel.pp-layers", "1,2"],
     "--parallel.pp-layers '1,2' covers 3 layers; the model has 4, so layers 3..3 would be in no stage"),
    (["--parallel.pp", "2", "--parallel.pp-microbatches", "0"], "--parallel.pp-microbatches 0: must be an integer >= 1"),
    (["--parallel.pp", "3"], "WORLD_SIZE 2 is not divisible by pp 3 x dp_replicate 1 x ep 1 x tp 1 = 3"),  # before the ranks connect
    (["--parallel.pp-layers", "1,3"], "--parallel.pp-layers 1,3 is a pipeline option: give --parallel.pp N (N > 1) too, or leave it out"),
    (["--parallel.pp", "2", "--parallel.pp-microbatches", "1"],
     "--parallel.pp-microbatches 1: the 1f1b schedule needs at least one micro-batch per pipeline rank (>= --parallel.pp 2); "
     "use more micro-batches or --parallel.pp-schedule gpipe"),
])
def test_bad_pipeline_options_stop_every_rank_with_one_line(tmp_path, extra, cause):
    args = tiny_args(make_corpus(tmp_path / "corpus")) + ["--steps", "2", "--ckpt-dir", str(tmp_path / "ck"), *extra]
    r, per_rank = torchrun_rank_stderr(2, args, tmp_path)
    assert r.returncode != 0
    for rank, err in enumerate(per_rank):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert lines == [f"error: rank {rank}: {cause}"], err
    assert "step " not in r.stdout and "data:" not in r.stdout


@pytest.mark.parametrize("recipe", ["generate", "eval"])
def test_generation_and_evaluation_refuse_pipeline_parallelism(tmp_path, recipe):
    r = subprocess.run([sys.executable, "-m", f"mff.recipes.{recipe}", "--parallel.pp", "2"], capture_output=True, text=True,
                       env=cli_env(tmp_path), cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"error: --parallel.pp: {recipe} does not run pipeline parallelism (pipeline stages are for "
                                     f"training: python -m mff.recipes.pretrain --parallel.pp N); {recipe} reads a pipeline run's "
                                     "checkpoint as any other"]


def test_finetune_refuses_pipeline_parallelism(runs, tmp_path):
    root = runs[0]
    r = subprocess.run([sys.executable, "-m", "mff.recipes.finetune", "--init-from", str(root / "one"), "--parallel.pp", "2"],
                       capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert "--parallel.pp 2: pipeline parallelism is built for pretraining only" in r.stderr.splitlines()[-1]


# ---- the split ------------------------------------------------------------------------------

def test_balanced_split_minimises_the_slowest_stage_against_brute_force():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(2, 8), rng.randint(1, 4)
        if k > n:
            continue
        costs = [rng.choice([1.0, 2.0, 5.0, 0.5]) for _ in range(n)]
        first, last = rng.choice([0.0, 3.0]), rng.choice([0.0, 4.0])
        got = balanced_split(costs, k, first, last)

        def worst(counts, costs=costs, k=k, first=first, last=last):
            bounds = list(itertools.accumulate(counts, initial=0))
            stage = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(k)]
            stage[0] += first
            stage[-1] += last
            return max(stage)

        best = min(worst(c) for c in itertools.product(range(1, n + 1), repeat=k) if sum(c) == n)
        assert sum(got) == n and min(got) >= 1 and worst(got) == pytest.approx(best), (costs, k, got)


def test_a_validation_split_smaller_than_the_ranks_stops_every_rank():
    """rank_slices refuses on every rank, also those that would get rows, so all ranks stop alike."""
    from mff.train.loop import rank_slices

    one = {"input_ids": torch.zeros(1, 4, dtype=torch.int64), "labels": torch.zeros(1, 4, dtype=torch.int64)}
    for rank in (0, 1):
        with pytest.raises(ValueError, match="the validation split has 1 windows, fewer than the 2 data-parallel ranks"):
            rank_slices([one], rank, 2)


def test_stage_layout_places_stages_round_robin():
    lay = stage_layout(8, 2, 2)
    assert [list(r) for r in lay.layers] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.stages_of(0) == [0, 2] and lay.stages_of(1) == [1, 3] and lay.rank_of(3) == 1
    assert [len(r) for r in stage_layout(5, 2, 1, "1,4").layers] == [1, 4]


@pytest.mark.parametrize("family", ["deepseek3", "telechat3", "qwen3", "qwen3_moe", "glm4", "glm4_moe", "llama"])
def test_stages_in_order_give_the_forward_losses(family):
    """Every family: the stage functions run one after the other on one process (each with
    exactly its stage's params) give the losses of ``forward``, term by term."""
    from tests.pp_worker import global_batch, tiny

    model = tiny(family)
    params = model.init(seed=3)
    batch = global_batch(0)
    want = model.forward(params, batch, logits=False).losses
    layout = stage_layout(model.config.num_hidden_layers, 3, 1, "1,2,1")
    carry, loads = (), {}
    for s, layers in enumerate(layout.layers):
        first, last = s == 0, s == layout.num_stages - 1
        keys = model.stage_keys(layers, first, last)
        carry, stage_loads = model.stage_forward({k: params[k] for k in keys}, carry, layers, first, last, batch)
        loads.update(stage_loads)
    assert carry.keys() == want.keys()
    for k in want:
        assert float(carry[k]) == pytest.approx(float(want[k]), abs=1e-6), k
    assert sorted(loads) == sorted(model.forward(params, batch, logits=False).expert_load)
    shared = model.shared_keys()
    assert bool(shared) == (getattr(model.config, "tie_word_embeddings", False) or bool(model.mtp_layers())), shared
