"""`tinyrt pull`: fetch and convert a known model."""

from __future__ import annotations

import argparse

from tinyrt.registry import DEFAULT_DTYPE, DEFAULT_MODEL, KNOWN_MODELS, pull


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="fetch and convert a known model",
                       description=f"Known models: {', '.join(KNOWN_MODELS)} (default {DEFAULT_MODEL}).")
    p.add_argument("name", nargs="?", default=None, metavar="NAME")
    p.add_argument("--dtype", choices=["f16", "f32"], default=DEFAULT_DTYPE)


def main(args: argparse.Namespace) -> int:
    print(pull(args.name, dtype=args.dtype))
    return 0
