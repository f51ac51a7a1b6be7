"""The Llama / Mistral GQA decoder, written once against the backend ops.

Mistral is Llama with the same tensor names plus a sliding attention window (`sliding_window`).
The model returns logits; sampling lives in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyrt.errors import ModelFormatError

from .config import LlamaConfig
from .rope import rope_inv_freq
from .weights import WeightStore


@dataclass
class Layer:
    input_norm: Any      # [H]
    qkv: Any             # fused q|k|v projection: H -> Q*D + 2*G*D
    o: Any               # Q*D -> H
    post_norm: Any       # [H]
    gate_up: Any         # fused gate|up projection: H -> 2*I
    down: Any            # I -> H


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every float weight of the model."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (cfg.q_size, H),
            p + "self_attn.k_proj.weight": (cfg.kv_size, H),
            p + "self_attn.v_proj.weight": (cfg.kv_size, H),
            p + "self_attn.o_proj.weight": (H, cfg.q_size),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
    return shapes


class LlamaModel:
    """Decoder over a KV cache. `forward(tokens, cache)` appends the tokens to the cache and returns
    logits [T, V] (or [1, V] for the last token only)."""

    def __init__(self, config: LlamaConfig, weights: WeightStore, backend):
        self.config = cfg = config
        self.backend = be = backend
        shapes = expected_shapes(cfg)
        for name, shape in shapes.items():
            if name not in weights:
                raise ModelFormatError(f"{weights.directory}: tensor {name!r} is missing")
            if tuple(weights.shape(name)) != shape:
                raise ModelFormatError(
                    f"{weights.directory}: tensor {name!r} has shape {list(weights.shape(name))}, "
                    f"the config needs {list(shape)}")

        def w(name: str) -> np.ndarray:
            return weights.get_float(name)

        def lin(*names: str):
            return be.prepare_linear([w(n + ".weight") for n in names])

        self.embed = be.prepare_embedding(w("model.embed_tokens.weight"))
        self.lm_head = (be.prepare_linear([w("model.embed_tokens.weight")])
                        if cfg.tie_word_embeddings else lin("lm_head"))
        self.norm = be.prepare_vector(w("model.norm.weight"))
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            self.layers.append(Layer(
                input_norm=be.prepare_vector(w(f"model.layers.{i}.input_layernorm.weight")),
                qkv=lin(a + "q_proj", a + "k_proj", a + "v_proj"),
                o=lin(a + "o_proj"),
                post_norm=be.prepare_vector(w(f"model.layers.{i}.post_attention_layernorm.weight")),
                gate_up=lin(m + "gate_proj", m + "up_proj"),
                down=lin(m + "down_proj"),
            ))
        self.inv_freq = rope_inv_freq(cfg)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, tokens, cache, *, all_logits: bool = False):
        """Run `tokens` [T] through the decoder, appending their K/V to `cache`.

        The cache assigns each new token a slot and a position (the RoPE angle and the causal
        order); attention reads every slot the cache holds. Returns logits [T, V] if `all_logits`,
        else [1, V] for the last token.
        """
        cfg, be = self.config, self.backend
        tokens = np.asarray(tokens, dtype=np.int64)
        T, Q, G, D = len(tokens), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        slots, pos = cache.allocate(T)
        cos, sin = be.rope_tables(self.inv_freq, pos)
        k_pos = cache.slot_positions()
        x = be.embedding(self.embed, tokens)                               # [T, H]
        for i, L in enumerate(self.layers):
            h = be.rmsnorm(x, L.input_norm, cfg.rms_norm_eps)
            qkv = be.linear(h, L.qkv)                                      # [T, (Q+2G)*D]
            q = be.rope(qkv[:, :Q * D].reshape(T, Q, D), cos, sin)
            k = be.rope(qkv[:, Q * D:(Q + G) * D].reshape(T, G, D), cos, sin)
            v = qkv[:, (Q + G) * D:].reshape(T, G, D)
            k_buf, v_buf = cache.layer(i)
            be.store_kv(k_buf, v_buf, slots, k, v)
            n = len(k_pos)
            a = be.attention(q, k_buf[:, :n], v_buf[:, :n], pos, k_pos, self.scale,
                             cfg.sliding_window)                           # [T, Q, D]
            x = x + be.linear(a.reshape(T, Q * D), L.o)
            h = be.rmsnorm(x, L.post_norm, cfg.rms_norm_eps)
            gu = be.linear(h, L.gate_up)                                   # [T, 2I]
            I = gu.shape[1] // 2
            x = x + be.linear(be.silu_mul(gu[:, :I], gu[:, I:]), L.down)
        if not all_logits:
            x = x[-1:]
        return be.linear(be.rmsnorm(x, self.norm, cfg.rms_norm_eps), self.lm_head)
