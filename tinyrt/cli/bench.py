"""`tinyrt bench [MODEL]`: load time, prefill, decode, peak memory and bandwidth of a model."""

from __future__ import annotations

import argparse
import json

from .options import (add_draft_options, add_model_option, add_runtime_options, load_llm,
                      load_options, number)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure a model's speed and memory",
                       description="Load time, TTFT and prefill tok/s of a prompt, decode tok/s "
                                   "(median of --runs), peak RSS, weight bytes per decoded token "
                                   "and the GB/s it makes.")
    add_model_option(p, positional=True)
    # (read leniently, checked by bench.check_args before the model loads)
    p.add_argument("--prompt-tokens", type=number, default=512)
    p.add_argument("--decode-tokens", type=number, default=128)
    p.add_argument("--runs", type=number, default=5)
    add_draft_options(p)
    add_runtime_options(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def main(args: argparse.Namespace) -> int:
    from tinyrt import bench
    from tinyrt.errors import TinyrtError
    from tinyrt.kv_options import CacheOptions

    # all before the model loads; the cache holds the prompt and the decoded tokens
    bench.check_args(args.prompt_tokens, args.decode_tokens, args.runs, flags=True)
    llm = load_llm(args, load_options(
        args, cache=CacheOptions(kv_size=args.prompt_tokens + args.decode_tokens)))
    try:
        r = bench.run(llm, args.prompt_tokens, args.decode_tokens, args.runs)
    except ValueError as e:
        raise TinyrtError(str(e)) from None
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']} on {r['device']} ({r['threads'] or 'BLAS'} threads)\n"
          f"  load           {r['load_s']:8.2f} s\n"
          f"  TTFT           {r['ttft_s'] * 1e3:8.0f} ms   ({r['prompt_tokens']}-token prompt)\n"
          f"  prefill        {r['prefill_tok_s']:8.1f} tok/s\n"
          f"  decode         {r['decode_tok_s']:8.1f} tok/s   (median of {args.runs} x "
          f"{r['decode_tokens']} tokens)\n"
          f"  peak RSS       {r['peak_rss_mb']:8.0f} MB\n"
          f"  read/token     {r['weight_mb_per_token']:8.1f} MB weights + "
          f"{r['kv_mb_per_token']:.1f} MB KV cache -> {r['decode_gb_s']:.1f} GB/s\n"
          f"  KV cache       {r['kv_cache']}")
    s = r.get("speculative")
    if s:
        print(f"  draft          {s['drafter']}: {s['accept_rate']:.0%} of drafts accepted, "
              f"{s['tokens_per_step']:.2f} tokens per target pass, gamma {s['gamma']}, "
              f"draft {s['draft_s']:.2f} s / target {s['target_s']:.2f} s")
    return 0
