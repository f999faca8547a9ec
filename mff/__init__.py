"""mff: train and serve MoE language models on Ascend NPU, CUDA and CPU with PyTorch.

Models are pure functions over param pytrees::

    import mff
    model = mff.build("deepseek3", size="tiny")
    params = model.init(seed=0)
    out = model.forward(params, {"input_ids": ids})   # ids: int64 [B, T]
    out.logits                                        # [B, T, vocab]

    model, params = mff.load("path/to/hf-folder")     # or an mff checkpoint, or a .gguf file
    model, params = mff.load("base", adapter="lora")  # a PEFT adapter or an mff LoRA run, merged
    mff.save_hf(model, params, "out/hf-folder")       # loads in transformers
    ids = mff.generate.generate(model, params, ids, max_new_tokens=32)  # KV-cache decoding
"""

from mff import generate, peft
from mff.ckpt.hf import save_hf
from mff.model import Model, Output
from mff.models import FAMILIES, build, get_family
from mff.peft.load import load_model as load

__version__ = "0.1.0"
__all__ = ["FAMILIES", "Model", "Output", "build", "generate", "get_family", "load", "peft", "save_hf", "__version__"]
