"""MindFormers pretraining YAML -> ``python -m mff.recipes.pretrain`` flags.

``python -m mff.recipes.pretrain --from-mindformers-yaml run.yaml [flags]`` reads a MindFormers
pretraining YAML (Mcore and legacy forms, ``docs/mindformers_formats.md`` §5),
prints the mff command it corresponds to and every YAML key it does not use (dotted paths), then
runs that command with the user's other flags after the translated ones (explicit flags win).

What maps where:

- Model family: ``trainer.model_name``, ``model.model_config.model_type`` / ``type``,
  ``model.arch.type`` or ``pretrained_model_dir``'s config.json (deepseek_v3 -> deepseek3, qwen3,
  qwen3_moe, glm4, glm4_moe, telechat3). ``model.model_config`` fields (HF names of the Mcore form,
  Megatron names such as ``num_moe_experts`` / ``moe_router_topk`` / ``num_layers``, and the legacy
  names ``num_heads`` / ``n_kv_heads`` / ``theta`` / ``mtp_depth`` / ``moe_config.expert_num`` /
  ``num_experts_chosen`` ...) over ``pretrained_model_dir/config.json`` over the HF defaults give
  the model config; the command names the family's size closest to it and ``--model.<field>`` for
  each field that differs.
- ``seq_length`` -> ``--seq-len``; ``compute_dtype`` / ``params_dtype`` -> ``--precision``.
- Batch: MindFormers' ``batch_size`` is per data-parallel rank and micro-batch, so ``--batch-size``
  (global) = batch_size x data_parallel x micro_batch_num x gradient_accumulation_steps and
  ``--grad-accum`` = micro_batch_num x gradient_accumulation_steps.
- ``parallel_config`` -> ``--parallel.*`` (data_parallel / expert_parallel to dp-shard, or
  dp-replicate without the parallel optimizer, since MindFormers takes the expert-parallel ranks
  out of the data-parallel ones; model_parallel -> tp, expert_parallel -> ep, pipeline_stage -> pp,
  context_parallel -> cp). mff's own validation rejects what it does not support.
- ``optimizer`` (AdamW family, Muon) -> ``--optim.*``; ``runner_wrapper`` clipping ->
  ``--optim.max-grad-norm``; ``lr_schedule`` (ConstantWarmUpLR, CosineWithWarmUpLR,
  LinearWithWarmUpLR) -> ``--optim.lr/schedule/warmup-steps/min-lr-ratio`` and ``--steps``
  (``total_steps``, else the Megatron loader's train ``sizes`` / global batch).
- ``train_dataset`` BlendedMegatronDatasetDataLoader -> ``--data.path`` (blend syntax),
  ``--data.split``, ``--data.eod-id``, the EOD options, ``--seed`` (the data seed, so the samples
  are Megatron's); MindDataset ``dataset_dir`` -> ``--data.path`` (MindRecord).
- ``seed``, ``output_dir`` -> ``--ckpt-dir``, ``load_checkpoint`` -> ``--init-from`` (when it is an
  HF folder, an mff checkpoint or a .gguf file), ``recompute_config`` -> ``--ac``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mff.models import FAMILIES, family_for_model_type, get_family, size_config
from mff.nn.rope import RopeParameters

__all__ = ["FLAG", "Translation", "expand_argv", "translate"]

FLAG = "--from-mindformers-yaml"

# normalised model names -> mff family (longest first: "qwen3moe" before "qwen3")
_FAMILY_KEYS = (("deepseekv3", "deepseek3"), ("deepseek3", "deepseek3"), ("telechat3", "telechat3"), ("qwen3moe", "qwen3_moe"),
                ("glm4moe", "glm4_moe"), ("qwen3", "qwen3"), ("glm4", "glm4"), ("llama", "llama"))
_FAMILY_SOURCES = ("trainer.model_name", "model.model_config.model_type", "model.model_config.type", "model.arch.type")

# MindFormers / Megatron / legacy names -> HF field candidates (the first the family has wins)
_RENAMES: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "padded_vocab_size": ("vocab_size",),
    "rotary_base": ("rope_theta",),
    "layernorm_epsilon": ("rms_norm_eps",),
    "num_moe_experts": ("n_routed_experts", "num_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_router_topk_scaling_factor": ("routed_scaling_factor",),
    "moe_router_num_groups": ("n_group",),
    "moe_router_group_topk": ("topk_group",),
    "moe_aux_loss_coeff": ("aux_loss_alpha", "router_aux_loss_coef"),
    "qk_head_dim": ("qk_nope_head_dim",),
    "qk_pos_emb_head_dim": ("qk_rope_head_dim",),
    "mtp_num_layers": ("num_nextn_predict_layers",),
    "qk_layernorm": ("use_qk_norm",),
    "add_qkv_bias": ("attention_bias",),
    # legacy (MindFormers <= 1.x research/deepseek3, Llama family)
    "num_heads": ("num_attention_heads",),
    "n_kv_heads": ("num_key_value_heads",),
    "theta": ("rope_theta",),
    "mtp_depth": ("num_nextn_predict_layers",),
    "mtp_loss_factor": ("mtp_loss_scaling_factor",),
    # legacy moe_config
    "expert_num": ("n_routed_experts", "num_experts"),
    "num_experts_chosen": ("num_experts_per_tok",),
    "shared_expert_num": ("n_shared_experts",),
    "topk_bias_update_rate": ("moe_router_bias_update_rate",),
    "aux_loss_factor": ("aux_loss_alpha", "router_aux_loss_coef"),
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
# settings mff's DeepSeek-V3-style families always have: used when the YAML agrees, else listed
_FIXED = {"deepseek3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_router_score_function": "sigmoid",
                        "moe_router_load_balancing_type": "seq_aux_loss", "moe_config.use_gating_sigmoid": True}}
_FIXED["telechat3"] = _FIXED["deepseek3"]
_SCHEDULES = {"ConstantWarmUpLR": "constant", "CosineWithWarmUpLR": "cosine", "LinearWithWarmUpLR": "linear"}
_ADAMW = ("AdamW", "AdamWeightDecay", "FusedAdamWeightDecay", "PmaAdamW", "FusedAdamW")
_DTYPES = {"float32": 32, "fp32": 32, "float16": 16, "fp16": 16, "bfloat16": 16, "bf16": 16}


@dataclass
class Translation:
    """The mff flags a MindFormers YAML stands for.

    Attributes:
        flags: ``python -m mff.recipes.pretrain`` arguments.
        ignored: dotted paths of the YAML keys not used (with a reason in parentheses where one helps).
    """

    flags: list[str]
    ignored: list[str] = field(default_factory=list)


class _Tree:
    """The YAML mapping with a record of which dotted paths were used."""

    def __init__(self, tree: dict, where: str):
        self.tree, self.where = tree, where
        self.used: set[str] = set()
        self.reasons: dict[str, str] = {}
        self.notes: list[str] = []  # parts of used values left out (a list item, a regex alternative), listed with the ignored keys

    def get(self, path: str, default: Any = None, use: bool = True) -> Any:
        node: Any = self.tree
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        if use:
            self.used.add(path)
        return node

    def first(self, *paths: str, default: Any = None) -> tuple[str | None, Any]:
        for p in paths:
            v = self.get(p, None, use=False)
            if v is not None:
                self.used.add(p)
                return p, v
        return None, default

    def skip(self, path: str, reason: str) -> None:
        self.reasons[path] = reason

    def leaves(self) -> list[str]:
        """Dotted paths of the leaves; a mapping reached again through a YAML alias (``*name``)
        counts once, at its first path."""
        out: list[str] = []
        seen: set[int] = set()

        def walk(node: Any, prefix: str) -> None:
            if isinstance(node, dict) and node:
                if id(node) in seen:
                    return
                seen.add(id(node))
                for k, v in node.items():
                    walk(v, f"{prefix}.{k}" if prefix else str(k))
            else:
                out.append(prefix)

        walk(self.tree, "")
        return out

    def ignored(self) -> list[str]:
        out = []
        for leaf in self.leaves():
            parts = leaf.split(".")
            if any(".".join(parts[:i]) in self.used for i in range(1, len(parts) + 1)):
                continue
            reason = next((self.reasons[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in self.reasons), None)
            out.append(f"{leaf} ({reason})" if reason else leaf)
        return out + self.notes

    def error(self, path: str, msg: str) -> ValueError:
        return ValueError(f"{self.where}: {path}: {msg}")


def _load(path: str) -> _Tree:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{FLAG}: {path} does not exist" if not p.exists() else f"{FLAG}: {path} is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{FLAG}: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        tree = yaml.safe_load(text)
    except RecursionError:
        raise ValueError(f"{FLAG}: {path}: not valid YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
        raise ValueError(f"{FLAG}: {where}: not valid YAML: {what}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{FLAG}: {path} must hold a YAML mapping (a MindFormers run config), got {type(tree).__name__}")
    return _Tree(tree, str(path))


def _family_of(value: Any) -> str | None:
    norm = "".join(c for c in str(value).lower() if c.isalnum())
    return next((fam for key, fam in _FAMILY_KEYS if key in norm), None)


def _family(t: _Tree, hf: dict) -> str:
    seen = []
    for path in _FAMILY_SOURCES:
        v = t.get(path, use=False)
        if v is None:
            continue
        seen.append(f"{path}={v!r}")
        fam = _family_of(v)
        if fam is not None:
            for other in (*_FAMILY_SOURCES, "model.model_config.architectures"):  # every name that agrees is used
                if _family_of(t.get(other, "", use=False)) == fam:
                    t.used.add(other)
            return fam
    if "model_type" in hf:
        try:
            return family_for_model_type(str(hf["model_type"])).name
        except ValueError:
            seen.append(f"pretrained_model_dir config.json model_type={hf['model_type']!r}")
    where = ", ".join(seen) if seen else f"none of {', '.join(_FAMILY_SOURCES)} is set"
    raise ValueError(f"{t.where}: unknown model type ({where}); supported: deepseek_v3/deepseek3, telechat3, qwen3, qwen3_moe, glm4, glm4_moe")


def _pretrained_config(t: _Tree) -> dict:
    d = t.get("pretrained_model_dir", use=False)
    if not d:
        return {}
    cfg = Path(str(d)) / "config.json"
    if not cfg.is_file():
        t.skip("pretrained_model_dir", f"no config.json in {d} here")
        return {}
    t.used.add("pretrained_model_dir")
    try:
        out = json.loads(cfg.read_bytes().decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError is a ValueError too
        raise ValueError(f"{t.where}: pretrained_model_dir: {cfg} is not valid JSON ({e})") from None
    return out if isinstance(out, dict) else {}


def _hf_name(key: str, fields: set[str]) -> str | None:
    if key in fields or key in _ROPE_KEYS:
        return key
    for cand in _RENAMES.get(key, ()):
        if cand in fields or cand in _ROPE_KEYS:
            return cand
    return None


def _model_dict(t: _Tree, fields: set[str], base: dict) -> dict:
    """HF-named config keys from ``model.model_config`` (and a legacy ``moe_config``)."""
    hf = dict(base)
    mc_path = "model.model_config"
    mc = t.get(mc_path, {}, use=False) or {}
    if not isinstance(mc, dict):
        raise t.error(mc_path, f"must be a mapping, got {mc!r}")
    moe_blocks = [(f"{mc_path}.moe_config", mc.get("moe_config")), ("moe_config", t.get("moe_config", use=False))]
    for prefix, block in [(mc_path, mc)] + [(p, b) for p, b in moe_blocks if isinstance(b, dict)]:
        for key, value in block.items():
            path = f"{prefix}.{key}"
            if key == "moe_config" or value is None:
                continue
            if key == "untie_embeddings_and_output_weights" and "tie_word_embeddings" in fields:
                hf["tie_word_embeddings"] = not value
            elif key == "scaling_factor" and isinstance(value, dict):  # legacy DeepSeek-V3 YaRN block
                hf["rope_scaling"] = {"rope_type": "yarn", **value}
            elif key == "moe_router_enable_expert_bias" and "moe_router_bias_update_rate" in fields:
                if not value:
                    hf["moe_router_bias_update_rate"] = 0.0
            elif key == "balance_via_topk_bias" and "moe_router_bias_update_rate" in fields:
                if not value:
                    hf["moe_router_bias_update_rate"] = 0.0
            elif key == "aux_loss_factors" and isinstance(value, list) and value:
                types = block.get("aux_loss_types") or ["expert"]
                name = _hf_name("aux_loss_factor", fields)
                if name is None or "expert" not in types:
                    continue
                hf[name] = value[types.index("expert")]
                t.used.add(f"{prefix}.aux_loss_types")
            elif key == "moe_shared_expert_intermediate_size":
                continue  # resolved below, once moe_intermediate_size is known
            else:
                name = _hf_name(key, fields)
                if name is None:
                    continue
                if name in ("moe_router_bias_update_rate",) and hf.get(name) == 0.0:
                    t.used.add(path)
                    continue
                hf[name] = value
            t.used.add(path)
        shared = block.get("moe_shared_expert_intermediate_size")
        if shared is not None and "n_shared_experts" in fields:
            width = hf.get("moe_intermediate_size")
            if width and shared % width == 0:
                hf["n_shared_experts"] = shared // width
                t.used.add(f"{prefix}.moe_shared_expert_intermediate_size")
            else:
                t.skip(f"{prefix}.moe_shared_expert_intermediate_size", "not a multiple of moe_intermediate_size")
    return hf


def _flag_values(value: Any) -> list[str]:
    if value is None:
        return ["None"]
    if isinstance(value, tuple):
        return [str(v) for v in value]
    if isinstance(value, float):
        return [repr(value)]
    return [str(value)]


def _field_flags(prefix: str, name: str, value: Any) -> list[str]:
    flag = f"{prefix}.{name.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if value else f"{prefix}.no-{name.replace('_', '-')}"]
    return [flag, *_flag_values(value)]


def _model_flags(family: str, cfg: Any, given: set[str]) -> list[str]:
    """``--model FAMILY --size S`` and the fields of ``cfg`` that differ from size S (the size
    needing the fewest such flags); token ids (metadata) only when ``given``."""
    fam = get_family(family)
    best: tuple[int, str, list[str]] | None = None
    for size in fam.sizes:
        base = size_config(fam, size)
        flags: list[str] = []
        for f in dataclasses.fields(cfg):
            v, b = getattr(cfg, f.name), getattr(base, f.name)
            if v == b or (f.name in _TOKEN_IDS and f.name not in given):
                continue
            if isinstance(v, RopeParameters):
                for rf in dataclasses.fields(RopeParameters):
                    if getattr(v, rf.name) != getattr(b, rf.name):
                        flags += _field_flags("--model.rope-parameters", rf.name, getattr(v, rf.name))
            else:
                flags += _field_flags("--model", f.name, v)
        n = sum(1 for x in flags if x.startswith("--"))
        if best is None or n < best[0] or (n == best[0] and size == fam.default_size):
            best = (n, size, flags)
    assert best is not None
    return ["--model", family, "--size", best[1], *best[2]]


def _int(t: _Tree, path: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise t.error(path, f"{value!r} must be an integer >= {low}")
    return value


def _number(t: _Tree, path: str, value: Any) -> float:
    if isinstance(value, bool):
        raise t.error(path, f"{value!r} must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise t.error(path, f"{value!r} must be a number") from None


def _data_loader(t: _Tree) -> tuple[str | None, dict]:
    for p in ("train_dataset.data_loader", "train_dataset.dataloader"):
        v = t.get(p, use=False)
        if isinstance(v, dict):
            return p, v
    return None, {}


def _loadable(path: str) -> str | None:
    from mff.ckpt.autoload import checkpoint_kind

    try:
        checkpoint_kind(path)
        return None
    except (FileNotFoundError, ValueError) as e:
        return str(e)


def translate(path: str, recipe: str = "pretrain") -> Translation:
    """The mff flags a MindFormers YAML stands for (see the module docstring): pretraining
    flags, or with ``recipe="finetune"`` the flags of ``mff.recipes.finetune`` (weights, LoRA and
    the fine-tuning data loader: :mod:`mff.recipes.mindformers_finetune`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not YAML or not a mapping; an unknown model type (names the keys read); an
            lr schedule, optimizer or dataset loader type mff cannot map (names the key and the
            supported types); a value of the wrong kind (names its dotted path).
    """
    if recipe not in ("pretrain", "finetune"):
        raise ValueError(f"recipe {recipe!r}; expected pretrain or finetune")
    t = _load(path)
    finetune = recipe == "finetune"
    flags: list[str] = []
    if finetune:
        from mff.recipes import mindformers_finetune as ft

        flags += ft.weights_flags(t, _loadable)
        if not flags:
            print(f"notice: {t.where} names no checkpoint mff can load here (load_checkpoint, pretrained_model_dir); pass --init-from",
                  file=sys.stderr)
        flags += ft.lora_flags(t)
        for key in ("model.model_config", "model.arch", "trainer.model_name"):
            t.skip(key, "the model config comes from the --init-from checkpoint")
        if t.get("run_mode", use=False) in ("finetune", "train"):
            t.used.add("run_mode")
        if not isinstance(t.get("train_dataset", use=False), dict):
            print(f"notice: {t.where} has no train_dataset; pass --data.path", file=sys.stderr)
    else:
        flags += _pretrain_model_flags(t)
        if t.get("run_mode", use=False) == "finetune":
            t.skip("run_mode", "a finetune YAML: run it with python -m mff.recipes.finetune --from-mindformers-yaml")
    _run_flags(t, flags, finetune)
    return Translation(flags, t.ignored())


def _pretrain_model_flags(t: _Tree) -> list[str]:
    """``--model FAMILY --size S --model.*`` from the YAML's model config (pretraining)."""
    flags: list[str] = []
    if not isinstance(t.get("model.model_config", use=False), dict) and not t.get("pretrained_model_dir", use=False):
        raise ValueError(f"{t.where}: no model.model_config mapping and no pretrained_model_dir; the YAML must describe the model")
    if not isinstance(t.get("train_dataset", use=False), dict) and not isinstance(t.get("train_dataset_task", use=False), dict):
        print(f"notice: {t.where} has no train_dataset; mff's default corpus is used unless --data.path is given", file=sys.stderr)
    hf_base = _pretrained_config(t)
    family = _family(t, hf_base)
    fam = FAMILIES[family]
    fields = {f.name for f in dataclasses.fields(fam.config_cls)}
    hf = _model_dict(t, fields, hf_base)
    try:
        cfg = fam.from_hf_config(hf)
        cfg.validate()
    except (ValueError, TypeError) as e:
        raise ValueError(f"{t.where}: model.model_config: {str(e).replace('config.json: ', '')}") from None
    flags += _model_flags(family, cfg, set(hf))
    for key, want in _FIXED.get(family, {}).items():
        for path in (f"model.model_config.{key}", key):
            got = t.get(path, use=False)
            if got == want:
                t.used.add(path)
            elif got is not None:
                t.skip(path, f"mff's {family} always uses {want}")
    return flags


def _run_flags(t: _Tree, flags: list[str], finetune: bool) -> None:
    """Append the run's flags (sequence, precision, batch and parallel sizes, optimizer, steps
    and schedule, data, folders) to ``flags``."""
    if t.get("trainer.type", use=False) == "CausalLanguageModelingTrainer":
        t.used.add("trainer.type")  # pretraining, what this recipe does

    # sequence length and precision
    seq_path, seq = t.first("model.model_config.seq_length", "train_dataset.data_loader.config.seq_length",
                            "train_dataset.dataloader.config.seq_length")
    if seq is not None:
        flags += ["--seq-len", str(_int(t, seq_path, seq))]
    for p in ("train_dataset.data_loader.config.seq_length", "train_dataset.dataloader.config.seq_length"):
        other = t.get(p, use=False)
        if other is not None and seq is not None:
            if other == seq:
                t.used.add(p)
            else:
                t.skip(p, f"differs from {seq_path} {seq}, which --seq-len takes")
    cpath, compute = t.first("model.model_config.compute_dtype")
    ppath, params = t.first("model.model_config.params_dtype", "model.model_config.param_init_type")
    if compute is not None or params is not None:
        bits_c = _DTYPES.get(str(compute or "float32").lower())
        bits_p = _DTYPES.get(str(params or "float32").lower())
        if bits_c is None or bits_p is None:
            bad = (cpath, compute) if bits_c is None else (ppath, params)
            raise t.error(bad[0], f"{bad[1]!r} is not a dtype mff knows (float32, bfloat16, float16)")
        flags += ["--precision", "bf16" if bits_p == 16 else "bf16-mixed" if bits_c == 16 else "fp32"]

    # batch sizes and parallel sizes
    bpath, bs = t.first("runner_config.batch_size", "train_dataset.batch_size")
    dp = _int(t, "parallel_config.data_parallel", t.get("parallel_config.data_parallel", 1))
    mbn = _int(t, "parallel_config.micro_batch_num", t.get("parallel_config.micro_batch_num", 1))
    gpath, gas = t.first("runner_config.gradient_accumulation_steps", "gradient_accumulation_steps", default=1)
    gas = _int(t, gpath or "runner_config.gradient_accumulation_steps", gas)
    global_batch = None
    if bs is not None:
        global_batch = _int(t, bpath, bs) * dp * mbn * gas
        flags += ["--batch-size", str(global_batch), "--grad-accum", str(mbn * gas)]
    # MindFormers carves expert_parallel out of data_parallel (devices = dp x mp x pp); in mff ep is
    # its own mesh axis whose ranks also read different tokens, so dp-shard (or dp-replicate) = dp / ep
    ep_raw = t.get("parallel_config.expert_parallel", use=False)
    ep = _int(t, "parallel_config.expert_parallel", ep_raw) if ep_raw is not None else 1
    if dp % ep:
        raise t.error("parallel_config.expert_parallel", f"{ep} does not divide parallel_config.data_parallel {dp} "
                      "(MindFormers takes the expert-parallel ranks out of the data-parallel ones)")
    if t.get("parallel_config.data_parallel", use=False) is not None:
        if t.get("parallel.enable_parallel_optimizer", True) is False:
            flags += ["--parallel.dp-replicate", str(dp // ep), "--parallel.dp-shard", "1"]
        else:
            flags += ["--parallel.dp-shard", str(dp // ep)]
    for key, name in (("model_parallel", "tp"), ("expert_parallel", "ep"), ("pipeline_stage", "pp"), ("context_parallel", "cp")):
        v = t.get(f"parallel_config.{key}")
        if v is not None:
            flags += [f"--parallel.{name}", str(_int(t, f"parallel_config.{key}", v))]

    # optimizer and clipping
    opt_type = t.get("optimizer.type")
    if opt_type is not None:
        if opt_type in _ADAMW:
            flags += ["--optim.name", "adamw"]
        elif str(opt_type).lower() == "muon":
            flags += ["--optim.name", "muon"]
        else:
            raise t.error("optimizer.type", f"{opt_type!r} is not supported; mff maps {', '.join(_ADAMW)} and Muon")
    betas = t.get("optimizer.betas")
    if betas is not None:
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise t.error("optimizer.betas", f"{betas!r} must be a list of two numbers")
        flags += ["--optim.beta1", repr(_number(t, "optimizer.betas", betas[0])), "--optim.beta2", repr(_number(t, "optimizer.betas", betas[1]))]
    for key, flag in (("eps", "--optim.eps"), ("weight_decay", "--optim.weight-decay")):
        v = t.get(f"optimizer.{key}")
        if v is not None:
            flags += [flag, repr(_number(t, f"optimizer.{key}", v))]
    clip = t.get("runner_wrapper.use_clip_grad")
    if clip is False:
        flags += ["--optim.max-grad-norm", "0"]
    elif t.get("runner_wrapper.max_grad_norm", use=False) is not None:
        flags += ["--optim.max-grad-norm", repr(_number(t, "runner_wrapper.max_grad_norm", t.get("runner_wrapper.max_grad_norm")))]

    # steps and lr schedule
    sched_root = "lr_schedule" if isinstance(t.get("lr_schedule", use=False), dict) else "lr_scheduler"
    steps = None
    total = t.get(f"{sched_root}.total_steps")
    if total is not None and total != -1:
        steps = _int(t, f"{sched_root}.total_steps", total)
    dl_path, dl = _data_loader(t)
    if steps is None and dl_path and isinstance(dl.get("sizes"), list) and dl["sizes"] and global_batch:
        steps = max(1, int(dl["sizes"][0]) // global_batch)
        t.used.add(f"{dl_path}.sizes")
    if steps is not None:
        flags += ["--steps", str(steps)]
    elif finetune and t.get("runner_config.epochs", use=False) is not None:
        flags += ["--epochs", repr(_number(t, "runner_config.epochs", t.get("runner_config.epochs")))]
        if total == -1:
            t.used.add(f"{sched_root}.total_steps")
    elif t.get("runner_config.epochs", use=False) is not None:
        t.skip("runner_config.epochs", "mff counts --steps; set lr_schedule.total_steps")
    sched = t.get(f"{sched_root}.type")
    if sched is None and isinstance(t.get(sched_root, use=False), dict):
        raise t.error(f"{sched_root}.type", f"is missing; mff maps {', '.join(_SCHEDULES)}")
    if sched is not None:
        if sched not in _SCHEDULES:
            raise t.error(f"{sched_root}.type", f"{sched!r} is not supported; mff maps {', '.join(_SCHEDULES)}")
        flags += ["--optim.schedule", _SCHEDULES[sched]]
    _, lr = t.first(f"{sched_root}.learning_rate", "optimizer.learning_rate")
    if lr is not None:
        lr = _number(t, f"{sched_root}.learning_rate", lr)
        flags += ["--optim.lr", repr(lr)]
    warm = t.get(f"{sched_root}.warmup_steps")
    ratio = t.get(f"{sched_root}.warmup_ratio")
    if warm is not None:
        flags += ["--optim.warmup-steps", str(_int(t, f"{sched_root}.warmup_steps", warm, low=0))]
    elif ratio is not None and finetune:
        flags += ["--warmup-ratio", repr(_number(t, f"{sched_root}.warmup_ratio", ratio))]
    elif ratio is not None:
        from mff.recipes.pretrain import PretrainConfig

        n = steps if steps is not None else PretrainConfig.__dataclass_fields__["steps"].default
        flags += ["--optim.warmup-steps", str(int(_number(t, f"{sched_root}.warmup_ratio", ratio) * n))]
    if sched in ("CosineWithWarmUpLR", "LinearWithWarmUpLR") and lr:  # MindFormers decays to lr_end (default 0)
        lr_end = t.get(f"{sched_root}.lr_end")
        flags += ["--optim.min-lr-ratio", repr((_number(t, f"{sched_root}.lr_end", lr_end) if lr_end is not None else 0.0) / lr)]
    if t.get(f"{sched_root}.warmup_lr_init", use=False) not in (None, 0, 0.0):
        t.skip(f"{sched_root}.warmup_lr_init", "mff warms up from lr / warmup-steps")

    # data
    seed_path, seed = t.first("seed")
    if dl_path:
        kind = dl.get("type")
        t.used.add(f"{dl_path}.type")
        if kind == "BlendedMegatronDatasetDataLoader":
            c = f"{dl_path}.config"
            data_path = t.get(f"{c}.data_path")
            if data_path is not None:
                items = data_path if isinstance(data_path, list) else str(data_path).split()
                flags += ["--data.path", *[str(x) for x in items]]
            split = t.get(f"{c}.split")
            if split is not None:
                flags += ["--data.split", ",".join(str(x).strip() for x in split) if isinstance(split, list) else str(split).replace(" ", "")]
            for key in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask"):
                v = t.get(f"{c}.{key}")
                if v is not None:
                    flags += [f"--data.{key.replace('_', '-')}" if v else f"--data.no-{key.replace('_', '-')}"]
            eod = t.get(f"{c}.eod")
            if eod is not None:
                flags += ["--data.eod-id", str(_int(t, f"{c}.eod", eod, low=0))]
            _, data_seed = t.first(f"{c}.seed", f"{c}.random_seed")
            if data_seed is not None:
                if seed is not None and seed != data_seed:
                    t.used.discard(seed_path)
                    t.skip(seed_path, f"mff has one --seed; the data seed {data_seed} is used so the samples are Megatron's")
                seed = data_seed
            if t.get(f"{dl_path}.datasets_type", use=False) == "GPTDataset":
                t.used.add(f"{dl_path}.datasets_type")
        elif kind == "HFDataLoader" and finetune:
            from mff.recipes import mindformers_finetune as ft

            flags += ft.hf_loader_flags(t, dl_path, dl, seq)
        elif kind == "MindDataset":
            d = t.get(f"{dl_path}.dataset_dir")
            if d is None:
                raise t.error(f"{dl_path}.dataset_dir", "a MindDataset needs dataset_dir (the .mindrecord file or folder)")
            flags += ["--data.path", str(d)]
        elif kind == "HFDataLoader":
            raise t.error(f"{dl_path}.type", "HFDataLoader is a fine-tuning loader: run the YAML with python -m mff.recipes.finetune")
        else:
            raise t.error(f"{dl_path}.type", f"{kind!r} is not supported; mff reads BlendedMegatronDatasetDataLoader (.bin/.idx) and "
                                             "MindDataset (MindRecord) data" + (", and HFDataLoader json files" if finetune else ""))
        sh = t.get(f"{dl_path}.shuffle")
        if sh is not None and not (finetune and kind == "HFDataLoader"):
            flags += ["--data.shuffle" if sh else "--data.no-shuffle"]
    if seed is not None:
        flags += ["--seed", str(_int(t, "seed", seed, low=0))]

    # run folders, initial weights, recomputation
    out = t.get("output_dir")
    if out:
        flags += ["--ckpt-dir", str(out)]
    ckpt = t.get("load_checkpoint", use=False)
    if ckpt and not finetune:  # (finetune: see mindformers_finetune.weights_flags)
        err = _loadable(str(ckpt))
        if err is None:
            t.used.add("load_checkpoint")
            flags += ["--init-from", str(ckpt)]
        else:
            t.skip("load_checkpoint", f"not loadable by --init-from here: {err}")
    if t.get("recompute_config.recompute"):
        flags += ["--ac", "full"]
    elif t.get("recompute_config.select_recompute"):
        flags += ["--ac", "selective"]


def _split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    rest, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == FLAG:
            if i + 1 >= len(argv):
                raise ValueError(f"{FLAG} needs a YAML path")
            path = argv[i + 1]
            i += 2
            continue
        if a.startswith(FLAG + "="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return path, rest


def expand_argv(argv: list[str], recipe: str = "pretrain") -> list[str]:
    """``argv`` with ``--from-mindformers-yaml PATH`` replaced by the flags PATH translates to,
    placed before the other flags so those win. Prints (rank 0) the mff command and the ignored
    YAML keys. ``argv`` without the flag comes back unchanged.

    Raises:
        FileNotFoundError, ValueError: see :func:`translate`; the flag without a path.
    """
    path, rest = _split_argv(list(argv))
    if path is None:
        return list(argv)
    tr = translate(path, recipe)
    new = tr.flags + rest
    if os.environ.get("RANK", "0") == "0":
        print("mff command: " + shlex.join(["python", "-m", f"mff.recipes.{recipe}", *new]), flush=True)
        print(f"ignored MindFormers keys ({len(tr.ignored)}):" + "".join(f"\n  {k}" for k in tr.ignored), flush=True)
    return new
