"""The one error type that reaches users.

A leaf module with no imports, so that every layer (models, converters, engine, front ends) can raise
it without an arrow pointing back up. Front ends print `str(err)` as one line and exit non-zero; any
other exception is a bug.
"""


class TinyrtError(Exception):
    """Something the user can fix: a bad file, a wrong option, a prompt too long for the cache."""


class ModelFormatError(TinyrtError):
    """A model file or directory that is missing, truncated, foreign or inconsistent."""


class CacheFullError(TinyrtError):
    """The KV cache cannot take the tokens asked of it under its policy."""
