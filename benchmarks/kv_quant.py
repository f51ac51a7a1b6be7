"""The quantized KV cache (--kv-type q8|q4|q2, KIVI) against float16, on the real model:

    python benchmarks/kv_quant.py MODEL bytes
        bytes per cached token (codes, scales, zeros) against float16, for the model and for
        head dims 64 and 128, at the default group and at KIVI's 32
    python benchmarks/kv_quant.py MODEL quality --text FILE [--tokens 8192] [--configs ...]
        streaming perplexity (the text fed token by token) for f16, q8, q4, q2 under dense,
        sink 4+1020 (over --tokens) and h2o at 20 % of 2048 (over 2048 tokens), at the
        default group and residual and at KIVI's
        G=32, R=128 (--types, --policies, --layouts G=.. KIVI: some of them)
    python benchmarks/kv_quant.py MODEL speed [--context 4096] [--rounds 64]
        decode ms per token with the context full, f16 against q8, q4 and q2 caches taking turns
        token by token (the token appended, then rolled back), and a long prompt's prefill
    python benchmarks/kv_quant.py MODEL long --text FILE [--tokens 32768] [--kv-type q4]
        a sink 4+1020 stream: RSS at 4k, 16k and 32k tokens

All on the CPU backend, `--threads` threads (default 2).
"""

import argparse
import json
import statistics
import time

import numpy as np
from soak import rss_mb

TYPES = ("f16", "q8", "q4", "q2")


def options(**kw):
    from tinyrt.kv_options import CacheOptions

    return CacheOptions(**kw)


def bytes_table(llm, args):
    from tinyrt.kernels import kv_quant
    from tinyrt.kv_options import DEFAULT_GROUPS

    cfg = llm.config
    out = {}
    for D in sorted({cfg.head_dim, 64, 128}):
        for group in ("default", 32, 64):
            row = {}
            for t in TYPES[1:]:
                g = DEFAULT_GROUPS[t] if group == "default" else group
                row[t] = kv_quant.token_bytes(kv_quant.BITS[t], g, D) / (2 * D * 2)
            out[f"D={D} G={group}"] = row
            print(f"head dim {D:4d}, group {group}: " + "  ".join(
                f"{t} {r:.3f}x" for t, r in row.items()), flush=True)
    for t in TYPES:
        o = options(kv_type=t)
        print(f"{cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads: "
              f"{o.describe(cfg)}")
    return out


def quality(llm_for, text, args):
    from tinyrt.perplexity import stream_perplexity
    from tinyrt.kv_options import DEFAULT_GROUPS, DEFAULT_RESIDUAL

    policies = {"dense": ("dense", args.tokens, args.tokens), "sink 4+1020": ("sink", 1024, args.tokens),
                "h2o 20% of 2048": ("h2o", 410, 2048)}
    layouts = {f"default R={DEFAULT_RESIDUAL}": (None, DEFAULT_RESIDUAL),
               "KIVI G=32 R=128": (32, 128)}
    out = {}
    for pname, (policy, size, tokens) in policies.items():
        if args.policies and policy not in args.policies:
            continue
        base, seen = None, set()
        for t in TYPES:
            for lname, (group, residual) in layouts.items():
                same = (t,) if t == "f16" else (t, group or DEFAULT_GROUPS[t], residual)
                if same in seen or t not in args.types or (
                        t != "f16" and args.layouts and lname.split()[0] not in args.layouts):
                    continue
                seen.add(same)
                llm = llm_for(t, group, residual)
                r = stream_perplexity(llm, text, options(kv_policy=policy, kv_size=size),
                                      max_tokens=tokens)
                base = r.ppl if t == "f16" else base
                key = f"{pname} {t}" + ("" if t == "f16" else f" G={same[1]} R={residual}")
                out[key] = r.ppl
                vs = f"{r.ppl / base - 1:+7.2%}" if base else ""
                print(f"{key:36s} ppl {r.ppl:9.4f}  {vs}  ({r.tokens} tokens, {r.seconds:.0f} s)",
                      flush=True)
    return out


def speed(llm, text, args):
    from tinyrt.kv_cache import make_cache

    model = llm.model
    ids = np.asarray(llm.tokenizer.encode(text), np.int64)
    ids = np.resize(ids, args.context)          # repeated if the text is short
    out = {}
    caches = {t: make_cache(options(kv_type=t, kv_size=args.context + 1), model) for t in TYPES}
    for t, cache in caches.items():              # prefill, timed: best of 2
        best = None
        for _ in range(2):
            cache.reset()
            start = time.perf_counter()
            model.forward(ids, cache)
            best = min(best or 1e9, time.perf_counter() - start)
        out[f"prefill {t} s"] = best
    times = {t: [] for t in TYPES}
    token = ids[-1:]
    for r in range(args.rounds + 4):
        for t, cache in caches.items():
            start = time.perf_counter()
            model.forward(token, cache)
            elapsed = time.perf_counter() - start
            cache.rollback(1)
            if r >= 4:                           # the first rounds warm the caches
                times[t].append(elapsed)
    f16 = statistics.median(times["f16"])
    for t in TYPES:
        ms = statistics.median(times[t]) * 1e3
        out[f"decode {t} ms"] = ms
        print(f"{t}: decode {ms:7.2f} ms/token ({1e3 / ms:6.1f} tok/s, {f16 * 1e3 / ms:.2f}x f16) "
              f"at {args.context} tokens; prefill of {args.context} tokens "
              f"{out[f'prefill {t} s']:.2f} s ({out[f'prefill {t} s'] / out['prefill f16 s']:.2f}x "
              f"f16)", flush=True)
    return out


def long(llm, text, args):
    from tinyrt.perplexity import stream_perplexity

    marks, seen = (4096, 16384, 32768), {}

    def progress(done, total):
        for m in marks:
            if done >= m and m not in seen:
                seen[m] = rss_mb()
                print(f"{m:6d} tokens: RSS {seen[m]:.0f} MB", flush=True)

    r = stream_perplexity(llm, text, options(kv_policy="sink", kv_size=1024),
                          max_tokens=args.tokens, progress=progress)
    seen["end"] = rss_mb()
    print(f"sink 4+1020 {args.kv_type} over {r.tokens} tokens: ppl {r.ppl:.4f}, "
          f"{r.seconds:.0f} s; RSS at the end {seen['end']:.0f} MB")
    return {"rss_mb": seen, "ppl": r.ppl}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("what", choices=["bytes", "quality", "speed", "long"])
    p.add_argument("--text")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=64)
    p.add_argument("--policies", nargs="+", default=None, help="quality: dense, sink, h2o")
    p.add_argument("--types", nargs="+", default=list(TYPES), help="quality: the cache types")
    p.add_argument("--layouts", nargs="+", default=None,
                   help="quality: the group and residual, default and/or KIVI")
    p.add_argument("--kv-type", default="q4", help="long: the cache's type")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import tinyrt
    from tinyrt.sample_text import default_text

    def llm_for(kv_type, group=None, residual=None):
        extra = {} if residual is None else {"kv_group": group, "kv_residual": residual}
        return tinyrt.load(args.model, device="cpu", threads=args.threads, kv_type=kv_type,
                           **extra)

    text = open(args.text, encoding="utf-8").read() if args.text else default_text()
    if args.what == "bytes":
        out = bytes_table(llm_for("f16"), args)
    elif args.what == "quality":
        args.tokens = args.tokens or 8192
        out = quality(llm_for, text, args)
    elif args.what == "speed":
        out = speed(llm_for("f16"), text, args)
    else:
        args.tokens = args.tokens or 32768
        out = long(llm_for(args.kv_type), text, args)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
