"""Qwen3 (`Qwen3ForCausalLM`): the Llama decoder with an RMSNorm over each head's queries and
keys before RoPE (`q_norm`, `k_norm`: weights [head_dim]), and no biases. Its sliding window is
Qwen2's: off in the released models, refused where a config turns it on."""

from __future__ import annotations

from .base import Family
from .llama import LlamaModel
from .qwen2 import adapt_config


class Qwen3Model(LlamaModel):
    qk_norm = True


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", Qwen3Model, gguf_permuted_qk=False,
               adapt_config=adapt_config)
