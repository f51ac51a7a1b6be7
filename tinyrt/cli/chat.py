"""`tinyrt chat`: an interactive conversation in the terminal (prompt_toolkit for the input, rich
for the output: replies rendered as markdown as they stream), or, with stdin not a terminal, one
turn per input line. With stdout not a terminal, replies are written as plain text, as generated.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tinyrt.errors import CacheFullError, TinyrtError, printable
from tinyrt.sampling import DEFAULT_MAX_TOKENS, SHOWN_SETTINGS, SamplingParams, is_text

from .options import (add_generation_options, add_model_option, add_raw_output_option,
                      decode_text, generation_kwargs, load_llm, number, speculative_line)

MAX_LINE_BYTES = 1 << 20     # a piped input line (a turn, or a command); a longer one is skipped
STOPPED = "[stopped]"        # after a reply stopped in a terminal
# A streaming reply is drawn again at most this often: each drawing lays out the reply's last,
# unfinished block, and the tokens that come in between are drawn together
RENDER_INTERVAL = 1 / 15
# The settings /set shows and changes, and the other names it takes for them
SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens", "seed",
            "stop")
ALIASES = {"temp": "temperature", "n": "max_tokens"}

HELP = """\
/help              this list
/reset             forget the conversation (keeps the system message and settings)
/system TEXT       set the system message (no TEXT: remove it)
/set               the generation settings in effect
/set NAME VALUE    change one: temperature (temp), top_k, top_p, min_p, repeat_penalty,
                   max_tokens, seed (-1: random), stop (the text to stop at);
                   VALUE default: back to the default
/temp X            the same as /set temperature X (0 = greedy)
/top-p X           the same as /set top_p X
/max-tokens N      the same as /set max_tokens N
/stats             the last reply's timings and the KV cache
/save FILE         write the conversation as JSON
/load FILE         read a conversation written by /save
/exit              quit (or /quit, ollama's /bye, Ctrl-D)
A line ending in \\ continues on the next line; Alt-Enter inserts a line break.
Ctrl-C stops a reply (what it said stays) or clears the line; Ctrl-D during a reply
stops it and quits. Keys typed during a reply go to the next prompt."""


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model",
                       description="Chat with a model. In a terminal: line editing, history, "
                                   "replies rendered as markdown, /help for commands, Ctrl-C "
                                   "stops a reply, Ctrl-D quits. With stdin not a terminal: one "
                                   "user turn per line. With stdout not a terminal: replies as "
                                   "plain text.")
    add_model_option(p, positional=True)
    add_generation_options(p)
    p.add_argument("--plain", "--no-markdown", dest="markdown", action="store_false",
                   help="in a terminal, print replies as plain text (word-wrapped) instead of "
                        "rendering their markdown")
    add_raw_output_option(p)


def main(args: argparse.Namespace) -> int:
    import tinyrt

    options = generation_kwargs(args)            # (checked before the model loads)
    llm = load_llm(args)
    session = tinyrt.ChatSession(llm, system=options.pop("system"), **options)
    if sys.stdin is None:                        # (stdin closed: nothing to read)
        return 0
    if sys.stdin.isatty() and sys.stdout.isatty():
        return Terminal(session, markdown=args.markdown, raw=args.raw_output).run()
    return piped(session, markdown=args.markdown, raw=args.raw_output)


def piped(session, markdown: bool = True, raw: bool = False) -> int:
    """One turn per input line (slash commands too), replies printed as they stream (rendered
    where stdout is a terminal, else plain text as generated). A line that is not UTF-8, or over
    MAX_LINE_BYTES, is skipped with a note."""
    if sys.stdout.isatty() and not raw:
        from rich.console import Console

        out = Printer(Console(), markdown=markdown)
    else:
        out = Printer(None, raw=raw)
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


MAX_HISTORY_BYTES = 64 << 20     # the chat history read at each start: larger, none is kept


def _history_file(path: Path) -> bool:
    """Whether the chat history may live in `path`: none there yet, or a regular file (a link to
    one: a history kept elsewhere on purpose) of a sane size. A FIFO there would hang the
    prompt, a directory or a broken link end each line in a traceback: the history is then
    kept in memory."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return not os.path.islink(path)     # (a dangling link: the file it names is not ours)
    except OSError:                          # a link loop, a name too long
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size <= MAX_HISTORY_BYTES


class Printer:
    """Where replies and notes go. With a rich `console` (a terminal) a reply is rendered as it
    streams (`LiveReply`: markdown, or with `markdown` false plain text, word-wrapped); without
    one it goes to stdout as plain text, as generated (scripts read it). Notes go to `notes`
    (a console: dim), else to stderr. Control characters in either are shown as escapes
    (`printable`), but in a plain reply that is `raw` (--raw-output)."""

    def __init__(self, console=None, *, markdown: bool = True, notes=None,
                 interval: float = RENDER_INTERVAL, raw: bool = False):
        self.console, self.markdown, self.notes, self.interval = console, markdown, notes, interval
        self.raw = raw

    def reply(self):
        """A reply's output: `write(text)` for each piece, `close(ended, stopped)` at the end."""
        if self.console is None:
            return PlainReply(self.raw)
        return LiveReply(self.console, markdown=self.markdown, interval=self.interval)

    def note(self, s: str) -> None:
        if self.notes is None:
            print(printable(s), file=sys.stderr, flush=True)
        else:
            self.notes.print(printable(s), style="dim", markup=False, highlight=False)


class PlainReply:
    """A reply written to stdout as generated (control characters as escapes, but `raw`), then
    a line end (not after an error: its note follows on stderr). A stopped reply is not marked:
    stdout is the replies' text alone."""

    def __init__(self, raw: bool = False):
        self.raw = raw

    def write(self, text: str) -> None:
        sys.stdout.write(text if self.raw else printable(text))
        sys.stdout.flush()

    def close(self, ended: bool = True, stopped: bool = False) -> None:
        if ended:
            sys.stdout.write("\n")
            sys.stdout.flush()


class LiveReply:
    """A reply drawn on a rich console as it streams, word-wrapped at the console's width: as
    markdown (headings, emphasis, lists, highlighted code blocks), or as plain text.

    Only the reply's last block (markdown) or line (plain text) is live, drawn again in a rich
    Live region as tokens come, at most once per `interval`; once a block is complete (what
    follows cannot change how it looks) it is printed above the live region, once, and never laid
    out again. So a drawing costs the size of one block, not of the reply, and the screen does
    not flicker. When the reply ends (or is stopped) its last block stays where it was drawn."""

    def __init__(self, console, *, markdown: bool = True, interval: float = RENDER_INTERVAL):
        from rich.live import Live

        self.console, self.markdown, self.interval = console, markdown, interval
        self.pending: list[str] = []         # text not drawn yet
        self.tail = ""                       # text drawn in the live region
        self.drawn_at = -float("inf")
        # (no refresh thread: the live region is drawn here, from the tokens' loop)
        self.live = Live(console=console, auto_refresh=False, vertical_overflow="visible")

    def write(self, text: str) -> None:
        self.live.start()                    # (at the first text: an error before has the line)
        self.pending.append(printable(text))
        now = time.monotonic()
        if now - self.drawn_at >= self.interval:
            self.drawn_at = now
            self._draw()

    def close(self, ended: bool = True, stopped: bool = False) -> None:
        """Draw the rest and leave it on the screen (the reply's line ended); a `stopped` reply
        ends in a dim [stopped]."""
        if not self.live.is_started:         # (no text came)
            if stopped:
                self.console.print(STOPPED, style="dim", markup=False, highlight=False)
            return
        try:
            self._draw()
            # the whole last block this time, however tall (Live's last drawing scrolls)
            self.live.update(Lines(self._render(self.tail), mark=STOPPED if stopped else ""),
                             refresh=False)
        finally:
            self.live.stop()

    def _draw(self) -> None:
        self.tail += "".join(self.pending)
        self.pending.clear()
        cut = complete_blocks(self.tail) if self.markdown else self.tail.rfind("\n") + 1
        done, self.tail = self.tail[:cut], self.tail[cut:]
        # the live region's new content first, so that printing above it draws it once
        self.live.update(Lines(self._render(self.tail), fit=True), refresh=not done)
        if done:
            if self.markdown:
                from rich.console import Group
                from rich.text import Text

                # the blank line that separates blocks in a markdown rendering of the whole
                self.console.print(Group(Lines(self._render(done)), Text()))
            else:
                self.console.print(self._render(done[:-1]))   # (print ends the line)

    def _render(self, text: str):
        from rich.markdown import Markdown
        from rich.text import Text

        return Markdown(text) if self.markdown else Text(text)


class Lines:
    """A rendering of a part of a reply: of markdown, without the blank lines it starts with
    (rich starts a rendering that opens with a list so, and the parts are separated here), and
    with `fit` only the last lines that fit the console, less one: a live region taller than
    the screen cannot be drawn again in place (its top has scrolled off), so while a long block
    streams its end shows; it is printed whole once complete. A `mark` (dim) follows the last
    line, or has a line of its own where it does not fit there."""

    def __init__(self, renderable, fit: bool = False, mark: str = ""):
        self.renderable, self.fit, self.mark = renderable, fit, mark

    def __rich_console__(self, console, options):
        from rich.markdown import Markdown
        from rich.segment import Segment
        from rich.style import Style

        lines = console.render_lines(self.renderable, options, pad=False, new_lines=False)
        if isinstance(self.renderable, Markdown):
            while lines and all(not s.text.strip() and not (s.style and s.style.bgcolor)
                                for s in lines[0]):     # (a code block's margin has colour)
                lines.pop(0)
        if self.fit:
            lines = lines[-max(1, options.size.height - 1):]
        if self.mark:
            mark = Segment(self.mark, Style(dim=True))
            last = rstrip(lines[-1]) if lines else []
            if last and Segment.get_line_length(last) + 1 + len(self.mark) <= options.max_width:
                lines[-1] = [*last, Segment(" "), mark]
            else:
                lines.append([mark])
        for line in lines:
            yield from line
            yield Segment.line()


def rstrip(line: list) -> list:
    """A rendered line without the spaces that pad it to the width (where they have no colour:
    a code block's do)."""
    line = list(line)
    while line and not (line[-1].style and line[-1].style.bgcolor):
        text = line[-1].text.rstrip()
        if text:
            line[-1] = line[-1]._replace(text=text)
            break
        line.pop()
    return line


# a code fence's opening or closing line: ``` or ~~~ (an info string after ``` has no `)
FENCE = re.compile(r"\s*(`{3,}(?!.*`)|~{3,})")


def complete_blocks(text: str) -> int:
    """How much of markdown `text` is complete top-level blocks, which the text that follows
    cannot change: up to the start of the last line that begins a new block (a line that starts
    at the margin after a blank line or after a code block, or that opens a code block), outside
    code blocks. 0 where no block is complete yet."""
    cut, pos, fence, new_block = 0, 0, None, False
    lines = text.split("\n")                # (the last one unfinished, perhaps empty)
    for i, line in enumerate(lines):
        complete = i < len(lines) - 1
        if fence is not None:                # inside a code block, until its closing fence
            mark = line.strip()
            if complete and mark.startswith(fence) and mark == mark[0] * len(mark):
                fence, new_block = None, True
        else:
            opening = FENCE.match(line) if complete else None
            at_margin = line[:1] not in ("", " ", "\t")
            if pos and at_margin and (new_block or opening):
                cut = pos
            if opening:
                fence = opening.group(1)
            new_block = not line.strip()
        pos += len(line) + 1
    return cut


def command(session, line: str, out: Printer, stopped: Callable[[], bool] | None = None) -> bool:
    """Run one input line: a slash command or a user turn (stopped early where `stopped()` says
    so, asked between tokens). False: quit."""
    if not is_text(line):            # (a terminal's invalid bytes, surrogate-escaped)
        out.note("error: the input is not valid UTF-8 text")
        return True
    if not line.startswith("/"):
        reply(session, line, out, stopped)
        return True
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if name in ("/exit", "/quit", "/bye"):              # (/bye: ollama's)
            return False
        if name == "/help":
            out.note(HELP)
        elif name == "/reset":
            session.reset()
            out.note("conversation cleared")
        elif name == "/system":
            session.set_system(arg or None)
            out.note("system message set" if arg else "system message removed")
        elif name == "/set":
            out.note(set_command(session, arg))
        elif name in ("/temp", "/top-p", "/max-tokens"):
            key = {"/temp": "temperature", "/top-p": "top_p", "/max-tokens": "max_tokens"}[name]
            out.note(set_command(session, f"{key} {arg}"))
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


def set_command(session, arg: str) -> str:
    """/set: the settings in effect; /set NAME VALUE: change one (VALUE `default`: back to the
    default). A bad name or value is a TinyrtError, and nothing changes."""
    if not arg:
        return settings_table(session)
    name, _, value = arg.partition(" ")
    value = value.strip()
    key = name.lower().lstrip("-").replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in SETTINGS:
        raise TinyrtError(f"unknown setting {name!r} (the settings: {', '.join(SETTINGS)})")
    if not value:
        raise TinyrtError(f"/set {key} needs a value (default: back to the default)")
    if value == "default":
        given = None
    else:
        given = value if key == "stop" else number(value)
    session.configure(**{key: given})        # (checked as every front end's options are)
    shown, source = effective(session)[key]
    return f"{key} = {shown}" + (f" ({source})" if source else "")


def effective(session) -> dict[str, tuple[str, str]]:
    """Each of SETTINGS as the next turn runs on it, as text, and where it comes from when the
    session does not set it: the model's own settings (its generation_config.json or GGUF
    metadata) or tinyrt's default. The sampler's values are made as LLM.generation makes them:
    the session's over the model's over SamplingParams' own."""
    settings, model = session.settings, session.llm.sampling_sources()
    given = {k: v for k, v in settings.items()
             if k in SamplingParams.__dataclass_fields__ and v is not None}
    params = SamplingParams(**{**{k: v for k, (v, src) in model.items() if src != "tinyrt"},
                               **given})
    out = {}
    for key in SETTINGS:
        value = settings.get(key)
        if key == "stop":                    # (the chat template's own stops are not shown)
            out[key] = (", ".join(map(repr, value)) if value else "none", "")
        elif key == "max_tokens":
            out[key] = (str(value or DEFAULT_MAX_TOKENS), "" if value else "default")
        elif key == "seed":
            out[key] = ("random" if value is None else str(value), "")
        else:
            source = model.get(key, (None, "tinyrt"))[1]
            source = ("" if key in given else "default" if source == "tinyrt"
                      else f"the model's {source}")
            out[key] = (str(getattr(params, key)), source)
    return out


def sampling_line(session) -> str:
    """The sampler's settings in effect, grouped by where they come from, for the banner."""
    groups: dict[str, list[str]] = {}
    for key, (shown, source) in effective(session).items():
        if key in SHOWN_SETTINGS:
            where = {"": "yours", "default": "tinyrt's defaults"}.get(source, source)
            groups.setdefault(where, []).append(f"{key} {shown}")
    return "sampling " + "; ".join(f"{', '.join(v)} ({k})" for k, v in groups.items()) + \
        " · /set to change"


def settings_table(session) -> str:
    rows = effective(session)
    width = max(len(shown) for shown, _ in rows.values())
    return "\n".join(f"{key:<15} {shown:<{width}}  {source}".rstrip()
                     for key, (shown, source) in rows.items())


def reply(session, text: str, out: Printer, stopped: Callable[[], bool] | None) -> None:
    """Stream the reply to `text`, ending early when `stopped()` (Ctrl-C, Ctrl-D); a reply so
    stopped is shown as the conversation keeps it, and marked."""
    gen = session.send(text)
    left_out = session.left_out
    shown, error, ended, pieces, broke = out.reply(), None, False, [], False
    try:
        for r in gen:
            shown.write(r.text)
            pieces.append(r.text)
            if stopped is not None and stopped():
                broke = True
                break
        ended = True
    except CacheFullError as e:
        error = (f"{e}.\nThe conversation is too long for this KV cache: /reset to start over, "
                 "or restart with --kv-policy sink (or h2o) to chat past the cache size.")
    except TinyrtError as e:
        error = f"error: {e}"
    finally:
        gen.close()
        cut = ended and broke and session.last_finish is None
        if cut:
            # the conversation keeps the text of all the reply's tokens, some of which the
            # stream held back (the start of a stop string, of a character): shown too
            kept, said = session.messages[-1]["content"], "".join(pieces)
            if kept.startswith(said):
                shown.write(kept[len(said):])
        shown.close(ended, stopped=cut)      # (before a note: below the reply)
    if error is not None:
        out.note(error)
        return
    cache = session.llm.cache
    if session.left_out > left_out and left_out == 0:      # (said once a conversation)
        out.note(f"The conversation fills the KV cache ({cache.capacity} tokens): its oldest "
                 "turns are left out from now on (/reset to start over, --kv-size for more).")
    if session.last is not None:
        out.note(status_line(session))
    if session.last_finish == "length" and not cache.streams and cache.free == 0:
        out.note(f"The reply was cut where the KV cache ends ({cache.capacity} tokens); the "
                 "next turn leaves the oldest turns out.")


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

    def __init__(self, session, *, markdown: bool = True, raw: bool = False):
        from rich.console import Console

        self.session = session
        console = Console()
        # (--raw-output: the replies' text as generated, so not through rich)
        self.out = Printer(None if raw else console, markdown=markdown, notes=console, raw=raw)

    def _prompt_session(self):
        from platformdirs import user_data_path
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings
        from prompt_toolkit.key_binding.bindings.mouse import load_mouse_bindings
        from prompt_toolkit.keys import Keys

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

        mouse = load_mouse_bindings().get_bindings_for_keys((Keys.Vt100MouseEvent,))[0].handler

        @keys.add(Keys.Vt100MouseEvent)
        def _(event):
            # a mouse report that is malformed (an escape sequence typed or pasted raw) is
            # ignored: prompt_toolkit's own handler raises on it, which ends the prompt
            try:
                return mouse(event)
            except (ValueError, IndexError, KeyError):
                return None

        history = InMemoryHistory()
        try:
            path = user_data_path("tinyrt", appauthor=False)
            path.mkdir(parents=True, exist_ok=True)
            if _history_file(path / "chat_history"):
                history = FileHistory(str(path / "chat_history"))
        except OSError:
            pass
        return PromptSession(history=history, key_bindings=keys, multiline=True,
                             prompt_continuation="… ")

    def run(self) -> int:
        prompt = self._prompt_session()
        llm = self.session.llm
        self.out.note(f"{llm.directory.name} · KV cache "
                      f"{llm.cache_options.describe(llm.config, llm.cache.capacity)} · /help for "
                      "commands, Ctrl-D to quit")
        self.out.note(sampling_line(self.session))
        while True:
            try:
                line = prompt.prompt("> ")
            except KeyboardInterrupt:        # Ctrl-C at the prompt: a fresh line
                continue
            except EOFError:                 # Ctrl-D
                return 0
            if not line.strip():
                continue
            keys = Keys(sys.stdin.fileno())
            # Ctrl-C during a reply sets a flag read between tokens, so that a forward pass is
            # never cut in the middle and the conversation keeps what was said
            previous = signal.signal(signal.SIGINT, keys.interrupt)
            try:
                with keys:
                    going_on = command(self.session, line.strip(), self.out, keys.stopped)
            finally:
                signal.signal(signal.SIGINT, previous)
            if not going_on or keys.quit:
                return 0
            type_ahead(prompt, keys.typed)


def type_ahead(prompt, typed: bytes) -> None:
    """Give the keys typed during a reply to the next prompt, as if typed there (prompt_toolkit
    takes them first): the text shows in it, edited by the keys as the prompt edits (a
    backspace, an arrow), and an Enter among them sends it."""
    from prompt_toolkit.input.typeahead import store_typeahead
    from prompt_toolkit.input.vt100_parser import Vt100Parser

    presses = []
    parser = Vt100Parser(presses.append)
    parser.feed(typed.decode("utf-8", "surrogateescape"))    # (as prompt_toolkit reads keys)
    parser.flush()
    store_typeahead(prompt.input, presses)


class Keys:
    """The keyboard while a reply streams (or a command runs), on terminal `fd`. Keys are not
    echoed: an echo lands in the reply's live region, and its line is then drawn twice. What is
    typed is read between tokens (`stopped`) and kept in `typed`, for the next prompt. Ctrl-C
    (a signal, as at any time: `interrupt`) stops the reply, and so does Ctrl-D (with line
    editing off, the byte 0x04 in what is typed), which then quits (`quit`). The terminal's
    settings come back at the end, whatever ends it. Not a terminal: nothing is read."""

    def __init__(self, fd: int):
        self.fd, self.typed, self.interrupted, self.quit = fd, bytearray(), False, False
        self.saved = None

    def __enter__(self) -> Keys:
        try:
            import termios
        except ImportError:                  # (not POSIX: keys are left to the console)
            return self
        try:
            saved, mode = termios.tcgetattr(self.fd), termios.tcgetattr(self.fd)
            # no echo, no line editing (the bytes as typed, Ctrl-D too), reads that take what is
            # there without waiting; signals stay (Ctrl-C) and keep what was typed (NOFLSH)
            mode[3] = mode[3] & ~(termios.ECHO | termios.ICANON) | termios.NOFLSH
            mode[6][termios.VMIN], mode[6][termios.VTIME] = 0, 0
            termios.tcsetattr(self.fd, termios.TCSANOW, mode)
        except termios.error:                # (not a terminal)
            return self
        self.saved = saved
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is None:
            return
        import termios

        try:
            self.read()                      # (what was typed after the last token)
        finally:
            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)

    def interrupt(self, *_) -> None:
        self.interrupted = True

    def stopped(self) -> bool:
        self.read()
        return self.interrupted or self.quit

    def read(self) -> None:
        if self.saved is None or self.quit:
            return
        try:
            while chunk := os.read(self.fd, 4096):
                if b"\x04" in chunk:            # Ctrl-D: what follows it is not for the chat
                    chunk, self.quit = chunk[:chunk.index(b"\x04")], True
                self.typed += chunk[:max(0, MAX_LINE_BYTES - len(self.typed))]
                if self.quit:
                    return
        except OSError:                      # the terminal is gone
            self.quit = True
