"""Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1: the CUDA kernels tested without a GPU),
mended where it races. It runs a block's threads as Python threads, and two of its lookups are
check-then-act with no lock:

- `cuda.shared.array`: one array per call site, made by the first thread to get there; two
  threads arriving together could each make their own, and then read values the other half of
  the block wrote elsewhere (it failed a kernel test at a short switch interval).
- a device function's call points its module's `cuda` at the simulated one and, when it returns,
  back at the real one: the first thread into a device function of a module restored the real
  `cuda` while the block's other threads were still inside (`module 'numba.cuda' has no attribute
  'syncthreads'`, seen in a warp sum).

`mend()` puts both under a lock: the array made once per site; a module's `cuda` swapped by the
first thread in and restored by the last one out. Only ever called in the simulator."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import numpy as np

_lock = threading.Lock()
_swapped: dict[int, list] = {}     # id(a module's globals) -> [threads inside, its own values]


@contextmanager
def _swapped_cuda_module(fn, fake):
    from numba import cuda

    globs = fn.__globals__
    with _lock:
        entry = _swapped.get(id(globs))
        if entry is None:
            own = {k: v for k, v in globs.items() if v is cuda}
            entry = _swapped[id(globs)] = [0, own]
            globs.update(dict.fromkeys(own, fake))
        entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                globs.update(entry[1])
                del _swapped[id(globs)]


def _array(self, shape, dtype):
    from numba.core import types
    from numba.np import numpy_support

    if shape == 0:                         # dynamic shared memory: one buffer, no lookup
        return _unlocked_array(self, shape, dtype)
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    caller = sys._getframe(1)
    site = (caller.f_code.co_filename, caller.f_lineno)      # (keyed as the simulator keys it)
    with _lock:
        a = self._allocations.get(site)
        if a is None:
            a = self._allocations[site] = np.empty(shape, dtype)
    return a


_unlocked_array = None


def mend() -> None:
    """Both lookups under the lock (idempotent)."""
    global _unlocked_array
    from numba.cuda.simulator import kernel, kernelapi

    if _unlocked_array is not None:
        return
    _unlocked_array = kernelapi.FakeCUDAShared.array
    kernelapi.FakeCUDAShared.array = _array
    kernelapi.swapped_cuda_module = kernel.swapped_cuda_module = _swapped_cuda_module
