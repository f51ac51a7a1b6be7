"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with q, k and v in one fused
projection (`qkv_proj`) and gate and up in another (`gate_up_proj`, gate first), partial
rotary (`partial_rotary_factor`: Phi-4-mini rotates 3/4 of each head's dims), longrope scaling
(a divisor per frequency for short and for long contexts, and an attention factor), and, where
its config names one, a sliding window on every layer (Phi-3-mini's 2047)."""

from __future__ import annotations

from .base import Family
from .llama import GGUF_LAYER, LlamaModel

_SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
             "mlp.up_proj")


class Phi3Model(LlamaModel):
    linears = {"qkv": ("self_attn.qkv_proj",), "o": ("self_attn.o_proj",),
               "gate_up": ("mlp.gate_up_proj",), "down": ("mlp.down_proj",)}
    gguf_layer = {**{k: v for k, v in GGUF_LAYER.items() if k not in _SEPARATE},
                  "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def adapt_config(d: dict) -> dict:
    s = d.get("rope_scaling")
    if isinstance(s, dict) and (s.get("rope_type") or s.get("type")) == "su":
        d = {**d, "rope_scaling": {**s, "rope_type": "longrope"}}     # (longrope's first name)
    return d


PHI3 = Family("phi3", "Phi3ForCausalLM", Phi3Model, gguf_permuted_qk=False,
              adapt_config=adapt_config,
              gguf_config=lambda d, window: {**d, "sliding_window": window} if window else d)
