"""`tinyrt bench [MODEL]`: load time, prefill, decode, peak memory and bandwidth of a model."""

from __future__ import annotations

import argparse
import json
import sys

from .options import (add_draft_options, add_model_option, add_runtime_options, load_llm,
                      load_options, number)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure a model's speed and memory",
                       description="Load time, TTFT and prefill tok/s of a prompt, decode tok/s "
                                   "(median of --runs), peak RSS, weight bytes per decoded token "
                                   "and the GB/s it makes.")
    add_model_option(p, positional=True)
    # (read leniently, checked by bench.check_args before the model loads); the short names
    # and the second long ones are llama-bench's
    p.add_argument("--prompt-tokens", "-p", "--n-prompt", dest="prompt_tokens", type=number,
                   default=512, metavar="N", help="tokens of the prompt (default 512)")
    p.add_argument("--decode-tokens", "-n", "--n-gen", dest="decode_tokens", type=number,
                   default=128, metavar="N", help="tokens decoded per run (default 128)")
    p.add_argument("--runs", "-r", "--repetitions", dest="runs", type=number, default=5,
                   metavar="N", help="runs; decode's figure is their median (default 5)")
    add_draft_options(p)
    add_runtime_options(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


class BenchProgress:
    """What bench is doing, on stderr (stdout holds the figures alone): in a terminal a rich
    line that goes when bench ends (the phase, run k of n, the time it has taken); where stderr
    is no terminal (a log, a pipe), a plain line as each phase starts, none per run."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self.terminal = console.is_terminal
        self.bar = Progress(SpinnerColumn(), TextColumn("bench: {task.description}"), BarColumn(),
                            TimeElapsedColumn(), console=console, transient=True,
                            redirect_stdout=False,
                            disable=not self.terminal)
        self.task, self.phase = None, None

    def __call__(self, what: str, done: int = 0, total: int | None = None, *,
                 log: bool = True) -> None:
        """Phase `what`, `done` of `total` steps (None: not counted). `log` False: no line where
        stderr is no terminal (the loading's: an error in it stays the one line there)."""
        if what != self.phase and log and not self.terminal:
            print(f"bench: {what}", file=sys.stderr, flush=True)
        self.phase = what
        shown = what + (f": {min(done + 1, total)} of {total}" if total else "")
        if self.task is None:
            self.bar.start()
            self.task = self.bar.add_task(shown, total=total)
        self.bar.update(self.task, description=shown, completed=done, total=total)

    def close(self) -> None:
        self.bar.stop()


def _threads(n: int | None) -> str:
    return "BLAS threads" if not n else "1 thread" if n == 1 else f"{n} threads"


def main(args: argparse.Namespace) -> int:
    from tinyrt import bench
    from tinyrt.errors import TinyrtError, printable
    from tinyrt.kv_options import CacheOptions

    # all before the model loads; the cache holds the prompt and the decoded tokens
    bench.check_args(args.prompt_tokens, args.decode_tokens, args.runs, flags=True)
    load = load_options(args, cache=CacheOptions(kv_size=args.prompt_tokens + args.decode_tokens))
    progress = BenchProgress()
    try:
        progress("loading the model", log=False)
        llm = load_llm(args, load)
        r = bench.run(llm, args.prompt_tokens, args.decode_tokens, args.runs, progress)
    except ValueError as e:
        raise TinyrtError(str(e)) from None
    finally:
        progress.close()
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{printable(r['model'])} on {r['device']} ({_threads(r['threads'])})\n"
          f"  load           {r['load_s']:8.2f} s\n"
          f"  TTFT           {r['ttft_s'] * 1e3:8.0f} ms   ({r['prompt_tokens']}-token prompt)\n"
          f"  prefill        {r['prefill_tok_s']:8.1f} tok/s\n"
          f"  decode         {r['decode_tok_s']:8.1f} tok/s   (median of {args.runs} x "
          f"{r['decode_tokens']} tokens)\n"
          f"  peak RSS       {r['peak_rss_mb']:8.0f} MB\n"
          f"  read/token     {r['weight_mb_per_token']:8.1f} MB weights + "
          f"{r['kv_mb_per_token']:.1f} MB KV cache -> {r['decode_gb_s']:.1f} GB/s\n"
          f"  KV cache       {r['kv_cache']}")
    if r["device"] == "cuda":
        print(f"  first reply    {r['first_reply_extra_s'] * 1e3:8.0f} ms   more decode (the "
              "step's eager run and graph capture, once)")
    s = r.get("speculative")
    if s:
        print(f"  draft          {printable(s['drafter'])}: {s['accept_rate']:.0%} of drafts accepted, "
              f"{s['tokens_per_step']:.2f} tokens per target pass, gamma {s['gamma']}, "
              f"draft {s['draft_s']:.2f} s / target {s['target_s']:.2f} s")
    return 0
