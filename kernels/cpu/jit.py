"""How the CPU kernels compile: the Numba options they share, and Numba's cache guarded
(jit_cache) before any kernel is read from it."""

from __future__ import annotations

import warnings

from numba.core.errors import NumbaPerformanceWarning

from .. import jit_cache

jit_cache.guard()

# Typing decode_layer's call of attention_decode warns (once, when the cache is cold) that a
# parallel function had nothing to parallelize; its prange does run in parallel (measured: one
# token at 2 threads takes 0.47x the time at 1).
warnings.filterwarnings("ignore", message=r"\s*The keyword argument 'parallel=True' was specified",
                        category=NumbaPerformanceWarning)


def prange_only() -> dict:
    """Numba's parallel option with only prange loops run in parallel. With parallel=True Numba
    also turns every array expression, slice assignment and np.zeros of the function into a
    parallel region of its own: the small ones around the pranges (a head's row of the attention
    merge, a K/V row into the cache) each cost a thread launch, 27 us instead of 5 us for a
    one-slot decode attention. A fresh dict each time: Numba empties the one it is given."""
    return dict(comprehension=False, reduction=False, inplace_binop=False, setitem=False,
                numpy=False, stencil=False, fusion=False)
