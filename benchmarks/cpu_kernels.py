"""The CPU backend's 4-bit linears on a real model, per projection: one token (the GEMV, over all
layers in turn, so weights come from memory as in decode) and a prompt of --tokens tokens
(dequantize + BLAS). Each figure runs in its own process, --rounds times alternately with 512-bit
vectors (the backend's choice on AVX-512 CPUs) and with LLVM's default 256-bit preference; the
medians over rounds are printed with their ratio.

    python benchmarks/cpu_kernels.py AWQ_MODEL_DIR [--threads 2] [--reps 30] [--tokens 512] [--rounds 5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NAMES = ("qkv", "o", "gate_up", "down")


def child(args) -> dict:
    import numpy as np

    import tinyrt
    from tinyrt.kernels import cpu

    llm = tinyrt.load(args.model, device="cpu", threads=args.threads, quiet=True)
    be, layers = llm.model.backend, llm.model.layers
    rows = {}
    for name in NAMES:
        ws = [getattr(L, name) for L in layers]
        n_out, n_in = ws[0].shape
        x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
        y = np.empty(n_out, np.float32)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            for w in ws:
                cpu.q4_gemv(x, w.w, w.s, w.z, y, be.threads)
            times.append((time.perf_counter() - start) / len(ws))
        xp = np.random.default_rng(1).standard_normal((args.tokens, n_in)).astype(np.float32)
        be.linear(xp, ws[0])
        prompt = []
        for _ in range(5):
            start = time.perf_counter()
            be.linear(xp, ws[0])
            prompt.append(time.perf_counter() - start)
        gemv = statistics.median(times)
        rows[name] = {"shape": [n_out, n_in], "gemv_us": gemv * 1e6,
                      "gw_s": n_out * n_in / gemv / 1e9, "prompt_ms": statistics.median(prompt) * 1e3}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="processes per vector width")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    import llvmlite.binding

    cmd = [sys.executable, __file__, args.model, "--threads", str(args.threads), "--reps",
           str(args.reps), "--tokens", str(args.tokens), "--child"]
    env512 = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    env256 = {**env512, "NUMBA_CPU_FEATURES": llvmlite.binding.get_host_cpu_features().flatten()}
    rounds = {"512-bit": [], "256-bit": []}
    for _ in range(args.rounds):          # alternated, so a slow spell of the machine hits both
        for label, env in (("512-bit", env512), ("256-bit", env256)):
            rounds[label].append(json.loads(subprocess.run(
                cmd, env=env, capture_output=True, text=True, check=True).stdout))
    runs = {label: {name: {k: (statistics.median(r[name][k] for r in rs)
                               if isinstance(rs[0][name][k], float) else rs[0][name][k])
                           for k in rs[0][name]} for name in NAMES}
            for label, rs in rounds.items()}
    print(f"{args.threads} threads; one token: median over {args.reps} passes of all layers; "
          f"prompt: {args.tokens} tokens; medians of {args.rounds} processes each")
    print(f"{'linear':9s} {'out x in':>11s} {'GEMV us':>16s} {'G w/s':>12s} "
          f"{'prompt ms':>14s}   (512-bit / 256-bit)")
    total = {label: 0.0 for label in runs}
    for name in NAMES:
        a, b = runs["512-bit"][name], runs["256-bit"][name]
        total["512-bit"] += a["gemv_us"]
        total["256-bit"] += b["gemv_us"]
        print(f"{name:9s} {a['shape'][0]:5d}x{a['shape'][1]:<5d} "
              f"{a['gemv_us']:7.1f} /{b['gemv_us']:7.1f} {a['gw_s']:5.1f} /{b['gw_s']:5.1f} "
              f"{a['prompt_ms']:6.2f} /{b['prompt_ms']:6.2f}")
    print(f"one layer's GEMVs: {total['512-bit']:.0f} us with 512-bit vectors, "
          f"{total['256-bit']:.0f} us with 256-bit: {total['256-bit'] / total['512-bit']:.2f}x")


if __name__ == "__main__":
    main()
