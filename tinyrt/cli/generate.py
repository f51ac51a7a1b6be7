"""`tinyrt generate`: one prompt, the reply streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from tinyrt.errors import TinyrtError

from .options import (add_generation_options, add_model_option, generation_kwargs, load_llm,
                      load_options, read_stdin, speculative_line, text_arg)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to one prompt",
                       description="Stream a reply to PROMPT ('-' reads it from stdin) from "
                                   "MODEL (or -m MODEL; default: the default model).")
    add_model_option(p, positional=True)
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--stats", action="store_true", help="print timings to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_generation_options(p)


def main(args: argparse.Namespace) -> int:
    from tinyrt.api import MAX_TEXT_BYTES

    # every input checked before the model loads
    options = generation_kwargs(args)
    load = load_options(args)
    if args.prompt == "-":
        prompt = read_stdin("PROMPT", MAX_TEXT_BYTES)
    else:
        prompt = text_arg(args.prompt, "PROMPT")
    if not prompt:
        raise TinyrtError("PROMPT is empty")
    llm = load_llm(args, load)
    text, tokens, last = [], 0, None
    for r in llm.stream(prompt, raw=args.raw, **options):
        last = r
        tokens += r.token is not None
        if args.json:
            text.append(r.text)
        elif r.text:
            sys.stdout.write(r.text)
            sys.stdout.flush()
    t = last.timings
    timings = {"load_s": t.load_s, "ttft_s": t.ttft_s, "prefill_tok_s": t.prefill_tok_s,
               "decode_tok_s": t.decode_tok_s}
    if t.speculative is not None:
        timings["speculative"] = t.speculative.as_dict()
    if args.json:
        print(json.dumps({"text": "".join(text), "tokens": tokens,
                          "finish_reason": last.finish_reason, "timings": timings}))
        return 0
    print()
    if args.stats:
        print(f"load {t.load_s:.2f} s · ttft {t.ttft_s * 1000:.0f} ms · "
              f"prefill {t.prompt_tokens} tok @ {t.prefill_tok_s:.1f} tok/s · "
              f"decode {t.generated_tokens} tok @ {t.decode_tok_s:.1f} tok/s · "
              f"finish {last.finish_reason}", file=sys.stderr)
        if t.speculative is not None:
            print(speculative_line(t), file=sys.stderr)
    return 0
