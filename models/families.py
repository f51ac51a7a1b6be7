"""The table of model families, keyed on HF `model_type`: a new family is its model file and a
line here (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

from tinyrt.errors import ModelFormatError

from .base import Family
from .llama import LLAMA, MISTRAL
from .gemma3 import GEMMA3
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen3 import QWEN3
from .smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, GEMMA3, PHI3, QWEN2, QWEN3, SMOLLM3)}


# vision-language checkpoints whose text part tinyrt runs (their weights: models.weights.TEXT_MODEL):
# model_type -> their `text_config`'s
MULTIMODAL = {"gemma3": "gemma3_text"}


def text_config(d: dict) -> dict:
    """The config dict of a vision-language checkpoint's text model (`d` itself for others):
    its `text_config`, with the token ids and settings the checkpoint gives outside it (which
    win: they are the checkpoint's, as its generation_config.json's)."""
    if not isinstance(d.get("model_type"), str) or d["model_type"] not in MULTIMODAL:
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"a {d['model_type']} config needs a text_config object")
    outer = {k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                               "tie_word_embeddings", "torch_dtype", "dtype",
                               "quantization_config") if k in d}
    return {**text, **outer, "model_type": MULTIMODAL[d["model_type"]]}


def family(model_type: str) -> Family:
    """The family of an HF `model_type`; a clear error for one tinyrt does not run."""
    if model_type not in FAMILIES:
        raise ModelFormatError(f"unsupported architecture {model_type!r}: tinyrt runs "
                               f"{', '.join(FAMILIES)} decoders (and the text part of "
                               f"{', '.join(MULTIMODAL)})")
    return FAMILIES[model_type]


def gguf_family(arch: str) -> Family:
    """The family of a GGUF file's `general.architecture`."""
    for f in FAMILIES.values():
        if (f.gguf_arch or f.model_type) == arch:
            return f
    raise ModelFormatError(f"unsupported architecture {arch!r} (tinyrt runs "
                           f"{', '.join(f.gguf_arch or f.model_type for f in FAMILIES.values())})")
