"""The real default model, run from its GGUF on its quantized kernels (as users get it) and on the
float path (dtype f32 / f16), against HF transformers loading the same GGUF (dequantized)."""

import numpy as np
import pytest

import tinyrt
from helpers import hf_logits, rel_err

pytestmark = [pytest.mark.real_model, pytest.mark.oracle]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits.",
    "Translate 'good morning' into Spanish.",
    "Count to five.",
]


@pytest.fixture(scope="module")
def llm32(smol):
    """The float path at full precision: float32 weights and KV cache."""
    return tinyrt.LLM(smol, dtype="f32", kv_type="f32")


@pytest.fixture(scope="module")
def llm16(smol):
    """The float path on float16 weights."""
    return tinyrt.LLM(smol, dtype="f16")


@pytest.fixture(scope="module")
def llm4(smol):
    """As users get it: the file's Q4_1 layers and Q8_0 head on the quantized kernels."""
    return tinyrt.LLM(smol)


def _greedy(llm, prompt, n=64):
    return [r.token for r in llm.stream(prompt, max_tokens=n, temperature=0) if r.token is not None]


def _hf_greedy(model, ids, eos_ids, n=64):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0])
    toks = out[0][len(ids):].tolist()
    return [t for t in toks if t not in eos_ids]


def _logits_256(llm, long_text):
    ids = llm.tokenizer.encode(long_text[:4000])[:256]
    assert len(ids) == 256
    llm.cache.reset()
    return ids, llm.model.forward(ids, llm.cache, all_logits=True)


def test_logits_agree_with_transformers_over_256_tokens(llm32, hf_gguf_model, long_text):
    ids, ours = _logits_256(llm32, long_text)
    want = hf_logits(hf_gguf_model, ids)
    err = rel_err(ours, want)
    print(f"\nlogits relative error (Frobenius) over 256 tokens: {err:.2e}; "
          f"max abs {np.abs(ours - want).max():.2e}")
    assert err <= 1e-3
    assert np.abs(ours - want).max() <= 1e-3 * np.abs(want).max()
    assert (ours.argmax(-1) == want.argmax(-1)).all()


def test_float16_kv_cache_error(smol, hf_gguf_model, long_text):
    """The default float16 KV cache: the logits' error it adds over 256 tokens stays small."""
    ids, ours = _logits_256(tinyrt.LLM(smol, dtype="f32"), long_text)
    want = hf_logits(hf_gguf_model, ids)
    err = rel_err(ours, want)
    agree = (ours.argmax(-1) == want.argmax(-1)).mean()
    print(f"\nfloat16 KV: logits relative error {err:.2e}; top-1 agreement {agree:.4f}")
    assert err <= 1e-3 and agree >= 0.99


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_64_tokens_identical_f32_and_f16(llm32, llm16, hf_gguf_model, prompt):
    ids = llm32.prompt_ids(prompt)
    want = _hf_greedy(hf_gguf_model, ids, llm32.eos_ids)
    assert _greedy(llm32, prompt) == want
    assert _greedy(llm16, prompt) == want


def test_quantized_kernels_agree_with_transformers(llm4, hf_gguf_model, long_text):
    """The file's own 4- and 8-bit codes on the kernels (activations rounded to int16 per block,
    a float16 KV cache) against transformers' float32 model of the same weights."""
    assert llm4.model.layers[0].qkv.bits == 4 and llm4.model.lm_head.bits == 8
    ids, ours = _logits_256(llm4, long_text)
    want = hf_logits(hf_gguf_model, ids)
    err, agree = rel_err(ours, want), (ours.argmax(-1) == want.argmax(-1)).mean()
    print(f"\n4-bit kernels: logits relative error {err:.2e}; top-1 agreement {agree:.4f}")
    assert err <= 2e-3 and agree >= 0.99


def test_golden_answer(llm4, llm16):
    assert llm4.generate("What is the capital of France?", temperature=0) == \
        "The capital of France is Paris."
    assert llm16.generate("What is the capital of France?", temperature=0) == \
        "The capital of France is Paris."
