"""Speculative decoding against the target alone, in one run (greedy, 2 threads by default).

    python benchmarks/speculative.py --target F16_DIR --draft AWQ_DIR [--tokens 128] [--runs 3]
        [--layers 6 10] [--confidence 0.1 0.3] [--own-cache]
    python benchmarks/speculative.py --verify-cost [--target MODEL]

For each prompt (open chat, and a summarise-this-text prompt that a reply may quote), the
decode speed and the time to the first token (medians of the runs) of: the target alone; the
target with the draft model (at each draft confidence given: the probability of its whole draft
below which the draft stops; with --own-cache, also on a KV cache of its own instead of the
target's); the target with prompt lookup; and, for the draft (an AWQ model) as a target of its
own, that model alone and with its own first N layers as the draft (`layers:N`). Runs alternate
between configurations; a speed-up is the median (and range) of each run's ratio to its
reference's run in the same round. Every speculative reply is checked token for token against
its target's.
"""

import argparse
import statistics

CHAT = [
    "Tell me a short story about a robot who learns to paint.",
    "How does a bicycle stay upright? Explain simply.",
    "Give me five tips for learning a new language.",
]


def summarise_prompt() -> str:
    from tinyrt.sample_text import default_text

    text = default_text()
    start = text.find("\n\n", len(text) // 3)
    return "Summarize the following text in a few sentences.\n\n" + text[start:start + 1500].strip()


def verify_cost(llm, sizes=(2, 4, 8), rounds: int = 100, context: int = 256) -> dict:
    """What a draft's verification costs against one decode step: the median time of a forward
    pass of T tokens with every token's logits (what the target runs to check T - 1 drafted
    tokens) over the median time of a one-token step, both after the same `context` tokens in
    the cache, taking turns round after round. {T: ratio}."""
    import time

    import numpy as np

    ids = np.asarray(llm.encode(summarise_prompt())[:context], np.int64)
    m, cache = llm.model, llm.cache
    llm.reset()
    m.forward(ids, cache)
    times = {T: [] for T in (1, *sizes)}
    for _ in range(rounds):
        for T in times:
            start = time.perf_counter()
            m.backend.to_numpy(m.forward(ids[:T], cache, all_logits=True))
            times[T].append(time.perf_counter() - start)
            cache.rollback(T)
    step = statistics.median(times[1])
    return {"step_ms": step * 1e3, **{T: statistics.median(times[T]) / step for T in sizes}}


def run(llm, prompt: str, tokens: int):
    replies = list(llm.stream(prompt, max_tokens=tokens, temperature=0))
    return [r.token for r in replies if r.token is not None], replies[-1].timings


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="float model (default: the default model)")
    p.add_argument("--draft", help="its AWQ version")
    p.add_argument("--verify-cost", action="store_true",
                   help="the target's cost of verifying 2, 4 and 8 tokens against one decode "
                        "step (no draft needed), on its weights as stored and as float32")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, nargs="*", default=[6, 10])
    p.add_argument("--confidence", type=float, nargs="*", default=[],
                   help="draft confidences to compare (default: the runtime's)")
    p.add_argument("--own-cache", action="store_true",
                   help="also the draft on a KV cache of its own (the runtime has it read the "
                        "target's, a copy of the target's)")
    args = p.parse_args()
    import tinyrt

    def load(model, draft=None):
        return tinyrt.load(model, threads=args.threads, kv_size=2048, draft=draft, quiet=True)

    if args.verify_cost:
        for dtype in (None, "f32"):
            llm = tinyrt.load(args.target, threads=args.threads, kv_size=2048, dtype=dtype,
                              quiet=True)
            r = verify_cost(llm)
            print(f"verify / step, {dtype or 'as stored'} ({r['step_ms']:.1f} ms a step): "
                  + ", ".join(f"{T} tokens {r[T]:.2f}x" for T in r if T != "step_ms"), flush=True)
            del llm
        if args.draft is None:
            return
    elif args.draft is None:
        p.error("--draft is needed (or --verify-cost alone)")
    configs = {"target": (load(args.target), None)}
    for c in args.confidence or [None]:
        llm = load(args.target, args.draft)
        if c is not None:
            llm.drafter.confidence = c
        configs["+ draft" if c is None else f"+ draft {c:g}"] = (llm, "target")
    if args.own_cache:
        from tinyrt.kv_cache import make_cache
        from tinyrt.speculative import ModelDrafter

        llm = load(args.target, args.draft)
        m = llm.drafter.model
        cache = make_cache(llm.cache_options, m)
        llm.drafter = ModelDrafter(m, cache, llm.drafter.name)
        configs["+ draft own cache"] = (llm, "target")
    configs["+ lookup"] = (load(args.target, "lookup"), "target")
    if args.layers:
        configs["awq alone"] = (load(args.draft), None)
    for n in args.layers:
        configs[f"awq + layers:{n}"] = (load(args.draft, f"layers:{n}"), "awq alone")
    prompts = {f"chat {i + 1}": q for i, q in enumerate(CHAT)}
    prompts["summarise"] = summarise_prompt()
    for name, prompt in prompts.items():
        speed, ttft = {c: [] for c in configs}, {c: [] for c in configs}
        stats, outputs = {}, {}
        for _ in range(args.runs):
            for c, (llm, _ref) in configs.items():
                ids, t = run(llm, prompt, args.tokens)
                speed[c].append(t.decode_tok_s)
                ttft[c].append(t.ttft_s)
                outputs[c], stats[c] = ids, t.speculative
        print(f"{name} ({len(outputs['target'])} tokens):")
        for c, (_llm, ref) in configs.items():
            tok_s = statistics.median(speed[c])
            first_ms = statistics.median(ttft[c]) * 1e3
            line = f"  {c:16s} {tok_s:6.1f} tok/s, first token {first_ms:4.0f} ms"
            if ref is not None:
                s = stats[c]
                same = "identical" if outputs[c] == outputs[ref] else "DIFFERENT"
                # the speed-up of each run against its reference's run of the same round (the
                # machine's speed drifts between rounds more than within one): median and range
                ratios = sorted(a / b for a, b in zip(speed[c], speed[ref]))
                line += (f"  x{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) "
                         f"vs {ref}; accepted "
                         f"{s.accept_rate:.0%} of {s.drafted}, {s.tokens_per_step:.2f} tokens per "
                         f"target pass, gamma {s.drafted / max(1, s.target_steps):.1f} on "
                         f"average, {s.gamma} at the end; output {same}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
