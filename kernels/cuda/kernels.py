"""Numba CUDA kernels for the decoder's per-token path (one token at batch 1, memory-bound):
the float GEMV (the quantized one is gemv.py's), RMSNorm, RoPE, SiLU-mul, the float cache's
store and flash-decoding attention over it.

Each kernel computes what its NumPy reference (kernels.reference) computes, and is tested
against it in Numba's CUDA simulator. Activations are float32. Grids and blocks are the
launchers' business.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from .primitives import (LANES, NORM_THREADS, ROWS, SIM, THREADS, block_reduce, clip, greater,
                         lesser, rotate, square_add, visible)


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


@cuda.jit(device=True)
def _inv_rms(total, n, eps):
    """An RMSNorm's factor 1 / sqrt(total / n + eps) for n values whose squares sum to total."""
    return float32(1) / math.sqrt(total / n + eps)


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
    inv = _inv_rms(block_reduce(part, tid, acc, False), n, eps)
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
        inv = _inv_rms(block_reduce(part, tid, acc, False), D, eps)
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


# -- attention over a float cache: flash-decoding ------------------------------------------------
# One block per query head would leave most of a GPU idle at batch 1 (a few dozen heads for 132
# SMs) and read a long context slowly; so the slots are cut into splits, a block per (head,
# split, query), each writing an unnormalized partial and its (max, sum), which a second kernel
# merges. Positions are device arrays: a CUDA graph replays the same launches as they change.
# So is the number of slots the cache holds (`live`): the grid has the most splits, the kernels
# cut the slots held into them, and a block past those returns at once, so that a step's work
# follows what the cache holds and not its capacity.

SPLIT_BLOCKS = 8 if SIM else 512       # blocks that fill a GPU (4 per SM of an H100's 132)
SPLIT_MIN = 16 if SIM else 64          # the fewest slots a split takes: less is all overhead
SPLIT_MAX = 64                          # the most splits (bounds the partials and the merge)


def attention_splits(Q: int, T: int) -> int:
    """The grid's splits for T queries of Q heads: enough that Q * splits * T blocks fill the
    GPU (SPLIT_BLOCKS; a prompt's queries fill it alone), at most SPLIT_MAX."""
    return min(SPLIT_MAX, -(-SPLIT_BLOCKS // (Q * T)))


def _split_chunk(S, splits):
    """The slots a split takes, of S slots cut into at most `splits`: at least SPLIT_MIN."""
    chunk = (S + splits - 1) // splits
    return chunk if chunk > SPLIT_MIN else SPLIT_MIN


split_chunk = cuda.jit(device=True)(_split_chunk)


def attention_chunk(S: int, Q: int, T: int) -> int:
    """The slots a split takes, for T queries of Q heads over S slots held (the kernels' own
    choice where they are given none)."""
    return _split_chunk(S, attention_splits(Q, T))


@cuda.jit(device=True)
def live_splits(S, live, chunk, splits):
    """What attention reads of a slot table of S: slots [0, n), the first live[0] (the slots
    the cache holds); the slots a split takes (chunk, or where it is 0 split_chunk's of n in
    `splits`); and how many splits hold them. One definition for the kernels that must agree."""
    n = lesser(S, live[0])
    if chunk <= 0:
        chunk = split_chunk(n, splits)
    return n, chunk, (n + chunk - 1) // chunk


@cuda.jit(cache=True)
def attention_split(q, k, v, q_pos, k_pos, live, scale, window, chunk, probs, part, ml):
    """Flash-decoding's first pass: queries q [T, Q, D] at positions q_pos [T] over the cache
    buffers k, v [G, C, D] (float16 or float32), slots [0, S) of which hold positions k_pos
    [Gk, S] (Gk = G: a table per KV head, or 1: one for all; -1: free), in any order, the first
    live[0] of them read (live_splits, with chunk); window <= 0: none. Block (h, j, t) takes
    query t of head h over slots [j chunk, (j + 1) chunk), or returns if they hold none:
    its warps take the slots in turn, a warp's lanes a slot's channels (a K row read at once),
    for the scores (-inf: hidden, its K row not read) into probs [T, Q, S]; then each thread
    takes channels d for sum_s exp(score_s - m) V[s, d] (m: the chunk's largest score; V rows
    read at once) and the weights' sum l. Writes the partial, unnormalized, into part
    [T, Q, splits, D] and (m, l) into ml [T, Q, splits, 2]."""
    h, j, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    lane, warp, warps = tid % LANES, tid // LANES, THREADS // LANES
    Q, D = q.shape[1], q.shape[2]
    G = k.shape[0]
    S, chunk, splits = live_splits(k_pos.shape[1], live, chunk, part.shape[2])
    if j >= splits:                      # (the whole block returns: no barrier waits for it)
        return
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
def attention_combine(part, ml, S, live, chunk, out, stats):
    """Flash-decoding's merge: block (h, t) adds the partials of query t, head h of the splits
    attention_split wrote (live_splits of the same S, live and chunk; part [T, Q, splits, D],
    (m, l) in ml [T, Q, splits, 2]): M = max_j m_j, L = sum_j l_j exp(m_j - M), out [T, Q, D] =
    sum_j part_j exp(m_j - M) / L (0: nothing visible); (M, L) into stats [T, Q, 2] for
    attention_scores."""
    h, t, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    D = part.shape[3]
    splits = live_splits(S, live, chunk, part.shape[2])[2]
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
def attention_scores(probs, stats, live, score):
    """H2O: slot s < S of KV head g, of the first live[0] that attention read, gets the weights
    of the T queries and the R = Q / G query heads of g added: score [G, C] += sum exp(probs
    [T, Q, S] - M) / L ((M, L): stats [T, Q, 2]). A thread per (g, s), its sum in a fixed
    order: no atomics, the same scores every run."""
    n = cuda.grid(1)
    T, Q, S = probs.shape
    G = score.shape[0]
    R = Q // G
    if n < G * S and n % S < live[0]:
        g, s = n // S, n % S
        acc = float32(0)
        for t in range(T):
            for h in range(g * R, (g + 1) * R):
                e = probs[t, h, s]
                if e != -math.inf:
                    acc += math.exp(e - stats[t, h, 0]) / stats[t, h, 1]
        score[g, s] += acc
