"""``pretrain --from-mindformers-yaml`` (issue 8, acceptance 5): a MindFormers DeepSeek-V3
pretraining YAML (Mcore form, tests/data/mindformers) becomes an mff run that trains 3 steps; the
legacy form and Megatron field names map to the same mff fields; bad YAMLs get clear errors."""

from __future__ import annotations

import json
import math
import shlex
import shutil

import numpy as np
import pytest
import yaml

from mff.recipes.common import parse_model_args
from mff.recipes.mindformers_yaml import translate
from mff.recipes.pretrain import PretrainConfig
from mff.recipes.pretrain import main as pretrain_main
from tests.cli_util import ROOT, run_cli
from tests.data_util import write_indexed

DATA = ROOT / "tests" / "data"
MCORE = DATA / "mindformers" / "pretrain_deepseek3_tiny.yaml"
LEGACY = DATA / "mindformers" / "pretrain_deepseek3_legacy.yaml"


def _parse(flags: list[str]) -> PretrainConfig:
    return parse_model_args(PretrainConfig, flags, prog="test")[2]


def _write_yaml(path, tree) -> str:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return str(path)


# every key of pretrain_deepseek3_tiny.yaml that mff has no use for
MCORE_IGNORED = """seed (mff has one --seed; the data seed 1234 is used so the samples are Megatron's)
run_mode use_parallel use_legacy load_checkpoint load_ckpt_format auto_trans_ckpt resume_training pretrained_model_dir print_separate_loss
runner_config.epochs runner_config.sink_mode runner_config.sink_size runner_wrapper.type runner_wrapper.scale_sense
train_dataset.data_loader.sizes train_dataset.data_loader.config.create_attention_mask train_dataset.data_loader.config.create_compressed_eod_mask
train_dataset.data_loader.config.eod_pad_length train_dataset.data_loader.config.pad train_dataset.input_columns train_dataset.construct_args_key
train_dataset.drop_remainder train_dataset.num_parallel_workers train_dataset.python_multiprocessing train_dataset.numa_enable
train_dataset.prefetch_size train_dataset_task.type context.mode context.device_target context.max_device_memory context.save_graphs
context.jit_config.jit_level context.memory_optimize_level parallel_config.use_seq_parallel parallel_config.vocab_emb_dp
parallel_config.gradient_aggregation_group parallel.parallel_mode parallel.gradients_mean parallel.enable_alltoall parallel.full_batch
parallel.dataset_strategy parallel.search_mode parallel.strategy_ckpt_config.save_file parallel.strategy_ckpt_config.only_trainable_params
recompute_config.parallel_optimizer_comm_recompute recompute_config.mp_comm_recompute recompute_config.recompute_slice_activation
model.model_config.layernorm_compute_dtype model.model_config.softmax_compute_dtype model.model_config.rotary_dtype
model.model_config.use_flash_attention model.model_config.input_sliced_sig model.model_config.moe_grouped_gemm model.model_config.mla_qkv_concat
model.model_config.use_interleaved_weight_layout_mlp model.model_config.fused_norm callbacks"""


def _ignored_list() -> list[str]:
    first, rest = MCORE_IGNORED.split("\n", 1)
    return [first, *rest.split()]


def test_mcore_deepseek3_yaml_maps_every_field():
    tr = translate(str(MCORE))
    assert tr.ignored == _ignored_list()
    cfg = _parse(tr.flags)
    m = cfg.model
    # model_config as the YAML writes it (HF names)
    assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.moe_intermediate_size, m.num_hidden_layers) == (512, 64, 128, 32, 2)
    assert (m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (2, 32, 16, 16, 8, 16)
    assert (m.n_routed_experts, m.n_shared_experts, m.num_experts_per_tok, m.n_group, m.topk_group, m.first_k_dense_replace) == (4, 1, 2, 2, 1, 1)
    assert (m.routed_scaling_factor, m.norm_topk_prob, m.num_nextn_predict_layers, m.max_position_embeddings) == (2.5, True, 1, 64)
    assert m.rope_parameters.rope_type == "default" and m.rope_parameters.rope_theta == 10000.0 and m.rms_norm_eps == 1e-6
    # Megatron-named extras: moe_aux_loss_coeff -> aux_loss_alpha, bias update rate and MTP weight keep their names
    assert (m.aux_loss_alpha, m.moe_router_bias_update_rate, m.mtp_loss_scaling_factor) == (1e-4, 1e-3, 0.3)
    assert cfg.seq_len == 32 and cfg.precision == "bf16-mixed"  # bfloat16 compute over float32 params
    # global batch = batch_size 1 x data_parallel 1 x micro_batch_num 2 x gradient_accumulation_steps 2
    assert (cfg.batch_size, cfg.grad_accum) == (4, 4)
    assert (cfg.parallel.dp_shard, cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.pp) == (1, 1, 1, 1)
    o = cfg.optim
    assert (o.name, o.beta1, o.beta2, o.eps, o.weight_decay, o.max_grad_norm) == ("adamw", 0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (o.schedule, o.lr, o.warmup_steps, cfg.steps) == ("cosine", 2e-3, 2, 4)  # warmup_ratio 0.5 of total_steps 4
    assert math.isclose(o.min_lr_ratio, 0.1)  # lr_end 2e-4 / learning_rate 2e-3
    d = cfg.data
    assert d.path == ("0.3", "/path/to/wiki_a_text_document", "0.7", "/path/to/wiki_b_text_document") and d.split == "1,0,0"
    assert d.eod_mask_loss and d.reset_position_ids and d.reset_attention_mask and d.eod_id == 0
    assert cfg.seed == 1234 and cfg.ckpt_dir == "./output" and cfg.ac == "none"
    assert tr.flags[:4] == ["--model", "deepseek3", "--size", "tiny"]


def test_mcore_deepseek3_yaml_trains_three_steps(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        write_indexed(tmp_path / name, [list(rng.integers(1, 512, rng.integers(5, 40))) + [0] for _ in range(30)])
    tree = yaml.safe_load(MCORE.read_text())
    tree["train_dataset"]["data_loader"]["config"]["data_path"] = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")]
    tree["output_dir"] = str(tmp_path / "out")
    run_yaml = _write_yaml(tmp_path / "run.yaml", tree)
    user = ["--steps", "3", "--optim.warmup-steps", "1", "--eval-every", "0", "--threads", "1", "--metrics-file", str(tmp_path / "m.jsonl")]
    r = run_cli(["--from-mindformers-yaml", run_yaml, *user], tmp_path / "cache", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "mff command: " + shlex.join(["python", "-m", "mff.recipes.pretrain", *translate(run_yaml).flags, *user])
    assert lines[1] == f"ignored MindFormers keys ({len(_ignored_list())}):"
    assert [x.strip() for x in lines[2:2 + len(_ignored_list())]] == _ignored_list()
    recs = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3] and all(math.isfinite(x["loss"]) and x["mtp_loss"] > 0 for x in recs)
    assert (tmp_path / "out" / "latest").read_text().strip() == "step_00000003"  # output_dir is the checkpoint folder
    assert "Megatron samples: train 13," in r.stdout  # ceil(12 x 0.3) + ceil(12 x 0.7) from --steps 3 x --batch-size 4


def test_legacy_deepseek3_yaml_maps_and_runs_on_mindrecord(tmp_path):
    tr = translate(str(LEGACY))
    cfg = _parse(tr.flags)
    m = cfg.model
    assert (m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers, m.num_nextn_predict_layers) == (2, 2, 2, 1)  # num_heads ...
    assert m.mtp_loss_scaling_factor == 0.3 and m.vocab_size == 1024
    assert (m.n_routed_experts, m.num_experts_per_tok, m.n_shared_experts, m.moe_intermediate_size) == (4, 2, 1, 32)  # moe_config
    assert (m.n_group, m.topk_group, m.first_k_dense_replace, m.routed_scaling_factor) == (2, 1, 1, 2.5)
    assert m.moe_router_bias_update_rate == 5e-4 and m.aux_loss_alpha == 2e-4
    rp = m.rope_parameters  # theta and the scaling_factor YaRN block
    assert (rp.rope_type, rp.rope_theta, rp.factor, rp.mscale, rp.mscale_all_dim, rp.original_max_position_embeddings) == ("yarn", 1e4, 4.0, 1.0, 1.0, 16)
    assert cfg.seq_len == 8 and cfg.precision == "bf16-mixed" and cfg.ac == "full"
    assert (cfg.batch_size, cfg.grad_accum, cfg.parallel.dp_shard, cfg.parallel.pp) == (2, 1, 2, 2)
    assert (cfg.optim.name, cfg.optim.max_grad_norm, cfg.optim.schedule, cfg.optim.lr, cfg.optim.warmup_steps, cfg.steps) == \
        ("adamw", 0.0, "constant", 1e-3, 1, 3)
    assert cfg.data.path == ("/path/to/wiki4096.mindrecord",) and not cfg.data.shuffle and cfg.seed == 42
    assert "moe_config.routing_policy" in tr.ignored and "model.model_config.multiple_of" in tr.ignored
    assert not [k for k in tr.ignored if k.startswith(("moe_config.expert_num", "model.model_config.num_heads", "model.model_config.theta"))]

    shutil.copytree(DATA / "mindrecord", tmp_path / "mr")
    tree = yaml.safe_load(LEGACY.read_text())
    tree["train_dataset"]["data_loader"]["dataset_dir"] = str(tmp_path / "mr" / "tiny_pretrain.mindrecord")
    tree["output_dir"] = str(tmp_path / "out")
    run_yaml = _write_yaml(tmp_path / "legacy.yaml", tree)
    # pipeline_stage 2 maps to --parallel.pp 2, which one process cannot hold
    r = run_cli(["--from-mindformers-yaml", run_yaml, "--threads", "1"], tmp_path / "cache", timeout=600)
    assert r.returncode == 2 and "mesh pp 2 x dp_replicate 1 x dp_shard 2 x ep 1 x tp 1 = 4 processes, but WORLD_SIZE is 1" in r.stderr, r.stderr
    # flags given after the YAML win
    r = run_cli(["--from-mindformers-yaml", run_yaml, "--parallel.pp", "1", "--parallel.dp-shard", "1", "--threads", "1", "--eval-every", "0"],
                tmp_path / "cache", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MindRecord data" in r.stdout and "step     3/3" in r.stdout


def test_megatron_field_names_and_qwen3_moe(tmp_path):
    tree = {"trainer": {"model_name": "qwen3_moe"},
            "model": {"model_config": {"num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2,
                                       "kv_channels": 16, "num_moe_experts": 6, "moe_router_topk": 3, "moe_ffn_hidden_size": 24,
                                       "moe_aux_loss_coeff": 0.01, "untie_embeddings_and_output_weights": False, "rotary_base": 5e5,
                                       "layernorm_epsilon": 1e-5, "padded_vocab_size": 300, "seq_length": 16}},
            "lr_scheduler": {"type": "LinearWithWarmUpLR", "learning_rate": 1e-3, "warmup_steps": 0, "total_steps": 10},
            "train_dataset": {"dataloader": {"type": "MindDataset", "dataset_dir": "/d"}}}
    tr = translate(_write_yaml(tmp_path / "q.yaml", tree))
    cfg = _parse(tr.flags)
    m = cfg.model
    assert tr.flags[:2] == ["--model", "qwen3_moe"] and tr.ignored == []
    assert (m.num_hidden_layers, m.intermediate_size, m.num_key_value_heads, m.head_dim, m.num_experts, m.num_experts_per_tok) == (3, 96, 2, 16, 6, 3)
    assert (m.moe_intermediate_size, m.router_aux_loss_coef, m.tie_word_embeddings, m.rope_parameters.rope_theta) == (24, 0.01, True, 5e5)
    assert (m.rms_norm_eps, m.vocab_size, cfg.seq_len, cfg.steps, cfg.optim.schedule, cfg.optim.min_lr_ratio) == (1e-5, 300, 16, 10, "linear", 0.0)


def test_expert_parallel_is_taken_out_of_data_parallel(tmp_path):
    """MindFormers runs data_parallel x model_parallel x pipeline_stage devices, expert_parallel
    carved out of data_parallel; mff's ep is a mesh axis of its own, so dp-shard = dp / ep."""
    base = {"trainer": {"model_name": "qwen3_moe"}, "model": {"model_config": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}},
            "runner_config": {"batch_size": 1}}
    tr = translate(_write_yaml(tmp_path / "a.yaml", {**base, "parallel_config": {"data_parallel": 4, "expert_parallel": 2, "model_parallel": 2}}))
    p = _parse(tr.flags).parallel
    assert (p.dp_replicate, p.dp_shard, p.ep, p.tp) == (1, 2, 2, 2)  # 8 processes, as MindFormers' 4 x 2 devices
    assert _parse(tr.flags).batch_size == 4
    tr = translate(_write_yaml(tmp_path / "b.yaml", {**base, "parallel_config": {"data_parallel": 4, "expert_parallel": 4},
                                                      "parallel": {"enable_parallel_optimizer": False}}))
    p = _parse(tr.flags).parallel
    assert (p.dp_replicate, p.dp_shard, p.ep) == (1, 1, 4)
    with pytest.raises(ValueError, match=r"parallel_config.expert_parallel.*3 does not divide parallel_config.data_parallel 4"):
        translate(_write_yaml(tmp_path / "c.yaml", {**base, "parallel_config": {"data_parallel": 4, "expert_parallel": 3}}))


def test_bad_yaml_is_refused_clearly(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="nope.yaml does not exist"):
        translate(str(tmp_path / "nope.yaml"))
    assert pretrain_main(["--from-mindformers-yaml", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err
    assert pretrain_main(["--from-mindformers-yaml"]) == 2 and "--from-mindformers-yaml needs a YAML path" in capsys.readouterr().err
    base = yaml.safe_load(MCORE.read_text())
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a YAML mapping"):
        translate(str(tmp_path / "list.yaml"))
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ValueError, match=r"bad.yaml:2:1: not valid YAML: expected the node content") as e:
        translate(str(tmp_path / "bad.yaml"))
    assert "\n" not in str(e.value)  # one line, with the file, line and column
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 100_000)
    with pytest.raises(ValueError, match=r"deep.yaml: not valid YAML: nested too deeply"):
        translate(str(tmp_path / "deep.yaml"))
    (tmp_path / "latin1.yaml").write_bytes(b"model:\n  name: \"caf\xe9\"\n")
    with pytest.raises(ValueError, match=r"latin1.yaml is not UTF-8 text \(byte 19: invalid continuation byte\)"):
        translate(str(tmp_path / "latin1.yaml"))

    def variant(name, edit):
        tree = json.loads(json.dumps(base))
        edit(tree)
        return _write_yaml(tmp_path / f"{name}.yaml", tree)

    with pytest.raises(ValueError, match="no model.model_config mapping and no pretrained_model_dir"):
        translate(variant("nomodel", lambda tr: tr.update(model=None)))
    with pytest.raises(ValueError, match=r"lr_schedule.type: is missing; mff maps ConstantWarmUpLR"):
        translate(variant("notype", lambda tr: tr["lr_schedule"].pop("type")))
    translate(variant("nodata", lambda tr: [tr.pop("train_dataset"), tr.pop("train_dataset_task", None)]))
    assert "has no train_dataset; mff's default corpus is used unless --data.path is given" in capsys.readouterr().err

    def unknown(tr):
        tr["trainer"]["model_name"] = "mixtral"
        tr["model"]["model_config"]["model_type"] = "mixtral"
        del tr["model"]["model_config"]["architectures"]

    with pytest.raises(ValueError, match=r"unknown model type \(trainer.model_name='mixtral', model.model_config.model_type='mixtral'\); supported"):
        translate(variant("model", unknown))
    with pytest.raises(ValueError, match=r"lr_schedule.type: 'CosineWithRestartsAndWarmUpLR' is not supported; mff maps ConstantWarmUpLR"):
        translate(variant("lr", lambda tr: tr["lr_schedule"].update(type="CosineWithRestartsAndWarmUpLR")))
    with pytest.raises(ValueError, match=r"optimizer.type: 'SGD' is not supported"):
        translate(variant("opt", lambda tr: tr["optimizer"].update(type="SGD")))
    with pytest.raises(ValueError, match=r"train_dataset.data_loader.type: 'CommonDataLoader' is not supported"):
        translate(variant("data", lambda tr: tr["train_dataset"]["data_loader"].update(type="CommonDataLoader")))
    with pytest.raises(ValueError, match=r"runner_config.batch_size: 0 must be an integer >= 1"):
        translate(variant("batch", lambda tr: tr["runner_config"].update(batch_size=0)))
    with pytest.raises(ValueError, match=r"model.model_config: .*num_experts_per_tok=8 must be in \[1, n_routed_experts=4\]"):
        translate(variant("topk", lambda tr: tr["model"]["model_config"].update(num_experts_per_tok=8)))
