"""Numba's kernel cache found damaged: the kernel compiles again and the cache is rewritten."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import numpy as np
from tinyrt.kernels import cpu
x = np.arange(16, dtype=np.float32).reshape(2, 8)
print(cpu.rmsnorm(x, np.ones(8, np.float32), np.float32(1e-5)).sum())
"""


def run(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)


def files(cache_dir, suffix):
    return sorted(Path(cache_dir).rglob(f"cpu.rmsnorm-*{suffix}"))


@pytest.mark.parametrize("damage", ["truncated index", "garbage index", "garbage data"])
def test_damaged_cache_is_rebuilt(tmp_path, damage):
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    index, data = files(tmp_path, ".nbi"), files(tmp_path, ".nbc")
    assert index and data
    if damage == "truncated index":
        index[0].write_bytes(index[0].read_bytes()[:20])
    elif damage == "garbage index":
        index[0].write_bytes(os.urandom(500))
    else:
        data[0].write_bytes(os.urandom(2000))
    second = run(tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert "damaged kernel cache file" in second.stderr
    third = run(tmp_path)                       # read from the cache written anew, no warning
    assert third.returncode == 0 and third.stdout == first.stdout
    assert "damaged" not in third.stderr and files(tmp_path, ".nbi")
