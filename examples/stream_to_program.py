"""Stream a reply into another program as it is generated: here `fold`, which wraps the text
at 60 columns, reading the reply through a pipe while the model writes it.

    python examples/stream_to_program.py [MODEL]
"""

import subprocess
import sys

import tinyrt

llm = tinyrt.load(sys.argv[1] if len(sys.argv) > 1 else None)
chat = tinyrt.ChatSession(llm, max_tokens=200)
consumer = subprocess.Popen(["fold", "-s", "-w", "60"], stdin=subprocess.PIPE, text=True)
for r in chat.send("Explain in a paragraph why the sky is blue."):
    consumer.stdin.write(r.text)
    consumer.stdin.flush()               # the other program gets each piece at once
consumer.stdin.close()
consumer.wait()
print(f"\n{chat.last.generated_tokens} tokens, finish: {chat.last_finish}", file=sys.stderr)
