"""`tinyrt chat`: a multi-turn conversation over stdin, one line per user turn."""

from __future__ import annotations

import argparse
import sys

from .options import add_generation_options, add_model_option, generation_kwargs, load_llm


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model",
                       description="Chat with a model: one line per turn, Ctrl-D (end of input) "
                                   "to quit, Ctrl-C to stop a reply.")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="same as -m")
    add_model_option(p)
    add_generation_options(p)


def main(args: argparse.Namespace) -> int:
    args.model = args.model or args.model_pos
    llm = load_llm(args)
    kwargs = generation_kwargs(args)
    system = kwargs.pop("system")
    interactive = sys.stdin.isatty()
    messages = [] if system is None else [{"role": "system", "content": system}]
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for r in llm.stream(messages, **kwargs):
                reply.append(r.text)
                sys.stdout.write(r.text)
                sys.stdout.flush()
        except KeyboardInterrupt:  # stop the reply, keep the conversation
            pass
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0
