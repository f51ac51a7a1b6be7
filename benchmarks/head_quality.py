"""What storing the tied LM head in fewer bits costs: perplexity on WikiText-2 with the head kept in
float16 (as the file stores it), int8 per row, and 4-bit groups of 128/64/32 (round to nearest),
and the bytes the head adds to every decoded token.

    python benchmarks/head_quality.py MODEL --text ../shared/data/wikitext2-test.txt [--max-windows 16]
"""

import argparse
import json

import numpy as np

import tinyrt
from tinyrt.converters.quantize import fake_quantize
from tinyrt.perplexity import perplexity


def int8_rows(w: np.ndarray) -> np.ndarray:
    s = np.abs(w).max(axis=1, keepdims=True) / 127
    return np.round(w / s).clip(-127, 127) * s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--max-windows", type=int, default=16)
    args = ap.parse_args()
    llm = tinyrt.load(args.model)
    text = open(args.text, encoding="utf-8").read()
    head = llm.model.lm_head.astype(np.float16).astype(np.float32)   # as stored in the file
    V, H = head.shape
    variants = [
        ("f16", lambda: head, 2 * V * H),
        ("int8 per row", lambda: int8_rows(head), V * H + 2 * V),
    ] + [(f"int4 g{g}", lambda g=g: fake_quantize(head, g), V * H // 2 + V * (H // g) * 2.5)
         for g in (128, 64, 32) if H % g == 0]
    rows = {}
    for name, make, nbytes in variants:
        llm.model.lm_head = make().astype(np.float32)
        r = perplexity(llm, text, ctx=args.ctx, max_windows=args.max_windows)
        rows[name] = {"ppl": r.ppl, "head_mb_per_token": nbytes / 1e6}
        print(f"{name:14s} ppl {r.ppl:.4f}  head {nbytes / 1e6:6.1f} MB per decoded token", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
