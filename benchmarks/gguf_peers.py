"""tinyrt against llama.cpp (llama-cpp-python) on the same GGUF files (issue 27's figures).

Speed: for each FILE, both engines load the file itself (tinyrt: `tinyrt.load(FILE, device="cpu",
threads=T, kv_size=4096)`, running its quantized tensors in place; llama.cpp: n_ctx 4096, the same
threads), and both run the same prompt token ids (the first --prompt tokens of the Python
documentation text that `tinyrt bench` prompts with, tokenized by llama.cpp from the file; tinyrt's
own tokenization of that text is checked against them) and --decode greedy tokens from an empty
cache: TTFT / prefill tok/s, decode tok/s, peak RSS. Each engine is a process of its own (its
peak RSS, VmHWM, is its own, load included) that stays up for all rounds; after an untimed
warm-up, the engines take turns one run at a time, round after round (the order flipped each
round, a pause between turns so that one engine's idle threads are asleep when the other runs),
so that drift on a shared machine hits both. Reported: medians over the rounds, and the
tinyrt / llama.cpp ratio of each round with the ratios' median and range.

Perplexity (--ppl TEXT): the protocol of tinyrt.perplexity (`tinyrt ppl --ctx C --max-windows W`):
the text tokenized whole by each engine's own tokenizer (BOS where the model adds one), cut into
non-overlapping windows of --ctx tokens from its start, each window evaluated whole from an empty
cache, the NLL of tokens 1..ctx-1 of each window; llama.cpp with logits_all=True. The two
tokenizations are compared and the report says whether they agree.

An engine that fails (tinyrt before it loads GGUF files in place, say) is reported as failed with
its error, and the other engine's figures are still printed.

    # the files (see benchmarks/make_ggufs.py; not in CI)
    python benchmarks/make_ggufs.py --out /tmp/bench_gguf
    G=/tmp/bench_gguf; D=~/.cache/tinyrt/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    # speed: issue 27's figures (2 threads, 512-token prompt, 128 tokens, medians of >= 5 runs)
    python benchmarks/gguf_peers.py $D $G/smollm2-135m.Q4_K_M.gguf $G/tinyllama-shape.Q4_K_M.gguf \\
        --threads 2 --runs 5
    # perplexity on WikiText-2 test, ctx 2048, 10 windows
    python benchmarks/gguf_peers.py $D $G/smollm2-135m.Q4_K_M.gguf \\
        --ppl ../shared/data/wikitext2-test.txt --ctx 2048 --windows 10
    # one engine only: --engines llama.cpp; JSON instead of the table: --json
    # issue 28's shapes: llama.cpp and tinyrt on the Q4_0 file, tinyrt on its own RTN g128 too
    python benchmarks/make_ggufs.py tinyllama-q4_0 tinyllama-rtn
    python benchmarks/gguf_peers.py $G/tinyllama-shape.Q4_0.gguf \\
        --model-dir $G/tinyllama-shape.rtn-g128 --threads 2 --runs 5

Needs `pip install llama-cpp-python` (not a CI dependency).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ENGINE_NAMES = ("tinyrt", "llama.cpp")
MODEL_DIR = "tinyrt-dir"    # tinyrt on --model-dir, beside the engines on FILE


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb / 1024


def prompt_text(n: int) -> str:
    """The text `tinyrt bench` prompts with (tinyrt.bench.prompt_ids), enough for n tokens."""
    from tinyrt.sample_text import default_text

    return default_text()[:n * 12]


def nll_sum(logits, targets, chunk: int = 256) -> float:
    """Sum over rows of -log softmax(logits[i])[targets[i]] (exp in float32, sums in float64),
    `chunk` rows at a time."""
    import numpy as np

    targets = np.asarray(targets)
    total = 0.0
    for a in range(0, len(targets), chunk):
        x = np.array(logits[a:a + chunk], dtype=np.float32)
        t = targets[a:a + chunk]
        target = x[np.arange(len(t)), t].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        x -= m
        np.exp(x, out=x)
        lse = m[:, 0].astype(np.float64) + np.log(x.sum(axis=1, dtype=np.float64))
        total += float(np.sum(lse - target))
    return total


# ----------------------------------------------------------------------------------- llama.cpp

class LlamaCpp:
    """llama.cpp (llama-cpp-python) on a GGUF file: greedy runs from an empty cache."""

    def __init__(self, path: str, threads: int, n_ctx: int = 4096, logits_all: bool = False):
        import llama_cpp

        self.lib = llama_cpp
        self.m = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=threads,
                                 n_threads_batch=threads, n_batch=512, logits_all=logits_all,
                                 verbose=False)

    def tokenize(self, text: str) -> list[int]:
        """The text's ids as the model's tokenizer gives them (BOS where the model adds one)."""
        return self.m.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def _last_logits(self):
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.m._ctx.ctx, -1)   # (Llama.scores stays empty)
        return np.ctypeslib.as_array(ptr, shape=(self.m.n_vocab(),))

    def run(self, ids: list[int], decode: int) -> tuple[float, float]:
        """Seconds to the first token of prompt `ids`, then seconds per greedy decoded token."""
        self.m.reset()
        t = time.perf_counter()
        self.m.eval(ids)
        tok = int(self._last_logits().argmax())
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(decode):
            self.m.eval([tok])
            tok = int(self._last_logits().argmax())
        return ttft, (time.perf_counter() - t) / max(decode, 1)

    def window_nll(self, ids: list[int]) -> float:
        """Sum of -log p(ids[t+1] | ids[:t+1]) over a window evaluated whole (logits_all)."""
        self.m.reset()
        self.m.eval(ids)
        return nll_sum(self.m.scores[:len(ids) - 1], ids[1:])


def llama_cpp_speed(path, threads):
    return LlamaCpp(path, threads)


def llama_cpp_ppl(path, threads, text, ctx, windows):
    e = LlamaCpp(path, threads, n_ctx=ctx, logits_all=True)
    ids = e.tokenize(text)
    w = min(len(ids) // ctx, windows)
    start = time.perf_counter()
    nll = sum(e.window_nll(ids[i * ctx:(i + 1) * ctx]) for i in range(w))
    n = w * (ctx - 1)
    return {"ppl": math.exp(nll / n) if n else float("nan"), "tokens": n, "windows": w,
            "seconds": time.perf_counter() - start, **ids_summary(ids, w * ctx)}


# -------------------------------------------------------------------------------------- tinyrt

def load_tinyrt(path, threads, **cache):
    import tinyrt

    return tinyrt.load(str(path), device="cpu", threads=threads, quiet=True, **cache)


# tinyrt's weight bytes over the file's above which it must be running float copies: in place,
# 4-bit types cost about 1x and 5-8-bit types held as 8-bit codes at most ~1.8x (Q5_0: 5.5 bits
# a weight in the file, 8 bits and a scale and an offset per 32 in tinyrt); float16 is >= 2.9x
FLOAT_RATIO = 2.5


def weights_note(llm, path) -> dict:
    """The bytes of weights a decoded token reads in tinyrt against the file's own (quantized)
    bytes of the same tensors (see FLOAT_RATIO); for a model directory, tinyrt's alone."""
    try:
        from tinyrt.bench import weight_bytes
        from tinyrt.models.gguf import GGUFFile       # (gguf's reader would add to the RSS)

        if not Path(path).is_file():
            return {"weight_mb": weight_bytes(llm.model) / 1e6}
        tensors = {n: int(t.n_bytes) for n, t in GGUFFile(path).tensors.items()}
        tied = "output.weight" not in tensors
        file_b = sum(b for n, b in tensors.items() if n != "token_embd.weight" or tied)
        ours = weight_bytes(llm.model)
        return {"weight_mb": ours / 1e6, "file_weight_mb": file_b / 1e6,
                "weight_ratio": ours / file_b if file_b else None}
    except Exception as e:          # the runtime's weight types change under this benchmark
        return {"weight_note_error": f"{type(e).__name__}: {e}"}


def kv_note(llm) -> dict:
    """What a decoded token reads of the K/V cache besides the weights: each layer's bytes per
    cached token and its window (0: none), so that the parent counts min(context, window)
    tokens a layer at the run's mean context (as `tinyrt bench` counts its decode GB/s)."""
    cfg = llm.config
    per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * 2      # K and V, float16 (default)
    return {"kv_layer_bytes": per_layer,
            "kv_windows": [cfg.window(i) or 0 for i in range(cfg.num_hidden_layers)]}


def kv_mb(e: dict, context: float) -> float:
    """The K/V megabytes a decode step reads at `context` tokens (kv_note's figures; 0 without
    them)."""
    return sum(min(context, w) if w else context
               for w in e.get("kv_windows", [])) * e.get("kv_layer_bytes", 0) / 1e6


class Tinyrt:
    def __init__(self, path: str, threads: int):
        self.llm = load_tinyrt(path, threads, kv_size=4096)
        # (its own load time, as `tinyrt bench` reports it: without the imports)
        self.info = {**weights_note(self.llm, path), "tinyrt_load_s": self.llm.load_s,
                     **kv_note(self.llm)}

    def tokenize(self, text: str) -> list[int]:
        return [int(i) for i in self.llm.tokenizer.encode(text, add_special=True)]

    def run(self, ids: list[int], decode: int) -> tuple[float, float]:
        import numpy as np

        from tinyrt.bench import timed_runs      # what `tinyrt bench` times (8-token warm-up first)

        ttft, step, _ = timed_runs(self.llm, np.asarray(ids, dtype=np.int64), decode, 1)
        return ttft[0], step[0]


def tinyrt_speed(path, threads):
    return Tinyrt(path, threads)


def tinyrt_ppl(path, threads, text, ctx, windows):
    from tinyrt.perplexity import perplexity

    llm = load_tinyrt(path, threads)
    ids = [int(i) for i in llm.tokenizer.encode(text, add_special=True)]
    r = perplexity(llm, text, ctx=ctx, max_windows=windows).as_dict()
    return {**r, **ids_summary(ids, r["windows"] * ctx), **weights_note(llm, path)}


SPEED = {"tinyrt": tinyrt_speed, "llama.cpp": llama_cpp_speed, MODEL_DIR: tinyrt_speed}
PPL = {"tinyrt": tinyrt_ppl, "llama.cpp": llama_cpp_ppl}


def ids_summary(ids: list[int], span: int) -> dict:
    """What the parent compares two tokenizations by: the evaluated span itself, the count and a
    hash of all the ids."""
    import numpy as np

    return {"n_ids": len(ids), "ids_sha": hashlib.sha256(np.asarray(ids, np.int64).tobytes())
            .hexdigest()[:16], "span_ids": ids[:span]}


# ---------------------------------------------------------------------------- worker processes

def worker(args) -> None:
    """One engine in its own process. JSON lines: it answers {"ready": ...} or {"error": ...}
    after loading, then one line per command read from stdin ({"cmd": "run", "ids", "decode"},
    {"cmd": "tokenize", "text"}, {"cmd": "quit"}: its peak RSS). Anything a library prints goes
    to stderr; the protocol has stdout to itself."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(d: dict) -> None:
        proto.write(json.dumps(d) + "\n")
        proto.flush()

    def error(e: BaseException) -> dict:
        return {"error": f"{type(e).__name__}: {e}".strip(),
                "traceback": traceback.format_exc(limit=-4)}

    try:
        if args.ppl:
            text = Path(args.ppl).read_text(encoding="utf-8")
            r = PPL[args.engine](args.worker, args.threads, text, args.ctx, args.windows)
            send({**r, "peak_rss_mb": peak_rss_mb()})
            return
        t = time.perf_counter()
        engine = SPEED[args.engine](args.worker, args.threads)
        send({"ready": True, "load_s": time.perf_counter() - t, **getattr(engine, "info", {})})
    except Exception as e:
        send(error(e))
        return
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "run":
                ttft, step = engine.run(cmd["ids"], cmd["decode"])
                send({"ttft_s": ttft, "decode_s": step})
            elif cmd["cmd"] == "tokenize":
                send({"ids": engine.tokenize(cmd["text"])})
            else:
                break
        except Exception as e:
            send(error(e))
    send({"peak_rss_mb": peak_rss_mb()})


class Worker:
    """The parent's end of a worker process."""

    def __init__(self, engine: str, path: str, args, ppl: str | None = None):
        cmd = [sys.executable, __file__, "--worker", str(path), "--engine", engine,
               "--threads", str(args.threads)]
        if ppl:
            cmd += ["--ppl", ppl, "--ctx", str(args.ctx), "--windows", str(args.windows)]
        self.name = engine
        # the engine's own output: a file, not a pipe (a full pipe would stall the worker)
        self.stderr = None if args.verbose else tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.stderr, text=True)
        self.error = None

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            err = ""
            if self.stderr:
                self.stderr.seek(0)
                err = self.stderr.read()
            tail = "\n".join(err.strip().splitlines()[-6:])
            return {"error": f"the worker exited ({self.p.returncode}) without an answer"
                             + (f":\n{tail}" if tail else "")}
        d = json.loads(line)
        if "error" in d and self.error is None:
            self.error = d["error"]
        return d

    def ask(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> dict:
        try:
            d = self.ask(cmd="quit") if self.p.poll() is None else {}
            self.p.stdin.close()
        except BrokenPipeError:
            d = {}
        self.p.wait()
        return d


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (the shorter length if one is a prefix of the
    other); None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


_READ_BUFFER: list = []


def read_gb_s(threads: int, nbytes: int = 512 << 20) -> float:
    """The machine's memory bandwidth as a plain read sees it now: `threads` threads each summing
    its share of a buffer far larger than the caches (NumPy's sum leaves the GIL), median of 3.
    Decode at batch 1 reads every weight once per token, so this bounds decode tok/s at about
    this / the weights' bytes, for both engines alike."""
    import threading

    import numpy as np

    if not _READ_BUFFER:
        _READ_BUFFER.append(np.ones(nbytes // 4, np.float32))
    parts = np.array_split(_READ_BUFFER[0], threads)
    times = []
    for _ in range(3):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": xs}


# -------------------------------------------------------------------------------------- speed

def speed(path: str, args) -> dict:
    out: dict = {"file": path, "threads": args.threads, "prompt_tokens": args.prompt,
                 "decode_tokens": args.decode, "runs": args.runs, "engines": {}}
    workers: dict[str, Worker] = {}
    engines = [(name, path) for name in args.engines]
    if args.model_dir:
        engines.append((MODEL_DIR, args.model_dir))
        out["model_dir"] = args.model_dir
    for name, source in engines:                   # loaded one after the other, not together
        log(f"{Path(path).name}: loading {name}")
        w = Worker(name, source, args)
        r = w.read()
        if "error" in r:
            w.close()
            out["engines"][name] = {"error": r["error"]}
            log(f"{Path(path).name}: {name} failed: {r['error']}")
            continue
        workers[name] = w
        out["engines"][name] = {"load_s": r["load_s"],
                                **{k: v for k, v in r.items() if k not in ("ready", "load_s")},
                                "ttft_s": [], "decode_s": []}
    ids = None
    if "llama.cpp" in workers:
        r = workers["llama.cpp"].ask(cmd="tokenize", text=prompt_text(args.prompt))
        ids = r.get("ids")
    if "tinyrt" in workers:
        r = workers["tinyrt"].ask(cmd="tokenize", text=prompt_text(args.prompt))
        if ids is None:
            ids = r.get("ids")
        elif "ids" in r:
            d = first_difference(ids[:args.prompt], r["ids"][:args.prompt])
            out["prompt_ids_agree"] = d is None
            if d is not None:
                out["prompt_ids_first_difference"] = d
    if ids is None or len(ids) < args.prompt:
        for w in workers.values():
            w.close()
        out["error"] = f"no prompt of {args.prompt} tokens"
        return out
    ids = ids[:args.prompt]

    def turn(name: str, decode: int, n_ids: int) -> dict | None:
        w = workers[name]
        if w.error:
            return None
        r = w.ask(cmd="run", ids=ids[:n_ids], decode=decode)
        if "error" in r:
            out["engines"][name]["error"] = r["error"]
            log(f"{Path(path).name}: {name} failed: {r['error']}")
            return None
        time.sleep(args.pause)
        return r

    for name in workers:                           # warm-up, untimed: the whole prompt
        turn(name, 4, args.prompt)
    out["read_gb_s"] = []
    for k in range(args.runs):
        out["read_gb_s"].append(read_gb_s(args.threads))     # between turns: both engines idle
        order = list(workers) if k % 2 == 0 else list(reversed(workers))
        for name in order:
            r = turn(name, args.decode, args.prompt)
            if r:
                out["engines"][name]["ttft_s"].append(r["ttft_s"])
                out["engines"][name]["decode_s"].append(r["decode_s"])
        log(f"{Path(path).name}: round {k + 1}/{args.runs}")
    for name, w in workers.items():
        out["engines"][name]["peak_rss_mb"] = w.close().get("peak_rss_mb")
    for name, e in out["engines"].items():
        if e.get("ttft_s"):
            e["ttft_median_s"] = statistics.median(e["ttft_s"])
            e["prefill_tok_s"] = args.prompt / e["ttft_median_s"]
            e["decode_tok_s"] = 1 / statistics.median(e["decode_s"])
    l = out["engines"].get("llama.cpp", {})
    for name, key in (("tinyrt", "ratios"), (MODEL_DIR, "ratios_model_dir")):
        t = out["engines"].get(name, {})
        n = min(len(t.get("ttft_s", [])), len(l.get("ttft_s", [])))
        if n and not t.get("error") and not l.get("error"):
            out[key] = {
                "prefill": spread([l["ttft_s"][i] / t["ttft_s"][i] for i in range(n)]),
                "decode": spread([l["decode_s"][i] / t["decode_s"][i] for i in range(n)]),
                "peak_rss": (t["peak_rss_mb"] / l["peak_rss_mb"]
                             if t.get("peak_rss_mb") and l.get("peak_rss_mb") else None)}
    return out


def fmt(x, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def table_head(*columns: str) -> list[str]:
    """A markdown table's header: file and engine left-aligned, the figures right-aligned."""
    return ["| " + " | ".join(columns) + " |", "|---|---|" + "---:|" * (len(columns) - 2)]


def failed_row(f: str, name: str, error: str, columns: int, notes: list[str]) -> str:
    """The row of an engine that gave no figures (its error goes to the notes)."""
    notes.append(f"{f}: {name} failed: {error.splitlines()[0]}")
    return f"| {f} | {name} | failed |" + " |" * (columns - 3)


def streamed(r: dict, e: dict) -> float | None:
    """GB/s of weights an engine reads at its decode speed: decode tok/s x the weights' bytes per
    token (tinyrt's own figure; llama.cpp reads the same file's tensors)."""
    mb = e.get("weight_mb") or next((x["file_weight_mb"] for x in r["engines"].values()
                                     if "file_weight_mb" in x), None)
    return e["decode_tok_s"] * mb / 1e3 if mb and e.get("decode_tok_s") else None


def speed_table(results: list[dict]) -> str:
    r0 = results[0]
    lines = [f"{r0['threads']} threads, {r0['prompt_tokens']}-token prompt, {r0['decode_tokens']} "
             f"greedy tokens, 4096-token context, medians of {r0['runs']} alternating rounds", "",
             *table_head("file", "engine", "prefill tok/s", "TTFT s", "decode tok/s",
                         "decode weight GB/s", "peak RSS MB", "weights MB/token (file)")]
    notes = []
    for r in results:
        f = Path(r["file"]).name
        for name, e in r["engines"].items():
            wt = (f"{e['weight_mb']:.0f}" if "weight_mb" in e else "—") + \
                (f" ({e['file_weight_mb']:.0f})" if "file_weight_mb" in e else "")
            if e.get("weight_ratio") and e["weight_ratio"] > FLOAT_RATIO:
                notes.append(f"{f}: tinyrt holds {e['weight_ratio']:.1f}x the file's weight bytes: "
                             "it is not running the file's quantized tensors in place")
            if e.get("error") and not e.get("ttft_s"):
                lines.append(failed_row(f, name, e["error"], 8, notes))
                continue
            if e.get("error"):
                notes.append(f"{f}: {name} failed after {len(e['ttft_s'])} runs: {e['error']}")
            lines.append(f"| {f} | {name} | {fmt(e.get('prefill_tok_s'))} | "
                         f"{fmt(e.get('ttft_median_s'), '.3f')} | {fmt(e.get('decode_tok_s'))} | "
                         f"{fmt(streamed(r, e))} | {fmt(e.get('peak_rss_mb'), '.0f')} | {wt} |")
        for key, name in (("ratios", "tinyrt"), ("ratios_model_dir", MODEL_DIR)):
            if key in r:
                q = r[key]
                lines.append(f"| {f} | {name} / llama.cpp | {q['prefill']['median']:.2f}x "
                             f"({q['prefill']['min']:.2f}-{q['prefill']['max']:.2f}) | | "
                             f"{q['decode']['median']:.2f}x ({q['decode']['min']:.2f}-"
                             f"{q['decode']['max']:.2f}) | | {fmt(q['peak_rss'], '.2f')}x | |")
        if "model_dir" in r:
            notes.append(f"{f}: {MODEL_DIR} is tinyrt on {r['model_dir']}")
        if r.get("read_gb_s"):
            read = statistics.median(r["read_gb_s"])
            notes.append(f"{f}: a plain {r['threads']}-thread read of memory ran at {read:.1f} GB/s "
                         f"(median of the rounds; {min(r['read_gb_s']):.1f}-"
                         f"{max(r['read_gb_s']):.1f}): the decode speed that reading the weights "
                         "alone allows is that / the weights' bytes")
            t = r["engines"].get("tinyrt", {})
            weights = streamed(r, t)
            if weights:
                context = r["prompt_tokens"] + r["decode_tokens"] / 2
                both = weights + t["decode_tok_s"] * kv_mb(t, context) / 1e3
                notes.append(f"{f}: tinyrt's decode read its weights at {weights:.1f} GB/s "
                             f"({weights / read:.0%} of the plain read), its weights and K/V "
                             f"cache at {both:.1f} GB/s ({both / read:.0%}; the mean context of "
                             f"{context:.0f} tokens)")
        if r.get("prompt_ids_agree") is False:
            notes.append(f"{f}: tinyrt's tokenization of the prompt text differs from llama.cpp's "
                         f"at token {r['prompt_ids_first_difference']} (both ran llama.cpp's ids)")
        if r.get("error"):
            notes.append(f"{f}: {r['error']}")
    lines += ["", "Ratios: tinyrt / llama.cpp speed (and RSS) per round, median (min-max); "
              "issue 27's bars: decode >= 1.25x, prefill >= 1.6x (default model), peak RSS <= 1x."]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


# --------------------------------------------------------------------------------- perplexity

def ppl(path: str, args) -> dict:
    out: dict = {"file": path, "text": args.ppl, "ctx": args.ctx, "windows": args.windows,
                 "engines": {}}
    for name in args.engines:                      # one after the other
        log(f"{Path(path).name}: perplexity with {name}")
        w = Worker(name, path, args, ppl=args.ppl)
        r = w.read()
        w.p.wait()
        out["engines"][name] = r
        if "error" in r:
            log(f"{Path(path).name}: {name} failed: {r['error']}")
    t, l = out["engines"].get("tinyrt", {}), out["engines"].get("llama.cpp", {})
    if "span_ids" in t and "span_ids" in l:
        d = first_difference(t["span_ids"], l["span_ids"])
        out["ids_agree_in_windows"] = d is None
        out["ids_agree_whole_text"] = t["ids_sha"] == l["ids_sha"] and t["n_ids"] == l["n_ids"]
        if d is not None:
            out["ids_first_difference"] = d
    if "ppl" in t and "ppl" in l:
        out["ratio"] = t["ppl"] / l["ppl"]
    for e in out["engines"].values():
        e.pop("span_ids", None)
    return out


def ppl_table(results: list[dict]) -> str:
    r0 = results[0]
    lines = [f"Perplexity of {Path(r0['text']).name}: non-overlapping windows of {r0['ctx']} "
             f"tokens from the start (at most {r0['windows']}), NLL of tokens 1..{r0['ctx'] - 1} "
             "of each", "",
             *table_head("file", "engine", "ppl", "predicted tokens", "windows", "seconds",
                         "text tokens", "peak RSS MB")]
    notes = []
    for r in results:
        f = Path(r["file"]).name
        for name, e in r["engines"].items():
            if "error" in e:
                lines.append(failed_row(f, name, e["error"], 8, notes))
                continue
            lines.append(f"| {f} | {name} | {e['ppl']:.4f} | {e['tokens']} | {e['windows']} | "
                         f"{e['seconds']:.0f} | {e['n_ids']} | "
                         f"{fmt(e.get('peak_rss_mb'), '.0f')} |")
        if "ratio" in r:
            lines.append(f"| {f} | tinyrt / llama.cpp | {r['ratio']:.4f} "
                         f"({100 * (r['ratio'] - 1):+.2f} %) | | | | | |")
        if "ids_agree_in_windows" in r:
            if r["ids_agree_in_windows"]:
                notes.append(f"{f}: the two tokenizers agree on every id of the windows"
                             + (" and of the whole text" if r["ids_agree_whole_text"]
                                else " (not on the whole text)"))
            else:
                notes.append(f"{f}: the tokenizers differ, first at id {r['ids_first_difference']} "
                             "of the windows: each engine is scored on its own ids")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


# ------------------------------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", metavar="FILE.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="rounds (each engine one run per round)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between turns")
    ap.add_argument("--engines", default=",".join(ENGINE_NAMES),
                    help=f"comma-separated, of {', '.join(ENGINE_NAMES)}")
    ap.add_argument("--model-dir", metavar="DIR",
                    help=f"speed of tinyrt on this model directory too, engine {MODEL_DIR} (one "
                         "FILE; e.g. make_ggufs.py's {shape}-rtn of the file's float source)")
    ap.add_argument("--ppl", metavar="TEXT", help="perplexity on this text instead of speed")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    ap.add_argument("--verbose", action="store_true", help="the engines' own output on stderr")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if not args.files:
        ap.error("give at least one GGUF file")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if bad := [e for e in args.engines if e not in ENGINE_NAMES]:
        ap.error(f"unknown engine {bad[0]!r} (known: {', '.join(ENGINE_NAMES)})")
    for f in args.files:
        if not Path(f).is_file():
            ap.error(f"{f}: no such file")
    if args.model_dir and (len(args.files) != 1 or args.ppl or not Path(args.model_dir).is_dir()):
        ap.error("--model-dir takes one FILE, speed only, and a model directory")
    run = ppl if args.ppl else speed
    results = [run(str(Path(f).expanduser()), args) for f in args.files]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print((ppl_table if args.ppl else speed_table)(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
