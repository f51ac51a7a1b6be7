"""Numba CUDA kernels for the decoder's per-token path (one token at batch 1, memory-bound):
RMSNorm, RoPE, SiLU-mul and the float cache's store (the GEMV is gemv.py's, attention
attention.py's).

Each kernel computes what its NumPy reference (kernels.reference) computes, and is tested
against it in Numba's CUDA simulator. Activations are float32. Grids and blocks are the
launchers' business.
"""

from __future__ import annotations

from numba import cuda, float32

from .primitives import NORM_THREADS, block_reduce, clip, inv_rms, rotate, silu, square_add


@cuda.jit(cache=True)
def add_rmsnorm(x, d, add, w, eps, y):
    """y [T, H] = x / sqrt(mean(x**2) + eps) * w, the residual d [T, H] first added into x
    where add is 1 (x += d, in place: a decode step's residual add and the norm after it in one
    launch; add 0: a plain RMSNorm, d not read). One block per row, its threads striding it (a
    power of two of them, at most NORM_THREADS), their sums of squares a block reduction."""
    t, tid, threads = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    part = cuda.shared.array(NORM_THREADS, float32)
    acc = float32(0)
    for i in range(tid, n, threads):
        if add:
            x[t, i] += d[t, i]
        acc = square_add(acc, x[t, i])
    inv = inv_rms(block_reduce(part, tid, acc, False), n, eps)
    for i in range(tid, n, threads):
        y[t, i] = x[t, i] * inv * w[i]


@cuda.jit(cache=True)
def rope(x, cos, sin, y):
    """y [T, N, D] = x rotated by cos/sin [T, D/2], HF rotate-half pairs (i, i + D/2)."""
    k = cuda.grid(1)
    T, N, D = x.shape
    half = D // 2
    if k < T * N * half:
        t, rest = k // (N * half), k % (N * half)
        n, i = rest // half, rest % half
        c, s = cos[t, i], sin[t, i]
        x1, x2 = x[t, n, i], x[t, n, i + half]
        y[t, n, i], y[t, n, i + half] = rotate(x1, x2, c, s)


@cuda.jit(cache=True)
def silu_mul(gu, y):
    """y [T, I] = silu(gate) * up of the fused gate/up output gu [T, 2I] (gate first)."""
    k = cuda.grid(1)
    T, I = y.shape
    if k < T * I:
        t, i = k // I, k % I
        g = gu[t, i]
        y[t, i] = silu(g) * gu[t, I + i]


@cuda.jit(cache=True)
def store_kv(k_buf, v_buf, slots, k, v, top):
    """k, v float32 [T, G, D] -> cache buffers [G, C, D] at KV head g's slots slots[g] ([G, T]),
    clamped to +-top (the largest finite float16 for a float16 cache)."""
    n = cuda.grid(1)
    T, G, D = k.shape
    if n < T * G * D:
        t, rest = n // (G * D), n % (G * D)
        g, d = rest // D, rest % D
        s = slots[g, t]
        k_buf[g, s, d] = clip(k[t, g, d], -top, top)
        v_buf[g, s, d] = clip(v[t, g, d], -top, top)


@cuda.jit(device=True)
def _biased(qkv, bias, t, c):
    """Column c of token t's q|k|v projection, its bias added (bias [0]: none)."""
    return qkv[t, c] + bias[c] if bias.shape[0] > 0 else qkv[t, c]


@cuda.jit(cache=True)
def rope_store(qkv, bias, q_norm, k_norm, eps, cos, sin, k_buf, v_buf, slots, top, q):
    """A decode step's q|k|v projection qkv [T, (Q + 2G) D] made ready for attention in one
    launch, as the model's ops make it (LlamaModel.attention): the bias added (bias
    [(Q + 2G) D], or [0]: none), each q and k head RMS-normed (q_norm, k_norm [D], or [0]:
    none), rotated by cos, sin [T, D/2] as `rope` rotates; the queries into q [T, Q, D], the keys
    and values stored as store_kv stores them (into k_buf, v_buf [G, C, D] at KV head g's slots
    slots[g] ([G, T]), clamped to +-top). Block (h, t): head h of token t, the Q query heads
    and then the G KV heads (a key and its value); its threads take the pairs (i, i + D/2), and
    sum a norm's squares as add_rmsnorm's threads do (launched as many: the same sums)."""
    h, t, tid, threads = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, cuda.blockDim.x
    Q, D = q.shape[1], q.shape[2]
    G = k_buf.shape[0]
    half = D // 2
    at = h * D                           # the head's first column in qkv
    g = h - Q                            # (a KV head: h >= Q)
    norm = q_norm if h < Q else k_norm
    part = cuda.shared.array(NORM_THREADS, float32)
    inv = float32(1)
    if norm.shape[0] > 0:                # (the same branch in the whole block: it syncs)
        acc = float32(0)
        for i in range(tid, D, threads):
            acc = square_add(acc, _biased(qkv, bias, t, at + i))
        inv = inv_rms(block_reduce(part, tid, acc, False), D, eps)
    for i in range(tid, half, threads):
        x1, x2 = _biased(qkv, bias, t, at + i), _biased(qkv, bias, t, at + i + half)
        if norm.shape[0] > 0:            # (rounded to float32 as the norm's output is)
            x1, x2 = float32(x1 * inv * norm[i]), float32(x2 * inv * norm[i + half])
        c, s = cos[t, i], sin[t, i]
        y1, y2 = rotate(x1, x2, c, s)
        if h < Q:
            q[t, h, i], q[t, h, i + half] = y1, y2
        else:
            k_buf[g, slots[g, t], i] = clip(y1, -top, top)
            k_buf[g, slots[g, t], i + half] = clip(y2, -top, top)
    if h >= Q:
        for i in range(tid, D, threads):
            v_buf[g, slots[g, t], i] = clip(_biased(qkv, bias, t, (Q + G + g) * D + i), -top, top)
