"""Load the default model, ask one question, then stream a reply with its timings.

    python examples/quickstart.py [MODEL]
"""

import sys

import tinyrt

llm = tinyrt.load(sys.argv[1] if len(sys.argv) > 1 else None)

print(llm.generate("What is the capital of France?", temperature=0))

messages = [{"role": "system", "content": "You answer in one short paragraph."},
            {"role": "user", "content": "Why is the sky blue?"}]
for r in llm.stream(messages, max_tokens=96, seed=0):
    print(r.text, end="", flush=True)
t = r.timings
print(f"\n[{r.finish_reason}] ttft {t.ttft_s * 1000:.0f} ms, prefill {t.prefill_tok_s:.0f} tok/s, "
      f"decode {t.decode_tok_s:.1f} tok/s")
