"""`tinyrt pull`: fetch a known model."""

from __future__ import annotations

import argparse

from tinyrt.registry import DEFAULT_MODEL, KNOWN_MODELS, pull


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="fetch a known model",
                       description=f"Known models: {', '.join(KNOWN_MODELS)} (default {DEFAULT_MODEL}). "
                                   "Prints the path of its GGUF file, which runs as it is.")
    p.add_argument("name", nargs="?", default=None, metavar="NAME")


def main(args: argparse.Namespace) -> int:
    print(pull(args.name))
    return 0
