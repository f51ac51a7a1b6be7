"""How much memory the machine can still give, and a check made before large allocations, so that
too large a model or KV cache gets a clear error with the figures instead of the OOM killer."""

from __future__ import annotations

from tinyrt.errors import TinyrtError


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
