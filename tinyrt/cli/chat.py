"""`tinyrt chat`: an interactive conversation in the terminal (prompt_toolkit for the input, rich
for the output), or, with stdin not a terminal, one turn per input line, replies printed plainly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from tinyrt.errors import CacheFullError, TinyrtError
from tinyrt.sampling import is_text

from .options import (add_generation_options, add_model_option, decode_text, generation_kwargs,
                      load_llm, number, speculative_line)

MAX_LINE_BYTES = 1 << 20     # a piped input line (a turn, or a command); a longer one is skipped

HELP = """\
/help              this list
/reset             forget the conversation (keeps the system message and settings)
/system TEXT       set the system message (no TEXT: remove it)
/temp X            sampling temperature (0 = greedy)
/top-p X           nucleus sampling threshold (1 = off)
/max-tokens N      longest reply
/stats             the last reply's timings and the KV cache
/save FILE         write the conversation as JSON
/load FILE         read a conversation written by /save
/exit              quit (or Ctrl-D)
A line ending in \\ continues on the next line; Alt-Enter inserts a line break.
Ctrl-C stops a reply (what it said stays) or clears the line."""


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model",
                       description="Chat with a model. In a terminal: line editing, history, "
                                   "/help for commands, Ctrl-C stops a reply, Ctrl-D quits. With "
                                   "stdin not a terminal: one user turn per line.")
    add_model_option(p, positional=True)
    add_generation_options(p)


def main(args: argparse.Namespace) -> int:
    import tinyrt

    options = generation_kwargs(args)            # (checked before the model loads)
    llm = load_llm(args)
    session = tinyrt.ChatSession(llm, system=options.pop("system"), **options)
    if sys.stdin is None:                        # (stdin closed: nothing to read)
        return 0
    if sys.stdin.isatty() and sys.stdout.isatty():
        return Terminal(session).run()
    return piped(session)


def piped(session) -> int:
    """One turn per input line (slash commands too), replies printed as they stream. A line
    that is not UTF-8, or over MAX_LINE_BYTES, is skipped with a note."""
    out = Printer(None)
    for n, raw in enumerate(input_lines(sys.stdin.buffer), 1):
        try:
            if raw is None:
                raise TinyrtError(f"input line {n} is over {MAX_LINE_BYTES:,} bytes")
            line = decode_text(raw, f"input line {n}").rstrip("\n")
        except TinyrtError as e:
            out.note(f"error: {e}; skipped")
            continue
        if line.strip() and not command(session, line, out):
            break
    return 0


def input_lines(stream, limit: int = MAX_LINE_BYTES):
    """The lines of a binary stream as bytes, each read no further than `limit` bytes: a longer
    one is read through (and dropped) and given as None."""
    while line := stream.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := stream.readline(limit)) and not rest.endswith(b"\n"):
            pass
        yield None


class Printer:
    """Where replies and notes go: a rich console, or plain stdout/stderr."""

    def __init__(self, console):
        self.console = console

    def text(self, s: str) -> None:
        if self.console is None:
            sys.stdout.write(s)
            sys.stdout.flush()
        else:
            self.console.print(s, end="", markup=False, highlight=False, soft_wrap=True)

    def note(self, s: str) -> None:
        if self.console is None:
            print(s, file=sys.stderr, flush=True)
        else:
            self.console.print(s, style="dim", markup=False, highlight=False)


def command(session, line: str, out: Printer, stop: threading.Event | None = None) -> bool:
    """Run one input line: a slash command or a user turn. False: quit."""
    if not is_text(line):            # (a terminal's invalid bytes, surrogate-escaped)
        out.note("error: the input is not valid UTF-8 text")
        return True
    if not line.startswith("/"):
        reply(session, line, out, stop)
        return True
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            out.note(HELP)
        elif name == "/reset":
            session.reset()
            out.note("conversation cleared")
        elif name == "/system":
            session.set_system(arg or None)
            out.note("system message set" if arg else "system message removed")
        elif name in ("/temp", "/top-p", "/max-tokens"):
            key = {"/temp": "temperature", "/top-p": "top_p", "/max-tokens": "max_tokens"}[name]
            session.configure(**{key: number(arg)})        # (checked as every front end's)
            out.note(f"{key} = {session.settings[key]}")
        elif name == "/stats":
            out.note(stats(session))
        elif name == "/save":
            out.note(f"saved to {session.save(arg or 'chat.json')}")
        elif name == "/load":
            if not arg:
                raise TinyrtError("/load needs a file name")
            session.load(arg)
            out.note(f"loaded {len(session.messages)} messages from {arg}")
        else:
            out.note(f"unknown command {name}; /help lists them")
    except TinyrtError as e:
        out.note(f"error: {e}")
    return True


def reply(session, text: str, out: Printer, stop: threading.Event | None) -> None:
    """Stream the reply to `text`, ending early when `stop` is set (by Ctrl-C)."""
    gen = session.send(text)
    try:
        for r in gen:
            out.text(r.text)
            if stop is not None and stop.is_set():
                break
    except CacheFullError as e:
        out.note(f"{e}.\nThe conversation is too long for this KV cache: /reset to start over, "
                 "or restart with --kv-policy sink (or h2o) to chat past the cache size.")
        return
    except TinyrtError as e:
        out.note(f"error: {e}")
        return
    finally:
        gen.close()
    out.text("\n")
    cache = session.llm.cache
    if session.last is not None:
        out.note(status_line(session))
    if session.last_finish is None:
        out.note("(stopped)")
    elif session.last_finish == "length" and not cache.streams and cache.free == 0:
        out.note("The KV cache is full: /reset to start over, or restart with --kv-policy sink.")


def status_line(session) -> str:
    t, cache = session.last, session.llm.cache
    return (f"prefill {t.prefill_tok_s:.0f} tok/s · decode {t.decode_tok_s:.0f} tok/s · "
            f"{t.generated_tokens} tokens · cache {cache.length}/{cache.capacity}")


def stats(session) -> str:
    cache = session.llm.cache
    policy = cache.policy + (f" ({cache.n_sink} sinks)" if cache.streams else "")
    if session.last is None:
        return f"no reply yet · cache {cache.length}/{cache.capacity}, {policy}"
    t = session.last
    return (f"last reply: TTFT {t.ttft_s * 1000:.0f} ms · prefill {t.prompt_tokens} tokens at "
            f"{t.prefill_tok_s:.1f} tok/s · decode {t.generated_tokens} tokens at "
            f"{t.decode_tok_s:.1f} tok/s · finish {session.last_finish or 'stopped'}\n"
            f"KV cache: {cache.length}/{cache.capacity} tokens held, {cache.next_pos} seen, "
            f"policy {policy}" + ("\n" + speculative_line(t) if t.speculative else ""))


class Terminal:
    """The interactive chat: prompt_toolkit reads a turn, rich prints the reply as it streams."""

    def __init__(self, session):
        from rich.console import Console

        self.session = session
        self.out = Printer(Console())

    def _prompt_session(self):
        from platformdirs import user_data_path
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        keys = KeyBindings()

        @keys.add("enter")
        def _(event):                        # a trailing backslash continues the input
            buf = event.current_buffer
            if buf.text.endswith("\\"):
                buf.text = buf.text[:-1] + "\n"
                buf.cursor_position = len(buf.text)
            else:
                buf.validate_and_handle()

        @keys.add("escape", "enter")
        def _(event):
            event.current_buffer.insert_text("\n")

        try:
            path = user_data_path("tinyrt", appauthor=False)
            path.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path / "chat_history"))
        except OSError:
            history = InMemoryHistory()
        return PromptSession(history=history, key_bindings=keys, multiline=True,
                             prompt_continuation="… ")

    def run(self) -> int:
        prompt = self._prompt_session()
        llm = self.session.llm
        self.out.note(f"{llm.directory.name} · KV cache "
                      f"{llm.cache_options.describe(llm.config, llm.cache.capacity)} · /help for "
                      "commands, Ctrl-D to quit")
        while True:
            try:
                line = prompt.prompt("> ")
            except KeyboardInterrupt:        # Ctrl-C at the prompt: a fresh line
                continue
            except EOFError:                 # Ctrl-D
                return 0
            if not line.strip():
                continue
            stop = threading.Event()
            # Ctrl-C during a reply sets a flag read between tokens, so that a forward pass is
            # never cut in the middle and the conversation keeps what was said
            previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
            try:
                if not command(self.session, line.strip(), self.out, stop):
                    return 0
            finally:
                signal.signal(signal.SIGINT, previous)
