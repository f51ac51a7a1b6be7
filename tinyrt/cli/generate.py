"""`tinyrt generate`: one prompt, the reply streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from tinyrt.errors import TinyrtError, printable, shown

from .options import (add_generation_options, add_model_option, add_raw_output_option,
                      generation_kwargs, load_llm, load_options, read_stdin, speculative_line,
                      text_arg)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to one prompt",
                       description="Stream a reply to PROMPT ('-' reads it from stdin) from "
                                   "MODEL (or -m MODEL; default: the default model).")
    add_prompt_arguments(p)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--stats", action="store_true", help="print timings to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_raw_output_option(p)
    add_generation_options(p)


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """[MODEL] [PROMPT] as positionals, -m MODEL and -p PROMPT (llama.cpp's) as options;
    `place_prompt` says which a lone positional is."""
    add_model_option(p, positional=True)
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="'-' reads it from stdin")
    p.add_argument("-p", "--prompt", dest="prompt_option", default=None, metavar="PROMPT",
                   help="the same as PROMPT (llama.cpp's spelling)")


def place_prompt(args: argparse.Namespace, lone: str) -> None:
    """Sort the positionals that `add_prompt_arguments` took into args.model_pos and
    args.prompt, -p's PROMPT among them. argparse fills MODEL first; a lone positional is what
    -m or -p leaves open, else `lone` ("model": `run MODEL`, "prompt": `generate PROMPT`), but
    text with spaces that names no file is a PROMPT (`run "What is the capital of France?"`)."""
    given = [a for a in (args.model_pos, args.prompt) if a is not None]
    if len(given) == 1:
        open_ = [slot for slot, option in (("model", args.model), ("prompt", args.prompt_option))
                 if option is None]
        slot = open_[0] if len(open_) == 1 else lone
        if slot == "model" and len(open_) != 1 and _reads_as_prompt(given[0]):
            slot = "prompt"          # (`run "What is ...?"`: text, not a model's name)
        args.model_pos, args.prompt = (given[0], None) if slot == "model" else (None, given[0])
    if args.prompt_option is not None:
        if args.prompt is not None:
            raise TinyrtError(f"two prompts given, {shown(args.prompt)} and -p "
                              f"{shown(args.prompt_option)}: give one")
        args.prompt, args.prompt_option = args.prompt_option, None


def _reads_as_prompt(text: str) -> bool:
    """Whether a lone argument of `run` is a prompt, not MODEL: text with spaces that names no
    file (no model's name, alias or Hugging Face id has one)."""
    import os

    return any(c.isspace() for c in text.strip()) and not os.path.exists(text)


def main(args: argparse.Namespace) -> int:
    place_prompt(args, lone="prompt")
    if args.prompt is None:
        raise TinyrtError("no PROMPT given: tinyrt generate [MODEL] PROMPT, or -p PROMPT "
                          "('-' reads it from stdin)")
    return answer(args)


def answer(args: argparse.Namespace) -> int:
    """Stream the reply to args.prompt (placed by `place_prompt`)."""
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
    safe = (lambda s: s) if args.raw_output else printable
    text, tokens, last = [], 0, None
    for r in llm.stream(prompt, raw=args.raw, **options):
        last = r
        tokens += r.token is not None
        if args.json:
            text.append(r.text)
        elif r.text:
            sys.stdout.write(safe(r.text))
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
