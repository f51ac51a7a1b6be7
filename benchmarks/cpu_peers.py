"""tinyrt's CPU path against llama.cpp (llama-cpp-python, the model's own Q4_1 GGUF) and HF
transformers (float32, the GGUF dequantized) in the same run, same threads, same prompt ids:
TTFT / prefill tok/s of a 512-token prompt, decode tok/s over 128 greedy tokens (median of --runs),
peak RSS. Each engine runs in its own process so its peak RSS is its own.

    python benchmarks/cpu_peers.py AWQ_MODEL_DIR [--gguf FILE] [--threads 2] [--runs 5]

Needs `pip install llama-cpp-python torch transformers accelerate` (not CI dependencies).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

from gguf_peers import LlamaCpp, peak_rss_mb      # (benchmarks/ is sys.path[0] as a script)


def prompt(n: int) -> list[int]:
    import tinyrt
    from tinyrt import bench

    llm = tinyrt.load(None, device="reference", quiet=True)   # the default model's tokenizer
    return [int(i) for i in bench.prompt_ids(llm, n)]


def llama_cpp(args, ids):
    m = LlamaCpp(args.gguf, args.threads)          # n_ctx 4096, n_batch 512
    runs = [m.run(ids, args.decode) for _ in range(args.runs)]
    return [r[0] for r in runs], [r[1] for r in runs]


def hf(args, ids):
    import torch
    from transformers import AutoModelForCausalLM
    from pathlib import Path

    torch.set_num_threads(args.threads)
    g = Path(args.gguf)
    m = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    ttft, decode = [], []
    with torch.inference_mode():
        for _ in range(args.runs):
            t = time.perf_counter()
            out = m(x, use_cache=True, logits_to_keep=1)
            tok = out.logits[0, -1].argmax().view(1, 1)
            ttft.append(time.perf_counter() - t)
            past = out.past_key_values
            t = time.perf_counter()
            for _ in range(args.decode):
                out = m(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
            decode.append((time.perf_counter() - t) / args.decode)
    return ttft, decode


def tinyrt_cpu(args, ids):
    import numpy as np

    import tinyrt
    from tinyrt.bench import timed_runs

    llm = tinyrt.load(args.model, device="cpu", threads=args.threads, kv_size=4096)
    return timed_runs(llm, np.array(ids), args.decode, args.runs)[:2]


ENGINES = {"tinyrt": tinyrt_cpu, "llama.cpp": llama_cpp, "transformers": hf}


def child(args) -> None:
    ids = json.loads(sys.stdin.read())
    ttft, decode = ENGINES[args.engine](args, ids)
    print(json.dumps({"prefill_tok_s": len(ids) / statistics.median(ttft),
                      "decode_tok_s": 1 / statistics.median(decode),
                      "peak_rss_mb": peak_rss_mb()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="tinyrt model directory (the AWQ conversion of the GGUF)")
    ap.add_argument("--gguf", default=None, help="default: the default model's GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gguf is None:
        from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf

        args.gguf = str(fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], quiet=True))
    if args.engine:
        return child(args)
    ids = json.dumps(prompt(args.prompt))
    rows = {}
    for name in ENGINES:
        cmd = [sys.executable, __file__, args.model, "--gguf", args.gguf, "--threads", str(args.threads),
               "--runs", str(args.runs), "--prompt", str(args.prompt), "--decode", str(args.decode),
               "--engine", name]
        rows[name] = json.loads(subprocess.run(cmd, input=ids, capture_output=True, text=True,
                                               check=True).stdout)
    print(f"{args.threads} threads, {args.prompt}-token prompt, {args.decode} decoded tokens, "
          f"medians of {args.runs} runs")
    print(f"{'engine':14s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'peak RSS MB':>12s}")
    for name, r in rows.items():
        print(f"{name:14s} {r['prefill_tok_s']:14.1f} {r['decode_tok_s']:13.1f} {r['peak_rss_mb']:12.0f}")
    t, l, h = rows["tinyrt"], rows["llama.cpp"], rows["transformers"]
    print(f"tinyrt / llama.cpp: decode {t['decode_tok_s'] / l['decode_tok_s']:.2f}x (bar 1.25), "
          f"prefill {t['prefill_tok_s'] / l['prefill_tok_s']:.2f}x (bar 1.6)")
    print(f"tinyrt / transformers: prefill {t['prefill_tok_s'] / h['prefill_tok_s']:.2f}x (bar 1.0), "
          f"decode {t['decode_tok_s'] / h['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
