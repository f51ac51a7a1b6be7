"""Paths the user names and the text files tinyrt reads, in one place: a name no file can have, a
~user that does not exist, an OSError (a name too long, a file used as a directory), a file that
is not a regular file (a directory, a FIFO, /dev/zero), one larger than its use allows or bytes
that are not UTF-8 each become one line naming the path, never a traceback, a hang or a read
without end."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tinyrt.errors import ModelFormatError, TinyrtError

MAX_TEXT_BYTES = 256 << 20       # a text to tokenize whole (ppl --text, convert --calib)
MAX_JSON_BYTES = 64 << 20        # a config file (config.json, tokenizer_config.json, ...)
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json / tokenizer.model: the largest vocabularies


def shown(path: str | os.PathLike) -> str:
    """A path as a message prints it: as typed, unless it holds something that would break the
    one line or cannot be printed (a newline, bytes that are not UTF-8): then quoted, escaped."""
    text = os.fsdecode(path)
    return text if text.isprintable() else repr(text)


def _label(path, what: str | None) -> str:
    return f"{what} {shown(path)}" if what else shown(path)


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def user_path(name: str | os.PathLike | bytes, what: str | None = None) -> Path:
    """A path the user named (`what`: how messages call it, e.g. "--calib"), ~ and ~user
    expanded. TinyrtError for a name no file can have or a ~user that does not exist."""
    text = os.fsdecode(name)
    if not text or "\0" in text:           # "" would mean the current directory
        raise TinyrtError(f"{what or 'path'} {text!r}: not a file name")
    try:
        return Path(text).expanduser()
    except RuntimeError:                   # pathlib's word for ~user of no such user
        user = text[1:].split(os.sep, 1)[0]
        raise TinyrtError(f"{_label(text, what)}: no user named {user!r} for ~") from None


def stat_or_none(path: Path, what: str | None = None) -> os.stat_result | None:
    """The path's status (symlinks followed), None where nothing is there; TinyrtError for any
    other OSError (a name too long, a file used as a directory, a symlink loop, no permission)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TinyrtError(f"cannot use {_label(path, what)}: {_reason(e)}") from None


def _not_regular(info: os.stat_result) -> str:
    mode = info.st_mode
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
    return f"it is {kind}, not a regular file"


def read_bytes(path: str | os.PathLike, what: str | None = None, limit: int = MAX_TEXT_BYTES,
               *, missing_ok: bool = False, error: type[TinyrtError] = TinyrtError
               ) -> bytes | None:
    """The contents of a regular file of at most `limit` bytes (None for a missing one where
    `missing_ok`); `error` (a TinyrtError class) with one line otherwise."""
    label = _label(path, what)
    try:
        # O_NONBLOCK: opening a FIFO with no writer would wait forever. The kind and size are
        # checked on the open descriptor, so nothing swapped in after the check is read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise error(f"cannot read {label}: no such file") from None
    except OSError as e:
        raise error(f"cannot read {label}: {_reason(e)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"cannot read {label}: {_not_regular(info)}")
        if info.st_size > limit:
            raise error(f"cannot read {label}: {info.st_size:,} bytes, more than the "
                        f"{limit:,} it may have")
        with open(fd, "rb", closefd=False) as f:
            # read(n) allocates n bytes up front: ask for the size the file has, not the limit
            want = min(info.st_size, limit) + 1
            data = f.read(want)
            if len(data) == want < limit + 1:   # longer than it said (it grew, or /proc's size 0)
                data += f.read(limit + 1 - want)
    except OSError as e:
        raise error(f"cannot read {label}: {_reason(e)}") from None
    finally:
        os.close(fd)
    if len(data) > limit:                  # it grew after the check
        raise error(f"cannot read {label}: more than the {limit:,} bytes it may have")
    return data


def read_text(path: str | os.PathLike, what: str | None = None, limit: int = MAX_TEXT_BYTES,
              *, missing_ok: bool = False, error: type[TinyrtError] = TinyrtError) -> str | None:
    """A UTF-8 text file, as `read_bytes` reads it."""
    data = read_bytes(path, what, limit, missing_ok=missing_ok, error=error)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{_label(path, what)} is not UTF-8 text (byte {e.start})") from None


def read_json(path: str | os.PathLike, what: str | None = None, limit: int = MAX_JSON_BYTES,
              *, missing_ok: bool = False, error: type[TinyrtError] = ModelFormatError
              ) -> dict | None:
    """A JSON file holding an object, as `read_text` reads it."""
    text = read_text(path, what, limit, missing_ok=missing_ok, error=error)
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:   # ValueError: also a number of too many digits
        raise error(f"{_label(path, what)} is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise error(f"{_label(path, what)} must hold a JSON object")
    return obj
