"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder in which some layers attend without
positions (NoPE: no RoPE on their q and k): those `no_rope_layers` marks 0, by default every
fourth (as llama.cpp runs it). Its sliding window is off in the released model and refused where
a config turns it on."""

from __future__ import annotations

from tinyrt.errors import ModelFormatError

from .base import Family
from .llama import LlamaModel


def adapt_config(d: dict) -> dict:
    if d.get("use_sliding_window"):
        raise ModelFormatError("SmolLM3 with use_sliding_window is not supported")
    if d.get("no_rope_layers") is None and d.get("no_rope_layer_interval") is None:
        d = {**d, "no_rope_layer_interval": 4}          # (HF's default, and llama.cpp's)
    return {**d, "sliding_window": None}


SMOLLM3 = Family("smollm3", "SmolLM3ForCausalLM", LlamaModel, adapt_config=adapt_config)
