"""The CPU's attention: decode attention over the cache (float16 bits, float32 or KIVI codes)
in blocks of slots split among threads, prompt attention as blocked BLAS matmuls, and the cache's
stores and H2O's lowest scores."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import kv, simd
from .jit import prange_only
from .ops import exp

PROMPT_BLOCK = 128       # queries per block of prompt attention
ATTENTION_BLOCK = 256    # cache slots per block of decode attention


@njit(cache=True, inline="always")
def _hidden(p, q_pos, window):
    """Whether a slot holding position p is hidden from a query at q_pos (window <= 0: none).
    Without branches, so that a loop over slots vectorizes."""
    return (p < 0) | (p > q_pos) | ((window > 0) & (q_pos - p >= window))


@njit(fastmath=True, cache=True, inline="always")
def _row_scores(q, h, R, k, row, Dv, scale, out, c):
    """out[r, c] = scale * sum over d of q[h + r, d] * k[row, d] for r < R (k float16 bits or
    float32 rows): simd.cache_dots for the first Dv columns, up to HEADS heads per pass over the
    row, a loop for the rest."""
    r = 0
    while r < R:
        m = min(simd.HEADS, R - r)
        if m == 4:
            simd.cache_dots(q, h + r, k, row, Dv, out, r, c, 4)
        elif m == 3:
            simd.cache_dots(q, h + r, k, row, Dv, out, r, c, 3)
        elif m == 2:
            simd.cache_dots(q, h + r, k, row, Dv, out, r, c, 2)
        else:
            simd.cache_dots(q, h + r, k, row, Dv, out, r, c, 1)
        r += m
    for r in range(R):
        acc = out[r, c]
        for d in range(Dv, q.shape[1]):
            acc += q[h + r, d] * simd.as_float(k[row, d])
        out[r, c] = acc * scale


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
            for i in range(n):           # (not a slice = an array: see layer._layer_qkv)
                probs[h, s0 + i] = sr[i]


@njit(fastmath=True, cache=True, inline="always")
def _axpy4(e, r, i, v, row, out, h, Dv, m):
    """simd.cache_axpy4 for the m <= HEADS heads h .. h+m-1 (weights e[r .. r+m-1])."""
    if m == 4:
        simd.cache_axpy4(e, r, i, v, row, out, h, Dv, 4)
    elif m == 3:
        simd.cache_axpy4(e, r, i, v, row, out, h, Dv, 3)
    elif m == 2:
        simd.cache_axpy4(e, r, i, v, row, out, h, Dv, 2)
    else:
        simd.cache_axpy4(e, r, i, v, row, out, h, Dv, 1)


@njit(fastmath=True, cache=True)
def _add_rows(e, i0, v, row0, count, out, h, Dv):
    """out[h + r] += sum over k < count of e[r, i0 + k] * v[row0 + k] for each head r < R
    (e [R, m]; v float16 bits or float32 rows): simd.cache_axpy4 four rows and up to HEADS
    heads at a time over the first Dv columns, loops for the rest."""
    R = e.shape[0]
    r = 0
    while r < R:
        m = min(simd.HEADS, R - r)
        k = 0
        while k + 4 <= count:
            _axpy4(e, r, i0 + k, v, row0 + k, out, h + r, Dv, m)
            k += 4
        r += m
    for r in range(R):
        for k in range(count - count % 4, count):
            x = e[r, i0 + k]
            for d in range(Dv):
                out[h + r, d] += x * simd.as_float(v[row0 + k, d])
        for k in range(count):
            x = e[r, i0 + k]
            for d in range(Dv, out.shape[1]):
                out[h + r, d] += x * simd.as_float(v[row0 + k, d])


@njit(fastmath=True, cache=True)
def _attention_slots(q, kg, vg, pg, o, q_pos, scale, window, s0, s1, g, R, out, top, total,
                     probs):
    """Softmax attention of one query per head q [Q, D] over the cache slots [s0, s1) of KV head
    g, not yet normalized, for the R query heads h that read it: top[h] = the largest score,
    total[h] = sum of e**(score - top), and out[h] [D] = sum of e**(score - top) * v; probs
    [Q, S] (when not empty) gets the e**(score - top). kg, vg: the head's keys and values, slot
    s in row s - o, float16 bits (uint16) or float32 [S - o, D]; pg [S] the positions the slots
    hold. The R heads read the rows while they are in cache; the vector parts are
    simd.cache_dots / cache_axpy4, the last D % LANES columns a loop."""
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
        _row_scores(q, g * R, R, kg, s - o, Dv, scale, scores, s - s0)
    _softmax(scores, n, s0, s1, g, top, total, probs)
    if n > 0:                    # (else no visible slot: every head's total is 0)
        _add_rows(scores, 0, vg, s0 - o, n, out, g * R, Dv)


@njit(fastmath=True, cache=True)
def _attention_qslots(q, kc, ks, vc, vs, fk, fv, where, q_pos, k_pos, scale, window, s0, s1, g,
                      out, top, total, probs):
    """_attention_slots over a quantized cache (kernels.kv_quant, float16 arrays as uint16 bits),
    read in place: a block in the float pool as float16 rows, a quantized one as its codes
    (kv.add_codes: each row of codes taken apart once for the R query heads, their sums in
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
                if seen[i]:
                    _row_scores(q, g * R, R, fk[g, e], i, Dv, scale, scores, a0 - s0 + i)
                else:
                    scores[:, a0 - s0 + i] = -np.inf
            continue
        for d in range(D):           # the block's scores, B slots at a time along each channel
            sz[0, d], sz[1, d] = simd.as_float(ks[g, j, 0, d]), simd.as_float(ks[g, j, 1, d])
        for r in range(R):
            b = np.float32(0)
            for d in range(D):
                wk[r, d, 0] = q[g * R + r, d] * sz[0, d]
                b += q[g * R + r, d] * sz[1, d]
            kb[r, :] = b
        kv.add_codes(wk, kc[g, j], bits, B, kb)
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
            _add_rows(scores, a0 - s0, fv[g, e], 0, m, out, g * R, Dv)
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
        kv.add_codes(wv, vc[g, a0:a0 + m], bits, Gv, out[g * R:(g + 1) * R])
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
                    for d in range(D):   # (not out[t, h] += ...: see layer._layer_qkv)
                        out[t, h, d] += f * outs[t, b, h, d]
            for d in range(D):
                out[t, h, d] /= denom
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


@njit(parallel=prange_only(), fastmath=True, cache=True)
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


@njit(parallel=prange_only(), fastmath=True, cache=True)
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
