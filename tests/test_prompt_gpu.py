"""The CUDA backend's passes of several tokens (a prompt; kernels/cuda/prompt.py): 16-bit GEMMs
of the dequantized layers and torch's fused attention, against the NumPy reference, within
docs/GPU.md's contract (helpers.PROMPT_ERR); whole tiny models of every family and cache policy.
In Numba's CUDA simulator where there is no GPU (torch's CPU kernels standing in for cuBLAS and
the fused attention), on the GPU where there is one."""

import numpy as np
import pytest
import torch

from helpers import (PROMPT_ERR, assert_logits_close, random_quant, rel_err, seeded_rng,
                     tiny_config, write_tiny_model)
from tinyrt.kernels import get_backend, quant
from tinyrt.kernels import reference as ref
from tinyrt.kernels.cuda import CudaBackend, prompt
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models import FAMILIES, load_model

pytestmark = pytest.mark.usefixtures("quick_barriers")

rng = seeded_rng(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Calls:
    """What the prompt path called: each GEMM's operand types (PromptOps.mm) and each fused
    attention's mask (PromptOps.fused, torch's scaled_dot_product_attention: a CausalBias, a
    Tensor)."""

    def __init__(self, monkeypatch):
        self.mm, self.sdpa = [], []
        mm, fused = prompt.PromptOps.mm, prompt.PromptOps.fused

        def spy_mm(ops, a, b):
            self.mm.append((a.dtype, b.dtype))
            return mm(ops, a, b)

        def spy_fused(ops, q, k, v, mask):
            self.sdpa.append(type(mask).__name__)
            return fused(ops, q, k, v, mask)
        monkeypatch.setattr(prompt.PromptOps, "mm", spy_mm)
        monkeypatch.setattr(prompt.PromptOps, "fused", spy_fused)


# -- the ops ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, err", [("bfloat16", 6e-3), ("float16", 8e-4), ("float32", 1e-6)])
@pytest.mark.parametrize("kind", ["4-bit", "8-bit", "float16"])
def test_prompt_gemm(monkeypatch, dtype, err, kind):
    """backend.linear of T > 1 rows: the layer dequantized into the scratch, one 16-bit GEMM with
    float32 sums (float32 operands: the fallback); a layer larger than the scratch (the LM head)
    a block of rows at a time. Against x @ W.T in float32 (operands rounded: the error)."""
    calls = Calls(monkeypatch)
    be = CudaBackend(prompt_dtype=DTYPES[dtype])
    n_out, n_in = 40, 64
    w = rng.standard_normal((n_out, n_in)).astype(np.float16) if kind == "float16" else \
        random_quant(n_out, n_in, int(kind[0]), 32, True, rng)
    want_w = quant.dequantize(w) if kind != "float16" else w.astype(np.float32)
    dev = be.prepare_linear([w])
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    want = ref.linear(x, want_w)
    assert_close = lambda got: rel_err(be.to_numpy(got), want) < err   # noqa: E731
    assert assert_close(be.linear(x, dev))
    assert calls.mm == [(DTYPES[dtype], DTYPES[dtype])]
    be.prompt.largest = 13 * n_in                   # a scratch of 13 rows: 4 blocks of them
    assert assert_close(be.linear(x, dev)) and len(calls.mm) == 1 + 4


def test_float16_operands_past_65504():
    """float16 operands: a row of x past float16's range (or 2**14) is scaled down by a power of
    two and its product scaled back, exactly; unguarded, it would be infinite."""
    be = CudaBackend(prompt_dtype=torch.float16)
    w = random_quant(24, 64, 4, 32, True, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1] *= 1e6
    got = be.to_numpy(be.linear(x, be.prepare_linear([w])))
    assert np.isfinite(got).all() and rel_err(got, ref.linear(x, quant.dequantize(w))) < 8e-4
    with np.errstate(over="ignore"):
        assert not np.isfinite(x[1].astype(np.float16)).all()   # (what it guards against)


def _cache(G, C, D, dtype):
    k, v = (rng.standard_normal((G, C, D)).astype(dtype) for _ in range(2))
    return k, v


@pytest.mark.parametrize("cache_dtype, err", [(np.float16, 2e-3), (np.float32, 1e-5)])
@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("case, path", [
    ("whole", "CausalBias"),            # a prompt into an empty cache: slots 0..T-1
    ("after", "CausalBias"),            # queries after cached tokens, in order
    ("ring", "Tensor"),                 # a ring that wrapped: positions out of slot order
    ("window", "Tensor"),               # a sliding window that cuts the oldest
    ("per head", None),                 # each KV head its own slots (H2O), scores added
])
def test_prompt_attention(monkeypatch, cache_dtype, err, ratio, case, path):
    """backend.attention of T > 1 queries: torch's fused attention with flash attention's
    lower-right causal mask where the slots hold the positions in order up to the queries, a
    mask of the positions otherwise; per-head slot tables and H2O's scores in blocks of queries
    (here of 2 queries: SCORES_BYTES), the weights' column sums added to the scores. Against
    reference.attention on the same cache."""
    calls = Calls(monkeypatch)
    be = CudaBackend()
    G, D, T, C = 2, 8, 5, 12
    Q = G * ratio
    k, v = _cache(G, C, D, cache_dtype)
    q = rng.standard_normal((T, Q, D)).astype(np.float32)
    S, window, score = {"whole": T, "after": 9, "ring": 10, "window": 9, "per head": 11}[case], \
        5 if case == "window" else None, None
    k_pos = np.arange(S)
    if case == "ring":                  # slots 0..9 hold 10..14, 5..9 (the ring's order)
        k_pos = np.concatenate([np.arange(10, 15), np.arange(5, 10)])
    k_pos = np.broadcast_to(k_pos, (G, S)).copy()
    if case == "per head":
        k_pos[1] = rng.permutation(S)
        k_pos[0, 3] = -1
        score = rng.random((G, C)).astype(np.float32)
        monkeypatch.setattr(prompt, "SCORES_BYTES", 4 * Q * S * 2)
    q_pos = np.sort(k_pos[0])[-T:] if case != "ring" else np.arange(10, 15)
    want_score = None if score is None else score.copy()
    want = ref.attention(q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos, 0.3,
                         window, want_score)
    dev = [be.dev(a, a.dtype) for a in (k, v)]
    got = be.to_numpy(be.attention(q, *dev, q_pos, k_pos, 0.3, window, score))
    assert rel_err(got, want) < err
    if score is not None:
        assert rel_err(score, want_score) < err
    assert calls.sdpa == ([path] if path else [])
    if path is None:                     # (3 blocks of at most 2 queries: 2 GEMMs each)
        assert len(calls.mm) == 6


# -- whole models ----------------------------------------------------------------------------------

OVER = {"mistral": dict(sliding_window=4),
        "smollm3": dict(num_hidden_layers=2, no_rope_layers=[1, 0]),
        "phi3": dict(partial_rotary_factor=0.5, original_max_position_embeddings=16,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.5, 2.0],
                                   "long_factor": [3.0, 5.0]}),
        "gemma3_text": dict(num_hidden_layers=2, sliding_window=3, query_pre_attn_scalar=6,
                            head_dim=8,     # (Gemma 3's default: 256)
                            layer_types=["sliding_attention", "full_attention"],
                            hidden_act="gelu_pytorch_tanh")}


def tiny(tmp_path, family: str, kind: str, **over):
    """A one-layer model of `family` (hidden 32, 4 heads; OVER's settings), float or 4-bit."""
    from tinyrt.converters import convert

    d = write_tiny_model(tmp_path / "m", tiny_config(**{
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "model_type": family,
        "architectures": [FAMILIES[family].architecture], **OVER.get(family, {}), **over}))
    return convert(d, tmp_path / "q", method="rtn", group_size=32) if kind == "4-bit" else d


@pytest.mark.parametrize("family, policy, kv_type, kind", [
    ("llama", "dense", "f16", "float"), ("llama", "sink", "f32", "4-bit"),
    ("llama", "h2o", "f16", "4-bit"), ("mistral", "dense", "f16", "4-bit"),
    ("qwen2", "h2o", "f32", "float"), ("qwen3", "dense", "q4", "float"),
    ("smollm3", "sink", "f16", "4-bit"), ("phi3", "dense", "f32", "4-bit"),
    ("gemma3_text", "sink", "f16", "float"), ("llama", "h2o", "q2", "float")])
def test_tiny_model_cuda_equals_reference(tmp_path, monkeypatch, family, policy, kv_type, kind):
    """The whole decoder on the CUDA backend, a prompt and then decode steps, gives the
    reference's logits within the contract and its greedy tokens (but for near ties), step by
    step, for every family and cache policy: Qwen2's biases, Qwen3's per-head q/k norms,
    SmolLM3's NoPE layer (the second of two), Phi-3's fused projections, half of each head
    rotated and longrope, Gemma 3's sliding and global layers (their sinks re-rotated by two
    sets of frequencies) and GeGLU, Mistral's window; dense, sink and h2o caches of float16,
    float32 and KIVI's codes; a cache of 6 slots (1 sink) makes sink and h2o evict, their
    prompts in chunks. The prompt's GEMMs take bfloat16 operands; dense and sink caches attend
    through torch's fused attention, h2o in blocks with its scores."""
    calls = Calls(monkeypatch)
    d = tiny(tmp_path, family, kind)
    fast, slow = load_model(d, get_backend("cuda")), load_model(d, get_backend("reference"))
    assert fast.backend.name == "cuda" and fast.backend.prompt.dtype == torch.bfloat16
    more = dict(kv_group=4, kv_residual=0) if kv_type.startswith("q") else {}
    caches = [make_cache(CacheOptions(policy, 16 if policy == "dense" else 6, kv_type, sinks=1,
                                      **more), m) for m in (fast, slow)]
    err = PROMPT_ERR["bfloat16"]
    ids = rng.integers(0, fast.config.vocab_size, 8 if policy == "dense" else 11)
    a, b = (m.forward(ids[:5], cache, all_logits=True) for m, cache in zip((fast, slow), caches))
    assert_logits_close(fast.backend.to_numpy(a), b, err)
    assert (torch.bfloat16, torch.bfloat16) in calls.mm
    assert bool(calls.sdpa) == (policy != "h2o")
    for t in ids[5:]:
        a, b = (m.forward([t], cache) for m, cache in zip((fast, slow), caches))
        assert_logits_close(fast.backend.to_numpy(a), b, err)
    assert caches[0].next_pos == len(ids) and np.array_equal(caches[0].slot_pos, caches[1].slot_pos)


def test_a_prompt_in_passes_is_the_prompt_at_once(tmp_path, monkeypatch):
    """A prompt longer than the backend's pass (`pass_tokens`, here 3) runs in passes over the
    cache (the later ones attend to the earlier ones' keys through the lower-right causal
    mask) and gives the logits of one pass: every row is computed alone, and the cache holds
    the same keys either way. (9 tokens: a last pass of one token would be a decode step.)"""
    calls = Calls(monkeypatch)
    d = tiny(tmp_path, "llama", "4-bit")
    logits = []
    for tokens in (None, 3):
        m = load_model(d, get_backend("cuda"))
        m.backend.pass_tokens = tokens
        cache = make_cache(CacheOptions("dense", 16, "f16"), m)
        logits.append(m.backend.to_numpy(m.forward(np.arange(9) + 7, cache, all_logits=True)))
    assert rel_err(logits[1], logits[0]) < 1e-6
    assert calls.sdpa == ["CausalBias"] * (1 + 3)        # (one layer: one attention a pass)


def test_a_prompt_past_float16_s_range(tmp_path, monkeypatch):
    """float16 operands (a GPU before bfloat16: Turing) where the MLP's inputs pass 65504 (its
    norm's weights 1e5): the rows scaled down by powers of two keep the logits finite and
    within float16's contract; bfloat16's range holds them as they are."""
    from safetensors.numpy import load_file, save_file

    d = tiny(tmp_path, "llama", "float")
    w = load_file(d / "model.safetensors")
    w["model.layers.0.post_attention_layernorm.weight"] *= np.float32(1e5)
    save_file(w, str(d / "model.safetensors"))
    seen = []
    operand = prompt.PromptOps.operand
    monkeypatch.setattr(prompt.PromptOps, "operand", lambda ops, x: (
        seen.append(float(x.abs().max())), operand(ops, x))[1])
    slow = load_model(d, get_backend("reference"))
    want = slow.forward(np.arange(6) + 3, make_cache(CacheOptions("dense", 8, "f32"), slow),
                        all_logits=True)
    for dtype in ("float16", "bfloat16"):
        fast = load_model(d, CudaBackend(prompt_dtype=DTYPES[dtype]))
        got = fast.forward(np.arange(6) + 3, make_cache(CacheOptions("dense", 8, "f32"), fast),
                           all_logits=True)
        assert_logits_close(fast.backend.to_numpy(got), want, PROMPT_ERR[dtype])
    assert max(seen) > 65504
