"""The one error type that reaches users, the "did you mean" its messages offer, how they show a
caller's value, and the check of a caller's whole numbers.

A leaf module (nothing of the package imported), so that every layer (models, converters, engine,
front ends) can raise it without an arrow pointing back up. Front ends print `str(err)` as one line
and exit non-zero; any other exception is a bug.
"""

import re


class TinyrtError(Exception):
    """Something the user can fix: a bad file, a wrong option, a prompt too long for the cache."""


class ModelFormatError(TinyrtError):
    """A model file or directory that is missing, truncated, foreign or inconsistent."""


class CacheFullError(TinyrtError):
    """The KV cache cannot take the tokens asked of it under its policy."""


def closest(name: str, known) -> str | None:
    """The one of `known` names that `name` most likely misspells, if any is close (difflib's
    similarity of at least 0.6): for "did you mean" (options, commands, settings, model names)."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return close[0] if close else None


def shown(value, limit: int = 40) -> str:
    """`value` as a one-line message shows it: its repr, cut to `limit` characters. An integer
    of thousands of digits (a hostile option) is cut before it is written out in full, which
    Python refuses past 4,300 digits (a ValueError in place of the message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        digits = int(value.bit_length() * 0.30103) + 1          # (log10 2: to within one)
        return f"{'a negative' if value < 0 else 'an'} integer of about {digits:,} digits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# C0 controls but tab and newline, DEL, C1 controls (0x9b is CSI to some terminals)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# a lone surrogate: an undecodable byte of a file name or an argument (surrogate-escaped), or
# a JSON escape not in a pair; no encoder takes it
SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` as it may be written to a terminal or a pipe: control characters other than
    newline and tab as visible escapes (`\\x1b`), so that text from a model or a file cannot
    retitle, clear or recolour the user's terminal; lone surrogates (undecodable bytes of a
    file name, surrogate-escaped) as U+FFFD, which every encoder takes. The one filter of what
    tinyrt writes from a model or a file to a terminal, a pipe or an HTTP header."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return SURROGATE.sub("\ufffd", text)


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """`value` as an int where it is a whole number in [low, high] (high None: no bound above),
    else a TinyrtError naming `name`: the one check of a caller's whole numbers, before any
    arithmetic on them (a huge one overflows a float or a C integer; a float or a bool is not
    a count)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < low or high is not None and value > high:
        bound = f"from {low:,} to {high:,}" if high is not None else f"of at least {low:,}"
        raise TinyrtError(f"{name} must be a whole number {bound}, not {shown(value)}")
    return int(value)


def rust_panic(e: BaseException) -> bool:
    """Whether `e` is a panic inside the Rust of `tokenizers`: pyo3 raises it as
    pyo3_runtime.PanicException, a BaseException (no `except Exception` catches it) that cannot be
    imported by name."""
    return type(e).__name__ == "PanicException"
