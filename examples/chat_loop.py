"""A chat in a few lines: each turn prefills only itself; Ctrl-D ends it.

    python examples/chat_loop.py [MODEL]
"""

import sys

import tinyrt

chat = tinyrt.ChatSession(tinyrt.load(sys.argv[1] if len(sys.argv) > 1 else None),
                          system="You are a helpful assistant.", max_tokens=256)
while True:
    try:
        text = input("you> ")
    except EOFError:
        break
    for r in chat.send(text):
        print(r.text, end="", flush=True)
    print(f"\n[{chat.last.decode_tok_s:.0f} tok/s]")
