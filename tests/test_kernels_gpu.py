"""The CUDA kernels against the NumPy reference, on fresh random inputs of tiny shapes: in Numba's
CUDA simulator where there is no GPU (CI), on the GPU where there is one (see conftest)."""

import numpy as np
import pytest
from numba import cuda

from helpers import random_quant, rel_err
from tinyrt.kernels import gpu, quant
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
