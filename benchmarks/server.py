"""`tinyrt serve` under load, on a follow-up turn, and per streamed token, through OpenAI's client.

    python benchmarks/server.py load [MODEL] [--clients 32] [--requests 4] [--max-tokens 48]
                                     [--max-queue N] [--timeout 600]
    python benchmarks/server.py turns [MODEL] [--runs 5]
    python benchmarks/server.py overhead [MODEL] [--tokens 128] [--runs 5]
    (each takes --threads N and --json)

Each starts the real server (`python -m tinyrt serve MODEL --port 0`, the default model when
MODEL is left out), talks to it with the `openai` package (max_retries=0: a 503 is counted, not
retried) and stops it with SIGINT.

load: --clients concurrent streaming chat clients send --requests short distinct messages each
(greedy, --max-tokens). Reports requests completed and refused (a clean 503 or 429; any other
error is a failure and the exit code is 1), time to first token p50/p95 (request sent to the
first non-empty content delta), generated tokens/s over the run (usage completion_tokens summed
over wall time), the server's RSS after one warm-up request, after the load, and the growth,
and the CPU seconds the server and this client used during the load.

turns: a conversation of 4 user turns (greedy, 64-token replies), each request carrying the
whole history, against the same conversation in-process with `ChatSession` (run here while the
server is idle). The server is asked twice: with the openai client, and over plain HTTP
(http.client, the JSON encoded first), which leaves out the openai package's own time per
request (3-6 ms here). Per turn, medians over --runs fresh conversations: server TTFT (client-side),
ChatSession TTFT (`send` called -> its first text, as the client times the server), their ratio, and the server's usage cached_tokens /
prompt_tokens. (The server keeps its KV cache across conversations: its turn 1 finds the last
conversation's turn 1 there; a new ChatSession starts empty.)

overhead: the time per streamed token the server adds. In-process `LLM.stream(PROMPT,
ignore_eos=True)` gives decode_s / decode_steps; through the server the same chat prompt,
streamed, gives (last content chunk - first) / (completion_tokens - 1), client-side. Medians over
--runs, the two ways alternating.

`--threads` goes to the server and the in-process runs alike. The client shares the server's
machine; `load` reports both sides' CPU time.
"""

import argparse
import ast
import asyncio
import http.client
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import openai

READY = re.compile(r"serving (.+) at (http://\S+/v1) ")
QUESTIONS = [
    "Hi! I am planning a weekend trip to the mountains with two friends in early autumn. "
    "We like hiking but none of us has done anything very hard. Where should we start?",
    "That sounds good. What should we pack for two days if the weather might turn cold and "
    "wet in the afternoon?",
    "How much water should each of us carry for a six hour hike, and how do we keep it from "
    "getting too heavy?",
    "Thanks! Can you sum up the plan in three short points so I can send it to my friends?",
]
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@contextmanager
def server(args, *extra):
    """The server as a subprocess: yields (Popen, base URL, model name); SIGINT at the end."""
    cmd = [sys.executable, "-m", "tinyrt", "serve", *([args.model] if args.model else []),
           "--port", "0", *(["--threads", str(args.threads)] if args.threads else []), *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()

    def drain():            # read stderr to the end, so that the server never blocks on the pipe
        for line in proc.stderr:
            lines.put(line)
            if line.strip() and not READY.search(line):
                print(f"[server] {line}", end="", file=sys.stderr, flush=True)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"the server did not start in {args.start_timeout} s") from None
            if line is None:
                raise SystemExit(f"the server exited ({proc.wait()}) before it was serving")
            if m := READY.search(line):
                break
        yield proc, m.group(2), ast.literal_eval(m.group(1))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                print("the server ignored SIGINT for 15 s; killed", file=sys.stderr)
                proc.kill()
                proc.wait()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def _chunk(chunk, t0, out):
    """Note a stream chunk: the times of content deltas, their text, the usage."""
    if chunk.usage:
        out["usage"] = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            out["times"].append(time.perf_counter() - t0)
            out["text"].append(c.delta.content)


def request_kw(name, messages, max_tokens, **extra):
    return dict(model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body=extra or None)


def stream_chat(client, **kw) -> dict:
    """One streamed chat request: content-delta times (s after sending), text, usage."""
    out, t0 = {"times": [], "text": [], "usage": None}, time.perf_counter()
    for chunk in client.chat.completions.create(**kw):
        _chunk(chunk, t0, out)
    return out


def http_stream_chat(conn, **kw) -> dict:
    """As stream_chat over a plain keep-alive HTTP connection (the JSON encoded before the clock
    starts): the server's own time, without the openai package's work on each request."""
    body = json.dumps({**kw, "stream": True}).encode()
    out, t0 = {"times": [], "text": []}, time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json"})
    for line in conn.getresponse():
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                out["times"].append(time.perf_counter() - t0)
                out["text"].append(choices[0]["delta"]["content"])
    return out


async def astream_chat(client, **kw) -> dict:
    out, t0 = {"times": [], "text": [], "usage": None}, time.perf_counter()
    async for chunk in await client.chat.completions.create(**kw):
        _chunk(chunk, t0, out)
    return out


# -- load --------------------------------------------------------------------------------------

async def _load(args, url, name, pid) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=args.timeout)
    await astream_chat(client, **request_kw(name, [{"role": "user", "content": "Hello!"}], 8))
    rss_before = rss_mb(pid)
    ttft, tokens, refused, failed = [], 0, {}, []

    async def one_client(c):
        nonlocal tokens
        for r in range(args.requests):
            msg = [{"role": "user", "content": f"Tell me about topic {c * args.requests + r}."}]
            try:
                out = await astream_chat(client, **request_kw(name, msg, args.max_tokens))
            except openai.APIStatusError as e:
                if e.status_code in (429, 503):             # a refusal the client may retry
                    refused[e.status_code] = refused.get(e.status_code, 0) + 1
                else:
                    failed.append(f"{e.status_code}: {e.message}")
                continue
            except openai.OpenAIError as e:        # connection lost, an error event mid-stream
                failed.append(f"{type(e).__name__}: {e}")
                continue
            if not out["times"] or out["usage"] is None:
                failed.append(f"{msg[0]['content']!r}: no content or no usage")
                continue
            ttft.append(out["times"][0])
            tokens += out["usage"].completion_tokens

    # CPU of both sides: on a small machine the client's share is taken from the server's
    cpu = cpu_s(pid), cpu_s(os.getpid())
    start = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(one_client(c) for c in range(args.clients))),
                               args.timeout)
    except asyncio.TimeoutError:
        raise SystemExit(f"the load ran past --timeout {args.timeout} s") from None
    wall = time.perf_counter() - start
    rss_after = rss_mb(pid)
    cpu = cpu_s(pid) - cpu[0], cpu_s(os.getpid()) - cpu[1]
    await client.close()
    return {"clients": args.clients, "requests_each": args.requests, "max_tokens": args.max_tokens,
            "completed": len(ttft), "refused": refused, "failed": len(failed),
            "failures": failed[:10], "wall_s": wall,
            "ttft_p50_ms": statistics.median(ttft) * 1000 if ttft else None,
            "ttft_p95_ms": statistics.quantiles(ttft, n=20)[18] * 1000 if len(ttft) > 1 else None,
            "completion_tokens": tokens, "tok_s": tokens / wall,
            "rss_warm_mb": rss_before, "rss_after_mb": rss_after,
            "rss_growth_mb": rss_after - rss_before, "server_cpu_s": cpu[0], "client_cpu_s": cpu[1]}


def load(args) -> dict:
    extra = ["--max-queue", str(args.max_queue)] if args.max_queue is not None else []
    with server(args, *extra) as (proc, url, name):
        res = asyncio.run(_load(args, url, name, proc.pid))
    if not args.json:
        refused = ", ".join(f"{n} with {code}" for code, n in res["refused"].items()) or "none"
        print(f"{res['completed']} completed, refused {refused}, {res['failed']} failed in "
              f"{res['wall_s']:.1f} s ({args.clients} clients x {args.requests} requests)")
        for f in res["failures"]:
            print(f"  failure: {f}")
        if res["ttft_p95_ms"] is not None:
            print(f"TTFT p50 {res['ttft_p50_ms']:.0f} ms, p95 {res['ttft_p95_ms']:.0f} ms; "
                  f"{res['completion_tokens']} tokens generated, {res['tok_s']:.1f} tok/s")
        print(f"server RSS: {res['rss_warm_mb']:.1f} MB warm, {res['rss_after_mb']:.1f} MB after "
              f"the load ({res['rss_growth_mb']:+.1f} MB); CPU during the load: server "
              f"{res['server_cpu_s']:.1f} s, client {res['client_cpu_s']:.1f} s")
    return res


# -- turns -------------------------------------------------------------------------------------

def conversation(ask) -> list[dict]:
    """QUESTIONS as one conversation, each request `ask(messages)` carrying the whole history
    (the replies as received); each turn's output."""
    messages, outs = [], []
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        outs.append(ask(messages))
        messages.append({"role": "assistant", "content": "".join(outs[-1]["text"])})
    return outs


def turns(args) -> dict:
    import tinyrt

    llm = tinyrt.load(args.model, threads=args.threads, quiet=True)
    rows = [{"server": [], "http": [], "chat": [], "cached": [], "prompt": []} for _ in QUESTIONS]
    with server(args) as (proc, url, name):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        conn = http.client.HTTPConnection(*url.split("//")[1].split("/")[0].split(":"))
        stream_chat(client, **request_kw(name, [{"role": "user", "content": "Hello!"}], 8))
        for run in range(args.runs + 1):                  # run 0 warms the in-process path
            served = conversation(lambda m: stream_chat(client, **request_kw(name, m, 64)))
            plain = conversation(lambda m: http_stream_chat(conn, model=name, messages=m,
                                                            max_tokens=64, temperature=0))
            for i, (out, http_out) in enumerate(zip(served, plain)):
                if run:
                    rows[i]["server"].append(out["times"][0])
                    rows[i]["http"].append(http_out["times"][0])
                    rows[i]["cached"].append(out["usage"].prompt_tokens_details.cached_tokens)
                    rows[i]["prompt"].append(out["usage"].prompt_tokens)
            chat = tinyrt.ChatSession(llm, max_tokens=64, temperature=0)   # the server is idle
            for i, q in enumerate(QUESTIONS):
                start, first = time.perf_counter(), None
                for r in chat.send(q):         # timed as the client is: sent -> first text
                    if first is None and r.text:
                        first = time.perf_counter() - start
                if run:
                    rows[i]["chat"].append(first)
    med = [{k: statistics.median(v) for k, v in row.items()} for row in rows]
    res = {"runs": args.runs, "turns": [
        {"turn": i + 1, "server_ttft_ms": m["server"] * 1000, "http_ttft_ms": m["http"] * 1000,
         "chat_ttft_ms": m["chat"] * 1000, "ratio": m["server"] / m["chat"],
         "http_ratio": m["http"] / m["chat"],
         "cached_tokens": m["cached"], "prompt_tokens": m["prompt"]} for i, m in enumerate(med)]}
    if not args.json:
        print(f"medians of {args.runs} conversations (ms)")
        print("turn  openai TTFT  HTTP TTFT  chat TTFT  openai/chat  HTTP/chat  cached/prompt")
        for t in res["turns"]:
            print(f"{t['turn']:4d}  {t['server_ttft_ms']:11.1f}  {t['http_ttft_ms']:9.1f}  "
                  f"{t['chat_ttft_ms']:9.1f}  {t['ratio']:11.2f}  {t['http_ratio']:9.2f}  "
                  f"{t['cached_tokens']:.0f}/{t['prompt_tokens']:.0f}")
    return res


# -- overhead ----------------------------------------------------------------------------------

def overhead(args) -> dict:
    import tinyrt

    llm = tinyrt.load(args.model, threads=args.threads, quiet=True)
    local, remote, chunks = [], [], []
    with server(args) as (proc, url, name):
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        kw = request_kw(name, [{"role": "user", "content": PROMPT}], args.tokens, ignore_eos=True)

        def in_process():
            for r in llm.stream(PROMPT, max_tokens=args.tokens, ignore_eos=True, temperature=0):
                pass
            return r.timings.decode_s / r.timings.decode_steps

        def served():
            out = stream_chat(client, **kw)
            chunks.append(len(out["times"]))
            return (out["times"][-1] - out["times"][0]) / (out["usage"].completion_tokens - 1)

        in_process(), served()                                          # warm-up
        chunks.clear()
        for run in range(args.runs):
            for way in ((in_process, served) if run % 2 == 0 else (served, in_process)):
                (local if way is in_process else remote).append(way())
    ms_local, ms_remote = statistics.median(local) * 1000, statistics.median(remote) * 1000
    res = {"tokens": args.tokens, "runs": args.runs, "in_process_ms_per_token": ms_local,
           "server_ms_per_token": ms_remote, "overhead_ms_per_token": ms_remote - ms_local,
           "overhead_pct": (ms_remote / ms_local - 1) * 100, "server_content_chunks": chunks}
    if not args.json:
        print(f"{args.tokens} tokens, medians of {args.runs} runs: in-process {ms_local:.2f} "
              f"ms/token, server {ms_remote:.2f} ms/token (content chunks {chunks}): overhead "
              f"{ms_remote - ms_local:+.2f} ms/token ({res['overhead_pct']:+.1f}%)")
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("load", "turns", "overhead"):
        s = sub.add_parser(name)
        s.add_argument("model", nargs="?", default=None)
        s.add_argument("--threads", type=int, default=None)
        s.add_argument("--start-timeout", type=float, default=300,
                       help="seconds the server may take to listen")
        s.add_argument("--json", action="store_true", help="the figures as one JSON object")
        if name == "load":
            s.add_argument("--clients", type=int, default=32)
            s.add_argument("--requests", type=int, default=4, help="requests per client")
            s.add_argument("--max-tokens", type=int, default=48)
            s.add_argument("--max-queue", type=int, default=None, help="default: the server's")
            s.add_argument("--timeout", type=float, default=600, help="s the whole load may take")
        else:
            s.add_argument("--runs", type=int, default=5)
        if name == "overhead":
            s.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    res = {"load": load, "turns": turns, "overhead": overhead}[args.what](args)
    if args.json:
        print(json.dumps(res, indent=1))
    if res.get("failed"):
        sys.exit(1)


if __name__ == "__main__":
    main()
