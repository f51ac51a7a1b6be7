"""Numba's cache of compiled kernels, safe to find damaged.

Every kernel compiles with cache=True: Numba keeps its machine code in files beside the sources
(or under NUMBA_CACHE_DIR) and reads them back at the next start. A file cut short (a full disk,
a process killed while writing it) or damaged otherwise would make that read raise, and every
start after it fail. `guard()` makes such a file a cache miss: it is removed, the kernel compiles
again and its cache is written anew, with a warning. A stale cache (the sources changed since)
Numba detects itself, by the sources' timestamps and sizes, and compiles again.
"""

from __future__ import annotations

import os
import warnings

from numba.core import caching


def guard() -> None:
    """Make a damaged cache file a cache miss (idempotent). A Numba whose cache reads files
    otherwise (these are its internals) is left as it is."""
    cls = getattr(caching, "IndexDataCacheFile", None)
    if cls is None or getattr(cls, "_tinyrt_guarded", False) or not all(
            callable(getattr(cls, name, None)) for name in ("_load_index", "_load_data")):
        return
    load_index, load_data = cls._load_index, cls._load_data

    def _load_index(self):
        try:
            return load_index(self)
        except Exception as e:                 # what a damaged file raises is anyone's guess
            _drop(self._index_path, e)
            return {}

    def _load_data(self, name):
        try:
            return load_data(self, name)
        except OSError:
            raise                              # Numba's own miss: the file is gone
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
