"""Time to first token along a conversation: each turn should prefill only itself.

    python benchmarks/chat_turns.py [MODEL] [--turns 5] [--runs 3] [--kv-policy dense]

A `ChatSession` on the model (default: the default model), greedy, 64-token replies; for each
turn: TTFT, tokens prefilled and tokens in the conversation. Reports, over --runs fresh
conversations, the median TTFT per turn and the ratio of the last turn's to the first's; the peer
is the last turn sent to a new session that holds the same history (so it prefills all of it).
"""

import argparse
import statistics

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
    full = []
    for run in range(args.runs):
        chat = tinyrt.ChatSession(llm, temperature=0, max_tokens=64)
        for i in range(args.turns):
            for _ in chat.send(QUESTIONS[i % len(QUESTIONS)]):
                pass
            t = chat.last
            ttft[i].append(t.ttft_s)
            if run == 0:
                print(f"turn {i + 1}: TTFT {t.ttft_s * 1000:6.1f} ms, prefilled {t.prompt_tokens:4d} "
                      f"tokens, {llm.cache.length:5d} in the conversation", flush=True)
        again = tinyrt.ChatSession(llm, temperature=0, max_tokens=1)
        again.messages = chat.messages[:-2]
        for _ in again.send(chat.messages[-2]["content"]):
            pass
        full.append(again.last.ttft_s)
    med = [statistics.median(x) * 1000 for x in ttft]
    print("median TTFT per turn (ms): " + ", ".join(f"{m:.1f}" for m in med))
    print(f"turn {args.turns} / turn 1: {med[-1] / med[0]:.2f}")
    whole = statistics.median(full) * 1000
    print(f"turn {args.turns} prefilling the whole conversation again: {whole:.1f} ms "
          f"({whole / med[0]:.2f} x turn 1)")


if __name__ == "__main__":
    main()
