"""Numba CUDA kernels for the decoder's per-token path (one token at batch 1, memory-bound):
the quantized and float GEMVs, RMSNorm, RoPE, SiLU-mul, the float cache's store and
flash-decoding attention over it.

Each kernel computes what its NumPy reference (kernels.reference, quant) computes, and is tested
against it in Numba's CUDA simulator. Activations are float32; quantized weights are read in the
runtime's one form (kernels.quant), their codes as int32 words along each output row (`repack`),
never dequantized to memory for a token. Grids and blocks are the launchers' business.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint64

from .primitives import LANES, ROWS, SIM, THREADS, block_reduce, clip, greater, lesser, visible


# Numba's CUDA simulator has no warp shuffles (cuda.shfl_*_sync raise there): so the sum of a
# row's lanes is a device function chosen here, once, at import: on hardware the lanes' values
# move between registers (no shared memory, no barrier); in the simulator they go through shared
# memory. Both need every thread of the block to call it (a barrier, or a full-warp mask).
if SIM:
    @cuda.jit(device=True)
    def _warp_sum(v, lane, r):
        """The sum of v over the LANES lanes of row r of a (LANES, ROWS) block (lane 0 has it)."""
        part = cuda.shared.array((ROWS, LANES), float32)
        part[r, lane] = v
        cuda.syncthreads()
        total = float32(0)
        for k in range(LANES):
            total += part[r, k]
        cuda.syncthreads()   # every lane has read before a next call (in a loop) writes again
        return total
else:
    @cuda.jit(device=True)
    def _warp_sum(v, lane, r):
        offset = LANES // 2
        while offset > 0:
            v += cuda.shfl_down_sync(0xFFFFFFFF, v, offset)
            offset //= 2
        return v


# A code q (< 2**23) as the low bits of the float 2**23's mantissa is the float 2**23 + q:
# minus 2**23, q exactly. An integer OR and a float subtract, instead of an int-to-float
# conversion, which runs at 1/8 of the float multiply-add's rate on the GPU (the CUDA guide's
# throughput table): too slow to convert 4-bit codes as fast as memory delivers them.
_TWO23 = float32(2 ** 23)
_TWO23_BITS = 0x4B000000
if SIM:
    @cuda.jit(device=True)
    def _as_float(i):
        return np.int32(i).view(np.float32)
else:
    from numba.cuda import libdevice

    _as_float = libdevice.int_as_float


@cuda.jit(device=True, inline=True)
def _row_dot(x, codes, scale, offset, o, lane, first, last, n_in, g, bits):
    """Lane `lane`'s part of output o of q_gemv over tiles [first, last). Inlined where `bits`
    is a constant: shifts by constants (32-bit) and a loop over a word's codes unrolled."""
    per = 32 // bits
    mask = (1 << bits) - 1
    acc = float32(0)
    dot = float32(0)
    xsum = float32(0)
    i = first * LANES * per + lane
    if i >= n_in:                   # a lane of padding only (in the last tile)
        return acc
    gi = i // g                     # the group being summed, and the input it ends before
    end = (gi + 1) * g
    for j in range(first, last):
        w = codes[o, j * LANES + lane]
        i = j * LANES * per + lane
        for t in range(per):
            if i >= end:            # a new group (at the same t in every lane where LANES | g),
                if i >= n_in:       # or past n_in (g divides n_in): padding to the tile's end
                    break
                acc += float32(scale[o, gi]) * dot + float32(offset[o, gi]) * xsum
                dot = float32(0)
                xsum = float32(0)
                gi = i // g
                end = (gi + 1) * g
            xi = x[uint64(i)]       # (unsigned: no wraparound of a negative index to compute)
            dot += xi * (_as_float(int32(int32(w >> (bits * t)) & mask | _TWO23_BITS)) - _TWO23)
            xsum += xi
            i += LANES
    return acc + float32(scale[o, gi]) * dot + float32(offset[o, gi]) * xsum


@cuda.jit(cache=True)
def q_gemv(x, codes, scale, offset, bits, n_in, g, y):
    """y [out] = x [n_in] @ W.T for a GpuQuant of 4- or 8-bit codes: codes in `repack`'s layout,
    scale and offset [out, n_in/g] (float16 or float32). Block (LANES, ROWS): a warp per output
    row, lane `lane` reading word `lane` of each tile, its inputs lane + LANES t. Per group each
    lane sums x q and x (dot, xsum) and adds s * dot + m * xsum when the group changes. Grid
    (row blocks, splits): split k sums the k-th share of the tiles (split-K); with 2 it adds
    into y, zeroed by the launcher."""
    lane, r = cuda.threadIdx.x, cuda.threadIdx.y
    o = cuda.blockIdx.x * ROWS + r
    tiles = codes.shape[1] // LANES
    share = (tiles + cuda.gridDim.y - 1) // cuda.gridDim.y
    first = cuda.blockIdx.y * share
    last = lesser(first + share, tiles)
    acc = float32(0)
    if o < codes.shape[0]:          # (no return: every thread must reach _warp_sum)
        if bits == 4:
            acc = _row_dot(x, codes, scale, offset, o, lane, first, last, n_in, g, 4)
        else:
            acc = _row_dot(x, codes, scale, offset, o, lane, first, last, n_in, g, 8)
    total = _warp_sum(acc, lane, r)
    if lane == 0 and o < codes.shape[0]:
        if cuda.gridDim.y == 1:
            y[o] = total
        else:               # two addends into 0: the same float sum in either order
            cuda.atomic.add(y, o, total)


@cuda.jit(cache=True)
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


@cuda.jit(cache=True)
def rmsnorm(x, w, eps, y):
    """y [T, H] = x / sqrt(mean(x**2) + eps) * w; one block per row."""
    t, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    part = cuda.shared.array(THREADS, float32)
    acc = float32(0)
    for i in range(tid, n, THREADS):
        acc += x[t, i] * x[t, i]
    inv = float32(1) / math.sqrt(block_reduce(part, tid, acc, False) / n + eps)
    for i in range(tid, n, THREADS):
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
        y[t, n, i] = x1 * c - x2 * s
        y[t, n, i + half] = x2 * c + x1 * s


@cuda.jit(cache=True)
def silu_mul(gu, y):
    """y [T, I] = silu(gate) * up of the fused gate/up output gu [T, 2I] (gate first)."""
    k = cuda.grid(1)
    T, I = y.shape
    if k < T * I:
        t, i = k // I, k % I
        g = gu[t, i]
        y[t, i] = g / (float32(1) + math.exp(lesser(-g, float32(88)))) * gu[t, I + i]


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


# -- attention over a float cache: flash-decoding ------------------------------------------------
# One block per query head would leave most of a GPU idle at batch 1 (a few dozen heads for 132
# SMs) and read a long context slowly; so the slots are cut into splits, a block per (head,
# split, query), each writing an unnormalized partial and its (max, sum), which a second kernel
# merges. Positions are device arrays: a CUDA graph replays the same launches as they change.

SPLIT_BLOCKS = 8 if SIM else 512       # blocks that fill a GPU (4 per SM of an H100's 132)
SPLIT_MIN = 16 if SIM else 64          # the fewest slots a split takes: less is all overhead
SPLIT_MAX = 64                          # the most splits (bounds the partials and the merge)


def attention_chunk(S: int, Q: int, T: int) -> int:
    """The slots a split takes, for T queries of Q heads over S slots: enough splits that
    Q * splits * T blocks fill the GPU (SPLIT_BLOCKS; a prompt's queries fill it alone), at
    most SPLIT_MAX, each of at least SPLIT_MIN slots. The launcher's splits: ceil(S / chunk)."""
    want = min(SPLIT_MAX, -(-SPLIT_BLOCKS // (Q * T)))
    return max(SPLIT_MIN, -(-S // want))


@cuda.jit(cache=True)
def attention_split(q, k, v, q_pos, k_pos, scale, window, chunk, probs, part, ml):
    """Flash-decoding's first pass: queries q [T, Q, D] at positions q_pos [T] over the cache
    buffers k, v [G, C, D] (float16 or float32), slots [0, S) of which hold positions k_pos
    [Gk, S] (Gk = G: a table per KV head, or 1: one for all; -1: free), in any order; window
    <= 0: none. Block (h, j, t) takes query t of head h over slots [j chunk, (j + 1) chunk):
    its warps take the slots in turn, a warp's lanes a slot's channels (a K row read at once),
    for the scores (-inf: hidden, its K row not read) into probs [T, Q, S]; then each thread
    takes channels d for sum_s exp(score_s - m) V[s, d] (m: the chunk's largest score; V rows
    read at once) and the weights' sum l. Writes the partial, unnormalized, into part
    [T, Q, splits, D] and (m, l) into ml [T, Q, splits, 2]."""
    h, j, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    lane, warp, warps = tid % LANES, tid // LANES, THREADS // LANES
    Q, D = q.shape[1], q.shape[2]
    G, S = k.shape[0], k_pos.shape[1]
    g = h // (Q // G)
    row = g if k_pos.shape[0] > 1 else 0
    qp = q_pos[t]
    lo, hi = j * chunk, lesser(S, (j + 1) * chunk)
    top = float32(-math.inf)
    for first in range(lo, hi, warps):   # as many turns for every warp: all call _warp_sum
        s = first + warp
        seen = s < hi and visible(k_pos[row, s], qp, window)
        acc = float32(0)
        if seen:
            for d in range(lane, D, LANES):
                acc += q[t, h, d] * float32(k[g, s, d])
        acc = _warp_sum(acc, lane, warp)
        if lane == 0 and s < hi:         # (lane 0 has the sum)
            e = acc * scale if seen else float32(-math.inf)
            probs[t, h, s] = e
            top = greater(top, e)
    buf = cuda.shared.array(THREADS, float32)
    m = block_reduce(buf, tid, top, True)   # (its barrier: every warp's scores are written)
    for d in range(tid, D, THREADS):
        acc, l = float32(0), float32(0)
        for s in range(lo, hi):
            e = probs[t, h, s]
            if e != -math.inf:           # (a hidden slot's V row is not read)
                p = math.exp(e - m)
                acc += p * float32(v[g, s, d])
                l += p
        part[t, h, j, d] = acc
        if d == 0:
            ml[t, h, j, 0] = m
            ml[t, h, j, 1] = l


@cuda.jit(cache=True)
def attention_combine(part, ml, out, stats):
    """Flash-decoding's merge: block (h, t) adds the splits' partials of query t, head h
    (part [T, Q, splits, D], (m, l) in ml [T, Q, splits, 2]): M = max_j m_j, L = sum_j l_j
    exp(m_j - M), out [T, Q, D] = sum_j part_j exp(m_j - M) / L (0: nothing visible); (M, L)
    into stats [T, Q, 2] for attention_scores."""
    h, t, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    splits, D = part.shape[2], part.shape[3]
    M = float32(-math.inf)
    for j in range(splits):
        M = greater(M, ml[t, h, j, 0])
    L = float32(0)
    if M != -math.inf:                   # (else exp(-inf - -inf): NaN)
        for j in range(splits):
            L += ml[t, h, j, 1] * math.exp(ml[t, h, j, 0] - M)
    for d in range(tid, D, THREADS):
        acc = float32(0)
        if L > 0:
            for j in range(splits):
                acc += part[t, h, j, d] * math.exp(ml[t, h, j, 0] - M)
            acc /= L
        out[t, h, d] = acc
    if tid == 0:
        stats[t, h, 0] = M
        stats[t, h, 1] = L


@cuda.jit(cache=True)
def attention_scores(probs, stats, score):
    """H2O: slot s < S of KV head g gets the weights of the T queries and the R = Q / G query
    heads of g added: score [G, C] += sum exp(probs [T, Q, S] - M) / L ((M, L): stats [T, Q, 2]).
    A thread per (g, s), its sum in a fixed order: no atomics, the same scores every run."""
    n = cuda.grid(1)
    T, Q, S = probs.shape
    G = score.shape[0]
    R = Q // G
    if n < G * S:
        g, s = n // S, n % S
        acc = float32(0)
        for t in range(T):
            for h in range(g * R, (g + 1) * R):
                e = probs[t, h, s]
                if e != -math.inf:
                    acc += math.exp(e - stats[t, h, 0]) / stats[t, h, 1]
        score[g, s] += acc


@cuda.jit(cache=True)
def q_dequantize(codes, scale, offset, bits, n_in, g, dst):
    """dst [n_in, out] (float16 or float32) = W.T of a GpuQuant (as q_gemv reads it), for a
    prompt's matmul; one
    thread per word: its 32 / bits inputs of one output, neighbouring threads at neighbouring
    outputs (their writes to a row of dst coalesce)."""
    n = cuda.grid(1)
    rows, words = codes.shape
    per = 32 // bits
    if n < rows * words:
        o, c = n % rows, n // rows
        w = codes[o, c]
        i = c // LANES * LANES * per + c % LANES
        for t in range(per):
            if i < n_in:
                q = float32((w >> (bits * t)) & ((1 << bits) - 1))
                dst[i, o] = q * float32(scale[o, i // g]) + float32(offset[o, i // g])
            i += LANES


def repack(codes: np.ndarray, bits: int, n_in: int, lanes: int) -> np.ndarray:
    """kernels.quant's codes of a layer (uint8 [out, n_in/2] for 4 bits, input 2j in the low
    nibble of byte j; [out, n_in] for 8) -> the GEMV's layout, int32 [out, tiles * lanes]:
    per = 32 // bits codes a word, a tile is `lanes` words (lanes * per inputs), tiles =
    ceil(n_in / (lanes * per)). Word `lane` of row o's tile j holds the inputs
    j*lanes*per + lane + lanes*t, t in range(per), at bits [bits*t, bits*(t+1)) (t = 0 lowest);
    inputs past n_in are code 0. So at each t a warp's lanes read `lanes` consecutive floats of
    x, and at each tile `lanes` consecutive words of the row: both loads coalesce."""
    per = 32 // bits
    tiles = -(-n_in // (lanes * per))
    q = np.zeros((codes.shape[0], tiles * lanes * per), np.uint32)
    if bits == 4:
        q[:, 0:n_in:2], q[:, 1:n_in:2] = codes & 15, codes >> 4
    else:
        q[:, :n_in] = codes
    q = q.reshape(-1, tiles, per, lanes) << (bits * np.arange(per, dtype=np.uint32))[:, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(-1, tiles * lanes).view(np.int32)


class GpuQuant(NamedTuple):
    """A quantized layer on the GPU (the projections that share an input side by side, along
    the output): kernels.quant's one form, 4- or 8-bit codes in `repack`'s layout."""

    codes: object        # int32 [out, tiles * lanes] (repack; bench counts its padding too:
                         # a tile's loads read it)
    scale: object        # float16 | float32 [out, n_in/g]
    offset: object       # as scale
    bits: int            # 4 or 8
    n_in: int            # inputs (the tiles may pad them)
    lanes: int           # words of a tile: the LANES the kernels launch with

    @property
    def group(self) -> int:
        return self.n_in // self.scale.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.n_in
