"""The AWQ quality bar: perplexity on WikiText-2 (ctx 2048, the same windows for every model) of the
float model, round-to-nearest and AWQ at each group size that fits, with conversion time and peak
RSS, and AWQ's share of RTN's loss: (PPL(AWQ) - PPL(float)) / (PPL(RTN) - PPL(float)).

    python benchmarks/awq_quality.py [SRC.gguf] --text ../shared/data/wikitext2-test.txt \
        [--groups 64 32] [--max-windows N] [--out DIR]

SRC defaults to the default model's GGUF (a Q4_1 file: its "float" model is that file dequantized).
Each conversion runs in its own process, so its peak RSS is its own.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def tinyrt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyrt", *args], capture_output=True, text=True,
                          check=True)


def ppl(model: Path, args) -> float:
    extra = ["--max-windows", str(args.max_windows)] if args.max_windows else []
    out = tinyrt("ppl", "-m", str(model), "--text", args.text, "--ctx", str(args.ctx), "--json", *extra)
    return json.loads(out.stdout)["ppl"]


def convert(src: str, out: Path, *options) -> dict:
    start = time.perf_counter()
    p = tinyrt("convert", src, str(out), "--force", *options)
    summary = p.stderr.strip().splitlines()[-1]   # "<out>: N MB, ... s, peak RSS M MB"
    return {"seconds": time.perf_counter() - start, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="?", default=None)
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--groups", type=int, nargs="+", default=[128, 64, 32])
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--out", default="awq-quality")
    args = ap.parse_args()
    if args.src is None:
        from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf
        args.src = str(fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL]))
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    rows = {}
    convert(args.src, out / "float", "--method", "none", "--dtype", "f32")
    rows["float"] = {"ppl": ppl(out / "float", args)}
    print(f"float  ppl {rows['float']['ppl']:.4f}", flush=True)
    for g in args.groups:
        for method in ("rtn", "awq"):
            name = f"{method}-g{g}"
            try:
                # (the default model's GGUF is 4-bit: its "float" model is dequantized)
                info = convert(args.src, out / name, "--method", method, "--group-size", str(g),
                               "--requantize")
            except subprocess.CalledProcessError as e:
                print(f"{name}: {e.stderr.strip().splitlines()[-1]}", flush=True)
                break
            rows[name] = {**info, "ppl": ppl(out / name, args)}
            print(f"{name:7s} ppl {rows[name]['ppl']:.4f}  ({info['summary']})", flush=True)
        if f"awq-g{g}" in rows:
            f, r, a = rows["float"]["ppl"], rows[f"rtn-g{g}"]["ppl"], rows[f"awq-g{g}"]["ppl"]
            rows[f"awq-g{g}"]["share_of_rtn_loss"] = (a - f) / (r - f)
            print(f"g{g}: AWQ keeps {(a - f) / (r - f):.2f} of RTN's perplexity loss "
                  f"(bar: <= 0.5)", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
