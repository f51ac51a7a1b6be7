"""A device decoder kept from one reply to the next (generate.DecoderHolder,
device_decode.DeviceDecoder.restart), in Numba's CUDA simulator: the replies and the cache they
leave are a new decoder's, a reply it cannot serve gets a new one, and a restart writes into the
tensors the step already reads (which a captured graph replays: the simulator captures none, but
the restart is the same code)."""

import gc
import weakref

import numpy as np
import pytest

from helpers import seeded_rng, tiny_config, write_tiny_model
from tinyrt import device_decode

pytestmark = pytest.mark.usefixtures("quick_barriers")

GREEDY = dict(temperature=0, repeat_penalty=1.2)
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.95, min_p=0.02, repeat_penalty=1.2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2)
    return write_tiny_model(tmp_path_factory.mktemp("decoder_reuse"), cfg)


def _llm(tiny, policy, **over):
    import tinyrt

    size = 40 if policy == "dense" else 6
    return tinyrt.LLM(tiny, device="cuda", kv_policy=policy, kv_size=size, sinks=2, **over)


def _tokens(gen) -> list[int]:
    return [r.token for r in gen if r.token is not None]


def _cache_state(llm) -> dict:
    """The cache's host bookkeeping and its K/V buffers, as host arrays."""
    c, be = llm.cache, llm.backend
    out = dict(pos=(c.next_pos, c.length, c.span), slot_pos=c.slot_pos.copy(),
               k=be.to_numpy(c.k), v=be.to_numpy(c.v))
    if c.policy == "h2o":
        out["score"] = c.score.copy()
    if c.policy != "dense":
        out["shift"] = c.rotated_shift
        out["sinks"] = None if c.sink_keys is None else \
            [np.asarray(be.to_numpy(a), np.float32) for a in (c.sink_keys, c.sink_values)]
    return out


def _conversation(llm, params, prompts) -> list:
    """Three replies: a conversation's first turn (a small cache's window moves at its second
    step: the device takes the sinks' copies) and its next (`complete`: the cache keeps the
    first, the copies handed back), then after `reset` a new one whose prompt alone runs the
    cache past its size (the host takes the copies before the device steps). Each reply's
    tokens and the cache it leaves; sampled replies each with their own seed."""
    ids, more, third = prompts
    kw = dict(max_tokens=3, ignore_eos=True, **params)
    seeds = iter((11, 12, 13)) if params["temperature"] else iter((None,) * 3)
    out = []
    first = _tokens(llm.complete(ids, seed=next(seeds), **kw))
    out.append((first, _cache_state(llm)))
    out.append((_tokens(llm.complete(ids + first + more, seed=next(seeds), **kw)),
                _cache_state(llm)))
    llm.reset()
    out.append((_tokens(llm.generation(third, seed=next(seeds), **kw)), _cache_state(llm)))
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    return a == b


def _count_decoders(monkeypatch) -> list:
    made, init = [], device_decode.DeviceDecoder.__init__

    def counted(self, *a, **k):
        made.append(self)
        init(self, *a, **k)
    monkeypatch.setattr(device_decode.DeviceDecoder, "__init__", counted)
    return made


@pytest.mark.parametrize("policy, params", [("dense", SAMPLED), ("sink", GREEDY),
                                            ("h2o", SAMPLED)], ids=["dense", "sink", "h2o"])
def test_a_kept_decoder_replies_as_new_decoders_do(tiny, monkeypatch, policy, params):
    """Three replies over one LLM, one decoder restarted for each, give the tokens and leave the
    cache (positions, slot tables, h2o scores, the sinks' rotation and copies, the K/V buffers)
    exactly as a new decoder for each reply does, greedy with a penalty and sampled (seeded: a
    restart re-seeds the draws). (Dense, sink and h2o; sampling's ring of penalties and draws
    restarted for two, greedy's argmax for one: the simulator takes seconds a step.)"""
    rng = seeded_rng()
    prompts = [[int(t) for t in rng.integers(3, 300, n)] for n in (5, 2, 8)]
    made = _count_decoders(monkeypatch)
    fresh = _llm(tiny, policy)
    fresh._decoders = None                  # (a Generation without a holder: a new decoder)
    want = _conversation(fresh, params, prompts)
    assert len(made) == 3
    made.clear()
    kept = _llm(tiny, policy)
    got = _conversation(kept, params, prompts)
    assert len(made) == 1 and kept._decoders.decoder is made[0]
    for (g_tok, g_cache), (w_tok, w_cache) in zip(got, want):
        assert g_tok == w_tok and len(g_tok) == 3
        assert _same(g_cache, w_cache)
    if policy != "dense":           # the small cache ran past its size, the sinks re-rotated
        assert all(state["shift"] > 0 and state["sinks"] is not None for _, state in got)


def test_a_reply_the_decoder_cannot_serve_gets_a_new_one(tiny, monkeypatch):
    """Other sampler settings (not the seed alone), another cache object, graphs asked or not,
    or a reply whose steps run on the host replace the kept decoder, and the dropped one is
    freed at once (no reference cycle keeps its graph's memory until a garbage collection);
    an emptied cache keeps it. While a reply steps, its decoder serves no other; once a backend
    tensor its first step read is replaced, none."""
    from tinyrt.generate import DecoderHolder, Generation
    from tinyrt.kv_cache import make_cache
    from tinyrt.sampling import Sampler, SamplingParams

    llm = _llm(tiny, "sink")
    holder = DecoderHolder()

    def decoder(cache=None, graph=True, **kw):
        """The decoder a reply gets, its steps over (none run: the choice is the test's)."""
        d = holder.decoder_for(llm.model, cache or llm.cache,
                               Sampler(SamplingParams(**{**GREEDY, **kw})), [5, 6], graph)
        d.finish()
        return d

    gc.collect()
    gc.disable()                # (a cycle would be found only by the collector)
    try:
        a = decoder()
        assert decoder() is a and holder.decoder is a
        llm.reset()
        assert decoder() is a
        gone = weakref.ref(a)
        del a
        b = decoder(**SAMPLED, seed=1)
        assert gone() is None and holder.decoder is b
        assert decoder(**SAMPLED, seed=2) is b                     # a seed is no setting
        for change in (dict(top_k=21), dict(top_p=0.9), dict(min_p=0.0), dict(temperature=0.7),
                       dict(repeat_penalty=1.3), dict(presence_penalty=0.5),
                       dict(frequency_penalty=0.5), dict(repeat_last_n=32)):
            c = decoder(**{**SAMPLED, **change})
            assert c is not b and decoder(**{**SAMPLED, **change}) is c, change
            b = c
        c = decoder(graph=False, **{**SAMPLED, **change})
        assert c is not b and decoder(graph=False, **{**SAMPLED, **change}) is c
        llm.cache = make_cache(llm.cache_options, llm.model)      # (a cache rebuilt)
        b, c = c, decoder(graph=False, **{**SAMPLED, **change})
        assert c is not b and c.cache is llm.cache
        gone = weakref.ref(c)
        del b, c
        monkeypatch.setattr(device_decode, "usable", lambda model, cache: False)
        g = Generation(llm.model, llm.cache, llm.tokenizer, [5], Sampler(), max_tokens=1,
                       eos_ids=(), decoders=holder)
        assert g._device_decoder([]) is None and holder.decoder is None and gone() is None
    finally:
        gc.enable()
    monkeypatch.undo()
    d = holder.decoder_for(llm.model, llm.cache, Sampler(SamplingParams(**GREEDY)), [], True)
    assert d.busy and holder.decoder is d
    other = holder.decoder_for(llm.model, llm.cache, Sampler(SamplingParams(**GREEDY)), [], True)
    assert other is not d and holder.decoder is d and other.busy        # (d steps a reply)
    d.finish()
    assert not d.busy and decoder() is d
    be = llm.backend            # a tensor the backend keeps (as the split-K GEMVs' sums)...
    be.scratch_for_test = be.zeros(4)
    d = decoder()
    d.restart(Sampler(SamplingParams(**GREEDY)), [])
    d.step(5)                   # (its first step: a graph would be captured here)
    d.finish()
    assert decoder() is d
    be.scratch_for_test = be.zeros(8)       # ...grown for a larger launch: a graph of d is stale
    assert decoder() is not d


class Touched:
    """The storage of every tensor that a decode step reads or writes and that was there before
    it (its inputs, not what it allocates): the tensors of Numba's launches and of torch's ops,
    classed by where each storage is first seen (an op's input, or its output)."""

    def __init__(self):
        self.steps = []

    def record(self, monkeypatch):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        from tinyrt.kernels.cuda import launchers

        steps = self.steps
        seen = {}

        def see(tree, made=False):
            for a in tree_leaves(tree):
                if isinstance(a, torch.Tensor) and a.numel():
                    seen.setdefault(a.untyped_storage().data_ptr(), made)

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                see((args, kwargs))
                out = func(*args, **(kwargs or {}))
                see(out, made=True)
                return out

        launch = launchers.launch

        def launched(kernel, grid, block, *args, **kw):
            see(list(args))
            return launch(kernel, grid, block, *args, **kw)

        step = device_decode.DeviceDecoder._step

        def recorded(dec):
            seen.clear()
            with Ops():
                step(dec)
            steps.append((dec.steps, {p for p, made in seen.items() if not made}))

        monkeypatch.setattr(launchers, "launch", launched)
        monkeypatch.setattr(device_decode.DeviceDecoder, "_step", recorded)


def _touched_by_reply(tiny, monkeypatch, policy, restart=None, steps=2):
    """The storages that the steps of two replies over one LLM touch (sampled, with penalties:
    every tensor of the sampler in use): a set for each reply (its steps all touch the same),
    and the decoder. `restart` replaces DeviceDecoder.restart."""
    touched = Touched()
    touched.record(monkeypatch)
    if restart is not None:
        monkeypatch.setattr(device_decode.DeviceDecoder, "restart", restart)
    llm = _llm(tiny, policy)
    rng = seeded_rng("touched")
    replies, decoders = [], []
    for seed in (1, 2):
        touched.steps.clear()
        llm.reset()
        _tokens(llm.generation([int(t) for t in rng.integers(3, 300, 3 + seed)],
                               max_tokens=steps + 1, ignore_eos=True, seed=seed, **SAMPLED))
        assert [n for n, _ in touched.steps] == list(range(steps))
        sets = [s for _, s in touched.steps]
        assert all(s == sets[0] for s in sets)
        replies.append(sets[0])
        decoders.append(llm._decoders.decoder)
    assert decoders[0] is decoders[1]           # (a new one would touch new tensors)
    return replies, decoders[0]


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_a_restart_keeps_the_storage_of_every_tensor_a_step_touches(tiny, monkeypatch, policy):
    """The tensors a decode step reads or writes that were allocated before it (the step's
    state, tables, scores, the sinks' copies, the token, the sampler's uniforms, count and
    penalties' ring, the cache's buffers, the weights), found as the step runs (every Numba
    launch's and torch op's tensors), are the same storage in the next reply: what a CUDA graph
    recorded in the first stays valid in the next ones. (h2o's step touches every tensor that
    sink's does, and more.)"""
    replies, dec = _touched_by_reply(tiny, monkeypatch, policy)
    assert replies[0] == replies[1]
    s = dec.sampler
    mine = [dec.state, dec.table, dec.tok, dec.cos, s.uniform, s.drawn, s.ring, s.counts, s.at,
            dec.cache.k, dec.cache.v]
    mine += [dec.score, dec.sink_k, dec.sink_v] if policy == "h2o" else []
    assert {t.untyped_storage().data_ptr() for t in mine} <= replies[0]


def _reallocating(what):
    """DeviceDecoder.restart, then the decoder's tensor `what` put in a new tensor (as a restart
    that allocated one would)."""
    restart = device_decode.DeviceDecoder.restart

    def restarted(dec, sampler, history):
        restart(dec, sampler, history)
        owner, name = (dec.sampler, what[8:]) if what.startswith("sampler.") else (dec, what)
        setattr(owner, name, getattr(owner, name).clone())
    return restarted


@pytest.mark.parametrize("what", ["state", "sink_k", "sampler.ring"])
def test_the_storage_check_finds_a_restart_that_allocates(tiny, monkeypatch, what):
    """The check above fails for a restart that puts one of the step's tensors in a new one
    (one of the decoder's, of the sinks' copies, of the sampler's)."""
    replies, _ = _touched_by_reply(tiny, monkeypatch, "h2o", _reallocating(what), steps=1)
    assert replies[0] != replies[1]


def test_bench_makes_its_decoder_in_the_warm_up_and_says_what_it_cost(tiny, monkeypatch):
    """bench.run's warm-up reply makes the decoder that every timed run restarts (on a GPU: the
    graph captured there, not in a timed run), and its first_reply_extra_s is what that reply's
    decode took beyond its steps at the runs' rate: here steps of 10 ms (no kernels: a token
    written) and a decoder's first step 0.5 s longer, as an eager step and a capture are."""
    import time

    from tinyrt import bench

    made = _count_decoders(monkeypatch)
    firsts = []

    def step(dec):
        if dec not in firsts:
            firsts.append(dec)
            time.sleep(0.5)
        time.sleep(0.01)
        dec.tok.fill_(7)
    monkeypatch.setattr(device_decode.DeviceDecoder, "_step", step)
    r = bench.run(_llm(tiny, "dense"), prompt_tokens=8, decode_tokens=3, runs=2)
    assert len(made) == 1 and firsts == made
    assert 0.45 < r["first_reply_extra_s"] < 0.55
    assert 0.01 < 1 / r["decode_tok_s"] < 0.05
