"""KV cache policies on the real model, by the StreamingLLM paper's streaming evaluation (the text
fed one token at a time, each next-token NLL recorded, the policy applied as the cache fills):

    python benchmarks/kv_policies.py MODEL --text wikitext2-test.txt quality [--tokens 8192]
        dense (the whole text in context), sink 4 + 1020, window 0 + 1024, h2o 1024: PPL, ratios
    python benchmarks/kv_policies.py MODEL --text ... long [--tokens 32768]
        sink 4 + 1020 over a stream past the model's context: PPL of the first and last 8192
        tokens, RSS when the cache fills and at the end
    python benchmarks/kv_policies.py MODEL --text ... budget [--tokens 2048] [--plot FILE.png]
        PPL against cache budget for window, sink and h2o (dense: the whole text, a line);
        205, 410 and 819 are 10, 20 and 40 % of 2048
    python benchmarks/kv_policies.py MODEL speed [--kv-size 1024]
        decode ms per token with the cache full: dense (its last token appended and rolled
        back) against sink (sinks re-rotated every step) and h2o (scores kept, one eviction
        per head and layer every step), same cache size, taking turns token by token, medians

--kv-type q8|q4|q2 runs every cache quantized (kernels/kv_quant.py). Needs matplotlib for --plot
(not a CI dependency).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from soak import rss_mb


def stream(llm, text, policy, size, sinks, tokens, progress=None, skip=0):
    from tinyrt.kv_options import CacheOptions
    from tinyrt.perplexity import stream_perplexity

    return stream_perplexity(llm, text, CacheOptions(policy, size, sinks=sinks),
                             max_tokens=tokens, skip=skip, progress=progress)


def ratio_line(out, base, names):
    return "  ".join(f"{n} / {base}: {out[n] / out[base]:.3f}" for n in names)


def quality(llm, text, args):
    runs = {"dense": ("dense", args.tokens, 0), "sink 4+1020": ("sink", 1024, 4),
            "window 0+1024": ("sink", 1024, 0), "h2o 1024": ("h2o", 1024, 4)}
    out = {}
    for name, (policy, size, sinks) in runs.items():
        r = stream(llm, text, policy, size, sinks, args.tokens)
        out[name] = r.ppl
        print(f"{name:14s} ppl {r.ppl:9.4f}  ({r.tokens} tokens, {r.seconds:.0f} s)", flush=True)
    print(ratio_line(out, "dense", list(runs)[1:]))
    return out


def long(llm, text, args):
    seen = {}

    def progress(done, total):
        if done >= 1024 and "full" not in seen:
            seen["full"] = rss_mb()
        seen["peak"] = max(seen.get("peak", 0), rss_mb())

    r = stream(llm, text, "sink", 1024, 4, args.tokens, progress)
    first, last = r.ppl_of(0, 8192), r.ppl_of(r.tokens - 8192, r.tokens)
    print(f"sink 4+1020 over {r.tokens} tokens ({r.seconds:.0f} s): ppl first 8192 {first:.4f}, "
          f"last 8192 {last:.4f} (ratio {last / first:.3f}); RSS when the cache filled "
          f"{seen['full']:.0f} MB, highest after {seen['peak']:.0f} MB, at the end {rss_mb():.0f} MB",
          flush=True)
    # the text's own difficulty changes along it: the same last 8192 tokens streamed from a
    # fresh cache, positions from 0, against those streamed after 24k tokens
    alone = stream(llm, text, "sink", 1024, 4, 8193, skip=r.tokens + 1 - 8193).ppl
    print(f"the last 8192 tokens streamed alone: ppl {alone:.4f}; after the long stream / alone: "
          f"{last / alone:.3f}")
    return {"first": first, "last": last, "last_alone": alone, "rss_full": seen["full"],
            "rss_peak": seen["peak"]}


def budget(llm, text, args):
    budgets = sorted(set(args.budgets) if args.budgets else
                     {64, 128, 256, 512, 1024} | {round(f * args.tokens) for f in (0.1, 0.2, 0.4)})
    dense = stream(llm, text, "dense", args.tokens, 0, args.tokens).ppl
    runs = {"window": ("sink", 0), "sink (4)": ("sink", 4), "h2o (4)": ("h2o", 4)}
    curves = {name: [] for name in runs}
    for b in budgets:
        for name, (policy, sinks) in runs.items():
            curves[name].append(stream(llm, text, policy, b, sinks, args.tokens).ppl)
        print(f"budget {b:5d}: " + "  ".join(f"{n} {c[-1]:8.3f}" for n, c in curves.items())
              + f"  (dense {dense:.3f}; h2o / dense {curves['h2o (4)'][-1] / dense:.3f})",
              flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, ys in curves.items():
            ax.plot(budgets, ys, marker="o", label=name)
        ax.axhline(dense, color="gray", linestyle="--", label=f"dense ({args.tokens} in context)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("KV cache budget (tokens)")
        ax.set_ylabel("perplexity (streaming)")
        ax.set_title(f"{Path(args.model).name}, first {args.tokens} tokens of {Path(args.text).name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    return {"budgets": budgets, "dense": dense, **curves}


def speed(llm, args):
    from tinyrt.kv_cache import make_cache
    from tinyrt.kv_options import CacheOptions

    model = llm.model
    ids = np.random.default_rng(0).integers(100, 10000, 2 * args.kv_size)
    # every cache holds kv_size tokens at each step: dense appends its last free slot's token
    # and rolls it back, over and over; sink and h2o stream on, evicting
    prompts = {"dense": args.kv_size - 1, "sink": 2 * args.kv_size - 128,
               "h2o": 2 * args.kv_size - 128}
    caches, steps = {}, {policy: [] for policy in prompts}
    for policy, prompt in prompts.items():
        caches[policy] = make_cache(CacheOptions(policy, args.kv_size, llm.cache_options.kv_type),
                                    model)
        model.forward(ids[:prompt], caches[policy])
    # the policies take turns, token by token, so that a change in the machine's load falls on
    # all three alike
    for i in range(128):
        for policy, prompt in prompts.items():
            start = time.perf_counter()
            if policy == "dense":
                model.forward([ids[prompt]], caches[policy])
                caches[policy].rollback(1)
            else:
                model.forward([ids[prompt + i]], caches[policy])
            steps[policy].append(time.perf_counter() - start)
    out = {}
    for policy in prompts:
        out[policy] = statistics.median(steps[policy]) * 1e3
        print(f"{policy:6s} decode {out[policy]:.2f} ms per token (median of 128, cache of "
              f"{args.kv_size}, {args.kv_size} held)", flush=True)
    print(ratio_line(out, "dense", ["sink", "h2o"]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("what", choices=["quality", "long", "budget", "speed"])
    p.add_argument("--text")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--kv-size", type=int, default=1024)
    p.add_argument("--plot", default=None)
    p.add_argument("--budgets", type=int, nargs="+", default=None,
                   help="budget: these cache sizes (default 64 to 1024 and 10, 20, 40 %% of the text)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-type", default="f16", help="the caches' element type (f16, q8, q4, q2)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import tinyrt

    llm = tinyrt.load(args.model, device="cpu", threads=args.threads, kv_type=args.kv_type)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    defaults = {"quality": 8192, "long": 32768, "budget": 2048}
    args.tokens = args.tokens or defaults.get(args.what)
    result = {"quality": lambda: quality(llm, text, args), "long": lambda: long(llm, text, args),
              "budget": lambda: budget(llm, text, args), "speed": lambda: speed(llm, args)}[args.what]()
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
