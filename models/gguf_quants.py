"""GGUF (llama.cpp) quantized blocks -> the runtime's one quantized form (`kernels.quant`),
exactly: codes are copied bit for bit, each block's float16 scale (and min) kept as it is, the
K-quants' integer sub-block scales as integers beside them. The table at the top of
kernels/quant.py lists the mapping; the block layouts are ggml's (ggml-common.h), documented below
where each is decoded.

A 2-D GGUF weight W [out, in] is stored row after row (one row per output), each row a run of
blocks along the input; `raw` is those bytes, uint8 [out, bytes_per_row]. Everything is NumPy on
whole tensors (no loop over blocks), but the 4-bit codes' repacking, compiled (most of a
model's bytes). All multi-byte fields are little-endian.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from numba import njit, prange

from tinyrt.kernels import jit_cache
from tinyrt.kernels.quant import QuantWeight, make
from tinyrt.models.weights import all_finite

# Numba stamps a kernel's cache as it decorates it: guarded first, the stamp is the same whatever
# this process imported before (else a process that imported this module alone rewrote the cache).
jit_cache.guard()

QK_K = 256  # values in a K-quant super-block


def _blocks(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """raw uint8 [rows, bytes_per_row] -> [rows, blocks per row, bytes per block] (a view)."""
    size = GGML_QUANT_SIZES[qtype][1]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{qtype.name} rows must be uint8 [rows, k * {size}], not "
                         f"{raw.dtype} {list(raw.shape)}")
    return raw.reshape(raw.shape[0], raw.shape[1] // size, size)


@njit(parallel=True, cache=True)
def _halves(b, at, out):
    for r in prange(b.shape[0]):
        for k in range(b.shape[1]):
            out[r, k] = np.uint16(b[r, k, at]) | (np.uint16(b[r, k, at + 1]) << np.uint16(8))


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block [rows, blocks] (compiled: NumPy's copy of a
    strided 2-byte field is slow, and a 7B model's Q4_0 has 200 million of them)."""
    out = np.empty(b.shape[:2], np.uint16)
    _halves(b, at, out)
    return out.view(np.float16)


def _flat(x: np.ndarray) -> np.ndarray:
    """[rows, blocks, k] -> [rows, blocks * k]."""
    return x.reshape(x.shape[0], -1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., n] whose low nibbles hold values 0..n-1 and whose high nibbles hold values
    n..2n-1 (ggml's order in every 4-bit layout) -> the 2n values one per byte [..., 2n]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


@njit(cache=True)
def _u64(a, at):
    """The 8 bytes a[at : at + 8] as a little-endian uint64."""
    v = np.uint64(0)
    for i in range(8):
        v |= np.uint64(a[at + i]) << np.uint64(8 * i)
    return v


@njit(cache=True)
def _pair(x):
    """uint64 of 8 nibbles, one in the low half of each byte -> those 8 packed two per byte in
    the low 4 bytes (byte j: nibble 2j low, 2j + 1 high)."""
    x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return (x | (x >> np.uint64(16))) & np.uint64(0xFFFFFFFF)


@njit(parallel=True, cache=True)
def _pack_rows(raw, block, at, n, chunks, out):
    """The loop of `_pack_nibbles` over each row of raw uint8 [rows, blocks * block]: in every
    block, `chunks` runs of n bytes (n a multiple of 16) from byte `at` on -> out, uint64
    [rows, blocks * chunks * n / 8], 16 bytes (32 values) at a time."""
    low, half = np.uint64(0x0F0F0F0F0F0F0F0F), n // 2
    for r in prange(raw.shape[0]):
        row, dst_row = raw[r], out[r]
        for b in range(raw.shape[1] // block):
            for c in range(chunks):
                src, dst = b * block + at + c * n, (b * chunks + c) * n
                for j in range(0, n, 16):
                    v0, v1 = _u64(row, src + j), _u64(row, src + j + 8)
                    lo = _pair(v0 & low) | (_pair(v1 & low) << np.uint64(32))
                    hi = _pair((v0 >> np.uint64(4)) & low) | \
                        (_pair((v1 >> np.uint64(4)) & low) << np.uint64(32))
                    dst_row[(dst + j // 2) // 8] = lo
                    dst_row[(dst + half + j // 2) // 8] = hi


def _pack_nibbles(raw: np.ndarray, block: int, at: int, n: int, chunks: int = 1) -> np.ndarray:
    """The 4-bit values of raw uint8 [rows, blocks * block], in each block `chunks` runs of n
    bytes from byte `at` on, each run's low nibbles holding its values 0..n-1 and its high
    nibbles values n..2n-1 (ggml's order in every 4-bit layout), packed as kernels.quant packs
    4-bit codes (value 2j in the low nibble of byte j, 2j + 1 in its high nibble), without
    unpacking: -> [rows, blocks * chunks * n]. Compiled: a 7B model's codes take one pass."""
    out = np.empty((raw.shape[0], raw.shape[1] // block * chunks * n), np.uint8)
    _pack_rows(raw, block, at, n, chunks, out.view(np.uint64))
    return out


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit sub-block scales and mins [..., 12] -> (scales, mins),
    uint8 [..., 8] each. Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; the
    scales and mins of sub-blocks 4-7 have their low 4 bits in bytes 8-11 (scale in the low
    nibble, min in the high) and their top 2 bits in the top 2 bits of bytes 0-3 (scales) and
    4-7 (mins):

        byte 0-3:  s4..7[5:4] s0..3[5:0]      byte 8-11: m4..7[3:0] s4..7[3:0]
        byte 4-7:  m4..7[5:4] m0..3[5:0]
    """
    lo_s, lo_m, hi = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([lo_s & 63, (hi & 15) | ((lo_s >> 6) << 4)], axis=-1)
    mins = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return scales, mins


def q4_0(raw: np.ndarray) -> QuantWeight:
    """block_q4_0, 32 values in 18 bytes: d f16 | qs[16]. Value j (j < 16) is the low nibble of
    qs[j], value j + 16 its high nibble; w = d * (q - 8) -> scale d, zero 8."""
    b = _blocks(raw, Q.Q4_0)
    return make(_pack_nibbles(raw, 18, 2, 16), 4, _f16(b, 0), zero=8, packed=True)


def q4_1(raw: np.ndarray) -> QuantWeight:
    """block_q4_1, 32 values in 20 bytes: d f16 | m f16 | qs[16], nibbles as Q4_0;
    w = d * q + m -> scale d, offset m."""
    b = _blocks(raw, Q.Q4_1)
    return make(_pack_nibbles(raw, 20, 4, 16), 4, _f16(b, 0), _f16(b, 2), packed=True)


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: qh[4] is a little-endian uint32 whose bit j is value j's 5th bit; qs[16] holds
    the low 4 bits as Q4_0's nibbles. -> codes 0..31 [rows, blocks, 32]."""
    high = np.unpackbits(qh, axis=-1, bitorder="little")   # [rows, blocks, 32]: bit j of the u32
    return _nibbles(qs) | (high << 4)


def q5_0(raw: np.ndarray) -> QuantWeight:
    """block_q5_0, 32 values in 22 bytes: d f16 | qh[4] | qs[16]; w = d * (q - 16) -> 5-bit
    codes, scale d, zero 16."""
    b = _blocks(raw, Q.Q5_0)
    return make(_flat(_q5_codes(b[..., 2:6], b[..., 6:22])), 5, _f16(b, 0), zero=16)


def q5_1(raw: np.ndarray) -> QuantWeight:
    """block_q5_1, 32 values in 24 bytes: d f16 | m f16 | qh[4] | qs[16]; w = d * q + m."""
    b = _blocks(raw, Q.Q5_1)
    return make(_flat(_q5_codes(b[..., 4:8], b[..., 8:24])), 5, _f16(b, 0), _f16(b, 2))


def q8_0(raw: np.ndarray) -> QuantWeight:
    """block_q8_0, 32 values in 34 bytes: d f16 | qs int8[32]; w = d * c -> code c + 128 (the
    int8's bits with the sign bit flipped), scale d, zero 128."""
    b = _blocks(raw, Q.Q8_0)
    return make(_flat(b[..., 2:34] ^ np.uint8(0x80)), 8, _f16(b, 0), zero=128)


def _k_groups(b: np.ndarray) -> dict:
    """Q4_K / Q5_K: d f16 at 0, dmin f16 at 2, 6-bit scales and mins at 4..15; sub-block k
    (32 values) is w = d * sc[k] * q - dmin * m[k] -> scale d [rows, blocks] with sub-scales sc,
    offset -dmin with sub-scales m [rows, blocks * 8]."""
    sc, mn = _k_scales(b[..., 4:16])
    return dict(scale=_f16(b, 0), scale_q=_flat(sc), offset=-_f16(b, 2), offset_q=_flat(mn))


def q4_k(raw: np.ndarray) -> QuantWeight:
    """block_q4_K, 256 values in 144 bytes: d f16 | dmin f16 | scales[12] | qs[128]. The values
    go in 4 chunks of 64, chunk c from qs[32c : 32c + 32]: its first 32 values (sub-block 2c) are
    the low nibbles, the next 32 (sub-block 2c + 1) the high nibbles."""
    b = _blocks(raw, Q.Q4_K)
    return make(_pack_nibbles(raw, 144, 16, 32, 4), 4, packed=True, **_k_groups(b))


def q5_k(raw: np.ndarray) -> QuantWeight:
    """block_q5_K, 256 values in 176 bytes: d f16 | dmin f16 | scales[12] | qh[32] | qs[128].
    The low 4 bits as Q4_K's; the 5th bit of value j of sub-block k (k = 0..7, j = 0..31) is bit
    k of qh[j]. 5-bit codes."""
    b = _blocks(raw, Q.Q5_K)
    rows, nb = b.shape[:2]
    low = _nibbles(b[..., 48:176].reshape(rows, nb, 4, 32)).reshape(rows, nb, QK_K)
    high = np.unpackbits(b[..., 16:48, None], axis=-1, bitorder="little")   # [.., j, k]
    high = high.swapaxes(-1, -2).reshape(rows, nb, QK_K)                    # [.., k, j]
    return make(_flat(low | (high << 4)), 5, **_k_groups(b))


def q6_k(raw: np.ndarray) -> QuantWeight:
    """block_q6_K, 256 values in 210 bytes: ql[128] | qh[64] | scales int8[16] | d f16. Two
    halves of 128 values; half h takes ql[64h : 64h + 64] and qh[32h : 32h + 32]. Its value
    l = 32 i + j (i = 0..3, j = 0..31) has low 4 bits from ql[64h + 32 (i % 2) + j] (low nibble
    for i < 2, high for i >= 2) and top 2 bits from bits 2i, 2i + 1 of qh[32h + j]. Sub-block k
    (16 values) is w = d * scales[k] * (q - 32) -> 6-bit codes, groups of 16, scale d with
    sub-scales scales[k], zero 32."""
    b = _blocks(raw, Q.Q6_K)
    rows, nb = b.shape[:2]
    low = _nibbles(b[..., 0:128].reshape(rows, nb, 2, 64))                  # [.., h, 128]
    qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3            # [.., h, i, j]
    codes = low | (high.reshape(rows, nb, 2, 128) << 4)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return make(_flat(codes.reshape(rows, nb, QK_K)), 6, _f16(b, 208), scale_q=_flat(sc), zero=32)


# the form each type takes: (bits of its codes, inputs per group)
FORMS = {Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q4_K: (4, 32), Q.Q5_0: (5, 32), Q.Q5_1: (5, 32),
         Q.Q5_K: (5, 32), Q.Q6_K: (6, 16), Q.Q8_0: (8, 32)}

GGUF_TO_QUANT: dict[Q, Callable[[np.ndarray], QuantWeight]] = {
    Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q4_K: q4_k,
    Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q5_K: q5_k, Q.Q6_K: q6_k, Q.Q8_0: q8_0,
}


# byte offsets of each block's float16 fields (d, and dmin or m), per type: what a NaN or inf
# in a block shows in, checked without dequantizing (the other fields are integers)
FLOAT_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
                Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def finite_scales(raw: np.ndarray, qtype: Q) -> bool:
    """Whether every float16 field of the blocks of raw uint8 [rows, bytes_per_row] (a type
    of FLOAT_FIELDS) is finite: whether the rows dequantize to finite values."""
    b = _blocks(raw, qtype)
    return all(all_finite(_f16(b, at)) for at in FLOAT_FIELDS[qtype])


def to_quant(raw: np.ndarray, qtype: Q, n_in: int) -> QuantWeight:
    """A GGUF weight of type `qtype` with `n_in` inputs per row, its raw block bytes uint8
    [rows, bytes_per_row], as a QuantWeight [rows, n_in] (ValueError if it does not fit)."""
    qtype = Q(qtype)
    if qtype not in GGUF_TO_QUANT:
        raise ValueError(f"GGUF type {qtype.name} has no exact quantized form in the runtime")
    block, size = GGML_QUANT_SIZES[qtype]
    if n_in <= 0 or n_in % block or raw.ndim != 2 or raw.shape[1] != n_in // block * size:
        raise ValueError(f"{qtype.name} rows of {n_in} values take {n_in // block * size} bytes "
                         f"in blocks of {block}; got {list(raw.shape)}")
    return GGUF_TO_QUANT[qtype](raw)
