"""`tinyrt rm`: remove models from tinyrt's cache (never the Hugging Face cache's files, nor
anything tinyrt did not write)."""

from __future__ import annotations

import argparse
import sys

from tinyrt.errors import TinyrtError, printable


def add_parser(sub) -> None:
    p = sub.add_parser("rm", help="remove cached models",
                       description="Remove models from tinyrt's cache, by the names `tinyrt list` "
                                   "shows (asks first). The Hugging Face cache is huggingface_hub's "
                                   "to manage (`hf cache rm`).")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--all", action="store_true", help="everything in tinyrt's cache")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")


def _say(text: str, **kwargs) -> None:
    """A line of rm's: its names and paths are a cache's, shown safe (`printable`)."""
    print(printable(text), **kwargs)


def _confirm(question: str) -> bool:
    _say(question, end=" ", file=sys.stderr, flush=True)
    try:
        return input().strip().lower() in ("y", "yes")
    except EOFError:
        return False


def main(args: argparse.Namespace) -> int:
    from tinyrt.cli.listing import size_text
    from tinyrt.model_cache import FetchRunning, cache_dir, remove_cached, tinyrt_cached
    from tinyrt.registry import ALIASES, hf_cached

    if args.all == bool(args.names):
        raise TinyrtError("name the models to remove, or --all (not both)")
    cached = tinyrt_cached()
    if args.all:
        targets = cached
    else:
        targets = []
        for name in args.names:
            found = [m for m in cached if m.name == ALIASES.get(name, name)]
            if not found:
                if any(m.name == name for m in hf_cached()):
                    raise TinyrtError(f"{name} is in the Hugging Face cache, not tinyrt's: "
                                      f"`hf cache rm` removes it")
                have = ", ".join(m.name for m in cached) or "nothing"
                raise TinyrtError(f"{name!r} is not in tinyrt's cache ({cache_dir()} holds "
                                  f"{have}; see `tinyrt list`)")
            targets += [m for m in found if m not in targets]
    if not targets:
        _say(f"nothing to remove: tinyrt's cache ({cache_dir()}) holds no models", file=sys.stderr)
        return 0
    total = sum(m.size for m in targets)
    if not args.yes:
        if not sys.stdin.isatty():
            raise TinyrtError("not removing without confirmation: stdin is not a terminal "
                              "(add -y)")
        for m in targets:
            _say(f"  {m.name}  {size_text(m.size)}  {m.path}", file=sys.stderr)
        if not _confirm(f"Remove {len(targets)} item(s), {size_text(total)}? [y/N]"):
            print("nothing removed", file=sys.stderr)
            return 0
    kept = 0
    for m in targets:
        try:
            remove_cached(m)
        except FetchRunning as e:            # (the others are still removed)
            _say(f"tinyrt: {e}", file=sys.stderr)
            kept += 1
            continue
        _say(f"removed {m.name} ({size_text(m.size)}): {m.path}")
    return 1 if kept and not args.all else 0
