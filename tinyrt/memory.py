"""How much memory the machine can still give, and a check made before large allocations, so that
too large a model or KV cache gets a clear error with the figures instead of the OOM killer; and
how many CPUs this process may use."""

from __future__ import annotations

import os
import re

from tinyrt.errors import TinyrtError, shown

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


# The largest size taken (1 EiB, more than any machine's memory or disk): a larger one, and
# the infinity that float() makes of a few hundred digits, is refused before any arithmetic.
MAX_SIZE = 2**60


def parse_size(text: str | int, name: str | None = None) -> int:
    """'5GB', '500MB', '2GiB', '1000000' (or an int) -> bytes (TinyrtError if not a positive size
    of at most MAX_SIZE, naming the option `name` where given)."""
    where = f"{name}: " if name else ""
    if isinstance(text, int) and not isinstance(text, bool):
        if not 1 <= text <= MAX_SIZE:
            raise TinyrtError(f"{where}a size must be from 1 byte to {MAX_SIZE:,} bytes (1 EiB), "
                              f"not {shown(text)}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m[2].lower() not in _UNITS or float(m[1]) * _UNITS[m[2].lower()] < 1:
        raise TinyrtError(f"{where}{shown(text)} is not a size (e.g. 5GB, 500MB, 2GiB)")
    size = float(m[1]) * _UNITS[m[2].lower()]
    if not size <= MAX_SIZE:                 # (inf from a number of over 308 digits)
        raise TinyrtError(f"{where}{shown(text)} is more than the largest size taken, 1 EiB")
    return int(size)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None where the
    system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ensure_fits(what: str, needed: int, hint: str = "") -> None:
    """Raise TinyrtError if `needed` bytes exceed the memory available now."""
    avail = available_bytes()
    if avail is not None and needed > avail:
        raise TinyrtError(f"{what} needs {needed / 2**20:,.0f} MiB but {avail / 2**20:,.0f} MiB of "
                          f"memory is available{hint}")


def cpu_count() -> int:
    """The CPUs this process may run on: as many threads as Numba's pool has (its default)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                   # (no affinity on macOS)
        return os.cpu_count() or 1
