"""The one error type that reaches users, and the "did you mean" its messages offer.

A leaf module (nothing of the package imported), so that every layer (models, converters, engine,
front ends) can raise it without an arrow pointing back up. Front ends print `str(err)` as one line
and exit non-zero; any other exception is a bug.
"""


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
