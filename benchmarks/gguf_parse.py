"""How long opening a GGUF file takes: tinyrt's reader (models/gguf.py: metadata, a 49k-token
vocabulary and its merges, the tensor table) against the gguf package's GGUFReader, the reason
tinyrt has its own. Medians of --runs, each in a fresh process (no warm Python objects).

    python benchmarks/gguf_parse.py [FILE.gguf] [--runs 5]

FILE: a GGUF file (default: the default model's, fetched on first use).
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time
from gguf import GGUFReader
from tinyrt.models.gguf import GGUFFile
reader, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if reader == "tinyrt":
    n = len(GGUFFile(path).get("tokenizer.ggml.tokens"))
else:
    n = len(GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": n}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if args.file is None:
        from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf

        args.file = str(fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL]))
    for reader in ("tinyrt", "GGUFReader"):
        runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, reader, args.file],
                                          capture_output=True, text=True, check=True).stdout)
                for _ in range(args.runs)]
        times = [r["seconds"] for r in runs]
        print(f"{reader:>10}: median {statistics.median(times) * 1000:.0f} ms of "
              f"{[round(t * 1000) for t in times]} ms ({runs[0]['tokens']} tokens)")


if __name__ == "__main__":
    main()
