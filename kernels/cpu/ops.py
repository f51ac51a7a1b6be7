"""The CPU's small ops: exp, RMSNorm, RoPE and the gated MLP's SiLU-mul and GELU-mul, as Numba
loops."""

from __future__ import annotations

import numpy as np
from numba import njit

from . import simd


@njit(fastmath=True, cache=True, inline="always")
def exp(x):
    """e**x for float32 x, relative error below 4e-7, in arithmetic that LLVM vectorizes (a loop
    calling np.exp makes one libm call per element): e**x = 2**n * e**f with n = round(x / ln 2)
    and |f| <= ln(2) / 2, e**f by its Taylor polynomial to degree 7. exp(-inf) = 0; inputs
    above 88 give e**88 (no inf)."""
    x = min(x, np.float32(88.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    f = (x - n * np.float32(0.693145751953125)) - n * np.float32(1.4286068203094173e-06)
    p = np.float32(1 / 5040)
    p = p * f + np.float32(1 / 720)
    p = p * f + np.float32(1 / 120)
    p = p * f + np.float32(1 / 24)
    p = p * f + np.float32(1 / 6)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1)
    p = p * f + np.float32(1)
    if x < np.float32(-87.3):                       # below float32's normal range (and -inf)
        return np.float32(0)
    return p * simd.float_from_bits(np.int32((np.int32(n) + 127) << 23))


@njit(fastmath=True, cache=True, error_model="numpy")
def rmsnorm(x, w, eps):
    """x [T, H], w [H] float32 -> [T, H] float32. (Numpy's error model, here and in every
    kernel that divides by data: a zero divisor, from activations that overflowed or an epsilon
    of 0, gives inf or NaN, which the sampler reports as a broken model, not an exception.)"""
    T, H = x.shape
    y = np.empty((T, H), np.float32)
    for t in range(T):
        ss = np.float32(0)
        for i in range(H):
            ss += x[t, i] * x[t, i]
        r = np.float32(1) / np.sqrt(ss / np.float32(H) + np.float32(eps))
        for i in range(H):
            y[t, i] = x[t, i] * r * w[i]
    return y


@njit(fastmath=True, cache=True)
def rope(x, cos, sin):
    """x [T, N, D] -> rotated copy (rotate-half layout), cos/sin [T, D/2]."""
    T, N, D = x.shape
    half = D // 2
    y = np.empty((T, N, D), np.float32)
    for t in range(T):
        for h in range(N):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                c, s = cos[t, i], sin[t, i]
                y[t, h, i] = a * c - b * s
                y[t, h, i + half] = b * c + a * s
    return y


@njit(fastmath=True, cache=True, error_model="numpy")
def swiglu_row(gu, y):
    """y [I] = silu(gate) * up of one row gu [2I] (gate first). NumPy's error model: Numba's
    default checks every division for a zero divisor, a branch that keeps LLVM from vectorizing
    the loop (4 ns instead of 0.6 ns per element)."""
    I = y.shape[0]
    for i in range(I):
        g = gu[i]
        y[i] = g / (np.float32(1) + exp(-g)) * gu[I + i]


@njit(fastmath=True, cache=True, error_model="numpy")
def geglu_row(gu, y):
    """y [I] = gelu_tanh(gate) * up of one row gu [2I] (gate first; Gemma). GELU's tanh form
    0.5 g (1 + tanh z), z = sqrt(2 / pi) (g + 0.044715 g**3), is g * sigmoid(2z): the same
    arithmetic as SiLU's, on 2z."""
    I = y.shape[0]
    for i in range(I):
        g = gu[i]
        z2 = np.float32(1.5957691216057308) * (g + np.float32(0.044715) * g * g * g)
        y[i] = g / (np.float32(1) + exp(-z2)) * gu[I + i]


@njit(fastmath=True, cache=True)
def gated(gu, gelu):
    """gu [T, 2I] C-contiguous (the fused gate/up output, gate first) -> silu(gate) * up [T, I],
    or gelu_tanh(gate) * up where `gelu`. On one thread: a prompt's BLAS calls come before and
    after (see int8_dequantize)."""
    T, I = gu.shape[0], gu.shape[1] // 2
    y = np.empty((T, I), np.float32)
    for t in range(T):
        if gelu:
            geglu_row(gu[t], y[t])
        else:
            swiglu_row(gu[t], y[t])
    return y
