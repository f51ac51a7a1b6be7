"""A newcomer's first reply: `tinyrt chat` on the default model, from start to the first token
of the reply on stdout, cold (nothing cached: the model fetched with pip, the kernels compiled)
and warm (the same caches again).

Cold runs get empty directories for the user cache (tinyrt's and pip's: XDG_CACHE_HOME) and for
Numba's compiled kernels (NUMBA_CACHE_DIR); warm runs reuse them. --python picks the interpreter
of the installation to time (e.g. a fresh venv's after `pip install .`).

    python benchmarks/first_reply.py [--python PY] [--runs 3] [--busy N] [--json]

--busy N runs N busy loops (`python -c "while True: pass"`) beside it all the while: the first
reply on a machine that is not idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from under_load import busy_loops

QUESTION = "What is the capital of France?\n"


def first_reply(python: str, cache: str, timeout: float = 900) -> float:
    """Seconds from starting `tinyrt chat` to its first byte on stdout."""
    env = dict(os.environ, XDG_CACHE_HOME=os.path.join(cache, "user"),
               NUMBA_CACHE_DIR=os.path.join(cache, "numba"))
    log = os.path.join(cache, "stderr.txt")
    with open(log, "wb") as err:
        start = time.perf_counter()
        p = subprocess.Popen([python, "-m", "tinyrt", "chat", "--temperature", "0", "-n", "8"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                             cwd=cache)  # (not the repository: its tinyrt/ would shadow the install)
        p.stdin.write(QUESTION.encode())
        p.stdin.close()
        first = p.stdout.read(1)
        took = time.perf_counter() - start
        p.stdout.read()
        failed = p.wait(timeout) != 0 or not first
    if failed:
        with open(log) as f:
            raise SystemExit(f"tinyrt chat failed (exit {p.returncode}): {f.read()[-500:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="busy loops running beside it")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cold, warm = [], []
    with busy_loops(args.busy):
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as cache:
                cold.append(first_reply(args.python, cache))
                warm.append(first_reply(args.python, cache))
    out = {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
           "cold_runs": cold, "warm_runs": warm}
    print(json.dumps(out) if args.json else
          f"first reply token{f' beside {args.busy} busy loops' if args.busy else ''}: "
          f"cold {out['cold_s']:.1f} s, warm {out['warm_s']:.1f} s "
          f"(medians of {args.runs}; cold {', '.join(f'{c:.1f}' for c in cold)}; "
          f"warm {', '.join(f'{w:.1f}' for w in warm)})")


if __name__ == "__main__":
    main()
