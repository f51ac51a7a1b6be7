"""Numba CUDA kernels that keep a decode step's bookkeeping on the GPU, so that a step needs no
input from the host and can be captured once in a CUDA graph and replayed (tinyrt.device_decode
runs them): the step's position, the slot each KV head's new token takes (by the cache
policy's rule: dense, sink, h2o), the slot tables, H2O's decayed scores and its eviction
choice, the RoPE angles of the position, and the sinks' re-rotation.

Every value that changes from step to step lives in device memory: the state vector `state`
(int64 [N_STATE], fields below) and the tables. A step's kernels read the state that `begin`
wrote; `begin` is one thread, so no kernel reads a field while another writes it.
"""

from __future__ import annotations

import math

from numba import cuda, float32, float64, int64

from . import launchers
from .launchers import blocks
# (THREADS: imported, a constant where a kernel compiles)
from .primitives import HALF_MAX, THREADS, clip, greater, rotate


# the fields of `state` (int64): this step's position and (dense/sink) slot; the next position;
# the tokens held; whether this step evicts (h2o); the sinks' shift (SinkCache.sink_shift) and
# the shift they are rotated for; whether the sinks' un-rotated copies were taken; the slots
# [0, span) that attention reads (the cache's span: those in use)
POS, SLOT, NEXT, LENGTH, EVICT, SHIFT, ROTATED, COPIES, SPAN = range(9)
N_STATE = 9

DENSE, SINK, H2O = range(3)


@cuda.jit(cache=True)
def begin(state, policy, n_sink, size, ring):
    """One thread: commit the last step's sink rotation, then take the next position and, for
    dense and sink, its slot, and the span (KVCache / SinkCache / H2OCache.allocate for one
    token; slack 0: h2o's slots in use are [0, length), its new token's among them)."""
    if cuda.grid(1) != 0:
        return
    if state[SHIFT] != state[ROTATED]:        # rotate_sinks ran last step: its copies exist
        state[COPIES] = 1
        state[ROTATED] = state[SHIFT]
    pos = state[NEXT]
    state[POS] = pos
    state[NEXT] = pos + 1
    if policy == DENSE:
        state[SLOT] = pos
        state[LENGTH] = pos + 1
        state[SPAN] = greater(state[SPAN], pos + 1)
        return
    state[SLOT] = pos if pos < n_sink else n_sink + (pos - n_sink) % ring
    state[EVICT] = 1 if state[LENGTH] >= size else 0
    if state[LENGTH] < size:
        state[LENGTH] += 1
    state[SHIFT] = pos + 1 - size if pos + 1 > size else 0
    state[SPAN] = state[LENGTH] if policy == H2O else greater(state[SPAN], state[SLOT] + 1)


@cuda.jit(cache=True)
def take_slot(state, slots, table):
    """Dense and sink: this step's slot in every KV head's row of slots [G, 1], its position in
    the table [1, C] they share."""
    if cuda.grid(1) == 0:
        for g in range(slots.shape[0]):
            slots[g, 0] = state[SLOT]
        table[0, state[SLOT]] = state[POS]


@cuda.jit(cache=True)
def take_slot_h2o(state, slots, table, score, n_sink, recent, decay, floor):
    """H2O, one block per row (a KV head of a layer) of the tables [R, C] and scores [R, C]:
    every score decays (H2OCache.allocate: times decay, below floor 0); the new token takes the
    next free slot, or once the cache is full the slot of the lowest score among those holding a
    position in [n_sink, pos - recent] (ties: the lowest slot), whose score becomes 0."""
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    C = table.shape[1]
    pos = state[POS]
    best = float32(math.inf)
    best_slot = C
    for s in range(tid, C, THREADS):
        sc = score[row, s] * decay
        if sc < floor:
            sc = float32(0)
        score[row, s] = sc
        p = table[row, s]
        if p >= n_sink and p <= pos - recent and sc < best:
            best, best_slot = sc, s
    vals = cuda.shared.array(THREADS, float32)
    where = cuda.shared.array(THREADS, int64)
    vals[tid] = best
    where[tid] = best_slot
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            o = tid + stride
            if vals[o] < vals[tid] or (vals[o] == vals[tid] and where[o] < where[tid]):
                vals[tid] = vals[o]
                where[tid] = where[o]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        slot = where[0] if state[EVICT] else state[LENGTH] - 1
        slots[row, 0] = slot
        table[row, slot] = pos
        score[row, slot] = float32(0)


@cuda.jit(cache=True)
def rope_row(inv_freq, state, cos, sin):
    """cos, sin [1, D/2] of this step's position (reference.rope_tables: angles in float64)."""
    i = cuda.grid(1)
    if i < inv_freq.shape[0]:
        ang = float64(state[POS]) * float64(inv_freq[i])
        cos[0, i] = float32(math.cos(ang))
        sin[0, i] = float32(math.sin(ang))


@cuda.jit(cache=True)
def rotate_sinks(k, v, sink_k, sink_v, state, inv_freq, top):
    """SinkCache._rotate_sinks on the device: where this step's shift differs from the one the
    sinks are rotated for, the sinks' keys in every row of k, v [R, C, D] (slots [0, n)) become
    their un-rotated copies sink_k [n, R, D] (float32) rotated to positions i + shift, values
    from sink_v. The copies are taken here the first time (state COPIES 0: the sinks then
    rotated by their own positions i), one thread per pair (i, i + D/2) of a sink of a row."""
    x = cuda.grid(1)
    n, R, D = sink_k.shape
    half = D // 2
    shift = state[SHIFT]
    if x >= n * R * half or shift == state[ROTATED]:
        return
    i, rest = x // (R * half), x % (R * half)
    r, d = rest // half, rest % half
    if state[COPIES] == 0:
        ang = float64(i) * float64(inv_freq[d])
        c, s = float32(math.cos(ang)), float32(math.sin(ang))
        x1, x2 = float32(k[r, i, d]), float32(k[r, i, d + half])
        sink_k[i, r, d], sink_k[i, r, d + half] = rotate(x1, x2, c, -s)   # by -angle
        sink_v[i, r, d] = float32(v[r, i, d])
        sink_v[i, r, d + half] = float32(v[r, i, d + half])
    ang = float64(i + shift) * float64(inv_freq[d])
    c, s = float32(math.cos(ang)), float32(math.sin(ang))
    x1, x2 = sink_k[i, r, d], sink_k[i, r, d + half]
    y1, y2 = rotate(x1, x2, c, s)
    k[r, i, d] = clip(y1, -top, top)
    k[r, i, d + half] = clip(y2, -top, top)
    v[r, i, d] = clip(sink_v[i, r, d], -top, top)
    v[r, i, d + half] = clip(sink_v[i, r, d + half], -top, top)


def launch_begin(state, policy: int, n_sink: int, size: int, ring: int) -> None:
    launchers.launch(begin, 1, 1, state, policy, n_sink, size, ring)


def launch_take_slot(state, slots, table) -> None:
    launchers.launch(take_slot, 1, 1, state, slots, table)


def launch_take_slot_h2o(state, slots, table, score, n_sink: int, recent: int, decay,
                         floor) -> None:
    launchers.launch(take_slot_h2o, table.shape[0], THREADS, state, slots, table, score, n_sink,
            recent, float32(decay), float32(floor))


def launch_rope_row(inv_freq, state, cos, sin) -> None:
    launchers.launch(rope_row, blocks(inv_freq.shape[0], THREADS), THREADS, inv_freq, state,
            cos, sin)


def launch_rotate_sinks(k, v, sink_k, sink_v, state, inv_freq) -> None:
    top = float32(HALF_MAX if str(k.dtype).endswith("float16") else math.inf)
    n, R, D = sink_k.shape
    launchers.launch(rotate_sinks, blocks(n * R * (D // 2), THREADS), THREADS, k, v, sink_k,
            sink_v, state, inv_freq, top)
