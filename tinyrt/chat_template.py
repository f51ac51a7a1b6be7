"""Chat templates: the model's jinja template, rendered in jinja2's sandbox.

A template comes inside a downloaded file, so it is untrusted: it runs in an
`ImmutableSandboxedEnvironment` (no attribute access to Python internals, no mutation of the
messages we pass), with the same options and helpers as transformers' `apply_chat_template`, so that
prompts match token for token. Work is bounded too: `range` hands out at most RANGE_BUDGET items
per render, repetition (`'x' * n`) builds at most MAX_REPEAT items and powers take small
exponents, so that a hostile template fails cleanly instead of hanging or filling memory.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from typing import Any

from tinyrt.errors import TinyrtError


class ChatTemplateError(TinyrtError):
    pass


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


RANGE_BUDGET = 1_000_000      # items all `range` calls of one render may produce
MAX_REPEAT = 1_000_000        # items of a string or list built by `*`
MAX_EXPONENT = 256


def _sandbox(**options):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            sized = [x for x in (left, right) if isinstance(x, (str, list, tuple))]
            count = [x for x in (left, right) if isinstance(x, int)]
            if operator == "*" and sized and count and len(sized[0]) * count[0] > MAX_REPEAT:
                raise ChatTemplateError(f"the chat template builds a sequence of more than "
                                        f"{MAX_REPEAT} items")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                raise ChatTemplateError(f"the chat template raises to a power above {MAX_EXPONENT}")
            return super().call_binop(context, operator, left, right)

    return Sandbox(**options)


class ChatTemplate:
    """A compiled chat template with the tokenizer's special-token strings."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        env = _sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["range"] = self._range       # budgeted: reset by each render
        self._local = threading.local()          # (each thread's render has its own budget)
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...])."""
        from jinja2 import TemplateError
        from jinja2.sandbox import SecurityError

        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ChatTemplateError("each message needs a string 'role' and 'content'")
        self._local.budget = RANGE_BUDGET
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"the chat template tried something unsafe: {e}") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError, RecursionError, OverflowError) as e:
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def _range(self, *args):
        from jinja2.sandbox import safe_range

        r = safe_range(*args)
        self._local.budget -= len(r)
        if self._local.budget < 0:
            raise ChatTemplateError(f"the chat template loops over more than {RANGE_BUDGET} "
                                    "items")
        return r


def template_from_config(config: dict) -> ChatTemplate | None:
    """The chat template named in a tokenizer config (a string, or a list of named templates of
    which "default" is used), or None when the model has none."""
    from tinyrt.tokenizer import token_text

    src = config.get("chat_template")
    if isinstance(src, list):
        named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
        src = named.get("default")
    if not isinstance(src, str) or not src.strip():
        return None
    return ChatTemplate(src, bos_token=token_text(config.get("bos_token")),
                        eos_token=token_text(config.get("eos_token")))
