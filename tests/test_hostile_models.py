"""Hostile model files end to end (issue 32): sizes that would allocate gigabytes before any
check, GGUF metadata of the wrong type, numbers no float holds, token ids beyond the embedding.
Each is refused through the CLI in one line (tests/helpers.assert_refused: no traceback, under
1 GB), and through the API as a ModelFormatError. The readers' own tests: test_config.py,
test_gguf.py, test_weights.py."""

from __future__ import annotations

import json
import shutil

import pytest

import tinyrt
from helpers import assert_refused, run_tinyrt, tiny_config, write_tiny_model
from tinyrt.errors import ModelFormatError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("hostile") / "tiny")


def _variant(tiny, tmp_path, config_text: str | None = None):
    """A copy of the tiny model, its config.json's text replaced if given."""
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    if config_text is not None:
        (d / "config.json").write_text(config_text)
    return d


# -- class 3 and 5 through the CLI: sizes before allocation, numbers no float holds ----------

@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 10**8}, ["claims 100000000 layers", "num_hidden_layers"]),
    ({"rope_theta": 10**400}, ["config.json", "rope_theta", "finite"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
     ["config.json", "rope_scaling.factor"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                       "high_freq_factor": 2.0, "original_max_position_embeddings": 64}},
     ["config.json", "high_freq_factor", "low_freq_factor"]),
])
def test_generate_refuses_a_hostile_config(tiny, tmp_path, change, words):
    d = _variant(tiny, tmp_path, json.dumps(tiny_config(**change)))
    assert_refused(run_tinyrt("generate", "-m", str(d), "hi", "-n", "2"), *words)


def test_convert_refuses_a_config_of_a_hundred_million_layers(tiny, tmp_path):
    """An HF source's config.json claiming 10^8 layers: refused before the converter builds
    its table of expected tensors."""
    d = _variant(tiny, tmp_path, json.dumps(tiny_config(num_hidden_layers=10**8)))
    assert_refused(run_tinyrt("convert", str(d), str(tmp_path / "out"), "--method", "rtn"),
                   "claims 100000000 layers")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("literal", ["NaN", "Infinity"])
def test_info_refuses_json_nan_and_infinity(tiny, tmp_path, literal):
    text = json.dumps(tiny_config(rms_norm_eps=12345)).replace("12345", literal)
    d = _variant(tiny, tmp_path, text)
    assert_refused(run_tinyrt("info", str(d)), "config.json", "rms_norm_eps", "finite")


# -- class 3 and 4 through the CLI: GGUF metadata ------------------------------------------------

def _gguf(tmp_path, changes=None, tensors=None):
    from gguf import GGUFValueType as V

    from test_gguf import hostile_gguf

    changes = {k: (v, V[t], sub and V[sub]) for k, (v, t, sub) in (changes or {}).items()}
    return hostile_gguf(tmp_path / "bad.gguf", changes, tensors)


def test_info_refuses_a_gguf_of_a_billion_layers(tmp_path):
    path = _gguf(tmp_path, {"llama.block_count": (10**9, "UINT32", None)})
    assert_refused(run_tinyrt("info", str(path)), "bad.gguf", "llama.block_count", "2 layers")


@pytest.mark.parametrize("changes, tensors, words", [
    ({"llama.attention.layer_norm_rms_epsilon": ("1e-5", "STRING", None)}, None,
     ["llama.attention.layer_norm_rms_epsilon", "not a number"]),
    ({"llama.attention.head_count_kv": ([2, 6], "ARRAY", "UINT32")}, None,
     ["llama.attention.head_count_kv", "differs between layers"]),
    ({"llama.rope.scaling.type": ("linear", "STRING", None)}, None,
     ["llama.rope.scaling.factor", "missing"]),
    (None, {"rope_freqs.weight": [1.0] * 5}, ["rope_freqs.weight", "[5]", "head_dim 16"]),
])
def test_convert_refuses_hostile_gguf_metadata(tmp_path, changes, tensors, words):
    import numpy as np

    tensors = {k: np.array(v, np.float32) for k, v in (tensors or {}).items()}
    path = _gguf(tmp_path, changes, tensors)
    out = tmp_path / "out"
    assert_refused(run_tinyrt("convert", str(path), str(out), "--method", "none"), "bad.gguf",
                   *words)
    assert not out.exists()


# -- class 6: token ids beyond the embedding's rows ------------------------------------------------

def _small_embedding(tiny, tmp_path):
    """The tiny model's tokenizer (ids up to 319) over a model of 260 embedding rows."""
    small = write_tiny_model(tmp_path / "small", tiny_config(vocab_size=260))
    shutil.copy(tiny / "tokenizer.json", small / "tokenizer.json")
    return small


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tiny, tmp_path):
    d = _small_embedding(tiny, tmp_path)
    with pytest.raises(ModelFormatError, match=r"tokenizer has token ids up to 319, but the "
                                               r"embedding has 260 rows"):
        tinyrt.load(d, device="reference", quiet=True)
    assert_refused(run_tinyrt("generate", "-m", str(d), "hi", "-n", "2"), "tokenizer", "260 rows")


def test_a_sparse_added_token_beyond_the_embedding_is_refused(tiny, tmp_path):
    """A tokenizer.json whose count of tokens (321) fits the embedding (400 rows), but one
    token's id (5000, in a vocabulary with a gap) does not: its largest id counts, not its
    size."""
    from tinyrt.tokenizer import load_tokenizer

    tok = json.loads((tiny / "tokenizer.json").read_text())
    tok["model"]["vocab"]["<|far|>"] = 5000
    tok["added_tokens"].append({"id": 5000, "content": "<|far|>", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False,
                                "special": True})
    small = write_tiny_model(tmp_path / "m", tiny_config(vocab_size=400))
    (small / "tokenizer.json").write_text(json.dumps(tok))
    tokenizer = load_tokenizer(small)
    assert tokenizer.vocab_size < 400 and 5000 in tokenizer.encode("hi <|far|>")
    with pytest.raises(ModelFormatError, match="token ids up to 5000, but the embedding has 400"):
        tinyrt.load(small, device="reference", quiet=True)


@pytest.mark.parametrize("where, change", [
    ("config.json", {"bos_token_id": 100000}),
    ("config.json", {"eos_token_id": [2, 320]}),
    ("config.json", {"pad_token_id": 320}),
    ("generation_config.json", {"eos_token_id": [2, 999]}),
])
def test_special_token_ids_beyond_the_embedding_are_refused(tiny, tmp_path, where, change):
    d = _variant(tiny, tmp_path)
    if where == "config.json":
        (d / where).write_text(json.dumps(tiny_config(**change)))
    else:
        (d / where).write_text(json.dumps(change))
    key = next(iter(change))
    with pytest.raises(ModelFormatError, match=rf"{where} {key} \d+ is beyond the embedding's "
                                               r"320 rows") as e:
        tinyrt.load(d, device="reference", quiet=True)
    assert "\n" not in str(e.value)


def test_ids_within_the_embedding_load(tiny, tmp_path):
    """The bar is the embedding's rows, not the tokenizer's count: negative ids ("none" in
    some configs) and ids up to vocab_size - 1 load."""
    d = _variant(tiny, tmp_path, json.dumps(tiny_config(eos_token_id=[2, 319], pad_token_id=-1)))
    llm = tinyrt.load(d, device="reference", quiet=True)
    assert 319 in llm.eos_ids
