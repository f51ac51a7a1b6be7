"""Decode steps on the device (tinyrt.device_decode, kernels.cuda.step) against the host's steps,
in Numba's CUDA simulator where there is no GPU: the cache policies' bookkeeping kernel by
kernel, the device sampler against the host's, and whole generations (greedy tokens, and the
cache the device hands back) for every policy."""

import numpy as np
import pytest

from helpers import fit_p, rel_err, seeded_rng, tiny_config, write_tiny_model
from tinyrt import device_decode
from tinyrt.kernels.cuda import CudaBackend, step as gs
from tinyrt.kernels import reference as ref
from tinyrt.kv_cache import SCORE_DECAY, SCORE_FLOOR, KVLayout, POLICIES
from tinyrt.kv_options import CacheOptions
from tinyrt.sampling import Sampler, SamplingParams, filtered_probs

pytestmark = pytest.mark.usefixtures("quick_barriers")


@pytest.mark.parametrize("policy, size", [("dense", 12), ("sink", 7), ("h2o", 7)])
def test_state_kernels_follow_the_cache_policy(policy, size):
    """begin and take_slot(_h2o), step after step, give the slots, positions, lengths, spans
    and sink shifts that the host cache's allocate(1) gives (h2o: with the same scores added
    between steps, the same victims)."""
    rng = seeded_rng()
    L, G, D = 2, 2, 8
    be = CudaBackend()
    layout = KVLayout(L, G, D, [1 / 10000 ** (np.arange(D // 2) / (D // 2))] * L)
    cache = POLICIES[policy](layout, size, ref.ReferenceBackend(),
                             CacheOptions(policy, size, "f32", sinks=2, recent=2))
    cache.allocate(3)                                # a prompt
    C = cache.capacity
    state = np.zeros(gs.N_STATE, np.int64)
    state[[gs.NEXT, gs.LENGTH, gs.SPAN]] = cache.next_pos, cache.length, cache.span
    state = be.dev(state, np.int64)
    kind = {"dense": gs.DENSE, "sink": gs.SINK, "h2o": gs.H2O}[policy]
    if policy == "h2o":
        table = be.dev(cache.slot_pos.reshape(L * G, C), np.int64)
        score = be.dev(cache.score.reshape(L * G, C))
        slots = be.zeros((L * G, 1), np.int64)
    else:
        table, slots = be.dev(cache.slot_pos[None], np.int64), be.zeros((G, 1), np.int64)
    for _ in range(size + 4 if policy != "dense" else size - 3):
        if policy == "h2o":          # attention's weights, the same on both sides
            add = rng.random((L, G, C)).astype(np.float32)
            cache.score += add
            score += be.dev(add.reshape(L * G, C))
        pos = cache.allocate(1)
        gs.launch_begin(state, kind, cache.n_sink, getattr(cache, "size", C),
                        getattr(cache, "ring", C))
        if policy == "h2o":
            gs.launch_take_slot_h2o(state, slots, table, score, cache.n_sink, cache.recent,
                                    SCORE_DECAY, SCORE_FLOOR)
            assert np.array_equal(be.to_numpy(slots).reshape(L, G, 1), cache._slots)
            assert np.array_equal(be.to_numpy(score).reshape(L, G, C), cache.score)
        else:
            gs.launch_take_slot(state, slots, table)
            assert np.array_equal(be.to_numpy(slots), cache._slots)
        s = be.to_numpy(state)
        assert s[gs.POS] == pos[0] and s[gs.NEXT] == cache.next_pos
        assert s[gs.LENGTH] == cache.length and s[gs.SPAN] == cache.span
        assert np.array_equal(be.to_numpy(table).reshape(cache.slot_pos.shape), cache.slot_pos)
        if policy != "dense":
            assert s[gs.SHIFT] == cache.sink_shift


def test_rope_row_is_the_reference_table():
    be = CudaBackend()
    inv = (1 / 500000 ** (np.arange(8) / 8)).astype(np.float32)
    state = np.zeros(gs.N_STATE, np.int64)
    state[gs.POS] = 123457
    cos, sin = be.zeros((1, 8)), be.zeros((1, 8))
    gs.launch_rope_row(be.dev(inv), be.dev(state, np.int64), cos, sin)
    want = ref.rope_tables(inv, np.array([123457]))
    assert rel_err(be.to_numpy(cos), want[0]) < 1e-6 and rel_err(be.to_numpy(sin), want[1]) < 1e-6


def _decoder(model, cache, prompt):
    """A device decoder (greedy, eager) over `cache` after the prompt, and the prompt's token."""
    logits = model.backend.to_numpy(model.forward(prompt, cache))
    sampler = Sampler(SamplingParams(temperature=0, repeat_penalty=1.0))
    return device_decode.DeviceDecoder(model, cache, sampler, list(prompt), graph=False), \
        int(logits.argmax())


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name) -> a tiny 2-layer model of that family (GQA), written once."""
    from tinyrt.models import FAMILIES

    made = {}

    def model(name: str):
        if name not in made:
            # (Gemma 3 with global layers only: one set of RoPE frequencies, as the device needs)
            over = dict(head_dim=8, query_pre_attn_scalar=8, hidden_act="gelu_pytorch_tanh",
                        layer_types=["full_attention"] * 2) if name == "gemma3_text" else {}
            cfg = tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, model_type=name,
                              architectures=[FAMILIES[name].architecture], **over)
            made[name] = write_tiny_model(tmp_path_factory.mktemp(name), cfg)
        return made[name]
    return model


@pytest.mark.parametrize("policy, name", [("dense", "llama"), ("sink", "llama"), ("h2o", "llama"),
                                          ("dense", "qwen3"), ("sink", "qwen2"),
                                          ("h2o", "gemma3_text")])
def test_device_steps_read_only_the_slots_in_use(family, policy, name):
    """Attention in the device's steps visits the cache's slots in use (its span, which the
    steps keep on the device), not its capacity: in a cache of 40 slots, of which a prompt of 5
    and 4 steps use 9, slots 20 and on are made to hold positions the queries would see, with
    NaN keys and values, in the device's cache and the host's. The device's greedy tokens are
    the host's steps' (which read slots [0, span)), and every K, V row it stored is finite (a
    visit makes them NaN). Through each family's fused step: Qwen3's q/k norms, Qwen2's biases,
    Gemma 3's output norms, GeGLU and scaled embeddings."""
    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import make_cache
    from tinyrt.models import load_model

    model = load_model(family(name), get_backend("cuda"))
    assert device_decode.usable(model, make_cache(CacheOptions(policy, 40, "f16"), model))
    caches = [make_cache(CacheOptions(policy, 40, "f16", sinks=2), model) for _ in range(2)]
    for c in caches:
        c.slot_pos[..., 20:] = np.arange(20) % 4
        c.k[:, :, 20:] = c.v[:, :, 20:] = np.nan
    prompt = [int(t) for t in seeded_rng().integers(3, 300, 5)]
    dec, tok = _decoder(model, caches[0], prompt)
    model.forward(prompt, caches[1])
    got, want = [tok], [tok]
    for _ in range(4):
        got.append(dec.step(got[-1]))
        logits = model.forward([want[-1]], caches[1])
        want.append(int(model.backend.to_numpy(logits).argmax()))
    dec.finish()
    assert got == want and caches[0].span == caches[1].span == 9
    for a in (caches[0].k, caches[0].v):
        assert np.isfinite(model.backend.to_numpy(a)[:, :, :9]).all()


def _launches(tmp_path, layers: int) -> tuple[int, int]:
    """Kernels that one device decode step launches, for a 4-bit model of `layers` layers of
    Llama-2-7B's structure (RMSNorm, fused q|k|v, RoPE, multi-head attention over a float16
    cache, o, SwiGLU; tiny), every GEMV split-K (as most of 7B's are): those Numba launches,
    and the torch ops that run a kernel (not a view, not an allocation)."""
    import torch
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    from torch.utils._python_dispatch import TorchDispatchMode

    from helpers import write_tiny_model
    from tinyrt.converters import convert
    from tinyrt.kernels import get_backend
    from tinyrt.kernels.cuda import launchers
    from tinyrt.kv_cache import make_cache
    from tinyrt.models import load_model

    cfg = tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=layers)
    d = convert(write_tiny_model(tmp_path / f"m{layers}", cfg), tmp_path / f"q{layers}",
                method="rtn", group_size=32)
    model = load_model(d, get_backend("cuda"))
    cache = make_cache(CacheOptions("dense", 16, "f16"), model)
    dec, tok = _decoder(model, cache, [5, 6, 7])
    assert launchers.resident_blocks() > 2   # (a row block or two a GEMV here: split)
    numba, ops = [], []
    free = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func not in free:
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    call = FakeCUDAKernel.__call__

    def counted(kernel, *args):
        if not kernel._device:             # (a device function's call is no launch)
            numba.append(kernel.py_func.__name__)
        return call(kernel, *args)

    FakeCUDAKernel.__call__ = counted
    try:
        dec.step(tok)                      # (a warm step: the next ones launch the same)
        numba.clear(), ops.clear()
        with Ops():
            dec.step(tok)
    finally:
        FakeCUDAKernel.__call__ = call
    return len(numba), len(ops)


def test_a_decode_step_launches_6_kernels_a_layer_at_7b(tmp_path):
    """Kernel launches of a device decode step at Llama-2-7B's structure, counted where Numba
    launches a kernel (a model of 2 layers against one of 1: a layer's, and the rest a token's):
    6 a layer (each norm in the projection after it, each residual add in the one before,
    attention's splits merged by the last of them: the ops one by one were 12 a layer and 2
    torch adds), at most 6.25 a layer over 7B's 32 layers with the token's own; no torch op
    runs in a layer."""
    (n2, t2), (n1, t1) = _launches(tmp_path, 2), _launches(tmp_path, 1)
    numba, fixed = n2 - n1, n1 - (n2 - n1)
    assert numba == 6 and (fixed + 32 * numba) / 32 <= 6.25, (numba, fixed)
    assert t2 - t1 == 0, f"{t2 - t1} torch ops a layer"


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.3),
    dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.5,
         frequency_penalty=0.3),
    dict(temperature=0.9, top_k=40, top_p=0.5, min_p=0.2)])
def test_device_sampler_draws_from_the_host_distribution(params):
    """The device sampler's penalized logits and candidates are the host sampler's (ids and
    probabilities), and its draws land on candidates; greedy gives the host's argmax."""
    rng = seeded_rng()
    be = CudaBackend()
    V = 300
    host = Sampler(SamplingParams(**params, seed=1))
    history = list(rng.integers(0, V, 80))
    dev = device_decode.DeviceSampler(be, host, V, seed=2)
    dev.start(history)
    dev.refill()
    out = be.zeros(1, np.int64)
    for _ in range(3):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        x = host.penalized(logits, history)
        got = be.to_numpy(dev.penalized(be.dev(logits[None])))
        assert rel_err(got, x) < 1e-6
        ids, probs = filtered_probs(x, host.params)
        d_ids, d_probs = (be.to_numpy(a) for a in dev.candidates(be.dev(x)))
        keep = d_probs > 0
        assert np.array_equal(d_ids[keep], ids)
        assert np.allclose(d_probs[keep] / d_probs.sum(), probs, atol=1e-6)
        dev(be.dev(logits[None]), out)
        tok = int(be.to_numpy(out)[0])
        assert tok in ids
        history.append(tok)
    penalized = SamplingParams(temperature=0, repeat_penalty=1.5)
    greedy = device_decode.DeviceSampler(be, Sampler(penalized), V, 0)
    greedy.start(history)
    logits = rng.standard_normal(V).astype(np.float32)
    greedy(be.dev(logits[None]), out)
    assert int(be.to_numpy(out)[0]) == Sampler(penalized)(logits, history)


def test_device_sampler_draws_follow_the_host_probabilities():
    """Draws from fixed logits, thousands of them across blocks of uniforms: each candidate comes
    as often as the host sampler's probability says (a chi-square test that fails a right
    sampler once in 10^4 runs), and nothing else ever comes."""
    rng = seeded_rng()
    be = CudaBackend()
    V, N = 64, 3 * device_decode.UNIFORMS
    host = Sampler(SamplingParams(temperature=0.8, top_k=24, top_p=0.95, min_p=0.01,
                                  repeat_penalty=1.0, seed=1))     # (no penalty: fixed odds)
    dev = device_decode.DeviceSampler(be, host, V, seed=int(rng.integers(2 ** 31)))
    dev.start([])
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    ids, probs = filtered_probs(host.penalized(logits, []), host.params)
    out, counts = be.zeros(1, np.int64), np.zeros(V)
    for i in range(N):
        if i % device_decode.UNIFORMS == 0:
            dev.refill()
        dev(be.dev(logits[None]), out)
        counts[int(be.to_numpy(out)[0])] += 1
    expected = np.zeros(V)
    expected[ids] = probs * N
    assert fit_p(counts, expected) > 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2)
    return write_tiny_model(tmp_path_factory.mktemp("device_decode"), cfg)


@pytest.mark.parametrize("policy, size, kv_type", [("dense", 40, "f16"), ("sink", 9, "f32"),
                                                   ("h2o", 9, "f16")])
def test_generation_on_the_device_is_the_host_s(tiny, monkeypatch, policy, size, kv_type):
    """Greedy generation with a repeat penalty: the device's steps give the host's tokens (the
    same kernels launched from the host), and hand back the cache the host's steps leave
    (positions, slot tables, h2o scores, the sinks' rotation and copies), so that a next prompt
    over it gives the same logits. Small caches make sink wrap and re-rotate, and h2o evict."""
    import tinyrt

    opts = dict(device="cuda", kv_policy=policy, kv_size=size, kv_type=kv_type, sinks=2)
    dev, host = tinyrt.LLM(tiny, **opts), tinyrt.LLM(tiny, **opts)
    ids = list(seeded_rng().integers(3, 300, 5))
    kw = dict(max_tokens=14, ignore_eos=True, temperature=0, repeat_penalty=1.2)
    steps, step = [], device_decode.DeviceDecoder.step
    monkeypatch.setattr(device_decode.DeviceDecoder, "step",
                        lambda self, token: steps.append(token) or step(self, token))
    got = _tokens(dev.generation(ids, **kw))
    ran = len(steps)
    assert ran >= len(got) - 1             # the tokens after the first came from the device
    monkeypatch.setattr(device_decode, "usable", lambda model, cache: False)
    want = _tokens(host.generation(ids, **kw))
    assert got == want and len(steps) == ran     # and the host's from the host
    a, b = dev.cache, host.cache
    assert (a.next_pos, a.length, a.span) == (b.next_pos, b.length, b.span)
    assert np.array_equal(a.slot_pos, b.slot_pos)
    if policy == "h2o":
        assert rel_err(a.score, b.score) < 1e-6
    if policy != "dense":
        assert a.rotated_shift == b.rotated_shift > 0
        assert rel_err(dev.backend.to_numpy(a.sink_keys), host.backend.to_numpy(b.sink_keys)) < 1e-6
    more = [int(t) for t in seeded_rng().integers(3, 300, 3)]
    la, lb = (m.backend.to_numpy(m.model.forward(more, m.cache)) for m in (dev, host))
    assert rel_err(la, lb) < 1e-5


def _tokens(gen) -> list[int]:
    return [r.token for r in gen if r.token is not None]


class CaptureError(Exception):
    """As Numba's CudaAPIError on a GPU: an Exception, not a RuntimeError (the simulator's own
    CudaAPIError is one, so it cannot stand in)."""


def test_a_failed_capture_leaves_the_eager_step(tiny, monkeypatch, capsys):
    """A CUDA graph capture that raises anything (here as a Numba launch's CudaAPIError would)
    does not end the generation: the steps go on eagerly, with the eager steps' tokens, and one
    line on stderr says so. (The simulator cannot capture: capture is made to raise.)"""
    import tinyrt

    opts = dict(device="cuda", kv_policy="sink", kv_size=9, sinks=2)
    ids = list(seeded_rng().integers(3, 300, 5))
    kw = dict(max_tokens=16, ignore_eos=True, temperature=0, repeat_penalty=1.2)
    want = _tokens(tinyrt.LLM(tiny, cuda_graph=False, **opts).generation(ids, **kw))
    capsys.readouterr()
    tries = []

    def capture(self):
        tries.append(1)
        raise CaptureError("[700] CUDA_ERROR_ILLEGAL_ADDRESS\nmore")
    monkeypatch.setattr(device_decode, "SIM", False)       # the decoder tries a graph
    monkeypatch.setattr(device_decode.DeviceDecoder, "_capture", capture)
    got = _tokens(tinyrt.LLM(tiny, **opts).generation(ids, **kw))
    assert got == want and len(got) == 16 and tries == [1]
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: a CUDA graph of the decode step could not be captured (CaptureError: "
                   "[700] CUDA_ERROR_ILLEGAL_ADDRESS); the steps run eagerly"]
