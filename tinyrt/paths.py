"""Paths the user names, the text files tinyrt reads and the new files it writes, in one place: a
name no file can have, a ~user that does not exist, an OSError (a name too long, a file used as a
directory), a file that is not a regular file (a directory, a FIFO, /dev/zero), one larger than
its use allows or bytes that are not UTF-8 each become one line naming the path, never a
traceback, a hang or a read without end."""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from tinyrt.errors import ModelFormatError, TinyrtError

MAX_TEXT_BYTES = 256 << 20       # a text to tokenize whole (ppl --text, convert --calib)
MAX_JSON_BYTES = 64 << 20        # a config file (config.json, tokenizer_config.json, ...)
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json / tokenizer.model: the largest vocabularies
MAX_JSON_DEPTH = 100             # a config file's nesting (Hugging Face's nest 3 or 4 levels)


def shown_path(path: str | os.PathLike) -> str:
    """A path as a message prints it: as typed, unless it holds something that would break the
    one line or cannot be printed (a newline, bytes that are not UTF-8): then quoted, escaped."""
    text = os.fsdecode(path)
    return text if text.isprintable() else repr(text)


def _label(path, what: str | None) -> str:
    return f"{what} {shown_path(path)}" if what else shown_path(path)


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


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | os.PathLike, what: str | None = None, *, missing_ok: bool = False,
                 error: type[TinyrtError] = TinyrtError
                 ) -> tuple[BinaryIO, os.stat_result] | None:
    """A regular file opened to read (binary), with the status of the open file: the one way
    tinyrt opens a file it reads (text, JSON, weights, GGUF). None for a missing one where
    `missing_ok`; `error` (a TinyrtError class) with one line for anything else: a directory, a
    FIFO, a device, a socket, a symlink loop, no permission. Read errors after the open (EIO, as
    /proc/self/mem gives) are the caller's OSError to turn into one line."""
    label = _label(path, what)
    try:
        # checked before the open too: opening a device may itself do something (a tape rewinds)
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"cannot read {label}: {_not_regular(info)}")
        # O_NONBLOCK: a FIFO swapped in after the check would wait forever for a writer; the
        # kind is checked again on the open descriptor, which is what gets read
        fd = os.open(path, _READ_FLAGS)
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
        return os.fdopen(fd, "rb"), info
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, what: str | None = None, limit: int = MAX_TEXT_BYTES,
               *, missing_ok: bool = False, error: type[TinyrtError] = TinyrtError
               ) -> bytes | None:
    """The contents of a regular file of at most `limit` bytes (None for a missing one where
    `missing_ok`); `error` (a TinyrtError class) with one line otherwise."""
    label = _label(path, what)
    opened = open_regular(path, what, missing_ok=missing_ok, error=error)
    if opened is None:
        return None
    f, info = opened
    with f:
        if info.st_size > limit:
            raise error(f"cannot read {label}: {info.st_size:,} bytes, more than the "
                        f"{limit:,} it may have")
        try:
            # read(n) allocates n bytes up front: ask for the size the file has, not the limit
            want = min(info.st_size, limit) + 1
            data = f.read(want)
            if len(data) == want < limit + 1:   # longer than it said (it grew, or /proc's size 0)
                data += f.read(limit + 1 - want)
        except OSError as e:
            raise error(f"cannot read {label}: {_reason(e)}") from None
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
    except RecursionError:
        raise error(f"{_label(path, what)} is not valid JSON (nested too deeply)") from None
    except ValueError as e:                 # ValueError: also a number of too many digits
        raise error(f"{_label(path, what)} is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise error(f"{_label(path, what)} must hold a JSON object")
    if _depth(obj) > MAX_JSON_DEPTH:
        raise error(f"{_label(path, what)} nests more than {MAX_JSON_DEPTH} levels deep")
    return obj


def _depth(obj) -> int:
    """How deep JSON containers nest in `obj` (an object of scalars: 1), without recursion:
    what parsed just under the interpreter's limit would break a later deep copy or repr."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > MAX_JSON_DEPTH:
            break
        stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o)
                     if isinstance(v, (dict, list)))
    return deepest


def new_file(directory: str | os.PathLike, prefix: str, suffix: str = "") -> tuple[int, Path]:
    """A file made new in `directory`, under a name no file had (never a link's target), open to
    write: (descriptor, path). A temporary to rename over what it replaces: writing to a fixed
    name instead would write into a file or through a link of another program's. Its mode is a
    plainly written file's (0666 less the umask; mkstemp's would be 0600). OSError as os.open."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    while True:
        path = Path(directory) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
