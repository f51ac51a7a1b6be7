import json

import pytest

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
    ({"num_hidden_layers": 0}, "must be positive"),
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
