"""Numba CUDA kernels of the quantized KV cache (kernels.kv_quant: its layout and math): a store
writes rows and keeps its pool's bookkeeping in one kernel, decode attention reads the codes in
place, and a prompt's attention reads a dequantized copy. Codes, scales and zeros are the
reference's bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, types, uint8

from .primitives import (HALF_MAX, THREADS, add_rn as _add_rn, block_reduce, clip, greater,
                         mul_rn as _mul_rn, visible)

_TOP16 = np.float32(HALF_MAX)
_NEVER = np.iinfo(np.int64).max
MAX_CODES = 256      # the most codes in a row of a quantized cache: its block (slots per key
                     # channel) and its head dim (channels per value slot)

@cuda.jit(device=True)
def _softmax(probs, h, S, part, tid, top):
    """Query head h's scores probs[h, :S] (-inf: hidden; each thread's are every THREADS-th,
    their largest `top`) -> exp(score - the largest), in place; returns 1 / their sum (0: none
    visible). Every thread's weights are written when it returns."""
    top = block_reduce(part, tid, top, True)
    total = float32(0)
    for s in range(tid, S, THREADS):
        e = probs[h, s]
        e = float32(0) if e == -math.inf else math.exp(e - top)
        probs[h, s] = e
        total += e
    total = block_reduce(part, tid, total, False)
    cuda.syncthreads()           # every thread's probs written before any thread reads them all
    return float32(0) if total == 0 else float32(1) / total


@cuda.jit(device=True)
def _add_score(score, probs, g, h, S, tid, inv):
    """H2O: query head h's weights added to its KV head's scores score [G, C] (atomically: the
    R query heads of a KV head add to the same row); score [G, 0]: none kept."""
    if score.shape[1] > 0:
        for s in range(tid, S, THREADS):
            cuda.atomic.add(score, (g, s), probs[h, s] * inv)


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
    return clip(x, -_TOP16, _TOP16)


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
    return int(clip(_step(float32(x), s, z), 0, top))


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
        if visible(k_pos[g, s], q_pos, window):
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
        top = greater(top, e)
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
