"""The Llama / Mistral GQA decoder, written once against the backend ops.

Mistral is Llama with the same tensor names plus a sliding attention window (`sliding_window`).
The model returns logits; sampling lives in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tinyrt.errors import ModelFormatError
from tinyrt.kernels import QuantizedLinear

from .config import LlamaConfig
from .rope import rope_inv_freq
from .weights import WeightStore, release_pages


@dataclass
class Layer:
    input_norm: Any      # [H]
    qkv: Any             # fused q|k|v projection: H -> Q*D + 2*G*D
    o: Any               # Q*D -> H
    post_norm: Any       # [H]
    gate_up: Any         # fused gate|up projection: H -> 2*I
    down: Any            # I -> H


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """Decoder-layer linear name (HF, without .weight) -> (out, in)."""
    H, I, Qs, KVs = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    dims = dict(zip(LINEARS, [(Qs, H), (KVs, H), (KVs, H), (H, Qs), (I, H), (I, H), (H, I)]))
    return {f"model.layers.{i}.{n}": d for i in range(cfg.num_hidden_layers) for n, d in dims.items()}


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor of the model (AWQ tensors when quantized)."""
    from tinyrt.kernels import awq_layout

    H, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (H,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (H,)
    q = cfg.quant
    for name, (out, inp) in linear_shapes(cfg).items():
        if q is None:
            shapes[name + ".weight"] = (out, inp)
            continue
        if inp % q.group_size or out % awq_layout.PACK:
            raise ModelFormatError(f"{name}: AWQ group size {q.group_size} does not divide its "
                                   f"{inp} inputs (or {out} outputs are not a multiple of 8)")
        for part, shape in awq_layout.shapes(inp, out, q.group_size).items():
            shapes[f"{name}.{part}"] = shape
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
            if cfg.quant is None:
                return be.prepare_linear([w(n + ".weight") for n in names])
            return be.prepare_linear([QuantizedLinear(weights.get(n + ".qweight"), weights.get(n + ".qzeros"),
                                                      weights.get(n + ".scales")) for n in names])

        self.embed = be.prepare_embedding(w("model.embed_tokens.weight"))
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        # float in AWQ checkpoints; a backend may quantize it when the rest of the model is quantized
        self.lm_head = be.prepare_head(w(head), quantized=cfg.quant is not None)
        self.norm = be.prepare_vector(w("model.norm.weight"))
        self.layers = []
        # the file pages read while preparing each part leave the resident set at once, so that
        # the peak of a load stays close to what the prepared model holds
        weights.release()
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
            weights.release()
        self.inv_freq = rope_inv_freq(cfg)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, tokens, cache, *, all_logits: bool = False):
        """Run `tokens` [T] through the decoder, appending their K/V to `cache`.

        Returns logits [T, V] if `all_logits`, else [1, V] for the last token.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        out, step = [], cache.chunk
        # more tokens than one pass may append go in chunks, the cache's policy applied between
        for c in range(0, max(len(tokens), 1), step):
            h = self.hidden_states(tokens[c:c + step], cache)
            if all_logits:
                out.append(self.logits(h))
        if not all_logits:
            return self.logits(h[-1:])
        return out[0] if len(out) == 1 else np.concatenate([self.backend.to_numpy(o) for o in out])

    def logits(self, h):
        """Final hidden states [T, H] -> logits [T, V]."""
        return self.backend.linear(h, self.lm_head)

    def hidden_states(self, tokens, cache):
        """The final (normed) hidden states [T, H] of `tokens`, their K/V appended to `cache`.

        The cache assigns each new token a position (the RoPE angle and the causal order) and,
        in each layer and KV head, a slot; attention reads every slot the cache holds (and adds
        its weights to the cache's scores, for a policy that keeps them).
        """
        cfg, be = self.config, self.backend
        tokens = np.asarray(tokens, dtype=np.int64)
        T, Q, G, D = len(tokens), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        pos = cache.allocate(T)
        if cache.n_sink and cache.sink_shift != cache.rotated_shift:
            self._rotate_sinks(cache)
        cos, sin = be.rope_tables(self.inv_freq, pos)
        x = be.embedding(self.embed, tokens)                               # [T, H]
        # a table used as stored, mapped from the file, is read a few rows per token: its rows
        # leave the resident set at once, or RSS would creep up as new tokens appear
        release_pages(self.embed)
        for i, L in enumerate(self.layers):
            # buffers [G, C, D], new tokens' slots [G, T], slot positions [G, S], scores or None
            k_buf, v_buf, slots, k_pos, score = cache.layer(i)
            if be.fused_decode(L, T):              # the same ops, in one call (the backend's)
                x = be.decode_layer(x, L, k_buf, v_buf, slots, pos, k_pos, score, cos, sin,
                                    eps=cfg.rms_norm_eps, n_heads=Q, scale=self.scale,
                                    window=cfg.sliding_window)
                continue
            h = be.rmsnorm(x, L.input_norm, cfg.rms_norm_eps)
            qkv = be.linear(h, L.qkv)                                      # [T, (Q+2G)*D]
            q = be.rope(qkv[:, :Q * D].reshape(T, Q, D), cos, sin)
            k = be.rope(qkv[:, Q * D:(Q + G) * D].reshape(T, G, D), cos, sin)
            v = qkv[:, (Q + G) * D:].reshape(T, G, D)
            be.store_kv(k_buf, v_buf, slots, k, v)
            a = be.attention(q, k_buf, v_buf, pos, k_pos, self.scale,
                             cfg.sliding_window, score)                    # [T, Q, D]
            x = x + be.linear(a.reshape(T, Q * D), L.o)
            h = be.rmsnorm(x, L.post_norm, cfg.rms_norm_eps)
            gu = be.linear(h, L.gate_up)                                   # [T, 2I]
            x = x + be.linear(be.swiglu(gu), L.down)
        return be.rmsnorm(x, self.norm, cfg.rms_norm_eps)

    def _rotate_sinks(self, cache) -> None:
        """Rotate the attention sinks' cached keys to positions i + cache.sink_shift (see
        kv_cache.SinkCache), from float32 copies of their un-rotated keys and of their values,
        taken the first time from the cache itself (sink i still rotated by its own position i
        then). All layers at once: their KV heads side by side, one RoPE and one store."""
        be, n = self.backend, cache.n_sink
        L, G, C, D = cache.k.shape
        k_buf, v_buf = cache.k.reshape(L * G, C, D), cache.v.reshape(L * G, C, D)
        if cache.sink_keys is None:
            cos, sin = be.rope_tables(self.inv_freq, np.arange(n))
            cache.sink_keys = be.rope(_rows(be, k_buf[:, :n]), cos, -sin)     # [n, L*G, D]
            cache.sink_values = _rows(be, v_buf[:, :n])
        cos, sin = be.rope_tables(self.inv_freq, np.arange(n) + cache.sink_shift)
        slots = np.tile(np.arange(n), (L * G, 1))                               # [L*G, n]
        be.store_kv(k_buf, v_buf, slots, be.rope(cache.sink_keys, cos, sin), cache.sink_values)
        cache.rotated_shift = cache.sink_shift


def _rows(backend, buf) -> np.ndarray:
    """Cache buffer rows [G, n, D] as float32 [n, G, D]."""
    return np.ascontiguousarray(backend.to_numpy(buf).astype(np.float32).transpose(1, 0, 2))
