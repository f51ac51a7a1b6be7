"""The filters and globals a chat template gets in the sandbox (tinyrt.template_sandbox): jinja2's
own, and transformers' tojson and strftime_now, with the same names and arguments; each one that
can write far more than it reads is measured before it runs, and every result after."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from jinja2 import filters as F
from jinja2.utils import generate_lorem_ipsum, pass_environment, pass_eval_context

from .template_sandbox import (ChatTemplateError, current_limits, int_or, joined_size, measure,
                               one_line, percent_size, replaced_size, text_size)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators=None, sort_keys: bool = False) -> str:
    limits = current_limits()
    width = len(indent) if isinstance(indent, str) else int_or(indent)
    limits.fits(width * (1 + measure(x, limits.chars)[1]))     # json writes the indent per level
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    pieces, chars = [], 0
    for piece in encoder.iterencode(x):     # (json.dumps' C encoder writes all of it in one call)
        chars += len(piece)
        limits.fits(chars)
        limits.tick()
        pieces.append(piece)
    return "".join(pieces)


def _center(value, width=80):
    current_limits().fits(int_or(width))
    return F.do_center(value, width)


def _indent(s, width=4, first=False, blank=False):
    if not isinstance(s, str):      # (jinja2's indent does `s += "\n"`, extending a list in place)
        raise TypeError(f"indent takes a string, not {type(s).__name__}")
    text, pad = s, len(width) if isinstance(width, str) else max(int_or(width), 0)
    current_limits().fits(len(text) + (text.count("\n") + 1) * (pad + 1))
    return F.do_indent(s, width, first, blank)


@pass_environment
def _wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None,
              break_on_hyphens=True):
    limits, text = current_limits(), str(s)
    wrap = environment.newline_sequence if wrapstring is None else str(wrapstring)
    limits.fits(len(text) + (2 * len(text) + 1) * len(wrap))   # a line per character at most
    longest = max(map(len, text.split()), default=0)
    # textwrap cuts a long word a line at a time, copying the rest of it each time
    limits.charge(longest * longest // max(int_or(width), 1))
    return F.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


@pass_eval_context
def _replace(eval_ctx, s, old, new, count=None):
    count_ = -1 if count is None else int_or(count, -1)
    current_limits().fits(replaced_size(str(s), str(old), str(new), count_))
    return F.do_replace(eval_ctx, s, old, new, count)


def _format(value, *args, **kwargs):
    limits = current_limits()
    limits.fits(percent_size(str(value), kwargs or args, limits.chars))
    return F.do_format(value, *args, **kwargs)


@pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    items = list(value)         # (read once, here)
    limits = current_limits()
    limits.fits(joined_size(d, items, limits.chars))
    return F.sync_do_join(eval_ctx, items, d, attribute)


def _batch(value, linecount, fill_with=None):
    current_limits().fits(int_or(linecount), "a sequence", "items")
    return F.do_batch(value, linecount, fill_with)


def _slice(value, slices, fill_with=None):
    current_limits().fits(int_or(slices), "a sequence", "items")
    return F.sync_do_slice(value, slices, fill_with)


@pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    if attribute is not None:
        iterable = map(F.make_attrgetter(environment, attribute), iterable)
    values = list(iterable)
    if hasattr(start, "__len__"):       # sum() copies the partial sum at each step
        items = len(start) + sum(len(v) for v in values if hasattr(v, "__len__"))
        current_limits().charge(8 * len(values) * items)
    return sum(values, start)


def _round(value, precision=0, method="common"):
    current_limits().bits(abs(int_or(precision)) * 4)       # it may compute 10 ** precision
    return F.do_round(value, precision, method)


def _pprint(value):
    limits = current_limits()
    chars, depth = measure(value, limits.chars)
    limits.fits(chars * (depth + 1))               # each line indented by its depth
    return F.do_pprint(value)


_FILTERS = {"tojson": _tojson, "center": _center, "indent": _indent, "wordwrap": _wordwrap,
            "replace": _replace, "format": _format, "join": _join, "batch": _batch,
            "slice": _slice, "sum": _sum, "round": _round, "pprint": _pprint}
# filters that turn their value into text first
_TEXT_FILTERS = {"capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
                 "replace", "safe", "string", "striptags", "title", "trim", "truncate", "upper",
                 "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"}


def _guarded(f, measure_value: bool):
    """A filter whose value is measured (if it writes it as text) and whose result is counted."""
    value_at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        limits = current_limits()
        if measure_value and len(args) > value_at:
            limits.fits(text_size(args[value_at], limits.chars))
        return limits.made(f(*args, **kwargs))
    return guarded


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the conversation: {one_line(message)}")


def _strftime_now(fmt):
    current_limits().fits(256 * len(fmt))      # (Python's strftime stops at 256 per format character)
    return datetime.now().strftime(fmt)


def _lipsum(n=5, html=True, min=20, max=100):     # (jinja2's names)
    current_limits().fits(int_or(n) * (int_or(max) * 16 + 10))   # a word and its punctuation: under 16
    return generate_lorem_ipsum(n, html, min, max)




def filters(defaults: dict) -> dict:
    """jinja2's filters `defaults` with ours in place of theirs, each one guarded."""
    return {name: _guarded(f, name in _TEXT_FILTERS) for name, f in {**defaults, **_FILTERS}.items()}


GLOBALS = {"raise_exception": _raise_exception, "strftime_now": _strftime_now, "lipsum": _lipsum}
