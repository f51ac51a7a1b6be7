"""Numba CPU kernels and the backend that runs the decoder on them.

Decode at batch 1 is memory-bound, so the 4-bit weights are read as they are packed, never as a
dequantized copy. The AutoAWQ layout (see awq_layout) is repacked once, at load, into a *planar*
layout that vectorizes: for a layer with `out` outputs (all projections that share an input fused
into one), W = out / 8 words per input row, and nibble j of word c holds output j * W + c. A GEMV
then runs, for each nibble j, one long contiguous loop over the words of a row (mask, convert,
multiply-add), with partial sums per quantization group folded into the output once per group:

    y[o] = sum_groups  s[g, o] * sum_{i in g} x[i] q[i, o]  -  s[g, o] z[g, o] * sum_{i in g} x[i]

On two cores this float GEMV is compute-bound rather than memory-bound (mask, convert,
multiply-add per weight: 10-15 G weights/s on two threads, benchmarks/cpu_kernels.py). One token runs each decoder layer
as one fused kernel call (decode_layer), its GEMVs split among threads by words or, for narrow
layers, by groups (gemv_split).

Prompts (more than GEMV_MAX_TOKENS tokens) dequantize the layer into a scratch buffer and call BLAS
through NumPy; prompt attention is blocked BLAS matmuls (attention_prompt). The LM head is
quantized at load to int8 per row (see prepare_head). Attention over the cache in decode, RMSNorm,
RoPE and SiLU·mul are Numba loops.

Every kernel compiles with cache=True: the first run of a fresh install compiles them (tens of
seconds), later runs load machine code from the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import llvmlite.binding
import numba
import numpy as np
from numba import njit, prange

from . import awq_layout, reference


def _wide_vectors() -> None:
    """Let LLVM vectorize with 512-bit registers on CPUs that have AVX-512 (by default it prefers
    256 bits there): one layer's 4-bit GEMVs measured 1.02-1.11x faster with them, medians of 5
    alternated processes (benchmarks/cpu_kernels.py).
    Takes effect if no Numba code of this process compiled yet; a NUMBA_CPU_FEATURES that the user
    set wins. Numba's cache keys machine code by these features."""
    if numba.config.CPU_FEATURES is None:
        features = llvmlite.binding.get_host_cpu_features()
        if features.get("avx512f"):
            numba.config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"


_wide_vectors()

GEMV_MAX_TOKENS = 4      # up to this many tokens, run the GEMV per token; above, dequantize + BLAS
PROMPT_BLOCK = 128       # queries per block of prompt attention
PARALLEL_MIN_WORDS = 256  # narrower 4-bit layers (words per row) split their groups among threads


class Q4Linear(NamedTuple):
    """A 4-bit linear layer in the planar layout."""

    w: np.ndarray        # int32 [in, W]: nibble j of word c = output j * W + c
    s: np.ndarray        # float32 [in/g, out]: scales
    zs: np.ndarray       # float32 [in/g, out]: zero point x scale

    @property
    def shape(self) -> tuple[int, int]:
        return self.s.shape[1], self.w.shape[0]          # (out, in), as a float weight


class Int8Rows(NamedTuple):
    """A float matrix [out, in] stored as int8 rows with one float32 scale per row."""

    q: np.ndarray        # int8 [out, in]
    s: np.ndarray        # float32 [out]


# -- repacking, once at load ---------------------------------------------------------------------

@njit(parallel=True, cache=True)
def _repack_planar(src, col0, W, dst):
    """Add a packed AutoAWQ part src int32 [in, out_p/8] whose outputs start at col0 into the
    planar dst int32 [in, W]."""
    rows, words = src.shape
    for i in prange(rows):
        for c in range(words):
            word = np.uint32(src[i, c])
            for k in range(8):
                code = (word >> np.uint32(4 * k)) & np.uint32(15)
                o = col0 + 8 * c + (2 * k if k < 4 else 2 * k - 7)   # ORDER[k]
                j, cc = o // W, o % W
                dst[i, cc] = np.int32(np.uint32(dst[i, cc]) | (code << np.uint32(4 * j)))


def repack(parts: list) -> Q4Linear:
    """AutoAWQ parts (QuantizedLinear) that share an input -> one planar Q4Linear."""
    rows = parts[0].qweight.shape[0]
    groups = parts[0].scales.shape[0]
    for p in parts:
        if p.qweight.shape[0] != rows or p.scales.shape[0] != groups:
            raise ValueError("fused 4-bit parts must share input size and group size")
    out = sum(p.scales.shape[1] for p in parts)
    W = out // awq_layout.PACK
    w = np.zeros((rows, W), np.int32)
    col = 0
    for p in parts:
        _repack_planar(np.ascontiguousarray(p.qweight), col, W, w)
        col += p.scales.shape[1]
    s = np.concatenate([p.scales.astype(np.float32) for p in parts], axis=1)
    z = np.concatenate([awq_layout.unpack(p.qzeros) for p in parts], axis=1)
    return Q4Linear(w, np.ascontiguousarray(s), np.ascontiguousarray(z * s, dtype=np.float32))


@njit(parallel=True, cache=True)
def _int8_rows(w, q, s):
    for r in prange(w.shape[0]):
        m = np.float32(0)
        for i in range(w.shape[1]):
            m = max(m, abs(np.float32(w[r, i])))
        scale = m / np.float32(127) if m > 0 else np.float32(1)
        s[r] = scale
        for i in range(w.shape[1]):
            q[r, i] = np.int8(np.round(np.float32(w[r, i]) / scale))


def quantize_int8_rows(w: np.ndarray, block: int = 512) -> Int8Rows:
    """reference.int8_rows, compiled: q = round(w / s), s = max|w_row| / 127. Converts `block`
    rows to float32 at a time, so a float16 table is never copied whole."""
    q = np.empty(w.shape, np.int8)
    s = np.empty(w.shape[0], np.float32)
    for a in range(0, w.shape[0], block):
        _int8_rows(np.ascontiguousarray(w[a:a + block], dtype=np.float32), q[a:a + block], s[a:a + block])
    return Int8Rows(q, s)


# -- 4-bit linear --------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def _q4_block(x, w, s, zs, y, c0, c1, g0, g1):
    """Add to y the part of y = x @ W.T (planar 4-bit layer) that the words [c0, c1) of the
    quantization groups [g0, g1) hold: outputs j * W + c, inputs g0 * g ... g1 * g."""
    n_in, W = w.shape
    g = n_in // s.shape[0]
    n = c1 - c0
    out = np.zeros((8, n), np.float32)
    acc = np.empty((8, n), np.float32)
    for gi in range(g0, g1):
        acc[:] = 0
        xs = np.float32(0)
        for i in range(gi * g, gi * g + g, 4):      # four rows per pass: fewer acc round trips
            x0, x1, x2, x3 = x[i], x[i + 1], x[i + 2], x[i + 3]
            xs += x0 + x1 + x2 + x3
            r0, r1, r2, r3 = w[i, c0:c1], w[i + 1, c0:c1], w[i + 2, c0:c1], w[i + 3, c0:c1]
            for j in range(7):
                # nibble j masked in place reads as q * 16^j: exact in float32; the 16^-j is
                # applied once per group
                m = np.int32(15 << (4 * j))
                a = acc[j]
                for c in range(n):
                    a[c] += (x0 * np.float32(r0[c] & m) + x1 * np.float32(r1[c] & m)
                             + x2 * np.float32(r2[c] & m) + x3 * np.float32(r3[c] & m))
            a = acc[7]
            for c in range(n):
                a[c] += (x0 * np.float32((r0[c] >> 28) & 15) + x1 * np.float32((r1[c] >> 28) & 15)
                         + x2 * np.float32((r2[c] >> 28) & 15) + x3 * np.float32((r3[c] >> 28) & 15))
        for j in range(8):
            f = np.float32(16.0 ** -j) if j < 7 else np.float32(1)
            sj = s[gi, j * W + c0:j * W + c1]
            zj = zs[gi, j * W + c0:j * W + c1]
            o = out[j]
            a = acc[j]
            for c in range(n):
                o[c] += sj[c] * (a[c] * f) - zj[c] * xs
    for j in range(8):
        y[j * W + c0:j * W + c1] += out[j]


def gemv_split(w: Q4Linear, threads: int) -> tuple[int, int]:
    """How a one-token GEMV of w is cut among `threads` tasks: (column chunks, group ranges).
    Wide layers split their words; narrow ones (short rows, where half a row is too little work
    per pass) split the input's groups, the partial outputs summed at the end."""
    if threads <= 1:
        return 1, 1
    if w.w.shape[1] >= PARALLEL_MIN_WORDS:
        return threads, 1
    return 1, min(threads, w.s.shape[0])


@njit(parallel=True, cache=True)
def q4_gemv(x, w, s, zs, y, ncol, nk):
    """y [out] = x [in] @ W.T for a planar 4-bit layer, in ncol x nk tasks: the words of a row
    cut into ncol column ranges, the quantization groups into nk ranges (see gemv_split)."""
    W, G = w.shape[1], s.shape[0]
    cstep, gstep = (W + ncol - 1) // ncol, (G + nk - 1) // nk
    parts = np.zeros((nk, y.shape[0]), np.float32)
    for t in prange(ncol * nk):
        c, k = t % ncol, t // ncol
        _q4_block(x, w, s, zs, parts[k], c * cstep, min(W, c * cstep + cstep),
                  k * gstep, min(G, k * gstep + gstep))
    y[:] = parts[0]
    for k in range(1, nk):
        y += parts[k]


@njit(fastmath=True, cache=True)
def q4_dequantize(w, s, zs, dst):
    """dst float32 [in, out] = W.T of a planar 4-bit layer. On one thread, on purpose: BLAS runs
    next, and OpenMP workers left spinning by a parallel loop would take its cores for
    milliseconds, slowing every prompt GEMM several times over."""
    n_in, W = w.shape
    g = n_in // s.shape[0]
    for i in range(n_in):
        gi = i // g
        for j in range(8):
            shift = 4 * j
            for c in range(W):
                o = j * W + c
                dst[i, o] = np.float32((w[i, c] >> shift) & 15) * s[gi, o] - zs[gi, o]


@njit(parallel=True, fastmath=True, cache=True)
def int8_gemv(x, q, s, y, nchunk):
    """y [out] = (q [out, in] * s[:, None]) @ x [in]."""
    rows = q.shape[0]
    step = (rows + nchunk - 1) // nchunk
    for ch in prange(nchunk):
        for r in range(ch * step, min(rows, ch * step + step)):
            acc = np.float32(0)
            row = q[r]
            for i in range(row.shape[0]):
                acc += x[i] * np.float32(row[i])
            y[r] = acc * s[r]


@njit(fastmath=True, cache=True)
def int8_dequantize(q, s, dst):
    """dst float32 [in, out] = (q * s[:, None]).T, on one thread (see q4_dequantize)."""
    for r in range(q.shape[0]):
        for i in range(q.shape[1]):
            dst[i, r] = np.float32(q[r, i]) * s[r]


# -- the small ops --------------------------------------------------------------------------------

@njit(fastmath=True, cache=True)
def rmsnorm(x, w, eps):
    """x [T, H], w [H] float32 -> [T, H] float32."""
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


@njit(fastmath=True, cache=True)
def silu_mul(gate, up):
    """gate, up [T, I] -> silu(gate) * up."""
    T, I = gate.shape
    y = np.empty((T, I), np.float32)
    for t in range(T):
        for i in range(I):
            g = gate[t, i]
            y[t, i] = g / (np.float32(1) + np.exp(-g)) * up[t, i]
    return y


@njit(parallel=True, fastmath=True, cache=True)
def attention_decode(q, k, v, q_pos, k_pos, scale, window):
    """One query per head over the cache: q [Q, D]; k, v [G, S', D] whole cache buffers of which
    the first len(k_pos) slots are read; k_pos -1 = free slot; window <= 0 means none.
    Returns [Q, D]."""
    Q, D = q.shape
    G, S = k.shape[0], k_pos.shape[0]
    R = Q // G
    out = np.zeros((Q, D), np.float32)
    for h in prange(Q):
        kg, vg, qh, oh = k[h // R], v[h // R], q[h], out[h]
        scores = np.empty(S, np.float32)
        m = np.float32(-np.inf)
        for s in range(S):
            p = k_pos[s]
            if p < 0 or p > q_pos or (window > 0 and q_pos - p >= window):
                scores[s] = -np.inf
                continue
            row = kg[s]
            acc = np.float32(0)
            for d in range(D):
                acc += qh[d] * row[d]
            scores[s] = acc * scale
            m = max(m, scores[s])
        total = np.float32(0)
        for s in range(S):
            e = np.exp(scores[s] - m)          # exp(-inf) = 0 for masked slots
            scores[s] = e
            total += e
        inv = np.float32(1) / total
        for s in range(S):
            if scores[s] != 0:
                p = scores[s] * inv
                row = vg[s]
                for d in range(D):
                    oh[d] += p * row[d]
    return out


@njit(cache=True)
def store_kv(k_buf, v_buf, slots, k, v):
    """k, v [T, G, D] -> cache buffers [G, S, D] at slots [T]."""
    T, G, D = k.shape
    for t in range(T):
        s = slots[t]
        for g in range(G):
            for d in range(D):
                k_buf[g, s, d] = k[t, g, d]
                v_buf[g, s, d] = v[t, g, d]


def attention_prompt(q, k, v, q_pos, k_pos, scale, window=None, block=PROMPT_BLOCK):
    """reference.attention for a prompt q [T, Q, D], in blocks of queries: each block's scores
    [R, block, S] for the R query heads of a KV head stay in the L2 cache through the softmax,
    slots after the last one a block sees are skipped (with slots in position order, the causal
    half of the work), and the normalization divides the [.., D] output instead of the [.., S]
    probabilities. Matmuls by BLAS."""
    T, Q, D = q.shape
    G, S = k.shape[0], len(k_pos)
    R = Q // G
    out = np.empty((T, Q, D), np.float32)
    qs = (q * np.float32(scale)).transpose(1, 0, 2)                    # [Q, T, D]
    for b in range(0, T, block):
        e = min(T, b + block)
        visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[b:e, None])
        if window is not None:
            visible &= (q_pos[b:e, None] - k_pos[None, :]) < window
        seen = np.flatnonzero(visible.any(axis=0))
        n = int(seen[-1]) + 1 if len(seen) else S          # slots past n: unseen by the block
        bias = np.where(visible[:, :n], np.float32(0), np.float32(-np.inf))
        for g in range(G):
            s = (qs[g * R:(g + 1) * R, b:e].reshape(-1, D) @ k[g, :n].T).reshape(R, e - b, n)
            s += bias
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            o = (s.reshape(-1, n) @ v[g, :n]).reshape(R, e - b, D)
            o /= s.sum(axis=-1)[..., None]
            out[b:e, g * R:(g + 1) * R] = o.transpose(1, 0, 2)
    return out


# -- one decoder layer for one token, fused ------------------------------------------------------

@njit(parallel=True, fastmath=True, cache=True)
def decode_layer(x, in_norm, post_norm, eps,
                 qkv_w, qkv_s, qkv_zs, qkv_split, o_w, o_s, o_zs, o_split,
                 gu_w, gu_s, gu_zs, gu_split, d_w, d_s, d_zs, d_split,
                 k_buf, v_buf, slot, pos, k_pos, cos, sin, n_heads, scale, window):
    """One token x [H] through one decoder layer of 4-bit linears, in place; its K/V go to `slot`
    of the cache buffers k_buf, v_buf [G, S, D] (k_pos already holds its position `pos`). The
    same ops as the decoder (models.llama) runs one by one, in a single call, so the costs of a
    call from Python are paid once per layer.
    *_split: (column chunks, group ranges) of each GEMV (gemv_split)."""
    G, D = k_buf.shape[0], k_buf.shape[2]
    Qd, Gd = n_heads * D, G * D
    h = rmsnorm(x.reshape(1, -1), in_norm, eps)[0]
    qkv = np.empty(qkv_s.shape[1], np.float32)
    q4_gemv(h, qkv_w, qkv_s, qkv_zs, qkv, qkv_split[0], qkv_split[1])
    q = rope(qkv[:Qd].reshape(1, n_heads, D), cos, sin)[0]
    k = rope(qkv[Qd:Qd + Gd].reshape(1, G, D), cos, sin)[0]
    for g in range(G):
        k_buf[g, slot] = k[g]
        v_buf[g, slot] = qkv[Qd + Gd + g * D:Qd + Gd + g * D + D]
    a = attention_decode(q, k_buf, v_buf, pos, k_pos, scale, window)
    y = np.empty(x.shape[0], np.float32)
    q4_gemv(a.reshape(-1), o_w, o_s, o_zs, y, o_split[0], o_split[1])
    x += y
    h = rmsnorm(x.reshape(1, -1), post_norm, eps)
    gu = np.empty(gu_s.shape[1], np.float32)
    q4_gemv(h[0], gu_w, gu_s, gu_zs, gu, gu_split[0], gu_split[1])
    I = gu.shape[0] // 2
    act = silu_mul(gu[:I].reshape(1, -1), gu[I:].reshape(1, -1))[0]
    q4_gemv(act, d_w, d_s, d_zs, y, d_split[0], d_split[1])
    x += y


# -- the backend ---------------------------------------------------------------------------------

class CpuBackend(reference.ReferenceBackend):
    """The decoder's ops on the Numba kernels above. Prepared weights: Q4Linear for 4-bit
    projections, Int8Rows for the LM head, float32 [out, in] arrays for float projections."""

    name = "cpu"

    def __init__(self, threads: int | None = None):
        if threads is not None:
            numba.set_num_threads(threads)
        self.threads = numba.get_num_threads()
        self._scratch = np.empty(0, np.float32)

    def prepare_linear(self, parts: list):
        if all(isinstance(p, awq_layout.QuantizedLinear) for p in parts):
            return repack(parts)
        return super().prepare_linear(parts)

    def prepare_head(self, table: np.ndarray, quantized: bool = False):
        # the same int8 rows as the reference (see ReferenceBackend.prepare_head), read as int8
        return quantize_int8_rows(table) if quantized else self.prepare_linear([table])

    def prepare_embedding(self, table: np.ndarray) -> np.ndarray:
        return table          # looked up a few rows at a time: stays as stored (mmap, f16 or f32)

    def _dequantized(self, w) -> np.ndarray:
        """The float32 [in, out] of a 4-bit or int8 layer, in a scratch buffer reused by all."""
        n_out, n_in = w.shape if isinstance(w, Q4Linear) else w.q.shape
        if self._scratch.size < n_in * n_out:
            self._scratch = np.empty(n_in * n_out, np.float32)
        dst = self._scratch[:n_in * n_out].reshape(n_in, n_out)
        if isinstance(w, Q4Linear):
            q4_dequantize(w.w, w.s, w.zs, dst)
        else:
            int8_dequantize(w.q, w.s, dst)
        return dst

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        if isinstance(w, np.ndarray):
            return reference.linear(x, w)
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if T > GEMV_MAX_TOKENS:
            return x @ self._dequantized(w)
        n_out = w.shape[0] if isinstance(w, Q4Linear) else w.q.shape[0]
        y = np.empty((T, n_out), np.float32)
        for t in range(T):
            if isinstance(w, Q4Linear):
                q4_gemv(x[t], w.w, w.s, w.zs, y[t], *gemv_split(w, self.threads))
            else:
                int8_gemv(x[t], w.q, w.s, y[t], self.threads)
        return y

    def fused_decode(self, layer) -> bool:
        return all(isinstance(w, Q4Linear) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def decode_layer(self, x, layer, k_buf, v_buf, slot, pos, k_pos, cos, sin, *, eps, n_heads,
                     scale, window=None):
        """One token x [1, H] through a decoder layer (see the kernel decode_layer)."""
        x = np.array(x, np.float32).reshape(-1)
        lins = []
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lins += [w.w, w.s, w.zs, gemv_split(w, self.threads)]
        decode_layer(x, layer.input_norm, layer.post_norm, np.float32(eps), *lins, k_buf, v_buf,
                     slot, pos, k_pos, cos, sin, n_heads, np.float32(scale), window or 0)
        return x[None]

    def rmsnorm(self, x, w, eps):
        return rmsnorm(np.ascontiguousarray(x, dtype=np.float32), w, eps)

    def rope(self, x, cos, sin):
        return rope(x, cos, sin)

    def silu_mul(self, gate, up):
        # a prompt's many rows: NumPy's vectorized exp is twice as fast as a Numba loop without
        # a vector math library; one token: the Numba loop, without NumPy's per-call costs
        return silu_mul(gate, up) if gate.shape[0] == 1 else reference.silu_mul(gate, up)

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None):
        if q.ndim == 3 and q.shape[0] == 1:
            out = attention_decode(q[0], k, v, int(q_pos[0]), k_pos, np.float32(scale),
                                   window or 0)
            return out[None]
        if q.ndim == 3:
            return attention_prompt(q, k, v, q_pos, k_pos, scale, window)
        return reference.attention(q, k, v, q_pos, k_pos, scale, window)

    def store_kv(self, k_buf, v_buf, slots, k, v):
        store_kv(k_buf, v_buf, slots, np.ascontiguousarray(k), np.ascontiguousarray(v))
