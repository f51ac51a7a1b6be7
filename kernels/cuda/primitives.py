"""What the CUDA kernels here share: the block shapes, and device functions for bounds, block
reductions and which cache slots a query sees.

Numba's CUDA simulator runs every CUDA thread as a Python thread: there (SIM), blocks are
smaller; every kernel is written for any of these sizes.
"""

from __future__ import annotations

import math

import numba
from numba import cuda, float32

from .. import jit_cache

jit_cache.guard()    # a kernel here compiles in device functions of this package's other files

SIM = bool(numba.config.ENABLE_CUDASIM)
if SIM:
    from .simulator import mend

    mend()
LANES = 4 if SIM else 32     # a warp's lanes (the simulator's fewer: it runs a thread as a
                             # Python thread)
THREADS = 8 if SIM else 128  # threads per block of the elementwise kernels and the quantized
                             # cache's (a power of two: the block reductions halve it)
NORM_THREADS = 16 if SIM else 1024   # the most threads per block of RMSNorm: a decode step's
                             # row (4096 wide at 7B) is one block's, 4 elements a thread
HALF_MAX = 65504.0   # the largest finite float16 (a float16 cache clamps to it, as the reference)


# The kernels compare with `if` rather than call the builtins min and max: Numba 0.68's built-in
# CUDA target (deprecated for the numba-cuda package) fails to compile those builtins, and a test
# compiles every kernel to PTX with whichever target is installed.
@cuda.jit(device=True)
def lesser(a, b):
    return a if a < b else b


@cuda.jit(device=True)
def greater(a, b):
    return a if a > b else b


@cuda.jit(device=True, inline=True)
def silu(g):
    """g sigmoid(g), exp's argument held under 88 (float32's exp overflows past it: inf, and
    g / inf is the 0 it tends to)."""
    return g / (float32(1) + math.exp(lesser(-g, float32(88))))


@cuda.jit(device=True)
def clip(x, lo, hi):
    return lo if x < lo else hi if x > hi else x


# Products and sums rounded one at a time, as NumPy's float32 arithmetic (the reference) rounds
# them: NVVM contracts a float32 multiply and add into one fused multiply-add unless each is
# rounded explicitly (libdevice's _rn forms, PTX mul.rn / add.rn, which are never fused), and it
# contracts differently in different kernels (a fused kernel and the ops one by one then part
# in the last bit). The simulator's NumPy float32 arithmetic rounds every step.
if SIM:
    @cuda.jit(device=True)
    def mul_rn(a, b):
        return a * b

    @cuda.jit(device=True)
    def add_rn(a, b):
        return a + b
else:
    from numba.cuda import libdevice

    mul_rn, add_rn = libdevice.fmul_rn, libdevice.fadd_rn


@cuda.jit(device=True)
def rotate(x1, x2, c, s):
    """The pair (x1, x2) rotated by the angle of cos c, sin s: (x1 c - x2 s, x2 c + x1 s), each
    product and sum rounded as reference.rope's NumPy float32 ops round them (see mul_rn)."""
    return (add_rn(mul_rn(x1, c), -mul_rn(x2, s)), add_rn(mul_rn(x2, c), mul_rn(x1, s)))


@cuda.jit(device=True)
def square_add(acc, x):
    """acc + x x, rounded twice: every kernel's sum of squares the same floats (see mul_rn)."""
    return add_rn(acc, mul_rn(x, x))


@cuda.jit(device=True)
def block_reduce(part, tid, value, take_max):
    """The sum (or, with take_max, the largest) of `value` over the block's threads (a power of
    two of them, in one or two dimensions; tid: x + y blockDim.x), in shared scratch part [at
    least that many]: halving strides, a barrier after each."""
    part[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x * cuda.blockDim.y // 2
    while stride > 0:
        if tid < stride:
            other = part[tid + stride]
            part[tid] = greater(part[tid], other) if take_max else part[tid] + other
        cuda.syncthreads()
        stride //= 2
    result = part[0]
    cuda.syncthreads()
    return result


@cuda.jit(device=True)
def inv_rms(total, n, eps):
    """An RMSNorm's factor 1 / sqrt(total / n + eps) for n values whose squares sum to total, in
    float32 as the reference's (float64 would cost a slow square root and products)."""
    return float32(1) / math.sqrt(total / float32(n) + float32(eps))


# Numba's CUDA simulator has no warp shuffles (cuda.shfl_*_sync raise there): so the sum of a
# warp's lanes is a device function chosen here, once, at import: on hardware the lanes' values
# move between registers (no shared memory, no barrier); in the simulator they go through shared
# memory. Both need every thread of the block to call it (a barrier, or a full-warp mask).
if SIM:
    @cuda.jit(device=True)
    def warp_allsum(v, lane, warp):
        """The sum of v over the LANES lanes of warp `warp` of a (LANES, warps) block, in every
        lane (the same float in each, summed in one order)."""
        part = cuda.shared.array((32, LANES), float32)
        part[warp, lane] = v
        cuda.syncthreads()
        total = float32(0)
        for k in range(LANES):
            total += part[warp, k]
        cuda.syncthreads()   # every lane has read before a next call (in a loop) writes again
        return total

    @cuda.jit(device=True)
    def warp_allsums(v, n, lane, warp):
        """v[k] for k < n (n <= 16; a local array) each summed over warp `warp`'s lanes, in
        place, in every lane, as warp_allsum sums them: here with two barriers in all, not two
        a value (the simulator's barrier takes a millisecond)."""
        part = cuda.shared.array((32, 16, LANES), float32)
        for k in range(n):
            part[warp, k, lane] = v[k]
        cuda.syncthreads()
        for k in range(n):
            total = float32(0)
            for j in range(LANES):
                total += part[warp, k, j]
            v[k] = total
        cuda.syncthreads()
else:
    @cuda.jit(device=True)
    def warp_allsum(v, lane, warp):
        offset = LANES // 2
        while offset > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        return v

    @cuda.jit(device=True, inline=True)
    def warp_allsums(v, n, lane, warp):
        for k in range(n):
            v[k] = warp_allsum(v[k], lane, warp)


@cuda.jit(device=True)
def visible(p, q_pos, window):
    """Whether a query at q_pos sees the slot holding position p (-1: free): causal, and inside
    the window (window <= 0: none)."""
    return p >= 0 and p <= q_pos and (window <= 0 or q_pos - p < window)
