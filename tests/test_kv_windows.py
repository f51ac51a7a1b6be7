"""Per-layer attention windows in the KV cache (kv_cache.WindowedCache): a layer that attends within
a sliding window keeps only a ring of its last tokens, the other layers follow the policy. Tiny
random models of each family with windowed layers, over sequences long enough that the rings wrap
(their ring is the window, a pass's 512 tokens and some slack), against transformers; rollbacks
(drafts, chat turns) exact; the memory at Gemma 3 1B's shape."""

import numpy as np
import pytest

import tinyrt
from helpers import hf_logits, hf_model, rel_err, seeded_rng
from test_families import SIZES, write_hf_model
from tinyrt.kernels.reference import ReferenceBackend
from tinyrt.errors import CacheFullError
from tinyrt.kv_cache import KVCache, KVLayout, WindowedCache
from tinyrt.kv_options import RING_CHUNK, RING_SLACK, CacheOptions

rng = seeded_rng(__name__)
# (family, tied, layers that keep only their window): Gemma 3's first layer of two slides,
# Phi-3 slides in every layer (as Mistral does)
WINDOWED = [("gemma3_text", True, [0]), ("phi3", False, [0, 1])]
CONTEXT = 2048


@pytest.fixture(scope="module", params=WINDOWED, ids=lambda c: c[0])
def windowed_model(request, tmp_path_factory):
    family, tied, ringed = request.param
    d = write_hf_model(tmp_path_factory.mktemp(family) / "m", family, tied,
                       seed=int(rng.integers(1 << 30)), max_position_embeddings=CONTEXT)
    return d, hf_model(d), ringed


@pytest.mark.parametrize("policy, kv_type", [("dense", "f32"), ("sink", "f32"), ("h2o", "f32"),
                                             ("dense", "q8")])
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_windowed_layers_give_transformers_logits_past_their_ring(windowed_model, device, policy,
                                                                  kv_type):
    """A 700-token prompt (two passes: the rings wrap in the second) and decode steps: every
    position's logits within 1e-4 of transformers' over the whole sequence (KIVI's 8-bit codes:
    within 2e-2), and the same greedy tokens; the windowed layers hold a ring, not the cache's
    2,048 slots. (Sink and h2o evict nothing here: the global layers hold every token.)"""
    d, hf, ringed = windowed_model
    llm = tinyrt.LLM(d, device=device, kv_policy=policy, kv_size=CONTEXT, kv_type=kv_type)
    cache = llm.cache
    assert isinstance(cache, WindowedCache)
    assert [i for i in range(cache.layout.n_layers) if cache._parts[i][0] is cache.ring] == ringed
    assert cache.ring.capacity < 700 < cache.capacity
    be = llm.model.backend
    ids = rng.integers(3, SIZES["vocab_size"], 700)
    got = [be.to_numpy(llm.model.forward(ids, cache, all_logits=True))]
    tokens = list(ids)
    for _ in range(8):
        tokens.append(int(np.argmax(got[-1][-1])))
        got.append(be.to_numpy(llm.model.forward(tokens[-1:], cache)))
    want = hf_logits(hf, tokens)
    assert rel_err(np.concatenate(got)[:-1], want[:-1]) < (1e-4 if kv_type == "f32" else 2e-2)
    if kv_type == "f32":
        assert tokens[len(ids):] == [int(t) for t in want[len(ids) - 1:-1].argmax(axis=1)]


def test_rollbacks_within_the_slack_stay_exact_and_longer_ones_are_refused(windowed_model):
    """A draft's rejected tokens rolled back (within the ring's slack) leave the cache as if
    they never came: the next tokens' logits are transformers' on the kept sequence. A rollback
    past the slack is refused and changes nothing (a chat turn then starts afresh)."""
    d, hf, _ = windowed_model
    llm = tinyrt.LLM(d, device="cpu", kv_size=CONTEXT, kv_type="f32")
    cache, be = llm.cache, llm.model.backend
    ids = rng.integers(3, SIZES["vocab_size"], 600)
    llm.model.forward(ids, cache)
    llm.model.forward(rng.integers(3, SIZES["vocab_size"], RING_SLACK), cache)    # a draft
    cache.rollback(RING_SLACK)
    more = rng.integers(3, SIZES["vocab_size"], 5)
    got = be.to_numpy(llm.model.forward(more, cache, all_logits=True))
    assert rel_err(got, hf_logits(hf, [*ids, *more])[-5:]) < 1e-4
    before = (cache.next_pos, cache.length, cache.ring.next_pos, cache.ring.slot_pos.copy())
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(200)
    assert before[:3] == (cache.next_pos, cache.length, cache.ring.next_pos)
    assert (before[3] == cache.ring.slot_pos).all()


def test_chat_turns_reuse_the_prefix_as_a_fresh_start_would(windowed_model):
    """`complete` over a windowed cache, a first prompt longer than the rings: a second prompt
    that extends it and the reply keeps what the cache holds and replies as a fresh engine
    does; one that changes an early token (a rollback past the rings' slack) starts afresh,
    as exactly."""
    d, _, _ = windowed_model
    llm = tinyrt.LLM(d, device="cpu", kv_size=CONTEXT, kv_type="f32")
    fresh = tinyrt.LLM(d, device="cpu", kv_size=CONTEXT, kv_type="f32")

    def reply(engine, ids):
        gen = engine.complete(ids, max_tokens=10, temperature=0, ignore_eos=True)
        return [r.token for r in gen if r.token is not None], gen.timings.cached_tokens

    first = [int(t) for t in rng.integers(3, SIZES["vocab_size"], 650)]
    out, _ = reply(llm, first)
    second = first + out + [5, 6, 7]
    out2, kept = reply(llm, second)
    assert kept >= len(first) and llm.cache.next_pos > llm.cache.ring.capacity
    assert out2 == reply(fresh, second)[0]
    third = [first[0] + 1] + second[1:]
    out3, kept = reply(llm, third)
    assert kept == 0
    assert out3 == reply(fresh, third)[0]


def _gemma3_1b(size, **options):
    """Caches at Gemma 3 1B's shape: 26 layers (each sixth global), one KV head of 256, a
    512-token window (no buffer is touched: the memory is only reserved)."""
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    layout = KVLayout(26, 1, 256, [np.ones(128)] * 26, windows)
    be, opts = ReferenceBackend(), CacheOptions(kv_size=size, **options)
    return WindowedCache(layout, size, be, opts), KVCache(layout._replace(windows=None), size, be, opts)


@pytest.mark.parametrize("kv_type", ["f16", "q4"])
def test_gemma3_cache_at_32k_tokens_takes_a_fifth_of_a_full_one(kv_type):
    """At 32,768 tokens, Gemma 3 1B's cache with its 22 sliding layers in rings takes at most a
    quarter of the bytes of a cache that keeps every token in every layer; the options count
    the same bytes before any cache exists (--kv-mem, info, the banner)."""
    windowed, full = _gemma3_1b(32768, kv_type=kv_type)
    assert windowed.nbytes <= 0.25 * full.nbytes
    assert windowed.ring.layout.n_layers == 22 and windowed.held.layout.n_layers == 4

    class Gemma3Config:        # what the options read of a config
        num_hidden_layers, num_key_value_heads, head_dim = 26, 1, 256
        max_position_embeddings = 32768

        def window(self, i):
            return None if i % 6 == 5 else 512

    cfg, opts = Gemma3Config(), CacheOptions(kv_size=32768, kv_type=kv_type)
    m = opts.memory(cfg, 32768)
    tables = windowed.held.slot_pos.nbytes + windowed.ring.slot_pos.nbytes
    assert m.ringed == 22 and m.ring == 512 + RING_CHUNK - 1 + RING_SLACK
    assert abs(32768 * m.per_token + m.residual + m.rings - (windowed.nbytes + tables)) \
        < 0.01 * windowed.nbytes
    assert "22 of 26 layers keep only their sliding window" in opts.describe(cfg)
    budget = CacheOptions(kv_mem=windowed.nbytes + tables, kv_type=kv_type)
    assert abs(budget.size_for(cfg) - 32768) < 0.01 * 32768


def test_a_cache_smaller_than_a_ring_keeps_every_layer_whole(windowed_model):
    """Where a ring would not be smaller than the cache, the windowed layers keep every token
    (attention's window mask does the rest), as before."""
    llm = tinyrt.LLM(windowed_model[0], device="reference", kv_size=500)
    assert type(llm.cache) is KVCache


class _Config:
    """What the options read of a config: sizes and each layer's window."""

    def __init__(self, windows, kv_heads=1, head_dim=64, context=32768):
        self.windows, self.num_hidden_layers = windows, len(windows)
        self.num_key_value_heads, self.head_dim = kv_heads, head_dim
        self.max_position_embeddings = context

    def window(self, i):
        return self.windows[i]


@pytest.mark.parametrize("policy", ["dense", "sink", "h2o"])
def test_a_memory_budget_is_the_largest_size_within_it(policy):
    """--kv-mem with windowed layers: the size whose memory (per token for the layers that
    keep every token, the rings, the float residual) fits the budget and is the largest that
    does, whichever layers keep only their window at that size (windows of several sizes:
    the set changes with the size); with every layer windowed, the model's context, not 16M
    slots. (The budgets are random: seeded.)"""
    for _ in range(200):
        windows = [None if rng.random() < 0.3 else int(rng.choice([256, 1024, 4096]))
                   for _ in range(4)]
        cfg, budget = _Config(windows), int(rng.integers(20_000, 50_000_000))
        options = CacheOptions(kv_policy=policy, kv_mem=budget,
                               kv_type=str(rng.choice(["f16", "q4"])))

        def total(n):
            m = options.memory(cfg, n)
            return n * m.per_token + m.residual + m.rings

        try:
            n = options.size_for(cfg)
        except CacheFullError:
            assert total(1) > budget
            continue
        assert total(n) <= budget
        if None in windows:
            assert all(total(s) > budget for s in (n + 1, n + 7, 2 * n, 8 * n))
        else:
            assert n == cfg.max_position_embeddings or total(n + 1) > budget
