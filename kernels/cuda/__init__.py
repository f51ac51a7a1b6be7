"""Numba CUDA kernels for decode at batch 1, and the backend that runs the decoder on them
(`CudaBackend`; `unavailable()` says why it cannot run here).

kernels: the GEMVs, small ops and flash-decoding attention over a float cache; kv: the quantized
KV cache's kernels; step: a decode step's bookkeeping kept on the GPU (so a CUDA graph replays
it); launchers: grids, blocks and launches on torch's current stream; primitives: what the
kernels share; backend.

Arrays are torch tensors on the GPU, shared with the kernels through the CUDA array interface.
In Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, where CI runs them) they are torch tensors in
host memory, which the launchers hand the kernels as NumPy views. Kernels compile once per
machine (cache=True).
"""

from . import numpy_names

numpy_names.restore()      # (before any kernel here compiles: numba-cuda's target names them)

from .backend import CudaBackend, unavailable  # noqa: E402

__all__ = ["CudaBackend", "unavailable"]
