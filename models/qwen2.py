"""Qwen2 (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): the Llama decoder with biases on q, k and v.

Its config names a `sliding_window` that only `use_sliding_window` turns on (for the layers from
`max_window_layers` on); the released models leave it off, and so does tinyrt: a model that
turns it on is refused rather than run with the wrong attention.
"""

from __future__ import annotations

from tinyrt.errors import ModelFormatError

from .base import Family
from .llama import LlamaModel


class Qwen2Model(LlamaModel):
    qkv_bias = True


def adapt_config(d: dict) -> dict:
    if d.get("use_sliding_window"):
        raise ModelFormatError("Qwen2 with use_sliding_window (a window on some "
                               "layers only) is not supported")
    return {**d, "sliding_window": None}


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", Qwen2Model, gguf_permuted_qk=False,
               adapt_config=adapt_config)
