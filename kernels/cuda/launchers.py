"""The launchers: each kernel's grid and block, and every launch on torch's current stream."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from .. import kv_quant
from . import attention, gemv
from .gemv import q_dequantize
from .kernels import add_rmsnorm, rope, rope_store, silu_mul, store_kv
from .kv import MAX_CODES, attention_decode_q, dequantize_kv, store_kv_q
from .primitives import HALF_MAX, LANES, NORM_THREADS, SIM, THREADS

SCORES_MAX = 2 ** 24     # the most floats of scores [T, Q, S] one launch set of attention keeps


def blocks(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


def _size(a) -> int:
    """Elements of a NumPy array or a torch tensor (whose `size` is a method)."""
    return math.prod(a.shape)


_streams: dict = {}


def _host(a):
    """A launch's argument in the simulator: a torch tensor as a NumPy view of its memory (the
    kernel's writes land in it); one of other strides (an input: a GPU's kernel reads any, the
    simulator only contiguous arrays) as a contiguous copy."""
    if not hasattr(a, "numpy") or isinstance(a, np.ndarray):
        return a
    return np.ascontiguousarray(a.numpy())


def launch(kernel, grid, block, *args, shared: int = 0) -> None:
    """Every launch, on torch's current stream: the GPU runs the kernels in torch's order, and
    a CUDA graph that torch captures sees them; `shared`: bytes of dynamic shared memory. Numba's
    CUDA simulator has no streams and takes NumPy arrays: there a torch tensor goes in as a
    NumPy view of its memory (the kernel's writes land in it), and the rest is the same code."""
    if SIM:
        kernel[grid, block, 0, shared](*(_host(a) for a in args))
        return
    import torch

    handle = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = cuda.external_stream(handle)
    kernel[grid, block, stream, shared](*args)


def _lanes(w) -> None:
    if w.lanes != LANES:
        raise ValueError(f"codes tiled for {w.lanes} lanes, kernels launched with {LANES}")


class SplitSums(NamedTuple):
    """Where a GEMV's blocks leave the sums of the row blocks they share, for the last of them
    to add up (one for every GEMV of a stream: they run one after another)."""

    parts: object        # float32 [most tiles, most rows]
    lens: object         # int32 [most row blocks x WARPS x most tiles]
    arrived: object      # int32 [most row blocks x WARPS]: 0 between launches (left so)


STAGED_BYTES = 48 * 1024    # the most x a block stages (more dynamic shared memory than 48 KB
                            # needs an opt-in Numba does not make)


def sums_needed(w) -> tuple[int, int]:
    """(rows, tiles) of the SplitSums a GEMV of w (a GpuQuant) needs."""
    return w.shape[0] + gemv.PAD_ROWS, gemv.width(w.bits, w.n_in, LANES) // LANES


def split_sums(zeros, rows: int, tiles: int) -> SplitSums:
    """SplitSums for GEMVs of up to `rows` rows and `tiles` tiles; zeros(shape, dtype)
    allocates (the backend's, on the device)."""
    rb = blocks(rows, gemv.R) * gemv.WARPS      # ((row block, warp)s: at most rows / R)
    return SplitSums(zeros((tiles, rows), np.float32), zeros((rb * tiles,), np.int32),
                     zeros((rb,), np.int32))


def fits(sums: SplitSums, w) -> bool:
    """Whether sums serve a GEMV of w."""
    rows, tiles = sums_needed(w)
    return sums.parts.shape[0] >= tiles and sums.parts.shape[1] >= rows


ACTS = {None: 0, "silu": 1, "gelu": 2}     # the GEMV's act: y as it is, or a gated MLP's

_sms: dict = {}


def resident_blocks() -> int:
    """Blocks of a GEMV the GPU holds at once (its SMs times gemv.BLOCKS_PER_SM; a few in the
    simulator)."""
    if SIM:
        return 4
    import torch

    dev = torch.cuda.current_device()
    if dev not in _sms:
        _sms[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _sms[dev] * gemv.BLOCKS_PER_SM


def gemv_grid(w, per_slab: int | None = None) -> tuple[int, int, int]:
    """(blocks, slabs, dynamic shared bytes) of a GEMV of w: its tiles in slabs of at most
    STAGED_BYTES of x, each slab's units shared among the GPU's resident blocks / slabs (or
    per_slab of them)."""
    tiles = gemv.width(w.bits, w.n_in, LANES) // LANES
    staged = LANES * gemv.stride(w.bits) * 8             # a tile's bytes in shared memory
    slabs, share = gemv_slabs(tiles, staged)
    per = per_slab or max(1, resident_blocks() // slabs)
    return per * slabs, slabs, share * staged


def gemv_slabs(tiles: int, staged: int) -> tuple[int, int]:
    """(slabs, tiles a slab) of a GEMV of `tiles` tiles of `staged` bytes each in shared
    memory: as few slabs as STAGED_BYTES allows, of equal tiles but the last."""
    slabs = min(tiles, -(-tiles * staged // STAGED_BYTES))
    share = -(-tiles // slabs)
    return -(-tiles // share), share


def launch_gemv(x, w, y, sums: SplitSums, act: str | None = None, norm=None, res=None,
                per_slab: int | None = None) -> None:
    """y [out] = x [in] @ W.T for a GpuQuant w (4- or 8-bit codes, or float16 weights); x, y
    torch tensors or NumPy arrays. With act ("silu", "gelu"), w a gated MLP's fused gate|up
    [2I, in] and y [I] = act(gate) * up. norm (norm_w, eps): the input is x RMS-normed with eps
    times norm_w; res [out]: y = res + x @ W.T (a residual add). sums: the scratch of the
    row blocks that blocks share (split_sums), where x and y are; per_slab: the blocks a slab,
    forced (else as many as the GPU holds at once)."""
    _lanes(w)
    if act is not None and 2 * y.shape[0] != w.shape[0]:
        raise ValueError(f"gated GEMV of {w.shape[0]} rows into {y.shape[0]} outputs")
    if not fits(sums, w):
        raise ValueError(f"split sums too small for a layer of {w.shape[0]} rows")
    grid, slabs, shared = gemv_grid(w, per_slab)
    none = x[:0]
    norm_w, eps = norm if norm is not None else (none, 0.0)
    shift = gemv.group_shift(w.bits, w.group) if w.bits != 16 else 0
    launch(gemv.KERNELS[w.bits, shift < 0, act is not None], grid, (LANES, gemv.WARPS), x,
           norm_w, np.float32(eps),
           none if res is None else res, w.codes, w.scale, w.offset, w.n_in, w.group, shift,
           ACTS[act], y, sums.parts, sums.lens, sums.arrived, slabs, shared=shared)


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


def attention_splits(heads: int, T: int, rq: int, D: int) -> int:
    """The grid's splits for T queries of `heads` blocks of rq query heads: as many as the GPU
    holds blocks of the kernel at once, in one wave (a prompt's queries fill it alone), at most
    SPLIT_MAX."""
    fill = 8 if SIM else resident_blocks() // gemv.BLOCKS_PER_SM * attention.blocks_per_sm(rq, D)
    return max(1, min(attention.SPLIT_MAX, fill // (heads * T)))


def attention_counts(q, G: int) -> int:
    """The int32 counts launch_attention needs (for a launch set of q's queries, G KV heads)."""
    T, Q, D = q.shape
    return min(T, 65535) * G * attention.head_blocks(Q // G, attention.kernel_for(Q // G, D)[1])


def launch_attention(q, k, v, q_pos, k_pos, live, scale: float, window: int, score, out, empty,
                     counts, chunk: int | None = None) -> None:
    """out [T, Q, D] = attention of the queries q [T, Q, D] at positions q_pos [T] (int64) over
    a float cache k, v [G, C, D] whose slots [0, S) hold positions k_pos [Gk, S] (int64; Gk: G
    or 1), of which the first live[0] are read (live: int64 [1] on the device, which a CUDA
    graph's replays read afresh); window 0: none; score [G, C] (H2O; [G, 0]: none) gets each
    slot's weights added. empty(shape) allocates float32 scratch on the device: the splits'
    partials, and (H2O) the scores [T, Q, S], for queries in batches whose scores stay under
    SCORES_MAX floats (a long prompt). counts: int32 zeros, attention_counts(q, G) of them, left
    zeros. chunk: the slots a split takes (default: the kernel cuts the live slots into
    attention_splits' splits)."""
    T, Q, D = q.shape
    G, S = k.shape[0], k_pos.shape[1]
    kernel, rq = attention.kernel_for(Q // G, D)
    heads = G * attention.head_blocks(Q // G, rq)
    h2o = score.shape[1] > 0
    n = max(1, min(T, SCORES_MAX // max(1, Q * S) if h2o else T, 65535))  # (a grid's z limit)
    splits = blocks(S, chunk) if chunk else attention_splits(heads, n, rq, D)
    if counts.shape[0] < n * heads:
        raise ValueError(f"{counts.shape[0]} attention counts, not {n * heads}")
    probs, part = empty((n, Q, S if h2o else 0)), empty((n, Q, splits, D))
    ml, stats = empty((n, Q, splits, 2)), empty((n, Q, 2))
    for a in range(0, T, n):
        b = min(T, a + n)
        probs_b, part_b, ml_b, stats_b = (x[:b - a] for x in (probs, part, ml, stats))
        launch(kernel, (heads, splits, b - a), (LANES, attention.WARPS), q[a:b], k.reshape(-1),
               v.reshape(-1), k.shape[1], q_pos[a:b], k_pos, live, np.float32(scale), window,
               chunk or 0, probs_b, part_b, ml_b, counts, out[a:b], stats_b)
        if h2o:
            launch(attention.attention_scores, blocks(G * S, THREADS), THREADS, probs_b, stats_b,
                   live, score)


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


def launch_dequantize(w, dst, r0: int = 0) -> None:
    """dst [rows, n_in] = rows [r0, r0 + rows) of a GpuQuant's W, for a prompt's GEMM: a float16
    or float32 array, or an int16 one that gets bfloat16's bits."""
    _lanes(w)
    rows, per = dst.shape[0], gemv.chunk(w.bits)
    bf16 = int(str(dst.dtype).endswith("int16"))       # (a torch tensor's or a NumPy array's)
    launch(q_dequantize, blocks(rows * -(-w.n_in // per), THREADS), THREADS, w.codes, w.scale,
           w.offset, w.bits, w.n_in, w.group, gemv.width(w.bits, w.n_in, w.lanes), r0, bf16, dst)
