"""Numba's cache of compiled kernels, safe to find damaged.

Every kernel compiles with cache=True: Numba keeps its machine code in files beside the sources
(or under NUMBA_CACHE_DIR) and reads them back at the next start. A file cut short (a full disk,
a process killed while writing it) or damaged otherwise would make that read raise, and every
start after it fail. `guard()` makes such a file a cache miss: it is removed, the kernel compiles
again and its cache is written anew, with a warning. A stale cache (the sources changed since)
Numba detects by a stamp of the kernel's own file: its timestamp and size. `guard()` stamps a
kernel of tinyrt by the contents of every file of its folder instead: a kernel also compiles in
code from the other files there (simd's intrinsics, the attention a fused layer calls), so an
upgrade that changes only cpu/simd.py compiles every CPU kernel again; and a reinstall of the
same sources (`pip install ".[server]"` to add an extra writes every file anew) keeps the
compiled kernels, where the timestamps would have made them all stale (87 s of compiling).

`on_first_compile(say)` tells the user when a kernel is about to compile (a cache miss: the
first run on a machine, or after an upgrade) rather than leave tens of seconds unexplained.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator

from numba.core import caching, event


HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent    # the installed tinyrt: kernels/, and models/ (whose repacking compiles)


_DIGESTS: dict[Path, str] = {}


def folder_digest(folder: Path) -> str:
    """SHA-256 of the names and contents of the Python files of `folder` (once a process)."""
    if folder not in _DIGESTS:
        h = hashlib.sha256()
        for f in sorted(folder.glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        _DIGESTS[folder] = h.hexdigest()
    return _DIGESTS[folder]


def _stamp_sources() -> None:
    """Numba's stamp of a kernel's source file, for a file of tinyrt's kernels/ or models/: the
    contents of all the files of the kernel's own folder (not their timestamps)."""
    mixin = getattr(caching, "_SourceFileBackedLocatorMixin", None)
    if mixin is None or getattr(mixin, "_tinyrt_guarded", False) or \
            not callable(getattr(mixin, "get_source_stamp", None)):
        return
    own = mixin.get_source_stamp

    def get_source_stamp(self):
        folder = Path(getattr(self, "_py_file", "")).resolve().parent
        if folder not in (HERE, PACKAGE / "models") and HERE not in folder.parents:
            return own(self)
        return "sha256", folder_digest(folder)

    mixin.get_source_stamp, mixin._tinyrt_guarded = get_source_stamp, True


def guard() -> None:
    """Make a damaged cache file a cache miss, and the cache of a kernel of tinyrt stale when
    the contents of any file of its folder changed (idempotent). A Numba whose cache reads
    files otherwise (these are its internals) is left as it is."""
    _stamp_sources()
    cls = getattr(caching, "IndexDataCacheFile", None)
    if cls is None or getattr(cls, "_tinyrt_guarded", False) or not all(
            callable(getattr(cls, name, None)) for name in ("_load_index", "_load_data")):
        return
    load_index, load_data = cls._load_index, cls._load_data

    def _load_index(self):
        try:
            return load_index(self)
        except MemoryError:                    # (no memory to read it: not damage)
            raise
        except Exception as e:                 # what a damaged file raises is anyone's guess
            _drop(self._index_path, e)
            return {}

    def _load_data(self, name):
        try:
            return load_data(self, name)
        except (OSError, MemoryError):
            # Numba's own miss (the file is gone), or no memory to read it into: not damage
            raise
        except Exception as e:
            _drop(self._data_path(name), e)
            return None

    cls._load_index, cls._load_data, cls._tinyrt_guarded = _load_index, _load_data, True


def _drop(path: str, error: Exception) -> None:
    warnings.warn(f"damaged kernel cache file {os.path.basename(path)} ({type(error).__name__}): "
                  "removed, the kernel compiles again", RuntimeWarning, stacklevel=2)
    try:
        os.remove(path)
    except OSError:
        pass


class _FirstCompile(event.Listener):
    """Calls `say()` once, as the first kernel of this package starts compiling."""

    def __init__(self, say: Callable[[], None]):
        self.say = say

    def on_start(self, ev) -> None:
        # Numba sends "numba:compile" only when it compiles: a kernel read from its cache
        # sends nothing, so a warm cache says nothing
        func = getattr(ev.data.get("dispatcher"), "py_func", None)
        code = getattr(func, "__code__", None)
        if self.say is not None and code is not None and \
                PACKAGE in Path(code.co_filename).resolve().parents:
            self.say, say = None, self.say
            say()

    def on_end(self, ev) -> None:
        pass


@contextlib.contextmanager
def on_first_compile(say: Callable[[], None]) -> Iterator[None]:
    """Within, `say()` is called once, just before the first of this package's kernels
    compiles (Numba found no machine code for it in its cache); not at all when every kernel
    run is read from the cache."""
    with event.install_listener("numba:compile", _FirstCompile(say)):
        yield
