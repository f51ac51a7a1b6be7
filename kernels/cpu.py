"""Numba CPU kernels and the backend that runs the decoder on them.

Decode at batch 1 reads every weight once per token, so quantized weights are read as they are
packed, never as a dequantized copy. A quantized layer (kernels.quant: codes of 4-8 bits, a scale
and an offset per group, each a float or a float times an int8, or an offset of -zero times
the scale) is repacked once, at load, into the pair-planar tiles of simd (all projections that
share an input fused into one layer): the codes' low 4 bits in one plane, their high bits in a
second; scales and offsets stay as they are stored. A GEMV rounds the activations to int16 (one
scale per block of at most X_BLOCK inputs, inside one quantization group) and sums codes times
activations in integers, 32 pairs per instruction (simd.tile_dot4 .. tile_dot8), then per block
and output

    y[o] += s[g, o] * sx[b] * sum_{i in b} x_q[i] q[i, o]  +  m[g, o] * sx[b] * sum_{i in b} x_q[i]

One token runs each decoder layer as one fused kernel call (decode_layer); GEMVs and decode
attention split their work among threads. A few tokens (up to SMALL_TOKENS: a draft's
verification) run the same GEMVs with each weight read from memory once for all of them, and
decode attention per token (a 4-bit model's through decode_layer too): each token's result is
what a one-token call of the same kernels gives it, to the bit.

Prompts (more than SMALL_TOKENS tokens) run the same integer sums as a GEMM (q_gemm): a
tile's codes are taken apart once for GEMM_TOKENS tokens, so the multiply-adds set the pace
(int16 pairs: twice the products per instruction of float32 FMA, and no float copy of the
layer), and each token's outputs are those a GEMV gives it, to the bit. Prompt
attention is blocked BLAS matmuls (attention_prompt). A float LM head of a quantized model is
quantized at load to int8 per row (see prepare_head); a prompt's pass over it (all logits:
perplexity) dequantizes tiles of it for BLAS.
Attention over the cache in decode, RMSNorm, RoPE and SiLU·mul are Numba loops. The KV cache
holds float16 (read as uint16 bits and converted in the loads) or float32.

Every kernel compiles with cache=True: the first run of a fresh install compiles them (tens of
seconds), later runs load machine code from the cache.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import NamedTuple

import numba
import numpy as np
from numba import njit, prange
from numba.core.errors import NumbaPerformanceWarning

from . import cores, cpu_kv, jit_cache, kv_quant, quant, reference, simd

jit_cache.guard()

SMALL_TOKENS = 16        # up to this many tokens (a draft's verification), layers run as GEMVs
                         # that read the weights once for all and attention as decode attention
                         # per token; above, quantized layers run as GEMMs (q_gemm)
PROMPT_BLOCK = 128       # queries per block of prompt attention
X_BLOCK = 128            # most inputs per int16 activation scale in a GEMV
GEMM_ACT_BYTES = 256 << 10   # a prompt GEMM's block of tokens' int16 activations (in L2)
DEQUANT_TILE_BYTES = 8 << 20   # an int8 head's dequantized tile in a prompt's GEMM

# Typing decode_layer's call of attention_decode warns (once, when the cache is cold) that a
# parallel function had nothing to parallelize; its prange does run in parallel (measured: one
# token at 2 threads takes 0.47x the time at 1).
warnings.filterwarnings("ignore", message=r"\s*The keyword argument 'parallel=True' was specified",
                        category=NumbaPerformanceWarning)


def _prange_only() -> dict:
    """Numba's parallel option with only prange loops run in parallel. With parallel=True Numba
    also turns every array expression, slice assignment and np.zeros of the function into a
    parallel region of its own: the small ones around the pranges (a head's row of the attention
    merge, a K/V row into the cache) each cost a thread launch, 27 us instead of 5 us for a
    one-slot decode attention. A fresh dict each time: Numba empties the one it is given."""
    return dict(comprehension=False, reduction=False, inplace_binop=False, setitem=False,
                numpy=False, stencil=False, fusion=False)


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

@njit(parallel=_prange_only(), cache=True)
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


@njit(parallel=_prange_only(), cache=True)
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


@njit(parallel=_prange_only(), cache=True, error_model="numpy")
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
    xp[p], 2p + 1 in the high half), with one scale per block of `block` inputs, sx [in/block]
    = max|x| / 32767, and the sums of the quantized blocks, xsum = sx * sum(x_q)."""
    for b in range(x.shape[0] // block):
        m = np.float32(0)
        for i in range(b * block, b * block + block):
            m = max(m, abs(x[i]))
        scale = m / np.float32(32767) if m > 0 else np.float32(1)
        inv = np.float32(1) / scale
        total = 0
        for i in range(b * block, b * block + block, 2):
            lo = min(32767, max(-32767, np.int32(np.round(x[i] * inv))))
            hi = min(32767, max(-32767, np.int32(np.round(x[i + 1] * inv))))
            xp[i // 2] = np.int32((lo & 0xFFFF) | (hi << 16))
            total += lo + hi
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
    FEW_TOKENS, 2 or 1)."""
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


@njit(parallel=_prange_only(), cache=True)
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


@njit(parallel=_prange_only(), cache=True)
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


@njit(parallel=_prange_only(), fastmath=True, cache=True)
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


# -- the small ops --------------------------------------------------------------------------------

@njit(fastmath=True, cache=True, inline="always")
def exp(x):
    """e**x for float32 x, relative error below 4e-7, in arithmetic that LLVM vectorizes (a loop
    calling np.exp makes one libm call per element): e**x = 2**n * e**f with n = round(x / ln 2)
    and |f| <= ln(2) / 2, e**f by its Taylor polynomial to degree 7. exp(-inf) = 0; inputs
    above 88 give e**88 (no inf)."""
    x = min(x, np.float32(88.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    f = (x - n * np.float32(0.693145751953125)) - n * np.float32(1.4286068203094173e-06)
    p = np.float32(1 / 5040)
    p = p * f + np.float32(1 / 720)
    p = p * f + np.float32(1 / 120)
    p = p * f + np.float32(1 / 24)
    p = p * f + np.float32(1 / 6)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1)
    p = p * f + np.float32(1)
    if x < np.float32(-87.3):                       # below float32's normal range (and -inf)
        return np.float32(0)
    return p * simd.float_from_bits(np.int32((np.int32(n) + 127) << 23))


@njit(fastmath=True, cache=True, error_model="numpy")
def rmsnorm(x, w, eps):
    """x [T, H], w [H] float32 -> [T, H] float32. (Numpy's error model, here and in every
    kernel that divides by data: a zero divisor, from activations that overflowed or an epsilon
    of 0, gives inf or NaN, which the sampler reports as a broken model, not an exception.)"""
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


@njit(fastmath=True, cache=True, error_model="numpy")
def _swiglu_row(gu, y):
    """y [I] = silu(gate) * up of one row gu [2I] (gate first). NumPy's error model: Numba's
    default checks every division for a zero divisor, a branch that keeps LLVM from vectorizing
    the loop (4 ns instead of 0.6 ns per element)."""
    I = y.shape[0]
    for i in range(I):
        g = gu[i]
        y[i] = g / (np.float32(1) + exp(-g)) * gu[I + i]


@njit(fastmath=True, cache=True)
def swiglu(gu):
    """gu [T, 2I] C-contiguous (the fused gate/up output, gate first) -> silu(gate) * up [T, I].
    On one thread: a prompt's BLAS calls come before and after (see int8_dequantize)."""
    T, I = gu.shape[0], gu.shape[1] // 2
    y = np.empty((T, I), np.float32)
    for t in range(T):
        _swiglu_row(gu[t], y[t])
    return y


ATTENTION_BLOCK = 256    # cache slots per block of decode attention


@njit(cache=True, inline="always")
def _hidden(p, q_pos, window):
    """Whether a slot holding position p is hidden from a query at q_pos (window <= 0: none).
    Without branches, so that a loop over slots vectorizes."""
    return (p < 0) | (p > q_pos) | ((window > 0) & (q_pos - p >= window))


@njit(fastmath=True, cache=True, inline="always")
def _row_score(q, h, k, row, Dv):
    """sum over d of q[h, d] * k[row, d] (k float16 bits or float32 rows): simd.cache_dot for
    the first Dv columns, a loop for the rest."""
    acc = simd.cache_dot(q, h, k, row, Dv)
    for d in range(Dv, q.shape[1]):
        acc += q[h, d] * simd.as_float(k[row, d])
    return acc


@njit(fastmath=True, cache=True)
def _softmax(scores, n, s0, s1, g, top, total, probs):
    """The scores [R, s1 - s0] of KV head g's R query heads over slots [s0, s1), of which the
    first n may be visible (hidden ones -inf), -> e**(score - top) in place, top[h] the
    largest, total[h] their sum (0 and a row of zeros where none is visible); probs (when
    not empty) [Q, S] gets the row."""
    R = scores.shape[0]
    keep = probs.shape[1] > 0
    for r in range(R):
        h, sr = g * R + r, scores[r]
        m = np.float32(-np.inf)
        for i in range(n):
            m = simd.fmax(m, sr[i])
        top[h] = m
        if keep:
            probs[h, s0 + n:s1] = 0
        if m == -np.inf:                 # no visible slot here
            total[h] = 0
            sr[:] = 0
            if keep:
                probs[h, s0:s1] = 0
            continue
        t = np.float32(0)
        for i in range(n):
            e = exp(sr[i] - m)           # 0 for a hidden slot, whose V row is still read
            sr[i] = e                    # below: harmless, cached values are finite (to_cache)
            t += e
        total[h] = t
        if keep:
            probs[h, s0:s0 + n] = sr[:n]


@njit(fastmath=True, cache=True)
def _add_rows(e, i0, v, row0, count, out, h, Dv):
    """out[h] += sum over k < count of e[i0 + k] * v[row0 + k] (v float16 bits or float32
    rows): simd.cache_axpy4 four rows at a time over the first Dv columns, loops for the rest."""
    k = 0
    while k + 4 <= count:
        simd.cache_axpy4(e, i0 + k, v, row0 + k, out, h, Dv)
        k += 4
    for k in range(k, count):
        x = e[i0 + k]
        for d in range(Dv):
            out[h, d] += x * simd.as_float(v[row0 + k, d])
    for k in range(count):
        x = e[i0 + k]
        for d in range(Dv, out.shape[1]):
            out[h, d] += x * simd.as_float(v[row0 + k, d])


@njit(fastmath=True, cache=True)
def _attention_slots(q, kg, vg, pg, o, q_pos, scale, window, s0, s1, g, R, out, top, total,
                     probs):
    """Softmax attention of one query per head q [Q, D] over the cache slots [s0, s1) of KV head
    g, not yet normalized, for the R query heads h that read it: top[h] = the largest score,
    total[h] = sum of e**(score - top), and out[h] [D] = sum of e**(score - top) * v; probs
    [Q, S] (when not empty) gets the e**(score - top). kg, vg: the head's keys and values, slot
    s in row s - o, float16 bits (uint16) or float32 [S - o, D]; pg [S] the positions the slots
    hold. The R heads read the rows while they are in cache; the vector parts are
    simd.cache_dot / cache_axpy4, the last D % LANES columns a loop."""
    D = q.shape[1]
    Dv = D - D % simd.LANES
    scores = np.empty((R, s1 - s0), np.float32)
    n = 0              # slots [s0, s0 + n) up to the last visible one: the sums below then
    for s in range(s0, s1):          # do not depend on hidden slots after it (to the bit)
        if _hidden(pg[s], q_pos, window):
            for r in range(R):
                scores[r, s - s0] = -np.inf
            continue
        n = s - s0 + 1
        for r in range(R):
            scores[r, s - s0] = _row_score(q, g * R + r, kg, s - o, Dv) * scale
    _softmax(scores, n, s0, s1, g, top, total, probs)
    for r in range(R):
        if total[g * R + r] > 0:
            _add_rows(scores[r], 0, vg, s0 - o, n, out, g * R + r, Dv)


@njit(fastmath=True, cache=True)
def _attention_qslots(q, kc, ks, vc, vs, fk, fv, where, q_pos, k_pos, scale, window, s0, s1, g,
                      out, top, total, probs):
    """_attention_slots over a quantized cache (kernels.kv_quant, float16 arrays as uint16 bits),
    read in place: a block in the float pool as float16 rows, a quantized one as its codes
    (cpu_kv.add_codes: each row of codes taken apart once for the R query heads, their sums in
    registers). Keys: score = sum_d (q_d scale_d) code[d, s] + sum_d q_d zero_d, for the B
    slots of a block at once (its codes lie by channel); values: out += (e scale) code per
    slot and channel group, the e zero parts summed per group and added at the end. A block
    with no visible slot is not read. The per-slot work is in loops over a block's slots
    that the compiler vectorizes: at a few thousand slots it costs as much as the codes do.
    s0 is a multiple of the block."""
    Q, D = q.shape
    G = where.shape[0]
    R = Q // G
    B = fk.shape[2]
    bits = vc.shape[2] * 8 // D
    NG = vs.shape[-1]                 # value groups per slot
    Gv = D // NG                      # channels per value group
    Dv = D - D % simd.LANES
    scores = np.empty((R, s1 - s0), np.float32)
    kb = np.empty((R, B), np.float32)
    wk = np.empty((R, D, 1), np.float32)
    sz = np.empty((2, max(B, D)), np.float32)
    wv = np.empty((R, B, NG), np.float32)
    zs = np.zeros((R, NG), np.float32)
    seen = np.empty(B, np.bool_)
    live = np.zeros((s1 - s0 + B - 1) // B, np.bool_)      # blocks with a visible slot
    pg = k_pos[g]
    n = 0
    for j in range(s0 // B, (s1 + B - 1) // B):
        a0, m, e = j * B, min(s1, j * B + B) - j * B, where[g, j]
        last = -1
        for i in range(m):
            seen[i] = not _hidden(pg[a0 + i], q_pos, window)
            last = max(last, i if seen[i] else -1)
        live[j - s0 // B] = last >= 0
        if last < 0:
            scores[:, a0 - s0:a0 - s0 + m] = -np.inf
            continue
        n = a0 + last + 1 - s0
        if e >= 0:
            for i in range(m):
                for r in range(R):
                    scores[r, a0 - s0 + i] = _row_score(q, g * R + r, fk[g, e], i, Dv) * scale \
                        if seen[i] else -np.inf
            continue
        for d in range(D):           # the block's scores, B slots at a time along each channel
            sz[0, d], sz[1, d] = simd.as_float(ks[g, j, 0, d]), simd.as_float(ks[g, j, 1, d])
        for r in range(R):
            b = np.float32(0)
            for d in range(D):
                wk[r, d, 0] = q[g * R + r, d] * sz[0, d]
                b += q[g * R + r, d] * sz[1, d]
            kb[r, :] = b
        cpu_kv.add_codes(wk, kc[g, j], bits, B, kb)
        for r in range(R):
            sr, kr = scores[r, a0 - s0:a0 - s0 + m], kb[r]
            for i in range(m):
                sr[i] = kr[i] * scale if seen[i] else -np.inf
    _softmax(scores, n, s0, s1, g, top, total, probs)
    for j in range(s0 // B, (s0 + n + B - 1) // B):
        a0, m, e = j * B, min(s0 + n, j * B + B) - j * B, where[g, j]
        if not live[j - s0 // B]:        # its weights are all 0
            continue
        if e >= 0:
            for r in range(R):
                _add_rows(scores[r], a0 - s0, fv[g, e], 0, m, out, g * R + r, Dv)
            continue
        for gi in range(NG):
            for i in range(m):
                sz[0, i], sz[1, i] = simd.as_float(vs[g, a0 + i, 0, gi]), \
                    simd.as_float(vs[g, a0 + i, 1, gi])
            for r in range(R):
                sr, z = scores[r, a0 - s0:a0 - s0 + m], np.float32(0)
                for i in range(m):
                    wv[r, i, gi] = sr[i] * sz[0, i]
                    z += sr[i] * sz[1, i]
                zs[r, gi] += z
        cpu_kv.add_codes(wv, vc[g, a0:a0 + m], bits, Gv, out[g * R:(g + 1) * R])
    for r in range(R):
        for d in range(D):
            out[g * R + r, d] += zs[r, d // Gv]


@njit(fastmath=True, cache=True, error_model="numpy")
def _merge(outs, tops, totals, probs, score, R):
    """The blocks' partial softmaxes of attention_decode merged, in order: [T, Q, D]; their
    weights added to score [G, S'] (unless it is empty)."""
    T, blocks, Q, D = outs.shape
    S = probs.shape[2]
    out = np.zeros((T, Q, D), np.float32)
    for t in range(T):
        for h in range(Q):
            m = np.float32(-np.inf)
            for b in range(blocks):
                m = max(m, tops[t, b, h])
            denom = np.float32(0)
            for b in range(blocks):
                if totals[t, b, h] > 0:
                    f = exp(tops[t, b, h] - m)
                    denom += f * totals[t, b, h]
                    out[t, h] += f * outs[t, b, h]
            out[t, h] /= denom
            if score.shape[1] > 0:           # the weights: e**(score - top_b) * e**(top_b - m) / denom
                sg = score[h // R]
                for b in range(blocks):
                    if totals[t, b, h] > 0:
                        f = exp(tops[t, b, h] - m) / denom
                        for s in range(b * ATTENTION_BLOCK, min(S, b * ATTENTION_BLOCK + ATTENTION_BLOCK)):
                            sg[s] += probs[t, h, s] * f
    return out


@njit(cache=True)
def _partials(T, Q, D, S, keep):
    """attention_decode's per-block buffers: outs, tops, totals, probs."""
    blocks = max(1, (S + ATTENTION_BLOCK - 1) // ATTENTION_BLOCK)
    return (np.zeros((T, blocks, Q, D), np.float32), np.empty((T, blocks, Q), np.float32),
            np.empty((T, blocks, Q), np.float32),
            np.empty((T, Q if keep else 1, S if keep else 0), np.float32))


@njit(parallel=_prange_only(), fastmath=True, cache=True)
def attention_decode(q, k, v, q_pos, k_pos, scale, window, threads, score):
    """A few queries, one per head each, over the cache: q [T, Q, D] at positions q_pos [T];
    k, v [G, S', D] whole cache buffers of which the first S slots are read, k_pos [G, S] their
    positions (-1 = free slot); window <= 0 means none. score [G, S'] gets each slot's
    attention weights added (summed over the query heads of its KV head, query after query),
    unless it is empty ([G, 0]). Returns [T, Q, D]. The slots go in blocks of ATTENTION_BLOCK;
    up to `threads` tasks share the (block, query, KV head) triples, taking every threads-th, block
    by block so that the full blocks spread evenly (a last block of a few slots costs little: in
    query order, a draft's verification gave one task twice the other's work); a block's K/V rows
    of a KV head are read once for the query heads that read it; the blocks' partial softmaxes are
    merged at the end, in order. The blocks' bounds depend on neither S nor T, so slots
    appended after a query's position (masked: a draft's verification) and the other queries
    change nothing in its result, to the bit."""
    T, Q, D = q.shape
    G, S = k_pos.shape
    outs, tops, totals, probs = _partials(T, Q, D, S, score.shape[1] > 0)
    blocks = outs.shape[1]
    items = T * blocks * G                  # (block, query, KV head)
    tasks = min(threads, items)
    for task in prange(tasks):
        for i in range(task, items, tasks):
            b, t, g = i // (T * G), i // G % T, i % G
            _attention_slots(q[t], k[g], v[g], k_pos[g], 0, q_pos[t], scale, window,
                             b * ATTENTION_BLOCK, min(S, b * ATTENTION_BLOCK + ATTENTION_BLOCK),
                             g, Q // G, outs[t, b], tops[t, b], totals[t, b], probs[t])
    return _merge(outs, tops, totals, probs, score, Q // G)


@njit(parallel=_prange_only(), fastmath=True, cache=True)
def attention_decode_q(q, kc, ks, vc, vs, fk, fv, where, q_pos, k_pos, scale, window, threads,
                       score):
    """attention_decode over a quantized cache (kernels.kv_quant's arrays, float16 ones as
    uint16 bits), read in place (_attention_qslots): no float copy of the cache."""
    T, Q, D = q.shape
    G, S = k_pos.shape
    outs, tops, totals, probs = _partials(T, Q, D, S, score.shape[1] > 0)
    blocks = outs.shape[1]
    items = T * blocks * G
    tasks = min(threads, items)
    for task in prange(tasks):
        for i in range(task, items, tasks):
            b, t, g = i // (T * G), i // G % T, i % G
            _attention_qslots(q[t], kc, ks, vc, vs, fk, fv, where, q_pos[t], k_pos, scale,
                              window, b * ATTENTION_BLOCK,
                              min(S, b * ATTENTION_BLOCK + ATTENTION_BLOCK), g, outs[t, b],
                              tops[t, b], totals[t, b], probs[t])
    return _merge(outs, tops, totals, probs, score, Q // G)


@njit(cache=True)
def store_kv(k_buf, v_buf, slots, k, v):
    """k, v float32 [T, G, D] -> cache buffers [G, S, D] (float16 bits or float32), KV head g's
    rows at its slots slots[g] ([G, T])."""
    T, G, D = k.shape
    for t in range(T):
        for g in range(G):
            s = slots[g, t]
            for d in range(D):
                k_buf[g, s, d] = simd.to_cache(k[t, g, d], k_buf)
                v_buf[g, s, d] = simd.to_cache(v[t, g, d], v_buf)


@njit(fastmath=True, cache=True)
def lowest_scored(slot_pos, score, first, last, n):
    """reference.lowest_scored: for n = 1 (a decode step) the lowest score of each row in a
    branch-free pass (the compiler makes it SIMD), then its first slot; for more, a stable sort
    of the row. Slots not to evict get the largest float32, not inf (fastmath assumes none)."""
    L, G, C = slot_pos.shape
    top = np.float32(3.4028235e38)
    out = np.empty((L, G, n), np.int64)
    key = np.empty(C, np.float32)
    for l in range(L):
        for g in range(G):
            pos, sc = slot_pos[l, g], score[l, g]
            for s in range(C):
                key[s] = sc[s] if pos[s] >= first and pos[s] <= last else top
            if n > 1:
                out[l, g] = np.argsort(key, kind="mergesort")[:n]
                continue
            m = top
            for s in range(C):
                m = min(m, key[s])
            at = 0
            while key[at] != m:
                at += 1
            out[l, g, 0] = at
    return out


@njit(fastmath=True, cache=True, error_model="numpy")
def _masked_softmax(s, q_pos, k_pos, window, sums):
    """Scores s [M, B, n] of B queries at positions q_pos [B] (for M heads) over the slots of
    positions k_pos[:n] -> e**(score - row max) in place, 0 where a slot is hidden (free, after
    the query, or out of the window); sums [M, B] = the rows' sums. Branch-free inner loops
    (they vectorize); on one thread, between two BLAS calls (see int8_dequantize)."""
    M, B, n = s.shape
    far = window if window > 0 else np.iinfo(np.int64).max
    for b in range(B):
        qp = q_pos[b]
        for h in range(M):
            r = s[h, b]
            m = np.float32(-np.inf)
            for i in range(n):
                p = k_pos[i]
                x = r[i] if (p >= 0) & (p <= qp) & (qp - p < far) else np.float32(-np.inf)
                r[i] = x
                m = simd.fmax(m, x)
            if m == -np.inf:                 # sees nothing: a row of zeros
                r[:] = 0
                sums[h, b] = 1
                continue
            t = np.float32(0)
            for i in range(n):
                e = exp(r[i] - m)
                r[i] = e
                t += e
            sums[h, b] = t


def attention_prompt(q, k, v, q_pos, k_pos, scale, window=None, score=None, block=PROMPT_BLOCK):
    """reference.attention for a prompt q [T, Q, D] over slots of positions k_pos [G, S] (score
    as there), in blocks of queries: each block's scores
    [R, block, S] for the R query heads of a KV head stay in the L2 cache through the softmax
    (one Numba pass: mask, max, exp, sum), slots after the last one a block sees are skipped
    (with slots in position order, the causal half of the work), and the normalization divides
    the [.., D] output instead of the [.., S] probabilities. Matmuls by BLAS, over float32
    copies of float16 caches made once per call."""
    T, Q, D = q.shape
    G, S = k_pos.shape
    R = Q // G
    k, v = np.asarray(k[:, :S], np.float32), np.asarray(v[:, :S], np.float32)
    out = np.empty((T, Q, D), np.float32)
    qs = (q * np.float32(scale)).transpose(1, 0, 2)                    # [Q, T, D]
    sums = np.empty((R, block), np.float32)
    for b in range(0, T, block):
        e = min(T, b + block)
        for g in range(G):
            seen = np.flatnonzero((k_pos[g] >= 0) & (k_pos[g] <= q_pos[b:e].max()))
            n = int(seen[-1]) + 1 if len(seen) else S      # slots past n: unseen by the block
            s = (qs[g * R:(g + 1) * R, b:e].reshape(-1, D) @ k[g, :n].T).reshape(R, e - b, n)
            _masked_softmax(s, q_pos[b:e], k_pos[g], window or 0, sums[:, :e - b])
            if score is not None:            # the weights s / sums, summed over heads and queries
                score[g, :n] += (1 / sums[:, :e - b]).reshape(-1) @ s.reshape(-1, n)
            o = (s.reshape(-1, n) @ v[g, :n]).reshape(R, e - b, D)
            o /= sums[:, :e - b, None]
            out[b:e, g * R:(g + 1) * R] = o.transpose(1, 0, 2)
    return out


# -- one decoder layer for one token, fused ------------------------------------------------------

@njit(fastmath=True, cache=True)
def _layer_qkv(x, in_norm, eps, qkv, qkv_b, cos, sin, n_heads, G, D, threads):
    """decode_layer's first part: the tokens' q [T, Q, D], k and v [T, G, D], RoPE applied."""
    T = x.shape[0]
    Qd, Gd = n_heads * D, G * D
    qkv_out = np.empty((T, Qd + 2 * Gd), np.float32)
    q_gemv(rmsnorm(x, in_norm, eps), qkv, qkv_out, threads)
    if qkv_b.shape[0]:
        for t in range(T):
            qkv_out[t] += qkv_b
    q = rope(np.ascontiguousarray(qkv_out[:, :Qd]).reshape(T, n_heads, D), cos, sin)
    k = rope(np.ascontiguousarray(qkv_out[:, Qd:Qd + Gd]).reshape(T, G, D), cos, sin)
    return q, k, np.ascontiguousarray(qkv_out[:, Qd + Gd:]).reshape(T, G, D)


@njit(fastmath=True, cache=True)
def _layer_rest(x, a, post_norm, eps, o, gate_up, down, threads):
    """decode_layer's last part, from the attention's output a [T, Q, D]: x updated in place."""
    T, H = x.shape
    y = np.empty((T, H), np.float32)
    q_gemv(a.reshape(T, a.shape[1] * a.shape[2]), o, y, threads)
    x += y
    n_inner = down.lo.shape[1] * 8
    gu = np.empty((T, 2 * n_inner), np.float32)
    q_gemv(rmsnorm(x, post_norm, eps), gate_up, gu, threads)
    act = np.empty((T, n_inner), np.float32)
    for t in range(T):
        _swiglu_row(gu[t], act[t])
    q_gemv(act, down, y, threads)
    x += y


@njit(fastmath=True, cache=True)
def decode_layer(x, in_norm, post_norm, eps, qkv, qkv_b, o, gate_up, down,
                 k_buf, v_buf, slots, pos, k_pos, score, cos, sin, n_heads, scale, window, threads):
    """A few tokens x [T, H] (a decode step, a draft's verification) through one decoder layer
    of quantized linears (QLinear: qkv, o, gate_up, down), in place; their K/V go to `slots`
    [G, T] of the cache buffers k_buf, v_buf [G, S, D] (k_pos [G, S] already holds their
    positions `pos` [T]; score as for attention_decode); qkv_b [(Q+2G)*D] the q/k/v biases, or
    empty: none. The ops of the model file's layer (models.llama LlamaModel.layer) in a single
    call, so the costs of a call from Python are paid once per layer; each token's result is
    the one it gets alone, to the bit."""
    q, k, v = _layer_qkv(x, in_norm, eps, qkv, qkv_b, cos, sin, n_heads, k_buf.shape[0],
                         k_buf.shape[2], threads)
    store_kv(k_buf, v_buf, slots, k, v)
    a = attention_decode(q, k_buf, v_buf, pos, k_pos, scale, window, threads, score)
    _layer_rest(x, a, post_norm, eps, o, gate_up, down, threads)


@njit(fastmath=True, cache=True)
def decode_layer_q(x, in_norm, post_norm, eps, qkv, qkv_b, o, gate_up, down,
                   kc, ks, vc, vs, fk, fv, where, owner, stamp, pin,
                   slots, pos, k_pos, score, cos, sin, n_heads, scale, window, threads):
    """decode_layer over a quantized cache (kernels.kv_quant's arrays, float16 ones as uint16
    bits)."""
    q, k, v = _layer_qkv(x, in_norm, eps, qkv, qkv_b, cos, sin, n_heads, where.shape[0],
                         fk.shape[3], threads)
    cpu_kv.store_kv(kc, ks, vc, vs, fk, fv, where, owner, stamp, pin, slots, k, v)
    a = attention_decode_q(q, kc, ks, vc, vs, fk, fv, where, pos, k_pos, scale, window, threads,
                           score)
    _layer_rest(x, a, post_norm, eps, o, gate_up, down, threads)


# -- the backend ---------------------------------------------------------------------------------

_NO_SCORES = np.zeros((1, 0), np.float32)
_NO_SCALES = np.zeros(0, np.float32)          # gemv_rows of float weights

# The thread counts last set: Numba's is each thread's own (get_num_threads costs a microsecond,
# and a token reads the count ~35 times), BLAS's the process's; and the process's measures of the
# free cores, by the most threads asked for.
_numba_threads = threading.local()
_SET = {"blas": None}
_CORES: dict[int, cores.Cores] = {}


def _scores(score):
    """An H2O score table [G, S] for the kernels, or an empty one: keep none."""
    return _NO_SCORES if score is None else score


def _bits(buf: np.ndarray) -> np.ndarray:
    """A KV buffer as the kernels take it: float16 as its uint16 bits (Numba's CPU target has no
    float16), float32 as it is."""
    return buf.view(np.uint16) if buf.dtype == np.float16 else buf


def _quant_arrays(store: kv_quant.QuantKV) -> tuple:
    """A quantized cache's arrays as the kernels take them (_bits), and its pinned blocks."""
    return tuple(_bits(a) for a in store[:-1]) + (store.pin,)


class CpuBackend(reference.ReferenceBackend):
    """The decoder's ops on the Numba kernels above. Prepared weights: QLinear for quantized
    projections, Int8Rows for the LM head, float32 [out, in] arrays for float projections."""

    name = "cpu"

    def __init__(self, threads: int | None = None):
        from threadpoolctl import ThreadpoolController

        # at most `threads` (default: Numba's pool, a thread per CPU), fewer while other programs
        # keep cores busy: one measure for the process (a draft model's backend shares it)
        most = threads or numba.config.NUMBA_NUM_THREADS
        if most not in _CORES:
            _CORES[most] = cores.Cores(most)
        self.cores = _CORES[most]
        self._fixed = None
        self._scratch = np.empty(0, np.float32)
        self._blas = ThreadpoolController()

    @property
    def threads(self) -> int:
        """The threads the next kernel runs on (kernels.cores), set for it: Numba's count is the
        calling thread's own, and BLAS's the process's."""
        n = self._fixed or self.cores.threads()
        pool = min(n, numba.config.NUMBA_NUM_THREADS)
        if getattr(_numba_threads, "n", None) != pool:
            numba.set_num_threads(pool)
            _numba_threads.n = pool
        if _SET["blas"] != pool:
            self._blas.limit(limits=pool, user_api="blas")
            _SET["blas"] = pool
        return n

    @threads.setter
    def threads(self, n: int) -> None:
        """A fixed count of tasks for the kernels to split their work into (a test of the
        split), whatever the machine's load; Numba's threads are at most its pool."""
        self._fixed = n

    def _one_blas_thread(self):
        """A context in which BLAS runs on one thread, for its calls between the parallel Numba
        kernels of a quantized model's prompt (attention, an int8 head): BLAS workers spin for
        a while after each call before they sleep, and spinning on the cores the next Numba
        kernel runs on, they slow it several times over."""
        return self._blas.limit(limits=1, user_api="blas")

    def warm_up(self, layers: list) -> tuple[list, tuple[int, ...]]:
        """What to run once at load so that every kernel a reply calls is compiled (or read
        from Numba's cache) before any timing: (layers, token counts of the forward passes).
        Numba compiles a kernel once per set of argument types, so one layer of each kind of
        weights (float16 or float32 scales, quantized or float, ...) and a pass of each path
        (a prompt's GEMMs, a token's fused layer) compile them all."""
        kinds = {}
        for layer in layers:
            key = tuple(numba.typeof(w) for w in vars(layer).values())
            kinds.setdefault(key, layer)
        return list(kinds.values()), (SMALL_TOKENS + 1, 1)

    def prepare_linear(self, parts: list):
        if all(isinstance(p, quant.QuantWeight) for p in parts):
            _ = self.threads               # (the count repack's prange runs on)
            return repack(parts)
        return super().prepare_linear(parts)

    def prepare_head(self, table: np.ndarray, quantized: bool = False):
        # the same int8 rows as the reference (see ReferenceBackend.prepare_head), read as int8
        return quantize_int8_rows(table) if quantized else self.prepare_linear([table])

    def prepare_embedding(self, table: np.ndarray) -> np.ndarray:
        return table          # looked up a few rows at a time: stays as stored (mmap, f16 or f32)

    def _int8_prompt(self, x: np.ndarray, w: Int8Rows) -> np.ndarray:
        """x [T, in] @ W.T for a prompt and an int8 head: W dequantized a tile of columns at a
        time into a scratch buffer of at most DEQUANT_TILE_BYTES, each tile one BLAS GEMM, so
        that the buffer stays small (the default model's whole head would take 113 MB)."""
        n_out, n_in = w.shape
        cols = max(simd.LANES, DEQUANT_TILE_BYTES // (4 * n_in) // simd.LANES * simd.LANES)
        if self._scratch.size < n_in * cols:
            self._scratch = np.empty(n_in * cols, np.float32)
        tiles = []
        for c0 in range(0, n_out, cols):
            c1 = min(n_out, c0 + cols)
            dst = self._scratch[:n_in * (c1 - c0)].reshape(n_in, c1 - c0)
            int8_dequantize(w.q, w.s, c0, c1, dst)
            with self._one_blas_thread():
                tiles.append(x @ dst)
        return tiles[0] if len(tiles) == 1 else np.concatenate(tiles, axis=1)

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if isinstance(w, np.ndarray):
            if T > SMALL_TOKENS or w.dtype != np.float32:
                return reference.linear(x, w)
            y = np.empty((T, w.shape[0]), np.float32)
            gemv_rows(x, w, _NO_SCALES, y, self.threads)
            return y
        if isinstance(w, Int8Rows):
            if T > SMALL_TOKENS:
                return self._int8_prompt(x, w)
            y = np.empty((T, w.shape[0]), np.float32)
            gemv_rows(x, w.q, w.s, y, self.threads)
            return y
        y = np.empty((T, w.shape[0]), np.float32)
        (q_gemm if T > SMALL_TOKENS else q_gemv)(x, w, y, self.threads)
        return y

    def fused_decode(self, layer, tokens: int) -> bool:
        return tokens <= SMALL_TOKENS and all(
            isinstance(w, QLinear) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def decode_layer(self, x, layer, kv, pos, cos, sin, cfg):
        """A few tokens x [T, H] through decoder layer `layer` (models.llama.Layer) over the
        cache layer `kv` (kv_cache.LayerView), for a model of config `cfg` (the kernel
        decode_layer)."""
        x = np.array(x, np.float32)
        bias = _NO_SCALES if layer.qkv_bias is None else layer.qkv_bias
        weights = (x, layer.input_norm, layer.post_norm, np.float32(cfg.rms_norm_eps), layer.qkv,
                   bias, layer.o, layer.gate_up, layer.down)
        rest = (kv.slots, np.ascontiguousarray(pos, np.int64), kv.k_pos, _scores(kv.score), cos,
                sin, cfg.num_attention_heads, np.float32(cfg.head_dim ** -0.5),
                cfg.sliding_window or 0, self.threads)
        if isinstance(kv.k, kv_quant.QuantKV):
            decode_layer_q(*weights, *_quant_arrays(kv.k), *rest)
        else:
            decode_layer(*weights, _bits(kv.k), _bits(kv.v), *rest)
        return x

    def rmsnorm(self, x, w, eps):
        return rmsnorm(np.ascontiguousarray(x, dtype=np.float32), w, eps)

    def rope(self, x, cos, sin):
        return rope(x, cos, sin)

    def swiglu(self, gu):
        return swiglu(np.ascontiguousarray(gu, dtype=np.float32))

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None, score=None):
        if q.ndim == 4:
            return reference.attention(q, k, v, q_pos, k_pos, scale, window, score)
        # [G, S], writable (a read-only array would compile, and round, apart)
        quantized = isinstance(k, kv_quant.QuantKV)
        G = k.where.shape[0] if quantized else k.shape[0]
        k_pos = np.ascontiguousarray(k_pos if k_pos.ndim == 2 else np.tile(k_pos, (G, 1)))
        if quantized and q.shape[0] <= SMALL_TOKENS:
            return attention_decode_q(np.ascontiguousarray(q, np.float32), *_quant_arrays(k)[:7],
                                      np.ascontiguousarray(q_pos, np.int64), k_pos,
                                      np.float32(scale), window or 0, self.threads, _scores(score))
        if quantized:          # a prompt: BLAS over a float32 copy, as of a float16 cache
            k, v = self.read_kv(k, None, k_pos.shape[1])
        if q.shape[0] > SMALL_TOKENS:
            with self._one_blas_thread():
                return attention_prompt(q, k, v, q_pos, k_pos, scale, window, score)
        # a few tokens (a draft's verification): decode attention, each query as if alone, the
        # later tokens' slots hidden by the causal mask; no BLAS call, whose spinning threads
        # would slow the Numba kernels around it
        return attention_decode(np.ascontiguousarray(q, np.float32), _bits(k), _bits(v),
                                np.ascontiguousarray(q_pos, np.int64), k_pos, np.float32(scale),
                                window or 0, self.threads, _scores(score))

    lowest_scored = staticmethod(lowest_scored)

    def read_kv(self, k_buf, v_buf, n):
        if not isinstance(k_buf, kv_quant.QuantKV):
            return super().read_kv(k_buf, v_buf, n)
        N, D = k_buf.where.shape[0], k_buf.head_dim
        k, v = np.empty((N, n, D), np.float32), np.empty((N, n, D), np.float32)
        cpu_kv.dequantize(*_quant_arrays(k_buf)[:7], n, k, v)
        return k, v

    def store_kv(self, k_buf, v_buf, slots, k, v):
        if isinstance(k_buf, kv_quant.QuantKV):
            return cpu_kv.store_kv(*_quant_arrays(k_buf), slots, np.ascontiguousarray(k, np.float32),
                                   np.ascontiguousarray(v, np.float32))
        store_kv(_bits(k_buf), _bits(v_buf), slots, np.ascontiguousarray(k, np.float32),
                 np.ascontiguousarray(v, np.float32))
