"""The CUDA kernels against the NumPy reference, on fresh random inputs of tiny shapes: in Numba's
CUDA simulator where there is no GPU (CI), on the GPU where there is one (see conftest)."""

import json

import numpy as np
import pytest
from numba import cuda

from helpers import quant_store, random_quant, random_weights, rel_err, tiny_config
from tinyrt.kernels import gpu, kv_quant, quant
from tinyrt.kernels import reference as ref

rng = np.random.default_rng()


def run(launch, *arrays):
    """Call `launch` on device copies of the arrays; return them all copied back."""
    dev = [cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in arrays]
    launch(*dev)
    return [d.copy_to_host() if isinstance(a, np.ndarray) else d for a, d in zip(arrays, dev)]


@pytest.mark.parametrize("n_in, n_out, g, bits, half", [(64, 24, 32, 4, True), (128, 26, 64, 4, False),
                                                    (96, 8, 16, 8, False), (64, 5, 32, 8, True)])
def test_q_gemv_and_dequantize(n_in, n_out, g, bits, half):
    w = random_quant(n_out, n_in, bits, g, half, rng)
    x = rng.standard_normal(n_in).astype(np.float32)
    be = gpu.CudaBackend()
    dev = be.prepare_linear([w])
    y = be.empty(n_out)
    gpu.launch_q_gemv(x, dev, y)
    assert rel_err(y, ref.linear(x[None], quant.dequantize(w))[0]) < 1e-5
    w_t = be.empty((n_in, n_out))
    gpu.launch_q_dequantize(dev, w_t)
    assert np.allclose(w_t, quant.dequantize(w).T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gemv(dtype):
    w = rng.standard_normal((37, 70)).astype(dtype)
    x = rng.standard_normal(70).astype(np.float32)
    (y,) = run(gpu.launch_gemv, x, w, np.zeros(37, np.float32))[-1:]
    assert rel_err(y, ref.linear(x[None], w)[0]) < 1e-5


def test_rmsnorm_rope_silu():
    x = rng.standard_normal((3, 200)).astype(np.float32)
    w = rng.standard_normal(200).astype(np.float32)
    (y,) = run(lambda x, w, y: gpu.launch_rmsnorm(x, w, 1e-5, y), x, w, np.empty_like(x))[-1:]
    assert rel_err(y, ref.rmsnorm(x, w, 1e-5)) < 1e-5

    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    cos, sin = ref.rope_tables(1 / 10000 ** (np.arange(8) / 8), np.array([0, 7, 1000]))
    (y,) = run(gpu.launch_rope, x, cos, sin, np.empty_like(x))[-1:]
    assert rel_err(y, ref.rope(x, cos, sin)) < 1e-6

    gu = (rng.standard_normal((2, 40)) * 30).astype(np.float32)
    (y,) = run(gpu.launch_silu_mul, gu, np.empty((2, 20), np.float32))[-1:]
    assert rel_err(y, ref.ReferenceBackend.swiglu(gu)) < 1e-6


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_store_kv(dtype):
    k_buf, v_buf = np.zeros((2, 9, 8), dtype), np.zeros((2, 9, 8), dtype)
    k, v = rng.standard_normal((3, 2, 8)).astype(np.float32), rng.standard_normal((3, 2, 8)).astype(np.float32)
    k[0, 0, 0] = 1e6
    slots = np.array([[4, 0, 8], [1, 7, 2]])
    want_k, want_v = k_buf.copy(), v_buf.copy()
    ref.ReferenceBackend.store_kv(want_k, want_v, slots, k, v)
    got_k, got_v = run(gpu.launch_store_kv, k_buf, v_buf, slots, k, v)[:2]
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("h2o", [False, True])
def test_attention_decode(ratio, window, dtype, h2o):
    """A ring buffer: slots hold positions in any order, some free (-1), some after the query
    (hidden), per KV head; S below the buffer's capacity C."""
    G, D, C, S, q_pos = 2, 16, 300, 261, 400
    Q = G * ratio
    q = rng.standard_normal((Q, D)).astype(np.float32)
    k = rng.standard_normal((G, C, D)).astype(dtype)
    v = rng.standard_normal((G, C, D)).astype(dtype)
    k_pos = np.stack([rng.permutation(S) + q_pos - S + 10 for _ in range(G)])   # 9 after q_pos
    k_pos[rng.random(k_pos.shape) < 0.1] = -1
    score0 = rng.random((G, C)).astype(np.float32) if h2o else np.zeros((G, 0), np.float32)
    want_score = score0.copy()
    want = ref.attention(q[None], k.astype(np.float32), v.astype(np.float32), np.array([q_pos]),
                         k_pos, 0.25, window or None, want_score if h2o else None)[0]
    out = run(lambda q, k, v, kp, sc, pr, o: gpu.launch_attention_decode(
        q, k, v, q_pos, kp, 0.25, window, sc, pr, o),
        q, k, v, k_pos, score0, np.empty((Q, S), np.float32), np.empty((Q, D), np.float32))
    assert rel_err(out[-1], want) < 1e-5
    if h2o:
        assert rel_err(out[4], want_score) < 1e-6


@pytest.fixture
def gpu_shapes(monkeypatch):
    """The launch shapes a GPU gets: warps of 32 lanes, 8 rows and 128 threads a block (the
    simulator's own are smaller, for its speed; the kernels are written for both)."""
    monkeypatch.setattr(gpu, "LANES", 32)
    monkeypatch.setattr(gpu, "ROWS", 8)
    monkeypatch.setattr(gpu, "THREADS", 128)


def test_kernels_at_the_gpu_s_launch_shapes(gpu_shapes):
    be = gpu.CudaBackend()
    w = random_quant(20, 256, 4, 32, True, rng)
    x = rng.standard_normal(256).astype(np.float32)
    y = be.empty(20)
    gpu.launch_q_gemv(x, be.prepare_linear([w]), y)
    assert rel_err(be.to_numpy(y), ref.linear(x[None], quant.dequantize(w))[0]) < 1e-5
    x = rng.standard_normal((2, 300)).astype(np.float32)
    g = rng.standard_normal(300).astype(np.float32)
    (y,) = run(lambda x, w, y: gpu.launch_rmsnorm(x, w, 1e-5, y), x, g, np.empty_like(x))[-1:]
    assert rel_err(y, ref.rmsnorm(x, g, 1e-5)) < 1e-5
    G, D, S, q_pos = 1, 16, 200, 250
    q = rng.standard_normal((2, D)).astype(np.float32)          # two query heads, one KV head
    k, v = (rng.standard_normal((G, S, D)).astype(np.float32) for _ in range(2))
    k_pos = np.arange(S)[None] + 10
    want = ref.attention(q[None], k, v, np.array([q_pos]), k_pos, 0.25, None, None)[0]
    out = run(lambda q, k, v, kp, sc, pr, o: gpu.launch_attention_decode(
        q, k, v, q_pos, kp, 0.25, 0, sc, pr, o),
        q, k, v, k_pos, np.zeros((G, 0), np.float32), np.empty((2, S), np.float32),
        np.empty((2, D), np.float32))
    assert rel_err(out[-1], want) < 1e-5


def test_a_float16_cache_at_the_gpu_s_launch_shapes(tmp_path, gpu_shapes):
    """The decoder over a float16 KV cache, as a GPU runs it: the backend's tensors through the
    launchers at the GPU's launch shapes, against the reference over the same cache type."""
    from helpers import write_tiny_model

    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import CacheOptions, make_cache
    from tinyrt.models import load_model

    d = write_tiny_model(tmp_path / "m", tiny_config(hidden_size=32, intermediate_size=64,
                                                     num_attention_heads=4, num_hidden_layers=1))
    fast, slow = (load_model(d, get_backend(dev)) for dev in ("cuda", "reference"))
    caches = [make_cache(CacheOptions("dense", 16, "f16"), m) for m in (fast, slow)]
    ids = rng.integers(0, fast.config.vocab_size, 6)
    a, b = (m.forward(ids[:4], cache, all_logits=True) for m, cache in zip((fast, slow), caches))
    assert rel_err(fast.backend.to_numpy(a), b) < 3e-3
    for t in ids[4:]:
        a, b = (m.forward([t], cache) for m, cache in zip((fast, slow), caches))
        assert rel_err(fast.backend.to_numpy(a), b) < 3e-3


def _fresh_rng():
    """A generator of fresh random inputs whose seed a failure prints (pytest shows stdout)."""
    seed = int(np.random.SeedSequence().entropy % 2 ** 32)
    print("seed", seed)
    return np.random.default_rng(seed)


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
    rng = _fresh_rng()
    N, D, B = 2, 16, 4
    C = 8 * B
    want, got = (quant_store(N, C, D, bits, B, 2 * B, pin=1) for _ in range(2))
    be = gpu.CudaBackend()
    at = 0
    for step in range(12):
        T = int(rng.integers(1, 5) if order == "scattered" else rng.integers(3, 6))
        if order == "in order":                 # (at least 36 tokens: past the 32 slots)
            slots = np.tile((np.arange(T) + at) % C, (N, 1))
            at += T
        else:
            slots = np.stack([rng.choice(C, T, replace=False) for _ in range(N)])
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
    some after the queries (hidden); a window; H2O's scores."""
    rng = _fresh_rng()
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
    be = gpu.CudaBackend()
    got = be.attention(q, store, None, q_pos, k_pos, 0.25, window or None,
                       got_score if h2o else None)
    assert rel_err(be.to_numpy(got), want) < 1e-5
    assert rel_err(got_score, want_score) < 1e-6


def test_quantized_cache_kernels_round_without_fma():
    """On the GPU, a float32 multiply and add contract into one fused multiply-add unless each is
    rounded explicitly: the store and dequantize kernels (code * scale + zero, as kv_quant rounds
    it twice) compiled to PTX for a Hopper GPU hold no fma, and do hold mul.rn and add.rn.
    Where no CUDA compiler (NVVM) is installed, nothing to check."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = r"""
import re, types
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
from tinyrt.kernels import gpu
a = lambda dt, nd: t.Array(dt, nd, 'C')
store = (a(t.uint8, 4), a(t.float16, 4), a(t.uint8, 3), a(t.float16, 4), a(t.float16, 4),
         a(t.float16, 4), a(t.int32, 2))
sigs = {'store_kv_q': store + (a(t.int32, 2), a(t.int64, 2), t.int64, a(t.int64, 2),
                               a(t.float32, 3), a(t.float32, 3)),
        'dequantize_kv': store + (a(t.float32, 3), a(t.float32, 3))}
for name, sig in sigs.items():
    ptx, _ = cuda.compile_ptx(getattr(gpu, name).py_func, sig, cc=(9, 0))
    print(name, *(len(re.findall(op, ptx)) for op in (r'\bfma\.', r'\bmul\.rn\.f32', r'\badd\.rn\.f32')))
"""
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.stdout.startswith("no nvvm"):
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    counts = {name: [int(n) for n in rest] for name, *rest in map(str.split, run.stdout.splitlines())}
    for name in ("store_kv_q", "dequantize_kv"):
        fma, mul, add = counts[name]
        assert fma == 0 and mul > 0 and add > 0, (name, counts[name])


@pytest.mark.parametrize("policy, kind", [("dense", "float"), ("sink", "4-bit"), ("h2o", "4-bit")])
def test_tiny_model_cuda_equals_reference(tmp_path, policy, kind):
    """The whole decoder on the CUDA backend (a prompt, then decode steps) gives the reference
    backend's logits step by step; a cache of 6 slots (1 sink) makes sink and h2o evict. The
    CUDA backend keeps float weights (and the 4-bit model's head) as float16: a relative error
    of a few 1e-4 on the logits."""
    from helpers import tiny_config, write_tiny_model

    from tinyrt.converters import convert
    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import CacheOptions, make_cache
    from tinyrt.models import load_model

    # (the simulator runs a CUDA thread as a Python thread: a model of a few thousand weights)
    d = write_tiny_model(tmp_path / "m", tiny_config(hidden_size=32, intermediate_size=64,
                                                     num_attention_heads=4, num_hidden_layers=1))
    if kind == "4-bit":
        d = convert(d, tmp_path / "q", method="rtn", group_size=32)
    fast, slow = (load_model(d, get_backend(dev)) for dev in ("cuda", "reference"))
    assert fast.backend.name == "cuda"
    c = fast.config
    caches = [make_cache(CacheOptions(policy, 16 if policy == "dense" else 6, "f32", sinks=1), m)
              for m in (fast, slow)]
    ids = rng.integers(0, c.vocab_size, 8 if policy == "dense" else 11)
    a, b = (m.forward(ids[:4], cache, all_logits=True) for m, cache in zip((fast, slow), caches))
    assert rel_err(fast.backend.to_numpy(a), b) < 3e-3
    for t in ids[4:]:
        a, b = (m.forward([t], cache) for m, cache in zip((fast, slow), caches))
        assert rel_err(fast.backend.to_numpy(a), b) < 3e-3
    assert caches[0].next_pos == len(ids) and np.array_equal(caches[0].slot_pos, caches[1].slot_pos)


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
    token, the same tokens kept and the same blocks sealed."""
    from tinyrt.kernels import get_backend
    from tinyrt.kv_cache import CacheOptions, make_cache
    from tinyrt.models import load_model

    rng = np.random.default_rng(11)
    opts = CacheOptions(policy, 24 if policy == "dense" else 12, kv_type, sinks=2, kv_group=4,
                        kv_residual=0)
    models = [load_model(micro, get_backend(dev)) for dev in ("cuda", "reference")]
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
    for name in ("where", "owner", "stamp"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (a.where[..., 1:3] < 0).any(axis=-1).all()     # a sealed block, read as codes


def test_cuda_asked_for_and_absent():
    """Without a GPU (and outside the simulator), --device cuda says why and what to use."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    code = ("from tinyrt.kernels import get_backend, gpu\n"
            "why = gpu.unavailable()\n"
            "try:\n    get_backend('cuda')\nexcept ValueError as e:\n    print('refused:', e)\n"
            "else:\n    print('ran' if why is None else 'no error')\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    if out.startswith("ran"):
        pytest.skip("a CUDA GPU is present: nothing to refuse")
    assert out.startswith("refused: --device cuda: ") and "use --device cpu" in out
