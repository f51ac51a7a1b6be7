"""The CPU backend's quantized linears on a real model, per projection: one token (the GEMV, over
all layers in turn, so weights come from memory as in decode; G weights/s and GB/s of packed
codes, scales and offsets read) and a prompt of --tokens tokens (dequantize + BLAS). Medians over
--rounds processes.

    python benchmarks/cpu_kernels.py MODEL [--threads 2] [--reps 30] [--tokens 512] [--rounds 5]

MODEL: a quantized GGUF file or AWQ model directory.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

NAMES = ("qkv", "o", "gate_up", "down")


def child(args) -> dict:
    import numpy as np

    import tinyrt
    from tinyrt.kernels.cpu.linear import q_gemv

    llm = tinyrt.load(args.model, device="cpu", threads=args.threads, quiet=True)
    be, layers = llm.model.backend, llm.model.layers
    rows = {}
    for name in NAMES:
        ws = [getattr(L, name) for L in layers]
        n_out, n_in = ws[0].shape
        x = np.random.default_rng(0).standard_normal((1, n_in)).astype(np.float32)
        y = np.empty((1, n_out), np.float32)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for w in ws:
                q_gemv(x, w, y, be.threads)
            times.append((time.perf_counter() - start) / len(ws))
        xp = np.random.default_rng(1).standard_normal((args.tokens, n_in)).astype(np.float32)
        be.linear(xp, ws[0])
        prompt = []
        for _ in range(5):
            start = time.perf_counter()
            be.linear(xp, ws[0])
            prompt.append(time.perf_counter() - start)
        gemv = statistics.median(times)
        nbytes = ws[0].nbytes
        rows[name] = {"shape": [n_out, n_in], "gemv_us": gemv * 1e6, "gw_s": n_out * n_in / gemv / 1e9,
                      "gb_s": nbytes / gemv / 1e9, "prompt_ms": statistics.median(prompt) * 1e3}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="processes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    cmd = [sys.executable, __file__, args.model, "--threads", str(args.threads), "--reps",
           str(args.reps), "--tokens", str(args.tokens), "--child"]
    rounds = [json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
              for _ in range(args.rounds)]
    print(f"{args.threads} threads; one token: median over {args.reps} passes of all layers; "
          f"prompt: {args.tokens} tokens; medians of {args.rounds} processes")
    print(f"{'linear':9s} {'out x in':>11s} {'GEMV us':>8s} {'G w/s':>6s} {'GB/s':>5s} {'prompt ms':>10s}")
    total = 0.0
    for name in NAMES:
        m = {k: statistics.median(r[name][k] for r in rounds) for k in ("gemv_us", "gw_s", "gb_s", "prompt_ms")}
        shape = rounds[0][name]["shape"]
        total += m["gemv_us"]
        print(f"{name:9s} {shape[0]:5d}x{shape[1]:<5d} {m['gemv_us']:8.1f} {m['gw_s']:6.1f} "
              f"{m['gb_s']:5.1f} {m['prompt_ms']:10.2f}")
    print(f"one layer's GEMVs: {total:.0f} us")


if __name__ == "__main__":
    main()
