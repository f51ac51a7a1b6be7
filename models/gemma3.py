"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text): the Llama decoder with sliding and
global layers (`layer_types`: 5 of each 6 attend within `sliding_window`, with their own RoPE
base `rope_local_base_freq`), q/k norms, norms of the attention's and the MLP's outputs before
the residual adds (four norms a layer), norms that multiply by 1 + w, GeGLU (GELU's tanh form),
attention scaled by `query_pre_attn_scalar`, embeddings times sqrt(hidden), a tied head."""

from __future__ import annotations

from tinyrt.errors import ModelFormatError

from .base import Family
from .llama import GGUF_LAYER, LlamaModel

MAX_LAYERS = 1 << 16     # a layer_types list is built for the layers: no real model comes near


class Gemma3Model(LlamaModel):
    qk_norm = True
    norms = {"input_norm": "input_layernorm", "post_norm": "pre_feedforward_layernorm",
             "attn_out_norm": "post_attention_layernorm",
             "mlp_out_norm": "post_feedforward_layernorm"}
    gguf_layer = {**GGUF_LAYER, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}
    norm_shift = 1.0
    embed_scale = True


def layer_types(n_layers, pattern) -> list[str] | None:
    """Gemma's default kinds of layer: every `pattern`-th global, the rest sliding."""
    if not isinstance(n_layers, int) or not 0 < n_layers <= MAX_LAYERS or \
            not isinstance(pattern, int) or pattern < 1:
        return None           # (the config's checks say what is wrong)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)]


# what transformers' Gemma3TextConfig takes for a key its config.json leaves out (the text
# configs inside Gemma 3's vision-language checkpoints leave out most)
DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=4096,
                hidden_act="gelu_pytorch_tanh")


def adapt_config(d: dict) -> dict:
    d = {**DEFAULTS, **d}
    if d.get("use_bidirectional_attention"):
        raise ModelFormatError("Gemma 3 with use_bidirectional_attention is not supported")
    if "hidden_activation" in d:
        d["hidden_act"] = d.pop("hidden_activation")
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:     # transformers 5: per kind
        d.pop("rope_parameters")
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ModelFormatError("rope_parameters must give an object for each kind of layer")
        d.setdefault("rope_theta", full.get("rope_theta", 1_000_000.0))
        if full.get("rope_type", "default") != "default":
            d.setdefault("rope_scaling", {k: v for k, v in full.items() if k != "rope_theta"})
        d.setdefault("rope_local_base_freq", local.get("rope_theta", 10_000.0))
    d.setdefault("rope_local_base_freq", 10_000.0)
    d.setdefault("rope_theta", 1_000_000.0)
    d.setdefault("query_pre_attn_scalar", 256)
    d.setdefault("tie_word_embeddings", True)
    if d.get("layer_types") is None and d.get("sliding_window") is not None:
        d["layer_types"] = layer_types(d.get("num_hidden_layers"),
                                       d.get("sliding_window_pattern", 6))
    return d


def gguf_config(d: dict, window: int | None) -> dict:
    # what llama.cpp's Gemma 3 fixes rather than reads: the activation, attention scaled by
    # head_dim ** -0.5, the sliding layers' RoPE base (its layer pattern: adapt_config's default)
    return {**d, "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": d["head_dim"],
            "rope_local_base_freq": 10_000.0, "sliding_window": window}


GEMMA3 = Family("gemma3_text", "Gemma3ForCausalLM", Gemma3Model, gguf_arch="gemma3",
                gguf_permuted_qk=False, adapt_config=adapt_config, gguf_config=gguf_config)
