"""The Llama decoder, written once against the backend ops; Mistral is the same decoder with a
sliding attention window (`sliding_window`), and other families (models/qwen2.py) derive from it.

The math of a decoder layer lives in `LlamaModel.layer` (and its two halves, `attention` and
`mlp`): the runtime runs it over the KV cache, the AWQ calibration over batches of sequences, and
a backend's fused layer (kernels/cpu/layer.py decode_layer) is tested against it for every family.
The model returns logits; sampling lives in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from tinyrt.errors import ModelFormatError
from tinyrt.kernels import QuantWeight, awq_layout

from .base import Family
from .rope import layer_inv_freqs, rotary_magnitude, rotary_order
from .weights import ModelWeights, release_pages

if TYPE_CHECKING:          # (config.py imports the families, this one among them)
    from .config import ModelConfig


@dataclass
class Layer:
    """One decoder layer's prepared weights (whatever the backend made of them)."""

    input_norm: Any      # [H]
    qkv: Any             # fused q|k|v projection: H -> Q*D + 2*G*D
    o: Any               # Q*D -> H
    post_norm: Any       # [H]
    gate_up: Any         # fused gate|up projection: H -> 2*I
    down: Any            # I -> H
    qkv_bias: Any = None  # [Q*D + 2*G*D] (a family with q/k/v biases), else None
    q_norm: Any = None   # [D]: an RMSNorm over each query head before RoPE (Qwen3), else None
    k_norm: Any = None   # [D]: the same over each key head
    attn_out_norm: Any = None   # [H]: an RMSNorm of the attention's output (Gemma 3), else None
    mlp_out_norm: Any = None    # [H]: the same of the MLP's output


# A model whose values overflow runs on to NaN or inf logits, which the sampler (or perplexity)
# reports in one line as a broken model; NumPy's warnings would add lines of their own.
_QUIET = {"over": "ignore", "invalid": "ignore", "divide": "ignore"}

# The tensor names, defined once. A layer's tensors, under `model.layers.N.` (HF) and `blk.N.`
# (GGUF): Layer field -> HF names it is made of (a fused projection lists its parts in order).
NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}      # [head_dim] each
LINEARS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
           "down": ("mlp.down_proj",)}
# HF name -> GGUF name: of a layer's modules, then of the model's own tensors
GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
               "lm_head": "output"}

# attend(q [T, Q, D], k [T, G, D], v [T, G, D]) -> [T, Q, D]: attention of the queries over the
# keys and values of everything before them (the KV cache, or the sequence itself)
Attend = Callable[[Any, Any, Any], Any]


def qkv_rows(cfg: ModelConfig, parts: list) -> list:
    """The parts of the fused q|k|v projection (float [out, in] arrays or QuantWeights, split
    along the output) with each q and k head's rows in rope.rotary_order, and the rotated ones
    times rope.rotary_magnitude (RoPE is linear: HF's scaled tables, folded into the weights);
    as they are where RoPE rotates every dim unscaled."""
    order, magnitude = rotary_order(cfg), rotary_magnitude(cfg)
    if order is None and magnitude == 1:
        return parts
    D, r = cfg.head_dim, cfg.rotary_dim
    order = np.arange(D) if order is None else order
    heads = cfg.num_attention_heads + cfg.num_key_value_heads
    index = np.concatenate([h * D + order for h in range(heads)]
                           + [heads * D + np.arange(cfg.kv_size)])
    factor = np.where(np.concatenate([order < r] * heads + [np.zeros(cfg.kv_size, bool)]),
                      np.float32(magnitude), np.float32(1))
    out, r0 = [], 0
    for w in parts:
        n = w.shape[0]
        idx, f = index[r0:r0 + n] - r0, factor[r0:r0 + n]
        if isinstance(w, QuantWeight):
            w = w.rows(idx)
            out.append(w if magnitude == 1 else w.scaled_rows(f))
        else:
            w = np.asarray(w)[idx]
            out.append(w if magnitude == 1 else (w * f[:, None]).astype(np.float32))
        r0 += n
    return out


class LlamaModel:
    """Decoder over a KV cache. `forward(tokens, cache)` appends the tokens to the cache and returns
    logits [T, V] (or [1, V] for the last token only)."""

    qkv_bias = False      # whether q, k and v have biases (Qwen2)
    qk_norm = False       # whether each head's q and k are RMS-normed before RoPE (Qwen3)
    linears = LINEARS     # its HF linear modules by Layer field (Phi-3: fused ones)
    norms = NORMS         # its HF norms by Layer field (Gemma 3: four)
    gguf_layer = GGUF_LAYER   # its HF module names -> llama.cpp's
    norm_shift = 0.0      # what its norms' stored weights are off by (Gemma: 1, for x * (1 + w))
    embed_scale = False   # whether embeddings are multiplied by sqrt(hidden) (Gemma)
    # whether `layer` is this pre-norm GQA / SwiGLU layer, the one a backend's decode_layer
    # fuses: a family that overrides the math says no
    fusable = True

    # -- the tensors ------------------------------------------------------------------------------

    @classmethod
    def linear_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """Decoder-layer linear name (HF, without .weight) -> (out, in)."""
        H, I, Qs, KVs = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
        # each field's parts (out sizes), or the whole as one fused module
        outs = {"qkv": (Qs, KVs, KVs), "o": (H,), "gate_up": (I, I), "down": (H,)}
        ins = {"qkv": H, "o": Qs, "gate_up": H, "down": I}
        dims = {}
        for f, names in cls.linears.items():
            sizes = outs[f] if len(names) == len(outs[f]) else (sum(outs[f]),)
            dims.update({n: (out, ins[f]) for n, out in zip(names, sizes)})
        return {f"model.layers.{i}.{n}": d for i in range(cfg.num_hidden_layers)
                for n, d in dims.items()}

    @classmethod
    def expected_shapes(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape of every tensor of the model (AWQ tensors when quantized)."""
        H, V = cfg.hidden_size, cfg.vocab_size
        shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, H)
        for i in range(cfg.num_hidden_layers):
            for n in cls.norms.values():
                shapes[f"model.layers.{i}.{n}.weight"] = (H,)
            for n in QK_NORMS.values() if cls.qk_norm else ():
                shapes[f"model.layers.{i}.{n}.weight"] = (cfg.head_dim,)
        q = cfg.quant
        for name, (out, inp) in cls.linear_shapes(cfg).items():
            if cls.qkv_bias and name.split(".", 3)[3] in cls.linears["qkv"]:
                shapes[name + ".bias"] = (out,)
            if q is None:
                shapes[name + ".weight"] = (out, inp)
                continue
            if inp % q.group_size or out % awq_layout.PACK:
                raise ModelFormatError(f"{name}: AWQ group size {q.group_size} does not divide its "
                                       f"{inp} inputs (or {out} outputs are not a multiple of 8)")
            for part, shape in awq_layout.shapes(inp, out, q.group_size).items():
                shapes[f"{name}.{part}"] = shape
        return shapes

    @classmethod
    def make_layer(cls, cfg: ModelConfig, i: int, backend, tensor: Callable[[str], np.ndarray],
                   linear: Callable[[str], Any]) -> Layer:
        """Layer i prepared by `backend` from `tensor(HF tensor name)` (a float array) and
        `linear(HF module name)` (a float weight [out, in] or a kernels.quant.QuantWeight)."""
        p = f"model.layers.{i}."

        def prepared(f: str):                  # (one projection's source in memory at a time)
            parts = [linear(p + n) for n in cls.linears[f]]
            return backend.prepare_linear(qkv_rows(cfg, parts) if f == "qkv" else parts)

        bias = None
        if cls.qkv_bias:
            bias = np.concatenate([np.asarray(tensor(p + n + ".bias"), np.float32)
                                   for n in cls.linears["qkv"]])
            bias = backend.prepare_vector(qkv_rows(cfg, [bias[:, None]])[0][:, 0])
        norms = {**cls.norms, **(QK_NORMS if cls.qk_norm else {})}
        return Layer(**{f: cls.prepare_norm(backend, tensor(p + n + ".weight"))
                        for f, n in norms.items()},
                     **{f: prepared(f) for f in cls.linears}, qkv_bias=bias)

    @classmethod
    def prepare_norm(cls, backend, w):
        """An RMSNorm's weight as the backend multiplies by it (Gemma's 1 + w, in float32 as HF
        adds it)."""
        w = np.asarray(w, np.float32)
        return backend.prepare_vector(w + np.float32(cls.norm_shift) if cls.norm_shift else w)

    def __init__(self, config: ModelConfig, weights: ModelWeights, backend):
        """The decoder of `config` on `backend`, its weights read from `weights` (checked against
        the config when they were opened: models.load_model)."""
        self.config = cfg = config
        self.backend = be = backend
        self.weights = weights
        self.embed = be.prepare_embedding(weights.embedding())
        self.lm_head = self._prepare_head(be, weights)
        self.norm = self.prepare_norm(be, weights.tensor("model.norm.weight"))
        self.layers = []
        # the file pages read while preparing each part leave the resident set at once, so that
        # the peak of a load stays close to what the prepared model holds
        weights.release()
        for i in range(cfg.num_hidden_layers):
            self.layers.append(self.make_layer(cfg, i, be, weights.tensor, weights.linear))
            weights.release()
        # each layer's RoPE frequencies; longrope: a pass whose last position lies past the
        # original context rotates by its long factors (HF's choice, made per forward pass)
        self.layer_freqs = layer_inv_freqs(cfg)
        self.layer_freqs_long = layer_inv_freqs(cfg, long=True) \
            if cfg.rope_type == "longrope" else None
        self.scale = cfg.attention_scale

    @staticmethod
    def _prepare_head(be, weights: ModelWeights):
        """The LM head on backend `be`: a quantized head as stored; a float head of a quantized
        model perhaps quantized by the backend (see its prepare_head). (A function of its own
        so that the source's copy is freed before the layers load.)"""
        return be.prepare_head(weights.head(), quantized=weights.quantized)

    # -- the math of a layer --------------------------------------------------------------------

    @staticmethod
    def attention(be, cfg: ModelConfig, L: Layer, h, cos, sin, attend: Attend):
        """The attention block of layer L for normed inputs h [T, H] (or [N, T, H]: N
        sequences) -> [T, H]."""
        lead, Q, G, D = h.shape[:-1], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = be.linear(h, L.qkv)                                          # [T, (Q+2G)*D]
        if L.qkv_bias is not None:
            qkv = qkv + L.qkv_bias
        q, k = qkv[..., :Q * D], qkv[..., Q * D:(Q + G) * D]
        if L.q_norm is not None:                  # per head: rows of D
            q = be.rmsnorm(q.reshape(-1, D), L.q_norm, cfg.rms_norm_eps)
            k = be.rmsnorm(k.reshape(-1, D), L.k_norm, cfg.rms_norm_eps)
        q = be.rope(q.reshape(*lead, Q, D), cos, sin)
        k = be.rope(k.reshape(*lead, G, D), cos, sin)
        v = qkv[..., (Q + G) * D:].reshape(*lead, G, D)
        return be.linear(attend(q, k, v).reshape(*lead, Q * D), L.o)

    @staticmethod
    def mlp(be, cfg: ModelConfig, L: Layer, h):
        """The gated MLP of layer L (SwiGLU; Gemma's GeGLU) for normed inputs h [T, H] -> [T, H]."""
        return be.linear(be.gated(h, L.gate_up, cfg.geglu), L.down)

    @classmethod
    def layer(cls, be, cfg: ModelConfig, L: Layer, x, cos, sin, attend: Attend):
        """Decoder layer L: x [T, H] -> [T, H], pre-norm residual blocks (Gemma's outputs
        normed too)."""
        eps = cfg.rms_norm_eps
        a = cls.attention(be, cfg, L, be.rmsnorm(x, L.input_norm, eps), cos, sin, attend)
        x = x + (a if L.attn_out_norm is None else be.rmsnorm(a, L.attn_out_norm, eps))
        m = cls.mlp(be, cfg, L, be.rmsnorm(x, L.post_norm, eps))
        return x + (m if L.mlp_out_norm is None else be.rmsnorm(m, L.mlp_out_norm, eps))

    # -- over the KV cache ------------------------------------------------------------------------

    def forward(self, tokens, cache, *, all_logits: bool = False):
        """Run `tokens` [T] through the decoder, appending their K/V to `cache`.

        Returns logits [T, V] if `all_logits`, else [1, V] for the last token.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        out, step = [], min(cache.chunk, self.backend.pass_tokens or cache.chunk)
        # more tokens than one pass may append (or the backend takes) go in chunks, the
        # cache's policy applied between
        for c in range(0, max(len(tokens), 1), step):
            h = self.hidden_states(tokens[c:c + step], cache)
            if all_logits:
                out.append(self.logits(h))
        if not all_logits:
            return self.logits(h[-1:])
        return out[0] if len(out) == 1 else np.concatenate([self.backend.to_numpy(o) for o in out])

    def logits(self, h):
        """Final hidden states [T, H] -> logits [T, V]."""
        with np.errstate(**_QUIET):
            return self.backend.linear(h, self.lm_head)

    def hidden_states(self, tokens, cache):
        """The final (normed) hidden states [T, H] of `tokens`, their K/V appended to `cache`.

        The cache assigns each new token a position (the RoPE angle and the causal order) and,
        in each layer and KV head, a slot; attention reads every slot the cache holds (and adds
        its weights to the cache's scores, for a policy that keeps them).
        """
        with np.errstate(**_QUIET):
            return self._hidden_states(tokens, cache)

    def _hidden_states(self, tokens, cache):
        cfg, be = self.config, self.backend
        tokens = np.asarray(tokens, dtype=np.int64)
        pos = cache.allocate(len(tokens))
        tables = self.rope_tables(pos)
        x = self.embed_tokens(tokens)                                      # [T, H]
        # a table used as stored, mapped from the file, is read a few rows per token: its rows
        # leave the resident set at once, or RSS would creep up as new tokens appear
        release_pages(self.embed)
        for i, (L, (c, s)) in enumerate(zip(self.layers, tables)):
            kv, window = cache.layer(i), cfg.window(i)
            if self.fusable and be.fused_decode(L, len(tokens)):   # its ops in one call
                x = be.decode_layer(x, L, kv, pos, c, s, cfg, window)
            else:
                x = self.layer(be, cfg, L, x, c, s, self._attend(kv, pos, window))
        return be.rmsnorm(x, self.norm, cfg.rms_norm_eps)


    def embed_tokens(self, tokens):
        """The embeddings [T, H] of token ids [T] (Gemma's times sqrt(hidden), in float32)."""
        x = self.backend.embedding(self.embed, tokens)
        return x * float(np.float32(self.config.hidden_size ** 0.5)) if self.embed_scale else x

    def rope_tables(self, pos: np.ndarray) -> list:
        """Each layer's (cos, sin) for a pass over positions `pos` (one table per distinct set
        of frequencies)."""
        freqs = self.layer_freqs
        if self.layer_freqs_long is not None and len(pos) and \
                int(pos.max()) + 1 > self.config.longrope_original:
            freqs = self.layer_freqs_long
        made = {}
        for f in freqs:
            if id(f) not in made:
                made[id(f)] = self.backend.rope_tables(f, pos)
        return [made[id(f)] for f in freqs]

    def decode_layers(self, x, attends: list):
        """An embedded token x [1, H] through every layer, the final norm and the head ->
        logits [1, V]: the step tinyrt.device_decode runs on the CUDA backend, its cache
        bookkeeping its own. `layer`'s math in fewer launches: each RMSNorm in the projection
        after it (norm_linear), each residual add in the projection before it (linear_add),
        the gated MLP's activation in its gate|up projection, and attends[i](qkv, L) layer i's
        attention from its q|k|v projection's output, bias, q/k norms, RoPE and the store into
        the cache included (rope_store)."""
        cfg, be, eps = self.config, self.backend, self.config.rms_norm_eps
        act = "gelu" if cfg.geglu else "silu"
        for L, attend in zip(self.layers, attends):
            a = attend(be.norm_linear(x, L.input_norm, eps, L.qkv), L).reshape(1, -1)
            x = self._residual(be, x, a, L.o, L.attn_out_norm, eps)
            m = be.norm_linear(x, L.post_norm, eps, L.gate_up, act)
            x = self._residual(be, x, m, L.down, L.mlp_out_norm, eps)
        with np.errstate(**_QUIET):
            return be.norm_linear(x, self.norm, eps, self.lm_head)

    @staticmethod
    def _residual(be, x, h, w, out_norm, eps):
        """x + h @ W.T in one launch (Gemma's product RMS-normed before the add), a new array."""
        if out_norm is None:
            return be.linear_add(h, w, x)
        return x + be.rmsnorm(be.linear(h, w), out_norm, eps)

    def _attend(self, kv, pos, window: int | None) -> Attend:
        """Attention over the cache layer `kv`, the new tokens (at positions `pos`) stored first."""
        be = self.backend

        def attend(q, k, v):
            be.store_kv(kv.k, kv.v, kv.slots, k, v)
            return be.attention(q, kv.k, kv.v, pos, kv.k_pos, self.scale, window, kv.score)
        return attend


def gguf_config(d: dict, window: int | None) -> dict:
    # llama.cpp writes Mistral's files as "llama": its sliding window tells them apart
    if window:
        return {**d, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding_window": window}
    return d


LLAMA = Family("llama", "LlamaForCausalLM", LlamaModel, gguf_config=gguf_config)
MISTRAL = Family("mistral", "MistralForCausalLM", LlamaModel, gguf_config=gguf_config)

