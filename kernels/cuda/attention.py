"""Attention over a float KV cache (float16 or float32): flash-decoding, one pass.

The slots the cache holds are cut into splits, a block per (KV head, split, query); the block
reads each K and V row once for all the query heads of its KV head (GQA: up to RQ of them a
block) and keeps a softmax that rescales as it goes (flash attention's), so scores never leave
registers; the last of a query's splits to finish merges their partials (an atomic count, as
the split-K GEMV's), so no second launch. What the first GPU run measured of the kernel this
replaced (62 us a layer at a context of ~80, latency-bound: a slot at a time, every thread
computing every exp, scores through global memory) drove the layout:

- a warp takes U slots at once, its lanes the channels (lane + LANES i: every row read in
  coalesced loads), all 2 U loads of K and V issued before any is used; the four warps of a
  block take turns over the split's slots, and their softmaxes merge in shared memory;
- a score is a warp's sum over its lanes (shuffles), then the same in every lane: each lane
  updates its channels' accumulators with no more traffic.

Positions are device arrays, and so is the number of slots held (`live`): a CUDA graph replays
the same launches as they change (the grid has the most splits; the kernel cuts the slots
held into them, and blocks past those return at once).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from .primitives import LANES, SIM, greater, lesser, visible, warp_allsums

WARPS = 2 if SIM else 4          # warps a block
BLOCK = LANES * WARPS
SPLIT_MIN = 8 if SIM else 32     # the fewest slots a split takes: fewer is all overhead
SPLIT_MAX = 64                   # the most splits (bounds the partials and the merge)


def _split_chunk(S, splits):
    """The slots a split takes, of S slots cut into at most `splits`: at least SPLIT_MIN."""
    chunk = (S + splits - 1) // splits
    return chunk if chunk > SPLIT_MIN else SPLIT_MIN


split_chunk = cuda.jit(device=True)(_split_chunk)


@cuda.jit(device=True)
def live_splits(S, live, chunk, splits):
    """What attention reads of a slot table of S: slots [0, n), the first live[0] (the slots
    the cache holds); the slots a split takes (chunk, or where it is 0 split_chunk's of n in
    `splits`); and how many splits hold them. One definition for the kernels that must agree."""
    n = lesser(S, live[0])
    if chunk <= 0:
        chunk = split_chunk(n, splits)
    return n, chunk, (n + chunk - 1) // chunk


def head_blocks(R: int, rq: int) -> int:
    """Blocks a KV head's R query heads take at rq a block."""
    return -(-R // rq)


def _kernel(RQ: int, CH: int, EXACT: bool):
    """attention_RQxCH (below): RQ query heads a block, CH channels a lane (D <= LANES CH, or
    EXACT: D = LANES CH, no channel tested); the sizes of its registers' and shared arrays are
    this closure's constants, as Numba needs."""
    U = 4 if RQ <= 4 else 2         # slots a warp at a time (registers: 2 U CH of K and V)
    QCH, UCH, RQU, WRQ = RQ * CH, U * CH, RQ * U, WARPS * RQ
    WA, FAC = WARPS * RQ * LANES * CH, RQ * SPLIT_MAX

    def attention(q, k, v, C, q_pos, k_pos, live, scale, window, chunk, probs, part, ml,
                  arrived, out, stats):
        gb, j, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        lane, warp = cuda.threadIdx.x, cuda.threadIdx.y
        tid = warp * LANES + lane
        Q, D = q.shape[1], q.shape[2]
        G = k.shape[0] // (C * D)
        R = Q // G
        HB = (R + RQ - 1) // RQ
        g, hb = gb // HB, gb % HB
        h0 = g * R + hb * RQ
        nh = lesser(RQ, R - hb * RQ)        # (the last block of a KV head's may have fewer)
        S, chunk, splits = live_splits(k_pos.shape[1], live, chunk, part.shape[2])
        if j >= splits:                     # (the whole block returns: no barrier waits)
            return
        row = g if k_pos.shape[0] > 1 else 0
        qp = q_pos[t]
        lo, hi = j * chunk, lesser(S, (j + 1) * chunk)
        qr, acc = cuda.local.array(QCH, float32), cuda.local.array(QCH, float32)
        m, l = cuda.local.array(RQ, float32), cuda.local.array(RQ, float32)
        for h in range(RQ):
            m[h], l[h] = float32(-math.inf), float32(0)
            for i in range(CH):
                d = lane + LANES * i
                qr[h * CH + i] = q[t, h0 + h, d] if h < nh and d < D else float32(0)
                acc[h * CH + i] = float32(0)
        kv, vv = cuda.local.array(UCH, float32), cuda.local.array(UCH, float32)
        seen = cuda.local.array(U, int32)
        sc = cuda.local.array(RQU, float32)
        # k, v flat, indexed unsigned (a signed index is tested for wrapping around at every
        # load), a lane's channels a constant apart (immediate offsets of one address)
        at_g = np.uint64(g * C * D + lane)
        for first in range(lo, hi, WARPS * U):    # (as many turns for every warp: in the
            base = first + warp * U                # simulator a warp's sum is a barrier)
            for u in range(U):              # every load of the U slots, then their use
                s = lesser(base + u, hi - 1)
                seen[u] = base + u < hi and visible(k_pos[np.uint64(row), np.uint64(s)], qp,
                                                    window)
                at = at_g + np.uint64(s * D)
                for i in range(CH):
                    if EXACT or lane + LANES * i < D:
                        kv[u * CH + i] = float32(k[at + np.uint64(LANES * i)])
                        vv[u * CH + i] = float32(v[at + np.uint64(LANES * i)])
                    else:
                        kv[u * CH + i] = vv[u * CH + i] = float32(0)
            for h in range(RQ):
                for u in range(U):
                    e = float32(0)
                    for i in range(CH):     # (a channel past D: its q is 0)
                        e += qr[h * CH + i] * kv[u * CH + i]
                    sc[h * U + u] = e
            warp_allsums(sc, RQU, lane, warp)
            for h in range(RQ):
                for u in range(U):
                    # (a hidden slot's K may be anything, NaN included: its score is -inf)
                    sc[h * U + u] = sc[h * U + u] * scale if seen[u] else float32(-math.inf)
            if probs.shape[2] > 0 and lane == 0:    # H2O: the raw scores, for its weights
                for h in range(RQ):
                    for u in range(U):
                        if h < nh and base + u < hi:
                            probs[t, h0 + h, base + u] = sc[h * U + u]
            for h in range(RQ):
                top = m[h]
                for u in range(U):
                    top = greater(top, sc[h * U + u])
                if top != -math.inf:        # (else exp(-inf - -inf): NaN)
                    alpha = math.exp(m[h] - top)
                    l[h] *= alpha
                    for i in range(CH):
                        acc[h * CH + i] *= alpha
                    for u in range(U):
                        p = math.exp(sc[h * U + u] - top)      # (0: a hidden slot)
                        l[h] += p
                        for i in range(CH):     # (a hidden slot's V may be anything too)
                            acc[h * CH + i] += p * vv[u * CH + i] if seen[u] else float32(0)
                    m[h] = top
        # the block's warps' softmaxes merged into the split's partial (unnormalized, with its
        # largest score and sum: part [T, Q, splits, D], ml [T, Q, splits, 2])
        # (one shared array a line: the simulator tells them apart by their lines)
        wm = cuda.shared.array(WRQ, float32)
        wl = cuda.shared.array(WRQ, float32)
        wa = cuda.shared.array(WA, float32)
        for h in range(RQ):
            if lane == 0:
                wm[warp * RQ + h], wl[warp * RQ + h] = m[h], l[h]
            for i in range(CH):
                wa[(warp * RQ + h) * LANES * CH + LANES * i + lane] = acc[h * CH + i]
        cuda.syncthreads()
        for x in range(tid, nh * D, BLOCK):
            h, d = x // D, x % D
            top = float32(-math.inf)
            for w in range(WARPS):
                top = greater(top, wm[w * RQ + h])
            a, total = float32(0), float32(0)
            if top != -math.inf:
                for w in range(WARPS):
                    f = math.exp(wm[w * RQ + h] - top)
                    a += wa[(w * RQ + h) * LANES * CH + d] * f
                    total += wl[w * RQ + h] * f
            part[t, h0 + h, j, d] = a
            if d == 0:
                ml[t, h0 + h, j, 0] = top
                ml[t, h0 + h, j, 1] = total
        # the last split of (t, g, hb) to finish merges them all (an atomic count, as the
        # split-K GEMV's)
        cuda.threadfence()          # the partials reach L2 before the count says they are there
        cuda.syncthreads()
        last = cuda.shared.array(1, int32)
        at = t * G * HB + gb
        if tid == 0:
            last[0] = cuda.atomic.add(arrived, at, 1) == splits - 1
        cuda.syncthreads()
        if last[0]:
            fac = cuda.shared.array(FAC, float32)
            tot = cuda.shared.array(WRQ, float32)
            _merge(part, ml, out, stats, t, h0, nh, splits, fac, tot, tid)
            if tid == 0:
                arrived[at] = 0             # ready for the next launch

    name = f"attention_{RQ}x{CH}{'' if EXACT else 'p'}"
    attention.__name__ = attention.__qualname__ = name      # (Numba's cache tells them apart)
    return cuda.jit(cache=True)(attention)


@cuda.jit(device=True, inline=True)
def _merge(part, ml, out, stats, t, h0, nh, splits, fac, tot, tid):
    """out [t, h0 + h] for h < nh from the splits' partials, in split order (the same floats
    whichever split finished last), read as atomics (from L2: other SMs' writes, which this
    SM's L1 may hold stale): M = max_j m_j, L = sum_j l_j exp(m_j - M), out = sum_j part_j
    exp(m_j - M) / L (0: nothing visible); (M, L) into stats. fac [nh SPLIT_MAX], tot [2 nh]:
    shared scratch."""
    D = part.shape[3]
    for h in range(tid, nh, BLOCK):
        top = float32(-math.inf)
        for jj in range(splits):
            top = greater(top, cuda.atomic.add(ml, (t, h0 + h, jj, 0), float32(0)))
        total = float32(0)
        for jj in range(splits):
            f = float32(0)
            if top != -math.inf:
                f = math.exp(cuda.atomic.add(ml, (t, h0 + h, jj, 0), float32(0)) - top)
            fac[h * SPLIT_MAX + jj] = f
            total += cuda.atomic.add(ml, (t, h0 + h, jj, 1), float32(0)) * f
        tot[2 * h], tot[2 * h + 1] = top, total
    cuda.syncthreads()
    for x in range(tid, nh * D, BLOCK):
        h, d = x // D, x % D
        a = float32(0)
        L = tot[2 * h + 1]
        if L > 0:
            for jj in range(splits):
                a += cuda.atomic.add(part, (t, h0 + h, jj, d), float32(0)) * \
                    fac[h * SPLIT_MAX + jj]
            a /= L
        out[t, h0 + h, d] = a
        if d == 0:
            stats[t, h0 + h, 0] = tot[2 * h]
            stats[t, h0 + h, 1] = L


# attention_RQxCH: out [T, Q, D] of the queries q [T, Q, D] (scaled by `scale`) at positions
# q_pos [T] over the cache buffers k, v [G, C, D] (flat: [G C D]), slots [0, S) of which hold
# positions k_pos [Gk, S] (Gk = G: a table per KV head, or 1: one for all; -1: free), in any
# order, the first live[0] read (live_splits, with chunk: 0, or the slots a split takes);
# window <= 0: none. Grid (G HB, splits, T), block (LANES, WARPS); RQ query heads a block
# (HB = R / RQ rounded up of each KV head's R), CH channels a lane. probs [T, Q, S] gets the
# raw scores (H2O), or is [T, Q, 0]; part [T, Q, splits, D] and ml [T, Q, splits, 2] the
# splits' partials; arrived [T G HB] int32 counts them (0 between launches, left 0); stats
# [T, Q, 2] gets the softmax's largest score and sum (attention_scores reads them).
_KERNELS: dict = {}


CH_MAX = 64 if SIM else 8          # a lane's channels: head dims up to 256 on a GPU

# Blocks of attention_RQxCH an SM holds (sm_90: 64K registers, 128 threads a block), from
# their registers (benchmarks/gpu_static.py reports them; tests/test_gpu_static.py holds the
# two together): the grid is one wave of them
BLOCKS_PER_SM = {(1, 4): 5, (2, 4): 4, (4, 4): 3, (8, 4): 2,
                 (1, 8): 4, (2, 8): 3, (4, 8): 3, (8, 8): 2}


def blocks_per_sm(rq: int, D: int) -> int:
    return BLOCKS_PER_SM[rq, 4 if D <= 4 * LANES else 8]


def kernel_for(R: int, D: int):
    """The kernel for R query heads a KV head and head dim D (made the first time): (kernel,
    RQ), RQ the query heads it takes a block (R rounded up to a power of two, at most 8)."""
    if D > LANES * CH_MAX:
        raise ValueError(f"attention kernels take head dims up to {LANES * CH_MAX}, not {D}")
    rq = 1 if R <= 1 else 2 if R <= 2 else 4 if R <= 4 else 8
    return _made((rq, -(-D // LANES), D % LANES == 0)), rq


def named(name: str):
    """The kernel `name` (attention_RQxCH, p: D not a multiple of LANES) of kernel_for's, made
    where it is not yet: those are no module names (tests and benchmarks/gpu_static.py compile
    what a launch recorded)."""
    rq, ch = name.removeprefix("attention_").rstrip("p").split("x")
    return _made((int(rq), int(ch), not name.endswith("p")))


def _made(key: tuple):
    """_kernel(*key), made once."""
    if key not in _KERNELS:
        _KERNELS[key] = _kernel(*key)
    return _KERNELS[key]


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
