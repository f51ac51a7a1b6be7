"""Time to first token along a conversation: each turn should prefill only itself.

    python benchmarks/chat_turns.py [MODEL] [--turns 5] [--runs 3] [--kv-policy dense]

A `ChatSession` on the model (default: the default model), greedy, 64-token replies; for each
turn: TTFT, tokens prefilled and tokens in the conversation. Reports, over --runs fresh
conversations, the median TTFT per turn and the ratio of the last turn's to the first's; the peer
is the last turn sent to a new session that holds the same history (so it prefills all of it;
dense cache only). Each turn of the first conversation also prints the resident set and the
reply's decode rate; a long one (`--turns 200 --runs 1 --kv-policy sink`) is the chat soak, whose
summary compares them from the turn that filled the cache (the warm-up) to the end.
"""

import argparse
import statistics

from soak import rss_mb

QUESTIONS = [
    "Hi! My name is Tom and I live in Paris. I like to cook.",
    "What could I cook tonight with tomatoes, eggs and bread?",
    "How long would that take?",
    "Which wine would go with it?",
    "Thanks! Remind me, which city do I live in?",
    "And what is my name?",
    "Give me one more idea for tomorrow.",
    "Thank you, goodbye!",
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kv-policy", default="dense")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import tinyrt

    llm = tinyrt.load(args.model, threads=args.threads, kv_policy=args.kv_policy)
    ttft = [[] for _ in range(args.turns)]
    full, rss, decode, held = [], [], [], []
    for run in range(args.runs):
        chat = tinyrt.ChatSession(llm, temperature=0, max_tokens=64)
        for i in range(args.turns):
            for _ in chat.send(QUESTIONS[i % len(QUESTIONS)]):
                pass
            t = chat.last
            ttft[i].append(t.ttft_s)
            if run == 0:
                rss.append(rss_mb())
                decode.append(t.decode_tok_s)
                held.append(llm.cache.length)
                print(f"turn {i + 1}: TTFT {t.ttft_s * 1000:6.1f} ms, prefilled {t.prompt_tokens:4d} "
                      f"tokens, {llm.cache.length:5d} in the cache, decode {t.decode_tok_s:6.1f} "
                      f"tok/s, RSS {rss[-1]:6.1f} MB", flush=True)
        if args.kv_policy != "dense":
            continue
        again = tinyrt.ChatSession(llm, temperature=0, max_tokens=1)
        again.messages = chat.messages[:-2]
        for _ in again.send(chat.messages[-2]["content"]):
            pass
        full.append(again.last.ttft_s)
    med = [statistics.median(x) * 1000 for x in ttft]
    print("median TTFT per turn (ms): " + ", ".join(f"{m:.1f}" for m in med))
    print(f"turn {args.turns} / turn 1: {med[-1] / med[0]:.2f}")
    if full:
        whole = statistics.median(full) * 1000
        print(f"turn {args.turns} prefilling the whole conversation again: {whole:.1f} ms "
              f"({whole / med[0]:.2f} x turn 1)")
    warm = held.index(max(held)) + 1                # the turn that filled the cache
    if args.turns >= warm + 20:
        print(f"cache full from turn {warm}: RSS then {rss[warm - 1]:.1f} MB, highest after "
              f"{max(rss[warm:]):.1f}, last {rss[-1]:.1f}; decode tok/s median of turns "
              f"{warm + 1}-{warm + 10} {statistics.median(decode[warm:warm + 10]):.1f}, of the "
              f"last 10 {statistics.median(decode[-10:]):.1f}")


if __name__ == "__main__":
    main()
