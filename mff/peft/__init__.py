"""LoRA fine-tuning: adapters as a param pytree beside frozen base params.

::

    model, params = mff.load("path/to/hf-folder")
    lora_model = mff.peft.add_lora(model, r=16, alpha=32)           # targets: every projection
    adapters = mff.peft.init_adapters(lora_model, seed=0)            # B = 0: equals the base model
    out = lora_model.forward({**params, **adapters}, batch)
    merged = mff.peft.merge(lora_model, params, adapters)            # runs on `model`
    mff.peft.save_peft(lora_model, adapters, "out/adapter")         # PeftModel.from_pretrained reads it
    spec, adapters = mff.peft.read_peft("out/adapter", model)       # and back

Adapter paths are the adapted weight's path + ``.lora_A`` / ``.lora_B`` (see :mod:`mff.nn.lora`).
"""

from mff.peft.adapters import adapter_placements, adapter_sharding_table, add_lora, init_adapters, lora_spec, merge, split_params, unmerge
from mff.peft.config import LoraConfig
from mff.peft.peft_format import PeftFormatError, is_peft_folder, read_peft, save_peft
from mff.peft.targets import candidate_weights, resolve_targets

__all__ = [
    "LoraConfig", "PeftFormatError", "add_lora", "adapter_placements", "adapter_sharding_table", "candidate_weights", "init_adapters",
    "is_peft_folder", "lora_spec", "merge", "read_peft", "resolve_targets", "save_peft", "split_params", "unmerge",
]
