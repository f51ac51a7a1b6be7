"""Numba CPU kernels and the backend that runs the decoder on them (`CpuBackend`).

linear: quantized and float linear layers; simd: the vector IR Numba cannot write (the integer
core of the quantized GEMV, the cache rows of decode attention); attention; ops (RMSNorm, RoPE,
SiLU-mul); layer: a decoder layer fused into one call; kv: the quantized KV cache's codes;
cores: how many threads; jit: the options every kernel compiles with; backend.

Every kernel compiles with cache=True: the first run of a fresh install compiles them (tens of
seconds), later runs load machine code from Numba's cache.
"""

from .backend import CpuBackend

__all__ = ["CpuBackend"]
