"""The GGUF files of the GGUF benchmark (benchmarks/gguf_peers.py), made here (not in CI):

    smollm2-q4km     the default model's Q4_1 GGUF requantized by llama.cpp to Q4_K_M
                     (its rows, 576, are not a multiple of 256: llama.cpp falls back to Q5_0/Q8_0
                     for most tensors)
    tinyllama-f16    a random-weight float16 GGUF of TinyLlama-1.1B's shape (llama, hidden 2048,
                     22 layers, 32 heads, 4 KV heads, FFN 5632, untied head, rope theta 1e4,
                     RMS eps 1e-5, context 2048) with the default model's tokenizer (vocab 49152),
                     written tensor by tensor (~2.3 GB on disk, one tensor in memory at a time)
    tinyllama-q4km   its Q4_K_M (rows a multiple of 256: Q4_K with Q6_K for some tensors)
    tinyllama-q4_0   its Q4_0
    llama3b-f16, llama3b-q4km, llama3b-q4_0   the same for Llama-3.2-3B's shape (hidden 3072,
                     28 layers, 24 heads, 8 KV heads, FFN 8192, rope theta 5e5; its head untied
                     here), ~6.4 GB in float16
    llama7b-f16, llama7b-q4km, llama7b-q4_0   the same for Llama-2-7B's shape (hidden 4096,
                     32 layers, 32 heads and KV heads, FFN 11008), ~13.7 GB in float16
    qwen3-f16, qwen3-q4km, gemma3-f16, gemma3-q4km, phi4mini-f16, phi4mini-q4km
                     random-weight models of Qwen3-1.7B's, Gemma-3-1B's and Phi-4-mini's shapes
                     (their config.json's values, their vocabulary sizes: the default model's
                     tokenizer padded with unused tokens), written as HF checkpoints (float16,
                     streamed) and converted by llama.cpp's own convert_hf_to_gguf.py (from
                     the llama-cpp-python sdist, tests/llama_cpp_files.py), so that their
                     metadata and tensor layout are llama.cpp's; then its Q4_K_M
    {shape}-rtn      tinyrt's own model directory of the shape's float file, round-to-nearest
                     4-bit in groups of 128 (`tinyrt convert F16 DIR --method rtn --group-size
                     128`), for gguf_peers.py --model-dir

    python benchmarks/make_ggufs.py                        # the default model's and TinyLlama's
    python benchmarks/make_ggufs.py --out DIR tinyllama-f16 tinyllama-q4km
    python benchmarks/make_ggufs.py llama7b-q4_0           # the float file first, then its Q4_0
    python benchmarks/make_ggufs.py --types FILE.gguf ...  # tensor types per tensor kind

Files: DIR/smollm2-135m.Q4_K_M.gguf, DIR/{tinyllama,llama3b,llama7b}-shape.{f16,Q4_K_M,Q4_0}.gguf,
DIR/{qwen3,gemma3,phi4mini}-shape.{f16,Q4_K_M}.gguf and the directories DIR/{shape}-shape.rtn-g128.
All use the default model's tokenizer (vocab 49152), so that both engines tokenize alike. A file
that exists is kept (--force remakes it). The random weights are N(0, 0.02) (the output projections, attn_output
and ffn_down, 0.02 / sqrt(2 * layers), as GPT-2 initializes them), norms 1 + N(0, 0.02), the same
for a given --seed. Quantization is llama.cpp's own (`llama_cpp.llama_model_quantize` with the
default parameters, allow_requantize on), so it needs `pip install llama-cpp-python gguf`.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path("/tmp/bench_gguf")
SMOLLM2_Q4KM = "smollm2-135m.Q4_K_M.gguf"
SHAPED = "{}-shape.{}.gguf"        # shape name, file type
SHAPED_RTN = "{}-shape.rtn-g128"   # tinyrt's own RTN model directory of the shape's float file

# real models' shapes (from their config.json), with the default model's vocabulary so that
# llama.cpp and tinyrt tokenize the same text the same way
SHAPES = {
    "tinyllama": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, context=2048,
                      rope_theta=10000.0, rms_eps=1e-5),          # TinyLlama-1.1B
    "llama3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, context=8192,
                    rope_theta=500000.0, rms_eps=1e-5),          # Llama-3.2-3B
    "llama7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, context=4096,
                    rope_theta=10000.0, rms_eps=1e-5),           # Llama-2-7B
}
QUANT_TYPES = {"q4km": ("Q4_K_M", "MOSTLY_Q4_K_M"), "q4_0": ("Q4_0", "MOSTLY_Q4_0")}


def default_gguf() -> Path:
    """The default model's GGUF (Q4_1 linears, Q8_0 token_embd), fetched if it is not cached."""
    from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf

    return Path(fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], quiet=True))


def quantize(src: Path, dst: Path, ftype: str, threads: int = 0) -> None:
    """llama.cpp's quantizer: `src` to `dst` as llama_cpp.LLAMA_FTYPE_<ftype> (e.g. MOSTLY_Q4_K_M),
    its default parameters, requantizing a quantized source."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    tmp.rename(dst)


def tokenizer_fields(src: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, array element type) of every tokenizer.* field of a GGUF file."""
    from gguf import GGUFReader, GGUFValueType

    out = []
    for key, f in GGUFReader(str(src)).fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def random_weight(seed: int, i: int, shape: tuple, std: float | None,
                  norm_center: float = 1.0) -> np.ndarray:
    """Tensor i of a random model, float32: normal with deviation `std`, or for a norm (std
    None) norm_center + 0.02 N (Gemma's norms scale by 1 + w: center 0). Seeded by (seed, i),
    so one tensor is made at a time."""
    x = np.random.default_rng([seed, i]).standard_normal(shape, dtype=np.float32)
    if std is None:
        return norm_center + 0.02 * x
    x *= std
    return x


def write_random_llama(dst: Path, tokenizer_src: Path, seed: int = 0, *, name: str, hidden: int,
                       layers: int, heads: int, kv_heads: int, ffn: int, context: int,
                       rope_theta: float, rms_eps: float) -> None:
    """A float16 GGUF of a Llama of this shape with random weights (1-D tensors float32) and the
    tokenizer of `tokenizer_src`, streamed: each tensor is made, written and dropped in turn."""
    import gguf

    tok = tokenizer_fields(tokenizer_src)
    vocab = next(len(v) for k, v, _, _ in tok if k == "tokenizer.ggml.tokens")
    head_dim = hidden // heads
    std, out_std = 0.02, 0.02 / np.sqrt(2 * layers)
    # (name, numpy shape [rows = outputs, cols = inputs], std; None: a norm)
    tensors = [("token_embd.weight", (vocab, hidden), std)]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (hidden,), None),
                    (b + "attn_q.weight", (heads * head_dim, hidden), std),
                    (b + "attn_k.weight", (kv_heads * head_dim, hidden), std),
                    (b + "attn_v.weight", (kv_heads * head_dim, hidden), std),
                    (b + "attn_output.weight", (hidden, heads * head_dim), out_std),
                    (b + "ffn_norm.weight", (hidden,), None),
                    (b + "ffn_gate.weight", (ffn, hidden), std),
                    (b + "ffn_up.weight", (ffn, hidden), std),
                    (b + "ffn_down.weight", (hidden, ffn), out_std)]
    tensors += [("output_norm.weight", (hidden,), None), ("output.weight", (vocab, hidden), std)]

    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch="llama")
    w.add_name(f"{name}-shape random f16")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(vocab)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    for name, shape, _ in tensors:
        dtype = np.float32 if len(shape) == 1 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shape, dev) in enumerate(tensors):
        x = random_weight(seed, i, shape, dev)
        w.write_tensor_data(x if dev is None else x.astype(np.float16))
        del x
    w.close()
    tmp.rename(dst)


# families beside Llama, at real models' shapes (their config.json's values, the Phi-4-mini
# longrope factors made up: they change angles, not work), with the default model's tokenizer
# (its pre-tokenizer, bos and eos; padded with unused tokens to their vocabulary sizes)
FAMILY_SHAPES = {
    "qwen3": dict(                                              # Qwen3-1.7B
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=True),
    "gemma3": dict(                                           # Gemma-3-1B
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=512,
        query_pre_attn_scalar=256, tie_word_embeddings=True, pad_token_id=0,
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "phi4mini": dict(                                          # Phi-4-mini
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=262144,
        tie_word_embeddings=True, pad_token_id=0,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [round(1 + 0.2 * i / 47, 4) for i in range(48)],
                      "long_factor": [round(40 ** (i / 47), 4) for i in range(48)]}),
}


def write_random_hf(dst: Path, tokenizer_src: Path, config: dict, seed: int = 0) -> None:
    """An HF checkpoint of random weights (float16, one tensor in memory at a time) with the
    config `config` (made and saved by transformers) and the tokenizer of `tokenizer_src`. The
    tensors' names and shapes are those of transformers' model of that config, made on the
    meta device (no memory)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tinyrt.gguf_tokenizer import tokenizer_files
    from tinyrt.models.gguf import GGUFFile
    from tinyrt.models.weights import write_safetensors

    cfg = AutoConfig.for_model(**config, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    cfg.architectures = [type(model).__name__]
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    dst.mkdir(parents=True)
    cfg.save_pretrained(dst)
    files = tokenizer_files(GGUFFile(tokenizer_src))
    # padded with unused tokens to the vocabulary size, as llama.cpp's converter counts it (the
    # vocabulary and the added tokens: it cuts Gemma's embedding rows to that many); a
    # byte-level BPE, as Phi-4-mini's (GPT2Tokenizer: the converter reads no SentencePiece file)
    tok = json.loads(files["tokenizer.json"])
    vocab = tok["model"]["vocab"]
    for i in range(len(vocab), cfg.vocab_size - len(tok["added_tokens"])):
        vocab[f"<unused{i}>"] = i
    files["tokenizer.json"] = json.dumps(tok)
    files["tokenizer_config.json"] = json.dumps({**json.loads(files["tokenizer_config.json"]),
                                                 "tokenizer_class": "GPT2Tokenizer"})
    for name, text in files.items():
        (dst / name).write_text(text)
    std, out_std = 0.02, 0.02 / np.sqrt(2 * cfg.num_hidden_layers)
    center = 0.0 if config["model_type"].startswith("gemma") else 1.0

    def weight(name: str) -> float | None:
        return (None if name.endswith("norm.weight") else
                out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std)

    write_safetensors(dst / "model.safetensors",
                      [(name, np.float16, shape) for name, shape in shapes.items()],
                      (random_weight(seed, i, shape, weight(name), center).astype(np.float16)
                       for i, (name, shape) in enumerate(shapes.items())),
                      metadata={"format": "pt"})


def write_family_gguf(dst: Path, tokenizer_src: Path, shape: str, seed: int = 0) -> None:
    """The float16 GGUF of FAMILY_SHAPES[shape] as llama.cpp's own converter writes it (from a
    random HF checkpoint, removed after)."""
    import shutil
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from llama_cpp_files import convert_with_llama_cpp

    config = FAMILY_SHAPES[shape]
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        write_random_hf(Path(tmp) / "hf", tokenizer_src, config, seed)
        part = dst.with_name(dst.name + ".part")
        convert_with_llama_cpp(Path(tmp) / "hf", part, "f16", pre="smollm", timeout=3600)
        shutil.rmtree(Path(tmp) / "hf")
        part.rename(dst)


def tensor_types(path: Path) -> dict[str, collections.Counter]:
    """Tensor kind (the name without blk.N.) -> Counter of GGML types."""
    from gguf import GGUFReader

    kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in GGUFReader(str(path)).tensors:
        kinds[re.sub(r"^blk\.\d+\.", "", t.name)][t.tensor_type.name] += 1
    return dict(kinds)


def print_types(path: Path) -> None:
    kinds = tensor_types(path)
    total = sum((c for c in kinds.values()), collections.Counter())
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB): "
          + ", ".join(f"{n} {t}" for t, n in total.most_common()))
    for kind, c in kinds.items():
        print(f"  {kind:22s} " + ", ".join(f"{n} {t}" for t, n in c.most_common()))


def convert_rtn(src: Path, dst: Path) -> None:
    """tinyrt's own 4-bit model of a float file: `tinyrt convert SRC DST --method rtn
    --group-size 128` (the conversion is atomic: DST appears whole or not at all)."""
    from tinyrt.converters import convert

    convert(src, dst, method="rtn", group_size=128)


TARGETS = (["smollm2-q4km"] + [f"{s}-{t}" for s in SHAPES for t in ("f16", *QUANT_TYPES, "rtn")]
           + [f"{s}-{t}" for s in FAMILY_SHAPES for t in ("f16", "q4km")])
DEFAULT_TARGETS = ["smollm2-q4km", "tinyllama-f16", "tinyllama-q4km", "tinyllama-q4_0"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", metavar="TARGET",
                    help=f"what to build: {', '.join(TARGETS)}, or all (default: "
                         f"{', '.join(DEFAULT_TARGETS)})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder (default {DEFAULT_OUT})")
    ap.add_argument("--source", type=Path, default=None,
                    help="the default model's GGUF (default: tinyrt's cached copy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all cores)")
    ap.add_argument("--force", action="store_true", help="remake files that exist")
    ap.add_argument("--types", type=Path, nargs="+", metavar="GGUF",
                    help="only print the tensor types of these files")
    args = ap.parse_args()
    if args.types:
        for p in args.types:
            print_types(p)
        return 0
    if bad := [t for t in args.targets if t not in TARGETS + ["all"]]:
        ap.error(f"unknown target {bad[0]!r} (known: {', '.join(TARGETS)}, all)")
    asked = set(TARGETS if "all" in args.targets else args.targets or DEFAULT_TARGETS)
    # a quantized file needs its float file (made if missing, not remade by --force)
    needed = asked | {t.split("-")[0] + "-f16" for t in asked
                      if t.split("-")[0] in (*SHAPES, *FAMILY_SHAPES)}
    targets = [t for t in TARGETS if t in needed]
    args.out.mkdir(parents=True, exist_ok=True)
    source = args.source or default_gguf()
    jobs = {"smollm2-q4km": (args.out / SMOLLM2_Q4KM,
                             lambda d: quantize(source, d, "MOSTLY_Q4_K_M", args.threads))}
    for shape, dims in SHAPES.items():
        f16 = args.out / SHAPED.format(shape, "f16")
        jobs[f"{shape}-f16"] = (f16, lambda d, shape=shape, dims=dims: write_random_llama(
            d, source, args.seed, name=shape, **dims))
        for t, (suffix, ftype) in QUANT_TYPES.items():
            jobs[f"{shape}-{t}"] = (args.out / SHAPED.format(shape, suffix),
                                    lambda d, f16=f16, ftype=ftype: quantize(f16, d, ftype,
                                                                             args.threads))
        jobs[f"{shape}-rtn"] = (args.out / SHAPED_RTN.format(shape),
                                lambda d, f16=f16: convert_rtn(f16, d))
    for shape in FAMILY_SHAPES:
        f16 = args.out / SHAPED.format(shape, "f16")
        jobs[f"{shape}-f16"] = (f16, lambda d, shape=shape: write_family_gguf(d, source, shape,
                                                                              args.seed))
        jobs[f"{shape}-q4km"] = (args.out / SHAPED.format(shape, "Q4_K_M"),
                                 lambda d, f16=f16: quantize(f16, d, "MOSTLY_Q4_K_M", args.threads))
    for name in targets:
        dst, make = jobs[name]
        if dst.exists() and not (args.force and name in asked):
            print(f"{name}: {dst} exists (--force remakes it)")
        else:
            t = time.perf_counter()
            print(f"{name}: making {dst} ...", flush=True)
            make(dst)
            print(f"{name}: {time.perf_counter() - t:.0f} s")
        if dst.is_file():
            print_types(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
