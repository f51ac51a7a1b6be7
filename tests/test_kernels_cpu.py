"""The Numba CPU kernels against the NumPy reference, on fresh random inputs of several shapes."""

import numpy as np
import pytest
from numba import njit

import tinyrt
from helpers import random_quant, rel_err, seeded_rng, tiny_config, write_tiny_model
from tinyrt.converters import convert
from tinyrt.kernels import cpu, get_backend, quant
from tinyrt.kernels.cpu import CpuBackend
from tinyrt.kernels import reference as ref
from tinyrt import kv_cache
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models import FAMILIES

rng = seeded_rng(__name__)


def packed(n_in: int, n_out: int, g: int, bits: int = 4, half: bool = True,
           form: str = "offset") -> quant.QuantWeight:
    return random_quant(n_out, n_in, bits, g, half, rng, form)


FORMS = [(4, 32, True, "offset"), (4, 64, False, "offset"), (4, 128, True, "awq"),
         (4, 32, False, "k"), (4, 32, True, "zero"), (5, 32, True, "zero"), (5, 32, True, "k"),
         (6, 16, True, "zero-k"), (6, 16, False, "zero-k"), (8, 32, True, "zero"),
         (8, 16, False, "offset"), (8, 128, True, "offset")]


@pytest.mark.parametrize("bits, g, half, form", FORMS)
@pytest.mark.parametrize("n_in, outs", [(128, [64]), (256, [96, 32, 32]), (384, [200, 200]),
                                        (576, [576, 192, 192]), (256, [120])])
@pytest.mark.parametrize("T", [1, 3, cpu.backend.SMALL_TOKENS + 3])
def test_q_linear(bits, g, half, form, n_in, outs, T):
    parts = [packed(n_in, o, g, bits, half, form) for o in outs]
    w = np.concatenate([quant.dequantize(p) for p in parts])                 # [out, in]
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    be = CpuBackend()
    prepared = be.prepare_linear(parts)
    tiles = -(-sum(outs) // 16)
    assert prepared.lo.shape == (tiles, n_in // 8, 16) and prepared.shape == (sum(outs), n_in)
    assert prepared.hi.shape == (tiles, n_in * (bits - 4) // 32, 16) and prepared.bits == bits
    got = be.linear(x, prepared)
    # the activations are rounded to int16 (1/65534 of a block's largest)
    assert rel_err(got, ref.linear(x, w)) < 1e-4


@pytest.mark.parametrize("bits, g, half, form", FORMS[::3] + [(5, 32, True, "k")])
@pytest.mark.parametrize("n_in, T", [(256, cpu.backend.SMALL_TOKENS + 1), (4096, 45), (4096, 90)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_gemm_gives_each_token_its_gemv_result(bits, g, half, form, n_in, T, threads):
    """A prompt's GEMM (GEMM_TOKENS tokens per pass over a tile; at 4096 inputs, tokens in
    blocks of 32 whose activations fit GEMM_ACT_BYTES; T not a multiple of either) gives every
    token the outputs the GEMV gives it alone, to the bit."""
    p = cpu.linear.repack([packed(n_in, 40, g, bits, half, form)])
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    y = np.full((T, 40), np.nan, np.float32)
    cpu.linear.q_gemm(x, p, y, threads)
    one = np.empty((1, 40), np.float32)
    for t in range(T):
        cpu.linear.q_gemv(x[t:t + 1], p, one, 1)
        assert np.array_equal(y[t], one[0]), t


@pytest.mark.parametrize("T", [1, cpu.backend.SMALL_TOKENS + 3])
def test_fused_parts_of_mixed_forms(T):
    """q, k (Q4_K's form: 4-bit, groups of 32, sub-scales) beside v (Q6_K's: 6-bit, groups of
    16, sub-scales, a zero), as a Q4_K_M file's layer has them: fused exactly into one 6-bit
    layer in groups of 16 that keeps the super-block scales and integer sub-scales."""
    parts = [packed(256, 96, 32, 4, True, "k"), packed(256, 32, 32, 4, True, "k"),
             packed(256, 32, 16, 6, True, "zero-k")]
    be = CpuBackend()
    prepared = be.prepare_linear(parts)
    assert (prepared.bits, prepared.group) == (6, 16) and prepared.s.dtype == np.uint16
    assert prepared.s.shape[1] == 4 and prepared.sq.shape[1] == prepared.mq.shape[1] == 16  # v: 4 blocks
    x = rng.standard_normal((T, 256)).astype(np.float32)
    w = np.concatenate([quant.dequantize(p) for p in parts])
    assert rel_err(be.linear(x, prepared), ref.linear(x, w)) < 1e-4


@pytest.mark.parametrize("bits, g", [(5, 16), (5, 8), (6, 8)])
def test_codes_widen_to_fill_words(bits, g):
    """A high plane must fill whole words within a group: 5-bit codes in groups of 16 run as
    6-bit, in groups of 8 as 8-bit."""
    w = packed(64, 24, g, bits, True, "zero")
    p = cpu.linear.repack([w])
    assert p.bits == (6 if g == 16 else 8)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    assert rel_err(CpuBackend().linear(x, p)[0], quant.dequantize(w) @ x[0]) < 1e-4


@pytest.mark.parametrize("n_in, n_out", [(576, 1536), (64, 72), (130, 7)])
@pytest.mark.parametrize("T", [1, 5, cpu.backend.SMALL_TOKENS, cpu.backend.SMALL_TOKENS + 3])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_float_linear(n_in, n_out, T, threads):
    """A float layer: a few tokens through the rows kernel, more through BLAS."""
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    be = CpuBackend()
    be.threads = threads
    assert rel_err(be.linear(x, be.prepare_linear([w])), x.astype(np.float64) @ w.T) < 1e-5


@pytest.mark.parametrize("kind", ["q4", "q6", "q8", "int8", "float"])
@pytest.mark.parametrize("T", [2, 6, 9, 15, cpu.backend.SMALL_TOKENS])
def test_few_tokens_equal_one_at_a_time(kind, T):
    """A few tokens' linear (a draft's verification: 8, 4, 2 and 1 tokens a pass over a tile)
    gives each token, to the bit, its one-token result: greedy speculative decoding depends
    on it."""
    n_in, n_out = 576, 1000
    be = CpuBackend()
    if kind in ("q4", "q6", "q8"):
        w = be.prepare_linear([packed(n_in, n_out, 64, int(kind[1]), form="k")])
    elif kind == "int8":
        w = be.prepare_head(rng.standard_normal((n_out, n_in)).astype(np.float32), quantized=True)
    else:
        w = be.prepare_linear([rng.standard_normal((n_out, n_in)).astype(np.float32)])
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    got = be.linear(x, w)
    assert all(np.array_equal(got[t], be.linear(x[t:t + 1], w)[0]) for t in range(T))


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pair_planar_tiles(bits):
    """The codes' low 4 bits in one plane of tiles, their high bits - 4 in another; in a plane
    of b-bit values, word [k, r, j] holds output 16k + j's values of inputs nr + 2m at bit b*m
    and nr + 2m + 1 at bit 16 + b*m (n = 32 / b); scales and sub-scales [k, group, j]; the last
    tile padded with zeros."""
    w = packed(128, 24, 32, bits, True, "k")
    codes = quant.unpack(w)
    p = cpu.linear.repack([w])
    planes = [(p.lo.view(np.uint32), 4, 0), (p.hi.view(np.uint32), bits - 4, 4)]
    for i, o in zip(rng.integers(0, 128, 50), rng.integers(0, 24, 50)):
        for words, b, low in planes[:1 + (bits > 4)]:
            n = 32 // b
            shift = b * (i % n // 2) + 16 * (i % 2)
            value = (codes[o, i] >> low) & (2 ** b - 1)
            assert (words[o // 16, i // n, o % 16] >> shift) & (2 ** b - 1) == value
    for g, o in zip(rng.integers(0, 4, 20), rng.integers(0, 24, 20)):
        assert p.s[o // 16, g // 4, o % 16] == w.scale.view(np.uint16)[o, g // 4]
        assert p.sq[o // 16, g, o % 16] == w.scale_q[o, g]
        assert p.m[o // 16, g // 4, o % 16] == w.offset.view(np.uint16)[o, g // 4]
        assert p.mq[o // 16, g, o % 16] == w.offset_q[o, g]
    assert not p.lo[1, :, 8:].any() and not p.hi[1, :, 8:].any() and not p.s[1, :, 8:].any()


@pytest.mark.parametrize("outs", [[72], [40, 40, 24], [16, 9, 23]])
@pytest.mark.parametrize("forms", [[(4, 32, "k")], [(6, 16, "zero-k")],
                                   [(4, 32, "zero"), (8, 32, "zero"), (4, 16, "offset")]])
def test_parts_tile_at_their_rows(outs, forms):
    """Each part's codes tiled at its own rows (tiles split between parts, packed 4-bit codes
    beside 8-bit ones) give the tiles of the layer quant.concat makes of the parts."""
    parts = [packed(64, o, g, bits, True, form)
             for o, (bits, g, form) in zip(outs, forms * len(outs))]
    fused = cpu.linear.repack([quant.concat(parts)])
    for a, b in zip(cpu.linear.repack(parts), fused):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("block", [8, 32, 128])
def test_quantize_pairs(block):
    x = (rng.standard_normal(256) * rng.choice([1e-3, 1, 50], 256)).astype(np.float32)
    x[:block] = 0                                                         # an all-zero block
    xp, sx, xsum = (np.empty(128, np.int32), np.empty(256 // block, np.float32),
                    np.empty(256 // block, np.float32))
    cpu.linear.quantize_pairs(x, block, xp, sx, xsum)
    q = np.stack([(xp << 16) >> 16, xp >> 16], axis=1).reshape(-1)       # int16 halves, signed
    step = np.repeat(sx, block)
    # rounded to the nearest step, up to float32 rounding of x / step (x / step <= 32767)
    assert np.abs(q).max() <= 32767 and np.all(np.abs(q * step - x) <= step * 0.51)
    np.testing.assert_allclose(xsum, (q * step).reshape(-1, block).sum(axis=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("n_out", [8, 120, 136, 576])
def test_q_gemv_tasks(threads, n_out):
    """Any number of tasks, and outputs that are not a multiple of the vector (a padded tile)."""
    w = packed(192, n_out, 32)
    p = cpu.linear.repack([w])
    x = rng.standard_normal((1, 192)).astype(np.float32)
    y = np.full((1, n_out), np.nan, np.float32)
    cpu.linear.q_gemv(x, p, y, threads)
    assert rel_err(y[0], quant.dequantize(w) @ x[0]) < 1e-4


def _tiles_of_form(bits: int, tokens: int, form: str):
    """Every tile of a layer through simd's tile_dot of `form` ("pairs": x86's multiply-adds of
    pairs, "neon": Arm's widening multiply-accumulates): y[k] = tile k's out ([LANES] for one
    token, else [tokens, LANES])."""
    tile = cpu.simd.make_tile_dot(bits, tokens, form)

    @njit(fastmath=True)
    def run(w, xp, sx, xsum, out, y):
        for k in range(w.lo.shape[0]):
            tile(w, k, xp, sx, xsum, 0, out)
            y[k] = out
    return run


@pytest.mark.parametrize("bits, g, half, form, T", [
    (4, 32, True, "offset", 1), (4, 32, True, "offset", 2), (4, 128, True, "awq", 4),
    (4, 32, False, "k", 8), (5, 32, True, "k", 1), (5, 32, True, "zero", 8),
    (6, 16, True, "zero-k", 2), (6, 16, False, "zero-k", 3), (8, 32, True, "zero", 4),
    (8, 16, False, "offset", 1)])
def test_both_forms_of_the_integer_loop_give_the_same_sums(bits, g, half, form, T):
    """The GEMV's integer loop in both its forms, whichever this CPU runs (simd.GEMV_FORM; the
    other compiles as plain vector code): the Arm form's sums are the x86 form's, to the bit,
    for 1 to 8 tokens (passes of 16, 8 or 4 outputs, tokens 4 at a time), and both match
    the NumPy reference."""
    n_in, n_out = 512, 40
    w = packed(n_in, n_out, g, bits, half, form)
    p = cpu.linear.repack([w])
    x = (rng.standard_normal((T, n_in)) * rng.choice([0.01, 1, 30], (T, n_in))).astype(np.float32)
    block, xp, sx, xsum = cpu.linear._activation_buffers(T, n_in, p.group)
    for t in range(T):
        cpu.linear.quantize_pairs(x[t], block, xp[t], sx[t], xsum[t])
    got = {}
    for f in ("pairs", "neon"):
        out = np.empty((T, cpu.simd.LANES) if T > 1 else cpu.simd.LANES, np.float32)
        y = np.full((p.lo.shape[0], *out.shape), np.nan, np.float32)
        _tiles_of_form(bits, T, f)(p, xp, sx, xsum, out, y)
        got[f] = y.reshape(p.lo.shape[0], T, -1).transpose(1, 0, 2).reshape(T, -1)[:, :n_out]
    assert np.array_equal(got["neon"].view(np.int32), got["pairs"].view(np.int32))
    assert rel_err(got["neon"], ref.linear(x, quant.dequantize(w))) < 1e-4


def test_exp():
    x = np.concatenate([rng.uniform(-87, 88, 100_000), [0, -1e-8, -87.2]]).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(exp_all(x) - want) <= 4e-7 * want)
    assert np.all(exp_all(np.array([-np.inf, -200, -87.5], np.float32)) == 0)
    assert np.all(np.isfinite(exp_all(np.array([88, 100, 1e30], np.float32))))


@njit(cache=True)
def exp_all(x):
    y = np.empty_like(x)
    for i in range(x.shape[0]):
        y[i] = cpu.ops.exp(x[i])
    return y


def test_int8_head():
    table = rng.standard_normal((1000, 96)).astype(np.float32)
    be = CpuBackend()
    head = be.prepare_head(table, quantized=True)
    q, s = ref.int8_rows(table)
    assert np.array_equal(head.q, q) and np.array_equal(head.s, s)
    step = np.abs(table).max(axis=1) / 127
    assert np.all(np.abs(head.q * head.s[:, None] - table) <= step[:, None] / 2 + 1e-6)
    for T in (1, 9):
        x = rng.standard_normal((T, 96)).astype(np.float32)
        assert rel_err(be.linear(x, head), x @ (head.q * head.s[:, None]).T) < 1e-5
        assert rel_err(be.linear(x, head), x @ table.T) < 1e-2


@pytest.mark.parametrize("T, H", [(1, 96), (7, 576), (3, 33)])
def test_rmsnorm_swiglu_geglu(T, H):
    x, w = rng.standard_normal((T, H)).astype(np.float32), rng.standard_normal(H).astype(np.float32)
    np.testing.assert_allclose(cpu.ops.rmsnorm(x, w, 1e-5), ref.rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
    gu = rng.standard_normal((T, 2 * H)).astype(np.float32) * 10     # gate (large: tails of exp), up
    gu[0, :3] = [-1e4, 1e4, 0]
    np.testing.assert_allclose(CpuBackend().swiglu(gu), ref.ReferenceBackend.swiglu(gu),
                               rtol=1e-5, atol=1e-6)
    # GELU's tanh form in float64 (float32's 1 + tanh z loses digits where tanh z nears -1)
    g, up = gu[:, :H].astype(np.float64), gu[:, H:]
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    np.testing.assert_allclose(CpuBackend().geglu(gu), gelu * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T, N, D", [(1, 9, 64), (5, 3, 16), (13, 8, 128)])
def test_rope(T, N, D):
    x = rng.standard_normal((T, N, D)).astype(np.float32)
    cos, sin = ref.rope_tables(1.0 / 10000 ** (np.arange(0, D, 2) / D), rng.integers(0, 4096, T))
    np.testing.assert_allclose(cpu.ops.rope(x, cos, sin), ref.rope(x, cos, sin), atol=1e-5)


def ring_positions(G, S, q_pos, free=0.2):
    """Slot positions [G, S] of a ring buffer whose KV heads keep different tokens: any order,
    some free slots (-1), and each of `q_pos` (the queries' own keys) held by every head."""
    k_pos = np.stack([rng.permutation(q_pos[0] + S)[:S] for _ in range(G)])
    k_pos[rng.random((G, S)) < free] = -1
    k_pos[k_pos >= q_pos[0]] = -1
    for g in range(G):
        k_pos[g, rng.choice(S, len(q_pos), replace=False)] = q_pos
    return k_pos


@pytest.mark.parametrize("ratio", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("S", [1, 17, 255, 700])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype, D", [(np.float16, 32), (np.float32, 32), (np.float16, 24)])
def test_attention_decode(ratio, S, window, dtype, D):
    """Over a ring buffer of float16 or float32 elements whose KV heads hold different
    positions; 700 slots: split among tasks, the partial softmaxes merged; head size 24: the
    columns past the vector part; 7 and 8 query heads per KV head: passes of 4 heads and fewer.
    The attention weights added to H2O scores as well."""
    G = 2
    q = rng.standard_normal((1, G * ratio, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, S + 2, D)).astype(dtype) for _ in range(2))
    q_pos = np.array([S + 3])
    k_pos = ring_positions(G, S, q_pos)
    score0 = rng.random((G, S + 2)).astype(np.float32)
    want_score = score0.copy()
    want = ref.attention(q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos, 0.2, window,
                         want_score)
    np.testing.assert_allclose(CpuBackend().attention(q, k, v, q_pos, k_pos, 0.2, window),
                               want, atol=1e-5)
    for tasks in (1, 3):
        score = score0.copy()
        got = cpu.attention.attention_decode(q, cpu.backend._bits(k), cpu.backend._bits(v), q_pos, k_pos,
                                   np.float32(0.2), window or 0, tasks, score)
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(score, want_score, atol=1e-5)
    assert not np.array_equal(want_score, score0)


@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("T, past, block", [(7, 0, 3), (130, 9, 128), (5, 40, 2)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_attention_prompt(ratio, T, past, block, window, ordered, dtype):
    """Blocked prompt attention = the reference, over caches in position order (the causal skip)
    and in ring order with free slots and different positions per KV head; buffers larger than
    the slots read; the H2O scores alike."""
    G, D = 2, 16
    S = past + T
    q = rng.standard_normal((T, G * ratio, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, S + 4, D)).astype(dtype) for _ in range(2))
    q_pos = np.arange(past, S)
    k_pos = np.tile(np.arange(S), (G, 1)) if ordered else ring_positions(G, S, q_pos)
    score, want_score = np.zeros((G, S + 4), np.float32), np.zeros((G, S + 4), np.float32)
    want = ref.attention(q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos, 0.3, window,
                         want_score)
    np.testing.assert_allclose(cpu.attention.attention_prompt(q, k, v, q_pos, k_pos, 0.3, window, score, block),
                               want, atol=1e-5)
    np.testing.assert_allclose(score, want_score, atol=1e-4)
    np.testing.assert_allclose(want_score.sum(), T * ratio * G, rtol=1e-4)   # each row sums to 1
    if T <= cpu.backend.SMALL_TOKENS:          # the backend runs a few tokens as decode attention each
        score[:] = 0
        got = CpuBackend().attention(q, k, v, q_pos, k_pos, 0.3, window, score)
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(score, want_score, atol=1e-4)


@pytest.mark.parametrize("S", [9, 300, 700])
def test_few_queries_equal_each_alone(S):
    """A few new tokens' attention (a draft's verification, the last T slots of a cache in
    position order) gives each, to the bit, what decode gave it when the cache ended at its slot."""
    G, R, D, T = 3, 3, 64, 8
    q = rng.standard_normal((T, G * R, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, S + 5, D)).astype(np.float16) for _ in range(2))
    k_pos = np.tile(np.arange(S), (G, 1))
    q_pos = np.arange(S - T, S)
    be = CpuBackend()
    got = be.attention(q, k, v, q_pos, k_pos, 0.125)
    for t in range(T):
        alone = be.attention(q[t:t + 1], k, v, q_pos[t:t + 1], k_pos[:, :S - T + t + 1], 0.125)
        assert np.array_equal(got[t], alone[0])


@pytest.mark.parametrize("S", [40, 300])
def test_decode_attention_does_not_depend_on_threads(S):
    """The threads share (query, block, KV head) triples of decode attention: 1, 2 or 5 of them
    give the same outputs and H2O scores, to the bit."""
    G, R, D, T = 3, 3, 64, 3
    q = rng.standard_normal((T, G * R, D)).astype(np.float32)
    k, v = (rng.standard_normal((G, S, D)).astype(np.float16).view(np.uint16) for _ in range(2))
    k_pos = np.tile(np.arange(S), (G, 1))
    k_pos[1, 5] = -1                                            # a free slot
    q_pos = np.arange(S - T, S)
    results = []
    for threads in (1, 2, 5):
        score = np.zeros((G, S), np.float32)
        out = cpu.attention.attention_decode(q, k, v, q_pos, k_pos, np.float32(0.125), 0, threads, score)
        results.append((out, score))
    for out, score in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(score, results[0][1])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_store_kv(dtype):
    """Each KV head's rows at its own slots; float16 buffers hold the values rounded to nearest
    (as NumPy rounds), clamped to the largest finite half."""
    k_buf, v_buf = np.zeros((3, 10, 8), dtype), np.zeros((3, 10, 8), dtype)
    k, v = rng.standard_normal((4, 3, 8)).astype(np.float32), rng.standard_normal((4, 3, 8)).astype(np.float32)
    k[0, 0, :2] = [1e6, -7e4]
    slots = np.array([[7, 2, 9, 0], [1, 2, 3, 4], [9, 8, 0, 5]])
    want_k, want_v = k_buf.copy(), v_buf.copy()
    ref.ReferenceBackend.store_kv(want_k, want_v, slots, k, v)
    CpuBackend().store_kv(k_buf, v_buf, slots, k, v)
    assert np.array_equal(k_buf, want_k) and np.array_equal(v_buf, want_v)
    assert np.isfinite(k_buf).all()
    for g in range(3):
        assert np.array_equal(v_buf[g, slots[g]], v[:, g].astype(dtype))
    if dtype == np.float16:
        assert k_buf[0, 7, 0] == np.finfo(np.float16).max and k_buf[0, 7, 1] == -np.finfo(np.float16).max


@pytest.mark.parametrize("n", [1, 3, 17])
def test_lowest_scored(n):
    """H2O's eviction choice: per row, the n lowest scores among slots holding a position in
    [first, last], ties (scores drawn from few values) by lowest slot; checked by sorting
    (score, slot) pairs in Python."""
    L, G, C, first, last = 3, 2, 200, 4, 150
    slot_pos = np.stack([[rng.permutation(C) for _ in range(G)] for _ in range(L)])
    slot_pos[rng.random(slot_pos.shape) < 0.1] = -1                   # free slots
    score = (rng.integers(0, 20, (L, G, C)) / 8).astype(np.float32)
    got = CpuBackend.lowest_scored(slot_pos, score, first, last, n)
    assert np.array_equal(got, ref.lowest_scored(slot_pos, score, first, last, n))
    for l in range(L):
        for g in range(G):
            ok = [(score[l, g, s], s) for s in range(C) if first <= slot_pos[l, g, s] <= last]
            assert list(got[l, g]) == [s for _, s in sorted(ok)[:n]]


def test_dispatch():
    assert get_backend("cpu").name == "cpu" and get_backend("auto").name == "cpu"
    assert get_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="unknown device"):
        get_backend("tpu")


def tiny_models(tmp_path, heads, kv_heads, **over):
    """A tiny float model directory and its 4-bit (RTN, group 32) conversion."""
    d = write_tiny_model(tmp_path / "m", tiny_config(hidden_size=128, intermediate_size=192, num_attention_heads=heads,
                                                     num_key_value_heads=kv_heads, **over))
    return d, convert(d, tmp_path / "q", method="rtn", group_size=32)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 8), (8, 1)])
def test_tiny_model_cpu_equals_reference(tmp_path, heads, kv_heads):
    for model in tiny_models(tmp_path, heads, kv_heads):
        fast, slow = tinyrt.LLM(model, device="cpu"), tinyrt.LLM(model, device="reference")
        prompt = "hello there, " * 5
        a = fast.generate(prompt, max_tokens=24, temperature=0, raw=True)
        b = slow.generate(prompt, max_tokens=24, temperature=0, raw=True)
        assert a == b


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_fused_layers_give_each_of_a_few_tokens_its_one_token_result(tmp_path, policy,
                                                                     monkeypatch):
    """A 4-bit model's pass over a few tokens (a draft's verification) runs the fused layer
    kernel as a decode step does, and gives each token the logits a decode step gives it, to
    the bit (so greedy speculation cannot flip a near-tie); the caches end the same. (h2o's
    scores decay per token appended, and a chunk's queries count alike, so the kernels' score
    sums are compared without the decay.)"""
    monkeypatch.setattr(kv_cache, "SCORE_DECAY", 1.0)
    _, q = tiny_models(tmp_path, 8, 2)
    m = tinyrt.LLM(q, device="cpu").model
    c = m.config
    caches = [make_cache(CacheOptions(policy, 64, "f32"), m) for _ in range(2)]
    ids = rng.integers(0, c.vocab_size, 30)
    for cache in caches:
        m.forward(ids[:20], cache)
    one = [m.forward([t], caches[0])[0] for t in ids[20:]]
    rows = m.forward(ids[20:], caches[1], all_logits=True)
    assert all(np.array_equal(a, b) for a, b in zip(one, rows))
    assert np.array_equal(caches[0].k, caches[1].k)
    assert np.array_equal(caches[0].slot_pos, caches[1].slot_pos)
    if policy == "h2o":
        assert np.array_equal(caches[0].score, caches[1].score)


FUSED_CASES = {"llama": (4, 2, None, "dense"), "llama-mha": (8, 8, None, "dense"),
               "mistral": (8, 2, 5, "dense"), "llama-h2o": (4, 2, None, "h2o"),
               "qwen2": (4, 2, None, "dense"), "qwen2-h2o": (8, 2, None, "h2o"),
               "qwen3": (4, 2, None, "dense"), "smollm3": (4, 2, None, "dense"),
               "phi3": (4, 2, 7, "dense"), "gemma3_text": (4, 2, 5, "dense"),
               "gemma3_text-h2o": (4, 1, 5, "h2o")}
FAMILY_OVER = {"smollm3": {"no_rope_layers": [1, 0]},       # its second layer a NoPE layer
               "phi3": {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
                        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.5] * 8,
                                         "long_factor": [4.0] * 8}},
               # a sliding layer and a global one, each with its RoPE base; GeGLU
               "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"],
                               "head_dim": 32,      # (Gemma 3's default: 256)
                               "hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                               "rope_local_base_freq": 10_000.0}}


def test_the_fused_layer_is_checked_for_every_family():
    assert {case.split("-")[0] for case in FUSED_CASES} == \
        {name for name, f in FAMILIES.items() if f.model.fusable}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_decode_layer_equals_the_ops(tmp_path, case):
    """One-token decode through the fused layer kernel gives the logits of the model file's
    layer run op by op, step after step, for every family (sliding window included; q/k/v
    biases; an h2o cache, its scores and evictions too)."""
    heads, kv_heads, window, policy = FUSED_CASES[case]
    family = case.split("-")[0]
    over = dict(model_type=family, architectures=[FAMILIES[family].architecture],
                **FAMILY_OVER.get(family, {}))
    if window:
        over["sliding_window"] = window
    _, q = tiny_models(tmp_path, heads, kv_heads, **over)
    fused, ops = tinyrt.LLM(q, device="cpu").model, tinyrt.LLM(q, device="cpu").model
    ops.backend.fused_decode = lambda layer, tokens: False
    assert fused.backend.fused_decode(fused.layers[0], 1)
    c = fused.config
    size = 24 if policy == "h2o" else 64                 # h2o: 50 evictions
    caches = [make_cache(CacheOptions(policy, size, "f32"), m) for m in (fused, ops)]
    ids = rng.integers(0, c.vocab_size, 60 if policy == "h2o" else 30)
    for m, cache in zip((fused, ops), caches):
        m.forward(ids[:9], cache)
    for t in ids[9:]:
        a, b = (m.forward([t], cache) for m, cache in zip((fused, ops), caches))
        # the fused kernel is compiled apart (and its code loaded from Numba's cache differs
        # again from a fresh compilation's): float32 sums in another order, through the layers
        assert rel_err(a, b) < 1e-4
    assert np.array_equal(caches[0].slot_pos, caches[1].slot_pos)
