"""`tinyrt convert`: a GGUF file or HF directory into a model directory."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file or HF directory",
                       description="Convert SRC (GGUF file or HF directory) into the model "
                                   "directory OUT.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--dtype", choices=["f16", "f32"], default="f16", help="weight dtype")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")


def main(args: argparse.Namespace) -> int:
    from tinyrt.converters import convert
    from tinyrt.registry import ConvertProgress

    progress = ConvertProgress()
    try:
        out = convert(args.src, args.out, dtype=args.dtype, force=args.force, progress=progress)
    finally:
        progress.close()
    print(out)
    return 0
