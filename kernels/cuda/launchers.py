"""The launchers: each kernel's grid and block, and every launch on torch's current stream."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from .. import kv_quant
from .gemv import ROWS_PER_WARP, group_shift, q4_gemv, q8_gemv, q_dequantize, width
from .kernels import (add_rmsnorm, attention_combine, attention_scores, attention_split,
                      attention_splits, gemv, rope, rope_store, silu_mul, store_kv)
from .kv import MAX_CODES, attention_decode_q, dequantize_kv, store_kv_q
from .primitives import HALF_MAX, LANES, NORM_THREADS, ROWS, SIM, THREADS

SCORES_MAX = 2 ** 24     # the most floats of scores [T, Q, S] one launch set of attention keeps


def blocks(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


def _size(a) -> int:
    """Elements of a NumPy array or a torch tensor (whose `size` is a method)."""
    return math.prod(a.shape)


_streams: dict = {}


def launch(kernel, grid, block, *args) -> None:
    """Every launch, on torch's current stream: the GPU runs the kernels in torch's order, and
    a CUDA graph that torch captures sees them. Numba's CUDA simulator has no streams and takes
    NumPy arrays: there a torch tensor goes in as a NumPy view of its memory (the kernel's
    writes land in it), and the rest is the same code."""
    if SIM:
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


def _pairs(x):
    """x [n]'s int64 view, its inputs in pairs for 8-byte loads (an odd n's last input left
    out; a copy where x starts at an odd float, which no 8-byte load can)."""
    n = x.shape[0] - x.shape[0] % 2
    if isinstance(x, np.ndarray):
        return x[:n].view(np.int64)
    import torch

    return (x if x.storage_offset() % 2 == 0 else x.clone())[:n].view(torch.int64)


class SplitSums(NamedTuple):
    """Where a split-K GEMV's blocks leave their sums for the last of them to add up (one for
    every GEMV of a stream: they run one after another)."""

    parts: object        # float32 [SPLITS, most outputs]
    arrived: object      # int32 [most row blocks]: 0 between launches (the kernel leaves it so)


SPLITS = 2


def split_sums(zeros, most_out: int) -> SplitSums:
    """SplitSums for GEMVs of up to most_out outputs; zeros(shape, dtype) allocates (the
    backend's, on the device)."""
    return SplitSums(zeros((SPLITS, most_out), np.float32),
                     zeros((blocks(most_out, ROWS_PER_WARP * ROWS),), np.int32))


ACTS = {None: 0, "silu": 1, "gelu": 2}     # the GEMV's act: y as it is, or a gated MLP's


def launch_q_gemv(x, w, y, sums: SplitSums, act: str | None = None) -> None:
    """y [out] = x [in] @ W.T for a GpuQuant w; y a torch tensor or a NumPy array. With act
    ("silu", "gelu"), w a gated MLP's fused gate|up [2I, in] and y [I] = act(gate) * up. sums:
    the split-K GEMV's scratch (split_sums), where x and y are."""
    _lanes(w)
    if act is not None and 2 * y.shape[0] != w.shape[0]:
        raise ValueError(f"gated GEMV of {w.shape[0]} rows into {y.shape[0]} outputs")
    rows = blocks(y.shape[0], ROWS) if act else blocks(w.shape[0], ROWS_PER_WARP * ROWS)
    splits = SPLITS if rows < SPLIT_BELOW and width(w.bits, w.n_in, LANES) >= 2 * LANES else 1
    if sums.parts.shape[1] < w.shape[0]:
        raise ValueError(f"split sums for {sums.parts.shape[1]} outputs, not {w.shape[0]}")
    launch(q4_gemv if w.bits == 4 else q8_gemv, (rows, splits), (LANES, ROWS), x, _pairs(x),
           w.codes, w.scale, w.offset, w.n_in, w.group, group_shift(w.bits, w.group), ACTS[act],
           y, sums.parts, sums.arrived)


def launch_gemv(x, w, y) -> None:
    launch(gemv, blocks(w.shape[0], ROWS), (LANES, ROWS), x, w, y)


def norm_threads(n: int) -> int:
    """The threads of a block that norms a row of n: a power of two, up to NORM_THREADS."""
    return min(NORM_THREADS, 1 << max(0, n - 1).bit_length())


def launch_rmsnorm(x, w, eps: float, y, d=None) -> None:
    """y [T, H] = RMSNorm of x; given d [T, H], x += d first (in place)."""
    launch(add_rmsnorm, x.shape[0], norm_threads(x.shape[1]), x, x if d is None else d,
           0 if d is None else 1, w, np.float32(eps), y)


def launch_rope(x, cos, sin, y) -> None:
    T, N, D = x.shape
    launch(rope, blocks(T * N * (D // 2), THREADS), THREADS, x, cos, sin, y)


def launch_silu_mul(gu, y) -> None:
    launch(silu_mul, blocks(y.shape[0] * y.shape[1], THREADS), THREADS, gu, y)


def _top(buf) -> np.float32:
    """What a store into a cache buffer clamps to: float16's largest, or none (numpy or torch)."""
    return np.float32(HALF_MAX if str(buf.dtype).endswith("float16") else np.inf)


def launch_store_kv(k_buf, v_buf, slots, k, v) -> None:
    launch(store_kv, blocks(_size(k), THREADS), THREADS, k_buf, v_buf, slots, k, v, _top(k_buf))


def launch_rope_store(qkv, bias, q_norm, k_norm, eps: float, cos, sin, k_buf, v_buf, slots,
                      q) -> None:
    """kernels.rope_store: q [T, Q, D] and the cache's new K, V rows from qkv [T, (Q + 2G) D];
    bias, q_norm, k_norm: vectors, or empty ones for none."""
    T, Q, D = q.shape
    launch(rope_store, (Q + k_buf.shape[0], T), norm_threads(D), qkv, bias, q_norm, k_norm,
           np.float32(eps), cos, sin, k_buf, v_buf, slots, _top(k_buf), q)


def launch_attention(q, k, v, q_pos, k_pos, live, scale: float, window: int, score, out, empty,
                     chunk: int | None = None) -> None:
    """out [T, Q, D] = attention of the queries q [T, Q, D] at positions q_pos [T] (int64) over
    a float cache k, v [G, C, D] whose slots [0, S) hold positions k_pos [Gk, S] (int64; Gk: G
    or 1), of which the first live[0] are read (live: int64 [1] on the device, which a CUDA
    graph's replays read afresh); window 0: none; score [G, C] (H2O; [G, 0]: none) gets each
    slot's weights added. empty(shape) allocates float32 scratch on the device: the scores
    [T, Q, S] and the splits' partials, for queries in batches whose scores stay under
    SCORES_MAX floats (a long prompt). chunk: the slots a split takes (default: the kernels
    cut the live slots into attention_splits' splits)."""
    T, Q, D = q.shape
    G, S = k.shape[0], k_pos.shape[1]
    n = max(1, min(T, SCORES_MAX // max(1, Q * S), 65535))    # (65535: a grid's z limit)
    splits = blocks(S, chunk) if chunk else attention_splits(Q, n)
    probs, part = empty((n, Q, S)), empty((n, Q, splits, D))
    ml, stats = empty((n, Q, splits, 2)), empty((n, Q, 2))
    for a in range(0, T, n):
        b = min(T, a + n)
        probs_b, part_b, ml_b, stats_b = (x[:b - a] for x in (probs, part, ml, stats))
        launch(attention_split, (Q, splits, b - a), THREADS, q[a:b], k, v, q_pos[a:b], k_pos,
                live, np.float32(scale), window, chunk or 0, probs_b, part_b, ml_b)
        launch(attention_combine, (Q, b - a), THREADS, part_b, ml_b, S, live, chunk or 0,
                out[a:b], stats_b)
        if score.shape[1] > 0:
            launch(attention_scores, blocks(G * S, THREADS), THREADS, probs_b, stats_b, live,
                    score)


def launch_store_kv_q(store: kv_quant.QuantKV, slots, k, v) -> None:
    """kv_quant.store_kv of k, v [T, N, D] at slots [N, T] into the store's N rows."""
    if max(store.block, store.head_dim) > MAX_CODES:
        raise ValueError(f"a quantized cache's block and head dim must be at most {MAX_CODES}")
    launch(store_kv_q, slots.shape[0], THREADS, *store[:-1], store.pin, slots, k, v)


def launch_dequantize_kv(store: kv_quant.QuantKV, k_out, v_out) -> None:
    N, S, D = k_out.shape
    launch(dequantize_kv, blocks(N * S * D, THREADS), THREADS, *store[:7], k_out, v_out)


def launch_attention_decode_q(q, store: kv_quant.QuantKV, q_pos: int, k_pos, scale: float,
                              window: int, score, probs, out) -> None:
    launch(attention_decode_q, q.shape[0], THREADS, q, *store[:7], q_pos, k_pos,
            np.float32(scale), window, score, probs, out)


def launch_q_dequantize(w, dst) -> None:
    _lanes(w)
    launch(q_dequantize, blocks(w.codes.shape[0], THREADS), THREADS, w.codes, w.scale, w.offset,
           w.bits, w.n_in, w.group, dst)
