import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_config
from tinyrt.errors import ModelFormatError
from tinyrt.models import ModelConfig
from tinyrt.models.rope import rope_inv_freq


def test_from_dict_drops_unknown_keys_and_fills_defaults():
    d = tiny_config(num_key_value_heads=None, some_future_key=[1, 2], initializer_range=0.02)
    cfg = ModelConfig.from_dict(d)
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    assert cfg.head_dim == 96 // 6
    assert cfg.n_rep == 1
    assert cfg.eos_token_ids == (2,)


def test_transformers5_rope_parameters():
    d = tiny_config()
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 5e5 and cfg.rope_type == "llama3"


def test_to_dict_round_trip():
    cfg = ModelConfig.from_dict(tiny_config(sliding_window=64, model_type="mistral"))
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize("change, words", [
    ({"num_key_value_heads": 4}, "multiple of num_key_value_heads"),
    ({"model_type": "gpt2"}, "unsupported architecture"),
    ({"hidden_act": "gelu"}, "activation"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be between 1"),
    ({"hidden_size": "96"}, "must be an integer"),
    ({"attention_bias": True}, "bias"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "unsupported quantization"),
])
def test_inconsistent_configs_are_clear_errors(change, words):
    with pytest.raises(ModelFormatError, match=words):
        ModelConfig.from_dict(tiny_config(**change))


def test_missing_required_key():
    d = tiny_config()
    del d["hidden_size"]
    with pytest.raises(ModelFormatError, match="hidden_size"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_frequencies_match_transformers(scaling):
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = tiny_config(rope_theta=500000.0, head_dim=32, rope_scaling=scaling)
    ours = rope_inv_freq(ModelConfig.from_dict(d))
    hf_cfg = HFConfig(**d)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        inv = 1.0 / (5e5 ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
    else:
        inv, _ = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    assert ours == pytest.approx(inv.double().numpy(), rel=1e-6)


# -- numbers out of range: each refused in one line naming the file and the field --------------

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("change, words", [
    ({"rope_theta": 10**400}, "rope_theta must be a finite number, got an integer of 1329 bits"),
    ({"rms_norm_eps": 10**400}, "rms_norm_eps must be a finite number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number, got nan"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be at least 1.17549e-38"),
    ({"rms_norm_eps": 1e-50}, "rms_norm_eps must be at least 1.17549e-38"),   # 0 in float32
    ({"rms_norm_eps": 5.0}, "rms_norm_eps must be at least 1.17549e-38 and below 1"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number"),
    ({"rope_theta": 0.5}, "rope_theta must be above 1"),
    ({"rope_theta": 1.3e54}, "rope_theta must be above 1 and below 1e+15, got 1.3e+54"),
    ({"rope_scaling": {**LLAMA3, "factor": 2e276}}, "rope_scaling.factor (llama3) must be at least 1 "
     "and below 1e+06"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 10**400}}, "rope_scaling.factor (linear)"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
     "rope_scaling.factor (linear) must be at least 1"),
    ({"rope_scaling": {"rope_type": "linear"}},
     "rope_scaling.factor (linear) must be a number, got None"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
     "rope_scaling.high_freq_factor (2) must be above low_freq_factor (2)"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 0}},
     "rope_scaling.low_freq_factor must be above 0"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": float("inf")}},
     "original_max_position_embeddings must be a finite number"),
    ({"num_hidden_layers": 10**8 * 10**8}, "num_hidden_layers must be between 1 and 2147483647"),
    ({"vocab_size": 2**31}, "vocab_size must be between 1 and 2147483647, got 2147483648"),
    ({"max_position_embeddings": 10**400}, "max_position_embeddings must be between 1 and "
                                          "2147483647, got an integer of 1329 bits"),
    ({"eos_token_id": [2, 10**30]}, "eos_token_id an integer of 100 bits is not a token id"),
    ({"sliding_window": 0, "model_type": "mistral"}, "sliding_window must be between 1"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": 5}},
     "rope_parameters must give an object for each kind of layer"),
    ({"model_type": "gemma3", "text_config": [1]}, "a gemma3 config needs a text_config object"),
    ({"model_type": "smollm3", "no_rope_layers": [1]}, "no_rope_layers must hold a 0 or 1 for "
     "each of the 2 layers"),
    ({"model_type": "smollm3", "no_rope_layers": [1, 2]}, "no_rope_layers must hold a 0 or 1"),
    ({"model_type": "smollm3", "no_rope_layers": "1,0"}, "no_rope_layers must be an integer or "
     "a list of integers"),
    ({"model_type": "smollm3", "no_rope_layer_interval": 0}, "no_rope_layer_interval must be "
     "between 1"),
    ({"model_type": "smollm3", "use_sliding_window": True}, "SmolLM3 with use_sliding_window is "
     "not supported"),
    ({"model_type": "phi3", "partial_rotary_factor": 0}, "partial_rotary_factor must be above 0"),
    ({"model_type": "phi3", "partial_rotary_factor": 1.5}, "partial_rotary_factor must be at most 1"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.1}, "rotates 1 of head_dim 16: not an even"),
    ({"model_type": "phi3", "original_max_position_embeddings": 64,
      "rope_scaling": {**LONGROPE, "short_factor": [1.0] * 7}},
     "rope_scaling.short_factor must be a list of 8 numbers"),
    ({"model_type": "phi3", "original_max_position_embeddings": 64,
      "rope_scaling": {**LONGROPE, "long_factor": [1.0] * 7 + [float("nan")]}},
     "rope_scaling.long_factor must be a finite number"),
    ({"model_type": "phi3", "rope_scaling": LONGROPE},
     "original_max_position_embeddings (longrope) must be a number, got None"),
    ({"model_type": "phi3", "original_max_position_embeddings": 1, "rope_scaling": LONGROPE},
     "original_max_position_embeddings (longrope) must be above 1"),
])
def test_numbers_out_of_range_are_refused(change, words):
    with pytest.raises(ModelFormatError) as e:
        ModelConfig.from_dict(tiny_config(**change))
    assert str(e.value).startswith("config.json: ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "1" + "0" * 400,
                                     "1" + "0" * 5000, "[" * 100_000 + "]" * 100_000])
def test_json_numbers_no_float_holds_are_refused_from_the_file(tmp_path, literal):
    """Python's json reads NaN and Infinity, 1e999 as inf, integers of any length (up to 4300
    digits; beyond, it raises ValueError), and nests until RecursionError: each ends as one line
    naming the file."""
    text = json.dumps(tiny_config(rms_norm_eps=12345)).replace("12345", literal)
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ModelFormatError) as e:
        ModelConfig.from_file(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg and len(msg) < 300, msg
    assert "rms_norm_eps" in msg or "not valid JSON" in msg, msg


# every numeric field, and the numbers of each rope scaling
INT_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
              "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id"]
FLOAT_FIELDS = ["rms_norm_eps", "rope_theta"]
SCALING_FIELDS = ["rope_scaling." + k for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")]
VALUES = st.one_of(
    st.integers(-2**70, 2**70), st.integers(-3, 70),
    st.sampled_from([0, -1, 1, 2, 2**31 - 1, 2**31, 2**63, 10**400, 10**4000]),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e-300, 1e-300),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e308, 5e-324]),
    st.booleans(), st.none(), st.text(max_size=4), st.lists(st.integers(-1, 400), max_size=3))


@settings(max_examples=300, deadline=None, derandomize=False)
@given(kind=st.sampled_from([None, "linear", "llama3"]),
       changes=st.dictionaries(st.sampled_from(INT_FIELDS + FLOAT_FIELDS + SCALING_FIELDS), VALUES,
                               min_size=1, max_size=3))
def test_any_numbers_give_a_sane_config_or_one_clear_error(kind, changes):
    """Whatever numbers config.json holds: ModelConfig refuses them in one line, or what it
    accepts is a config the model runs with: sizes and token ids within int32, finite and
    positive epsilon and theta, and RoPE frequencies that are finite and positive."""
    d = tiny_config(model_type="mistral")            # (its sliding_window is read)
    scaling = {None: None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": dict(LLAMA3)}
    d["rope_scaling"] = scaling[kind]
    for key, v in changes.items():
        if key.startswith("rope_scaling."):
            d["rope_scaling"] = {**(d["rope_scaling"] or LLAMA3), key.split(".", 1)[1]: v}
        else:
            d[key] = v
    try:
        cfg = ModelConfig.from_dict(d)
    except ModelFormatError as e:
        msg = str(e)
        assert msg.startswith("config.json: ") and "\n" not in msg and len(msg) < 300, msg
        return
    for name in INT_FIELDS:
        for v in (cfg.eos_token_ids if name == "eos_token_id" else [getattr(cfg, name)]):
            assert v is None or (type(v) is int and -2**31 <= v < 2**31), (name, v)
    for name in INT_FIELDS[:9]:                     # the sizes
        assert getattr(cfg, name) is None or getattr(cfg, name) >= 1, name
    assert 0 < cfg.rms_norm_eps < 1 and math.isfinite(cfg.rope_theta) and cfg.rope_theta > 1
    # the frequencies at a small head_dim (a head_dim of 2^30 is a config the weights refuse)
    inv = rope_inv_freq(dataclasses.replace(cfg, head_dim=16))
    assert inv.shape == (8,) and np.isfinite(inv).all() and (inv > 0).all(), (cfg.rope_scaling, inv)
