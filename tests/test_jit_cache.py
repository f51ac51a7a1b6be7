"""Numba's kernel cache found damaged: the kernel compiles again and the cache is rewritten."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import numpy as np
from tinyrt.kernels.cpu import ops
x = np.arange(16, dtype=np.float32).reshape(2, 8)
print(ops.rmsnorm(x, np.ones(8, np.float32), np.float32(1e-5)).sum())
"""


def run(cache_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)


def files(cache_dir, suffix):
    return sorted(Path(cache_dir).rglob(f"ops.rmsnorm-*{suffix}"))


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


NO_MEMORY = """
from numba.core import caching
from tinyrt.kernels import jit_cache
jit_cache.guard()
class NoMemory:                                    # (reading the cache runs out)
    def loads(self, data):
        raise MemoryError
    def __getattr__(self, name):
        return getattr(__import__("pickle"), name)
caching.pickle = NoMemory()
""" + SCRIPT


def test_no_memory_to_read_a_cached_kernel_is_no_damage(tmp_path):
    """A MemoryError while a cached kernel is read (a process near its memory limit) leaves
    the file alone: it is not damaged (it was taken for damage and removed)."""
    assert run(tmp_path).returncode == 0
    data = {f: f.read_bytes() for f in files(tmp_path, ".nbc") + files(tmp_path, ".nbi")}
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", NO_MEMORY], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0 and "MemoryError" in p.stderr
    assert "damaged" not in p.stderr
    assert {f: f.read_bytes() for f in files(tmp_path, ".nbc") + files(tmp_path, ".nbi")} == data


SIMD_SCRIPT = """
import numpy as np
from kernels.cpu import attention
k = np.ones((1, 4, 16), np.float32)
q = np.ones((1, 16), np.float32)
print(attention.attention_decode(q[:, None].reshape(1, 1, 16), k, k, np.zeros(1, np.int64),
                           np.zeros((1, 4), np.int64), np.float32(1), 0, 1,
                           np.zeros((1, 0), np.float32)).sum())
"""


def copied_kernels(tmp_path):
    """A copy of tinyrt's kernels/ under tmp_path with a cache of its own, and a function that
    runs SIMD_SCRIPT on it and returns Numba's cache lines for attention_decode."""
    import shutil

    from tinyrt import kernels

    pkg = tmp_path / "pkg"
    shutil.copytree(Path(kernels.__file__).parent, pkg / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_DEBUG_CACHE="1",
               PYTHONPATH=str(pkg))

    def attention_cache():
        r = subprocess.run([sys.executable, "-c", SIMD_SCRIPT], env=env, capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)     # not the checkout's copy
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if "attention_decode" in line]

    return pkg / "kernels", attention_cache


def test_a_change_in_the_intrinsics_file_compiles_again(tmp_path):
    """A kernel of cpu/attention.py compiles in cpu/simd.py's intrinsics: after a change to it alone (an
    upgrade), the cached machine code is stale and must not be loaded."""
    kernels, attention_cache = copied_kernels(tmp_path)
    assert any("data saved" in line for line in attention_cache())
    assert any("data loaded" in line for line in attention_cache())     # the cache works
    simd = kernels / "cpu" / "simd.py"
    simd.write_text(simd.read_text() + "\n# changed\n")
    again = attention_cache()
    assert any("data saved" in line for line in again)
    assert not any("data loaded" in line for line in again)


def test_the_same_sources_written_anew_keep_their_compiled_kernels(tmp_path):
    """A reinstall (adding an extra) writes every file anew, the same contents with new
    timestamps: the cached machine code is still the kernels', and must be loaded, not rebuilt
    (the stamp is the folder's contents)."""
    kernels, attention_cache = copied_kernels(tmp_path)
    assert any("data saved" in line for line in attention_cache())
    later = 2_000_000_000                      # (a time well after any file's own)
    for f in kernels.rglob("*.py"):
        f.write_bytes(f.read_bytes())
        os.utime(f, (later, later))
    again = attention_cache()
    assert any("data loaded" in line for line in again)
    assert not any("data saved" in line for line in again)


HALVES = """
import numpy as np
{first}
from tinyrt.models import gguf_quants
b = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
out = np.zeros((2, 3), np.uint16)
gguf_quants._halves(b, 0, out)
print(int(out.sum()))
"""


def test_a_model_kernel_reads_the_cache_whatever_was_imported_first(tmp_path):
    """models/gguf_quants.py compiles kernels of its own: imported alone (a test's process) or
    after the CPU kernels (the command line's), its cache is stamped the same, so one process
    reads what the other wrote (the stamps differed: each compiled again, a cold start's note on
    the command line after the tests had run the same kernel)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_DEBUG_CACHE="1")

    def halves(first):
        r = subprocess.run([sys.executable, "-c", HALVES.format(first=first)], env=env,
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if "gguf_quants._halves" in line]

    assert any("data saved" in line for line in halves(""))
    again = halves("import tinyrt.kernels.cpu.jit")
    assert any("data loaded" in line for line in again), again
    assert not any("data saved" in line for line in again), again


def test_list_counts_every_package_s_compiled_kernels(tmp_path):
    """`tinyrt list`'s size of the compiled kernels: every package that holds cache=True kernels
    (the CPU kernels' own subpackage among them), every file of theirs Numba wrote."""
    import importlib.util
    from pathlib import Path

    import tinyrt
    from tinyrt.cli.listing import kernel_cache

    from helpers import write_tiny_model

    # the CPU kernels compiled (their files written), or read from the files there
    tinyrt.load(write_tiny_model(tmp_path / "m"), device="cpu", quiet=True).generate("hi",
                                                                                  max_tokens=1)
    found, total = kernel_cache()
    for package in ("tinyrt.kernels.cpu",):
        source = Path(next(iter(importlib.util.find_spec(package).submodule_search_locations)))
        stems = {f.stem for f in source.glob("*.py")}
        ours = [f for d in found for f in d.iterdir()
                if f.suffix in (".nbi", ".nbc") and f.name.split(".", 1)[0] in stems]
        assert ours and total >= sum(f.stat().st_size for f in ours), (package, found)
