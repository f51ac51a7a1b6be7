"""`tinyrt bench`'s figures on a tiny model: what it counts per decoded token."""

import pytest

import tinyrt
from helpers import tiny_config, write_tiny_model
from tinyrt import bench


@pytest.mark.parametrize("kv_type, itemsize", [("f16", 2), ("f32", 4)])
def test_bench_counts_weights_and_kv_cache(tmp_path, kv_type, itemsize):
    cfg = tiny_config()
    llm = tinyrt.LLM(write_tiny_model(tmp_path / "m", cfg), kv_size=32, kv_type=kv_type)
    r = bench.run(llm, prompt_tokens=16, decode_tokens=4, runs=1)
    c = llm.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize * (16 + 4 / 2)
    assert r["kv_mb_per_token"] == pytest.approx(kv / 1e6)
    assert r["weight_mb_per_token"] == pytest.approx(bench.weight_bytes(llm.model) / 1e6)
    step = 1 / r["decode_tok_s"]
    assert r["decode_gb_s"] == pytest.approx((r["weight_mb_per_token"] + r["kv_mb_per_token"]) / 1e3 / step)
    assert r["ttft_s"] > 0 and r["prefill_tok_s"] == pytest.approx(16 / r["ttft_s"])
    with pytest.raises(ValueError, match="exceed the KV cache"):
        bench.run(llm, prompt_tokens=30, decode_tokens=4, runs=1)
