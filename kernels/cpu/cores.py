"""How many threads the CPU kernels run on: the cores that other programs leave free, measured
as the run goes.

Every parallel kernel is a fork and a join of a team of threads, and a join waits for the
slowest: where other programs keep the cores busy, the scheduler parks a thread of the team now
and then, and a join that should take microseconds takes milliseconds (docs/SPEED.md). So the
team is as large as the cores that are free: every WINDOW seconds (checked as a kernel is about
to run), the busy time of this process's CPUs (/proc/stat) less its own CPU time is the others'
work, in cores. More work elsewhere takes a thread away at once; a thread comes back after
UP_WINDOWS windows that found its core free, so two tinyrt processes settle rather than rise and
fall together. Niced work does not count unless this process is niced too; a container's CPU
quota caps the count; where the counters cannot be read (not Linux), the count stays as asked.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

WINDOW = 0.2     # seconds between measurements: /proc/stat counts in 10 ms ticks, so a window of
                 # 0.2 s on 2 CPUs measures the others' work to about 0.1 core
UP_WINDOWS = 2   # windows in a row that must find a core free before a thread comes back

# /proc/stat's columns after the CPU's name: user nice system idle iowait irq softirq steal ...
_USER, _NICE, _SYSTEM, _IDLE, _IOWAIT, _IRQ, _SOFTIRQ, _STEAL = range(8)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:                   # (no affinity on macOS)
        return list(range(os.cpu_count() or 1))


def quota_cores(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The cores a CPU quota (cgroup v2 cpu.max: a container's --cpus) lets this process use, or
    None where there is none. Threads beyond it are throttled, in the middle of a join."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def busy_seconds(cpus: list[int], path: str = "/proc/stat") -> float | None:
    """Seconds CPUs `cpus` have spent running work at our priority or above (or stolen by a
    hypervisor) since boot, from the kernel's counters; None where they cannot be read."""
    niced = os.getpriority(os.PRIO_PROCESS, 0) > 0 if hasattr(os, "getpriority") else False
    wanted = {f"cpu{i}" for i in cpus}
    ticks = 0
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in wanted:
                    v = [int(x) for x in rest.split()[:8]]
                    ticks += v[_USER] + v[_SYSTEM] + v[_IRQ] + v[_SOFTIRQ] + v[_STEAL]
                    ticks += v[_NICE] if niced else 0
                elif not name.startswith("cpu"):
                    break
    except (OSError, ValueError, IndexError):
        return None
    return ticks / _TICK


class Cores:
    """The thread count for the CPU kernels (see the module's docstring): `threads()` returns it,
    measuring again when a window has passed. `most` is the most threads to use; `clock`,
    `busy` (busy seconds of the CPUs, or None) and `own` (this process's CPU seconds) are the
    readings, replaceable for a test."""

    def __init__(self, most: int, *, clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[], float | None] | None = None,
                 own: Callable[[], float] = time.process_time):
        cpus = allowed_cpus()
        quota = quota_cores()
        self.cpus = len(cpus) if quota is None else min(len(cpus), max(1, math.ceil(quota)))
        self.most = max(1, min(most, self.cpus))
        self.n = self.most
        self.others = 0.0                 # cores' worth of other programs' work, last window
        self._clock, self._own = clock, own
        self._busy = busy if busy is not None else (lambda: busy_seconds(cpus))
        self._up = 0
        self._last = self._reading()

    def _reading(self):
        busy = self._busy()
        return None if busy is None else (self._clock(), busy, self._own())

    def threads(self) -> int:
        last = self._last
        if last is not None and self._clock() - last[0] >= WINDOW:
            now = self._reading()
            if now is not None:
                self._update(last, now)
            self._last = now
        return self.n

    def _update(self, last, now) -> None:
        wall = now[0] - last[0]
        self.others = max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / wall
        free = int(self.cpus - self.others + 0.5)
        target = min(self.most, max(1, free))
        if target < self.n:
            self.n, self._up = target, 0
        elif target > self.n:
            self._up += 1
            if self._up >= UP_WINDOWS:
                self.n, self._up = target, 0
        else:
            self._up = 0
