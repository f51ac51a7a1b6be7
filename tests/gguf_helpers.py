"""Writing tiny GGUF files the way llama.cpp's converter does (Q/K rows permuted, llama metadata),
with the `gguf` package's writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tinyrt.models.llama import GGUF_GLOBAL, GGUF_LAYER

# f16 fields of each K-quant block (byte offsets), which must hold finite values
KQUANT_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}

def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reordering of Q/K rows (rotate-half -> interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf: str) -> str:
    if hf == "rope_freqs.weight":
        return hf
    module, kind = hf.rsplit(".", 1)
    if module in GGUF_GLOBAL:
        return f"{GGUF_GLOBAL[module]}.{kind}"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{GGUF_LAYER[rest]}.{kind}"


def random_kquant(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random but valid K-quant blocks (the gguf package cannot quantize K-quants)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in KQUANT_HALVES[qtype]:
        halves = (rng.uniform(0.002, 0.02, n_blocks)).astype(np.float16)
        raw[:, off:off + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path: Path, cfg: dict, weights: dict, tokenizer_json: str | None, *,
               qtype: str = "F32", chat_template: str | None = None, pre: str = "default",
               kquant_rng=None, arch: str = "llama", metadata: dict | None = None) -> dict:
    """Write `weights` (HF names/layout) as a GGUF of `arch` (llama: Q/K rows permuted as
    llama.cpp's converter does; qwen2: not). 2-D weights are stored as `qtype`; norms and
    biases as F32; `metadata` keys added as float32 or int32 values. Returns the float weights
    as llama.cpp would read them back (HF layout)."""
    import json

    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    w = gguf.GGUFWriter(str(path), arch)
    permuted = arch == "llama"
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(1)
    if tokenizer_json is not None:
        tj = json.loads(tokenizer_json)
        vocab = tj["model"]["vocab"]
        tokens = [None] * cfg["vocab_size"]
        for t, i in vocab.items():
            tokens[i] = t
        types = [1] * cfg["vocab_size"]
        for a in tj["added_tokens"]:
            tokens[a["id"]], types[a["id"]] = a["content"], 3
        for i, t in enumerate(tokens):
            if t is None:
                tokens[i], types[i] = f"[PAD{i}]", 5
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)
    back = {}
    for name, a in weights.items():
        a = a.astype(np.float32)
        if permuted and name.endswith("q_proj.weight"):
            a = permute(a, cfg["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            a = permute(a, cfg["num_key_value_heads"])
        if a.ndim == 1 or qtype == "F32":
            stored, kind = a, Q.F32
        elif qtype in KQUANT_HALVES:
            kind = Q[qtype]
            stored = random_kquant(qtype, a.shape[0], a.shape[1], kquant_rng)
        else:
            kind = Q[qtype]
            stored = quantize(a, kind)
        w.add_tensor(gguf_name(name), stored, raw_dtype=kind)
        deq = a if kind == Q.F32 else dequantize(stored, kind).reshape(a.shape)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            deq = deq[np.argsort(permute(np.arange(a.shape[0])[:, None], heads)[:, 0])]
        back[name] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return back
