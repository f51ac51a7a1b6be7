"""The ops the decoder calls, and the one place that picks a backend for a device.

This package imports nothing else of tinyrt.
"""

from __future__ import annotations

import ctypes.util

from . import awq_layout, quant, reference
from .awq_layout import QuantizedLinear
from .quant import QuantWeight
from .reference import ReferenceBackend

DEVICES = ("auto", "cpu", "cuda", "reference")


def get_backend(device: str = "auto", threads: int | None = None, *, cuda_graph: bool = True):
    """The backend for `device`: "reference" is NumPy; "cpu" the Numba kernels; "cuda" the Numba
    CUDA kernels (ValueError saying why where it cannot run); "auto" is cuda where a CUDA driver
    and GPU are present, else cpu.
    `threads` sets the threads of the Numba kernels and caps those of the BLAS library NumPy calls
    (process-wide). `cuda_graph` False: the CUDA backend's decode steps run eagerly (debugging).
    Raises ValueError for an unknown device or thread count."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")
    if device == "reference":
        return ReferenceBackend()
    if device == "cuda" or (device == "auto" and ctypes.util.find_library("cuda")):
        from . import cuda

        why = cuda.unavailable()
        if why is None:
            return cuda.CudaBackend(cuda_graph)
        if device == "cuda":
            raise ValueError(f"--device cuda: {why}; use --device cpu")
    from .cpu import CpuBackend

    return CpuBackend(threads)


def on_first_compile(say):
    """A context in which `say()` is called once, just before a kernel compiles: Numba has no
    machine code for it in its cache yet (see jit_cache; imported only here, as it imports
    Numba)."""
    from .jit_cache import on_first_compile

    return on_first_compile(say)


__all__ = ["DEVICES", "get_backend", "on_first_compile", "awq_layout", "quant", "reference",
           "ReferenceBackend", "QuantizedLinear", "QuantWeight"]
