"""How much memory the machine can still give, and a check made before large allocations, so that
too large a model or KV cache gets a clear error with the figures instead of the OOM killer; and
how many CPUs this process may use."""

from __future__ import annotations

import contextlib
import errno
import os
import re

from tinyrt.errors import TinyrtError, shown

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


# what to lower where a KV cache does not fit (the CLI's names: llama.cpp's -c among them)
CACHE_HINT = ": choose a smaller --kv-size (-c) or --kv-mem"

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


# what a process under a limit must keep beside what a check is for: its kernels compiled after
# the cache is made (a cold start grew 0.42 GiB of address space and 0.32 GiB of data past the
# default model's cache) and the rest of the load; a limit hit there is an abort in LLVM's C++
# (std::bad_alloc), no error to catch
HEADROOM = 512 << 20


def process_rooms() -> list[tuple[int, str]]:
    """What this process may still allocate under each limit set on it, beside the machine's
    free memory, HEADROOM kept: its address-space and data limits (`ulimit -v`, `ulimit -d`:
    RLIMIT_AS less its mapped size, RLIMIT_DATA less its data) and its cgroup's memory.max (a
    container's limit: less what the group uses, page cache it can drop aside). Each as
    (bytes, what the limit is, for a message); none where no limit is set or the system does
    not say."""
    rooms = []
    try:
        import resource
    except ImportError:                      # (Windows)
        return rooms
    status = _proc_status()
    for limit, field, what in ((resource.RLIMIT_AS, "VmSize", "address-space limit (ulimit -v)"),
                               (resource.RLIMIT_DATA, "VmData", "data limit (ulimit -d)")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and field in status:
            rooms.append((max(soft - status[field] - HEADROOM, 0), f"the process's {what}"))
    cgroup = _cgroup_room()
    if cgroup is not None:
        rooms.append((max(cgroup - HEADROOM, 0), "its cgroup's memory limit (memory.max)"))
    return rooms


def _proc_status() -> dict[str, int]:
    """The sizes /proc/self/status gives (kB fields) in bytes; none off Linux."""
    sizes = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    sizes[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return sizes


# a cgroup's files: its limit, its use, and the page cache it can drop in its memory.stat
_CGROUP_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def _cgroup_room(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """What the memory cgroups this process is in, and their parents, still let it allocate:
    the least of each limit less what the group uses (its page cache that can be dropped
    aside); None where no limit is set. cgroup v2 (memory.max), and v1 (memory.limit_in_bytes:
    Jetsons, older container hosts), whose path may be the container's own root."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            version, base = 2, root
        elif "memory" in controllers.split(","):
            version, base = 1, os.path.join(root, "memory")
        else:
            continue
        limit_file, use_file, cache_field = _CGROUP_FILES[version]
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        for depth in range(len(parts), -1, -1):
            group = os.path.join(base, *parts[:depth])
            try:
                with open(os.path.join(group, limit_file)) as f:
                    limit = f.read().strip()
                if limit == "max" or int(limit) >= MAX_SIZE:     # (v1's "none": 2**63 - 4096)
                    continue
                with open(os.path.join(group, use_file)) as f:
                    used = int(f.read())
                with open(os.path.join(group, "memory.stat")) as f:
                    stat = dict(line.split()[:2] for line in f if len(line.split()) >= 2)
                rooms.append(int(limit) - used + int(stat.get(cache_field, 0)))
            except (OSError, ValueError):
                continue
    return max(min(rooms), 0) if rooms else None


def ensure_fits(what: str, needed: int, hint: str = "") -> None:
    """Raise TinyrtError if `needed` bytes exceed the memory available now: the machine's, or
    what a limit on this process leaves (process_rooms), whichever is less."""
    rooms = [(room, f"{room / 2**20:,.0f} MiB is left under {where}")
             for room, where in process_rooms()]
    avail = available_bytes()
    if avail is not None:
        rooms.append((avail, f"{avail / 2**20:,.0f} MiB of memory is available"))
    short = [said for room, said in sorted(rooms) if needed > room]      # (the least first)
    if short:
        raise TinyrtError(f"{what} needs {needed / 2**20:,.0f} MiB but {short[0]}{hint}")


@contextlib.contextmanager
def out_of_memory_is(what: str, hint: str = ""):
    """Turn an allocation that fails inside the block (MemoryError, or an mmap's ENOMEM) into
    one TinyrtError: what ran out, and `hint`, the option to lower. (ensure_fits checks before;
    a limit it cannot read, or memory taken meanwhile, still ends here.)"""
    try:
        yield
    except MemoryError:
        raise TinyrtError(f"{what} ran out of memory{hint}") from None
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise TinyrtError(f"{what} ran out of memory ({e.strerror}){hint}") from None


def cpu_count() -> int:
    """The CPUs this process may run on: as many threads as Numba's pool has (its default)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                   # (no affinity on macOS)
        return os.cpu_count() or 1
