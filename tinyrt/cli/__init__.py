"""`tinyrt` command line: one module per command, each with `add_parser` and `main`."""

from __future__ import annotations

import argparse
import sys

from tinyrt.errors import TinyrtError

from . import bench, chat, convert, generate, info, ppl, pull, serve

COMMANDS = {"pull": pull, "convert": convert, "generate": generate, "chat": chat, "ppl": ppl, "bench": bench, "info": info,
            "serve": serve}


class Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line, as every error of tinyrt (not the usage
    first); the commands' parsers are of this class too (add_subparsers makes its own kind)."""

    def error(self, message: str):
        message = " ".join(message.split())
        self.exit(2, f"tinyrt: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from tinyrt import __version__

    parser = Parser(prog="tinyrt", description="Edge / on-device LLM chat runtime.")
    parser.add_argument("--version", action="version", version=f"tinyrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].main(args) or 0
    except TinyrtError as e:
        print(f"tinyrt: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a program that stopped reading
        sys.stderr.close()
        return 0
