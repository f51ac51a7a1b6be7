"""KV cache policies: the slot tables, and the streaming caches against a plain NumPy oracle that
rebuilds every step's attention from the kept tokens and their positions within the cache."""

import numpy as np
import pytest

import tinyrt
from helpers import seeded_rng, tiny_config, write_tiny_model
from tinyrt.errors import CacheFullError, TinyrtError
from tinyrt.kernels import get_backend, reference as ref
from tinyrt.kv_cache import SCORE_DECAY, CacheOptions, H2OCache, KVCache, KVLayout, SinkCache

rng = seeded_rng(__name__)
STEPS = 2000


def _layout(n_layers, kv_heads, head_dim):
    return KVLayout(n_layers, kv_heads, head_dim,
                    [1 / 10000 ** (np.arange(head_dim // 2) / head_dim)] * n_layers)


def test_sink_slots_and_positions():
    c = SinkCache(_layout(1, 1, 4), 8, get_backend("reference"), CacheOptions(sinks=2))     # window of 6
    pos = c.allocate(5)
    assert list(c.layer(0)[2][0]) == [0, 1, 2, 3, 4] and list(pos) == [0, 1, 2, 3, 4]
    assert c.sink_shift == 0
    pos = c.allocate(4)                           # positions 5..8: 5, 6, 7 fill, 8 evicts 2
    assert list(c.layer(0)[2][0]) == [5, 6, 7, 2] and list(pos) == [5, 6, 7, 8]
    assert c.length == c.span == 8 and c.sink_shift == 1
    assert sorted(c.slot_positions()) == [0, 1, 3, 4, 5, 6, 7, 8]
    for _ in range(20):                           # the sinks stay, the window is the last 6
        c.allocate(1)
    assert sorted(c.slot_positions()) == [0, 1] + list(range(23, 29)) and c.sink_shift == 21
    assert c.chunk == 3 and c.fits(1000)          # any number of tokens, in chunks
    with pytest.raises(CacheFullError, match="exceed the window"):
        c.allocate(7)
    with pytest.raises(ValueError, match="evicted"):
        c.rollback(1)
    c.reset()
    assert c.length == c.next_pos == 0 and (c.slot_pos == -1).all()
    c.allocate(3)
    c.rollback(2)                                 # nothing evicted yet: allowed
    assert c.next_pos == 1 and list(c.slot_positions()) == [0]


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_sinks_are_re_rotated_by_each_layer_s_own_frequencies(device):
    """Layers with two sets of RoPE frequencies (Gemma 3's sliding and global, a NoPE layer's
    zeros): when the window moves, each layer's sink keys are its un-rotated keys rotated to
    their new positions by that layer's frequencies (against rotations written here)."""
    D = 8
    freqs = [1 / 10000 ** (np.arange(D // 2) / D), 1 / 1e6 ** (np.arange(D // 2) / D),
             np.zeros(D // 2)]
    layers = [freqs[0], freqs[1], freqs[0], freqs[2]]
    be = get_backend(device)
    c = SinkCache(KVLayout(4, 2, D, layers), 8, be, CacheOptions(sinks=2, kv_type="f32"))

    def rotate(x, f, p):                      # x [.., D] rotate-half by angles p * f
        a = p * f
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)

    raw = rng.standard_normal((4, 2, 2, D))        # [layer, head, sink, D], before rotation
    pos = c.allocate(2)
    for i in range(4):
        k = np.stack([rotate(raw[i, :, t], layers[i], t) for t in range(2)]).astype(np.float32)
        be.store_kv(*c.layer(i)[:2], c.layer(i).slots, k, k)
    for _ in range(10):                            # the window moves: the sinks shift
        pos = c.allocate(1)
    assert c.sink_shift == pos[0] - 7 > 0
    for i in range(4):
        got = be.read_kv(*c.layer(i)[:2], 2)[0]           # [G, 2, D]
        want = np.stack([rotate(raw[i, :, t], layers[i], t + c.sink_shift) for t in range(2)], 1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_window_is_sink_without_sinks():
    c = SinkCache(_layout(1, 1, 4), 5, get_backend("reference"), CacheOptions(sinks=0))
    for _ in range(12):
        c.allocate(1)
    assert sorted(c.slot_positions()) == list(range(7, 12)) and c.sink_shift == 7


def test_h2o_evicts_the_lowest_score_per_head():
    """Each KV head of each layer evicts its own lowest-scored token outside the sinks and the
    recent window, and the new token takes that slot with a score of 0."""
    c = H2OCache(_layout(2, 2, 4), 8, get_backend("reference"), CacheOptions(sinks=2, recent=3))
    assert list(c.allocate(6)) == list(range(6)) and list(c.allocate(2)) == [6, 7]
    assert c.layer(1)[3].shape == (2, 8) and c.layer(1)[2].tolist() == [[6, 7], [6, 7]]
    c.score[...] = rng.random(c.score.shape) + 1
    c.score[0, 0, 4] = c.score[0, 1, 2] = c.score[1, 0, 3] = 0.5        # candidates: positions 2..5
    c.score[1, 1, 5] = 0.1
    c.score[:, :, [0, 1, 6, 7]] = 0                # sinks and the two newest: kept whatever their score
    pos = c.allocate(1)                            # position 8; recent: 6, 7, 8
    assert list(pos) == [8]
    assert c.layer(0)[2].tolist() == [[4], [2]] and c.layer(1)[2].tolist() == [[3], [5]]
    assert c.slot_pos[0, 0].tolist() == [0, 1, 2, 3, 8, 5, 6, 7] and c.score[0, 0, 4] == 0
    assert c.slot_pos[1, 1].tolist() == [0, 1, 2, 3, 4, 8, 6, 7]
    assert c.chunk == 3
    c.allocate(3)                                  # three evictions at once, per head
    assert ((c.slot_pos >= 0) & (c.slot_pos < 2)).sum() == 2 * 2 * 2
    assert all(set(range(9, 12)) <= set(c.slot_pos[i, g]) for i in range(2) for g in range(2))
    with pytest.raises(CacheFullError, match="exceed"):
        c.allocate(7)                              # 7 evictions, 6 tokens outside the sinks
    with pytest.raises(ValueError, match="evicted"):
        c.rollback(1)
    c.reset()
    assert (c.slot_pos == -1).all() and not c.score.any()


def test_h2o_scores_decay_with_each_token_appended():
    """Before a chunk of n tokens goes in, every score is multiplied by SCORE_DECAY**n (one that
    falls below SCORE_FLOOR becomes 0), so that attention received lately outweighs attention
    received long ago: a token attended once, strongly, gives way to one attended a little at
    every step, which a plain sum would still rank below it."""
    from tinyrt.kv_cache import SCORE_FLOOR

    c = H2OCache(_layout(1, 1, 4), 6, get_backend("reference"), CacheOptions(sinks=1, recent=1))
    c.allocate(3)
    c.allocate(3)
    c.score[0, 0] = [0, 3.0, 2.0, 1e-31, 2.5, 1.0]
    before = c.score.copy()
    c.allocate(2)                       # decays, then evicts positions 3 and 5, the lowest
    want = before[0, 0] * np.float32(SCORE_DECAY ** 2)
    want[want < SCORE_FLOOR] = 0
    assert c.slot_pos[0, 0].tolist() == [0, 1, 2, 6, 4, 7]
    np.testing.assert_array_equal(c.score[0, 0, [0, 1, 2, 4]], want[[0, 1, 2, 4]])
    assert want[3] == 0 and c.score[0, 0, [3, 5]].tolist() == [0, 0]
    c.score[0, 0] = [0, 3.0, 0, 1.0, 0, 0]   # position 1: 3 long ago, position 6: 1
    for _ in range(100):                      # then 100 steps, position 6 attended 0.015 a step
        c.score[0, 0, c.slot_pos[0, 0] == 6] += 0.015    # (each step evicts a 0-score token)
        c.allocate(1)
    at = {p: c.score[0, 0, c.slot_pos[0, 0] == p][0] for p in (1, 6)}
    assert at[6] > at[1] and 1.0 + 100 * 0.015 < 3.0          # a plain sum: the other way


def test_policy_errors():
    be = get_backend("reference")
    with pytest.raises(TinyrtError, match="unknown KV cache policy"):
        CacheOptions("lru")
    with pytest.raises(CacheFullError, match="--sinks 8"):
        SinkCache(_layout(1, 1, 4), 8, be, CacheOptions(sinks=8))
    with pytest.raises(CacheFullError, match="--recent 7"):
        H2OCache(_layout(1, 1, 4), 8, be, CacheOptions(sinks=2, recent=7))
    with pytest.raises(CacheFullError, match="--kv-policy sink or h2o"):
        KVCache(_layout(1, 1, 4), 8, be).allocate(9)


@pytest.mark.parametrize("policy", ["dense", "sink", "h2o"])
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_a_memory_budget_picks_the_size_that_fits(tiny, policy, kv_type):
    """--kv-mem: as many tokens as fit at token_bytes each, which are the bytes the cache
    really holds per token (K, V and the policy's tables); a budget that holds no token, both
    sizes at once or a size that is not one are refused in one line."""
    llm = tinyrt.LLM(tiny, kv_policy=policy, kv_type=kv_type, kv_mem="100KB")
    cache, options = llm.cache, llm.cache_options
    each = options.token_bytes(llm.config)
    assert cache.capacity == 100_000 // each
    tables = cache.slot_pos.nbytes + (cache.score.nbytes if policy == "h2o" else 0)
    assert cache.nbytes + tables == cache.capacity * each <= 100_000
    text = options.describe(llm.config, cache.capacity)
    assert f"{each / 1024:.1f} KiB per token: {cache.capacity:,} tokens" in text
    same = dict(kv_policy=policy, kv_type=kv_type)
    assert tinyrt.LLM(tiny, kv_mem=11 * each - 1, **same).cache.capacity == 10
    with pytest.raises(CacheFullError, match="holds no token"):
        tinyrt.LLM(tiny, kv_mem=each - 1, **same)
    with pytest.raises(TinyrtError, match="not both"):
        CacheOptions(kv_size=64, kv_mem="1MB")
    for bad in ("lots", "-1MB", 0, 1.5, True):
        with pytest.raises(TinyrtError):
            CacheOptions(kv_mem=bad)


class Oracle:
    """StreamingLLM by its definition, in NumPy: every token's un-rotated K and V are kept as
    first computed; a chunk of new tokens first evicts (the window holds the last W tokens once
    the chunk is in), then each of its queries attends over the sinks and the window tokens up
    to itself, queries and keys rotated at their positions within the cache (sinks 0..n_sink-1,
    then the window in order)."""

    def __init__(self, model, n_sink: int, capacity: int):
        self.m, self.n_sink, self.window = model, n_sink, capacity - n_sink
        L = model.config.num_hidden_layers
        self.k, self.v = [[] for _ in range(L)], [[] for _ in range(L)]     # per token [G, D]

    def rollback(self, n: int) -> None:
        for i in range(len(self.k)):
            del self.k[i][len(self.k[i]) - n:], self.v[i][len(self.v[i]) - n:]

    def forward(self, tokens, all_logits: bool = False) -> np.ndarray:
        m, cfg = self.m, self.m.config
        n, T = len(self.k[0]), len(tokens)
        Q, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        first = max(self.n_sink, n + T - self.window)           # oldest window token kept
        kept = [j for j in range(n + T) if j < self.n_sink or j >= first]
        cache_pos = {j: (j if j < self.n_sink else self.n_sink + j - first) for j in kept}
        q_pos = np.array([cache_pos[n + t] for t in range(T)])
        k_pos = np.array([cache_pos[j] for j in kept])
        x = ref.embedding(m.embed, np.asarray(tokens))
        for i, L in enumerate(m.layers):
            qkv = ref.linear(ref.rmsnorm(x, L.input_norm, cfg.rms_norm_eps), L.qkv)
            q = qkv[:, :Q * D].reshape(T, Q, D)
            self.k[i] += list(qkv[:, Q * D:(Q + G) * D].reshape(T, G, D))
            self.v[i] += list(qkv[:, (Q + G) * D:].reshape(T, G, D))
            q = ref.rope(q, *ref.rope_tables(m.layer_freqs[0], q_pos))
            k = ref.rope(np.stack([self.k[i][j] for j in kept]), *ref.rope_tables(m.layer_freqs[0], k_pos))
            v = np.stack([self.v[i][j] for j in kept])
            a = ref.attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), q_pos, k_pos, m.scale)
            x = x + ref.linear(a.reshape(T, Q * D), L.o)
            gu = ref.linear(ref.rmsnorm(x, L.post_norm, cfg.rms_norm_eps), L.gate_up)
            x = x + ref.linear(ref.ReferenceBackend.swiglu(gu), L.down)
        return ref.linear(ref.rmsnorm(x if all_logits else x[-1:], m.norm, cfg.rms_norm_eps),
                          m.lm_head)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    return write_tiny_model(tmp_path_factory.mktemp("kv") / "m", cfg, seed=3)


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("n_sink", [4, 0])
def test_sink_cache_agrees_with_the_oracle_over_thousands_of_steps(tiny, device, n_sink):
    """2000 one-token steps through a 24-slot cache (about 100 wrap-arounds of the window), after
    a 40-token prompt that goes in chunks: the logits of every step within 1e-4."""
    llm = tinyrt.LLM(tiny, device=device, kv_size=24, kv_type="f32", kv_policy="sink",
                     sinks=n_sink)
    oracle = Oracle(tinyrt.LLM(tiny, device="reference").model, n_sink, 24)
    cache, model = llm.cache, llm.model
    prompt = rng.integers(0, 320, 40)
    want = oracle_prompt = None
    for c in range(0, len(prompt), cache.chunk):          # the oracle takes the same chunks
        oracle_prompt = oracle.forward(prompt[c:c + cache.chunk])
    got = model.forward(prompt, cache)
    assert np.abs(got - oracle_prompt).max() <= 1e-4 * np.abs(oracle_prompt).max()
    worst = 0.0
    for t in rng.integers(0, 320, 2000):
        got, want = model.forward([t], cache), oracle.forward([t])
        worst = max(worst, np.abs(got - want).max() / np.abs(want).max())
    assert cache.sink_shift == 40 + 2000 - 24 and worst <= 1e-4, worst


class H2OOracle:
    """H2O by its definition, in NumPy (attention in float64): each KV head of each layer keeps a
    set of tokens, each with the attention it has received (summed over queries and the query
    heads of the group, decayed by SCORE_DECAY**T before a chunk of T tokens adds its own).
    Before a chunk goes in, each set evicts its lowest-scored tokens
    outside the sinks and the recent window until the chunk fits; then the chunk's queries
    attend over the set and themselves, causally, keys and queries rotated at their stream
    positions (the sinks at i + shift, shift = max(0, tokens seen - capacity)).

    Scores that tie within float32 rounding may be broken either way: `forward` takes the sets
    the fast cache kept, and where its choice differs, checks that it is a lowest-scored choice
    too (within `tol`) and follows it; `adopted` counts those."""

    def __init__(self, model, n_sink: int, capacity: int, recent: int, tol: float = 1e-3):
        self.m, self.n_sink, self.C, self.recent, self.tol = model, n_sink, capacity, recent, tol
        cfg = model.config
        L, G = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.k, self.v = [[] for _ in range(L)], [[] for _ in range(L)]     # per token [G, D]
        self.kept = [[[] for _ in range(G)] for _ in range(L)]               # token indices
        self.score = [[{} for _ in range(G)] for _ in range(L)]
        self.n = self.adopted = self.decisions = 0

    def _evict(self, i, g, T, fast_set):
        kept, score, n = self.kept[i][g], self.score[i][g], self.n
        count = len(kept) + T - self.C
        if count <= 0:
            return
        self.decisions += 1
        cand = [j for j in kept if self.n_sink <= j < n + T - self.recent]
        mine = sorted(cand, key=lambda j: score[j])[:count]
        theirs = [j for j in kept if j not in fast_set]
        if set(mine) != set(theirs):
            assert len(theirs) == count and set(theirs) <= set(cand), (theirs, cand)
            a, b = sorted(score[j] for j in mine), sorted(score[j] for j in theirs)
            assert np.allclose(a, b, rtol=self.tol, atol=self.tol), (a, b)
            self.adopted += 1
            mine = theirs
        for j in mine:
            kept.remove(j)
            del score[j]

    def forward(self, tokens, fast_slot_pos) -> np.ndarray:
        m, cfg = self.m, self.m.config
        n, T = self.n, len(tokens)
        Q, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        R = Q // G
        shift = max(0, n + T - self.C)
        for i in range(cfg.num_hidden_layers):
            for g in range(G):
                score = self.score[i][g]
                for j in score:
                    score[j] *= SCORE_DECAY ** T
                self._evict(i, g, T, set(fast_slot_pos[i, g].tolist()))
        q_idx = np.arange(n, n + T)
        x = ref.embedding(m.embed, np.asarray(tokens))
        for i, L in enumerate(m.layers):
            qkv = ref.linear(ref.rmsnorm(x, L.input_norm, cfg.rms_norm_eps), L.qkv)
            q = ref.rope(qkv[:, :Q * D].reshape(T, Q, D), *ref.rope_tables(m.layer_freqs[0], q_idx))
            self.k[i] += list(qkv[:, Q * D:(Q + G) * D].reshape(T, G, D))
            self.v[i] += list(qkv[:, (Q + G) * D:].reshape(T, G, D))
            a = np.empty((T, Q, D))
            for g in range(G):
                kept, score = self.kept[i][g], self.score[i][g]
                kept += list(q_idx)
                idx = np.array(kept)
                k_at = np.where(idx < self.n_sink, idx + shift, idx)
                kk = ref.rope(np.stack([self.k[i][j][g:g + 1] for j in kept]),
                              *ref.rope_tables(m.layer_freqs[0], k_at))[:, 0].astype(np.float64)
                vv = np.stack([self.v[i][j][g] for j in kept]).astype(np.float64)
                s = np.einsum("trd,sd->rts", q[:, g * R:(g + 1) * R].astype(np.float64), kk) * m.scale
                s[:, idx[None, :] > q_idx[:, None]] = -np.inf
                p = np.exp(s - s.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                a[:, g * R:(g + 1) * R] = np.einsum("rts,sd->trd", p, vv)
                for j, w in zip(kept, p.sum(axis=(0, 1))):
                    score[j] = score.get(j, 0.0) + w
            x = x + ref.linear(a.astype(np.float32).reshape(T, Q * D), L.o)
            gu = ref.linear(ref.rmsnorm(x, L.post_norm, cfg.rms_norm_eps), L.gate_up)
            x = x + ref.linear(ref.ReferenceBackend.swiglu(gu), L.down)
        self.n += T
        return ref.linear(ref.rmsnorm(x[-1:], m.norm, cfg.rms_norm_eps), m.lm_head)


def _held(cache) -> list[list]:
    """Each KV head's positions in the cache, sorted (layer by layer, head by head)."""
    return [sorted(p for p in head if p >= 0)
            for head in cache.slot_pos.reshape(-1, cache.slot_pos.shape[-1])]


def _heads_differ(held: list[list]) -> bool:
    return len({tuple(h) for h in held}) > 1


def _a_prompt_the_heads_keep_differently(llm, tries: int = 20) -> np.ndarray:
    """A random 40-token prompt after which not every KV head holds the same positions: about
    one prompt in twenty leaves them all the same, and the tiny model's heavy hitters seldom
    change after the prompt, which would leave the run nothing to check per head. (Code that
    shared one choice across heads fails here.)"""
    for _ in range(tries):
        prompt = rng.integers(0, 320, 40)
        for c in range(0, 40, llm.cache.chunk):
            llm.model.forward(prompt[c:c + llm.cache.chunk], llm.cache)
        differ = _heads_differ(_held(llm.cache))
        llm.cache.reset()
        if differ:
            return prompt
    raise AssertionError(f"every KV head kept the same positions after each of {tries} prompts")


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("n_sink, recent", [(4, 8), (0, 3)])
def test_h2o_cache_agrees_with_the_oracle_over_thousands_of_steps(tiny, device, n_sink, recent):
    """2000 one-token steps through a 24-slot h2o cache after a 40-token prompt in chunks: each
    KV head's kept set follows the oracle's (ties within rounding aside, rare) and the logits of
    every step agree within 1e-4."""
    llm = tinyrt.LLM(tiny, device=device, kv_size=24, kv_type="f32", kv_policy="h2o",
                     sinks=n_sink, recent=recent)
    oracle = H2OOracle(tinyrt.LLM(tiny, device="reference").model, n_sink, 24, recent)
    cache, model = llm.cache, llm.model
    prompt = _a_prompt_the_heads_keep_differently(llm)
    worst, differ = 0.0, False
    for t in [prompt[c:c + cache.chunk] for c in range(0, 40, cache.chunk)] + [
            [t] for t in rng.integers(0, 320, STEPS)]:
        got = model.forward(t, cache)
        want = oracle.forward(t, cache.slot_pos)
        worst = max(worst, np.abs(got - want).max() / np.abs(want).max())
        kept = [sorted(oracle.kept[i][g]) for i in range(2) for g in range(2)]
        held = _held(cache)
        assert kept == held
        differ |= _heads_differ(held)
    assert worst <= 1e-4, worst
    assert oracle.decisions > 4 * STEPS * 0.99 and oracle.adopted <= 0.01 * oracle.decisions
    assert differ                                 # the heads kept different tokens at times


def test_float16_sink_cache_stays_close(tiny):
    """The default float16 cache, re-rotating its sinks 2000 times: no drift beyond float16's
    rounding of the cached rows."""
    llm = tinyrt.LLM(tiny, device="cpu", kv_size=24, kv_policy="sink", sinks=4)
    oracle = Oracle(tinyrt.LLM(tiny, device="reference").model, 4, 24)
    worst = 0.0
    for t in rng.integers(0, 320, 2000):
        got, want = llm.model.forward([t], llm.cache), oracle.forward([t])
        worst = max(worst, np.abs(got - want).max() / np.abs(want).max())
    assert worst <= 1e-2, worst


def test_dense_stops_at_its_size_and_the_streaming_policies_go_past_it(tiny):
    dense = tinyrt.LLM(tiny, kv_size=16)
    with pytest.raises(CacheFullError, match="room for 16"):
        dense.generate("hello " * 30, raw=True, max_tokens=4)
    n_prompt = len(dense.prompt_ids("hi", raw=True))
    replies = list(dense.stream("hi", raw=True, max_tokens=100, temperature=1, seed=0,
                                ignore_eos=True))
    tokens = [r.token for r in replies if r.token is not None]
    assert len(tokens) == 16 - n_prompt + 1 and replies[-1].finish_reason == "length"
    for policy in ("sink", "h2o"):
        llm = tinyrt.LLM(tiny, kv_size=16, kv_policy=policy)
        replies = list(llm.stream("hello " * 30, raw=True, max_tokens=300, temperature=1, seed=0,
                                  ignore_eos=True))
        assert sum(r.token is not None for r in replies) == 300
        assert replies[-1].finish_reason == "length"
        assert llm.cache.next_pos > 300 and llm.cache.length == 16


@pytest.mark.parametrize("device", ["reference", "cpu"])
@pytest.mark.parametrize("n_sink", [4, 0])
def test_sink_rollback_across_wraparounds_agrees_with_the_oracle(tiny, device, n_sink):
    """Speculative decoding's pattern on a sink cache with 6 slots of slack: passes of 1 to 6
    tokens, each followed by a rollback of all but at least one of them, 600 times through a
    24-slot cache (many wrap-arounds, rollbacks across them): every pass's logits, all rows,
    within 1e-4 of the oracle's (which forgets rolled-back tokens and keeps the last window)."""
    llm = tinyrt.LLM(tiny, device=device, kv_size=24, kv_type="f32", kv_policy="sink",
                     sinks=n_sink, draft="lookup", draft_tokens=5)
    cache, model = llm.cache, llm.model
    assert cache.slack == 6 and cache.capacity == 30
    oracle = Oracle(tinyrt.LLM(tiny, device="reference").model, n_sink, 24)
    worst, rolled = 0.0, 0
    for _ in range(600):
        tokens = rng.integers(0, 320, rng.integers(1, 7))
        got = model.forward(tokens, cache, all_logits=True)
        want = oracle.forward(tokens, all_logits=True)
        worst = max(worst, np.abs(got - want).max() / np.abs(want).max())
        n = int(rng.integers(0, len(tokens)))
        cache.rollback(n)
        oracle.rollback(n)
        rolled += n
    assert cache.next_pos == len(oracle.k[0]) > 24 + rolled and worst <= 1e-4, worst
    with pytest.raises(ValueError, match="evicted"):
        cache.rollback(7)
