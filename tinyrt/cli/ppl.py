"""`tinyrt ppl`: perplexity of a model on a text file."""

from __future__ import annotations

import argparse
import json

from .options import (add_cache_options, add_model_option, add_runtime_options, cache_options,
                      load_llm, load_options, whole)


def add_parser(sub) -> None:
    p = sub.add_parser("ppl", help="perplexity on a text file",
                       description="Perplexity by the AWQ papers' protocol: the text tokenized "
                                   "whole, non-overlapping windows of --ctx tokens. With --stream, "
                                   "the StreamingLLM protocol: the text fed one token at a time "
                                   "through a KV cache of --kv-policy and --kv-size.")
    add_model_option(p, positional=True)
    p.add_argument("--text", required=True, metavar="FILE")
    p.add_argument("--ctx", "-c", "--ctx-size", dest="ctx", type=whole, default=2048, metavar="N",
                   help="tokens per window (default 2048; -c/--ctx-size: llama-perplexity's "
                        "names)")
    p.add_argument("--max-windows", type=whole, default=None)
    p.add_argument("--json", action="store_true")
    add_runtime_options(p)
    st = p.add_argument_group("KV cache (all but --kv-type, --kv-group and --kv-residual with --stream only)")
    st.add_argument("--stream", action="store_true", help="token by token through a KV cache")
    add_cache_options(st, policy="sink", size=1024, ctx_size=False)
    st.add_argument("--max-tokens", type=whole, default=None, help="use the text's first tokens")


def main(args: argparse.Namespace) -> int:
    from tinyrt.kv_options import CacheOptions
    from tinyrt.paths import read_text, user_path
    from tinyrt.perplexity import check_options, perplexity, stream_perplexity
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # all before the model loads: a mistake is reported at once. The model's own cache is of
    # the element type asked for (the windows take its options); --stream's is its own
    check_options(args.ctx, args.max_windows, args.max_tokens)
    stream_cache = cache_options(args)
    load = load_options(args, cache=CacheOptions(kv_type=args.kv_type, kv_group=args.kv_group,
                                                 kv_residual=args.kv_residual))
    text = read_text(user_path(args.text, "--text"), "--text")
    llm = load_llm(args, load)
    console = Console(stderr=True)     # (no bar where stderr is no terminal: a blank line there)
    bar = Progress(TextColumn("ppl"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=console, transient=True, disable=not console.is_terminal)
    task = None

    def progress(done, total):
        nonlocal task
        if task is None:
            task = bar.add_task("windows", total=total)
        bar.update(task, completed=done)

    with bar:
        if args.stream:
            result = stream_perplexity(llm, text, stream_cache,
                                       max_tokens=args.max_tokens, progress=progress)
        else:
            result = perplexity(llm, text, ctx=args.ctx, max_windows=args.max_windows,
                                progress=progress)
    if args.json:
        print(json.dumps(result.as_dict()))
    elif args.stream:
        print(f"ppl {result.ppl:.4f} over {result.tokens} tokens streamed through a "
              f"{args.kv_policy} cache of {stream_cache.size_for(llm.config)}, "
              f"{result.seconds:.1f} s")
    else:
        print(f"ppl {result.ppl:.4f} over {result.tokens} tokens ({result.windows} windows of "
              f"{args.ctx}), {result.seconds:.1f} s")
    return 0
