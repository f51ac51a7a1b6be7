"""The CUDA kernels against the NumPy reference, on fresh random inputs of tiny shapes: in Numba's
CUDA simulator where there is no GPU (CI), on the GPU where there is one (see conftest)."""

import json

import numpy as np
import pytest
from numba import cuda

from helpers import (PROMPT_ERR, assert_logits_close, quant_store, random_quant, random_weights,
                     rel_err, seeded_rng, tiny_config)
from tinyrt.kernels import kv_quant, quant
from tinyrt.kernels.cuda import (CudaBackend, attention, backend, gemv, kernels, kv, launchers,
                                primitives)
from tinyrt.kernels.cuda import step as device_step
from tinyrt.kernels import reference as ref

pytestmark = pytest.mark.usefixtures("quick_barriers")

rng = seeded_rng(__name__)


def run(launch, *arrays):
    """Call `launch` on device copies of the arrays; return them all copied back."""
    dev = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in arrays]
    launch(*dev)
    return [d.copy_to_host() if isinstance(a, np.ndarray) else d for a, d in zip(arrays, dev)]


def unpack_words(codes, bits, n_in, lanes):
    """The codes [out, n_in] of a flat int64 array in gemv.repack's layout, read as its docstring
    says: rows of gemv.width int64s (the last PAD_ROWS of them padding), input i at bits
    [bits (i % per), bits (i % per + 1)) of int64 i // per (per = 64 // bits)."""
    per = 64 // bits
    rows = np.asarray(codes).view(np.uint64).reshape(-1, gemv.width(bits, n_in, lanes))
    i = np.arange(n_in)
    q = (rows[:, i // per] >> (bits * (i % per)).astype(np.uint64)) & np.uint64(2 ** bits - 1)
    return q.astype(np.uint8)[:-gemv.PAD_ROWS], q[-gemv.PAD_ROWS:]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n_in, lanes, g", [(64, 4, 32), (80, 4, 16), (576, 32, 64), (512, 32, 128),
                                            (34, 32, 17)])
def test_repack_round_trip(bits, n_in, lanes, g):
    """gemv.repack's arrays hold every code where its docstring says, in whole tiles (padding:
    code 0), and each row's scales and offsets, padded with zeros to the tiles' groups; then
    PAD_ROWS rows of zeros."""
    w = random_quant(3, n_in, bits, g, True, rng)
    codes, scale, offset = gemv.repack(quant.flat(w, bits), lanes)
    tile = lanes * 64 // bits
    assert codes.dtype == np.int64
    assert codes.shape == ((3 + gemv.PAD_ROWS) * -(-n_in // tile) * lanes,)
    got, pad = unpack_words(codes, bits, n_in, lanes)
    assert np.array_equal(got, quant.unpack(w)) and not pad.any()
    padded = -(-n_in // tile) * tile
    assert not unpack_words(codes, bits, padded, lanes)[0][:, n_in:].any()
    s, m = quant.scales(w)
    groups = -(-padded // g)
    for got, want in ((scale, s), (offset, m)):
        got = got.reshape(3 + gemv.PAD_ROWS, groups)
        assert not got[3:].any()
        assert np.array_equal(got[:3, :n_in // g], want) and not got[:3, n_in // g:].any()


@pytest.mark.parametrize("n_in, n_out, g, bits, half", [
    (64, 24, 32, 4, True), (128, 26, 64, 4, False), (96, 8, 16, 8, False),
    (80, 7, 16, 4, True),     # 2.5 tiles of 32 inputs (4 lanes)
    (36, 3, 6, 8, True),      # groups of 6: neither a multiple nor a divisor of 4 lanes
    (34, 4, 17, 8, False),    # a last tile with lanes of padding only
    (34, 5, 34, 16, True)])   # float16 weights
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dequantize(n_in, n_out, g, bits, half, dtype):
    """launch_dequantize (a prompt's weights for its GEMM) writes rows [r0, r0 + rows) of a
    prepared layer, every element (dst starts as NaN), none of the padding: float32 exactly,
    float16 and bfloat16 rounded to nearest even (bfloat16's bits in an int16 array); where
    no GPU contracts its multiply-adds, exactly."""
    import torch

    be = CudaBackend()
    w = random_quant(n_out, n_in, bits, g, half, rng) if bits < 16 else \
        rng.standard_normal((n_out, n_in)).astype(np.float16)
    dev = be.prepare_linear([w])
    assert dev.shape == (n_out, n_in)
    want = quant.dequantize(w) if bits < 16 else w.astype(np.float32)
    r0 = n_out // 3
    dst = torch.full((n_out - r0, n_in), float("nan"), dtype=getattr(torch, dtype),
                     device=be.device)
    launchers.launch_dequantize(dev, dst.view(torch.int16) if dtype == "bfloat16" else dst, r0)
    dst = dst.cpu()
    ulp = {"bfloat16": 2 ** -8, "float16": 2 ** -11, "float32": 1e-6}[dtype]
    # (a GPU may fuse q s + m into one FMA: one rounding less than NumPy's, and so rarely the
    # other 16-bit neighbour)
    assert np.allclose(dst.float().numpy(), want[r0:], rtol=ulp, atol=1e-7)
    if primitives.SIM:
        assert torch.equal(dst, torch.tensor(want[r0:]).to(dst.dtype))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_float_layers(dtype):
    """A float layer (float16 or float32 weights, held as float16: the GEMV's bits 16): one
    token's product, and a prompt's through the dequantized copy, against the reference's of
    the float16 values (the prompt's GEMM in float32 here: its 16-bit ones, test_prompt_gpu)."""
    import torch

    be = CudaBackend(prompt_dtype=torch.float32)
    w = rng.standard_normal((37, 70)).astype(dtype)
    dev = be.prepare_linear([w])
    assert dev.bits == 16
    want = w.astype(np.float16).astype(np.float32)
    for T in (1, 3):
        x = rng.standard_normal((T, 70)).astype(np.float32)
        assert rel_err(be.to_numpy(be.linear(be.dev(x), dev)), ref.linear(x, want)) < 1e-5


def test_rmsnorm_rope_silu():
    x = rng.standard_normal((3, 200)).astype(np.float32)
    w = rng.standard_normal(200).astype(np.float32)
    (y,) = run(lambda x, w, y: launchers.launch_rmsnorm(x, w, 1e-5, y), x, w, np.empty_like(x))[-1:]
    assert rel_err(y, ref.rmsnorm(x, w, 1e-5)) < 1e-5

    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    cos, sin = ref.rope_tables(1 / 10000 ** (np.arange(8) / 8), np.array([0, 7, 1000]))
    (y,) = run(launchers.launch_rope, x, cos, sin, np.empty_like(x))[-1:]
    assert rel_err(y, ref.rope(x, cos, sin)) < 1e-6

    gu = (rng.standard_normal((2, 40)) * 30).astype(np.float32)
    (y,) = run(launchers.launch_silu_mul, gu, np.empty((2, 20), np.float32))[-1:]
    assert rel_err(y, ref.ReferenceBackend.swiglu(gu)) < 1e-6


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_store_kv(dtype):
    k_buf, v_buf = np.zeros((2, 9, 8), dtype), np.zeros((2, 9, 8), dtype)
    k, v = rng.standard_normal((3, 2, 8)).astype(np.float32), rng.standard_normal((3, 2, 8)).astype(np.float32)
    k[0, 0, 0] = 1e6
    slots = np.array([[4, 0, 8], [1, 7, 2]])
    want_k, want_v = k_buf.copy(), v_buf.copy()
    ref.ReferenceBackend.store_kv(want_k, want_v, slots, k, v)
    got_k, got_v = run(launchers.launch_store_kv, k_buf, v_buf, slots, k, v)[:2]
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)


def attend(q, k, v, q_pos, k_pos, window, score, chunk=None, live=None):
    """launchers.launch_attention on device copies, scratch from cuda.device_array: (out, score);
    live: the slots of k_pos read (default: all). Its counts of the splits are left zeros (for
    the next launch: a graph replays them)."""
    out = np.empty(q.shape, np.float32)
    live = np.array([k_pos.shape[1] if live is None else live])
    counts = np.zeros(launchers.attention_counts(q, k.shape[0]), np.int32)
    got = run(lambda *a: launchers.launch_attention(
        *a[:6], 0.25, window, *a[6:8], lambda shape: cuda.device_array(shape, np.float32), a[8],
        chunk), q, k, v, q_pos, k_pos, live, score, out, counts)
    assert not got[-1].any()
    return got[-2], got[-3]


def ring(G, S, last, after, rng):
    """A ring buffer's slot table [G, S]: positions in any order, `after` of them past `last`
    (hidden), about a tenth free (-1)."""
    k_pos = np.stack([rng.permutation(S) + last - S + 1 + after for _ in range(G)])
    k_pos[rng.random(k_pos.shape) < 0.1] = -1
    return k_pos


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("T, tables, h2o", [(1, "per head", True), (1, "one", False),
                                            (3, "per head", True), (3, "one", False)])
def test_attention(ratio, window, dtype, T, tables, h2o):
    """Flash-decoding over a float cache against the reference: T queries (a prompt's, each
    hiding later ones' slots) over a ring buffer (positions in any order, some free, some after
    the queries), a slot table per KV head with H2O's scores (h2o) or one for all ([1, S]: dense
    and sink caches); S below the capacity C."""
    rng = seeded_rng()
    G, D, C, S = 2, 16, 48, 40
    Q = G * ratio
    q_pos = 400 - 2 * np.arange(T)[::-1]
    q = rng.standard_normal((T, Q, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, C, D)).astype(dtype) for _ in range(2))
    k_pos = ring(G if tables == "per head" else 1, S, q_pos[-1], 6, rng)
    score = rng.random((G, C)).astype(np.float32) if h2o else np.zeros((G, 0), np.float32)
    want_score = score.copy()
    want = ref.attention(q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos, 0.25,
                         window or None, want_score if h2o else None)
    got, got_score = attend(q, k, v, q_pos, k_pos, window, score)
    assert rel_err(got, want) < 1e-5
    if h2o:
        assert rel_err(got_score, want_score) < 1e-6


def test_attention_in_splits_and_batches(monkeypatch):
    """Splits of 8 slots, one of them all free or hidden, another past the query; a prompt's
    queries in batches of two (SCORES_MAX small), one of them seeing no slot (its output 0):
    against the reference, scores included."""
    rng = seeded_rng()
    G, Q, D, S, chunk = 2, 4, 8, 45, 8
    monkeypatch.setattr(launchers, "SCORES_MAX", 2 * Q * S)
    q_pos = np.array([50, 51, 3, 53, 54])                 # query 2: before every position (14..)
    k_pos = ring(G, S, q_pos[-1], 4, rng)
    k_pos[:, 8:16] = -1
    k_pos[:, 16:24] = rng.integers(55, 99, (G, 8))        # after every query
    q = rng.standard_normal((len(q_pos), Q, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, S, D)).astype(np.float32) for _ in range(2))
    score = rng.random((G, S)).astype(np.float32)
    seen = q_pos != 3
    want_score = score.copy()
    want = ref.attention(q[seen], k, v, q_pos[seen], k_pos, 0.25, None, want_score)
    got, got_score = attend(q, k, v, q_pos, k_pos, 0, score, chunk)
    assert rel_err(got[seen], want) < 1e-5 and not got[~seen].any()
    assert rel_err(got_score, want_score) < 1e-6
    assert launchers.attention_splits(2, 1, 1, 16) > 1   # a decode step's default: splits


@pytest.mark.parametrize("cache", ["dense", "sink", "h2o"])
@pytest.mark.parametrize("T, chunk", [(1, None), (2, None), (1, 8)])
def test_attention_reads_only_the_slots_held(cache, T, chunk):
    """Attention over the first n of C slots, n read from the device (live, as a decode step's
    span): the reference's over those n and, bit for bit, the kernels' over a table of n slots
    (as the host's steps give it). The slots past n are never visited: they hold positions the
    queries would see, but NaN keys and values (a visit makes the output NaN), and h2o's scores
    there stay as they were. A dense cache's positions in order, a sink cache's ring in any
    order (one table), h2o's per KV head with scores; the kernels' splits, or splits of 8."""
    rng = seeded_rng()
    G, R, D, C, n = 2, 2, 16, 96, 21
    q_pos = 300 + np.arange(T)
    if cache == "dense":
        k_pos = np.arange(C)[None] + q_pos[-1] - n + 1
    else:
        k_pos = ring(G if cache == "h2o" else 1, C, q_pos[-1], 2, rng)
    k_pos[:, n:] = rng.integers(0, q_pos[0], (k_pos.shape[0], C - n))
    q = rng.standard_normal((T, G * R, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, C, D)).astype(np.float16) for _ in range(2))
    k[:, n:] = v[:, n:] = np.nan
    score = rng.random((G, C)).astype(np.float32) if cache == "h2o" else np.zeros((G, 0),
                                                                                  np.float32)
    want_score = score.copy()
    want = ref.attention(q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos[:, :n],
                         0.25, None, want_score if cache == "h2o" else None)
    got, got_score = attend(q, k, v, q_pos, k_pos, 0, score.copy(), chunk, live=n)
    assert rel_err(got, want) < 1e-5
    held, held_score = attend(q, k, v, q_pos, np.ascontiguousarray(k_pos[:, :n]), 0, score.copy(),
                              chunk)
    assert np.array_equal(got, held) and np.array_equal(got_score, held_score)
    if cache == "h2o":
        assert rel_err(got_score, want_score) < 1e-6
        assert np.array_equal(got_score[:, n:], score[:, n:])


@pytest.mark.parametrize("H", [300, 5])
def test_add_rmsnorm(H):
    """The residual add and the norm after it in one launch: x becomes x + d (the add's floats),
    and the output is x + d's RMSNorm: rmsnorm's alone, bit for bit, and the reference's. Rows
    wider than a block's threads and narrower."""
    be = CudaBackend()
    x, d = (rng.standard_normal((2, H)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(H).astype(np.float32)
    x_dev = be.dev(x)
    y = be.to_numpy(be.add_rmsnorm(x_dev, be.dev(d), be.dev(w), 1e-5))
    assert np.array_equal(be.to_numpy(x_dev), x + d)
    assert np.array_equal(y, be.to_numpy(be.rmsnorm(be.dev(x + d), be.dev(w), 1e-5)))
    assert rel_err(y, ref.rmsnorm(x + d, w, 1e-5)) < 1e-5


@pytest.mark.parametrize("extra", ["none", "bias", "q/k norms"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rope_store(extra, dtype):
    """A q|k|v projection's output made ready in one launch (rope_store) as the backend's ops
    make it one by one (LlamaModel.attention: the bias (Qwen2's), each head's q/k norm
    (Qwen3's), RoPE; then store_kv): the queries and the cache after the store bit for bit the
    ops', and the NumPy reference's (a key past float16's range clamped). Bit for bit on a GPU
    too: the rotation and the norms' sums of squares round every product and sum (primitives.
    rotate, square_add), so no kernel's compiler can fuse them into multiply-adds its own way
    (test_rope_kernels_round_without_fma)."""
    be = CudaBackend()
    T, Q, G, D, C = 2, 4, 2, 16, 9
    qkv = (rng.standard_normal((T, (Q + 2 * G) * D)) * 3).astype(np.float32)
    qkv[0, Q * D + 3] = 1e6
    bias = rng.standard_normal(qkv.shape[1]).astype(np.float32) if extra == "bias" else None
    norms = [rng.standard_normal(D).astype(np.float32) if extra == "q/k norms" else None
             for _ in range(2)]
    cos, sin = ref.rope_tables(1 / 10000 ** (np.arange(D // 2) / (D // 2)), np.array([5, 300]))
    slots = np.array([[4, 0], [1, 7]])
    start = rng.standard_normal((G, C, D)).astype(dtype)
    dev = [None if a is None else be.dev(a) for a in (qkv, bias, *norms, cos, sin)]
    bufs = [be.dev(start, dtype) for _ in range(4)]
    q = be.rope_store(*dev[:4], 1e-6, *dev[4:], *bufs[:2], be.dev(slots, np.int64), Q)

    x = dev[0] if bias is None else dev[0] + dev[1]             # the ops, one by one
    heads = [x[:, :Q * D].reshape(T, Q, D), x[:, Q * D:(Q + G) * D].reshape(T, G, D)]
    if norms[0] is not None:
        heads = [be.rmsnorm(h.reshape(-1, D), w, 1e-6).reshape(h.shape)
                 for h, w in zip(heads, dev[2:4])]
    ops = [be.rope(h, dev[4], dev[5]) for h in heads]
    be.store_kv(*bufs[2:], slots, ops[1], x[:, (Q + G) * D:].reshape(T, G, D))
    for a, b in zip((q, *bufs[:2]), (ops[0], *bufs[2:])):
        assert _same_bits(be.to_numpy(a), be.to_numpy(b))

    x = qkv if bias is None else qkv + bias                     # the reference
    heads = [x[:, :Q * D].reshape(T, Q, D), x[:, Q * D:(Q + G) * D].reshape(T, G, D)]
    if norms[0] is not None:
        heads = [ref.rmsnorm(h.reshape(-1, D), w, 1e-6).reshape(h.shape)
                 for h, w in zip(heads, norms)]
    want_k, want_v = start.copy(), start.copy()
    ref.ReferenceBackend.store_kv(want_k, want_v, slots, ref.rope(heads[1], cos, sin),
                                  x[:, (Q + G) * D:].reshape(T, G, D))
    assert rel_err(be.to_numpy(q), ref.rope(heads[0], cos, sin)) < 1e-6
    for got, want in zip(bufs[:2], (want_k, want_v)):
        assert rel_err(be.to_numpy(got).astype(np.float32), want.astype(np.float32)) < 1e-3
    if dtype == np.float16 and norms[0] is None:
        assert be.to_numpy(bufs[0])[0, 4, 3] == 65504


@pytest.fixture
def gpu_shapes(monkeypatch):
    """The launch shapes a GPU gets: warps of 32 lanes, four of them a block of the GEMV and of
    attention, 128 threads a block of the rest (the simulator's own are smaller, for its speed;
    the kernels are written for both)."""
    for module in (primitives, kernels, gemv, kv, launchers, backend, device_step, attention):
        for name, value in (("LANES", 32), ("THREADS", 128), ("NORM_THREADS", 1024),
                            ("WARPS", 4), ("BLOCK", 128)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)
    if primitives.SIM:          # (made anew at these shapes; a GPU's are these, compiled once)
        monkeypatch.setattr(attention, "_KERNELS", {})


def test_kernels_at_the_gpu_s_launch_shapes(gpu_shapes):
    x = rng.standard_normal((2, 300)).astype(np.float32)
    g = rng.standard_normal(300).astype(np.float32)
    (y,) = run(lambda x, w, y: launchers.launch_rmsnorm(x, w, 1e-5, y), x, g, np.empty_like(x))[-1:]
    assert rel_err(y, ref.rmsnorm(x, g, 1e-5)) < 1e-5      # (a block of 512 threads)
    G, D, S = 1, 16, 200
    q_pos = np.array([249, 250])
    q = rng.standard_normal((2, 2, D)).astype(np.float32)       # two query heads, one KV head
    k, v = (rng.standard_normal((G, S, D)).astype(np.float32) for _ in range(2))
    k_pos = np.arange(S)[None] + 10
    score = rng.random((G, S)).astype(np.float32)
    want_score = score.copy()
    want = ref.attention(q, k, v, q_pos, k_pos, 0.25, None, want_score)
    got, got_score = attend(q, k, v, q_pos, k_pos, 0, score)        # (in 2 splits)
    assert rel_err(got, want) < 1e-5 and rel_err(got_score, want_score) < 1e-6


def test_a_float16_cache_at_the_gpu_s_launch_shapes(tmp_path, gpu_shapes):
    """The decoder over a float16 KV cache, as a GPU runs it: the backend's tensors through the
    launchers at the GPU's launch shapes, against the reference over the same cache type."""
    from helpers import write_tiny_model

    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import make_cache
    from tinyrt.kv_options import CacheOptions
    from tinyrt.models import load_model

    d = write_tiny_model(tmp_path / "m", tiny_config(hidden_size=32, intermediate_size=64,
                                                     num_attention_heads=4, num_hidden_layers=1))
    fast, slow = (load_model(d, get_backend(dev)) for dev in ("cuda", "reference"))
    caches = [make_cache(CacheOptions("dense", 16, "f16"), m) for m in (fast, slow)]
    ids = rng.integers(0, fast.config.vocab_size, 6)
    err = PROMPT_ERR[str(fast.backend.prompt.dtype).removeprefix("torch.")]
    a, b = (m.forward(ids[:4], cache, all_logits=True) for m, cache in zip((fast, slow), caches))
    assert_logits_close(fast.backend.to_numpy(a), b, err)
    for t in ids[4:]:
        a, b = (m.forward([t], cache) for m, cache in zip((fast, slow), caches))
        assert_logits_close(fast.backend.to_numpy(a), b, err)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("order", ["in order", "scattered"])
def test_store_kv_quantized(bits, order):
    """The store kernel over a quantized cache against kv_quant.store_kv, a few tokens at a
    time through a small pool (a pinned first block, the least recently written entry sealed
    when none is free): every array of the QuantKV equal bit for bit (codes, float16 scales
    and zeros, pool, block table, stamps), and read_kv equal to kv_quant.dequantize. Slots in
    order around the cache and past it (dense, the sink ring) or anywhere (h2o: blocks sealed
    again, some groups keeping their grid as kv_quant.requantize says); some tokens constant
    (scale 0), some of a tiny range (float16 scales below its normal range), some past
    float16's range (clamped)."""
    rng = seeded_rng()
    N, D, B = 2, 16, 4
    C = 8 * B
    want, got = (quant_store(N, C, D, bits, B, 2 * B, pin=1) for _ in range(2))
    be = CudaBackend()
    at = 0
    for step in range(12):
        T = int(rng.integers(1, 5) if order == "scattered" else rng.integers(3, 6))
        if order == "in order":                 # (at least 36 tokens: past the 32 slots)
            slots = np.tile((np.arange(T) + at) % C, (N, 1))
            at += T
        else:                                   # (the first step writes the pinned block)
            slots = np.stack([rng.choice(C, T, replace=False) if step else np.r_[0, rng.choice(
                np.arange(1, C), T - 1, replace=False)] for _ in range(N)])
        k, v = (rng.standard_normal((T, N, D)).astype(np.float32) * 4 for _ in range(2))
        k[:, :, 3] = 1.25                       # a key channel constant in every block
        v[rng.random((T, N)) < 0.2] = 0.5       # whole value rows constant
        k[rng.random((T, N)) < 0.2] *= 1e-6     # float16 scales below its normal range
        big = rng.random((T, N)) < 0.1          # clamped to -65504 (negative: a group's top
        k[big], v[big, :4] = -1e6, -1e6         # code times a scale rounded up stays finite)
        kv_quant.store_kv(want, slots, k, v)
        be.store_kv(got, None, slots, k, v)
    for name in kv_quant.QuantKV._fields[:-1]:
        assert _same_bits(getattr(got, name), getattr(want, name)), name
    assert (want.where[:, 0] >= 0).all()                   # the pinned block stays in the pool
    assert ((want.where < 0) & (want.ks[:, :, 0] > 0).any(axis=-1)).any()   # blocks sealed
    k, v = be.read_kv(got, None, C - 3)
    for a, b in zip((k, v), kv_quant.dequantize(want, C - 3)):
        assert _same_bits(a, b)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("T, window, h2o", [(1, 0, True), (1, 20, False), (2, 0, True)])
def test_attention_over_quantized_cache(bits, T, window, h2o):
    """Attention over a quantized cache (blocks in the float pool and sealed ones) against the
    reference: one query reads the codes in place (attention_decode_q), a prompt's queries a
    float copy of the slots. Positions held in any order per KV head, some slots free (-1),
    some after the queries (hidden); a window; H2O's scores. (The prompt's path in float32
    here; in float16, through whole models: test_prompt_gpu.)"""
    import torch

    rng = seeded_rng()
    G, ratio, D, B, C, S = 2, 2, 16, 4, 64, 57
    store = quant_store(G, C, D, bits, B, 2 * B, pin=1)
    slots = np.tile(np.arange(S), (G, 1))
    k, v = (rng.standard_normal((S, G, D)).astype(np.float32) for _ in range(2))
    kv_quant.store_kv(store, slots, k, v)
    blocks = store.where[:, :-(-S // B)]
    assert (blocks >= 0).any() and (blocks < 0).any()
    q_pos = np.arange(100, 100 + T)
    k_pos = np.stack([rng.permutation(S) + q_pos[-1] - S + 5 for _ in range(G)])   # 4 after q_pos
    k_pos[rng.random(k_pos.shape) < 0.1] = -1
    q = rng.standard_normal((T, G * ratio, D)).astype(np.float32)
    want_score = rng.random((G, C)).astype(np.float32)
    got_score = want_score.copy()
    want = ref.attention(q, store, None, q_pos, k_pos, 0.25, window or None,
                         want_score if h2o else None)
    be = CudaBackend(prompt_dtype=torch.float32)
    got = be.attention(q, store, None, q_pos, k_pos, 0.25, window or None,
                       got_score if h2o else None)
    assert rel_err(be.to_numpy(got), want) < 1e-5
    assert rel_err(got_score, want_score) < 1e-6


def _compile_for_the_gpu(code: str, *argv: str) -> str:
    """The standard output of `code` run with argv in a Python outside Numba's CUDA simulator,
    where it can compile kernels to PTX for a Hopper GPU (cuda.compile_ptx with cc=(9, 0); `t`
    is numba.core.types, `a(dtype, ndim)` a C-contiguous array type). Skips the test where no
    CUDA compiler (NVVM) is installed; fails on an error."""
    import os
    import subprocess
    import sys

    prelude = r"""
import types
from numba import cuda
from numba.core import types as t
import numba.cuda.dispatcher as dispatcher
try:
    from numba.cuda.cudadrv import nvvm
    nvvm.NVVM()
except Exception as e:
    print('no nvvm:', e); raise SystemExit
# device functions compile for the current device's compute capability: no GPU here
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
a = lambda dt, nd: t.Array(dt, nd, 'C')
"""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", prelude + code, *argv], env=env,
                         capture_output=True, text=True)
    if run.stdout.startswith("no nvvm"):
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout


def test_quantized_cache_kernels_round_without_fma():
    """On the GPU, a float32 multiply and add contract into one fused multiply-add unless each is
    rounded explicitly: the store and dequantize kernels (code * scale + zero, as kv_quant rounds
    it twice) compiled to PTX for a Hopper GPU hold no fma, and do hold mul.rn and add.rn.
    Where no CUDA compiler (NVVM) is installed, nothing to check."""
    out = _compile_for_the_gpu(r"""
import re
from tinyrt.kernels.cuda import kv
store = (a(t.uint8, 4), a(t.float16, 4), a(t.uint8, 3), a(t.float16, 4), a(t.float16, 4),
         a(t.float16, 4), a(t.int32, 2))
sigs = {'store_kv_q': store + (a(t.int32, 2), a(t.int64, 2), t.int64, a(t.int64, 2),
                               a(t.float32, 3), a(t.float32, 3)),
        'dequantize_kv': store + (a(t.float32, 3), a(t.float32, 3))}
for name, sig in sigs.items():
    ptx, _ = cuda.compile_ptx(getattr(kv, name).py_func, sig, cc=(9, 0))
    print(name, *(len(re.findall(op, ptx)) for op in (r'\bfma\.', r'\bmul\.rn\.f32', r'\badd\.rn\.f32')))
""")
    counts = {name: [int(n) for n in rest] for name, *rest in map(str.split, out.splitlines())}
    for name in ("store_kv_q", "dequantize_kv"):
        fma, mul, add = counts[name]
        assert fma == 0 and mul > 0 and add > 0, (name, counts[name])


def test_numpy_names_numba_cuda_needs_are_restored(monkeypatch):
    """numba-cuda 0.30 registers an overload of np.row_stack when its target loads, and NumPy
    2.5 removed row_stack: every kernel's first compile raised AttributeError on such a GPU
    machine. The package restores the name as NumPy's own alias (vstack), only where it is
    missing; then a kernel compiles with the name removed (and, with numba-cuda installed, does
    not without the restore). Where no CUDA compiler (NVVM) is installed, only the first
    part."""
    from tinyrt.kernels.cuda import numpy_names

    monkeypatch.delattr(np, "row_stack", raising=False)
    assert numpy_names.restore() == ["row_stack"] and np.row_stack is np.vstack
    own = object()                       # a NumPy that has the name keeps its own
    monkeypatch.setattr(np, "row_stack", own, raising=False)
    assert numpy_names.restore() == [] and np.row_stack is own
    code = r"""
import sys
import numpy as np
del np.row_stack                 # (as NumPy 2.5 has it)
def k(x):
    x[0] = 1.0
if sys.argv[1] == 'restored':
    import tinyrt.kernels.cuda
try:
    cuda.compile_ptx(k, (a(t.float32, 1),), cc=(9, 0))
    print('compiled')
except AttributeError as e:
    print('failed:', e)
"""
    assert _compile_for_the_gpu(code, "restored").strip() == "compiled"
    bare = _compile_for_the_gpu(code, "bare")
    import importlib.util
    if importlib.util.find_spec("numba_cuda") is not None:   # (numba's own target guards it)
        assert "row_stack" in bare, bare


def test_rope_kernels_round_without_fma():
    """The kernels that rotate by RoPE (rope, rope_store, and the sinks' re-rotation) and sum
    squares for a norm (add_rmsnorm, rope_store) hold no float32 fused multiply-add in their
    PTX for a Hopper GPU: each product and sum rounded alone, as NumPy rounds them, so the fused
    kernel and the ops one by one agree bit for bit on hardware (on which the compiler
    contracted a * b + c differently in each: the last bit of some queries differed). Where no
    CUDA compiler (NVVM) is installed, nothing to check."""
    out = _compile_for_the_gpu(r"""
import re
from tinyrt.kernels.cuda import kernels, step
f1, f2, f3, i2 = a(t.float32, 1), a(t.float32, 2), a(t.float32, 3), a(t.int64, 2)
sigs = {kernels.rope: (f3, f2, f2, f3),
        kernels.add_rmsnorm: (f2, f2, t.int64, f1, t.float32, f2),
        kernels.rope_store: (f2, f1, f1, f1, t.float32, f2, f2, f3, f3, i2, t.float32, f3),
        step.rotate_sinks: (f3, f3, f3, f3, a(t.int64, 1), a(t.float64, 1), t.float32)}
for kernel, sig in sigs.items():
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    print(kernel.py_func.__name__, len(re.findall(r'\bfma\.rn\.f32', ptx)),
          len(re.findall(r'\bmul\.rn\.f32', ptx)))
""")
    counts = {name: (int(fma), int(mul)) for name, fma, mul in map(str.split, out.splitlines())}
    assert len(counts) == 4 and all(fma == 0 and mul > 0 for fma, mul in counts.values()), counts


def test_q_gemv_compiles_for_the_gpu():
    """The GEMVs' hardware branches, which the simulator does not run, compiled to PTX for a
    Hopper GPU: the lanes' sums by warp shuffles, the barriers of x's staging, stream-K's fence
    before its count of the tiles summed and its parts read as atomics, the launch bounds
    that hold its registers to five blocks an SM (no int-to-float conversion of a code in the
    hot loop: test_gpu_static's, in SASS); every variant (4-, 8-bit, float16 weights, gated,
    the slow path: float16 scales, and float32 ones for two) and q_dequantize compile, its
    16-bit stores (bfloat16's bits, float16's by the hardware's conversion). Where no CUDA
    compiler (NVVM) is installed, nothing to check."""
    out = _compile_for_the_gpu(r"""
from tinyrt.kernels.cuda import gemv
f32 = a(t.float32, 1)
variants = [(k, t.float16) for k in gemv.KERNELS.values()]
variants += [(gemv.KERNELS[4, False, False], t.float32), (gemv.KERNELS[8, True, True], t.float32)]
for kernel, f in variants:
    ptx, _ = cuda.compile_ptx(kernel.py_func, (f32, f32, t.float32, f32, a(t.int64, 1),
                              a(f, 1), a(f, 1), t.int64, t.int64, t.int64, t.int64, f32,
                              a(t.float32, 2), a(t.int32, 1), a(t.int32, 1), t.int64),
                              cc=(9, 0), launch_bounds=gemv.BOUNDS)
    ops = ('shfl.sync', 'bar.sync', 'membar.gl', 'atom.global.add.u32',
           'atom.global.add.f32', '.maxntid 128', '.minnctapersm 5')
    print(*(int(op in ptx) for op in ops))
for f in (t.float16, t.float32):
    for dst in (t.int16, t.float16, t.float32):
        ptx, _ = cuda.compile_ptx(gemv.q_dequantize.py_func, (a(t.int64, 1), a(f, 1), a(f, 1),
                                  *[t.int64] * 6, a(dst, 2)), cc=(9, 0))
        half = any(f'st.global.{s}16' in ptx for s in 'buf')
        print(int(('cvt.rn.f16.f32' in ptx) == (dst == t.float16)), int(half == (dst != t.float32)))
""")
    assert out.split() == ["1"] * (7 * (len(gemv.KERNELS) + 2) + 2 * 6), out


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A model small enough for Numba's CUDA simulator (every CUDA thread a Python thread): one
    layer, 2 heads of 8 channels, a vocabulary of 16. Float16 weights: the CUDA backend holds
    them as they are and the reference as float32, so that both compute the same K and V (but
    for the order of float sums) and quantize them alike."""
    from safetensors.numpy import save_file

    cfg = tiny_config(hidden_size=16, intermediate_size=16, num_attention_heads=2,
                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=16)
    d = tmp_path_factory.mktemp("kvq_cuda")
    save_file(random_weights(cfg, 9, np.float16), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("policy, prompt", [("dense", [12]), ("sink", [10, 4]), ("h2o", [10, 4])])
@pytest.mark.parametrize("kv_type", ["q4", "q2"])
def test_cuda_runs_the_quantized_cache_as_the_reference(micro, policy, prompt, kv_type):
    """The CUDA backend (in Numba's simulator where there is no GPU) over a quantized cache of
    blocks of 4, no residual but the block being written, 2 sinks (a pinned block): a prompt in
    chunks (blocks sealed as it goes; in a cache of 12, sink and h2o evict and sink re-rotates
    its sinks through read_kv and store_kv), then a decode step that reads sealed blocks' codes
    in place. Step by step, the reference backend's logits (within float sums' order) and greedy
    token, the same tokens kept and the same blocks sealed. (The prompts' GEMMs in float32,
    so that the two compute the same K and V; the 16-bit path over these caches:
    test_prompt_gpu.py.)"""
    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import make_cache
    from tinyrt.kv_options import CacheOptions
    from tinyrt.models import load_model

    rng = np.random.default_rng(11)
    opts = CacheOptions(policy, 24 if policy == "dense" else 12, kv_type, sinks=2, kv_group=4,
                        kv_residual=0)
    import torch

    models = [load_model(micro, b) for b in (CudaBackend(prompt_dtype=torch.float32),
                                              get_backend("reference"))]
    assert models[0].backend.name == "cuda"
    caches = [make_cache(opts, m) for m in models]
    ids = rng.integers(0, 16, sum(prompt) + 1)
    for chunk in [*np.split(ids[:sum(prompt)], np.cumsum(prompt)[:-1]), *ids[sum(prompt):, None]]:
        got, want = (m.forward(chunk, c) for m, c in zip(models, caches))
        got = models[0].backend.to_numpy(got)
        assert rel_err(got, want) < 1e-4
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
    a, b = (c.k for c in caches)
    assert np.array_equal(caches[0].slot_pos, caches[1].slot_pos)
    for name in ("where", "owner", "stamp"):        # (the device's brought to the host first)
        assert np.array_equal(models[0].backend.to_numpy(getattr(a, name)), getattr(b, name)), name
    assert (a.where[..., 1:3] < 0).any(axis=-1).all()     # a sealed block, read as codes


def test_cuda_asked_for_and_absent():
    """Without a GPU (and outside the simulator), --device cuda says why and what to use."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = ("from tinyrt.kernels import get_backend\n"
            "from tinyrt.kernels.cuda import unavailable\n"
            "why = unavailable()\n"
            "try:\n    get_backend('cuda')\nexcept ValueError as e:\n    print('refused:', e)\n"
            "else:\n    print('ran' if why is None else 'no error')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    if out.startswith("ran"):
        pytest.skip("a CUDA GPU is present: nothing to refuse")
    assert out.startswith("refused: --device cuda: ") and "use --device cpu" in out


def test_every_kernel_compiles_for_the_gpu(tmp_path, monkeypatch, micro):
    """What the simulator cannot show, since it runs the kernels as Python: that the installed
    Numba CUDA target compiles them. Every kernel a 4-bit model's prompt and decode steps launch
    (on the device, over dense and h2o caches, and from the host over a quantized cache), with
    the argument types recorded at those launches, compiled to PTX for a Hopper GPU. Where no
    CUDA compiler (NVVM) is installed, nothing to check."""
    import numba

    import tinyrt
    from helpers import write_tiny_model
    from tinyrt.converters import convert

    seen = set()
    launch = launchers.launch

    def spec(a):
        a = a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else a
        t = numba.typeof(a)
        if isinstance(t, numba.types.Array):
            return [str(t.dtype), t.ndim, t.layout]
        return str(t)

    def record(kernel, grid, block, *args, **kw):
        fn = kernel.py_func        # (the simulator's FakeCUDAKernel and numba-cuda's dispatcher)
        seen.add(json.dumps([fn.__module__, fn.__name__, [spec(a) for a in args]]))
        launch(kernel, grid, block, *args, **kw)

    monkeypatch.setattr(launchers, "launch", record)
    d = write_tiny_model(tmp_path / "m", tiny_config(hidden_size=32, intermediate_size=64,
                                                     num_attention_heads=4, num_hidden_layers=1))
    d = convert(d, tmp_path / "q", method="rtn", group_size=32)
    for policy in ("dense", "h2o"):
        llm = tinyrt.LLM(d, device="cuda", kv_policy=policy, kv_size=6, sinks=1)
        for _ in llm.generation([5, 6, 7], max_tokens=5, ignore_eos=True, temperature=0.5):
            pass
    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import make_cache
    from tinyrt.kv_options import CacheOptions
    from tinyrt.models import load_model

    model = load_model(micro, get_backend("cuda"))
    cache = make_cache(CacheOptions("dense", 12, "q4", kv_group=4, kv_residual=0), model)
    for chunk in ([1, 2, 3, 4, 5], [6]):
        model.forward(chunk, cache)
    names = {json.loads(s)[1] for s in seen}
    assert {"q4_gemv", "q_dequantize", "begin", "take_slot", "take_slot_h2o", "rotate_sinks",
            "store_kv_q", "attention_decode_q", "add_rmsnorm", "rope_store",
            "attention_scores"} <= names, names
    assert any(name.startswith("attention_") and "x" in name for name in names), names
    (tmp_path / "launches.json").write_text(json.dumps(sorted(seen)))
    out = _compile_for_the_gpu(r"""
import importlib, json, sys
for line in json.load(open(sys.argv[1])):
    module, name, args = json.loads(line)
    sig = tuple(t.Array(getattr(t, a[0]), a[1], a[2]) if isinstance(a, list) else getattr(t, a)
                for a in args)
    mod = importlib.import_module(module)
    kernel = getattr(mod, name, None) or mod.named(name)    # (attention's: made by name)
    try:
        cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0),
                         launch_bounds=kernel.targetoptions.get("launch_bounds"))
    except Exception as e:
        print(name, str(e).splitlines()[0][:300])
""", str(tmp_path / "launches.json"))
    assert not out, out


DEVICE_MODULE = '''
import threading, time
from numba import cuda

entered, inside = threading.Event(), threading.Event()


@cuda.jit(device=True)
def late_lane(first):
    if first:                   # in first: wait here until the other thread is in too
        entered.set()
        inside.wait(5)
    else:                       # in second: still inside after the first thread has left
        inside.set()
        time.sleep(0.2)
    return cuda.threadIdx.x     # (`cuda` read again, after the first thread returned)
'''

KERNEL_MODULE = '''
from numba import cuda
import simdev


@cuda.jit
def lanes(out):
    i = cuda.threadIdx.x
    if i == 1:
        simdev.entered.wait(5)
    out[i] = simdev.late_lane(i == 0)
'''


@pytest.mark.skipif(not primitives.SIM, reason="(the simulator's own race: on a GPU, no Python "
                    "threads to race)")
def test_the_simulator_keeps_cuda_simulated_in_a_device_function_s_module(tmp_path, monkeypatch):
    """A device function of another module than its kernel's, the first of two threads leaving it
    while the second is still inside: the simulator pointed that module's `cuda` back at the real
    module when the first left, and the second then failed (no threadIdx there; in a warp sum, no
    syncthreads); mended, it stays simulated until the launch ends, then is real again."""
    import sys

    import numba

    (tmp_path / "simdev.py").write_text(DEVICE_MODULE)
    (tmp_path / "simkernel.py").write_text(KERNEL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import simkernel

    out = np.full(2, -1, np.int64)
    simkernel.lanes[1, 2](out)
    assert out.tolist() == [0, 1]
    assert sys.modules["simdev"].cuda is numba.cuda and simkernel.cuda is numba.cuda
    assert kernels.cuda is numba.cuda
