"""The quantized KV cache (kernels.kv_quant, KIVI): the math against its definition, the CPU
kernels against the NumPy reference on fresh random inputs, and every cache policy on a tiny
model against the float16 cache."""

import numpy as np
import pytest

import tinyrt
from helpers import quant_store, tiny_config, write_tiny_model
from tinyrt.errors import CacheFullError, TinyrtError
from tinyrt.kernels import get_backend, kv_quant, reference as ref
from tinyrt.kernels.cpu import CpuBackend, kv as cpu_kv
from tinyrt.kernels.reference import ReferenceBackend
from tinyrt.kv_cache import POLICIES, KVCache, KVLayout
from tinyrt.kv_options import CacheOptions

BITS = (8, 4, 2)


@pytest.mark.parametrize("bits", BITS)
def test_codes_round_to_the_nearest_step_of_each_group(bits):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 32)).astype(np.float32) * rng.uniform(0.1, 50, (40, 1))
    x[3] = 1.5                                        # a constant group
    c, scale, zero = kv_quant.quantize(x, bits)
    assert c.max() <= 2 ** bits - 1
    s, z = scale.astype(np.float32)[:, None], zero.astype(np.float32)[:, None]
    err = np.abs(c * s + z - x)
    # half a step, and float16's rounding of the zero and of the scale times the top code
    slack = np.abs(x).max(axis=1, keepdims=True) * 2 ** -10
    assert (err <= s / 2 + slack).all()
    assert (c[3] == 0).all() and np.float32(zero[3]) == 1.5
    assert (kv_quant.unpack(kv_quant.pack(c, bits), bits) == c).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("R", [1, 3, 4, 7])
@pytest.mark.parametrize("L, n, group", [(64, 64, 64), (64, 17, 32), (128, 5, 16), (32, 9, 16),
                                         (16, 5, 16), (8, 3, 4)])
def test_weighted_sums_of_code_rows(bits, R, L, n, group):
    """cpu_kv.add_codes (the vector intrinsic, or loops where rows are not whole vectors): acc
    plus the weighted sum of the code rows, against NumPy."""
    rng = np.random.default_rng(8)
    codes = rng.integers(0, 2 ** bits, (n, L)).astype(np.uint8)
    w = rng.standard_normal((R, n, L // group)).astype(np.float32)
    acc = rng.standard_normal((R, L)).astype(np.float32)
    want = acc + np.einsum("rig,igc->rgc", w, codes.reshape(n, L // group, group)).reshape(R, L)
    cpu_kv.add_codes(w, kv_quant.pack(codes, bits), bits, group, acc)
    assert np.abs(acc - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block, D", [(4, 16), (16, 64), (64, 64), (32, 128)])
@pytest.mark.parametrize("order", ["in order", "scattered"])
def test_cpu_writes_and_reads_as_the_reference(bits, block, D, order):
    """Rows written in slot order (dense, the sink ring) or anywhere (h2o's evictions), a few
    at a time, through a small pool: the CPU kernel keeps the same blocks in the pool, the same
    scales and the same codes as the reference, and reads back the reference's floats, to the
    bit; both within half a step of what was written in order, within a few steps after
    scattered writes."""
    rng = np.random.default_rng(2)
    N, C = 3, 8 * block
    want, got = (quant_store(N, C, D, bits, block, 2 * block) for _ in range(2))
    written = np.zeros((N, C, 2, D), np.float32)
    at = 0
    for step in range(4 * C // 3):
        T = int(rng.integers(1, 4))
        if order == "in order":        # around the slots twice over, as a ring
            slots = np.tile((np.arange(T) + at) % C, (N, 1))
            at += T
        else:
            slots = np.stack([rng.choice(C, T, replace=False) for _ in range(N)])
        k, v = (rng.standard_normal((T, N, D)).astype(np.float32) * 4 for _ in range(2))
        ReferenceBackend.store_kv(want, None, slots, k, v)
        CpuBackend(2).store_kv(got, None, slots, k, v)
        for n in range(N):
            written[n, slots[n], 0], written[n, slots[n], 1] = k[:, n], v[:, n]
    for name in ("where", "owner", "stamp", "ks", "vs", "fk", "fv", "kc", "vc"):
        a, b = getattr(got, name), getattr(want, name)
        assert np.array_equal(a.view(np.uint16) if a.dtype == np.float16 else a,
                              b.view(np.uint16) if b.dtype == np.float16 else b), name
    k, v = CpuBackend(1).read_kv(got, None, C)
    rk, rv = kv_quant.dequantize(want, C)
    for a, b, x in ((k, rk, written[:, :, 0]), (v, rv, written[:, :, 1])):
        step = (x.max() - x.min()) / (2 ** bits - 1)
        # the same codes and scales, dequantized in IEEE order (no fastmath): the same floats
        assert np.array_equal(a, b)
        # a scattered write off its block's grid quantizes the group afresh, its other values
        # rounded once more: within a few steps of the truth
        assert np.abs(b - x).max() <= step * (0.51 if order == "in order" else 4)


def test_the_residual_and_the_pinned_blocks_stay_float():
    """Written in order, the last R tokens read back as the float16 of what was written, and so
    do the pinned first blocks (the sinks), however many blocks were sealed since."""
    rng = np.random.default_rng(3)
    block, R, D = 4, 8, 16
    store = quant_store(2, 64, D, 2, block, R, pin=1)
    k, v = (rng.standard_normal((50, 2, D)).astype(np.float32) for _ in range(2))
    for t in range(50):
        CpuBackend(1).store_kv(store, None, np.full((2, 1), t), k[t:t + 1], v[t:t + 1])
    rk, rv = kv_quant.dequantize(store, 50)
    for got, x in ((rk, k), (rv, v)):
        x16 = x.transpose(1, 0, 2).astype(np.float16).astype(np.float32)
        assert np.array_equal(got[:, -R:], x16[:, -R:])
        assert np.array_equal(got[:, :block], x16[:, :block])
        assert not np.array_equal(got[:, block:-R - block], x16[:, block:-R - block])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("S, window, ratio", [(1, None, 1), (300, None, 3), (700, 200, 2),
                                              (520, None, 4)])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_attention_reads_the_codes_as_the_reference(bits, S, window, ratio, T):
    """CPU decode attention over a quantized cache (pool blocks and sealed blocks, hidden slots,
    H2O scores) against the reference over the dequantized cache."""
    rng = np.random.default_rng(4)
    G, D, block = 2, 64, 32
    store = quant_store(G, 1024, D, bits, block, 64)
    slots = np.tile(np.arange(S), (G, 1))
    k, v = (rng.standard_normal((S, G, D)).astype(np.float32) for _ in range(2))
    ReferenceBackend.store_kv(store, None, slots, k, v)
    k_pos = np.tile(np.arange(S), (G, 1))
    k_pos[:, 1::7] = -1
    q = rng.standard_normal((T, G * ratio, D)).astype(np.float32)
    q_pos = np.maximum(np.arange(S - T, S), 0)
    want_score, got_score = np.zeros((G, 1024), np.float32), np.zeros((G, 1024), np.float32)
    want = ref.attention(q, store, None, q_pos, k_pos, 0.125, window, want_score)
    got = CpuBackend(2).attention(q, store, None, q_pos, k_pos, 0.125, window, got_score)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(got_score - want_score).max() <= 1e-5 * T


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                      max_position_embeddings=1024)
    return write_tiny_model(tmp_path_factory.mktemp("kvq") / "m", cfg, seed=5)


def _logits(llm, tokens):
    return np.stack([llm.model.forward([t], llm.cache)[0] for t in tokens])


@pytest.mark.parametrize("policy, size", [("dense", 400), ("sink", 48), ("h2o", 48)])
@pytest.mark.parametrize("kv_type, tol", [("q8", 0.01), ("q4", 0.1), ("q2", 0.5)])
def test_every_policy_runs_on_codes_close_to_float16(tiny, policy, size, kv_type, tol):
    """200 tokens, one at a time (sink and h2o: the window wraps four times over): the logits
    of a quantized cache (groups of 4, a residual of 8) against those of a float16 cache of the
    same policy, relative error per step within `tol`, on the CPU and reference backends; the
    two within 1e-3 over the first 100 steps, but for h2o (their float sums differ in order, so
    a value on a rounding tie of its code may go either way, and later tokens' K/V diverge from
    there); inside the residual, the float16 cache's logits."""
    rng = np.random.default_rng(5)
    opts = dict(kv_policy=policy, kv_size=size, kv_group=4, kv_residual=8)
    f16 = tinyrt.LLM(tiny, device="cpu", **opts)
    q = tinyrt.LLM(tiny, device="cpu", kv_type=kv_type, **opts)
    qr = tinyrt.LLM(tiny, device="reference", kv_type=kv_type, **opts)
    tokens = rng.integers(0, 320, 200)
    a, b, c = _logits(f16, tokens), _logits(q, tokens), _logits(qr, tokens)
    scale = np.abs(a).max(axis=1)
    for got in (b, c):
        assert (np.abs(got - a).max(axis=1) <= tol * scale).all()
    if policy != "h2o":        # (where a score a rounding apart may evict another token)
        assert np.abs(b[:100] - c[:100]).max() <= 1e-3 * scale.max()
    assert np.abs(b[:8] - a[:8]).max() <= 1e-5 * scale.max()       # all in the float residual
    assert np.abs(b - a).max() > 0                                   # and codes after it


def test_drafts_roll_back_inside_the_residual(tiny):
    """Speculative decoding over a q4 cache: greedy output token for token that of the same
    cache without a draft (drafted slots are rolled back inside the float residual)."""
    plain = tinyrt.LLM(tiny, device="cpu", kv_type="q4", kv_group=4, kv_residual=16)
    drafted = tinyrt.LLM(tiny, device="cpu", kv_type="q4", kv_group=4, kv_residual=16,
                         draft="lookup", draft_tokens=4)
    prompt = "abc abc abc abd abc abc"
    want = plain.generate(prompt, raw=True, max_tokens=120, temperature=0, ignore_eos=True)
    got = drafted.generate(prompt, raw=True, max_tokens=120, temperature=0, ignore_eos=True)
    assert got == want


def test_options_and_sizes(tiny):
    llm = tinyrt.LLM(tiny, device="cpu")
    cfg = llm.config
    f16, q4 = CacheOptions(), CacheOptions(kv_type="q4")
    assert q4.token_bytes(cfg) < 0.35 * f16.token_bytes(cfg)
    assert "q4" in q4.describe(cfg) and "residual" in q4.describe(cfg)
    budget = CacheOptions(kv_type="q4", kv_mem="1MB")
    n = budget.size_for(cfg)
    assert n * budget.token_bytes(cfg) + budget.fixed_bytes(cfg) <= 10 ** 6
    assert (n + 1) * budget.token_bytes(cfg) + budget.fixed_bytes(cfg) > 10 ** 6
    with pytest.raises(CacheFullError, match="residual"):
        CacheOptions(kv_type="q4", kv_mem=1000).size_for(cfg)
    for bad in (3, 0, 512, True, "8"):
        with pytest.raises(TinyrtError, match="--kv-group"):
            CacheOptions(kv_type="q4", kv_group=bad)
    with pytest.raises(TinyrtError, match="--kv-residual"):
        CacheOptions(kv_residual=-1)
    with pytest.raises(TinyrtError, match="less than a byte"):
        tinyrt.LLM(tiny, device="cpu", kv_type="q2", kv_group=2)
    with pytest.raises(TinyrtError, match="head dim of 24"):
        CacheOptions(kv_type="q4", kv_group=16).check(KVLayout(2, 2, 24, None))
    class FloatOnly(ReferenceBackend):
        name, quantized_kv = "float-only", False

    with pytest.raises(TinyrtError, match="float-only kernels read f16"):
        KVCache(KVLayout.of(llm.model), 100, FloatOnly(), CacheOptions(kv_type="q8"))
    cache = tinyrt.LLM(tiny, device="cpu", kv_type="q4", kv_size=100).cache
    assert cache.bytes_per_token == round(2 * 2 * kv_quant.token_bytes(4, 64, 32))
    assert cache.k.where.shape[-1] * 64 >= 100


@pytest.mark.parametrize("bits", BITS)
def test_requantizing_keeps_the_grid_of_a_group_whose_new_values_fit(bits):
    """kv_quant.requantize: a group holding values as its codes gave them keeps its grid and
    those codes where its new values fit the grid (coded on it); a group with a value off the
    grid, with none as it was, or with scale 0 is quantized afresh."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 32)).astype(np.float32) * 3
    x[:, 4], x[:, 5] = x.min(axis=1) - 1, x.max(axis=1) + 1     # the extremes, replaced below
    x[5] = 2.0                                                   # scale 0
    codes, scale, zero = kv_quant.quantize(x, bits)
    s, z = scale.astype(np.float32)[:, None], zero.astype(np.float32)[:, None]
    was = (codes * s + z).astype(np.float16)
    new = was.astype(np.float32)
    new[:, 4:7] = (x[:, :3] + x[:, 3:6]) / 2                     # within the range of each group
    new[1, 9] = x[1].max() + 4 * s[1, 0]                         # off the grid
    new[2] = x[2] * 0.9                                          # none as it was
    new[5, 4:7] = 2.5
    got = kv_quant.requantize(new, was, codes, scale, zero, bits)
    fresh = kv_quant.quantize(new, bits)
    for g in range(6):
        if g in (0, 3, 4):
            want_codes = codes[g].copy()
            want_codes[4:7] = np.floor((new[g, 4:7] - z[g]) / s[g] + np.float32(0.5))
            assert np.array_equal(got[0][g], want_codes)
            assert got[1][g] == scale[g] and got[2][g] == zero[g]
        else:
            assert np.array_equal(got[0][g], fresh[0][g])
            assert got[1][g] == fresh[1][g] and got[2][g] == fresh[2][g]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("backend", ["reference", "cpu", "cuda"])
def test_a_block_sealed_again_keeps_its_other_tokens_codes(bits, backend):
    """A slot of a sealed block written again (h2o's eviction) with keys inside each channel's
    range: each time the block is sealed again, its other tokens read back exactly as after the
    first sealing, and the new key within half a step of what was written."""
    rng = np.random.default_rng(12)
    B, D, N = 16, 32, 2
    be = get_backend(backend)
    store = quant_store(N, 2 * B, D, bits, B, zeros=be.zeros)    # a pool of one block
    k, v = (rng.standard_normal((2 * B, N, D)).astype(np.float32) for _ in range(2))
    be.store_kv(store, None, np.tile(np.arange(2 * B), (N, 1)), k, v)
    first = be.read_kv(store, None, B)                           # block 0, sealed once
    rewritten = set()
    for step in range(12):
        s = int(rng.integers(B))
        a, b = rng.choice(B, 2, replace=False)
        kn = (k[a] + k[b]) / 2                                   # inside every key channel's range
        vn = rng.standard_normal((N, D)).astype(np.float32)
        be.store_kv(store, None, np.full((N, 1), s), kn[None], vn[None])
        be.store_kv(store, None, np.full((N, 1), B + step % B), k[B:B + 1], v[B:B + 1])
        rewritten.add(s)
        k[s], v[s] = kn, vn
        got = [be.to_numpy(a) for a in be.read_kv(store, None, B)]
        keep = [i for i in range(B) if i not in rewritten]
        for f, g in zip(first, got):
            assert np.array_equal(be.to_numpy(f)[:, keep], g[:, keep])
        ks = be.to_numpy(store.ks)[:, 0, 0].astype(np.float32)    # [N, D] the kept grids
        # half a step, and float16's rounding of the written key and of what is read back
        assert np.all(np.abs(got[0][:, s] - kn) <= ks * 0.5 + np.abs(kn) * 2.0 ** -10 + 1e-6)


@pytest.mark.parametrize("bits", BITS)
def test_groups_at_the_float16_limits_reopen_alike_on_every_backend(bits):
    """A group spanning float16's whole range (its top code reads back past 65504), -0.0 beside
    +0.0, sealed and opened again: every backend keeps the same bits, and reads finite values."""
    B, D, N = 16, 32, 1
    k = np.zeros((2 * B, N, D), np.float32)
    k[0, :, :8], k[1, :, 8:16] = 65504, -65504
    k[0, :, 16:24] = -0.0                              # before the +0.0 of the other slots
    v = k[:, :, ::-1].copy()
    stores = {}
    for name in ("reference", "cpu", "cuda"):
        be = get_backend(name)
        store = quant_store(N, 2 * B, D, bits, B, zeros=be.zeros)
        be.store_kv(store, None, np.tile(np.arange(2 * B), (N, 1)), k, v)   # block 0 sealed
        be.store_kv(store, None, np.full((N, 1), 3), k[4:5], v[4:5])       # opened again
        be.store_kv(store, None, np.full((N, 1), B), k[B:B + 1], v[B:B + 1])  # sealed again
        for a in be.read_kv(store, None, 2 * B):
            assert np.isfinite(be.to_numpy(a)).all(), name
        stores[name] = [be.to_numpy(a) for a in store[:-1]]
    for name in ("cpu", "cuda"):
        for a, b in zip(stores[name], stores["reference"]):
            assert np.array_equal(a.view(np.uint16) if a.dtype == np.float16 else a,
                                  b.view(np.uint16) if b.dtype == np.float16 else b), name


def make_cache_for(layout, options):
    return POLICIES[options.kv_policy](layout, options.kv_size, ReferenceBackend(), options)


def test_h2o_on_codes_keeps_h2o_s_tokens_and_fills_a_few_blocks_at_a_time():
    """h2o over a quantized cache keeps the tokens h2o over a float cache keeps (the same
    scores), never more than its size, and puts its new tokens in the holes of one block after
    another: most new tokens go to the block the one before went to (taking their victims'
    slots, they would go to any block)."""
    rng = np.random.default_rng(13)
    layout = KVLayout(2, 3, 16, [np.ones(8, np.float32)] * 2)
    opts = dict(kv_policy="h2o", kv_size=40, sinks=2, recent=4)
    caches = [make_cache_for(layout, CacheOptions(**opts)),
              make_cache_for(layout, CacheOptions(**opts, kv_type="q4", kv_group=8))]
    weight = rng.random((2, 3, 400)).astype(np.float32)          # attention per position
    blocks, same = None, []
    for step in range(400):
        for cache in caches:
            cache.allocate(1)
            table = cache.slot_pos
            cache.score += np.where(table >= 0, np.take_along_axis(
                weight, np.maximum(table, 0), axis=-1), 0)
        held = [np.sort(np.where(c.slot_pos >= 0, c.slot_pos, 10 ** 9), axis=-1)[..., :40]
                for c in caches]
        assert np.array_equal(*held)
        assert ((caches[1].slot_pos >= 0).sum(axis=-1) <= 40).all()
        new = caches[1].layer(0).slots, caches[1].layer(1).slots
        block = np.concatenate(new)[:, 0] // 8
        if step > 40:
            same.append(block == blocks)
        blocks = block
    assert np.mean(same) > 0.6
