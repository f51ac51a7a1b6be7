"""Numba CPU kernels of the quantized KV cache (kernels.kv_quant defines its layout and math):
writing rows (opening and sealing blocks of the float pool) and dequantizing it for a prompt's
attention. Decode attention reads the codes in place (attention.attention_decode_q).

float16 arrays (scales, zeros, the pool) are passed as their uint16 bits: Numba's CPU target
has no float16 (simd.as_float / simd.to_cache convert).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import simd


@njit(cache=True, inline="always")
def step(x, s, z):
    """kv_quant's rounding of x to a step of scale s from zero z, as a float: floor((x - z) / s
    + 1/2)."""
    return np.floor((x - z) / s + np.float32(0.5))


@njit(cache=True, inline="always")
def code(x, s, z, top):
    """kv_quant's code of x: step in [0, top], 0 where s is 0."""
    if s <= 0:
        return 0
    return int(min(max(step(x, s, z), np.float32(0)), np.float32(top)))


@njit(cache=True, error_model="numpy")
def _requantize_group(x, bits, sz, row, at, cs):
    """kv_quant.requantize of one group x (float16 bits, any stride) whose codes are values at,
    at + 1, ... of the code row `row` (kv_quant's planes) and whose scale and zero are sz [2]
    (float16 bits): its new codes replace them in the row, its new scale and zero in sz. cs: a
    scratch int64 [>= len(x)]. Without fastmath: what the group's codes gave is computed as
    dequantize_rows computes it."""
    top = (1 << bits) - 1
    n, W = x.shape[0], row.shape[0]
    s, z = simd.as_float(sz[0]), simd.as_float(sz[1])
    kept, stay = False, s > 0
    for i in range(n):
        c = (row[(at + i) % W] >> ((at + i) // W * bits)) & top
        v = simd.as_float(x[i])
        if v == simd.as_float(simd.to_cache(np.float32(c) * s + z, x)):
            kept = True
            cs[i] = c
        elif stay:
            u = step(v, s, z)
            stay = u >= 0 and u <= top
            cs[i] = int(u) if stay else 0
    if not (stay and kept):              # a new grid: kv_quant.quantize
        mn, mx = np.float32(np.inf), np.float32(-np.inf)
        for i in range(n):
            v = simd.as_float(x[i])
            mn, mx = min(mn, v), max(mx, v)
        sz[0] = simd.to_cache((mx - mn) / np.float32(top), sz)
        sz[1] = simd.to_cache(mn + np.float32(0), sz)      # kv_quant.quantize's zero: +0.0
        s, z = simd.as_float(sz[0]), simd.as_float(sz[1])
        for i in range(n):
            cs[i] = code(simd.as_float(x[i]), s, z, top)
    for i in range(n):
        shift = (at + i) // W * bits
        b = row[(at + i) % W] & ~(top << shift)
        row[(at + i) % W] = np.uint8(b | (cs[i] << shift))


@njit(cache=True)
def _seal(kc, ks, vc, vs, fk, fv, where, owner, n, e, bits):
    """Quantize the block that pool entry e of row n holds into its codes; free the entry."""
    B, D = fk.shape[2], fk.shape[3]
    Gv = D // vs.shape[-1]            # channels per value group
    j = owner[n, e]
    cs = np.empty(max(B, D), np.int64)
    for d in range(D):                       # keys: per channel over the block's slots
        _requantize_group(fk[n, e, :, d], bits, ks[n, j, :, d], kc[n, j, d], 0, cs)
    for i in range(B):                       # values: per slot, per group of channels
        for g in range(D // Gv):
            _requantize_group(fv[n, e, i, g * Gv:(g + 1) * Gv], bits, vs[n, j * B + i, :, g],
                              vc[n, j * B + i], g * Gv, cs)
    where[n, j] = -1
    owner[n, e] = -1


@njit(fastmath=True, cache=True, inline="always")
def unpack(row, bits, cf):
    """A row of codes (kernels.kv_quant's planes) as float32 cf [len(row) 8 / bits]. Slices,
    fixed counts and a uint8 shift and mask: with Numba's int64 ones it does not vectorize."""
    W = row.shape[0]
    mask = np.uint8((1 << bits) - 1)
    for p in range(8 // bits):
        shift = np.uint8(p * bits)
        dst = cf[p * W:(p + 1) * W]
        for w in range(W):
            dst[w] = np.float32((row[w] >> shift) & mask)


@njit(fastmath=True, cache=True)
def add_codes(w, codes, bits, group, acc):
    """acc[r, l] += sum over rows i of w[r, i, l // group] * value l of codes[i] (kv_quant's
    planes; w float32 [R, >= n, L / group], acc float32 [R, L], codes uint8 [n, L bits / 8]):
    simd.codes_axpy where a row's bytes and the groups split into whole vectors, else loops."""
    if simd.codes_axpy_fits(codes.shape[1], bits, group):
        simd.codes_axpy(w, codes, bits, group, acc)
        return
    R, L = acc.shape
    cf = np.empty(L, np.float32)
    for i in range(codes.shape[0]):
        unpack(codes[i], bits, cf)
        for r in range(R):
            for l in range(L):
                acc[r, l] += w[r, i, l // group] * cf[l]


@njit(cache=True)
def dequantize_rows(kc, ks, vc, vs, n, s0, s1, k_out, v_out):
    """Slots [s0, s1) of row n, in quantized blocks, dequantized into k_out, v_out [>= s1 - s0, D]
    (float16 bits or float32). Without fastmath: code * scale + zero rounded twice, as the
    reference does (a fused multiply-add would reopen a block a rounding apart)."""
    D, W = ks.shape[3], vc.shape[2]
    bits = W * 8 // D
    B = kc.shape[3] * 8 // bits
    Gv = D // vs.shape[-1]            # channels per value group
    cf = np.empty(max(B, D), np.float32)
    for j in range(s0 // B, (s1 + B - 1) // B):      # keys: a channel's slots at a time
        a, b = max(s0, j * B), min(s1, j * B + B)
        for d in range(D):
            unpack(kc[n, j, d], bits, cf)
            scale, zero = simd.as_float(ks[n, j, 0, d]), simd.as_float(ks[n, j, 1, d])
            for s in range(a, b):
                k_out[s - s0, d] = simd.to_cache(cf[s - j * B] * scale + zero, k_out)
    for s in range(s0, s1):                          # values: a slot at a time
        unpack(vc[n, s], bits, cf)
        for g in range(D // Gv):
            scale, zero = simd.as_float(vs[n, s, 0, g]), simd.as_float(vs[n, s, 1, g])
            src, dst = cf[g * Gv:(g + 1) * Gv], v_out[s - s0, g * Gv:(g + 1) * Gv]
            for d in range(Gv):
                dst[d] = simd.to_cache(src[d] * scale + zero, v_out)


@njit(fastmath=True, cache=True)
def read_rows(kc, ks, vc, vs, fk, fv, where, n, s0, s1, k_out, v_out):
    """Slots [s0, s1) of row n (s0 a multiple of the block), from the pool or dequantized, as
    float32 k_out, v_out [>= s1 - s0, D]."""
    B, D = fk.shape[2], fk.shape[3]
    for a in range(s0, s1, B):
        b = min(s1, a + B)
        e = where[n, a // B]
        if e < 0:
            dequantize_rows(kc, ks, vc, vs, n, a, b, k_out[a - s0:], v_out[a - s0:])
            continue
        for r in range(b - a):
            for d in range(D):
                k_out[a - s0 + r, d] = simd.as_float(fk[n, e, r, d])
                v_out[a - s0 + r, d] = simd.as_float(fv[n, e, r, d])


@njit(cache=True)
def _open(kc, ks, vc, vs, fk, fv, where, owner, stamp, pin, n, j, bits):
    """The pool entry holding block j of row n, the block opened if it is quantized: a free
    entry, or the least recently written one past the pinned blocks, sealed first."""
    e = where[n, j]
    if e >= 0:
        return e
    P = owner.shape[1]
    e = -1
    for i in range(P):
        if owner[n, i] < 0:
            e = i
            break
    if e < 0:
        oldest = np.iinfo(np.int64).max
        for i in range(P):
            if owner[n, i] >= pin and stamp[n, i] < oldest:
                e, oldest = i, stamp[n, i]
        _seal(kc, ks, vc, vs, fk, fv, where, owner, n, e, bits)
    B = fk.shape[2]
    dequantize_rows(kc, ks, vc, vs, n, j * B, j * B + B, fk[n, e], fv[n, e])
    where[n, j] = e
    owner[n, e] = j
    return e


@njit(cache=True)
def store_kv(kc, ks, vc, vs, fk, fv, where, owner, stamp, pin, slots, k, v):
    """kv_quant.store_kv: k, v float32 [T, N, D] -> row n's slots slots[n] ([N, T])."""
    T, N, D = k.shape
    B = fk.shape[2]
    bits = vc.shape[2] * 8 // D
    for n in range(N):
        for t in range(T):
            s = slots[n, t]
            e = _open(kc, ks, vc, vs, fk, fv, where, owner, stamp, pin, n, s // B, bits)
            last = np.int64(0)
            for i in range(stamp.shape[1]):
                last = max(last, stamp[n, i])
            stamp[n, e] = last + 1
            for d in range(D):
                fk[n, e, s % B, d] = simd.to_cache(k[t, n, d], fk)
                fv[n, e, s % B, d] = simd.to_cache(v[t, n, d], fv)


@njit(cache=True)
def dequantize(kc, ks, vc, vs, fk, fv, where, span, k_out, v_out):
    """kv_quant.dequantize into k_out, v_out float32 [N, >= span, D]. On one thread, on purpose:
    a prompt's BLAS attention reads it next (see cpu.int8_dequantize)."""
    for n in range(where.shape[0]):
        read_rows(kc, ks, vc, vs, fk, fv, where, n, 0, span, k_out[n], v_out[n])
