"""The CPU's linear layers: quantized weights read as they are packed, float ones row by row.

A quantized layer (kernels.quant) is repacked once, at load, into simd's pair-planar tiles (all
projections that share an input fused into one layer). A GEMV rounds the activations to int16
(one scale per block of at most X_BLOCK inputs, inside one quantization group) and sums codes
times activations in integers (simd.tile_dot4 .. tile_dot8), then per block and output

    y[o] += s[g, o] * sx[b] * sum_{i in b} x_q[i] q[i, o]  +  m[g, o] * sx[b] * sum_{i in b} x_q[i]

A few tokens share each pass over a tile; a prompt runs the same sums as a GEMM (q_gemm). Each
token's outputs are those it gets alone, to the bit, whatever the number of tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from .. import quant
from . import simd
from .jit import prange_only

X_BLOCK = 128            # most inputs per int16 activation scale in a GEMV
GEMM_ACT_BYTES = 256 << 10   # a prompt GEMM's block of tokens' int16 activations (in L2)


class QLinear(NamedTuple):
    """A quantized layer (kernels.quant) in pair-planar tiles of simd.LANES outputs (see simd):
    the codes' low 4 bits in one plane of tiles, their high bits - 4 bits (if any) in a
    second; scales and offsets [tiles, n, LANES] in tiles alike, so a tile's codes, scales and
    offsets each lie in one piece. The last tile is padded with zeros. Arrays a layer does not
    have are empty ([tiles, 0, LANES])."""

    lo: np.ndarray       # int32 [tiles, in/8, LANES]: output LANES k + j's low bits in lo[k, :, j]
    hi: np.ndarray       # int32 [tiles, in*(bits-4)/32, LANES]: its high bits
    s: np.ndarray        # [tiles, in/(k g), LANES] scales: float32, or float16 bits as uint16
    sq: np.ndarray       # int8 [tiles, in/g, LANES] sub-scales, or empty
    m: np.ndarray        # [tiles, in/(k' g), LANES] offsets, as s, or empty (m = -zero * s)
    mq: np.ndarray       # int8 [tiles, in/g, LANES] offset sub-scales, or empty
    zero: int
    bits: int
    group: int           # inputs per group
    n_out: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_out, 8 * self.lo.shape[1]    # (out, in), as a float weight

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.lo, self.hi, self.s, self.sq, self.m, self.mq))


class Int8Rows(NamedTuple):
    """A float matrix [out, in] stored as int8 rows with one float32 scale per row."""

    q: np.ndarray        # int8 [out, in]
    s: np.ndarray        # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


# -- repacking, once at load ---------------------------------------------------------------------

@njit(parallel=prange_only(), cache=True)
def _tile_codes(codes, shift, bits, row0, dst):
    """Bits shift .. shift+bits-1 of codes uint8 [out, in] (one per byte) -> rows row0 .. row0+out
    of the pair-planar tiles dst int32 [tiles, in*bits/32, LANES] of those `bits`-bit values
    (each output's lane written once)."""
    out, n_in = codes.shape
    per = 32 // bits
    mask = (1 << bits) - 1
    for o in prange(out):
        k, j = (row0 + o) // simd.LANES, (row0 + o) % simd.LANES
        for r in range(n_in // per):
            word = np.uint32(0)
            for t in range(per):
                value = (np.uint32(codes[o, r * per + t]) >> np.uint32(shift)) & np.uint32(mask)
                word |= value << np.uint32(simd.pair_shift(t, bits))
            dst[k, r, j] = np.int32(word)


@njit(parallel=prange_only(), cache=True)
def _tile_nibbles(codes, row0, dst):
    """_tile_codes of 4-bit codes packed two per byte (kernels.quant's packing: input 2b in the
    low nibble of byte b, 2b + 1 in its high nibble) [out, in/2], without unpacking them: the
    4 bytes of 8 inputs hold the even inputs in their low nibbles and the odd in their high;
    the tile's word wants the even inputs' nibbles side by side in its low 16 bits and the odd
    inputs' in its high 16 (simd.pair_shift)."""
    out, n_bytes = codes.shape
    for o in prange(out):
        k, j = (row0 + o) // simd.LANES, (row0 + o) % simd.LANES
        for r in range(n_bytes // 4):
            u = (np.uint32(codes[o, 4 * r]) | (np.uint32(codes[o, 4 * r + 1]) << np.uint32(8))
                 | (np.uint32(codes[o, 4 * r + 2]) << np.uint32(16))
                 | (np.uint32(codes[o, 4 * r + 3]) << np.uint32(24)))
            even, odd = u & np.uint32(0x0F0F0F0F), (u >> np.uint32(4)) & np.uint32(0x0F0F0F0F)
            even = (even | (even >> np.uint32(4))) & np.uint32(0x00FF00FF)
            odd = (odd | (odd >> np.uint32(4))) & np.uint32(0x00FF00FF)
            even = (even | (even >> np.uint32(8))) & np.uint32(0xFFFF)
            odd = (odd | (odd >> np.uint32(8))) & np.uint32(0xFFFF)
            dst[k, r, j] = np.int32(even | (odd << np.uint32(16)))


def _planes_fit(bits: int, group: int) -> int:
    """The fewest code bits >= `bits` whose high plane (bits - 4 bits, 32 / (bits - 4) inputs
    per word) fills whole words within a group of `group` inputs."""
    for b in quant.BITS:
        if b >= bits and (b == 4 or group % (32 // (b - 4)) == 0) and group % 8 == 0:
            return b
    raise ValueError(f"groups of {group} inputs do not fill whole words of {bits}-bit codes")


def repack(parts: list) -> QLinear:
    """Quantized layers (quant.QuantWeight) that share an input -> one QLinear in the common form
    quant.concat gives them (exact), each part's codes tiled straight from its own rows."""
    code_bits, g, form = quant.fused_form(parts)
    out, n_in = sum(p.shape[0] for p in parts), parts[0].shape[1]
    bits = _planes_fit(code_bits, g)
    tiles = -(-out // simd.LANES)
    planes = [np.zeros((tiles, n_in * b // 32, simd.LANES), np.int32) for b in (4, bits - 4)]
    row0 = 0
    for p in parts:
        if p.bits == 4:                   # packed; no high bits
            _tile_nibbles(p.codes, row0, planes[0])
        else:
            for dst, shift, b in ((planes[0], 0, 4), (planes[1], 4, bits - 4)):
                _tile_codes(p.codes, shift, b, row0, dst)
        row0 += p.shape[0]
    floats = [a for a in (form["scale"], form["offset"]) if a is not None]
    dtype = np.result_type(*floats)          # one float type for both: fewer compiled variants

    def in_tiles(a, dtype):       # [out, n] -> [tiles, n, LANES], zeros after out; None: empty
        padded = np.zeros((tiles * simd.LANES, 0 if a is None else a.shape[1]), dtype)
        padded[:out] = 0 if a is None else a
        t = np.ascontiguousarray(padded.reshape(tiles, simd.LANES, -1).transpose(0, 2, 1))
        return t.view(np.uint16) if t.dtype == np.float16 else t

    return QLinear(*planes, in_tiles(form["scale"], dtype), in_tiles(form["scale_q"], np.int8),
                   in_tiles(form["offset"], dtype), in_tiles(form["offset_q"], np.int8),
                   form["zero"], bits, g, out)


@njit(parallel=prange_only(), cache=True, error_model="numpy")
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


# -- quantized linear ----------------------------------------------------------------------------

@njit(fastmath=True, cache=True, error_model="numpy")
def quantize_pairs(x, block, xp, sx, xsum):
    """x float32 [in] -> int16 activations in pairs, xp int32 [in/2] (input 2p in the low half of
    xp[p], 2p + 1 in the high half: xp's int16 view on a little-endian CPU), with one scale per
    block of `block` inputs, sx [in/block] = max|x| / 32767, and the sums of the quantized
    blocks, xsum = sx * sum(x_q). The loops index slices from 0: an index that could be
    negative makes Numba wrap it, and LLVM then gathers and scatters (7x slower)."""
    halves = xp.view(np.int16)
    top = np.float32(32767)
    for b in range(x.shape[0] // block):
        xb, hb = x[b * block:b * block + block], halves[b * block:b * block + block]
        m = np.float32(0)
        for i in range(block):
            m = simd.fmax(m, abs(xb[i]))
        scale = m / top if m > 0 else np.float32(1)
        inv = np.float32(1) / scale
        total = np.int32(0)
        for i in range(block):
            q = np.int32(np.rint(min(top, max(-top, xb[i] * inv))))
            hb[i] = np.int16(q)
            total += q
        sx[b] = scale
        xsum[b] = np.float32(total) * scale


@njit(cache=True)
def _activation_buffers(rows, n_in, group):
    """Zeroed buffers xp int32 [rows, n_in/2], sx, xsum float32 [rows, n_in/block] for
    quantize_pairs, and the block: at most X_BLOCK inputs, dividing the group size (a block
    never spans two quantization groups). Rows left zero give zero outputs."""
    block = math.gcd(group, X_BLOCK)
    return (block, np.zeros((rows, n_in // 2), np.int32),
            np.zeros((rows, n_in // block), np.float32), np.zeros((rows, n_in // block), np.float32))


@njit(fastmath=True, cache=True)
def _tile_dots(w, k, xp, sx, xsum, t, out, m):
    """simd's tile_dot of w's code width for the m tokens t .. t+m-1 (m = GEMM_TOKENS,
    FEW_TOKENS, 2 or 1). Spelled out: intrinsics are not values Numba can put in a table."""
    if m == simd.GEMM_TOKENS:
        if w.bits == 4:
            simd.gemm_dot4(w, k, xp, sx, xsum, t, out)
        elif w.bits == 5:
            simd.gemm_dot5(w, k, xp, sx, xsum, t, out)
        elif w.bits == 6:
            simd.gemm_dot6(w, k, xp, sx, xsum, t, out)
        else:
            simd.gemm_dot8(w, k, xp, sx, xsum, t, out)
    elif m == simd.FEW_TOKENS:
        if w.bits == 4:
            simd.few_dot4(w, k, xp, sx, xsum, t, out)
        elif w.bits == 5:
            simd.few_dot5(w, k, xp, sx, xsum, t, out)
        elif w.bits == 6:
            simd.few_dot6(w, k, xp, sx, xsum, t, out)
        else:
            simd.few_dot8(w, k, xp, sx, xsum, t, out)
    elif m == 2:
        if w.bits == 4:
            simd.pair_dot4(w, k, xp, sx, xsum, t, out)
        elif w.bits == 5:
            simd.pair_dot5(w, k, xp, sx, xsum, t, out)
        elif w.bits == 6:
            simd.pair_dot6(w, k, xp, sx, xsum, t, out)
        else:
            simd.pair_dot8(w, k, xp, sx, xsum, t, out)
    elif w.bits == 4:
        simd.tile_dot4(w, k, xp, sx, xsum, t, out)
    elif w.bits == 5:
        simd.tile_dot5(w, k, xp, sx, xsum, t, out)
    elif w.bits == 6:
        simd.tile_dot6(w, k, xp, sx, xsum, t, out)
    else:
        simd.tile_dot8(w, k, xp, sx, xsum, t, out)


@njit(fastmath=True, cache=True)
def _q_tiles(xp, sx, xsum, w, y, k0, k1):
    """Tiles k0 .. k1-1 of the GEMV of a QLinear w for T tokens' activations xp, sx, xsum
    [T, ...] (from quantize_pairs) into y [T, out]: FEW_TOKENS tokens at a time while there are
    as many left, then two, then one (_tile_dots: a tile's codes taken apart once for the
    tokens of a call). A tile stays in the L1 cache from one token to the next; each token's
    outputs are the same sums in the same order whatever T."""
    T, n_out = y.shape
    F, G = simd.FEW_TOKENS, simd.GEMM_TOKENS
    out = np.empty((G, simd.LANES), np.float32)
    for k in range(k0, k1):
        c0 = k * simd.LANES
        n = min(simd.LANES, n_out - c0)
        t = 0
        while t < T:
            m = G if T - t >= G else F if T - t >= F else min(2, T - t)
            _tile_dots(w, k, xp, sx, xsum, t, out, m)
            for i in range(m):
                for j in range(n):
                    y[t + i, c0 + j] = out[i, j]
            t += m


@njit(parallel=prange_only(), cache=True)
def q_gemv(x, w, y, threads):
    """y [T, out] = x [T, in] @ W.T for a few tokens and a QLinear w. The activations are
    quantized to int16 in blocks (_activation_buffers), so the inner loop is integer pairwise
    multiply-adds (simd); `threads` tasks take runs of tiles, each read from memory once for
    all the tokens."""
    T, n_in = x.shape
    block, xp, sx, xsum = _activation_buffers(T, n_in, w.group)
    for t in range(T):
        quantize_pairs(x[t], block, xp[t], sx[t], xsum[t])
    tiles = w.lo.shape[0]
    tasks = max(1, min(threads, tiles))
    step = (tiles + tasks - 1) // tasks
    for task in prange(tasks):
        _q_tiles(xp, sx, xsum, w, y, task * step, min(tiles, task * step + step))


@njit(parallel=prange_only(), cache=True)
def q_gemm(x, w, y, threads):
    """y [T, out] = x [T, in] @ W.T for a prompt and a QLinear w, in integers as q_gemv does it
    (each token's activations, sums and outputs are those of q_gemv), with a tile's codes taken
    apart once for GEMM_TOKENS tokens (_tile_dots). The tokens go in blocks whose
    activations fit in GEMM_ACT_BYTES (the L2 cache); in each, `threads` tasks take runs of
    tiles, a tile read from memory once per block and from L1 for its tokens."""
    T, n_in = x.shape
    n_out = y.shape[1]
    N = simd.GEMM_TOKENS
    padded = (T + N - 1) // N * N            # rows past T: zeros, outputs dropped
    block, xp, sx, xsum = _activation_buffers(padded, n_in, w.group)
    for t in prange(T):
        quantize_pairs(x[t], block, xp[t], sx[t], xsum[t])
    tiles = w.lo.shape[0]
    tasks = max(1, min(threads, tiles))
    step = (tiles + tasks - 1) // tasks
    rows = max(N, GEMM_ACT_BYTES // (2 * n_in) // N * N)
    for t0 in range(0, padded, rows):
        t1 = min(padded, t0 + rows)
        for task in prange(tasks):
            out = np.empty((N, simd.LANES), np.float32)
            for k in range(task * step, min(tiles, task * step + step)):
                c0 = k * simd.LANES
                n = min(simd.LANES, n_out - c0)
                for t in range(t0, t1, N):
                    _tile_dots(w, k, xp, sx, xsum, t, out, N)
                    for i in range(min(N, T - t)):
                        for j in range(n):
                            y[t + i, c0 + j] = out[i, j]


@njit(parallel=prange_only(), fastmath=True, cache=True)
def gemv_rows(x, w, s, y, nchunk):
    """y [T, out] = x [T, in] @ W.T for a few tokens, W = w [out, in] (float32, or int8 rows
    times their scales s [out]; s empty: none), read from memory once: four rows at a time, used
    for every token while they sit in L1 (BLAS's GEMM repacks the weights first, which costs two
    passes over them at T = 2..16: twice the time of T = 1). A row's dot with a token is the same
    sums in the same order whatever T and wherever the row falls (simd.rows_dot), so each token's
    outputs are those it gets alone, to the bit."""
    T, rows, n = x.shape[0], w.shape[0], w.shape[1]
    n16 = n // simd.LANES * simd.LANES
    scaled = s.shape[0] > 0
    F = simd.FEW_TOKENS
    step = ((rows + nchunk - 1) // nchunk + 3) // 4 * 4
    for ch in prange(nchunk):
        r, end = ch * step, min(rows, ch * step + step)
        dots = np.empty(4 * F, np.float32)
        while r < end:
            R = 4 if r + 4 <= end else 1
            t = 0
            while t < T:
                U = F if R == 4 and T - t >= F else 1    # FEW_TOKENS tokens a pass where they fit
                if U == F:
                    simd.rows_dot4_few(w, r, x, t, dots)
                elif R == 4:
                    simd.rows_dot4(w, r, x, t, dots)
                else:
                    simd.rows_dot1(w, r, x, t, dots)
                for u in range(U):
                    for j in range(R):
                        acc = dots[u * R + j]
                        for i in range(n16, n):
                            acc += x[t + u, i] * np.float32(w[r + j, i])
                        y[t + u, r + j] = acc * s[r + j] if scaled else acc
                t += U
            r += R


@njit(fastmath=True, cache=True)
def int8_dequantize(q, s, c0, c1, dst):
    """dst float32 [in, c1 - c0] = columns [c0, c1) of (q * s[:, None]).T. On one thread, on
    purpose: BLAS runs next, and OpenMP workers left spinning by a parallel loop would take its
    cores for milliseconds, slowing every prompt GEMM several times over."""
    for r in range(c1 - c0):
        row, scale = q[c0 + r], s[c0 + r]
        for i in range(q.shape[1]):
            dst[i, r] = np.float32(row[i]) * scale
