"""GGUF files: tiny files written like llama.cpp's converter, read back through our converter and
compared with the source weights and with transformers loading the same file."""

import numpy as np
import pytest

from gguf_helpers import permute, write_gguf
from helpers import CHATML, byte_level_tokenizer, hf_logits, random_weights, rel_err, tiny_config
from tinyrt.converters import convert
from tinyrt.converters.gguf_file import unpermute
from tinyrt.errors import ModelFormatError
from tinyrt.kernels import get_backend
from tinyrt.kv_cache import CacheOptions, make_cache
from tinyrt.models import WeightStore, load_model


@pytest.mark.parametrize("heads, rows_per_head, cols", [(1, 8, 3), (4, 16, 5), (3, 64, 2)])
def test_unpermute_inverts_llamacpp_permute(heads, rows_per_head, cols):
    w = np.random.default_rng().standard_normal((heads * rows_per_head, cols))
    p = permute(w, heads)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute(p, heads), w)


def _tiny_gguf(tmp_path, cfg, qtype, **kw):
    tok = byte_level_tokenizer(cfg["vocab_size"])
    weights = random_weights(cfg, seed=7)
    path = tmp_path / f"tiny-{qtype}.gguf"
    back = write_gguf(path, cfg, weights, tok.to_str(), qtype=qtype, chat_template=CHATML,
                      kquant_rng=np.random.default_rng(1), **kw)
    return path, weights, back


def _ours_logits(directory, ids):
    m = load_model(directory, get_backend("reference"))
    cache = make_cache(CacheOptions(kv_size=64, kv_type="f32"), m)   # float32: vs transformers
    return m.forward(ids, cache, all_logits=True)


def _hf_gguf_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                             dtype=torch.float32).eval()
    return hf_logits(m, ids)


def test_f32_gguf_gives_back_the_source_weights(tmp_path):
    cfg = tiny_config()
    path, weights, _ = _tiny_gguf(tmp_path, cfg, "F32")
    out = convert(path, tmp_path / "out", method="none", dtype="f32")
    store = WeightStore(out)
    assert set(store.keys()) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(store.get(name), w)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_quantized_gguf_matches_transformers(tmp_path, qtype):
    kquant = qtype.endswith("_K")  # blocks of 256: rows of 256 and more
    cfg = (tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2) if kquant else tiny_config())
    path, _, back = _tiny_gguf(tmp_path, cfg, qtype)
    out = convert(path, tmp_path / "out", method="none", dtype="f32")
    store = WeightStore(out)
    for name, w in back.items():
        np.testing.assert_allclose(store.get(name), w, rtol=0, atol=1e-6)
    ids = np.random.default_rng().integers(0, cfg["vocab_size"], 24)
    # random K-quant blocks make large activations: float32 rounding shows a little more
    assert rel_err(_ours_logits(out, ids), _hf_gguf_logits(path, ids)) < (1e-4 if kquant else 1e-5)


def test_gguf_tokenizer_equals_its_source(tmp_path):
    from tinyrt.tokenizer import load_tokenizer
    from helpers import CORPUS

    cfg = tiny_config()
    path, _, _ = _tiny_gguf(tmp_path, cfg, "F32")
    out = convert(path, tmp_path / "out", method="none", dtype="f16")
    ours = load_tokenizer(out)
    src = byte_level_tokenizer(cfg["vocab_size"])
    for text in [CORPUS, "<|im_start|>user\nhi 123<|im_end|>", "  two  spaces\n\n\tand tabs"]:
        assert ours.encode(text) == src.encode(text).ids
    assert ours.eos_token == "<|im_end|>" and ours.bos_id == 1
    assert "im_start" in ours.config["chat_template"]


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        convert(p, tmp_path / "out", method="none")
    assert not (tmp_path / "out").exists()


def test_truncated_gguf(tmp_path):
    path, _, _ = _tiny_gguf(tmp_path, tiny_config(), "Q8_0")
    data = path.read_bytes()
    for cut in (len(data) // 2, 200, 30):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="truncated|damaged|not a readable"):
            convert(bad, tmp_path / f"out{cut}", method="none")
        assert not (tmp_path / f"out{cut}").exists()


def test_unsupported_architecture(tmp_path):
    import gguf

    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFormatError, match="unsupported architecture 'gpt2'"):
        convert(p, tmp_path / "out", method="none")


def test_unknown_pre_tokenizer(tmp_path):
    path, _, _ = _tiny_gguf(tmp_path, tiny_config(), "F32", pre="no-such-pre")
    with pytest.raises(ModelFormatError, match="pre-tokenizer 'no-such-pre'"):
        convert(path, tmp_path / "out", method="none")
    assert not (tmp_path / "out").exists()
