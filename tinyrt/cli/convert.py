"""`tinyrt convert`: a GGUF file or HF directory into a model directory (AWQ 4-bit by default)."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from tinyrt.converters import calibration

from .options import whole


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file or HF directory",
                       description="Convert SRC (a GGUF file, an HF directory, or any MODEL: a "
                                   "known name, a Hugging Face id) into the model "
                                   "directory OUT: 4-bit AWQ by default, or round-to-nearest "
                                   "(rtn), or float weights (none).")
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--method", choices=["awq", "rtn", "none"], default="awq")
    p.add_argument("--dtype", choices=["f16", "f32"], default="f16",
                   help="dtype of float tensors (all weights with --method none)")
    p.add_argument("--w-bit", type=whole, default=4, help="weight bits (4)")
    p.add_argument("--group-size", type=whole, default=None,
                   help="input channels per quantization group (default: 128, or the largest of "
                        "64 and 32 that divides every layer)")
    c = p.add_argument_group("AWQ calibration")
    c.add_argument("--calib", default=None, metavar="FILE",
                   help="plain text or JSON lines with a 'text' field (default: the Python "
                        "documentation shipped with Python)")
    c.add_argument("--calib-samples", type=whole, default=None, metavar="N",
                   help=f"calibration sequences (default: {calibration.DEFAULT_RULE}, "
                        f"{calibration.MIN_SAMPLES} to {calibration.PAPER_SAMPLES}, the AWQ "
                        "paper's size)")
    c.add_argument("--calib-seqlen", type=whole, default=calibration.DEFAULT_SEQLEN, metavar="N",
                   help="tokens per calibration sequence (default %(default)s)")
    c.add_argument("--no-clip", action="store_true", help="skip the clipping search")
    c.add_argument("--seed", type=whole, default=0, help="seed for choosing calibration samples")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="most bytes of weights per safetensors file (e.g. 2GB, 500MB; default "
                        "%(default)s); a larger model is written in shards with an index")
    p.add_argument("--requantize", action="store_true",
                   help="convert a source of quantized weights (a 4-bit GGUF) with awq or rtn, "
                        "rounding them a second time; without it such a source is refused "
                        "(tinyrt runs it as it is)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it is a model directory tinyrt wrote (and does not hold "
                        "SRC); anything else is never replaced")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


class ConvertProgress:
    """A conversion's progress on stderr: a rich bar in a terminal; elsewhere (a log, a pipe)
    plain lines, one for each tenth of the work (and the end) once LINE_EVERY_S seconds passed
    since the last, with the time taken and an estimate of the rest."""

    LINE_EVERY_S = 30

    def __init__(self, description: str = "converting"):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        # no bar where stderr is no terminal: its stop leaves a blank line there
        console = Console(stderr=True)
        self.plain = not console.is_terminal
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                            transient=True, disable=self.plain)
        self.task = None
        self.description = description
        self.start = self.said_at = time.monotonic()
        self.said = 0

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=total)
        self.bar.update(self.task, completed=done)
        now = time.monotonic()
        if self.plain and now - self.said_at >= self.LINE_EVERY_S and (
                done == total or done - self.said >= max(total // 10, 1)):
            spent = now - self.start
            left = spent / done * (total - done)
            print(f"{self.description}: {done}/{total}, {_minutes(spent)} so far, about "
                  f"{_minutes(left)} left", file=sys.stderr, flush=True)
            self.said, self.said_at = done, now

    def close(self) -> None:
        self.bar.stop()


def main(args: argparse.Namespace) -> int:
    from tinyrt.converters import convert
    from tinyrt.converters.conversion import bits_per_weight
    from tinyrt.errors import printable
    from tinyrt.memory import parse_size

    from tinyrt.converters.writer import check_output
    from tinyrt.paths import user_path
    from tinyrt.registry import NotFetched, resolve

    shard_bytes = parse_size(args.max_shard_size, "--max-shard-size")
    try:
        src = resolve(args.src, what="SRC", download=False)
    except NotFetched:
        # a known name or a Hugging Face id to fetch first: OUT is checked before the download
        check_output(user_path(args.out, "OUT"), args.force)
        src = resolve(args.src, what="SRC")

    what = "layers" if args.method != "none" else "tensors"
    progress = ConvertProgress(f"{args.method} {src.name} ({what})")
    start = time.perf_counter()
    try:
        out = convert(src, args.out, method=args.method, dtype=args.dtype, bits=args.w_bit,
                      group_size=args.group_size, calib=args.calib,
                      calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen,
                      clip=not args.no_clip, seed=args.seed, force=args.force,
                      max_shard_bytes=shard_bytes, progress=progress, requantize=args.requantize,
                      notice=lambda text: print(printable(f"note: {text}"), file=sys.stderr,
                                                  flush=True))
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    size_mb = sum(f.stat().st_size for f in Path(out).iterdir()) / 1e6
    linear_bpw, file_bpw = bits_per_weight(out)
    print(f"{printable(str(out))}: {size_mb:.1f} MB, {linear_bpw:.2f} bits per linear weight "
          f"({file_bpw:.2f} per parameter overall), {seconds:.1f} s, peak RSS {peak_mb:.0f} MB",
          file=sys.stderr)
    print(printable(str(out)))
    return 0
