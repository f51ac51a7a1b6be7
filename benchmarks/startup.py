"""Cold and warm start of `tinyrt generate` on the default model, as a user meets them.

Cold: an empty cache directory, so the run fetches the model with pip and loads it.
Warm: the same cache again. Prints the median wall time of each over --runs runs, and the
load/TTFT figures `generate --json` reports.

    python benchmarks/startup.py [--runs 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"


def run(cache: str) -> tuple[float, dict]:
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "tinyrt", "generate", PROMPT, "--json"],
                       env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    cold, warm, loads, ttfts = [], [], [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            wall, _ = run(cache)
            cold.append(wall)
            wall, out = run(cache)
            warm.append(wall)
            loads.append(out["timings"]["load_s"])
            ttfts.append(out["timings"]["ttft_s"])
    print(f"reply: {out['text']!r}")
    print(f"cold start (fetch + load + reply):         median {statistics.median(cold):.1f} s "
          f"of {[round(x, 1) for x in cold]}")
    print(f"warm start (load + reply):                 median {statistics.median(warm):.1f} s "
          f"of {[round(x, 1) for x in warm]}")
    print(f"warm load_s median {statistics.median(loads):.2f} s, ttft median "
          f"{statistics.median(ttfts) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
