"""The quantized GEMV of a decode step (one token at batch 1: memory-bound), its layout of the
codes (`repack`, `GpuQuant`), and the dequantization of a layer for a prompt's GEMM.

Each kernel computes what kernels.quant computes (W = q * s + m per group), tested against it in
Numba's CUDA simulator. The GEMV is built for the GPU's instruction budget (below);
benchmarks/gpu_static.py counts the SASS of its inner loop (docs/GPU.md has the figures).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from .kernels import _warp_sum
from .primitives import LANES, ROWS, SIM, lesser

# A 4-bit GEMV must turn codes into multiply-adds as fast as memory delivers them: at an H100's
# 3.35 TB/s some 30 weights a clock on each SM, which issues 128 instructions a clock (4
# schedulers, 32 lanes): 4 instructions a weight. So the steady loop has no index division, no
# bounds test, no 64-bit index arithmetic, and a code costs 3 instructions: an AND, an FFMA to
# its weight and an FFMA into the sum.
#
# The AND leaves a code q at bit `at` of an int32 with a zero exponent: read as a float32, the
# denormal q 2**(at - 149), exactly (the GPU's FFMA takes denormals at full rate; no int-to-float
# conversion, which runs at 1/8 of it). One FFMA with s 2**(85 - at) and m 2**-64 gives the
# weight (q s + m) 2**-64, rounded once; the sum, 2**-64 of y, is scaled back at the end
# (exactly; s 2**85 is finite for any s below 2**43, and what the scaling down loses to
# denormals is below 2**-86 of y's units).
_DOWN = 64
if SIM:
    def _as_float(i):
        # (plain Python: the simulator's device functions swap module globals at every call,
        # and this one is called for every code)
        return np.int32(i).view(np.float32)
else:
    from numba.cuda import libdevice

    _as_float = libdevice.int_as_float


@cuda.jit(device=True, inline=True)
def _pow2(e):
    """2.0**e as a float32 (-127 < e < 128; a constant where e is)."""
    return _as_float(int32((127 + e) << 23))


def chunk(bits: int) -> int:
    """Inputs a lane reads at a time: an int64 of codes."""
    return 64 // bits


# x is read from shared memory, staged there SLAB tiles at a time: a lane reads its chunk's
# inputs (16 for 4-bit codes: 64 bytes) in 8-byte loads, and straight from L1 a warp's load
# would touch 16 cache lines (its lanes 64 bytes apart), 8 times the passes of 256 bytes read
# whole. In shared memory pair p of inputs sits at p + p // 16 (8 bytes left every 128): the
# lanes' loads fall on distinct banks, 2 passes for 256 bytes, the fewest. And a warp sums two
# output rows, each x load serving two codes: L1 gives 128 bytes a clock, and 30 weights a
# clock of one row would need 120 bytes of x.
SLAB = 8
ROWS_PER_WARP = 2
_XS4 = SLAB * (32 * 8 + 32 * 8 // 16)     # a slab's padded pairs at 32 lanes (the simulator's
_XS8 = SLAB * (32 * 4 + 32 * 4 // 16)     # fewer lanes use part of it)


@cuda.jit(device=True, inline=True)
def _padded(p):
    return p + p // 16


@cuda.jit(device=True, inline=True)
def _chunk_dot(acc, xs, p, v, s, m, bits):
    """acc + 2**-64 sum over the 64 / bits inputs whose pairs are at xs[p...] of x (q s + m), q
    the codes of the int64 v (input t at bits [bits t, bits (t + 1))): each half-word's codes
    read in place, at bits 0, bits, ... (a constant `bits` unrolls it all)."""
    m = m * _pow2(-_DOWN)
    s0 = s * _pow2(149 - _DOWN)         # s 2**(149 - 64 - at) at bit `at`: s0 2**-at
    down = _pow2(-bits)
    mask = (1 << bits) - 1
    for word in range(2):
        w = int32(v >> (32 * word))
        for hw in range(2):
            h = w >> (16 * hw)
            sa = s0
            for at in range(0, 16, 2 * bits):
                pair = xs[p]                # (inputs 2p and 2p + 1: one 8-byte load)
                a, b = _as_float(int32(pair)), _as_float(int32(pair >> 32))
                sb = sa * down
                acc += a * (_as_float(int32(h & (mask << at))) * sa + m)
                acc += b * (_as_float(int32(h & (mask << (at + bits)))) * sb + m)
                sa = sb * down
                p += np.uint64(1)
    return acc


@cuda.jit(device=True, inline=True)
def _stage(xs, x2, first, count, tid):
    """Pairs [first, first + count) of x into xs at _padded(q), 0 past its end (a tile across
    n_in reads zeros, so its padding codes add nothing; n_in is even here, a whole number of
    groups of whole chunks)."""
    for q in range(tid, count, LANES * ROWS):
        p = first + q
        xs[_padded(q)] = x2[p] if p < x2.shape[0] else 0


@cuda.jit(device=True, inline=True)
def _rows_dot(x, x2, codes, scale, offset, o0, o1, lane, first, last, n_in, g, shift, xs,
              bits):
    """2**-64 of lane `lane`'s parts of outputs o0 and o1 over tiles [first, last): chunk
    j LANES + lane of each, x staged SLAB tiles at a time (the whole block takes part: it
    waits at barriers). The loop's indices are uint32: an address is one 32-bit multiply-add,
    with no test for a negative index to wrap."""
    per = 64 // bits
    pairs = LANES * per // 2            # a tile's
    width = (n_in + LANES * per - 1) // (LANES * per) * LANES
    groups = (width * per + g - 1) // g     # (repack pads each row's groups to whole tiles)
    row0, row1 = uint32(o0 * width), uint32(o1 * width)
    grp0, grp1 = uint32(o0 * groups), uint32(o1 * groups)
    at_lane = uint32(_padded(lane * (per // 2)))
    sh = uint32(shift & 31)
    tid = cuda.threadIdx.y * LANES + lane
    acc0, acc1 = float32(0), float32(0)
    for s0 in range(first, last, SLAB):
        n = lesser(SLAB, last - s0)
        if s0 > first:
            cuda.syncthreads()          # every warp is done with the last slab
        _stage(xs, x2, s0 * pairs, n * pairs, tid)
        cuda.syncthreads()
        c = uint32(s0 * LANES + lane)
        end = uint32(c + n * LANES)
        p = at_lane
        while c < end:
            gi = np.right_shift(c, sh)  # (a 32-bit shift: Numba's >> is 64-bit)
            g0, g1 = uint32(grp0 + gi), uint32(grp1 + gi)
            acc0 = _chunk_dot(acc0, xs, np.uint64(p), codes[uint32(row0 + c)],
                              float32(scale[g0]), float32(offset[g0]), bits)
            acc1 = _chunk_dot(acc1, xs, np.uint64(p), codes[uint32(row1 + c)],
                              float32(scale[g1]), float32(offset[g1]), bits)
            c = uint32(c + LANES)
            p = uint32(p + _padded(pairs))
    return acc0, acc1


@cuda.jit(device=True, inline=True)
def _row_dot_bounded(x, codes, scale, offset, o, lane, first, last, n_in, g, bits):
    """2**-64 of lane `lane`'s part of output o over tiles [first, last), input by input, each
    of its own group: the slow path, for groups that do not hold whole chunks."""
    per = 64 // bits
    width = (n_in + LANES * per - 1) // (LANES * per) * LANES
    groups = (width * per + g - 1) // g
    acc = float32(0)
    if o >= codes.shape[0] // width:
        return acc
    for j in range(first, last):
        c = j * LANES + lane
        v = codes[o * width + c]
        for t in range(per):
            i = c * per + t
            if i < n_in:
                q = _as_float(int32((v >> (bits * t)) & ((1 << bits) - 1))) * _pow2(149 - _DOWN)
                gi = o * groups + i // g
                acc += x[i] * (q * float32(scale[gi]) + float32(offset[gi]) * _pow2(-_DOWN))
    return acc


@cuda.jit(device=True, inline=True)
def _q_gemv(x, x2, codes, scale, offset, n_in, g, shift, act, y, parts, arrived, xs, bits):
    lane, r = cuda.threadIdx.x, cuda.threadIdx.y
    n_out = y.shape[0]
    # A warp's two rows: outputs o and o + 1, or (act: a gated MLP's fused gate|up layer of 2
    # n_out rows) output o's gate and up rows, o and o + n_out.
    if act == 0:
        o = (cuda.blockIdx.x * ROWS + r) * ROWS_PER_WARP
        ra, rb, ok_a, ok_b, rows = o, o + 1, o < n_out, o + 1 < n_out, n_out
    else:
        o = cuda.blockIdx.x * ROWS + r
        ra, rb, ok_a, ok_b, rows = o, o + n_out, o < n_out, o < n_out, 2 * n_out
    per = 64 // bits
    tiles = (n_in + LANES * per - 1) // (LANES * per)
    share = (tiles + cuda.gridDim.y - 1) // cuda.gridDim.y
    first = cuda.blockIdx.y * share
    last = lesser(first + share, tiles)
    if shift >= 0:
        # every warp takes part in the staging: a warp past the last row reads the last row
        acc0, acc1 = _rows_dot(x, x2, codes, scale, offset, lesser(ra, rows - 1),
                               lesser(rb, rows - 1), lane, first, last, n_in, g, shift, xs,
                               bits)
    else:
        acc0 = _row_dot_bounded(x, codes, scale, offset, ra, lane, first, last, n_in, g, bits)
        acc1 = _row_dot_bounded(x, codes, scale, offset, rb, lane, first, last, n_in, g, bits)
    total0 = _warp_sum(acc0, lane, r) * _pow2(_DOWN)
    total1 = _warp_sum(acc1, lane, r) * _pow2(_DOWN)
    if cuda.gridDim.y == 1:
        if lane == 0:
            _write(y, act, o, total0, total1)
        return
    # Split-K: each split's block leaves its sums in parts, and the last of a row block's
    # splits to finish adds them up in split order (the same float sum whichever finished
    # last) and writes y. No zeroed y, so no launch before this one to zero it.
    if lane == 0 and ok_a:
        parts[cuda.blockIdx.y, ra] = total0
    if lane == 0 and ok_b:
        parts[cuda.blockIdx.y, rb] = total1
    cuda.threadfence()              # the sums reach L2 before the count says they are there
    cuda.syncthreads()
    done = cuda.shared.array(1, int32)
    if lane == 0 and r == 0:
        done[0] = cuda.atomic.add(arrived, cuda.blockIdx.x, 1) == cuda.gridDim.y - 1
    cuda.syncthreads()
    if done[0]:
        if lane == 0:
            _write(y, act, o, _split_sum(parts, ra) if ok_a else float32(0),
                   _split_sum(parts, rb) if ok_b else float32(0))
        if lane == 0 and r == 0:
            arrived[cuda.blockIdx.x] = 0        # ready for the next launch


@cuda.jit(device=True, inline=True)
def _split_sum(parts, o):
    """The splits' sums of row o in split order, read as atomics (from L2: another SM's
    writes, which this SM's L1 may hold stale from an earlier launch)."""
    total = float32(0)
    for k in range(cuda.gridDim.y):
        total += cuda.atomic.add(parts, (k, o), float32(0))
    return total


@cuda.jit(device=True, inline=True)
def _write(y, act, o, total0, total1):
    """A warp's outputs: its two rows' sums as outputs o and o + 1 (act 0), or output o as
    silu(gate) * up (1) or gelu(gate) * up (2, GELU's tanh form: Gemma's GeGLU)."""
    if act == 0:
        if o < y.shape[0]:
            y[o] = total0
        if o + 1 < y.shape[0]:
            y[o + 1] = total1
    elif o < y.shape[0]:
        if act == 1:
            gate = total0 / (float32(1) + math.exp(lesser(-total0, float32(88))))
        else:
            inner = float32(0.7978845608028654) * (total0 + float32(0.044715) * total0 * total0 * total0)
            gate = float32(0.5) * total0 * (float32(1) + math.tanh(inner))
        y[o] = gate * total1


@cuda.jit(cache=True)
def q4_gemv(x, x2, codes, scale, offset, n_in, g, shift, act, y, parts, arrived):
    """y [out] = x [n_in] @ W.T for a GpuQuant of 4-bit codes (its flat arrays); x2: x's int64
    view. Block (LANES, ROWS): a warp per two output rows, lane `lane` reading chunk `lane` of
    each tile (repack). Grid (row pairs' blocks, splits): split k sums the k-th share of the
    tiles (split-K) into parts [splits, >= W's rows] float32, and arrived [>= row blocks] int32
    (0 between launches, left 0) counts a row block's splits done. shift: group_shift's. act
    1 or 2: W is a gated MLP's gate|up, and y [out / 2] its activation (_write), a warp per
    output (its gate and up rows)."""
    xs = cuda.shared.array(_XS4, int64)
    _q_gemv(x, x2, codes, scale, offset, n_in, g, shift, act, y, parts, arrived, xs, 4)


@cuda.jit(cache=True)
def q8_gemv(x, x2, codes, scale, offset, n_in, g, shift, act, y, parts, arrived):
    """q4_gemv for 8-bit codes."""
    xs = cuda.shared.array(_XS8, int64)
    _q_gemv(x, x2, codes, scale, offset, n_in, g, shift, act, y, parts, arrived, xs, 8)


def group_shift(bits: int, g: int) -> int:
    """s where g = chunk(bits) 2**s (a chunk in one group, chunk c's group c >> s), else -1 (the
    slow path)."""
    r, per = g // chunk(bits), chunk(bits)
    return r.bit_length() - 1 if g % per == 0 and r & (r - 1) == 0 else -1


def width(bits: int, n_in: int, lanes: int) -> int:
    """int64s of codes in a row of repack's layout: whole tiles of `lanes`."""
    return -(-n_in // (lanes * chunk(bits))) * lanes


@cuda.jit(cache=True)
def q_dequantize(codes, scale, offset, bits, n_in, g, dst):
    """dst [n_in, out] (float16 or float32) = W.T of a GpuQuant, for a prompt's matmul: one
    thread per int64 of codes (its inputs of one output), neighbouring threads at neighbouring
    outputs (their writes to a row of dst coalesce)."""
    n = cuda.grid(1)
    out = dst.shape[1]
    per = 64 // bits
    chunks = codes.shape[0] // out
    groups = (chunks * per + g - 1) // g
    if n < codes.shape[0]:
        o, c = n % out, n // out
        v = codes[o * chunks + c]
        for t in range(per):
            i = c * per + t
            if i < n_in:
                q = float32((v >> (bits * t)) & ((1 << bits) - 1))
                gi = o * groups + i // g
                dst[i, o] = q * float32(scale[gi]) + float32(offset[gi])


def repack(w, lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A kernels.quant layer of one float scale and offset per group and 4- or 8-bit codes
    (quant.flat's) -> the GEMV's flat arrays: codes int64 [out * width]: each row's codes in
    input order, input i at bits [bits (i % per), bits (i % per + 1)) of int64 i // per (per =
    chunk(bits)), padded with code 0 to whole tiles of `lanes` int64s (a warp's lanes read a
    tile's neighbouring ones: 256 bytes at once); scale and offset [out * groups], each row's
    groups padded with 0 to the tiles' inputs."""
    out, n_in = w.shape
    g = w.group_size
    per = chunk(w.bits)
    cols = width(w.bits, n_in, lanes)
    codes = np.zeros((out, cols * 8), np.uint8)
    codes[:, :w.codes.shape[1]] = w.codes
    groups = -(-cols * per // g)
    scales = []
    for a in (w.scale, w.offset):
        padded = np.zeros((out, groups), a.dtype)
        padded[:, :a.shape[1]] = a
        scales.append(padded.reshape(-1))
    return codes.view(np.int64).reshape(-1), *scales


class GpuQuant(NamedTuple):
    """A quantized layer on the GPU (the projections that share an input side by side, along
    the output): kernels.quant's one form, 4- or 8-bit codes, in `repack`'s flat arrays."""

    codes: object        # int64 [out * width] (bench counts the tiles' padding too: their
                         # loads read it)
    scale: object        # float16 | float32 [out * groups] (groups padded to the tiles)
    offset: object       # as scale
    bits: int            # 4 or 8
    n_in: int            # inputs (the tiles may pad them)
    lanes: int           # int64s of a tile: the LANES the kernels launch with
    group: int           # inputs of a group

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] // width(self.bits, self.n_in, self.lanes), self.n_in
