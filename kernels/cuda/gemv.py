"""The GEMV of a decode step (one token at batch 1: memory-bound), its layout of the weights
(`repack`, `GpuQuant`), and the dequantization of a layer for a prompt's GEMM.

One kernel for 4- and 8-bit codes (kernels.quant's one form: W = q * s + m per group) and for
float16 weights, each computing what the NumPy reference computes, tested against it in Numba's
CUDA simulator. Optionally the layer's RMSNorm runs before it in the same launch, and after it
a residual add (y = res + x W.T) or a gated MLP's activation.

Built for the memory's speed (docs/GPU.md; benchmarks/gpu_model.py models it):
- bytes in flight: a GPU hides the memory's latency (about 1 us under load, fitted to the first
  GPU run's profile) only with enough loads outstanding, ~25 KB an SM at an H200's 4.8 TB/s. A
  warp sums R rows and keeps the codes of the next DEPTH units loading while it sums one (R
  DEPTH 8 bytes a lane: 64; five blocks of 128 threads an SM: 40 KB), and a block's first units'
  loads leave before it stages x, so the staging's latency hides behind them.
- no tail: stream-K, the grid the blocks the GPU holds at once, each an equal run of the layer's
  units; a row block cut between blocks is summed by the last of them to finish (_flush).
- instructions: a 4-bit weight costs an AND (the code, read in place as a denormal float) and
  an FFMA into its row's sum: x is staged in shared memory once a block, each input scaled by
  the power of two that its code's bit position asks, so the group's scale and offset apply
  once a chunk of 16 inputs (s sum(x q) + m sum(x)); one x load serves R rows.
- no barrier after the staging, no division, 32-bit indices in the loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from .primitives import (LANES, SIM, block_reduce, inv_rms, lesser, silu, square_add,
                         warp_allsum, warp_allsums)

R = 4          # rows a warp sums at once (act: two outputs' gate and up rows)
DEPTH = 2      # tiles whose codes are loading while a warp computes one
WARPS = 2 if SIM else 4   # warps a block
BLOCKS_PER_SM = 5         # blocks an SM holds: at most 96 registers a thread (launch bounds)
PAD_ROWS = 2 * 4 * R      # (see repack)
FLUSH = True   # (False: benchmarks/gpu_static.py compiles a unit's hot path alone, to count it)
BLOCK = LANES * WARPS

# The sums run 2**-64 of y (scaled back at the end): a code q at bit `at` of a half-word, read
# as a float32, is the denormal q 2**(at - 149), exactly; staged x carries 2**(85 - at), so
# their product is x q 2**-64 with one rounding (the GPU's FFMA takes denormals at full rate;
# no int-to-float conversion, which runs at 1/8 of it). Float16 weights: the half's bits moved
# into a float32's read as the half times 2**-112, x staged times 2**48.
_DOWN = 64
if SIM:
    def _as_float(i):
        # (plain Python: the simulator's device functions swap module globals at every call,
        # and this one is called for every code)
        return np.int32(i).view(np.float32)

    def _as_int(x):
        return np.float32(x).view(np.int32)

    def _pack(a, b):
        return np.array([a, b], np.float32).view(np.int64)[0]
else:
    from numba.cuda import libdevice

    _as_float, _as_int = libdevice.int_as_float, libdevice.float_as_int

    @cuda.jit(device=True, inline=True)
    def _pack(a, b):
        return (int64(_as_int(a)) & 0xFFFFFFFF) | (int64(_as_int(b)) << 32)


@cuda.jit(device=True, inline=True)
def _pow2(e):
    """2.0**e as a float32 (-127 < e < 128; a constant where e is)."""
    return _as_float(int32((127 + e) << 23))


def chunk(bits: int) -> int:
    """Inputs a lane reads at a time: an int64 of codes (of float16 bits for bits 16)."""
    return 64 // bits


def stride(bits: int) -> int:
    """int64s a staged chunk takes in shared memory: its inputs in pairs, then its sum. (An odd
    number: the lanes' 8-byte loads fall on distinct banks.)"""
    return chunk(bits) // 2 + 1


def width(bits: int, n_in: int, lanes: int) -> int:
    """int64s of a row in repack's layout: whole tiles of `lanes` chunks."""
    return -(-n_in // (lanes * chunk(bits))) * lanes


def group_shift(bits: int, g: int) -> int:
    """s where g = chunk(bits) 2**s (a chunk in one group, chunk c's group c >> s), else -1 (the
    slow path)."""
    r, per = g // chunk(bits), chunk(bits)
    return r.bit_length() - 1 if g % per == 0 and r & (r - 1) == 0 else -1


# -- staging x -----------------------------------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _put(xs, at, v, bits):
    """A chunk's inputs v [chunk(bits)] into xs[at...] as the loop reads them: pairs scaled by
    their codes' bit positions (input t at bit bits (t % (16 / bits)) of its half-word), then
    the chunk's sum 2**-64 (float16 weights: scaled by 2**48, no sum)."""
    per = 64 // bits
    total = float32(0)
    for j in range(per // 2):
        a, b = v[2 * j], v[2 * j + 1]
        total += a + b
        if bits == 16:
            xs[at + j] = _pack(a * _pow2(112 - _DOWN), b * _pow2(112 - _DOWN))
        else:
            at_a, at_b = bits * ((2 * j) % (16 // bits)), bits * ((2 * j + 1) % (16 // bits))
            xs[at + j] = _pack(a * _pow2(149 - _DOWN - at_a), b * _pow2(149 - _DOWN - at_b))
    xs[at + per // 2] = _pack(total * _pow2(-_DOWN), float32(0))


@cuda.jit(device=True, inline=True)
def _stage(xs, x, norm_w, eps, first, last, n_in, part, bits):
    """x's inputs of tiles [first, last) into xs (_put's chunks, a stride apart), 0 past n_in
    (the tiles' padding codes then add nothing), the whole block taking part, each thread a
    chunk at a time (its loads issued together). Normed (norm_w not empty): x's RMSNorm over
    the whole row (a block reduction in part) times norm_w, in a second pass over the staged
    chunks."""
    tid = cuda.threadIdx.y * LANES + cuda.threadIdx.x
    per = 64 // bits
    st = per // 2 + 1
    lo, hi = first * LANES, last * LANES        # the block's chunks
    norm = norm_w.shape[0] > 0
    v = cuda.local.array(16, float32)
    ss = float32(0)
    begin, end = lo, hi
    if norm:                                # (every chunk of the row, for the norm's sum)
        begin, end = 0, max((n_in + per - 1) // per, hi)
    for c in range(begin + tid, end, BLOCK):
        for t in range(per):
            i = c * per + t
            v[t] = x[lesser(i, n_in - 1)] if i < n_in else float32(0)
            ss = square_add(ss, v[t])
        if lo <= c and c < hi:
            if norm:                        # (the raw inputs for now; normed below)
                for j in range(per // 2):
                    xs[(c - lo) * st + j] = _pack(v[2 * j], v[2 * j + 1])
            else:
                _put(xs, (c - lo) * st, v, bits)
    if not norm:
        return
    inv = inv_rms(block_reduce(part, tid, ss, False), n_in, eps)   # (its barriers: xs written)
    for c in range(lo + tid, hi, BLOCK):
        at = (c - lo) * st
        for j in range(per // 2):
            pair = xs[at + j]
            i = c * per + 2 * j
            v[2 * j] = _as_float(int32(pair)) * inv * norm_w[lesser(i, n_in - 1)]
            v[2 * j + 1] = _as_float(int32(pair >> 32)) * inv * norm_w[lesser(i + 1, n_in - 1)]
        _put(xs, at, v, bits)


# -- the weights' decoding -----------------------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _half_code(h, t, bits):
    """Input t of the half-word h (an int32 whose low 16 bits hold it, t < 16 / bits) as a
    float32 for a staged x (see _DOWN): a code q at bit `at` read in place (q 2**(at - 149)),
    or a float16's bits moved into a float32's (the half times 2**-112; sign, exponent and
    mantissa: a subnormal half is exact too)."""
    if bits == 16:
        return _as_float(int32(((h & 0x7FFF) << 13) | ((h & 0x8000) << 16)))
    return _as_float(int32(h & (((1 << bits) - 1) << (bits * t))))


@cuda.jit(device=True, inline=True)
def _code(w, t, bits):
    """Input t of the int64 w (the chunk's), as _half_code reads it."""
    per_half = 16 // bits
    return _half_code(int32(w >> (16 * (t // per_half))), t % per_half, bits)


@cuda.jit(device=True, inline=True)
def _w_row(r0, koff, k, n_out, gated):
    """W's row that slot k of a warp sums in the row block starting at r0: r0 + koff[k];
    gated (a compile-time constant: a run-time one here made LLVM load the codes of both kinds
    of rows and pick one), output o = r0 + koff[k]'s gate row (k even) or up row (n_out
    further), and past the last output, rows of repack's padding (2 o, 2 o + 1: never another
    output's row, whose sums a shared row block's parts would overwrite)."""
    o = r0 + koff[k]
    if not gated:
        return o
    return o + (k % 2) * n_out if o < n_out else 2 * o + k % 2


@cuda.jit(device=True, inline=True)
def _load(codes, scale, offset, koff, wid, groups, r0, c, shift, w, s, m, n_out, gated, bits,
          slow):
    """Into w, s, m: chunk c of the warp's R rows of the row block at r0 (_w_row), and the
    scale and offset of its group."""
    for k in range(R):
        r = uint32(_w_row(r0, koff, k, n_out, gated))
        w[k] = codes[uint32(r * wid + c)]
        if bits != 16 and not slow:             # (the slow path reads them as it goes)
            gi = uint32(r * groups + np.right_shift(c, uint32(shift)))   # (a 32-bit shift)
            s[k] = float32(scale[gi])
            m[k] = float32(offset[gi])


@cuda.jit(device=True)
def _pair(q, xs, p, w, word, hw, t, bits):
    """q[k] += the staged pair xs[p] times inputs t, t + 1 of half-word hw of int32 `word` of
    row k's int64 (float16 weights: the word's two halves), for the R rows."""
    pair = xs[p]
    a, b = _as_float(int32(pair)), _as_float(int32(pair >> 32))
    for k in range(R):
        h = int32(w[k] >> (32 * word))
        if bits == 16:
            q[k] += a * _half_code(h, 0, bits)
            q[k] += b * _half_code(h >> 16, 0, bits)
        else:
            h = h >> (16 * hw)
            q[k] += a * _half_code(h, t, bits)
            q[k] += b * _half_code(h, t + 1, bits)


@cuda.jit(device=True)
def _tile_dot(acc, xs, p, w, s, m, bits):
    """acc[k] += row k's part over one staged chunk (p: its first int64 in xs): s sum(x' q) +
    m sum(x) 2**-64, each staged pair read once for all R rows. The pairs one call each, with
    constants (a loop of 8 such would stay rolled: LLVM unrolls none so long)."""
    q = cuda.local.array(R, float32)
    for k in range(R):
        q[k] = float32(0)
    if bits == 4:
        _pair(q, xs, p, w, 0, 0, 0, 4)
        _pair(q, xs, p + np.uint64(1), w, 0, 0, 2, 4)
        _pair(q, xs, p + np.uint64(2), w, 0, 1, 0, 4)
        _pair(q, xs, p + np.uint64(3), w, 0, 1, 2, 4)
        _pair(q, xs, p + np.uint64(4), w, 1, 0, 0, 4)
        _pair(q, xs, p + np.uint64(5), w, 1, 0, 2, 4)
        _pair(q, xs, p + np.uint64(6), w, 1, 1, 0, 4)
        _pair(q, xs, p + np.uint64(7), w, 1, 1, 2, 4)
    elif bits == 8:
        _pair(q, xs, p, w, 0, 0, 0, 8)
        _pair(q, xs, p + np.uint64(1), w, 0, 1, 0, 8)
        _pair(q, xs, p + np.uint64(2), w, 1, 0, 0, 8)
        _pair(q, xs, p + np.uint64(3), w, 1, 1, 0, 8)
    else:
        _pair(q, xs, p, w, 0, 0, 0, 16)
        _pair(q, xs, p + np.uint64(1), w, 1, 0, 0, 16)
        for k in range(R):
            acc[k] += q[k]
        return
    sx = _as_float(int32(xs[p + np.uint64(32 // bits)]))
    for k in range(R):
        acc[k] += s[k] * q[k]            # (two statements: two FFMAs)
        acc[k] += m[k] * sx


# A block's progress through its units, in a local array (device functions cannot set their
# caller's variables): the unit summed next, its row block and tile; the row block and tile of
# the unit loading DEPTH ahead; the tile the row block's segment began at.
U_AT, U_RB, U_T, P_RB, P_T, SEG = range(6)


@cuda.jit(device=True)
def _unit(st, acc, xs, codes, scale, offset, koff, wid, groups, rows_rb, t_lo, t_hi, u1, shift,
          cur, nxt, g, y, res, act, parts, lens, arrived, tiles, bits, slow, gated):
    """One unit of a warp's loop: the codes of the unit DEPTH ahead start loading into nxt, the
    unit whose codes are in cur is summed into acc, and where it ends its row block's segment
    (the row block's last tile of the slab, or the block's last unit) the segment is flushed
    (_flush). st: the progress (U_AT...)."""
    lane, warp = cuda.threadIdx.x, cuda.threadIdx.y
    _load(codes, scale, offset, koff, wid, groups, st[P_RB] * rows_rb,
          uint32(st[P_T] * LANES + lane), shift, nxt[0], nxt[1], nxt[2], y.shape[0], gated,
          bits, slow)
    _next(st, t_lo, t_hi)
    t = st[U_T]
    at = np.uint64(((t - t_lo) * LANES + lane) * (32 // bits + 1))     # (its chunk in xs)
    if slow:
        _slow_dot(acc, xs, at, codes, scale, offset, koff, wid, groups, st[U_RB] * rows_rb,
                  uint32(t * LANES + lane), g, y.shape[0], gated, bits)
    else:
        _tile_dot(acc, xs, at, cur[0], cur[1], cur[2], bits)
    st[U_AT] += 1
    if FLUSH and (t + 1 == t_hi or st[U_AT] == u1):
        _flush(acc, st[U_RB], st[SEG], t + 1 - st[SEG], y, res, act, parts, lens, arrived,
               koff, rows_rb, tiles, warp, lane, gated)
        st[SEG] = t_lo
    st[U_T] = t + 1
    if st[U_T] == t_hi:
        st[U_T] = t_lo
        st[U_RB] += 1


@cuda.jit(device=True, inline=True)
def _next(st, t_lo, t_hi):
    """The unit loading moves on: its next tile, or its next row block's first."""
    st[P_T] += 1
    if st[P_T] == t_hi:
        st[P_T] = t_lo
        st[P_RB] += 1


@cuda.jit(device=True, inline=True)
def _flush(acc, rb, ta, n, y, res, act, parts, lens, arrived, koff, rows_rb, tiles, warp,
           lane, gated):
    """A warp's sums of row block rb over tiles [ta, ta + n) (acc, reset after): its outputs
    where that is the whole row; else its rows' parts at parts[ta], their count n at lens, and
    the row block's tiles counted at arrived (per warp: every warp of a block takes the same
    units): the warp that completes the row's tiles adds every segment's parts in tile order
    (the same floats whichever finished last), read as atomics (from L2: other SMs' writes,
    which this SM's L1 may hold stale), writes the outputs, and sets the count back to 0."""
    warp_row = rb * WARPS + warp
    r0 = rb * rows_rb
    warp_allsums(acc, R, lane, warp)
    for k in range(R):
        acc[k] *= _pow2(_DOWN)
    if n == tiles:
        if lane == 0:
            _write(y, act, warp_row, acc, res)
    else:
        at = warp_row * tiles
        done = float32(0)
        if lane == 0:
            for k in range(R):
                parts[ta, _w_row(r0, koff, k, y.shape[0], gated)] = acc[k]
            lens[at + ta] = n
            cuda.threadfence()      # the parts reach L2 before the count says they are there
            if cuda.atomic.add(arrived, warp_row, n) + n == tiles:
                done = float32(1)
        if warp_allsum(done, lane, warp) > 0 and lane == 0:     # (every lane calls the sum:
            t = 0                                               # the simulator's is a barrier)
            for k in range(R):
                acc[k] = float32(0)
            while t < tiles:
                for k in range(R):
                    r = _w_row(r0, koff, k, y.shape[0], gated)
                    acc[k] += cuda.atomic.add(parts, (t, r), float32(0))
                t += cuda.atomic.add(lens, at + t, 0)
            _write(y, act, warp_row, acc, res)
            arrived[warp_row] = 0               # ready for the next launch
    for k in range(R):
        acc[k] = float32(0)


@cuda.jit(device=True, inline=True)
def _q_gemv(x, norm_w, eps, res, codes, scale, offset, n_in, g, shift, act, y, parts, lens,
            arrived, slabs, bits, slow, gated):
    """Stream-K: the layer's work, units of one tile (a warp's R rows, a block's WARPS R) of a
    row block, cut evenly among the grid's blocks: slabs of the tiles (x staged a slab at a
    time: STAGED_BYTES) take gridDim.x / slabs blocks each, block j of a slab units [j U / P,
    (j + 1) U / P) of its U in row-block order. A row block a block covers whole is written
    at once; one cut between blocks (or slabs) is summed by the last of them (_flush). So the
    grid is the GPU's resident blocks once, each of about the same work, whatever the layer's
    shape (no wave of a few blocks left over)."""
    lane, warp = cuda.threadIdx.x, cuda.threadIdx.y
    n_out = y.shape[0]
    per = 64 // bits
    tiles = (n_in + LANES * per - 1) // (LANES * per)
    wid = tiles * LANES                      # int64s a row
    groups = (wid * per + g - 1) // g
    rows_rb = WARPS * R // 2 if gated else WARPS * R    # (gated: R / 2 outputs' gate and up)
    n_rb = (n_out + rows_rb - 1) // rows_rb
    share = (tiles + slabs - 1) // slabs
    blocks = cuda.gridDim.x // slabs
    slab, j = cuda.blockIdx.x // blocks, cuda.blockIdx.x % blocks
    t_lo = slab * share
    t_hi = lesser(t_lo + share, tiles)
    units = n_rb * (t_hi - t_lo)
    u0, u1 = j * units // blocks, (j + 1) * units // blocks
    if u0 >= u1:                             # (the whole block returns: no barrier waits)
        return
    koff = cuda.local.array(R, uint32)       # a warp's rows (act: outputs), from its block's
    for k in range(R):
        koff[k] = warp * R // 2 + k // 2 if gated else warp * R + k
    st = cuda.local.array(6, int32)
    st[U_AT], st[U_RB], st[U_T] = u0, u0 // (t_hi - t_lo), t_lo + u0 % (t_hi - t_lo)
    st[P_RB], st[P_T], st[SEG] = st[U_RB], st[U_T], st[U_T]
    # The first DEPTH units' codes start loading now, then each unit's leave DEPTH units ahead
    # of its sum: three buffers that take turns by name (the loop unrolled three times), so
    # that none is copied into another. (repack pads the rows past the last: a load past the
    # block's units, or the layer's, reads those.)
    b0 = (cuda.local.array(R, int64), cuda.local.array(R, float32), cuda.local.array(R, float32))
    b1 = (cuda.local.array(R, int64), cuda.local.array(R, float32), cuda.local.array(R, float32))
    b2 = (cuda.local.array(R, int64), cuda.local.array(R, float32), cuda.local.array(R, float32))
    for b in (b0, b1):
        _load(codes, scale, offset, koff, wid, groups, st[P_RB] * rows_rb,
              uint32(st[P_T] * LANES + lane), shift, b[0], b[1], b[2], n_out, gated, bits, slow)
        _next(st, t_lo, t_hi)
    xs = cuda.shared.array(0, int64)
    part = cuda.shared.array(BLOCK, float32)
    _stage(xs, x, norm_w, eps, t_lo, t_hi, n_in, part, bits)
    cuda.syncthreads()
    acc = cuda.local.array(R, float32)
    for k in range(R):
        acc[k] = float32(0)
    while True:
        _unit(st, acc, xs, codes, scale, offset, koff, wid, groups, rows_rb, t_lo, t_hi, u1,
              shift, b0, b2, g, y, res, act, parts, lens, arrived, tiles, bits, slow, gated)
        if st[U_AT] == u1:
            break
        _unit(st, acc, xs, codes, scale, offset, koff, wid, groups, rows_rb, t_lo, t_hi, u1,
              shift, b1, b0, g, y, res, act, parts, lens, arrived, tiles, bits, slow, gated)
        if st[U_AT] == u1:
            break
        _unit(st, acc, xs, codes, scale, offset, koff, wid, groups, rows_rb, t_lo, t_hi, u1,
              shift, b2, b1, g, y, res, act, parts, lens, arrived, tiles, bits, slow, gated)
        if st[U_AT] == u1:
            break
    if not FLUSH:                            # (the hot path's sums kept: see FLUSH)
        for k in range(R):
            y[k] = acc[k]


@cuda.jit(device=True, inline=True)
def _slow_dot(acc, xs, at, codes, scale, offset, koff, wid, groups, r0, c, g, n_out, gated,
              bits):
    """acc[k] += slot k's row's part (_w_row) over chunk c, input by input, each of its own
    group: the slow path, for groups that do not hold whole chunks (or not a power of two of
    them)."""
    per = 64 // bits
    for k in range(R):
        r = uint32(_w_row(r0, koff, k, n_out, gated))
        w = codes[uint32(r * wid + c)]
        for j in range(per // 2):
            pair = xs[at + j]
            for h in range(2):
                t = 2 * j + h
                xv = _as_float(int32(pair >> (32 * h)))
                gi = uint32(r * groups + (c * per + t) // g)
                # x' 2**(at - 149) (a denormal: bit `at`) is x 2**-64, the fast path's sums
                unit = _as_float(int32(1 << (bits * (t % (16 // bits)))))
                acc[k] += float32(scale[gi]) * (xv * _code(w, t, bits)) + \
                    float32(offset[gi]) * (xv * unit)


@cuda.jit(device=True, inline=True)
def _write(y, act, warp_row, acc, res):
    """A warp's outputs: its R rows' sums (act 0), plus res's (a residual: res not empty), or
    R / 2 outputs as silu(gate) * up (1) or gelu(gate) * up (2, GELU's tanh form: Gemma's
    GeGLU), rows past the end left out."""
    if act == 0:
        for k in range(R):
            o = warp_row * R + k
            if o < y.shape[0]:
                y[o] = res[o] + acc[k] if res.shape[0] > 0 else acc[k]
        return
    for k in range(R // 2):
        o = warp_row * (R // 2) + k
        if o < y.shape[0]:
            gate = acc[2 * k]
            if act == 1:
                gate = silu(gate)
            else:
                inner = float32(0.7978845608028654) * (gate + float32(0.044715) * gate * gate *
                                                       gate)
                gate = float32(0.5) * gate * (float32(1) + math.tanh(inner))
            y[o] = gate * acc[2 * k + 1]


def _kernel(bits: int, slow: bool, gated: bool):
    """The GEMV for `bits`-bit codes (16: float16 weights): slow, groups that do not hold whole
    chunks (or not a power of two of them: each input's group looked up); gated, a gated MLP's
    gate|up and its activation. Its arguments (x, norm_w, eps, res, codes, scale, offset, n_in,
    g, shift, act, y, parts, lens, arrived, slabs): y [out] = x [n_in] @ W.T for a GpuQuant (its
    flat arrays); block (LANES, WARPS): a warp sums R rows, lane `lane` reading chunk `lane` of
    each tile (repack); dynamic shared memory: a slab's tiles of x (launchers.gemv_grid sizes
    it); grid: `slabs` times the blocks a slab, each a share of the slab's units (_q_gemv);
    parts [>= tiles, >= W's rows] float32 and lens [>= row blocks WARPS tiles] int32 take the
    sums of a row block that blocks share, arrived [>= row blocks WARPS] int32 (0 between
    launches, left 0) counts its tiles summed. shift: group_shift's. act 1 or 2 (gated): y
    [out / 2] = silu or gelu of the gate rows' times the up rows' (_write). norm_w [n_in] (or
    empty): x RMS-normed with eps and times norm_w first. res [out] (or empty): y = res + x W.T
    (a residual add)."""
    def gemv(x, norm_w, eps, res, codes, scale, offset, n_in, g, shift, act, y, parts, lens,
             arrived, slabs):
        _q_gemv(x, norm_w, eps, res, codes, scale, offset, n_in, g, shift, act, y, parts, lens,
                arrived, slabs, bits, slow, gated)
    name = (f"q{bits}" if bits < 16 else "f16") + "_gemv" + "_gated" * gated + "_slow" * slow
    gemv.__name__ = gemv.__qualname__ = name        # (Numba's cache tells them apart)
    return cuda.jit(cache=True, **({} if SIM else {"launch_bounds": BOUNDS}))(gemv)


# (threads a block, blocks an SM): ptxas keeps the registers to what five blocks leave (65,536 /
# 640 threads: 96 of them; left to itself it takes 104, and four blocks hold 20 % less in flight)
BOUNDS = (LANES * WARPS, BLOCKS_PER_SM)


KERNELS = {(bits, slow, gated): _kernel(bits, slow, gated)
           for bits in (4, 8, 16) for slow in (False, True) for gated in (False, True)
           if not (slow and bits == 16)}


def named(name: str):
    """The kernel `name` of KERNELS (tests and benchmarks/gpu_static.py compile what a launch
    recorded: no module names)."""
    return next(k for k in KERNELS.values() if k.py_func.__name__ == name)


@cuda.jit(device=True, inline=True)
def _bf16_bits(x):
    """The bfloat16 nearest x (ties to even) as its 16 bits, in an int16's range (NaN aside)."""
    u = int64(_as_int(x)) & 0xFFFFFFFF
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u - ((u >> 15) << 16)


@cuda.jit(cache=True)
def q_dequantize(codes, scale, offset, bits, n_in, g, width, r0, bf16, dst):
    """dst [rows, n_in] = rows [r0, r0 + rows) of a GpuQuant's W (codes, scale, offset, bits,
    n_in, group g; `width` int64s a row), for a prompt's GEMM: float16 or float32 values, or
    (bf16 1) bfloat16's bits in an int16 array. One thread per int64 of codes that holds
    inputs (its `per` inputs of one row), neighbouring threads at a row's neighbouring int64s:
    their loads of the codes and their stores coalesce."""
    n = cuda.grid(1)
    rows = dst.shape[0]
    per = 64 // bits
    used = (n_in + per - 1) // per          # (int64s of a row past these are padding)
    groups = (width * per + g - 1) // g
    if n < rows * used:
        r, c = n // used, n % used
        o = r0 + r
        v = codes[o * width + c]
        for t in range(per):
            i = c * per + t
            if i < n_in:
                if bits == 16:
                    x = _code(v, t, 16) * _pow2(112)
                else:
                    gi = o * groups + i // g
                    x = float32((v >> (bits * t)) & ((1 << bits) - 1)) * float32(scale[gi]) \
                        + float32(offset[gi])
                if bf16:
                    dst[r, i] = _bf16_bits(x)
                else:
                    dst[r, i] = x


# repack's rows of zeros past the last of the GEMV's arrays (PAD_ROWS): a warp's loads run
# DEPTH units ahead of its sums, unchecked, into the next row block (the last block's past the
# layer's last), and the last row block's rows past the layer's are summed too (not written).


def repack(w, lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A kernels.quant layer of one float scale and offset per group and 4- or 8-bit codes
    (quant.flat's) -> the GEMV's flat arrays: codes int64 [out * width]: each row's codes in
    input order, input i at bits [bits (i % per), bits (i % per + 1)) of int64 i // per (per =
    chunk(bits)), padded with code 0 to whole tiles of `lanes` int64s (a warp's lanes read a
    tile's neighbouring ones: 256 bytes at once); scale and offset [out * groups], each row's
    groups padded with 0 to the tiles' inputs; then PAD_ROWS rows of zeros."""
    out, n_in = w.shape
    g = w.group_size
    per = chunk(w.bits)
    cols = width(w.bits, n_in, lanes)
    codes = np.zeros((out + PAD_ROWS, cols * 8), np.uint8)
    codes[:out, :w.codes.shape[1]] = w.codes
    groups = -(-cols * per // g)
    scales = []
    for a in (w.scale, w.offset):
        padded = np.zeros((out + PAD_ROWS, groups), a.dtype)
        padded[:out, :a.shape[1]] = a
        scales.append(padded.reshape(-1))
    return codes.view(np.int64).reshape(-1), *scales


def repack_f16(w: np.ndarray, lanes: int) -> np.ndarray:
    """Float weights [out, n_in] -> the GEMV's codes for bits 16: each row's float16 bits in
    input order, four to an int64, padded with zeros to whole tiles of `lanes` int64s; then
    PAD_ROWS rows of zeros."""
    out, n_in = w.shape
    rows = np.zeros((out + PAD_ROWS, width(16, n_in, lanes) * 4), np.float16)
    rows[:out, :n_in] = w
    return rows.view(np.int64).reshape(-1)


class GpuQuant(NamedTuple):
    """A layer on the GPU in the GEMV's layout (the projections that share an input side by
    side, along the output): kernels.quant's one form, 4- or 8-bit codes, or float16 weights
    (bits 16: no scale or offset), in `repack`'s flat arrays."""

    codes: object        # int64 [(out + PAD_ROWS) width]
    scale: object        # float16 | float32 [(out + PAD_ROWS) groups] (padded to the tiles); empty
    offset: object       # as scale                                         for float16 weights
    bits: int            # 4, 8 or 16
    n_in: int            # inputs (the tiles may pad them)
    lanes: int           # int64s of a tile: the LANES the kernels launch with
    group: int           # inputs of a group (float16 weights: n_in)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] // width(self.bits, self.n_in, self.lanes) - PAD_ROWS, self.n_in

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV of it reads (tinyrt.bench counts them): its rows' codes, their tiles'
        padding included, scales and offsets; not the PAD_ROWS rows."""
        out = self.shape[0]
        return sum(int(a.nbytes) * out // (out + PAD_ROWS)
                   for a in (self.codes, self.scale, self.offset))
