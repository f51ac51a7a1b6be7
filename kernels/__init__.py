"""The ops the decoder calls, and the one place that picks a backend for a device.

This package imports nothing else of tinyrt.
"""

from __future__ import annotations

from . import awq_layout, reference
from .awq_layout import QuantizedLinear
from .reference import ReferenceBackend

DEVICES = ("auto", "cpu", "reference")


def get_backend(device: str = "auto", threads: int | None = None):
    """The backend for `device`: "reference" is NumPy; "cpu" (and "auto") the Numba kernels.
    `threads` sets the threads of the Numba kernels and caps those of the BLAS library NumPy calls
    (process-wide). Raises ValueError for an unknown device or thread count."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")
    if device == "reference":
        return ReferenceBackend()
    from .cpu import CpuBackend

    return CpuBackend(threads)


__all__ = ["DEVICES", "get_backend", "awq_layout", "reference", "ReferenceBackend", "QuantizedLinear"]
