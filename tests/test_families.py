"""Every model family of models.FAMILIES against transformers' own implementation: tiny random
models built by transformers from a config (Llama; Qwen2 with its q/k/v biases; Qwen3 with its
per-head q/k norms; SmolLM3 with a NoPE layer; tied and untied), their logits and greedy tokens on the CPU and reference devices, dense and sink caches,
float and 4-bit (4-bit against transformers running the dequantized weights)."""

import json

import numpy as np
import pytest

import tinyrt
from gguf_helpers import write_gguf
from helpers import (CHATML, byte_level_tokenizer, hf_logits, hf_model, rel_err, seeded_rng,
                     tiny_config)
from tinyrt.converters import convert
from tinyrt.kernels import reference
from tinyrt.models import FAMILIES, WeightStore

rng = seeded_rng(__name__)
SIZES = dict(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda tied: __import__("transformers").LlamaConfig(
        **SIZES, rope_theta=10000.0, tie_word_embeddings=tied),
    "qwen2": lambda tied: __import__("transformers").Qwen2Config(
        **SIZES, rope_theta=1000000.0, tie_word_embeddings=tied),
    # a head dim that is not hidden / heads (as Qwen3's 0.6B, 4B, 8B ... have)
    "qwen3": lambda tied: __import__("transformers").Qwen3Config(
        **SIZES, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=tied),
    # Phi-4-mini's kind: 3/4 of each head's dims rotated, longrope factors (short ones in these
    # tests' contexts, within the original 64 tokens) and its attention factor (sqrt(1.5) for
    # a context stretched 8 times), a sliding window shorter than the tests' sequences
    "phi3": lambda tied: __import__("transformers").Phi3Config(
        **SIZES, rope_theta=10000.0, tie_word_embeddings=tied, pad_token_id=0,
        partial_rotary_factor=0.75, original_max_position_embeddings=64, sliding_window=30,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0, 2.5, 3.0],
                      "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 8.0]}),
    # a sliding layer (window 12, RoPE base 10000) and a global one (base 1e6, linear scaling 2),
    # attention scaled by 24 ** -0.5 where the head dim is 32
    "gemma3_text": lambda tied: __import__("transformers").Gemma3TextConfig(
        **SIZES, head_dim=32, query_pre_attn_scalar=24, sliding_window=12, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=tied,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # four layers: the fourth is a NoPE layer (HF's default)
    "smollm3": lambda tied: __import__("transformers").SmolLM3Config(
        **{**SIZES, "num_hidden_layers": 4}, rope_theta=50000.0, tie_word_embeddings=tied,
        pad_token_id=0),
}
FAMILY_CASES = [("llama", False), ("qwen2", True), ("qwen2", False), ("qwen3", True),
                ("qwen3", False), ("smollm3", True), ("phi3", False), ("phi3", True),
                ("gemma3_text", True)]


def test_every_family_is_tested_here():
    assert set(CONFIGS) | {"mistral"} == set(FAMILIES)     # mistral: tests/test_model_tiny.py


def write_hf_model(directory, family: str, tied: bool, seed: int, **over):
    """A random model of `family` made and saved by transformers (its config's values `over`
    changed), with a byte-level tokenizer and the ChatML template (Qwen2's)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = CONFIGS[family](tied)
    for k, v in over.items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():            # transformers initializes biases to zero and norms to one
        for name, p in model.named_parameters():     # (Gemma's to zero): make them count
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p), alpha=0.2)
    model.save_pretrained(directory)
    byte_level_tokenizer(SIZES["vocab_size"]).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML,
        "tokenizer_class": "GPT2Tokenizer"}))       # (a byte-level BPE, as Phi-4-mini's)
    return directory


# AutoAWQ's GEMM packing, written from its documentation (docs/DESIGN.md), not from tinyrt's
# code: nibble i (bits 4i..4i+3) of word c of a row holds output channel 8c + AWQ_ORDER[i]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_dequantize(qweight, qzeros, scales, group: int) -> np.ndarray:
    """An AutoAWQ GEMM layer -> its float weight [out, in]: (q - z) * s per group of inputs."""
    def unpack(words):                           # int32 [rows, cols/8] -> [rows, cols]
        nibbles = (words.astype(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
        out = np.empty(nibbles.shape, np.int64)
        out[..., AWQ_ORDER] = nibbles
        return out.reshape(words.shape[0], -1)

    q, z = unpack(qweight), np.repeat(unpack(qzeros), group, axis=0)     # [in, out]
    return ((q - z) * np.repeat(scales.astype(np.float32), group, axis=0)).T.astype(np.float32)


def dequantized_oracle(quantized, directory):
    """transformers' model of a 4-bit model directory: its linears dequantized (awq_dequantize),
    and the head as the int8 rows every tinyrt backend runs a 4-bit model's head as (untied)."""
    import torch
    from safetensors.torch import save_file

    store = WeightStore(quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    group = cfg["quantization_config"]["group_size"]
    w = {}
    for name in store.keys():
        module, part = name.rsplit(".", 1)
        if part == "qweight":
            w[module + ".weight"] = awq_dequantize(*(store.get(f"{module}.{p}")
                                                     for p in ("qweight", "qzeros", "scales")), group)
        elif part not in ("qzeros", "scales"):
            w[name] = store.get_float(name).astype(np.float32)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    q, s = reference.int8_rows(head)
    w["lm_head.weight"] = q.astype(np.float32) * s[:, None]
    directory.mkdir()
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    del cfg["quantization_config"]
    (directory / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    return hf_model(directory)


@pytest.fixture(scope="module", params=FAMILY_CASES, ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}")
def family_models(request, tmp_path_factory):
    """(float directory, its transformers model, 4-bit directory, its dequantized oracle)."""
    family, tied = request.param
    tmp = tmp_path_factory.mktemp(f"{family}-{tied}")
    d = write_hf_model(tmp / "float", family, tied, seed=int(rng.integers(1 << 30)))
    q = convert(d, tmp / "q4", method="rtn", group_size=32)
    return d, hf_model(d), q, dequantized_oracle(q, tmp / "q4-float")


@pytest.mark.parametrize("bits", ["float", "4-bit"])
@pytest.mark.parametrize("policy", ["dense", "sink"])
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_logits_and_greedy_tokens_match_transformers(family_models, device, policy, bits):
    """A prompt's logits (a prompt pass), then decode steps one token at a time: every step's
    logits within 1e-4 of transformers' and the same greedy tokens (the sink cache holds the
    whole sequence: it differs from dense only once it evicts)."""
    d, hf, q, oracle = family_models
    directory, ref = (d, hf) if bits == "float" else (q, oracle)
    llm = tinyrt.LLM(directory, device=device, kv_policy=policy, kv_size=64, kv_type="f32")
    ids = rng.integers(3, SIZES["vocab_size"], 24)
    got = [llm.model.backend.to_numpy(llm.model.forward(ids, llm.cache, all_logits=True))]
    tokens = list(ids)
    for _ in range(16):          # greedy, from our logits; each step checked against theirs
        tokens.append(int(np.argmax(got[-1][-1])))
        got.append(llm.model.backend.to_numpy(llm.model.forward(tokens[-1:], llm.cache)))
    want = hf_logits(ref, tokens)
    assert rel_err(np.concatenate(got)[:-1], want[:-1]) < 1e-4
    assert tokens[len(ids):] == [int(t) for t in want[len(ids) - 1:-1].argmax(axis=1)]


@pytest.mark.parametrize("family", ["phi3", "gemma3_text"])
def test_awq_search_that_is_not_written_for_a_family_is_refused(tmp_path, family):
    """The AWQ search folds scales into separate q/k/v and Llama's norms: for Phi-3's fused
    projections and Gemma's norms it says so in one line, before any work; RTN converts them."""
    from tinyrt.errors import TinyrtError

    d = write_hf_model(tmp_path / "m", family, True, seed=int(rng.integers(1 << 30)))
    with pytest.raises(TinyrtError, match=f"--method awq: the AWQ search of {family} .* "
                                          "--method rtn converts them"):
        convert(d, tmp_path / "awq", method="awq")
    assert not (tmp_path / "awq").exists()
    q = convert(d, tmp_path / "rtn", method="rtn", group_size=32)
    assert tinyrt.LLM(q, device="reference").generate("hi", max_tokens=2, temperature=0) is not None


@pytest.mark.parametrize("layout", ["transformers 5", "published"])
def test_gemma3_vision_language_checkpoint_runs_its_text_part(tmp_path, layout):
    """A Gemma 3 vision-language checkpoint (model_type gemma3: a text_config, a vision tower
    and its projector beside the language model) runs its text part: logits of a text prompt
    within 1e-4 of transformers' Gemma3ForConditionalGeneration's, with its tensors named as
    transformers 5 saves them or as the published checkpoints have them."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(int(rng.integers(1 << 30)))
    text = CONFIGS["gemma3_text"](True)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=32, patch_size=16)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                       mm_tokens_per_image=4, image_token_index=SIZES["vocab_size"] - 1)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p), alpha=0.2)
    d = tmp_path / "mm"
    model.save_pretrained(d)
    if layout == "published":           # language_model.model.* (and language_model.lm_head)
        w = load_file(str(d / "model.safetensors"))
        w = {k.replace("model.language_model.", "language_model.model.")
              .replace("model.vision_tower.", "vision_tower."): v for k, v in w.items()}
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    byte_level_tokenizer(SIZES["vocab_size"]).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
    ids = rng.integers(3, SIZES["vocab_size"] - 1, 30)
    llm = tinyrt.LLM(d, device="cpu", kv_type="f32")
    assert llm.config.model_type == "gemma3_text" and llm.config.num_hidden_layers == 2
    got = llm.model.backend.to_numpy(llm.model.forward(ids, llm.cache, all_logits=True))
    assert rel_err(got, hf_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_phi3_longrope_past_the_original_context(tmp_path, device):
    """A pass whose positions reach past longrope's original context (64 tokens here) rotates
    by its long factors, as transformers chooses them per pass: a prompt of 90 tokens, then a
    decode step, against transformers on the whole sequence."""
    d = write_hf_model(tmp_path / "phi3", "phi3", False, seed=int(rng.integers(1 << 30)))
    llm = tinyrt.LLM(d, device=device, kv_size=128, kv_type="f32")
    ids = rng.integers(3, SIZES["vocab_size"], 91)
    got = llm.model.backend.to_numpy(llm.model.forward(ids[:90], llm.cache, all_logits=True))
    step = llm.model.backend.to_numpy(llm.model.forward(ids[90:], llm.cache))
    want = hf_logits(hf_model(d), ids)
    assert rel_err(np.concatenate([got, step]), want) < 1e-4


def test_greedy_text_matches_transformers_generate(family_models):
    """The text of a greedy reply through the whole engine (chat template, generation loop,
    detokenizer) is transformers' `generate` text."""
    import torch

    d, hf, _, _ = family_models
    llm = tinyrt.LLM(d, device="cpu", kv_type="f32")
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ids = llm.prompt_ids(messages)
    ours = llm.generate(messages, max_tokens=20, temperature=0, ignore_eos=True)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert ours == llm.tokenizer.decode(out[0, len(ids):].tolist())


def test_qwen2_gguf_runs_as_transformers(tmp_path):
    """A Qwen2 GGUF (its Q/K rows as llama.cpp writes them for qwen2: not permuted; biases)
    converts and runs as transformers runs the same weights."""
    from helpers import random_weights, write_tiny_model

    cfg = tiny_config(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6)
    d = write_tiny_model(tmp_path / "hf", cfg, seed=int(rng.integers(1 << 30)))
    weights = random_weights(cfg, seed=7)
    write_gguf(tmp_path / "m.gguf", cfg, weights, (d / "tokenizer.json").read_text(), arch="qwen2",
               chat_template=CHATML)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", method="none", dtype="f32")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    from safetensors.numpy import save_file

    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    ids = rng.integers(3, cfg["vocab_size"], 30)
    llm = tinyrt.LLM(out, device="reference", kv_type="f32")
    got = llm.model.forward(ids, llm.cache, all_logits=True)
    assert rel_err(got, hf_logits(hf_model(d), ids)) < 1e-5


# the pre-tokenizer name each family's real vocabulary has in llama.cpp (the tests' own tokenizer
# is written under it; the logits below are compared on token ids)
# llama.cpp's Gemma 3 knows no layer_types, local RoPE base or attention scale: it runs a
# global layer after each five sliding ones, base 10000, head_dim ** -0.5 (so must the model)
LLAMA_CPP_OVER = {"gemma3_text": dict(num_hidden_layers=6, query_pre_attn_scalar=32,
                                      layer_types=["sliding_attention"] * 5 + ["full_attention"])}
LLAMA_CPP_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "smollm3": "llama-bpe",
                 "phi3": "gpt-4o", "gemma3_text": "default"}


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("family", LLAMA_CPP_PRE)
def test_llama_cpp_s_own_gguf_runs_as_transformers(tmp_path, family, outtype):
    """The GGUF that llama.cpp's own converter (convert_hf_to_gguf.py) writes of a family's model,
    its metadata keys and tensor layout as llama.cpp has them (Q/K rows permuted or not), float32
    or Q8_0 by its own quantizer, gives transformers' logits on the cpu and reference devices:
    within 1e-4 from float32; from Q8_0 within 8-bit rounding, and the two devices alike."""
    from llama_cpp_files import convert_with_llama_cpp

    d = write_hf_model(tmp_path / "hf", family, False, seed=int(rng.integers(1 << 30)),
                       **LLAMA_CPP_OVER.get(family, {}))
    gguf = convert_with_llama_cpp(d, tmp_path / f"m-{outtype}.gguf", outtype,
                                  pre=LLAMA_CPP_PRE[family])
    ids = rng.integers(3, SIZES["vocab_size"], 40)
    want = hf_logits(hf_model(d), ids)
    got = {}
    for device in ("cpu", "reference"):
        llm = tinyrt.LLM(gguf, device=device, kv_type="f32")
        assert llm.model.config.model_type == family
        got[device] = llm.model.backend.to_numpy(llm.model.forward(ids, llm.cache,
                                                                   all_logits=True))
        # (Q8_0: up to 3.0e-2 seen over seeds, Gemma 3's six layers the most; a layout wrong
        # anywhere gives errors near 1)
        assert rel_err(got[device], want) < (1e-4 if outtype == "f32" else 6e-2), device
    # the cpu device's Q8_0 kernels round activations to int16 (docs/SPEED.md): 3.5e-5 to 4.2e-5
    # seen for Llama's four layers, 8.6e-5 to 1.1e-4 for Gemma 3's six with their output norms
    assert rel_err(got["cpu"], got["reference"]) < (1e-4 if outtype == "f32" else 3e-4)


# Qwen2.5-Instruct's chat template as its tokenizer_config.json ships it (tools, tool calls, a
# default system message); `- ` trims and loop variables that a toy template would not use
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by "
    "Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou "
    "may call one or more functions to assist with the user query.\\n\\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] "
    "== 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == "
    "\"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n        {%- endif %}\n        {%- for tool_call in "
    "message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set "
    "tool_call = tool_call.function %}\n            {%- endif %}\n            {{- '\\n<tool_call>\\n"
    "{\"name\": \"' }}\n            {{- tool_call.name }}\n            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or "
    "(messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
])
def test_qwen2_chat_template_renders_as_transformers(messages):
    """Qwen2.5's own template through tinyrt's sandbox gives transformers' text."""
    from transformers import PreTrainedTokenizerFast

    from tinyrt.chat_template import ChatTemplate

    hf = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(SIZES["vocab_size"]))
    want = hf.apply_chat_template(messages, chat_template=QWEN25_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    got = ChatTemplate(QWEN25_TEMPLATE).render(messages, add_generation_prompt=True)
    assert got == want
    assert ("You are Qwen" in got) == (messages[0]["role"] != "system")   # its default system turn
