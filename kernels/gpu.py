"""Numba CUDA kernels for the decoder's per-token path (one token at batch 1, memory-bound).

Each kernel computes what its NumPy reference (kernels.reference, quant) computes, and is
tested against it on fresh random inputs in Numba's CUDA simulator, where CI runs them (no GPU
there). Arrays are anything with the CUDA array interface: torch tensors on the GPU, shared with
the kernels without copies; NumPy arrays in the simulator. Activations are float32; quantized
weights are read in the runtime's one form (kernels.quant), their codes as int32 words along
each output row, never dequantized to memory for a token.

Launch shapes are the `launch_*` helpers' business: the kernels take their arrays, the helpers
pick grid and block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
from numba import cuda, float32

from . import quant, reference


# Numba's CUDA simulator runs every CUDA thread as a Python thread: there, blocks are smaller
# (the same code: every kernel is written for any of these sizes)
_SIM = bool(numba.config.ENABLE_CUDASIM)
LANES = 4 if _SIM else 32      # threads per output row of a GEMV (a warp: neighbouring words of
                               # a row, 128 bytes at once)
ROWS = 2 if _SIM else 8        # output rows per block of a GEMV
THREADS = 8 if _SIM else 128   # threads per block of RMSNorm and of decode attention (a power
                               # of two: the block reductions halve it)
HALF_MAX = 65504.0   # the largest finite float16 (a float16 cache clamps to it, as the reference)


@cuda.jit
def q_gemv(x, codes, scale, offset, bits, y):
    """y [out] = x [in] @ W.T for a quantized layer (kernels.quant): codes int32 [out, in*bits/32]
    (word c of row o holds inputs n c .. n c + n - 1, n = 32 / bits, input n c + t at bit
    bits * t: the contract's bytes read four at a time), scale and offset [out, in/g] (float16
    or float32). Block (LANES, ROWS): a warp per output row, its lanes taking every LANES-th
    word; per word sum x q and x over its inputs (one group: n divides g), then
    s * dot + m * xsum; the lanes' sums added in shared memory."""
    lane, r = cuda.threadIdx.x, cuda.threadIdx.y
    o = cuda.blockIdx.x * ROWS + r
    words = codes.shape[1]
    per = 32 // bits
    mask = (1 << bits) - 1
    acc = float32(0)
    if o < codes.shape[0]:
        g = words * per // scale.shape[1]
        for c in range(lane, words, LANES):
            w = codes[o, c]
            dot = float32(0)
            xsum = float32(0)
            for t in range(per):
                xi = x[per * c + t]
                dot += xi * float32((w >> (bits * t)) & mask)
                xsum += xi
            gi = per * c // g
            acc += float32(scale[o, gi]) * dot + float32(offset[o, gi]) * xsum
    part = cuda.shared.array((ROWS, LANES), float32)
    part[r, lane] = acc
    cuda.syncthreads()
    if lane == 0 and o < codes.shape[0]:
        total = float32(0)
        for k in range(LANES):
            total += part[r, k]
        y[o] = total


@cuda.jit
def gemv(x, w, y):
    """y [out] = x [in] @ w.T for float weights w [out, in] (float16 or float32): the LM head of
    a float model. Block (LANES, ROWS): a warp per output row, its lanes taking every LANES-th
    input, their sums added in shared memory."""
    lane, r = cuda.threadIdx.x, cuda.threadIdx.y
    o = cuda.blockIdx.x * ROWS + r
    acc = float32(0)
    if o < w.shape[0]:
        for i in range(lane, w.shape[1], LANES):
            acc += x[i] * float32(w[o, i])
    part = cuda.shared.array((ROWS, LANES), float32)
    part[r, lane] = acc
    cuda.syncthreads()
    if lane == 0 and o < w.shape[0]:
        total = float32(0)
        for k in range(LANES):
            total += part[r, k]
        y[o] = total


@cuda.jit(device=True)
def _block_reduce(part, tid, value, take_max):
    """The sum (or, with take_max, the largest) of `value` over a block of THREADS threads, in
    shared scratch part [THREADS]: halving strides, a barrier after each."""
    part[tid] = value
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            other = part[tid + stride]
            part[tid] = max(part[tid], other) if take_max else part[tid] + other
        cuda.syncthreads()
        stride //= 2
    result = part[0]
    cuda.syncthreads()
    return result


@cuda.jit
def rmsnorm(x, w, eps, y):
    """y [T, H] = x / sqrt(mean(x**2) + eps) * w; one block per row."""
    t, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    part = cuda.shared.array(THREADS, float32)
    acc = float32(0)
    for i in range(tid, n, THREADS):
        acc += x[t, i] * x[t, i]
    inv = float32(1) / math.sqrt(_block_reduce(part, tid, acc, False) / n + eps)
    for i in range(tid, n, THREADS):
        y[t, i] = x[t, i] * inv * w[i]


@cuda.jit
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
        y[t, n, i] = x1 * c - x2 * s
        y[t, n, i + half] = x2 * c + x1 * s


@cuda.jit
def silu_mul(gu, y):
    """y [T, I] = silu(gate) * up of the fused gate/up output gu [T, 2I] (gate first)."""
    k = cuda.grid(1)
    T, I = y.shape
    if k < T * I:
        t, i = k // I, k % I
        g = gu[t, i]
        y[t, i] = g / (float32(1) + math.exp(min(-g, float32(88)))) * gu[t, I + i]


@cuda.jit
def store_kv(k_buf, v_buf, slots, k, v, top):
    """k, v float32 [T, G, D] -> cache buffers [G, C, D] at KV head g's slots slots[g] ([G, T]),
    clamped to +-top (the largest finite float16 for a float16 cache)."""
    n = cuda.grid(1)
    T, G, D = k.shape
    if n < T * G * D:
        t, rest = n // (G * D), n % (G * D)
        g, d = rest // D, rest % D
        s = slots[g, t]
        k_buf[g, s, d] = min(max(k[t, g, d], -top), top)
        v_buf[g, s, d] = min(max(v[t, g, d], -top), top)


@cuda.jit
def attention_decode(q, k, v, q_pos, k_pos, scale, window, score, probs, out):
    """One query per head q [Q, D] over the cache buffers k, v [G, C, D], slots [0, S) of which
    hold positions k_pos [G, S] (-1: free), in any order; window <= 0: none. One block per query
    head: its threads take every THREADS-th slot for the scores (kept in probs [Q, S]), the block
    finds their largest and the softmax's sum, then each thread sums the weighted V rows for its
    share of the D columns. score [G, C] (empty [G, 0]: none) gets each slot's weight added
    (atomically: the R query heads of a KV head add to the same row). out [Q, D]."""
    h, tid = cuda.blockIdx.x, cuda.threadIdx.x
    Q, D = q.shape
    G, S = k_pos.shape
    g = h // (Q // G)
    part = cuda.shared.array(THREADS, float32)
    top = float32(-math.inf)
    for s in range(tid, S, THREADS):
        p = k_pos[g, s]
        e = float32(-math.inf)
        if p >= 0 and p <= q_pos and (window <= 0 or q_pos - p < window):
            e = float32(0)
            for d in range(D):
                e += q[h, d] * float32(k[g, s, d])
            e *= scale
        probs[h, s] = e
        top = max(top, e)
    top = _block_reduce(part, tid, top, True)
    total = float32(0)
    for s in range(tid, S, THREADS):
        e = probs[h, s]
        e = float32(0) if e == -math.inf else math.exp(e - top)
        probs[h, s] = e
        total += e
    total = _block_reduce(part, tid, total, False)
    inv = float32(0) if total == 0 else float32(1) / total
    cuda.syncthreads()           # every thread's probs written before any thread reads them all
    for d in range(tid, D, THREADS):
        acc = float32(0)
        for s in range(S):
            acc += probs[h, s] * float32(v[g, s, d])
        out[h, d] = acc * inv
    if score.shape[1] > 0:
        for s in range(tid, S, THREADS):
            cuda.atomic.add(score, (g, s), probs[h, s] * inv)


def _blocks(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


def launch_q_gemv(x, w, y) -> None:
    """y [out] = x [in] @ W.T for a GpuQuant w."""
    q_gemv[_blocks(w.codes.shape[0], ROWS), (LANES, ROWS)](x, w.codes, w.scale, w.offset,
                                                            w.bits, y)


def launch_gemv(x, w, y) -> None:
    gemv[_blocks(w.shape[0], ROWS), (LANES, ROWS)](x, w, y)


def launch_rmsnorm(x, w, eps: float, y) -> None:
    rmsnorm[x.shape[0], THREADS](x, w, np.float32(eps), y)


def launch_rope(x, cos, sin, y) -> None:
    T, N, D = x.shape
    rope[_blocks(T * N * (D // 2), THREADS), THREADS](x, cos, sin, y)


def launch_silu_mul(gu, y) -> None:
    silu_mul[_blocks(y.shape[0] * y.shape[1], THREADS), THREADS](gu, y)


def launch_store_kv(k_buf, v_buf, slots, k, v) -> None:
    top = np.float32(HALF_MAX if str(k_buf.dtype).endswith("float16") else np.inf)   # numpy or torch
    store_kv[_blocks(k.size, THREADS), THREADS](k_buf, v_buf, slots, k, v, top)


def launch_attention_decode(q, k, v, q_pos: int, k_pos, scale: float, window: int, score,
                            probs, out) -> None:
    attention_decode[q.shape[0], THREADS](q, k, v, q_pos, k_pos, np.float32(scale), window,
                                          score, probs, out)


@cuda.jit
def q_dequantize(codes, scale, offset, bits, dst):
    """dst [in, out] = W.T of a quantized layer (as q_gemv reads it), for a prompt's matmul; one
    thread per word: its 32 / bits inputs of one output."""
    n = cuda.grid(1)
    rows, words = codes.shape
    per = 32 // bits
    if n < rows * words:
        o, c = n // words, n % words
        gi = per * c // (words * per // scale.shape[1])
        s, m, w = float32(scale[o, gi]), float32(offset[o, gi]), codes[o, c]
        for t in range(per):
            dst[per * c + t, o] = float32((w >> (bits * t)) & ((1 << bits) - 1)) * s + m


def launch_q_dequantize(w, dst) -> None:
    q_dequantize[_blocks(w.codes.shape[0] * w.codes.shape[1], THREADS), THREADS](
        w.codes, w.scale, w.offset, w.bits, dst)


class GpuQuant(NamedTuple):
    """A quantized layer on the GPU (the projections that share an input side by side, along
    the output): kernels.quant's arrays as stored, the codes read as int32 words."""

    codes: object        # int32 [out, in*bits/32]
    scale: object        # float16 | float32 [out, in/g]
    offset: object       # as scale
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 32 // self.bits


class CudaBackend(reference.ReferenceBackend):
    """The decoder's ops on the kernels above. Device arrays are torch tensors on the GPU (the
    kernels read them through the CUDA array interface, no copies); in Numba's CUDA simulator
    they are NumPy arrays, so that the whole backend runs, slowly, where there is no GPU.
    Weights are uploaded once, at load: quantized layers as kernels.quant holds them, float
    weights as float16.
    Host inputs (positions, RoPE tables, the sinks' keys) are copied up where an op takes them.
    """

    name = "cuda"
    host_memory = False
    quantized_kv = False     # its kernels read float16 and float32 caches only, so far

    def __init__(self):
        self.sim = bool(numba.config.ENABLE_CUDASIM)
        if not self.sim:
            import torch

            self.torch = torch
            self._types = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                           np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}

    # -- memory ----------------------------------------------------------------------------------

    def dev(self, a, dtype=np.float32):
        """A contiguous device array of `a` (host or device) as `dtype`."""
        if self.sim:     # (the simulator writes every array back after a launch)
            a = np.ascontiguousarray(a, dtype)
            return a if a.flags.writeable else a.copy()
        t = self._types[np.dtype(dtype)]
        if isinstance(a, self.torch.Tensor):
            return a.to(device="cuda", dtype=t).contiguous()
        return self.torch.as_tensor(np.ascontiguousarray(a, dtype), device="cuda")

    def empty(self, shape, dtype=np.float32):
        if self.sim:
            return np.empty(shape, dtype)
        return self.torch.empty(shape, dtype=self._types[np.dtype(dtype)], device="cuda")

    def zeros(self, shape, dtype=np.float32):
        if self.sim:
            return np.zeros(shape, dtype)
        return self.torch.zeros(shape, dtype=self._types[np.dtype(dtype)], device="cuda")

    def to_numpy(self, x) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.float().cpu().numpy()

    def _matmul(self, x, w_t):
        """x [T, in] @ w_t [in, out] on the device (cuBLAS through torch)."""
        return x @ w_t

    # -- weights ---------------------------------------------------------------------------------

    def prepare_linear(self, parts: list):
        if all(isinstance(p, quant.QuantWeight) for p in parts):
            # one float scale and offset per group, 4- or 8-bit codes: the kernels' one layout
            w = quant.concat(parts)
            w = quant.flat(w, 4 if w.bits == 4 else 8)
            if w.shape[1] % (32 // w.bits):
                raise ValueError(f"{w.shape[1]} inputs do not fill whole words of {w.bits}-bit codes")
            return GpuQuant(self.dev(np.ascontiguousarray(w.codes).view(np.int32), np.int32),
                            self.dev(w.scale, w.scale.dtype), self.dev(w.offset, w.offset.dtype),
                            w.bits)
        return self.dev(super().prepare_linear(parts), np.float16)

    def prepare_head(self, table: np.ndarray, quantized: bool = False):
        return self.dev(super().prepare_head(table, quantized), np.float16)

    def prepare_vector(self, a: np.ndarray):
        return self.dev(a)

    def prepare_embedding(self, table):
        if not isinstance(table, np.ndarray):        # rows dequantized as indexed: all of them
            table = table[np.arange(table.shape[0])]
        return self.dev(table, np.float16)

    # -- ops -------------------------------------------------------------------------------------

    def embedding(self, table, ids):
        if self.sim:
            return table[ids].astype(np.float32)
        return table[self.torch.as_tensor(ids, device="cuda")].float()

    def linear(self, x, w):
        x = self.dev(x)
        T = x.shape[0]
        if isinstance(w, GpuQuant):
            if T == 1:
                y = self.empty((1, w.shape[0]))
                launch_q_gemv(x[0], w, y[0])
                return y
            w_t = self.empty((w.shape[1], w.shape[0]))
            launch_q_dequantize(w, w_t)
            return self._matmul(x, w_t)
        if T == 1:
            y = self.empty((1, w.shape[0]))
            launch_gemv(x[0], w, y[0])
            return y
        return self._matmul(x, self.dev(w).T)

    def rmsnorm(self, x, w, eps):
        x = self.dev(x)
        y = self.empty(x.shape)
        launch_rmsnorm(x, w, eps, y)
        return y

    def rope(self, x, cos, sin):
        x = self.dev(x)
        y = self.empty(x.shape)
        launch_rope(x, self.dev(cos), self.dev(sin), y)
        return y

    def swiglu(self, gu):
        gu = self.dev(gu)
        y = self.empty((gu.shape[0], gu.shape[1] // 2))
        launch_silu_mul(gu, y)
        return y

    def store_kv(self, k_buf, v_buf, slots, k, v):
        launch_store_kv(k_buf, v_buf, self.dev(slots, np.int64), self.dev(k), self.dev(v))

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None, score=None):
        """One decode attention per query (a prompt's queries one after another: their own and
        later tokens' slots are hidden by the causal mask)."""
        q = self.dev(q)
        T, Q, D = q.shape
        G = k.shape[0]
        k_pos = self.dev(np.broadcast_to(k_pos, (G, k_pos.shape[-1])), np.int64)
        sc = self.zeros((G, 0)) if score is None else self.dev(score)
        probs, out = self.empty((Q, k_pos.shape[1])), self.empty((T, Q, D))
        for t in range(T):
            launch_attention_decode(q[t], k, v, int(q_pos[t]), k_pos, scale, window or 0, sc,
                                    probs, out[t])
        if score is not None and sc is not score:
            score[...] = self.to_numpy(sc)          # a cache that keeps its scores on the host
        return out


def unavailable() -> str | None:
    """Why the CUDA backend cannot run here (None: it can; Numba's CUDA simulator counts)."""
    if numba.config.ENABLE_CUDASIM:
        return None
    try:
        import torch
    except ImportError:
        return "the CUDA backend needs PyTorch built with CUDA (pip install torch)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU (no device, no driver, or a CPU-only build of torch)"
    if not cuda.is_available():
        return "Numba sees no CUDA GPU (is the CUDA driver installed?)"
    return None
