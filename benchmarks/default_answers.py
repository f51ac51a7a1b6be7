"""Whether a model answers simple factual questions right at its default sampling: each question
asked with several seeds (a new conversation each time, as `tinyrt generate --seed S` asks it), a
reply right when its first sentence names the answer (the question answered first, not somewhere
in a paragraph that starts elsewhere). The questions count only where the model gets them right
greedily (temperature 0): what is measured is what sampling loses, not what the model knows.

    python benchmarks/default_answers.py [MODEL] [--seeds 10] [--try temperature=0.2,top_p=0.9 ...]

Without --try: the defaults as `tinyrt` applies them to the model (the model's own settings, else
tinyrt's). Each --try is a set of settings over those defaults. The first three questions are issue 49's bar.
"""

from __future__ import annotations

import argparse
import re

import tinyrt
from tinyrt.api import describe_sampling

QUESTIONS = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("What color is the sky on a clear day?", r"\bblue\b"),
    ("What is the capital of Italy?", r"\brome\b"),
    ("What is the capital of Germany?", r"\bberlin\b"),
    ("What is the capital of Spain?", r"\bmadrid\b"),
    ("How many days are in a week?", r"\b(seven|7)\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("What color is grass?", r"\bgreen\b"),
    ("What is the boiling point of water in degrees Celsius?", r"\b100\b"),
    ("What is the capital of the United Kingdom?", r"\blondon\b"),
    ("How many legs does a spider have?", r"\b(eight|8)\b"),
    ("What is two plus two?", r"\b(four|4)\b"),
    ("What color are ripe bananas?", r"\byellow\b"),
    ("What is the opposite of hot?", r"\bcold\b"),
    ("Which planet do we live on?", r"\bearth\b"),
    ("How many hours are in a day?", r"\b(24|twenty-four)\b"),
    ("What is the chemical formula of water?", r"\bh2o\b"),
    ("What do bees make?", r"\bhoney\b"),
    ("What is frozen water called?", r"\bice\b"),
]
MAX_TOKENS = 64


def first_sentence(reply: str) -> str:
    """The reply up to its first sentence's end (., ! or ? before a space or the end) or line."""
    text = reply.strip().split("\n", 1)[0]
    end = re.search(r"[.!?](\s|$)", text)
    return text[:end.start() + 1] if end else text


def right(reply: str, answer: str) -> bool:
    return re.search(answer, first_sentence(reply).lower()) is not None


def settings(text: str) -> dict:
    """`temperature=0.2,top_p=0.9` -> {"temperature": 0.2, "top_p": 0.9}."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = float(value) if "." in value else int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--try", dest="tries", action="append", default=[], type=settings)
    args = ap.parse_args()
    llm = tinyrt.load(args.model, quiet=True)
    asked = [(q, a) for q, a in QUESTIONS
             if right(llm.generate(q, temperature=0, max_tokens=MAX_TOKENS), a)]
    skipped = [q for q, _ in QUESTIONS if q not in dict(asked)]
    print(f"model {llm.directory}; sampling {describe_sampling(llm.sampling_sources())}")
    if skipped:
        print("not right at temperature 0, left out: " + "; ".join(skipped))
    print(f"\n| settings | bar questions right | all questions right |\n|---|---:|---:|")
    for extra in [{}] + args.tries:
        label = ", ".join(f"{k}={v}" for k, v in extra.items()) or "defaults"
        bar = total = n_bar = 0
        wrong = []
        for i, (q, a) in enumerate(asked):
            for seed in range(1, args.seeds + 1):
                reply = llm.generate(q, seed=seed, max_tokens=MAX_TOKENS, **extra)
                ok = right(reply, a)
                total += ok
                if i < 3 and q in dict(QUESTIONS[:3]):
                    bar, n_bar = bar + ok, n_bar + 1
                if not ok:
                    wrong.append(f"{q} (seed {seed}): {reply[:80]!r}")
        print(f"| {label} | {bar}/{n_bar} | {total}/{len(asked) * args.seeds} |", flush=True)
        for w in wrong[:4]:
            print(f"  wrong: {w}")


if __name__ == "__main__":
    main()
