"""Numba CUDA kernels for the decoder's per-token path (one token at batch 1, memory-bound).

Each kernel computes what its NumPy reference (kernels.reference, quant) computes, and is
tested against it on fresh random inputs in Numba's CUDA simulator, where CI runs them (no GPU
there). Arrays are torch tensors on the GPU, shared with the kernels without copies through
the CUDA array interface; in the simulator, torch tensors in host memory, which `_launch` hands
the kernels as NumPy views (the tests also give the launchers NumPy arrays). Kernels launch on
torch's current stream and are compiled once per machine (`cache=True`). Activations are float32; quantized
weights are read in the runtime's one form (kernels.quant), their codes as int32 words along
each output row (in tiles: `repack`), never dequantized to memory for a token. A quantized KV
cache (kernels.kv_quant) is written by one kernel, its pool's bookkeeping included, and read in
place by decode attention; its codes, scales and zeros are the reference's bit for bit.

Launch shapes are the `launch_*` helpers' business: the kernels take their arrays, the helpers
pick grid and block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
from numba import cuda, float32, int32, int64, types, uint8, uint64

from . import kv_quant, quant, reference


# Numba's CUDA simulator runs every CUDA thread as a Python thread: there, blocks are smaller
# (the same code: every kernel is written for any of these sizes)
_SIM = bool(numba.config.ENABLE_CUDASIM)
LANES = 4 if _SIM else 32      # threads per output row of a GEMV (a warp: neighbouring words of
                               # a row, 128 bytes at once)
ROWS = 2 if _SIM else 8        # output rows per block of a GEMV
THREADS = 8 if _SIM else 128   # threads per block of RMSNorm and of decode attention (a power
                               # of two: the block reductions halve it)
HALF_MAX = 65504.0   # the largest finite float16 (a float16 cache clamps to it, as the reference)
_TOP16 = np.float32(HALF_MAX)
_NEVER = np.iinfo(np.int64).max
MAX_CODES = 256      # the most codes in a row of a quantized cache: its block (slots per key
                     # channel) and its head dim (channels per value slot)

# code * scale + zero rounded twice, as kv_quant (NumPy) does: NVVM contracts a float32 multiply
# and add into one fused multiply-add unless each is rounded explicitly (libdevice's _rn forms,
# PTX mul.rn / add.rn, which are never fused), and a block reopened a rounding apart from the
# reference would drift from it. The simulator's NumPy float32 arithmetic rounds every step.
if _SIM:
    @cuda.jit(device=True)
    def _mul_rn(a, b):
        return a * b

    @cuda.jit(device=True)
    def _add_rn(a, b):
        return a + b
else:
    from numba.cuda import libdevice

    _mul_rn, _add_rn = libdevice.fmul_rn, libdevice.fadd_rn


# Numba's CUDA simulator has no warp shuffles (cuda.shfl_*_sync raise there): so the sum of a
# row's lanes is a device function chosen here, once, at import: on hardware the lanes' values
# move between registers (no shared memory, no barrier); in the simulator they go through shared
# memory. Both need every thread of the block to call it (a barrier, or a full-warp mask).
if _SIM:
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
if _SIM:
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
    last = _min(first + share, tiles)
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


# The kernels compare with `if` rather than call the builtins min and max: Numba 0.68's built-in
# CUDA target (deprecated for the numba-cuda package) fails to compile those builtins, and a test
# compiles every kernel to PTX with whichever target is installed.
@cuda.jit(device=True)
def _min(a, b):
    return a if a < b else b


@cuda.jit(device=True)
def _max(a, b):
    return a if a > b else b


@cuda.jit(device=True)
def _clip(x, lo, hi):
    return lo if x < lo else hi if x > hi else x


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
            part[tid] = _max(part[tid], other) if take_max else part[tid] + other
        cuda.syncthreads()
        stride //= 2
    result = part[0]
    cuda.syncthreads()
    return result


@cuda.jit(cache=True)
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
        y[t, i] = g / (float32(1) + math.exp(_min(-g, float32(88)))) * gu[t, I + i]


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
        k_buf[g, s, d] = _clip(k[t, g, d], -top, top)
        v_buf[g, s, d] = _clip(v[t, g, d], -top, top)


@cuda.jit(device=True)
def _visible(p, q_pos, window):
    """Whether a query at q_pos sees the slot holding position p (-1: free): causal, and inside
    the window (window <= 0: none)."""
    return p >= 0 and p <= q_pos and (window <= 0 or q_pos - p < window)


@cuda.jit(device=True)
def _softmax(probs, h, S, part, tid, top):
    """Query head h's scores probs[h, :S] (-inf: hidden; each thread's are every THREADS-th,
    their largest `top`) -> exp(score - the largest), in place; returns 1 / their sum (0: none
    visible). Every thread's weights are written when it returns."""
    top = _block_reduce(part, tid, top, True)
    total = float32(0)
    for s in range(tid, S, THREADS):
        e = probs[h, s]
        e = float32(0) if e == -math.inf else math.exp(e - top)
        probs[h, s] = e
        total += e
    total = _block_reduce(part, tid, total, False)
    cuda.syncthreads()           # every thread's probs written before any thread reads them all
    return float32(0) if total == 0 else float32(1) / total


@cuda.jit(device=True)
def _add_score(score, probs, g, h, S, tid, inv):
    """H2O: query head h's weights added to its KV head's scores score [G, C] (atomically: the
    R query heads of a KV head add to the same row); score [G, 0]: none kept."""
    if score.shape[1] > 0:
        for s in range(tid, S, THREADS):
            cuda.atomic.add(score, (g, s), probs[h, s] * inv)


# -- attention over a float cache: flash-decoding ------------------------------------------------
# One block per query head would leave most of a GPU idle at batch 1 (a few dozen heads for 132
# SMs) and read a long context slowly; so the slots are cut into splits, a block per (head,
# split, query), each writing an unnormalized partial and its (max, sum), which a second kernel
# merges. Positions are device arrays: a CUDA graph replays the same launches as they change.

SPLIT_BLOCKS = 8 if _SIM else 512       # blocks that fill a GPU (4 per SM of an H100's 132)
SPLIT_MIN = 16 if _SIM else 64          # the fewest slots a split takes: less is all overhead
SPLIT_MAX = 64                          # the most splits (bounds the partials and the merge)
SCORES_MAX = 2 ** 24                    # the most floats of scores [T, Q, S] one launch set keeps


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
    lo, hi = j * chunk, _min(S, (j + 1) * chunk)
    top = float32(-math.inf)
    for first in range(lo, hi, warps):   # as many turns for every warp: all call _warp_sum
        s = first + warp
        seen = s < hi and _visible(k_pos[row, s], qp, window)
        acc = float32(0)
        if seen:
            for d in range(lane, D, LANES):
                acc += q[t, h, d] * float32(k[g, s, d])
        acc = _warp_sum(acc, lane, warp)
        if lane == 0 and s < hi:         # (lane 0 has the sum)
            e = acc * scale if seen else float32(-math.inf)
            probs[t, h, s] = e
            top = _max(top, e)
    buf = cuda.shared.array(THREADS, float32)
    m = _block_reduce(buf, tid, top, True)   # (its barrier: every warp's scores are written)
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
        M = _max(M, ml[t, h, j, 0])
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


# -- the quantized KV cache (kernels.kv_quant: its layout and math) ------------------------------

@cuda.jit(device=True)
def _key(kc, ks, n, j, i, d, bits):
    """Channel d of slot i of row n's quantized block j: code * scale + zero, in float32,
    rounded as kv_quant rounds it (kc [N, C/B, D, W] codes in planes, ks [N, C/B, 2, D])."""
    W = kc.shape[3]
    c = (kc[n, j, d, i % W] >> (i // W * bits)) & ((1 << bits) - 1)
    return _add_rn(_mul_rn(float32(c), float32(ks[n, j, 0, d])), float32(ks[n, j, 1, d]))


@cuda.jit(device=True)
def _value(vc, vs, n, s, d, bits):
    """Channel d of slot s of row n's quantized values: code * scale + zero of its channel
    group (vc [N, C, W] codes in planes, vs [N, C, 2, D/Gv])."""
    W = vc.shape[2]
    g = d // (W * 8 // bits // vs.shape[3])
    c = (vc[n, s, d % W] >> (d // W * bits)) & ((1 << bits) - 1)
    return _add_rn(_mul_rn(float32(c), float32(vs[n, s, 0, g])), float32(vs[n, s, 1, g]))




@cuda.jit(device=True)
def _to_pool(x):
    """kv_quant.to_pool's clamp: a value as a float16 pool or cache can hold it (the float16
    rounding is the store's)."""
    return _clip(x, -_TOP16, _TOP16)


@cuda.jit(device=True)
def _scale_zero(x, sz, top):
    """kv_quant.quantize's scale (max - min) / top and zero (min) of the group x (float16, any
    stride) into sz [2] (float16); returns them as stored, in float32."""
    mn, mx = float32(math.inf), float32(-math.inf)
    for i in range(x.shape[0]):
        xi = float32(x[i])
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
    sz[0] = (mx - mn) / top
    sz[1] = mn + float32(0)          # kv_quant.quantize's zero: -0.0 and +0.0 give +0.0
    return float32(sz[0]), float32(sz[1])


@cuda.jit(device=True)
def _step(x, s, z):
    """kv_quant's rounding of x to a step of scale s from zero z, as a float: floor((x - z) / s
    + 1/2)."""
    return math.floor((x - z) / s + float32(0.5))


@cuda.jit(device=True)
def _code(x, s, z, top):
    """kv_quant.quantize's code of x (float16): _step clipped to [0, top], 0 where s is 0."""
    if s <= 0:
        return 0
    return int(_clip(_step(float32(x), s, z), 0, top))


@cuda.jit(device=True)
def _opened(c, s, z, half):
    """A code as opening its block wrote it into the pool: code * scale + zero as float16
    (half: a float16 scratch [1] that rounds it), in float32."""
    half[0] = _to_pool(_add_rn(_mul_rn(float32(c), s), z))
    return float32(half[0])


@cuda.jit(device=True)
def _requantize(x, old, sz, top, out):
    """kv_quant.requantize of one group: its values x (float16, any stride), the codes old it
    had (unpacked) on the grid sz [2] (float16 scale, zero; scale 0: none) -> its codes into
    out (unpacked), its grid into sz. Where a value still reads as its code opened it and every
    other value's step on the grid is a code, the grid stays, those values keep their codes and
    the others take their steps; else the group is quantized afresh (kv_quant.quantize)."""
    half = cuda.local.array(1, types.float16)
    s, z = float32(sz[0]), float32(sz[1])
    stay, kept = s > 0, False
    if stay:
        for i in range(x.shape[0]):
            xi = float32(x[i])
            if xi == _opened(old[i], s, z, half):
                kept = True
            else:        # a float comparison first: a NaN's step is no code
                u = _step(xi, s, z)
                if not (u >= 0 and u <= top):
                    stay = False
    if stay and kept:
        for i in range(x.shape[0]):
            xi = float32(x[i])
            out[i] = old[i] if xi == _opened(old[i], s, z, half) else int(_step(xi, s, z))
        return
    s, z = _scale_zero(x, sz, float32(top))
    for i in range(x.shape[0]):
        out[i] = _code(x[i], s, z, top)


@cuda.jit(device=True)
def _unpack(row, bits, codes):
    """A row of codes in planes (kv_quant.pack: byte w holds values w, w + W, ...) -> codes."""
    W = row.shape[0]
    for w in range(W):
        for p in range(8 // bits):
            codes[w + p * W] = (row[w] >> (p * bits)) & ((1 << bits) - 1)


@cuda.jit(device=True)
def _pack(codes, bits, row):
    W = row.shape[0]
    for w in range(W):
        byte = 0
        for p in range(8 // bits):
            byte |= codes[w + p * W] << (p * bits)
        row[w] = byte


@cuda.jit(device=True)
def _seal(kc, ks, vc, vs, fk, fv, n, e, j, bits, tid):
    """kv_quant.seal of row n's pool entry e, which holds block j, by the threads of a block:
    the keys per channel (a thread a channel: its B codes are one row of bytes), the values per
    slot and channel group (a thread a slot: its groups share bytes). Freeing the entry is the
    caller's."""
    B, D = fk.shape[2], fk.shape[3]
    top = (1 << bits) - 1
    Gv = D // vs.shape[3]
    old = cuda.local.array(MAX_CODES, uint8)     # a row's codes, unpacked: as sealed before,
    new = cuda.local.array(MAX_CODES, uint8)     # and as sealed now
    for d in range(tid, D, THREADS):
        _unpack(kc[n, j, d], bits, old)
        _requantize(fk[n, e, :, d], old, ks[n, j, :, d], top, new)
        _pack(new, bits, kc[n, j, d])
    for i in range(tid, B, THREADS):
        s = j * B + i
        _unpack(vc[n, s], bits, old)
        for g in range(vs.shape[3]):
            _requantize(fv[n, e, i, g * Gv:(g + 1) * Gv], old[g * Gv:(g + 1) * Gv], vs[n, s, :, g],
                        top, new[g * Gv:(g + 1) * Gv])
        _pack(new, bits, vc[n, s])
    cuda.syncthreads()           # every code written before the entry takes another block


@cuda.jit(device=True)
def _free_entry(owner, stamp, pin, n):
    """kv_quant._open's choice of a pool entry for a quantized block of row n: the first free
    one, else the least recently written one past the pinned blocks (its block to be sealed)."""
    P = owner.shape[1]
    for i in range(P):
        if owner[n, i] < 0:
            return i
    e, oldest = 0, _NEVER        # (as np.argmin over the stamps, int64's largest where not eligible)
    for i in range(P):
        if owner[n, i] >= pin and stamp[n, i] < oldest:
            e, oldest = i, stamp[n, i]
    return e


@cuda.jit(cache=True)
def store_kv_q(kc, ks, vc, vs, fk, fv, where, owner, stamp, pin, slots, k, v):
    """kv_quant.store_kv on the device, its bookkeeping included (no step leaves the device):
    k, v float32 [T, N, D] -> row n's slots slots[n] ([N, T]) of a quantized cache (kc..stamp:
    a kv_quant.QuantKV's arrays, pin its pinned blocks). One block per row, walking its tokens
    in order: thread 0 finds the slot's block in the pool, or picks the entry to open it in;
    all threads seal the block that entry held, dequantize the slot's block into it and write
    the row (float16, clamped to the finite range); thread 0 updates where, owner and stamp."""
    n, tid = cuda.blockIdx.x, cuda.threadIdx.x
    T, D = k.shape[0], k.shape[2]
    P, B = fk.shape[1], fk.shape[2]
    bits = vc.shape[2] * 8 // D
    plan = cuda.shared.array(3, int64)       # the entry, the block to seal there (-1: none),
    for t in range(T):                       # whether to open the slot's block
        s = slots[n, t]
        j = s // B
        if tid == 0:
            e = where[n, j]
            plan[1], plan[2] = -1, 0
            if e < 0:
                e = _free_entry(owner, stamp, pin, n)
                plan[1], plan[2] = owner[n, e], 1
            plan[0] = e
        cuda.syncthreads()
        e, sealed, opening = plan[0], plan[1], plan[2]
        if sealed >= 0:
            _seal(kc, ks, vc, vs, fk, fv, n, e, sealed, bits, tid)
        if opening:
            for u in range(tid, B * D, THREADS):
                i, d = u // D, u % D
                fk[n, e, i, d] = _to_pool(_key(kc, ks, n, j, i, d, bits))
                fv[n, e, i, d] = _to_pool(_value(vc, vs, n, j * B + i, d, bits))
            cuda.syncthreads()   # the block's rows written before the new row overwrites one
        if tid == 0:
            if sealed >= 0:
                where[n, sealed] = -1
            where[n, j], owner[n, e] = e, j
            last = stamp[n, 0]
            for i in range(1, P):
                if stamp[n, i] > last:
                    last = stamp[n, i]
            stamp[n, e] = last + 1
        for d in range(tid, D, THREADS):
            fk[n, e, s % B, d] = _to_pool(k[t, n, d])
            fv[n, e, s % B, d] = _to_pool(v[t, n, d])
        cuda.syncthreads()       # the row written before a later token's seal reads the entry


@cuda.jit(cache=True)
def dequantize_kv(kc, ks, vc, vs, fk, fv, where, k_out, v_out):
    """kv_quant.dequantize: slots [0, S) of every row of a quantized cache (a QuantKV's first
    arrays) as float32 k_out, v_out [N, S, D]; one thread per element."""
    x = cuda.grid(1)
    N, S, D = k_out.shape
    if x < N * S * D:
        n, s, d = x // (S * D), x // D % S, x % D
        B = fk.shape[2]
        j, i = s // B, s % B
        e = where[n, j]
        if e >= 0:
            k_out[n, s, d] = float32(fk[n, e, i, d])
            v_out[n, s, d] = float32(fv[n, e, i, d])
        else:
            bits = vc.shape[2] * 8 // D
            k_out[n, s, d] = _key(kc, ks, n, j, i, d, bits)
            v_out[n, s, d] = _value(vc, vs, n, s, d, bits)


@cuda.jit(cache=True)
def attention_decode_q(q, kc, ks, vc, vs, fk, fv, where, q_pos, k_pos, scale, window, score,
                       probs, out):
    """One query per head q [Q, D] at position q_pos over a quantized cache of G rows (kc..where:
    a QuantKV's first arrays), slots [0, S) of which hold positions k_pos [G, S] (-1: free);
    window <= 0: none. One block per query head: its threads take every THREADS-th slot for the
    scores (kept in probs [Q, S]), the block their softmax, then each thread sums the weighted
    V rows for its share of the D columns; score [G, C] (empty [G, 0]: none) gets each slot's
    weight added; out [Q, D]. The cache is read in place, no float copy of it: a slot of a block
    in the float pool from fk, fv, one of a quantized block from its codes (a key from its
    channels' codes, scales and zeros, a value from its slot's codes and group scales)."""
    h, tid = cuda.blockIdx.x, cuda.threadIdx.x
    Q, D = q.shape
    G, S = k_pos.shape
    B = fk.shape[2]
    bits = vc.shape[2] * 8 // D
    g = h // (Q // G)
    part = cuda.shared.array(THREADS, float32)
    top = float32(-math.inf)
    for s in range(tid, S, THREADS):
        e = float32(-math.inf)
        if _visible(k_pos[g, s], q_pos, window):
            j, i = s // B, s % B
            entry = where[g, j]
            e = float32(0)
            if entry >= 0:
                for d in range(D):
                    e += q[h, d] * float32(fk[g, entry, i, d])
            else:
                for d in range(D):
                    e += q[h, d] * _key(kc, ks, g, j, i, d, bits)
            e *= scale
        probs[h, s] = e
        top = _max(top, e)
    inv = _softmax(probs, h, S, part, tid, top)
    for d in range(tid, D, THREADS):
        acc = float32(0)
        for s in range(S):
            p = probs[h, s]
            if p > 0:            # (a hidden slot's codes are not read)
                entry = where[g, s // B]
                if entry >= 0:
                    acc += p * float32(fv[g, entry, s % B, d])
                else:
                    acc += p * _value(vc, vs, g, s, d, bits)
        out[h, d] = acc * inv
    _add_score(score, probs, g, h, S, tid, inv)


def _blocks(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


def _size(a) -> int:
    """Elements of a NumPy array or a torch tensor (whose `size` is a method)."""
    return math.prod(a.shape)


_streams: dict = {}


def _launch(kernel, grid, block, *args) -> None:
    """Every launch, on torch's current stream: the GPU runs the kernels in torch's order, and
    a CUDA graph that torch captures sees them. Numba's CUDA simulator has no streams and takes
    NumPy arrays: there a torch tensor goes in as a NumPy view of its memory (the kernel's
    writes land in it), and the rest is the same code."""
    if _SIM:
        kernel[grid, block](*(a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray)
                              else a for a in args))
        return
    import torch

    handle = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = cuda.external_stream(handle)
    kernel[grid, block, stream](*args)


# Fewer row blocks than this and a GEMV splits each row's tiles in two halves, in two blocks
# (split-K): a GPU holds about 1000 blocks of 256 threads at once (8 on each of 132 SMs), and a
# layer of few outputs would leave SMs short of warps to hide memory latency with.
SPLIT_BELOW = 1024


def _lanes(w) -> None:
    if w.lanes != LANES:
        raise ValueError(f"codes tiled for {w.lanes} lanes, kernels launched with {LANES}")


def launch_q_gemv(x, w, y) -> None:
    """y [out] = x [in] @ W.T for a GpuQuant w; y a torch tensor or a NumPy array."""
    _lanes(w)
    rows = _blocks(w.shape[0], ROWS)
    splits = 2 if rows < SPLIT_BELOW and w.codes.shape[1] >= 2 * LANES else 1
    if splits == 2:
        # the halves are added into y atomically: 0 + a + b is the same float in either order,
        # so y is deterministic (with more splits it would not be). Torch zeroes it on its
        # current stream, before the kernel there.
        y[...] = 0
    _launch(q_gemv, (rows, splits), (LANES, ROWS), x, w.codes, w.scale, w.offset, w.bits,
            w.n_in, w.group, y)


def launch_gemv(x, w, y) -> None:
    _launch(gemv, _blocks(w.shape[0], ROWS), (LANES, ROWS), x, w, y)


def launch_rmsnorm(x, w, eps: float, y) -> None:
    _launch(rmsnorm, x.shape[0], THREADS, x, w, np.float32(eps), y)


def launch_rope(x, cos, sin, y) -> None:
    T, N, D = x.shape
    _launch(rope, _blocks(T * N * (D // 2), THREADS), THREADS, x, cos, sin, y)


def launch_silu_mul(gu, y) -> None:
    _launch(silu_mul, _blocks(y.shape[0] * y.shape[1], THREADS), THREADS, gu, y)


def launch_store_kv(k_buf, v_buf, slots, k, v) -> None:
    top = np.float32(HALF_MAX if str(k_buf.dtype).endswith("float16") else np.inf)   # numpy or torch
    _launch(store_kv, _blocks(_size(k), THREADS), THREADS, k_buf, v_buf, slots, k, v, top)


def launch_attention(q, k, v, q_pos, k_pos, scale: float, window: int, score, out, empty,
                     chunk: int | None = None) -> None:
    """out [T, Q, D] = attention of the queries q [T, Q, D] at positions q_pos [T] (int64) over
    a float cache k, v [G, C, D] whose slots [0, S) hold positions k_pos [Gk, S] (int64; Gk: G
    or 1); window 0: none; score [G, C] (H2O; [G, 0]: none) gets each slot's weights added.
    empty(shape) allocates float32 scratch on the device: the scores [T, Q, S] and the splits'
    partials, for queries in batches whose scores stay under SCORES_MAX floats (a long prompt).
    chunk: the slots a split takes (default: attention_chunk's)."""
    T, Q, D = q.shape
    G, S = k.shape[0], k_pos.shape[1]
    n = max(1, min(T, SCORES_MAX // max(1, Q * S), 65535))    # (65535: a grid's z limit)
    chunk = chunk or attention_chunk(S, Q, n)
    splits = _blocks(S, chunk)
    probs, part = empty((n, Q, S)), empty((n, Q, splits, D))
    ml, stats = empty((n, Q, splits, 2)), empty((n, Q, 2))
    for a in range(0, T, n):
        b = min(T, a + n)
        probs_b, part_b, ml_b, stats_b = (x[:b - a] for x in (probs, part, ml, stats))
        _launch(attention_split, (Q, splits, b - a), THREADS, q[a:b], k, v, q_pos[a:b], k_pos,
                np.float32(scale), window, chunk, probs_b, part_b, ml_b)
        _launch(attention_combine, (Q, b - a), THREADS, part_b, ml_b, out[a:b], stats_b)
        if score.shape[1] > 0:
            _launch(attention_scores, _blocks(G * S, THREADS), THREADS, probs_b, stats_b, score)


def launch_store_kv_q(store: kv_quant.QuantKV, slots, k, v) -> None:
    """kv_quant.store_kv of k, v [T, N, D] at slots [N, T] into the store's N rows."""
    if max(store.block, store.head_dim) > MAX_CODES:
        raise ValueError(f"a quantized cache's block and head dim must be at most {MAX_CODES}")
    _launch(store_kv_q, slots.shape[0], THREADS, *store[:-1], store.pin, slots, k, v)


def launch_dequantize_kv(store: kv_quant.QuantKV, k_out, v_out) -> None:
    N, S, D = k_out.shape
    _launch(dequantize_kv, _blocks(N * S * D, THREADS), THREADS, *store[:7], k_out, v_out)


def launch_attention_decode_q(q, store: kv_quant.QuantKV, q_pos: int, k_pos, scale: float,
                              window: int, score, probs, out) -> None:
    _launch(attention_decode_q, q.shape[0], THREADS, q, *store[:7], q_pos, k_pos,
            np.float32(scale), window, score, probs, out)


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


def launch_q_dequantize(w, dst) -> None:
    _lanes(w)
    _launch(q_dequantize, _blocks(_size(w.codes), THREADS), THREADS, w.codes, w.scale, w.offset,
            w.bits, w.n_in, w.group, dst)


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


class CudaBackend(reference.ReferenceBackend):
    """The decoder's ops on the kernels above. Device arrays are torch tensors on the GPU (the
    kernels read them through the CUDA array interface, no copies); in Numba's CUDA simulator
    torch tensors in host memory, so that the whole backend runs, slowly and as it does on a
    GPU, where there is none.
    Weights are uploaded once, at load: quantized layers as kernels.quant holds them, float
    weights as float16.
    Host inputs (positions, RoPE tables, the sinks' keys) are copied up where an op takes them.
    """

    name = "cuda"
    host_memory = False
    quantized_kv = True      # float16, float32 and kv_quant caches

    def __init__(self, cuda_graph: bool = True):
        import torch

        self.cuda_graph = cuda_graph     # decode steps replayed as a CUDA graph (tinyrt.device_decode)

        self.torch = torch
        # in Numba's CUDA simulator the tensors live in host memory, and `_launch` hands the
        # kernels NumPy views of them: the rest of the backend is the code the GPU runs
        self.device = "cpu" if _SIM else "cuda"
        self._types = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                       np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                       np.dtype(np.uint8): torch.uint8}

    # -- memory ----------------------------------------------------------------------------------

    def dev(self, a, dtype=np.float32):
        """A contiguous device tensor of `a` (host array or tensor) as `dtype`; a host array is
        copied."""
        t = self._types[np.dtype(dtype)]
        if isinstance(a, self.torch.Tensor):
            return a.to(device=self.device, dtype=t).contiguous()
        return self.torch.tensor(np.ascontiguousarray(a, dtype), device=self.device)

    def empty(self, shape, dtype=np.float32):
        return self.torch.empty(shape, dtype=self._types[np.dtype(dtype)], device=self.device)

    def zeros(self, shape, dtype=np.float32):
        return self.torch.zeros(shape, dtype=self._types[np.dtype(dtype)], device=self.device)

    def to_numpy(self, x) -> np.ndarray:
        """A host copy, of the same dtype (as the reference backend's arrays are)."""
        if isinstance(x, np.ndarray):
            return x
        return x.detach().to("cpu", copy=True).numpy()

    def _matmul(self, x, w_t):
        """x [T, in] @ w_t [in, out] on the device (cuBLAS through torch), in float32: a
        float16 GEMM overflows where activations pass 65504 (random-weight models do)."""
        return x @ w_t.float()

    # -- weights ---------------------------------------------------------------------------------

    def prepare_linear(self, parts: list):
        if all(isinstance(p, quant.QuantWeight) for p in parts):
            # one float scale and offset per group, 4- or 8-bit codes: the kernels' one layout
            w = quant.concat(parts)
            w = quant.flat(w, 4 if w.bits == 4 else 8)
            n_in = w.shape[1]
            return GpuQuant(self.dev(repack(w.codes, w.bits, n_in, LANES), np.int32),
                            self.dev(w.scale, w.scale.dtype), self.dev(w.offset, w.offset.dtype),
                            w.bits, n_in, LANES)
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
        if not isinstance(ids, self.torch.Tensor):
            ids = self.torch.as_tensor(np.asarray(ids, np.int64), device=self.device)
        return table[ids].float()

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
        return self._matmul(x, w.T)

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
        slots, k, v = self.dev(slots, np.int64), self.dev(k), self.dev(v)
        if isinstance(k_buf, kv_quant.QuantKV):
            launch_store_kv_q(k_buf, slots, k, v)
        else:
            launch_store_kv(k_buf, v_buf, slots, k, v)

    def _dequantized(self, store: kv_quant.QuantKV, n: int):
        """Slots [0, n) of a quantized cache as float32 device arrays k, v [N, n, D]."""
        N, D = store.where.shape[0], store.head_dim
        k, v = self.empty((N, n, D)), self.empty((N, n, D))
        launch_dequantize_kv(store, k, v)
        return k, v

    def read_kv(self, k_buf, v_buf, n):
        if isinstance(k_buf, kv_quant.QuantKV):
            return tuple(self.to_numpy(a) for a in self._dequantized(k_buf, n))
        return super().read_kv(k_buf, v_buf, n)

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None, score=None):
        """Flash-decoding over a float cache, a prompt's queries in one launch set (their own
        and later tokens' slots hidden by the causal mask); the positions uploaded once, k_pos
        with its own first dim (one table for all heads, or one per head). A quantized cache (k
        a QuantKV) is read in place for one query; for a prompt's, its slots are dequantized
        once into float32 buffers that the float kernels read."""
        q = self.dev(q)
        T, Q, D = q.shape
        quantized = isinstance(k, kv_quant.QuantKV)
        G, S = (k.where if quantized else k).shape[0], k_pos.shape[-1]
        k_pos = self.dev(k_pos, np.int64).reshape(-1, S)
        sc = self.zeros((G, 0)) if score is None else self.dev(score)
        out = self.empty((T, Q, D))
        if quantized and T == 1:
            launch_attention_decode_q(q[0], k, int(q_pos[0]), k_pos.expand(G, S).contiguous(),
                                      scale, window or 0, sc, self.empty((Q, S)), out[0])
        else:
            if quantized:
                k, v = self._dequantized(k, S)
            launch_attention(q, k, v, self.dev(q_pos, np.int64), k_pos, scale, window or 0, sc,
                             out, self.empty)
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
    from numba.cuda.cudadrv import nvvm

    if not nvvm.is_available():      # (the kernels compile through it; torch's wheels lack it)
        return ("Numba finds no libNVVM to compile the CUDA kernels with (torch's wheels do not "
                "ship it): install the CUDA toolkit, or set CUDA_HOME to one")
    return None
