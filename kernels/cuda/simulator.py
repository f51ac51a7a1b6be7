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

`mend()`: the array made once per site, under a lock; and a kernel's launch points `cuda` at the
simulated module in every module of this package (and any other whose device function it calls)
until the launch ends, so a device function's call changes nothing, and is a plain call (a lock
there, taken twice a call, made kernels of many small calls several times slower). Only ever
called in the simulator.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import numpy as np

_lock = threading.Lock()            # (the shared arrays')
_PACKAGE = __name__.rpartition(".")[0] + "."
_launch: list | None = None     # while a kernel runs: (a module's globals, its own values)


_held: set = set()               # ids of the globals _launch holds (while a kernel runs)


def _swap(globs: dict, cuda, fake) -> None:
    own = {k: v for k, v in globs.items() if v is cuda}
    _held.add(id(globs))
    if own:
        globs.update(dict.fromkeys(own, fake))
        _launch.append((globs, own))


def _call(self, *args):
    """FakeCUDAKernel.__call__, a device function of a module already held called at once
    (its context manager and its scan of the module's globals, at every call, were most of
    a GEMV's time in the simulator: its device functions are called per code)."""
    if _launch is not None and id(self.fn.__globals__) in _held:
        return self.fn(*args)
    return _unheld_call(self, *args)


@contextmanager
def _swapped_cuda_module(fn, fake):
    global _launch
    from numba import cuda

    if _launch is not None:           # a device function's call, within a launch
        _swap(fn.__globals__, cuda, fake)       # (nothing to do for this package's)
        yield
        return
    _launch = []
    try:
        _swap(fn.__globals__, cuda, fake)
        for name, module in list(sys.modules.items()):
            if name.startswith(_PACKAGE) and module is not None:
                _swap(module.__dict__, cuda, fake)
        yield
    finally:
        for globs, own in reversed(_launch):
            globs.update(own)
        _launch = None
        _held.clear()


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


_unlocked_array = _unheld_call = None


def mend() -> None:
    """The shared arrays made under the lock, the modules' `cuda` held for a launch
    (idempotent)."""
    global _unlocked_array, _unheld_call
    from numba.cuda.simulator import kernel, kernelapi

    if _unlocked_array is not None:
        return
    _unlocked_array = kernelapi.FakeCUDAShared.array
    kernelapi.FakeCUDAShared.array = _array
    _unheld_call = kernel.FakeCUDAKernel.__call__
    kernel.FakeCUDAKernel.__call__ = _call
    kernelapi.swapped_cuda_module = kernel.swapped_cuda_module = _swapped_cuda_module
