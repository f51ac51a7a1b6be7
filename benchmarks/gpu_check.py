"""tinyrt's CUDA path against its CPU path on one model, and a profile of the GPU's decode step.

The check of a GPU machine's first minutes (docs/GPU.md, `gpu_offline.sh first`), after gpu.py:

1. logits: the prompt's last-token logits on both devices (relative error, Frobenius norm; the
   GPU's prompt multiplies bfloat16 operands: docs/GPU.md's contract is under 1e-2, a few 1e-3
   expected).
2. greedy: --tokens greedy tokens after the prompt on each device, as a reply runs them (on the
   GPU the decode steps stay on the device, replayed as a CUDA graph; then again eagerly, which
   must give the captured step's tokens; in Numba's simulator, which captures no graph, both
   run eagerly). Equal, or the first step where they part: there each device's logits, from a
   prefill of the tokens before (the same on both), give the margin of its own token over the
   other's, as a share of the CPU logits' spread (their standard deviation).
   When both devices' margins are under --tie (1 %) it is a near tie that the order of float
   sums decides (the tokens after it are not compared); else a fault.
3. profile (a GPU only): torch.profiler over a reply's decode steps, captured and eager (its
   first step left out): every kernel's launches and microseconds a step (CUPTI sees Numba's
   launches), and the step's wall time in a reply not profiled, after the prompt; and, captured, after a prompt of each of
   --profile-contexts random ids (attention's share grows with the context); and the pass of
   each such prompt, kernel by kernel (the tensor cores' GEMMs, the dequantization, the fused
   attention), with its wall time.

With --json the result so far also goes to stderr as one line (`gpu_check: {...}`) after the
comparison and after each profile, so that what was measured stands where the run is cut short;
`wall_s` says what each part took.

The model is one of gpu.py's (random-weight AWQ directories written under --workdir, gpu.py's
folder; cut to its first --layers layers, 4 by default: every kernel at the full model's launch
shapes, for an eighth of the loads and of the CPU's decode), `default` (the default model's GGUF:
from tinyrt's cache or --default-model), or a model path; --smoke: a toy model of 1 layer (with
--model llama3-8b, grouped-query: 2 heads, 1 KV head). Exit status 0 when the devices agree
(equal tokens, or parted at a near tie), 1 when they do not.

    python benchmarks/gpu_check.py --model llama2-7b --json > check.json      # on a GPU
    python benchmarks/gpu_check.py --smoke       # no GPU: a toy model in Numba's CUDA simulator
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import gpu

PROMPT = "The history of the city begins with a small settlement on the river, where"
SMOKE_SHAPE = dict(gpu.SMOKE["llama2-7b"], hidden_size=128, intermediate_size=256,
                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                   vocab_size=258)      # (the byte tokenizer's 258 ids; AWQ groups of 128)
# --smoke --model llama3-8b: its family's grouped-query attention (2 heads, 1 KV head)
SMOKE_GQA = dict(SMOKE_SHAPE, num_key_value_heads=1, rope_theta=500000.0)


def model_path(args) -> Path:
    if args.smoke:
        if args.model == "llama3-8b":
            return gpu.awq_model(args.workdir, "check-gqa", SMOKE_GQA, smoke=True)
        return gpu.awq_model(args.workdir, "check", SMOKE_SHAPE, smoke=True)
    if args.model == "default":
        path = args.default_model or gpu.default_gguf()
        if not path.exists():
            sys.exit(f"gpu_check: no {path} (give --default-model)")
        return path
    if args.model in gpu.SHAPES:
        shape = gpu.SHAPES[args.model]
        layers = min(args.layers or shape["num_hidden_layers"], shape["num_hidden_layers"])
        if layers == shape["num_hidden_layers"]:
            return gpu.awq_model(args.workdir, args.model, shape, smoke=False)
        return gpu.awq_model(args.workdir, f"{args.model}-{layers}-layers",
                             dict(shape, num_hidden_layers=layers), smoke=False)
    return Path(args.model)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def last_logits(llm, ids: list[int]) -> np.ndarray:
    """The logits after `ids`, prefilled into an empty cache (float64 for the margins)."""
    llm.reset()
    out = llm.model.forward(np.asarray(ids), llm.cache)
    return llm.model.backend.to_numpy(out)[-1].astype(np.float64)


def greedy(llm, ids: list[int], n: int, timings: bool = False):
    """n greedy tokens after `ids`, from an empty cache (timings: the reply's Timings
    instead)."""
    from tinyrt.bench import greedy_reply

    llm.reset()
    reply = greedy_reply(llm, ids, n)
    return reply.timings if timings else list(reply.tokens)


def parting(gpu_llm, cpu_llm, ids: list[int], a: list[int], b: list[int], tie: float) -> dict:
    """Where the GPU's tokens `a` and the CPU's `b` first differ, and whether it is a near tie:
    both devices' margins under `tie` (the GPU's from its prefill of the tokens before, not from
    the decode step that drew its token). Tokens after a near tie are not compared."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        if len(a) == len(b):
            return {"equal": True, "tokens": len(a)}
        return {"equal": False, "lengths": [len(a), len(b)], "near_tie": False}
    before = ids + b[:k]
    cpu, dev = last_logits(cpu_llm, before), last_logits(gpu_llm, before)
    spread = float(cpu.std())
    margins = float(cpu[b[k]] - cpu[a[k]]) / spread, float(dev[a[k]] - dev[b[k]]) / spread
    return {"equal": False, "step": k, "cpu_token": b[k], "gpu_token": a[k],
            "cpu_margin": margins[0], "gpu_margin": margins[1],
            "logits_rel_err": rel_err(dev, cpu), "near_tie": max(map(abs, margins)) < tie}


def profile(llm, ids: list[int], steps: int) -> dict:
    """Each kernel's launches and device microseconds per decode step, over the steps 2 to
    `steps` of a reply (a reply of one decode step, its prefill and its first step, profiled the
    same way and taken off); and the step's wall
    microseconds in a reply not profiled (the host's wait for its token included), whose excess
    over the kernels' time, a launch, is what a launch costs beyond its kernel (`gap_us`: the
    step model's GAP, in a captured graph)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    def kernels(n):
        llm.reset()
        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            greedy(llm, ids, n + 1)
            torch.cuda.synchronize()
        # (the CUDA activity also records the runtime's calls, cuLaunchKernel..., on the host)
        return {e.key: (e.count, e.device_time_total) for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA}

    greedy(llm, ids, steps + 1)                  # warm: compiled, the allocator's pools made
    full, base = kernels(steps), kernels(1)
    if not full:
        return {"error": "the profiler saw no kernel (no CUPTI?)"}
    per = {}
    for name, (count, us) in full.items():
        c0, us0 = base.get(name, (0, 0))
        if count > c0:
            per[name] = {"launches": (count - c0) / (steps - 1), "us": (us - us0) / (steps - 1)}
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]["us"]))
    launches, us = sum(k["launches"] for k in per.values()), sum(k["us"] for k in per.values())
    t = greedy(llm, ids, steps + 1, timings=True)
    wall = 1e6 * t.decode_s / max(t.decode_steps, 1)
    # (the cache holds the prompt and the tokens before each profiled step)
    return {"steps": steps - 1, "context": [len(ids) + 1, len(ids) + steps - 1], "kernels": per,
            "launches": launches, "us": us, "wall_us": wall,
            "gap_us": (wall - us) / launches if launches else None}


def prefill_profile(llm, ids: list[int]) -> dict:
    """Each kernel's launches and device microseconds in one prompt pass of `ids` into an empty
    cache (the last token's logits made; after a warm pass), and the pass's wall microseconds
    in a pass not profiled: the tensor cores' GEMMs, the dequantization into their scratch,
    the fused attention and the rest, and what the host adds (wall_us over us)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    last_logits(llm, ids)                        # warm: compiled, the allocator's pools made
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        last_logits(llm, ids)
        torch.cuda.synchronize()
    per = {e.key: {"launches": e.count, "us": e.device_time_total} for e in prof.key_averages()
           if e.device_type == DeviceType.CUDA}
    if not per:
        return {"error": "the profiler saw no kernel (no CUPTI?)"}
    per = dict(sorted(per.items(), key=lambda kv: -kv[1]["us"]))
    torch.cuda.synchronize()
    start = time.perf_counter()
    last_logits(llm, ids)                        # (its logits on the host: a sync)
    wall = 1e6 * (time.perf_counter() - start)
    return {"tokens": len(ids), "kernels": per, "launches": sum(k["launches"] for k in per.values()),
            "us": sum(k["us"] for k in per.values()), "wall_us": wall}


def report(r: dict) -> str:
    layers = f"{r['layers']} layer{'s' * (r['layers'] > 1)}"
    lines = [f"{r['device']}: {r['model']} ({layers}), prompt {r['prompt_tokens']} tokens, "
             f"{r['tokens']} greedy tokens",
             f"  prompt logits, cuda vs cpu: relative error {r['logits_rel_err']:.2e}"]
    for how in ("graph", "eager"):
        p = r["greedy"][how]
        lines.append(f"  greedy ({how}): " + (
            f"equal for all {p['tokens']} tokens" if p["equal"] else
            f"the same tokens but {p['lengths'][0]} (gpu) against {p['lengths'][1]} (cpu): "
            "A FAULT" if "lengths" in p else
            f"parted at step {p['step']}: cpu {p['cpu_token']}, gpu {p['gpu_token']}; margins "
            f"{p['cpu_margin']:.2e} (cpu) {p['gpu_margin']:.2e} (gpu) of the logits' spread, "
            f"logits there within {p['logits_rel_err']:.1e}: "
            + ("a near tie" if p["near_tie"] else "A FAULT")))
    same = "the same" if r["graph_equals_eager"] else "DIFFERENT"
    lines.append(f"  graph and eager steps: {same} tokens; gpu text: {r['gpu_text']!r}")
    profiles = [*r.get("profile", {}).items(),
                *((f"graph, context {c}", p) for c, p in r.get("profile_at", {}).items())]
    profiles += [(f"a prompt of {c} tokens", p) for c, p in r.get("prefill_at", {}).items()]
    for how, p in profiles:
        if "kernels" not in p:
            lines.append(f"  profile ({how}): {p.get('skipped') or p.get('error')}")
            continue
        what = "its pass" if "tokens" in p else "a decode step"
        lines.append(f"  profile ({how}), {what}: {p['launches']:.1f} launches, "
                     f"{p['us']:.0f} us of kernels, {p.get('wall_us', 0):.0f} us wall")
        for name, k in list(p["kernels"].items())[:12]:
            lines.append(f"    {k['us']:9.1f} us {k['launches']:6.1f}x  {name[:80]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama2-7b",
                    help=f"{', '.join(gpu.MODELS)}, or a model's path (default llama2-7b)")
    ap.add_argument("--layers", type=int, default=4,
                    help="of gpu.py's models, the first LAYERS (default 4; 0: all)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens (default 64)")
    ap.add_argument("--tie", type=float, default=0.01,
                    help="a parting under this share of the logits' spread is a near tie")
    ap.add_argument("--profile-steps", type=int, default=9,
                    help="decode steps of the profiled reply (the first left out; default 9)")
    ap.add_argument("--profile-contexts", default="",
                    help="also profile the captured step after random prompts of these lengths "
                         "(e.g. 512,4096)")
    ap.add_argument("--threads", type=int, help="the CPU path's threads")
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "tinyrt_gpu_bench")
    ap.add_argument("--default-model", type=Path, help="the default model's GGUF")
    ap.add_argument("--smoke", action="store_true",
                    help="a toy model; without a GPU in Numba's CUDA simulator")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the text")
    args = ap.parse_args()
    if args.model not in gpu.MODELS and not Path(args.model).exists():
        ap.error(f"no model {args.model!r} (choose from {', '.join(gpu.MODELS)}, or a path)")
    try:
        contexts = [int(c) for c in args.profile_contexts.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--profile-contexts: {args.profile_contexts!r} is not a list of lengths")
    if args.tokens < 1 or args.profile_steps < 2 or args.layers < 0 or min(contexts, default=1) < 1:
        ap.error("--tokens must be at least 1, --profile-steps 2, --layers 0, a context 1")
    if args.smoke:      # (the simulator runs a CUDA thread as a Python thread: a toy model's
        # decode step takes seconds; 2 tokens: the prompt's, then one decode step's)
        args.tokens = min(args.tokens, 2)
        if ctypes.util.find_library("cuda") is None:      # (read when numba.cuda is imported)
            os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
            # the simulator's barriers wait on a thread switch: 10 ms each at Python's 5 ms
            sys.setswitchinterval(1e-4)
    import torch

    import tinyrt

    on_gpu = torch.cuda.is_available()
    if not (on_gpu or args.smoke):
        sys.exit("gpu_check: torch sees no CUDA GPU (--smoke runs it in Numba's simulator)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    wall, clock = {}, time.perf_counter()

    def took(part):
        nonlocal clock
        wall[part], clock = time.perf_counter() - clock, time.perf_counter()

    def partial(r):              # what is measured so far, on stderr (see the docstring)
        if args.json:
            print(f"gpu_check: {json.dumps(r)}", file=sys.stderr, flush=True)

    path = model_path(args)
    took("model")
    size = {"kv_size": max(contexts) + args.profile_steps + 8} if contexts and on_gpu else {}
    gpu_llm = tinyrt.load(str(path), device="cuda", quiet=True, **size)
    took("load_gpu")
    cpu_llm = tinyrt.load(str(path), device="cpu", threads=args.threads, quiet=True)
    took("load_cpu")
    ids = gpu_llm.encode(PROMPT)[:8 if args.smoke else None]
    r = {"device": torch.cuda.get_device_name() if on_gpu else "Numba's CUDA simulator",
         "model": str(path), "layers": gpu_llm.config.num_hidden_layers,
         "prompt_tokens": len(ids), "tokens": args.tokens, "wall_s": wall}
    r["logits_rel_err"] = rel_err(last_logits(gpu_llm, ids), last_logits(cpu_llm, ids))
    want = greedy(cpu_llm, ids, args.tokens)
    took("logits_and_cpu_greedy")
    r["greedy"], got = {}, {}
    for how, graph in (("graph", True), ("eager", False)):
        gpu_llm.model.backend.cuda_graph = graph
        got[how] = greedy(gpu_llm, ids, args.tokens)
        r["greedy"][how] = parting(gpu_llm, cpu_llm, ids, got[how], want, args.tie)
    r["graph_equals_eager"] = got["graph"] == got["eager"]
    r["gpu_text"] = gpu_llm.tokenizer.decode(got["graph"])
    r["agree"] = r["graph_equals_eager"] and all(p["equal"] or p["near_tie"]
                                                 for p in r["greedy"].values())
    took("gpu_greedy")
    partial(r)
    if on_gpu:
        r["profile"], r["profile_at"], r["prefill_at"] = {}, {}, {}
        jobs = [(r["profile"], how, graph, ids, profile) for how, graph in (("graph", True),
                                                                            ("eager", False))]
        for c in contexts:
            prompt_ids = gpu.prompt(c, gpu_llm.config.vocab_size).tolist()
            jobs += [(r["prefill_at"], c, True, prompt_ids, prefill_profile),
                     (r["profile_at"], c, True, prompt_ids, profile)]
        for where, key, graph, prompt_ids, fn in jobs:
            gpu_llm.model.backend.cuda_graph = graph
            try:
                where[key] = fn(gpu_llm, prompt_ids, args.profile_steps) if fn is profile \
                    else fn(gpu_llm, prompt_ids)
            except Exception as e:                       # noqa: BLE001 (the check's figures stand)
                where[key] = {"error": f"{type(e).__name__}: {e}"}
            took(f"{fn.__name__}_{key}")
            partial(r)
    print(json.dumps(r, indent=1) if args.json else report(r))
    return 0 if r["agree"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ModuleNotFoundError as e:
        sys.exit(f"gpu_check: {gpu.missing(e)}")
