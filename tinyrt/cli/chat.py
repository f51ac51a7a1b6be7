"""`tinyrt chat`: an interactive conversation in the terminal (prompt_toolkit for the input, rich
for the output), or, with stdin not a terminal, one turn per input line, replies printed plainly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from tinyrt.errors import CacheFullError, TinyrtError

from .options import (add_generation_options, add_model_option, generation_kwargs, load_llm,
                      speculative_line)

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

    llm = load_llm(args)
    options = generation_kwargs(args)
    session = tinyrt.ChatSession(llm, system=options.pop("system"), **options)
    if sys.stdin.isatty() and sys.stdout.isatty():
        return Terminal(session).run()
    return piped(session)


def piped(session) -> int:
    """One turn per input line (slash commands too), replies printed as they stream."""
    out = Printer(None)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip() and not command(session, line, out):
            break
    return 0


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
            key, kind = {"/temp": ("temperature", float), "/top-p": ("top_p", float),
                         "/max-tokens": ("max_tokens", int)}[name]
            try:
                session.settings[key] = kind(arg)
            except ValueError:
                raise TinyrtError(f"{name} needs a number") from None
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
