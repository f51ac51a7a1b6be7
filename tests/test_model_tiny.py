"""The decoder on tiny random models against transformers' own Llama/Mistral implementation."""

import json

import numpy as np
import pytest

from helpers import (hf_logits, hf_model, random_weights, rel_err, seeded_rng, tiny_config,
                     write_tiny_model)
from tinyrt.errors import CacheFullError, ModelFormatError
from tinyrt.kernels import get_backend
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models import load_model


def _ours(directory, capacity=512):
    """The reference decoder with a float32 KV cache: comparable with transformers to 1e-5."""
    m = load_model(directory, get_backend("reference"))
    return m, make_cache(CacheOptions(kv_size=capacity, kv_type="f32"), m)


CASES = {
    "mha": tiny_config(num_attention_heads=4, num_key_value_heads=4),
    "gqa3": tiny_config(),
    "gqa4-headdim": tiny_config(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "mqa-tied": tiny_config(num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3-rope": tiny_config(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "linear-rope": tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-window": tiny_config(model_type="mistral", architectures=["MistralForCausalLM"],
                                  sliding_window=8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    d = write_tiny_model(tmp_path / name, CASES[name], seed=int(seeded_rng().integers(1 << 31)))
    ids = seeded_rng().integers(0, 320, 40)
    want = hf_logits(hf_model(d), ids)
    m, cache = _ours(d)
    got = m.forward(ids, cache, all_logits=True)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints(tmp_path, dtype):
    import torch
    from safetensors.torch import save_file

    cfg = tiny_config(torch_dtype=dtype)
    d = write_tiny_model(tmp_path / dtype, cfg)
    w = {k: torch.from_numpy(v).to(getattr(torch, dtype)) for k, v in random_weights(cfg, 5).items()}
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    ids = seeded_rng().integers(0, 320, 20)
    want = hf_logits(hf_model(d), ids)
    m, cache = _ours(d)
    assert rel_err(m.forward(ids, cache, all_logits=True), want) < 1e-5


def test_decode_one_token_at_a_time_equals_prefill(tmp_path):
    d = write_tiny_model(tmp_path / "m", tiny_config(), seed=3)
    m, cache = _ours(d)
    ids = seeded_rng().integers(0, 320, 30)
    full = m.forward(ids, cache, all_logits=True)
    cache.reset()
    m.forward(ids[:11], cache)
    steps = np.concatenate([m.forward(ids[i:i + 1], cache) for i in range(11, 30)])
    np.testing.assert_allclose(steps, full[11:], rtol=1e-4, atol=1e-4)
    # rollback then replay gives the same logits
    cache.rollback(5)
    again = np.concatenate([m.forward(ids[i:i + 1], cache) for i in range(25, 30)])
    np.testing.assert_allclose(again, full[25:], rtol=1e-4, atol=1e-4)


def test_dense_cache_full_is_a_clear_error(tmp_path):
    d = write_tiny_model(tmp_path / "m", tiny_config())
    m, cache = _ours(d, capacity=16)
    m.forward(np.arange(10), cache)
    with pytest.raises(CacheFullError, match="--kv-policy sink"):
        m.forward(np.arange(7), cache)
    assert cache.length == 10  # nothing was appended


def test_wrong_tensor_shape(tmp_path):
    cfg = tiny_config()
    w = random_weights(cfg)
    w["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"][:-1]
    d = write_tiny_model(tmp_path / "m", cfg, weights=w)
    with pytest.raises(ModelFormatError, match=r"up_proj.weight.*shape \[159, 96\].*\[160, 96\]"):
        _ours(d)


def test_missing_tensor(tmp_path):
    cfg = tiny_config()
    w = random_weights(cfg)
    del w["model.norm.weight"]
    d = write_tiny_model(tmp_path / "m", cfg, weights=w)
    with pytest.raises(ModelFormatError, match="model.norm.weight.*missing"):
        _ours(d)


def test_config_with_inconsistent_heads(tmp_path):
    d = write_tiny_model(tmp_path / "m", tiny_config())
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError, match="num_key_value_heads"):
        _ours(d)


def test_an_embedding_is_the_mean_of_transformers_final_hidden_states(tmp_path):
    """LLM.embed (ollama's /api/embed): the final, normed hidden states of the text's tokens
    (as transformers' last hidden_states), averaged and L2-normalized; the conversation's
    cache is left as it was."""
    import torch

    import tinyrt

    d = write_tiny_model(tmp_path / "m", tiny_config())
    llm = tinyrt.LLM(d, device="reference", kv_size=128, kv_type="f32")
    llm.generate("hi", max_tokens=3, temperature=0)
    held = llm.cache.length
    text = "".join(chr(c) for c in seeded_rng().integers(97, 123, 40))
    ids = llm.encode(text, add_special=True)
    with torch.no_grad():
        h = hf_model(d)(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    want = h.double().mean(0).numpy()
    got = llm.embed(text)
    assert rel_err(got, want / np.linalg.norm(want)) < 1e-5
    assert llm.cache.length == held
    assert np.allclose(llm.embed(text * 20), llm.embed(text * 20, truncate=True))
    with pytest.raises(tinyrt.TinyrtError, match="the KV cache holds 128"):
        llm.embed(text * 20, truncate=False)
