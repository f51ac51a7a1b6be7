"""tinyrt on a CUDA GPU, against the GPU's measured bandwidth and HF transformers in float16.

Models: `llama2-7b` and `llama3-8b` are random-weight AWQ model directories of Llama-2-7B's shape
(hidden 4096, 32 layers, 32 heads and KV heads, FFN 11008, vocab 32000) and Llama-3-8B's (FFN
14336, 8 KV heads, vocab 128256, rope theta 5e5): 4-bit codes in groups of 128 in AutoAWQ's GEMM
layout (kernels/awq_layout.py; random codes, zero point 8, float16 scales), a float16 embedding
and head, a byte-level tokenizer (the prompts are random ids). They are written once under
--workdir (their chunks made on up to 16 threads, each from a seed of its own) and reused.
`default` is the default model's GGUF (Q4_1) from tinyrt's cache, or --default-model. Nothing is
downloaded.

For each model and context C (--contexts), tinyrt (`tinyrt.load(MODEL, device=..., kv_size=...)`,
tinyrt.bench.timed_runs: the generation loop a reply runs) prefills C random token ids into an
empty cache (that time is the TTFT, the last token's logits and its draw included; prefill
tok/s = C / TTFT), then
decodes --decode-tokens greedy tokens after them (decode tok/s: on a GPU the decode steps run on
the device, replayed as one CUDA graph, captured in the warm-up reply and restarted by each
later one as a user's next reply is; --no-cuda-graph runs them eagerly); medians of --runs runs (one count, or one a context: 3,2),
each run's figures beside them, after a warm-up run that compiles the kernels.
GB/s is the bytes one decoded token reads (the prepared weights as tinyrt/bench.py counts them,
the embedding left out, plus the KV cache at its mean length over the decode) times decode tok/s,
shown as a share of the device's copy bandwidth (a 1 GiB torch tensor copied device to device,
read plus write counted). The peer is transformers' LlamaForCausalLM of the same shape with random
init in float16 (float32 on --device cpu), run eagerly (no compile, no CUDA graph; attention
--hf-attn, sdpa by default) on the same ids, greedy one token at a time on its KV cache
(use_cache=True), timed the same way (its argmax stays on the GPU between steps; tinyrt's token
id crosses to the host each step, as a streamed reply needs). A shape whose weights and cache
would not fit in the GPU's free memory is skipped with a note. If one engine fails, its error is
reported and the other's figures still stand; a package that is not installed is one line.
With --json, each engine's figures so far go to stderr as one line (`MODEL: ENGINE: {...}`) as
each context is measured, so that they stand where the run is cut short; and the seconds each
part took (writing a model, tinyrt's load, warm-up and contexts, transformers') are recorded.

    # on a CUDA machine (torch with CUDA, transformers, Numba with libNVVM); the first run writes
    # ~3.9 GB (llama2-7b) and ~5.7 GB (llama3-8b) of model files under --workdir
    python benchmarks/gpu.py                          # all three models, contexts 512 and 4096
    python benchmarks/gpu.py --models llama3-8b --decode-tokens 256 --runs 5 --json > gpu.json
    # the script's logic without a GPU: toy shapes (2 layers, hidden 256) on the CPU backend
    python benchmarks/gpu.py --device cpu --smoke --threads 2
    # a GPU machine with no network (tinyrt not installed there): prepare here, one model a run
    bash benchmarks/gpu_offline.sh prepare            # here: .gpu_offline/, to bring along
    bash benchmarks/gpu_offline.sh run --models llama2-7b      # there: python benchmarks/gpu.py
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import json
import math
import os
import statistics
import struct
import sys
import tempfile
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
SHAPES = {   # HF config keys, from the models' config.json
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                      max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
}
SMOKE = {   # --smoke: the same families at toy size
    "llama2-7b": dict(SHAPES["llama2-7b"], hidden_size=256, intermediate_size=768,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      vocab_size=1024),
    "llama3-8b": dict(SHAPES["llama3-8b"], hidden_size=256, intermediate_size=896,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      vocab_size=2048),
}
MODELS = ("default", "llama2-7b", "llama3-8b")
ZERO8 = np.uint32(0x88888888).view(np.int32)     # eight 4-bit zero points of 8


# -- random-weight AWQ model directories ---------------------------------------------------------

def _seeded(seed: int, name: str, k: int, make):
    """A chunk of tensor `name`, made by make(rng) with a generator of its own (seed, the name,
    the chunk): the same bytes whichever thread makes it, and a tensor the same draws in every
    model that has it (a 4-layer copy's are the full model's, its output projections' scales
    but for their depth's factor)."""
    return lambda: make(np.random.default_rng([seed, zlib.crc32(name.encode()), k]))


def _normal(seed: int, name: str, shape: tuple, std: float, rows: int = 4096) -> list:
    return [_seeded(seed, name, r, lambda rng, n=min(rows, shape[0] - r): (
                rng.standard_normal((n, *shape[1:]), dtype=np.float32) * std).astype(np.float16))
            for r in range(0, shape[0], rows)]


def centred(raw: bytes) -> np.ndarray:
    """Random bytes as int32 words of 4-bit codes, each code 0 made 8: codes of mean 8, the zero
    point. (Uniform codes have 7.5, a bias that every output sums: a random model's hidden states
    then share one direction, and its greedy tokens hardly change.)"""
    lo, hi = np.arange(256, dtype=np.uint8) & 15, np.arange(256, dtype=np.uint8) >> 4
    lut = np.where(hi == 0, 8, hi) << 4 | np.where(lo == 0, 8, lo)
    return lut.astype(np.uint8)[np.frombuffer(raw, np.uint8)].view(np.int32)


def model_tensors(s: dict, seed: int = 0) -> list:
    """(name, safetensors dtype, shape, chunks) of every tensor of an AWQ model of shape s; the
    chunks are functions that make them (in any order, on any thread: see _seeded)."""
    from tinyrt.kernels import awq_layout

    H, I, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    Q, G = s["num_attention_heads"], s["num_key_value_heads"]
    D, std = H // Q, 0.02
    out_std = std / math.sqrt(2 * L)             # output projections, as GPT-2 initializes them

    def norm(name):
        return (name, "F16", (H,), [_seeded(seed, name, 0, lambda rng: (
                    1 + 0.02 * rng.standard_normal(H)).astype(np.float16))])

    def linear(name, out, inp, sd):              # (codes - 8) have a std of 4.6
        sh = awq_layout.shapes(inp, out, AWQ["group_size"])
        words = math.prod(sh["qweight"])
        return [(f"{name}.qweight", "I32", sh["qweight"], [_seeded(seed, name, 0, lambda rng: (
                    centred(rng.bytes(4 * words)).reshape(sh["qweight"])))]),
                (f"{name}.qzeros", "I32", sh["qzeros"],
                 [lambda: np.full(sh["qzeros"], ZERO8)]),
                (f"{name}.scales", "F16", sh["scales"], [_seeded(seed, name, 1, lambda rng: (
                    rng.uniform(0.5, 1.5, sh["scales"]) * sd / 4.6).astype(np.float16))])]

    emb = "model.embed_tokens.weight"
    t = [(emb, "F16", (V, H), _normal(seed, emb, (V, H), std))]
    for i in range(L):
        p = f"model.layers.{i}."
        t += [norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")]
        for name, out, inp, sd in (("self_attn.q_proj", Q * D, H, std),
                                   ("self_attn.k_proj", G * D, H, std),
                                   ("self_attn.v_proj", G * D, H, std),
                                   ("self_attn.o_proj", H, Q * D, out_std),
                                   ("mlp.gate_proj", I, H, std), ("mlp.up_proj", I, H, std),
                                   ("mlp.down_proj", H, I, out_std)):
            t += linear(p + name, out, inp, sd)
    return t + [norm("model.norm.weight"),
                ("lm_head.weight", "F16", (V, H), _normal(seed, "lm_head.weight", (V, H), std))]


def write_safetensors(path: Path, tensors: list, threads: int | None = None) -> None:
    """A safetensors file as the format defines it, its chunks made by `threads` threads (NumPy's
    generators and casts let go of the GIL: the 8B's 5.7 GB took 55 s on one core) and written
    in order, at most 2 * threads of them in memory."""
    threads = threads or min(16, os.cpu_count() or 1)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, _ in tensors:
        n = math.prod(shape) * {"I32": 4, "F16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f, ThreadPoolExecutor(threads) as pool:
        f.write(struct.pack("<Q", len(h)) + h)
        ahead: collections.deque = collections.deque()
        for make in (make for *_, chunks in tensors for make in chunks):
            ahead.append(pool.submit(make))
            if len(ahead) >= 2 * threads:
                np.ascontiguousarray(ahead.popleft().result()).tofile(f)
        while ahead:
            np.ascontiguousarray(ahead.popleft().result()).tofile(f)


def awq_model(workdir: Path, name: str, shape: dict, smoke: bool) -> Path:
    """The model directory of `shape`, written unless it is there (whole, or not at all); its
    tokenizer is byte-level BPE with no merges: 2 special tokens and the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # ("-centred": a folder of an earlier form, with uniform codes, is not taken for one)
    dst = workdir / f"{name}{'-smoke' if smoke else ''}-awq-g128-centred"
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"{name}: writing {dst} ...", file=sys.stderr, flush=True)
    write_safetensors(tmp / "model.safetensors", model_tensors(shape))
    tokens = ["<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                           "eos_token": "</s>"}))
    (tmp / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **shape,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float16", "quantization_config": AWQ}, indent=1))
    tmp.rename(dst)
    print(f"{name}: written in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return dst


# -- measurements ---------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, reps: int = 20) -> float:
    """GB/s of a device-to-device torch copy of nbytes, read plus write counted (median of 5)."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync(device)
        rates.append(2 * nbytes * reps / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def nbytes(w) -> int:
    """Bytes of a prepared weight: a NumPy array, a torch tensor, or a tuple of them
    (tinyrt.bench.weight_bytes counts NumPy arrays only, so 0 on the CUDA backend)."""
    if isinstance(w, tuple):
        return sum(nbytes(p) for p in w)
    return int(w.nbytes) if hasattr(w, "nbytes") and hasattr(w, "shape") else 0


def weight_bytes(model) -> int:
    """Bytes of weights one decoded token reads, counted as tinyrt/bench.py counts them."""
    return (sum(nbytes(w) for L in model.layers for w in vars(L).values())
            + nbytes(model.lm_head) + nbytes(model.norm))


def prompt(ctx: int, vocab: int) -> np.ndarray:
    """The random token ids of a prompt of ctx tokens (the same for both engines)."""
    return np.random.default_rng(ctx).integers(2, vocab, ctx)


def default_gguf() -> Path:
    """Where tinyrt's cache keeps the default model's GGUF (`tinyrt pull` puts it there)."""
    from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS, cache_dir

    return cache_dir() / "gguf" / Path(KNOWN_MODELS[DEFAULT_MODEL].member).name


def emit(args, name: str, engine: str, figures: dict) -> None:
    """With --json, an engine's figures so far on stderr, one line as soon as measured (the last
    line of each stands where a step that runs this script is cut short: gpu_summary.py)."""
    if args.json:
        print(f"{name}: {engine}: {json.dumps(figures)}", file=sys.stderr, flush=True)


def runs_of(args, ctx: int) -> int:
    return args.runs[args.contexts.index(ctx)]


def bench_tinyrt(name: str, path: Path, args, contexts: list[int]) -> tuple[dict, dict]:
    """tinyrt's figures per context (each context's emitted as measured), and the model's
    shape as tinyrt loaded it."""
    import tinyrt
    from tinyrt.bench import timed_runs

    start = time.perf_counter()
    llm = tinyrt.load(str(path), device=args.device, threads=args.threads, quiet=True,
                      cuda_graph=args.cuda_graph, kv_size=max(contexts) + args.decode_tokens + 8)
    model, cache, c = llm.model, llm.cache, llm.config
    shape = {k: getattr(c, k) for k in (*SHAPES["llama2-7b"], "tie_word_embeddings")}
    w_bytes = weight_bytes(model)
    if args.device == "cpu":      # where tinyrt.bench's count sees arrays, the two agree
        from tinyrt.bench import weight_bytes as theirs

        assert theirs(model) == w_bytes, (theirs(model), w_bytes)
    warm = time.perf_counter()
    timed_runs(llm, prompt(contexts[0], c.vocab_size), 3, 1)     # warm-up: compiles
    out = {"load_s": llm.load_s, "warm_up_s": time.perf_counter() - warm,
           "weight_mb_per_token": w_bytes / 1e6, "contexts": {}}
    emit(args, name, "tinyrt", out)
    for ctx in contexts:
        t = time.perf_counter()
        ttft, decode, _ = timed_runs(llm, prompt(ctx, c.vocab_size), args.decode_tokens,
                                     runs_of(args, ctx))
        step = statistics.median(decode)
        kv = cache.bytes_per_token * (ctx + args.decode_tokens / 2)
        gb_s = (w_bytes + kv) / step / 1e9
        out["contexts"][ctx] = {"prefill_tok_s": ctx / statistics.median(ttft),
                                "ttft_s": statistics.median(ttft),
                                "decode_tok_s": 1 / step, "kv_mb_per_token": kv / 1e6,
                                "gb_s": gb_s, "pct_copy_bw": 100 * gb_s / args.copy_gb_s,
                                "runs": len(decode),
                                "prefill_tok_s_runs": [ctx / x for x in ttft],
                                "decode_tok_s_runs": [1 / x for x in decode],
                                "wall_s": time.perf_counter() - t}
        out["wall_s"] = time.perf_counter() - start
        emit(args, name, "tinyrt", out)
    return out, shape


def hf_params(s: dict) -> int:
    H, I, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    Q, G = s["num_attention_heads"], s["num_key_value_heads"]
    attn = H * (H // Q) * (2 * Q + 2 * G)
    return V * H * (1 if s.get("tie_word_embeddings") else 2) + L * (attn + 3 * H * I + 2 * H) + H


def bench_hf(name: str, shape: dict, args, contexts: list[int]) -> dict:
    """transformers' figures per context (each context's emitted as measured), for a random
    LlamaForCausalLM of `shape`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    ctx_max = max(contexts) + args.decode_tokens + 8
    if args.device == "cuda":
        H, L, G = shape["hidden_size"], shape["num_hidden_layers"], shape["num_key_value_heads"]
        kv = 4 * L * G * H // shape["num_attention_heads"] * ctx_max
        need, free = 2 * hf_params(shape) + kv + 2**31, torch.cuda.mem_get_info()[0]
        if need > free:
            return {"skipped": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    positions = max(ctx_max, shape["max_position_embeddings"])
    cfg = LlamaConfig(**dict(shape, max_position_embeddings=positions), hidden_act="silu",
                      attn_implementation=args.hf_attn)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # made in place in its type: no float32 copy first
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    params = inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    kv_arg = "cache" if "cache" in params else "past_key_values"     # (renamed in 5.x)

    def step(ids, past=None):
        out = model(input_ids=ids, use_cache=True, **{kv_arg: past}, **keep)
        return getattr(out, kv_arg), out.logits[:, -1:].argmax(-1)

    out = {"dtype": str(dtype).removeprefix("torch."), "attn": args.hf_attn,
           "init_s": time.perf_counter() - start, "contexts": {}}
    with torch.inference_mode():
        # warm-up: a short prompt and each context's (a prefill of 4096 is a fraction of a
        # second here, and a first call's setup would weigh on a median of 2)
        for n in (8, *contexts):
            past, tok = step(torch.arange(2, n + 2, device=args.device)[None])
            for _ in range(3):
                past, tok = step(tok, past)
        for ctx in contexts:
            t = time.perf_counter()
            ids = torch.tensor(prompt(ctx, shape["vocab_size"]), device=args.device)[None]
            ttft, decode = [], []
            for _ in range(runs_of(args, ctx)):
                past = None
                sync(args.device)
                begin = time.perf_counter()
                past, tok = step(ids)
                int(tok)                            # the first token on the host, as tinyrt's
                ttft.append(time.perf_counter() - begin)
                begin = time.perf_counter()
                for _ in range(args.decode_tokens):
                    past, tok = step(tok, past)
                sync(args.device)
                decode.append((time.perf_counter() - begin) / args.decode_tokens)
            out["contexts"][ctx] = {"prefill_tok_s": ctx / statistics.median(ttft),
                                    "ttft_s": statistics.median(ttft),
                                    "decode_tok_s": 1 / statistics.median(decode),
                                    "runs": len(decode),
                                    "prefill_tok_s_runs": [ctx / x for x in ttft],
                                    "decode_tok_s_runs": [1 / x for x in decode],
                                    "wall_s": time.perf_counter() - t}
            out["wall_s"] = time.perf_counter() - start
            emit(args, name, "transformers", out)
    return out


def missing(e: ModuleNotFoundError) -> str:
    """What a package that is not installed stops, in words."""
    top = (e.name or "?").split(".")[0]
    if top == "tinyrt":
        return ("tinyrt is not installed (pip install -e . ; where there is no network, "
                "bash benchmarks/gpu_offline.sh run)")
    return f"the Python package {top} is not installed"


def guarded(name: str, engine: str, fn, *a):
    """fn(*a), or {"error": ...} with the traceback on stderr ({"skipped": ...} and one line for
    a package that is not installed); device memory freed after."""
    try:
        return fn(*a)
    except ModuleNotFoundError as e:
        print(f"{name}: {engine} skipped: {missing(e)}", file=sys.stderr)
        return {"skipped": missing(e)}
    except Exception as e:                               # noqa: BLE001
        traceback.print_exc()
        print(f"{name}: {engine} failed: {e!r}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        gc.collect()
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- report ---------------------------------------------------------------------------------------

def table(name: str, m: dict, bw: float) -> str:
    t, hf = m["tinyrt"], m["transformers"]

    def size(n):
        return "?" if n is None else f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"

    def f(d, k, fmt=".1f", unit=""):
        return format(d[k], fmt) + unit if k in d else "-"

    def ms(d):
        return format(d["ttft_s"] * 1e3, ".0f") if "ttft_s" in d else "-"

    lines = [f"\n{name}: {m['source']}, {size(m['params'])} params; tinyrt reads "
             f"{size(t.get('weight_mb_per_token', 0) * 1e6 or None)}B of weights a token"]
    lines += [f"  {who}: {r.get('error') or 'skipped: ' + r['skipped']}"
              for who, r in (("tinyrt", t), ("transformers", hf)) if "error" in r or "skipped" in r]
    hf_col = f"hf {hf.get('dtype', 'float16')} tok/s"
    lines.append(f"  {'ctx':>5} {'tinyrt tok/s':>12} {hf_col:>17} {'ratio':>6} {'GB/s':>7} "
                 f"{'% copy':>6} {'prefill tinyrt':>14} {'prefill hf':>10} {'TTFT ms':>8} "
                 f"{'hf ms':>6}")
    for ctx in m["contexts"]:
        a, b = t.get("contexts", {}).get(ctx, {}), hf.get("contexts", {}).get(ctx, {})
        lines.append(f"  {ctx:>5} {f(a, 'decode_tok_s'):>12} {f(b, 'decode_tok_s'):>17} "
                     f"{f(a, 'ratio_vs_transformers', '.2f', 'x'):>6} {f(a, 'gb_s'):>7} "
                     f"{f(a, 'pct_copy_bw', '.0f', '%'):>6} {f(a, 'prefill_tok_s', '.0f'):>14} "
                     f"{f(b, 'prefill_tok_s', '.0f'):>10} {ms(a):>8} {ms(b):>6}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
    ap.add_argument("--contexts", help="prompt lengths (default 512,4096; --smoke 64,256)")
    ap.add_argument("--decode-tokens", type=int, help="default 128 (--smoke 16)")
    ap.add_argument("--runs", help="medians of (default 3, --smoke 2); one a context: 3,2")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="toy shapes (2 layers, hidden 256)")
    ap.add_argument("--threads", type=int, help="CPU threads (tinyrt's and torch's)")
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "tinyrt_gpu_bench")
    ap.add_argument("--default-model", type=Path, help="the default model's GGUF")
    ap.add_argument("--hf-attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                    help="tinyrt's decode steps eagerly (still on the device)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    args = ap.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if bad := [n for n in names if n not in MODELS]:
        ap.error(f"unknown model {bad[0]!r} (choose from {', '.join(MODELS)})")
    contexts = args.contexts or ("64,256" if args.smoke else "512,4096")
    contexts = args.contexts = [int(c) for c in contexts.split(",")]
    args.decode_tokens = args.decode_tokens or (16 if args.smoke else 128)
    try:
        runs = [int(r) for r in (args.runs or ("2" if args.smoke else "3")).split(",")]
    except ValueError:
        runs = []
    if len(runs) not in (1, len(contexts)) or min(runs) < 1:
        ap.error(f"--runs: one count, or one a context ({len(contexts)}), each at least 1")
    args.runs = runs * len(contexts) if len(runs) == 1 else runs

    import platform

    import torch
    try:
        import transformers
    except ModuleNotFoundError as e:     # tinyrt's figures without the peer's
        transformers = None
        print(f"transformers skipped: {missing(e)}", file=sys.stderr)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch sees no CUDA GPU (--device cpu --smoke runs the script without one)")
    device = (torch.cuda.get_device_name() if args.device == "cuda"
              else f"cpu ({platform.processor() or platform.machine()})")
    bw = args.copy_gb_s = copy_bandwidth(args.device, 2**30 if args.device == "cuda" else 2**26)
    report = {"device": device, "copy_gb_s": bw, "torch": torch.__version__,
              "transformers": transformers and transformers.__version__, "smoke": args.smoke,
              "decode_tokens": args.decode_tokens, "runs": dict(zip(contexts, args.runs)),
              "models": {}}
    emit(args, "device", "copy", {k: report[k] for k in ("device", "copy_gb_s", "torch")})
    if not args.json:
        runs = "/".join(map(str, args.runs))
        print(f"{device}: torch copy {bw:.0f} GB/s (read + write); {args.decode_tokens} greedy "
              f"tokens decoded after each context; medians of {runs} runs")
    args.workdir.mkdir(parents=True, exist_ok=True)
    shapes = SMOKE if args.smoke else SHAPES
    for name in names:
        try:
            if name == "default":
                path = args.default_model or default_gguf()
                source = ("the default model's GGUF (Q4_1)" if args.default_model is None
                          else f"GGUF {path.name}")
                if not path.exists():
                    print(f"default: skipped: no {path} (`tinyrt pull` fetches it where there "
                          "is a network; or give --default-model)", file=sys.stderr)
                    continue
            else:
                start = time.perf_counter()
                path = awq_model(args.workdir, name, shapes[name], args.smoke)
                written = time.perf_counter() - start
                source = f"random weights, AWQ 4-bit g128{', smoke shape' if args.smoke else ''}"
        except ModuleNotFoundError as e:
            hint = " (or give --default-model)" if name == "default" else ""
            print(f"{name}: skipped: {missing(e)}{hint}", file=sys.stderr)
            continue
        m = {"source": source, "path": str(path), "contexts": contexts}
        if name != "default":
            m["write_s"] = written          # (0 where an earlier run wrote it)
        m["tinyrt"], shape = guarded(name, "tinyrt", bench_tinyrt, name, path, args, contexts), None
        if isinstance(m["tinyrt"], tuple):
            m["tinyrt"], shape = m["tinyrt"]
        elif name != "default":
            shape = dict(shapes[name], tie_word_embeddings=False)
        m["shape"], m["params"] = shape, shape and hf_params(shape)
        m["transformers"] = (
            {"skipped": "no shape (tinyrt did not load it)"} if not shape
            else {"skipped": "not installed"} if transformers is None
            else guarded(name, "transformers", bench_hf, name, shape, args, contexts))
        for ctx, a in m["tinyrt"].get("contexts", {}).items():
            if b := m["transformers"].get("contexts", {}).get(ctx):
                a["ratio_vs_transformers"] = a["decode_tok_s"] / b["decode_tok_s"]
        report["models"][name] = m
        if not args.json:
            print(table(name, m, bw), flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ModuleNotFoundError as e:    # (torch, numpy: nothing to measure without them)
        sys.exit(f"gpu.py: {missing(e)}")
