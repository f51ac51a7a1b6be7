"""Hostile input, measured: runs the tests that feed the command line bad files, paths, values
and templates (each through tests/helpers.run_tinyrt, which records every run's exit code, wall
time and the child's own peak RSS) and prints how long and how much memory the refusals took.
The bar (issue 32): exit code not 0, one line on stderr, no traceback, within 10 s and 1 GB.

    python benchmarks/hostile.py [--json] [pytest args...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_hostile_models.py", "tests/test_hostile_files.py", "tests/test_paths.py",
         "tests/test_convert.py", "tests/test_tokenizer.py", "tests/test_chat_template.py",
         "tests/test_cli.py", "tests/test_bench.py", "tests/test_perplexity.py",
         "tests/test_chat.py", "tests/test_hostile_tensors.py", "tests/test_hostile_numbers.py",
         "tests/test_hub.py", "tests/test_registry.py", "tests/test_terminal_output.py"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args, extra = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "runs.jsonl"
        env = {**os.environ, "TINYRT_RUN_LOG": str(log)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
               "not real_model", *(extra or TESTS)]
        tests = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    refused = [r for r in runs if r["returncode"] != 0]
    lines = [r["stderr"].strip() for r in refused]
    out = {
        "tests": tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else "",
        "runs": len(runs), "refused": len(refused),
        "tracebacks": sum("Traceback" in r["stderr"] for r in runs),
        "multi_line": sum(len([x for x in line.splitlines() if x.strip()]) != 1 for line in lines),
        "seconds_median": statistics.median(r["seconds"] for r in refused) if refused else None,
        "seconds_max": max((r["seconds"] for r in refused), default=None),
        "peak_mb_median": statistics.median(r["peak_bytes"] for r in refused) / 2**20
        if refused else None,
        "peak_mb_max": max((r["peak_bytes"] for r in refused), default=0) / 2**20,
        "slowest": max(refused, key=lambda r: r["seconds"])["args"] if refused else None,
        "largest": max(refused, key=lambda r: r["peak_bytes"])["args"] if refused else None,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>15}: {v:.2f}" if isinstance(v, float) else f"{k:>15}: {v}")
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())
