"""The CPU kernels' thread count follows the cores other programs leave free (kernels.cpu.cores)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
import pytest

from tinyrt.kernels.cpu import CpuBackend, cores


class Machine:
    """Readings for cores.Cores: a clock, and CPU seconds of other programs and of this process
    that a test advances."""

    def __init__(self):
        self.t = self.others = self.own = 0.0

    def run(self, seconds: float, others: float, own: float) -> None:
        """`seconds` pass, other programs busy on `others` cores' worth, this one on `own`."""
        self.t += seconds
        self.others += others * seconds
        self.own += own * seconds

    def cores(self, most: int) -> cores.Cores:
        c = cores.Cores(most, clock=lambda: self.t, busy=lambda: self.others + self.own,
                        own=lambda: self.own)
        c.cpus = 2           # the machine these readings describe, whatever runs the test
        return c


def test_other_work_takes_a_thread_at_once_and_a_free_core_gives_it_back_after_two_windows():
    m = Machine()
    c = m.cores(2)
    assert c.threads() == 2
    m.run(cores.WINDOW, others=0.1, own=2)          # a little noise: both cores stay ours
    assert c.threads() == 2
    m.run(cores.WINDOW, others=1, own=1)            # a busy loop
    assert c.threads() == 1 and c.others == pytest.approx(1)
    m.run(cores.WINDOW, others=2, own=0.6)          # two: never fewer than one thread
    assert c.threads() == 1
    m.run(cores.WINDOW, others=0, own=1)            # gone: one free window is not enough
    assert c.threads() == 1
    m.run(cores.WINDOW, others=1, own=1)            # back again: the count of free windows restarts
    assert c.threads() == 1
    m.run(cores.WINDOW, others=0, own=1)
    assert c.threads() == 1
    m.run(cores.WINDOW, others=0, own=1)
    assert c.threads() == 2


def test_no_measurement_inside_a_window_and_never_more_than_asked():
    m = Machine()
    c = m.cores(1)
    m.run(cores.WINDOW / 2, others=0, own=1)
    assert c.threads() == 1
    for _ in range(4):
        m.run(cores.WINDOW, others=0, own=1)
        assert c.threads() == 1                     # two CPUs free, one thread asked for
    c = m.cores(2)
    m.run(cores.WINDOW * 0.6, others=2, own=0)      # part of a window: not measured yet
    assert c.threads() == 2
    m.run(cores.WINDOW * 0.6, others=2, own=0)
    assert c.threads() == 1


def test_half_a_core_of_other_work_is_where_a_thread_goes():
    for others, n in ((0.4, 2), (0.6, 1)):
        m = Machine()
        c = m.cores(2)
        m.run(cores.WINDOW, others=others, own=2 - others)
        assert c.threads() == n, others


def test_without_counters_the_count_stays_as_asked():
    c = cores.Cores(2, busy=lambda: None)
    time.sleep(cores.WINDOW * 1.2)
    assert c.threads() == 2


def test_busy_seconds_reads_the_cpus_asked_for(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 900 900 900 0 0 0 0 0 0\n"
                    "cpu0 100 50 20 1000 7 3 2 1 0 0\n"
                    "cpu1 200 50 40 1000 7 6 4 2 0 0\n"
                    "cpu2 1000 0 0 0 0 0 0 0 0 0\n"
                    "intr 12345\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert cores.busy_seconds([0, 1], str(stat)) == pytest.approx((126 + 252) / tick)
    assert cores.busy_seconds([2], str(stat)) == pytest.approx(1000 / tick)
    assert cores.busy_seconds([0], str(tmp_path / "missing")) is None
    stat.write_text("cpu0 x y\n")
    assert cores.busy_seconds([0], str(stat)) is None


def test_a_cpu_quota_is_read_as_cores(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")
    assert cores.quota_cores(str(f)) == 1.5
    f.write_text("max 100000\n")
    assert cores.quota_cores(str(f)) is None
    assert cores.quota_cores(str(tmp_path / "missing")) is None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the kernel's counters are Linux's")
def test_a_busy_loop_is_measured_as_a_core_of_other_work():
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        c = cores.Cores(2)
        c._last = None
        time.sleep(0.3)                              # the loop has started
        c._last = c._reading()
        time.sleep(cores.WINDOW * 3)                 # this process idle, the loop busy
        c.threads()
        assert c.others > 0.6
        if c.cpus <= 2:
            assert c.threads() == 1
    finally:
        loop.kill()
        loop.wait()


def test_the_backend_runs_its_kernels_on_the_count_it_is_given():
    """Numba's thread count (the calling thread's) follows Cores; the results do not depend on
    it (every kernel's sums are the same whatever its split)."""
    m = Machine()
    be = CpuBackend(2)
    be.cores = m.cores(2)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((300, 96)).astype(np.float32)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    pw = be.prepare_linear([w])
    quiet = be.linear(x, pw)
    assert be.threads == min(2, numba.config.NUMBA_NUM_THREADS) == numba.get_num_threads()
    m.run(cores.WINDOW, others=1.5, own=0.5)
    busy = be.linear(x, pw)
    assert numba.get_num_threads() == 1 and be.threads == 1
    assert np.array_equal(quiet, busy)
