"""Hostile tensors end to end (issue 46, classes 5 and 6): tensors stored in a type their part
cannot be (AutoAWQ codes as F16, scales as U8, an integer weight, a GGUF tensor of an integer
type) are refused at open, before any is viewed as its type; NaN or inf in weights or scales
(AWQ, GGUF Q8_0 / Q4_K blocks, float tensors) is refused at load, naming the tensor; and logits
that no token can come from (a model whose finite weights overflow) end a reply in one line,
greedy or sampled, through the command line, the library and the server, never an IndexError.
Each through tests/helpers.assert_refused (one line, no traceback) where the CLI reads it."""

from __future__ import annotations

import json
import shutil
from unittest import mock

import numpy as np
import pytest

import tinyrt
from gguf_helpers import write_gguf
from helpers import (CHATML, assert_refused, byte_level_tokenizer, random_weights, run_tinyrt,
                     tiny_config, write_tiny_model)
from test_awq import _autoawq_checkpoint
from tinyrt.errors import ModelFormatError, TinyrtError
from tinyrt.sampling import Sampler, SamplingParams, filtered_probs

LAYER = "model.layers.0.mlp.up_proj"       # the AWQ layer made hostile
AWQ_CFG = tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=4)


def _generate(path, *more):
    return run_tinyrt("generate", "-m", str(path), "hi", "-n", "3", "--device", "reference",
                      *more)


def _load(path):
    return tinyrt.load(path, device="reference", quiet=True)


# -- AutoAWQ checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    """An AutoAWQ GEMM checkpoint (sharded), with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("awq")
    _autoawq_checkpoint(root / "awq", AWQ_CFG, g=32)
    float_dir = write_tiny_model(root / "float", AWQ_CFG)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(float_dir / f, root / "awq" / f)
    return root / "awq"


def _awq_variant(awq, tmp_path, part: str, change):
    """A copy of the checkpoint with LAYER's `part` replaced by change(its array)."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(awq, d)
    name = f"{LAYER}.{part}"
    shard = d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return d


def _nan_at(a, value=np.nan):
    a = a.copy()
    a.reshape(-1)[5] = value
    return a


@pytest.mark.parametrize("part, change, stored", [
    ("qweight", lambda a: a.view(np.float16)[:, ::2].copy(), "F16 [128, 32]"),
    ("qweight", lambda a: a.astype(np.int64), "I64 [128, 32]"),
    ("qweight", lambda a: (a & 0xFF).astype(np.uint8), "U8 [128, 32]"),
    ("qzeros", lambda a: (a & 0xFF).astype(np.float16), "F16 [4, 32]"),
    ("scales", lambda a: (a * 1000).astype(np.uint8), "U8 [4, 256]"),
    ("scales", lambda a: a.astype(np.float64), "F64 [4, 256]"),
])
def test_autoawq_tensors_of_the_wrong_type_are_refused(awq, tmp_path, part, change, stored):
    """Each was a reshape traceback (codes) or loaded and produced text (U8 scales)."""
    d = _awq_variant(awq, tmp_path, part, change)
    name = f"{LAYER}.{part}"
    line = assert_refused(_generate(d), name, stored, "expected")
    assert ("I32 or U32" if part != "scales" else "F16, BF16 or F32") in line
    with pytest.raises(ModelFormatError, match=rf"{name}' is {stored.split()[0]}"):
        _load(d)


def test_autoawq_codes_as_words_of_the_same_bits_load_as_int64_ones_do_not(awq, tmp_path):
    """The line the check draws: codes as U32 words (the same bits) and float32 scales (the
    same values) give the checkpoint's own logits; I64 codes (the same numbers, other bits)
    are refused."""
    from safetensors.numpy import load_file, save_file

    d = _awq_variant(awq, tmp_path, "qweight", lambda a: a.view(np.uint32))
    for f in d.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: v.astype(np.float32) if k.endswith(".scales") else v for k, v in t.items()},
                  str(f), metadata={"format": "pt"})
    ids = np.arange(3, 40)
    want, got = _load(awq), _load(d)
    np.testing.assert_array_equal(got.model.forward(ids, got.cache, all_logits=True),
                                  want.model.forward(ids, want.cache, all_logits=True))
    shutil.rmtree(d)
    d = _awq_variant(awq, tmp_path, "qweight", lambda a: a.view(np.uint32).astype(np.int64))
    with pytest.raises(ModelFormatError, match=r"qweight' is I64 \[128, 32\], expected I32 or U32"):
        _load(d)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_autoawq_scales_of_nan_or_inf_are_refused_at_load(awq, tmp_path, value):
    """Was an IndexError in the sampler at temperature > 0 (and token 0 forever, greedy)."""
    d = _awq_variant(awq, tmp_path, "scales", lambda a: _nan_at(a, value))
    assert_refused(_generate(d, "--temperature", "0.8"), f"{LAYER}.scales",
                   "NaN or infinite scales", "broken")
    with pytest.raises(ModelFormatError, match="NaN or infinite scales"):
        _load(d)


# -- float checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("name, change, stored", [
    ("model.layers.1.mlp.down_proj.weight", lambda a: (a * 100).astype(np.int32), "I32 [96, 160]"),
    ("model.norm.weight", lambda a: a.astype(np.uint8), "U8 [96]"),
    ("lm_head.weight", lambda a: a > 0, "BOOL [320, 96]"),
])
def test_float_weights_of_an_integer_type_are_refused(tmp_path, name, change, stored):
    """Were cast to float32 and run (or converted) as if they were weights."""
    w = random_weights(tiny_config())
    w[name] = change(w[name])
    d = write_tiny_model(tmp_path / "m", weights=w)
    assert_refused(_generate(d), name, stored, "expected F32, F16, BF16 or F64")
    # a conversion reads the source's tensors through the same check
    out = tmp_path / "out"
    assert_refused(run_tinyrt("convert", str(d), str(out), "--method", "rtn"), name, stored)
    assert not out.exists()


@pytest.mark.parametrize("name, value", [
    ("model.layers.1.self_attn.o_proj.weight", np.inf),
    ("model.layers.0.input_layernorm.weight", np.nan),
    ("model.embed_tokens.weight", -np.inf),
    ("lm_head.weight", np.nan),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_weights_of_nan_or_inf_are_refused_at_load(tmp_path, name, value, dtype):
    w = random_weights(tiny_config(), dtype=dtype)
    w[name] = _nan_at(w[name], value)
    d = write_tiny_model(tmp_path / "m", weights=w)
    with pytest.raises(ModelFormatError, match=rf"tensor '{name}' holds NaN or infinite values"):
        _load(d)


def test_a_float_weight_of_nan_is_refused_through_the_cli(tmp_path):
    w = random_weights(tiny_config())
    w["lm_head.weight"] = _nan_at(w["lm_head.weight"])
    d = write_tiny_model(tmp_path / "m", weights=w)
    assert_refused(_generate(d, "--temperature", "0.8"), "lm_head.weight", "NaN or infinite")


@pytest.mark.parametrize("method", ["none", "rtn", "awq"])
def test_a_conversion_writes_no_nan_and_says_so_in_one_line(tmp_path, method):
    """A source of NaN (quantized, it turned into finite nonsense) or of values whose quantized
    scales overflow float16: refused in one line (no progress bar's blank line, no NumPy
    warning), nothing written."""
    w = random_weights(tiny_config())
    w["model.layers.0.self_attn.q_proj.weight"] = _nan_at(w["model.layers.0.self_attn.q_proj.weight"])
    nan = write_tiny_model(tmp_path / "nan", weights=w)
    w = random_weights(tiny_config())
    w["model.layers.0.mlp.down_proj.weight"] *= np.float32(1e36)
    big = write_tiny_model(tmp_path / "big", weights=w)
    calib = ("--calib-samples", "2", "--calib-seqlen", "32") if method == "awq" else ()
    cases = [(nan, "NaN or infinite")] + ([(big, "NaN or infinite")] if method != "none" else [])
    for src, words in cases:
        out = tmp_path / f"out-{src.name}"
        assert_refused(run_tinyrt("convert", str(src), str(out), "--method", method, *calib,
                                  timeout=120), words)
        assert not out.exists()


# -- GGUF files ------------------------------------------------------------------------------------

K_CFG = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2)


def _gguf(tmp_path, changes: dict, qtype: str = "F32", cfg: dict | None = None):
    """A tiny llama GGUF (untied head) of `qtype`, the tensors named in `changes` (GGUF name ->
    change(stored array, its type) -> (array, type or None: the array's own)) replaced."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, **kw):
            if name in changes:
                tensor, raw_dtype = changes[name](tensor, raw_dtype)
            super().add_tensor(name, tensor, raw_shape=raw_shape, raw_dtype=raw_dtype, **kw)

    cfg = cfg or tiny_config()
    path = tmp_path / "bad.gguf"
    with mock.patch.object(gguf, "GGUFWriter", Writer):
        write_gguf(path, cfg, random_weights(cfg, seed=7),
                   byte_level_tokenizer(cfg["vocab_size"]).to_str(), qtype=qtype,
                   chat_template=CHATML, kquant_rng=np.random.default_rng(1))
    return path


def _block_half(at: int, value):
    """A change setting the float16 at byte `at` of the first block to `value`."""
    def change(raw, kind):
        raw = raw.copy()
        raw[0, at:at + 2] = np.array([value], np.float16).view(np.uint8)
        return raw, kind
    return change


def _retype(dtype):
    return lambda a, kind: (a.astype(dtype), None)


@pytest.mark.parametrize("name, dtype, stored", [
    ("blk.0.ffn_up.weight", np.int32, "I32 [160, 96]"),
    ("blk.1.attn_norm.weight", np.int8, "I8 [96]"),
    ("output.weight", np.float64, "F64 [320, 96]"),
])
def test_gguf_tensors_of_an_unreadable_type_are_refused_at_open(tmp_path, name, dtype, stored):
    """Were refused (or crashed) only once a load reached them; now at open, `info` too."""
    path = _gguf(tmp_path, {name: _retype(dtype)})
    for cmd in (["info", str(path)], ["generate", "-m", str(path), "hi", "-n", "2"]):
        assert_refused(run_tinyrt(*cmd), "bad.gguf", name, stored, "expected a float or "
                       "quantized type")


@pytest.mark.parametrize("qtype, name, at, value", [
    ("Q8_0", "output.weight", 0, np.nan),                # d
    ("Q8_0", "output.weight", 0, np.inf),
    ("Q8_0", "blk.1.ffn_down.weight", 0, -np.inf),
    ("Q8_0", "token_embd.weight", 0, np.nan),            # (untied: read as rows)
    ("Q4_K", "output.weight", 0, np.nan),                # d
    ("Q4_K", "output.weight", 2, np.inf),                # dmin
    ("Q4_K", "token_embd.weight", 2, np.nan),
    ("F32", "output_norm.weight", None, np.nan),
])
def test_gguf_blocks_of_nan_or_inf_are_refused_at_load(tmp_path, qtype, name, at, value):
    """NaN / inf in a Q4_K or Q8_0 output.weight's scales was an IndexError in the sampler."""
    if at is None:
        change = lambda a, kind: (_nan_at(a, value), kind)             # noqa: E731
    else:
        change = _block_half(at, value)
    path = _gguf(tmp_path, {name: change}, qtype, K_CFG if qtype == "Q4_K" else None)
    assert_refused(run_tinyrt("generate", "-m", str(path), "hi", "-n", "2", "--temperature",
                              "0.8"), "bad.gguf", name, "NaN or infinite", "broken")
    with pytest.raises(ModelFormatError, match=rf"{name} \(.*\)' holds NaN or infinite"):
        _load(path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_heads_load_finite_and_are_refused_nan(tmp_path, qtype):
    """The line the check draws: the file loads and generates; one block's NaN scale in its
    head, and it is refused."""
    cfg = K_CFG if qtype == "Q4_K" else None
    assert _load(_gguf(tmp_path, {}, qtype, cfg)).generate("hi", max_tokens=2, temperature=0.8)
    path = _gguf(tmp_path, {"output.weight": _block_half(0, np.nan)}, qtype, cfg)
    with pytest.raises(ModelFormatError, match="output.weight .*NaN or infinite"):
        _load(path)


# -- logits no token can come from: the sampler --------------------------------------------------

@pytest.mark.parametrize("logits, kind", [
    ([0.5, np.nan, 1.0], "NaN logits"),
    ([np.nan] * 3, "NaN logits"),
    ([0.5, np.inf, 1.0], "infinite logits"),
    ([-np.inf] * 3, "logits that are all -inf"),
])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_sampler_refuses_logits_no_token_can_come_from(logits, kind, temperature):
    """Was an IndexError (temperature > 0) or token 0 (greedy, NaN's argmax)."""
    x = np.array(logits * 100, np.float32)
    for top_p, min_p in ((0.95, 0.05), (1.0, 0.0)):
        s = Sampler(SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, seed=1))
        for call in (lambda: s(x, [1, 2]), lambda: s.distribution(x)):
            with pytest.raises(TinyrtError, match=f"the model produced {kind}: its weights are "
                                                  "broken"):
                call()
    with pytest.raises(TinyrtError, match=kind):
        filtered_probs(x, SamplingParams(temperature=0.8))
    # where the line lies: masked tokens (-inf) beside finite logits are a distribution
    x = np.array([-np.inf, 0.0, 1.0, -np.inf], np.float32)
    s = Sampler(SamplingParams(temperature=temperature or 1.0, top_k=0, top_p=1.0, min_p=0.0,
                               seed=3))
    assert {s(x) for _ in range(50)} <= {1, 2}
    assert Sampler(SamplingParams(temperature=0))(x) == 2


def test_a_repeat_penalty_that_overflows_is_refused_not_drawn():
    """A finite logit taken to inf by the penalty (divided by 0.01) would make NaN after
    the subtraction of the largest."""
    x = np.array([3e37, 1.0, 2.0], np.float32)
    s = Sampler(SamplingParams(temperature=0.8, repeat_penalty=0.01, seed=0))
    with pytest.raises(TinyrtError, match="infinite logits"):
        s(x, [0])


# -- a model whose finite weights overflow: end to end --------------------------------------------

@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """Finite weights (they load) whose logits overflow float32: an LM head of +-1e38."""
    w = random_weights(tiny_config())
    w["lm_head.weight"] = (np.sign(w["lm_head.weight"]) * 1e38).astype(np.float32)
    return write_tiny_model(tmp_path_factory.mktemp("overflow") / "m", weights=w)


@pytest.mark.parametrize("temperature, device", [("0", "reference"), ("0.8", "reference"),
                                                 ("0.8", "cpu")])
def test_non_finite_logits_end_a_reply_in_one_line(overflowing, temperature, device):
    assert_refused(run_tinyrt("generate", "-m", str(overflowing), "hi", "-n", "3", "--device",
                              device, "--temperature", temperature),
                   "the model produced", "logits", "broken")
    llm = _load(overflowing)
    with pytest.raises(TinyrtError, match="the model produced (NaN|infinite) logits"):
        llm.generate("hi", max_tokens=3, temperature=float(temperature))


def test_non_finite_logits_through_the_server(overflowing):
    """An OpenAI error object (whole and streamed), not a 500, and the server serves on."""
    import openai

    from test_server import Running

    run = Running(tinyrt.LLM(overflowing, device="reference", kv_size=256, kv_type="f32"))
    try:
        messages = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                r = run.client.chat.completions.create(model="tiny", messages=messages,
                                                       max_tokens=3, temperature=0.8,
                                                       stream=stream)
                if stream:
                    list(r)
            assert e.value.status_code < 500, e.value
            assert "the model produced" in e.value.message and "broken" in e.value.message
            body = e.value.body if isinstance(e.value.body, dict) else {}
            assert body.get("message", "").startswith("the model produced"), e.value.body
        assert run.health()["status"] == "ok"
    finally:
        run.stop()


@pytest.fixture(scope="module")
def exploding(tmp_path_factory):
    """Finite weights (they load) whose activations overflow inside the layers (norms of 1e30):
    the CPU kernels' norm divided by a zero (or NaN) sum of squares."""
    w = random_weights(tiny_config())
    for name in w:
        if name.endswith("norm.weight"):
            w[name] = (w[name] * 1e30).astype(np.float32)
    return write_tiny_model(tmp_path_factory.mktemp("exploding") / "m", weights=w)


def test_activations_that_overflow_end_a_reply_in_one_line(exploding):
    """On the CPU kernels (fused layers, and a prompt's GEMMs) as on the reference: one line
    naming the broken model, never a ZeroDivisionError from a kernel."""
    for device in ("cpu", "reference"):
        for prompt in ("hi", "a longer prompt " * 6):
            assert_refused(run_tinyrt("generate", "-m", str(exploding), prompt, "-n", "3",
                                      "--device", device), "the model produced", "broken")


def test_perplexity_of_a_broken_or_far_off_model(overflowing, tmp_path):
    """NaN or inf logits: ppl refuses in one line (not `ppl nan`, exit 0, with NumPy's warnings);
    finite logits far apart (a head of +-1e3): a perplexity past the largest float is inf, not
    an OverflowError."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    assert_refused(run_tinyrt("ppl", "-m", str(overflowing), "--text", str(text), "--ctx", "64",
                              "--max-windows", "1"), "the model produced")
    w = random_weights(tiny_config())
    w["lm_head.weight"] = (np.sign(w["lm_head.weight"]) * 1e3).astype(np.float32)
    far = write_tiny_model(tmp_path / "far", weights=w)
    p = run_tinyrt("ppl", "-m", str(far), "--text", str(text), "--ctx", "64", "--max-windows", "1")
    assert p.returncode == 0 and "inf" in p.stdout and not p.stderr.strip(), p.stderr


@pytest.mark.parametrize("meta", [
    {"model": "gpt2", "tokens": [1, 2, 3], "merges": [], "token_type": [1, 1, 1]},
    {"model": "gpt2", "tokens": ["a", "b", "c"], "merges": ["abc", "", " ", "a b c"],
     "token_type": [1, 1, 1]},
])
def test_a_gguf_tokenizer_the_library_refuses_is_one_line(meta):
    """The tokenizers library's refusal runs over several lines: the error is one."""
    from tinyrt.gguf_tokenizer import build_tokenizer

    with pytest.raises(ModelFormatError, match="tokenizer is unusable") as e:
        build_tokenizer(meta)
    assert "\n" not in str(e.value)


def test_the_library_refuses_arguments_of_the_wrong_kind(tmp_path):
    """cache= that is no CacheOptions (a bare StopIteration), a ChatSession of no model (an
    AttributeError deep inside)."""
    d = write_tiny_model(tmp_path / "m")
    for cache in ("x", 1):
        with pytest.raises(TinyrtError, match="CacheOptions"):
            tinyrt.load(str(d), cache=cache)
    for llm in (None, "x"):
        with pytest.raises(TypeError, match="ChatSession takes a model"):
            tinyrt.ChatSession(llm)
