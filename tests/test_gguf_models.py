"""GGUF files run in place on the quantized kernels: for each type the runtime holds quantized,
a tiny random model written in that type gives the logits of the float model built from the
`gguf` package's own dequantization of the same tensors (an oracle that shares no code with the
runtime's mapping), on every device; other types run as float, and say so."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gguf_helpers import write_gguf
from helpers import byte_level_tokenizer, rel_err, random_weights, tiny_config, write_tiny_model
from tinyrt.kernels import QuantWeight, get_backend
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models import load_model
from tinyrt.models.gguf_quants import FORMS, GGUF_TO_QUANT

# K-quants need rows of a multiple of 256 inputs
CFG = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2)
TYPES = [t.name for t in GGUF_TO_QUANT]


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return byte_level_tokenizer(CFG["vocab_size"]).to_str()


def quantized_and_float(tmp_path, qtype: str, tokenizer_json: str, cfg=CFG, seed=0):
    """A GGUF of `qtype` and the float model directory of its tensors as gguf dequantizes them."""
    back = write_gguf(tmp_path / f"m.{qtype}.gguf", cfg, random_weights(cfg, seed),
                      tokenizer_json, qtype=qtype, kquant_rng=np.random.default_rng(seed))
    if cfg.get("tie_word_embeddings"):
        back.pop("lm_head.weight", None)
    return tmp_path / f"m.{qtype}.gguf", write_tiny_model(tmp_path / "float", cfg, weights=back)


def logits_steps(model, ids, prompt: int = 5):
    """Logits of a prompt, then of each later token decoded one at a time."""
    cache = make_cache(CacheOptions(kv_size=64, kv_type="f32"), model)
    out = [model.backend.to_numpy(model.forward(ids[:prompt], cache, all_logits=True))]
    out += [model.backend.to_numpy(model.forward(ids[t:t + 1], cache)) for t in range(prompt, len(ids))]
    return np.concatenate(out)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_each_type_runs_as_its_float_model(tmp_path, tokenizer_json, qtype, device):
    gguf_path, float_dir = quantized_and_float(tmp_path, qtype, tokenizer_json)
    q = load_model(gguf_path, get_backend(device))
    w = q.weights.linear("model.layers.0.self_attn.q_proj")          # held quantized, as stored
    assert isinstance(w, QuantWeight) and (w.bits, w.group_size) == FORMS[Q[qtype]]
    if device == "cpu":                                               # and run on its kernels
        assert q.layers[0].qkv.bits == w.bits and q.lm_head.bits == w.bits
    ids = np.random.default_rng(1).integers(0, CFG["vocab_size"], 9)
    want = logits_steps(load_model(float_dir, get_backend("reference")), ids)
    assert rel_err(logits_steps(q, ids), want) < 1e-3


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_gguf_on_the_cuda_backend(tmp_path, tokenizer_json, qtype):
    """The CUDA kernels (in Numba's simulator without a GPU) on a 1-layer model (the prompt's
    GEMMs in float32, so that the formats' error alone is measured: the 16-bit ones are
    test_prompt_gpu's)."""
    import torch

    from tinyrt.kernels.cuda import CudaBackend

    cfg = dict(CFG, num_hidden_layers=1)
    gguf_path, float_dir = quantized_and_float(tmp_path, qtype, tokenizer_json, cfg)
    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], 4)
    want = logits_steps(load_model(float_dir, get_backend("reference")), ids, prompt=3)
    got = logits_steps(load_model(gguf_path, CudaBackend(prompt_dtype=torch.float32)), ids,
                       prompt=3)
    assert rel_err(got, want) < 1e-3


def test_tied_head_runs_quantized(tmp_path, tokenizer_json):
    """A tied model's head is its quantized embedding table, run as stored (the default model:
    Q8_0), while the embedding's rows are dequantized as they are read."""
    cfg = dict(CFG, tie_word_embeddings=True)
    gguf_path, float_dir = quantized_and_float(tmp_path, "Q8_0", tokenizer_json, cfg)
    q = load_model(gguf_path, get_backend("cpu"))
    assert q.lm_head.bits == 8
    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], 8)
    want = logits_steps(load_model(float_dir, get_backend("reference")), ids)
    assert rel_err(logits_steps(q, ids), want) < 1e-3


def test_float_path_on_request(tmp_path, tokenizer_json):
    """dtype f32 runs the same file on float weights: the reference's numbers, to rounding."""
    gguf_path, float_dir = quantized_and_float(tmp_path, "Q4_K", tokenizer_json)
    m = load_model(gguf_path, get_backend("cpu"), dtype="f32")
    assert isinstance(m.layers[0].qkv, np.ndarray) and m.layers[0].qkv.dtype == np.float32
    ids = np.random.default_rng(4).integers(0, CFG["vocab_size"], 7)
    want = logits_steps(load_model(float_dir, get_backend("reference")), ids)
    assert rel_err(logits_steps(m, ids), want) < 1e-5


def test_other_types_run_as_float_and_say_so(tmp_path, tokenizer_json, capsys, monkeypatch):
    """Q3_K has no quantized form here: dequantized at load, with one line naming it."""
    import tinyrt

    gguf_path, float_dir = quantized_and_float(tmp_path, "Q3_K", tokenizer_json)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    llm = tinyrt.load(gguf_path, device="cpu")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Q3_K" in err[0] and "run as float" in err[0]
    assert isinstance(llm.model.layers[0].qkv, np.ndarray)
    ids = np.random.default_rng(5).integers(0, CFG["vocab_size"], 6)
    want = logits_steps(load_model(float_dir, get_backend("reference")), ids)
    assert rel_err(logits_steps(llm.model, ids), want) < 1e-5


def test_a_gguf_runs_in_place(tmp_path, tokenizer_json, monkeypatch):
    """Loading a GGUF (by two paths: a link to it too) writes nothing: no float copy, no cache
    entry; its tokenizer and chat template come from its metadata."""
    import tinyrt

    cfg = dict(CFG, num_hidden_layers=1)
    gguf_path, _ = quantized_and_float(tmp_path, "Q4_1", tokenizer_json, cfg)
    link = tmp_path / "link.gguf"
    link.symlink_to(gguf_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    replies = [tinyrt.load(p, device="cpu", quiet=True).generate("hello", max_tokens=4,
                                                                 temperature=0)
               for p in (gguf_path, link)]
    assert replies[0] == replies[1]
    assert not cache.exists() or not any(cache.rglob("*"))
