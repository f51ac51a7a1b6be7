"""Long generation in constant memory: RSS and decode speed along one long reply.

    python benchmarks/soak.py MODEL [--tokens 50000] [--kv-policy sink] [--kv-size 4096]
                              [--every 1000] [--json FILE]

Runs `LLM.stream` (the path `tinyrt generate` prints from) with --ignore-eos sampling, and every
--every tokens records the resident set (from /proc) and the decode rate of the last block.
Prints the curve and the RSS when the cache filled against the highest and last RSS after it.
"""

import argparse
import json
import statistics
import time


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=50000)
    p.add_argument("--kv-policy", default="sink")
    p.add_argument("--kv-size", type=int, default=4096)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import tinyrt

    llm = tinyrt.load(args.model, device="cpu", threads=args.threads, kv_size=args.kv_size,
                      kv_policy=args.kv_policy)
    prompt = "Tell me a very long story about a lighthouse keeper and the sea."
    curve, n, block_start = [], 0, time.perf_counter()
    for r in llm.stream(prompt, max_tokens=args.tokens, temperature=0.8, seed=0, ignore_eos=True):
        if r.token is None:
            break
        n += 1
        if n % args.every == 0:
            now = time.perf_counter()
            curve.append({"tokens": n, "rss_mb": round(rss_mb(), 1),
                          "tok_s": round(args.every / (now - block_start), 2)})
            block_start = now
            print(f"{n:7d} tokens  RSS {curve[-1]['rss_mb']:7.1f} MB  {curve[-1]['tok_s']:6.1f} tok/s",
                  flush=True)
    t = r.timings
    full = next(c for c in curve if c["tokens"] >= args.kv_size)
    after = [c["rss_mb"] for c in curve if c["tokens"] > full["tokens"]]
    print(f"{n} tokens generated ({r.finish_reason}); decode {t.decode_tok_s:.1f} tok/s overall; "
          f"RSS when the cache filled ({full['tokens']} tokens) {full['rss_mb']:.1f} MB, highest "
          f"after {max(after):.1f} MB, last {after[-1]:.1f} MB; block decode rates: median "
          f"{statistics.median(c['tok_s'] for c in curve):.1f}, first {curve[0]['tok_s']:.1f}, "
          f"last {curve[-1]['tok_s']:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "curve": curve, "decode_tok_s": t.decode_tok_s}, f)


if __name__ == "__main__":
    main()
