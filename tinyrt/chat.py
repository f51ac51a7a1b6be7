"""A conversation that keeps its KV cache between turns: `ChatSession`.

Each turn prefills only what is new. A new turn renders the whole conversation with the chat
template; where that text starts with the last turn's text (the template adds only the end of the
last reply and the new user turn, as ChatML and its kind do), its tokens are the last turn's as
the model saw them (the reply as generated, not re-tokenized) and the rest's. `LLM.complete` then
keeps the longest common prefix of those tokens and what the cache holds. Where the text does not
start so (a stop string cut the reply, the system message changed, a loaded conversation), the
whole conversation is tokenized again and the cache keeps what still agrees: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Iterator

from tinyrt.errors import TinyrtError

from .chat_template import ChatTemplate
from .generate import Response, Timings
from .paths import new_file, read_text, shown_path, user_path
from .sampling import DEFAULT_MAX_TOKENS, MAX_STOPS, SettingError, check_settings

# for a model without a chat template; a reply follows "Assistant:" as generated (its own
# leading space), so that the next turn's text extends the text the cache holds
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}Assistant:"
                  "{{ m.content }}{% else %}{{ m.role | capitalize }}: {{ m.content }}{% endif %}{{ '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
PLAIN_STOP = "\nUser:"
FORMAT = "tinyrt-chat"
MAX_SAVED_BYTES = 64 << 20      # a saved conversation larger than this is not one of ours


def conversation_template(llm) -> tuple[ChatTemplate, list[str]]:
    """The template a conversation with `llm` is rendered with (the model's, else a plain one)
    and the stop strings a reply needs with it."""
    if llm.template is not None:
        return llm.template, []
    return ChatTemplate(PLAIN_TEMPLATE, bos_token=llm.tokenizer.bos_token), [PLAIN_STOP]


def with_template_stops(stop, extra: list[str]) -> list[str]:
    """A reply's stop strings: the caller's (checked: sampling.check_settings) and `extra`, those
    its conversation template needs, within MAX_STOPS in all."""
    stops = list(stop or ())
    stops += [s for s in extra if s not in stops]
    if len(stops) > MAX_STOPS:
        raise SettingError("stop", f"stop takes at most {MAX_STOPS - len(extra)} strings with "
                                   f"this model (its conversation template needs {len(extra)})")
    return stops


def fit_turns(encode, messages: list[dict], cache, reserve: int,
              ids: list[int] | None = None) -> tuple[list[int], list[dict]]:
    """The conversation `messages` with its oldest turns left out until its tokens
    (`encode(messages)`, or `ids` where known) leave `reserve` slots of a dense `cache` free for
    the reply (at most half of it), as ollama truncates a chat to its context: the system (and
    developer) messages at its head and the last user turn always stay, and what follows the
    head starts at a user turn. Returns (its tokens, the messages kept). A streaming cache takes
    it all; what does not fit even so is the caller's to refuse (check_fits)."""
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    kept = messages
    ids = encode(messages) if ids is None else ids
    reserve = min(reserve, cache.capacity // 2)
    first = head
    while not cache.streams and len(ids) + reserve > cache.capacity and first < len(messages) - 1:
        first += 1
        while first < len(messages) - 1 and messages[first]["role"] != "user":
            first += 1
        kept = messages[:head] + messages[first:]
        ids = encode(kept)
    return ids, kept


def conversation_ids(llm, template: ChatTemplate, messages: list[dict]) -> list[int]:
    """The tokens of `messages` rendered with `template`, the reply's turn opened."""
    return llm.encode(template.render(messages, add_generation_prompt=True),
                      what="the conversation")


class ChatSession:
    """A multi-turn chat with `llm` (a `tinyrt.LLM`, whose KV cache it uses).

        chat = tinyrt.ChatSession(llm, system="You are terse.")
        for r in chat.send("Hi!"):
            print(r.text, end="")

    `options` are defaults for every turn's `send` (max_tokens, temperature, top_p, ...; see
    `LLM.generation`); `settings` holds them and may be changed between turns (`configure`
    checks them as it does). A reply stopped early (the caller leaves the loop, or Ctrl-C) stays
    in the history as far as it went.
    """

    def __init__(self, llm, *, system: str | None = None, **options):
        if not hasattr(llm, "tokenizer") or not hasattr(llm, "stream"):
            raise TypeError("ChatSession takes a model loaded by tinyrt.load, not "
                            f"{type(llm).__name__}")
        self.llm = llm
        self.system = system
        self.settings = check_settings(options)
        self.messages: list[dict] = []           # user and assistant turns, without the system
        self.last: Timings | None = None         # the last reply's timings
        self.last_finish: str | None = None
        self.left_out = 0      # the oldest messages the model no longer sees (the cache filled)
        self.template, self._stops = conversation_template(llm)
        self._held: str | None = None            # the conversation's text so far
        self._ids: list[int] = []                # its tokens as the model saw them
        self.reset()

    @property
    def history(self) -> list[dict]:
        """The conversation as chat messages, the system message first when there is one."""
        return self._head() + [dict(m) for m in self.messages]

    def _head(self) -> list[dict]:
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def reset(self) -> None:
        """Forget the conversation (the system message and settings stay) and empty the cache."""
        self.messages, self.left_out = [], 0
        self.llm.reset()
        self._invalidate()

    def set_system(self, text: str | None) -> None:
        """A new system message; the conversation is prefilled again at the next turn."""
        self.system = text
        self._invalidate()

    def configure(self, **settings) -> None:
        """Change settings for the next turns (a SettingError, and no change, for a bad one)."""
        self.settings.update(check_settings(settings))

    def _invalidate(self) -> None:
        self._held, self._ids = None, []

    # -- a turn ---------------------------------------------------------------------------------

    def send(self, text: str, **options) -> Iterator[Response]:
        """Stream the reply to the user message `text`, one `Response` per token (the last has
        `finish_reason`); `options` override `settings` for this turn."""
        if not isinstance(text, str) or not text.strip():
            raise TinyrtError("a chat message needs some text")
        opts = check_settings({**self.settings, **options})
        opts["stop"] = with_template_stops(opts.get("stop"), self._stops)
        messages = self._head() + self.messages[self.left_out:] + [{"role": "user",
                                                                    "content": text}]
        full = self.template.render(messages, add_generation_prompt=True)
        tok = self.llm.tokenizer
        if self._held is not None and full.startswith(self._held):
            ids = self._ids + self.llm.encode(full[len(self._held):], what="the message")
        else:
            ids = self.llm.encode(full, what="the conversation")
        # a dense cache the conversation fills: its oldest turns are left out from now on
        ids, kept = fit_turns(self._encode, messages, self.llm.cache,
                              opts.get("max_tokens") or DEFAULT_MAX_TOKENS, ids)
        if kept is not messages:
            self.left_out += len(messages) - len(kept)
            full = self.template.render(kept, add_generation_prompt=True)
        self._invalidate()
        gen = self.llm.complete(ids, **opts)     # refuses, before any work, what cannot fit
        self.messages.append({"role": "user", "content": text})
        pieces = []
        replies = iter(gen)
        try:
            for r in replies:
                pieces.append(r.text)
                yield r
        finally:
            replies.close()          # the cache settles first
            # a reply stopped early keeps the text of all its tokens (the detokenizer may have
            # held back the last few characters)
            tokens = list(gen.tokens)
            reply = "".join(pieces) if gen.finish_reason else tok.decode(tokens)
            self.messages.append({"role": "assistant", "content": reply})
            self.last, self.last_finish = gen.timings, gen.finish_reason
            # the next turn's text starts with this one's where the template adds only the end
            # of the reply; its tokens are the ones drawn, unless the reply's text is not theirs
            # (a stop string cut it, a special token)
            if tok.decode(tokens, skip_special=False) == reply:
                self._held, self._ids = full + reply, ids + tokens

    def _encode(self, messages: list[dict]) -> list[int]:
        return conversation_ids(self.llm, self.template, messages)

    # -- saving ---------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write the conversation (system message, turns, settings) as JSON; returns the path.
        Written to a new temporary file beside it (of a name no other file has), then renamed:
        an existing file is replaced whole or kept (only a regular file is replaced)."""
        path = _path(path)
        data = {"format": FORMAT, "version": 1, "system": self.system, "messages": self.messages,
                "settings": self.settings}
        tmp = None
        try:
            if path.exists() and not path.is_file():     # a directory, a FIFO, a device
                raise OSError(errno.EEXIST, "it exists and is not a regular file")
            fd, tmp = new_file(path.parent, f".{path.name[:64]}.", ".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, ensure_ascii=False, indent=1))
            os.replace(tmp, path)
        except (OSError, ValueError) as e:               # ValueError: a NUL in the name
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise TinyrtError(f"cannot save the conversation to {path}: "
                              f"{getattr(e, 'strerror', None) or e}") from None
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Replace the conversation with one written by `save`; it is prefilled at the next turn."""
        path = _path(path)
        text = read_text(path, "saved conversation", MAX_SAVED_BYTES)
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):   # RecursionError: nested too deep
            raise TinyrtError(f"{path} is not a saved conversation (not JSON)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TinyrtError(f"{path} is not a saved conversation")
        messages, system, settings = data.get("messages"), data.get("system"), data.get("settings", {})
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant")
                and isinstance(m.get("content"), str) and len(m) == 2 for m in messages):
            raise TinyrtError(f"{path}: 'messages' must be a list of user and assistant "
                              "messages with string content")
        if system is not None and not isinstance(system, str) or not isinstance(settings, dict):
            raise TinyrtError(f"{path}: 'system' must be a string and 'settings' an object")
        # settings the next turn can use (the one check every front end's options have), and
        # no more text than the cache could hold: it is tokenized whole at the next turn
        try:
            settings = check_settings(settings)
        except SettingError as e:
            raise TinyrtError(f"{path}: {e}") from None
        self.llm.check_text("".join([system or "", *(m["content"] for m in messages)]),
                            what=f"{path}: the conversation")
        self.messages, self.left_out = [dict(m) for m in messages], 0
        self.system = system
        self.settings.update(settings)
        self._invalidate()


def _path(path: str | os.PathLike) -> Path:
    """A file name from the user (paths.user_path) that names a file: not blank (a slip of the
    keyboard, in /save), nor a directory's end."""
    if not os.fsdecode(path).strip():
        raise TinyrtError(f"not a file name: {os.fsdecode(path)!r}")
    path = user_path(path, "the conversation file")
    if not path.name:
        raise TinyrtError(f"not a file name: {shown_path(path)}")
    return path
