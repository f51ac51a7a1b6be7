"""AWQ: the packed layout, group quantization, the algorithm on tiny models, AutoAWQ checkpoints."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from helpers import (CORPUS, hf_logits, hf_model, random_weights, rel_err, seeded_rng, tiny_config,
                     write_tiny_model)
from tinyrt.converters import convert
from tinyrt.converters.awq import (QuantOptions, awq_layer, layer_forward, linear_mse, output_mse,
                                   search_scales)
from tinyrt.converters.quantize import dequantize, fake_quantize, pack_linear, quantize
from tinyrt.errors import ModelFormatError, TinyrtError
from tinyrt.kernels import awq_layout, get_backend, quant
from tinyrt.kernels.reference import int8_rows
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models.config import ModelConfig
from tinyrt.models import WeightStore, linear_shapes, load_model

DESIGN_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # docs/DESIGN.md: nibble order of the AutoAWQ GEMM layout


def read_code(packed: np.ndarray, row: int, col: int) -> int:
    """The 4-bit value at [row, col] of a packed tensor, by docs/DESIGN.md's definition: word col // 8 of
    the row; the nibble at shift 4*j holds column 8*(col // 8) + ORDER[j]."""
    word = int(packed[row, col // 8]) & 0xFFFFFFFF
    j = DESIGN_ORDER.index(col % 8)
    return (word >> (4 * j)) & 0xF


def write_by_definition(codes: np.ndarray) -> np.ndarray:
    """Pack [rows, cols] codes by the definition, one nibble at a time (no shared code)."""
    rows, cols = codes.shape
    out = np.zeros((rows, cols // 8), np.uint32)
    for r in range(rows):
        for c in range(cols):
            out[r, c // 8] |= np.uint32(int(codes[r, c]) << (4 * DESIGN_ORDER.index(c % 8)))
    return out.view(np.int32)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_pack_unpack_round_trip(rows, words, data):
    codes = data.draw(arrays(np.uint8, (rows, words * 8), elements=st.integers(0, 15)))
    packed = awq_layout.pack(codes)
    assert packed.dtype == np.int32 and packed.shape == (rows, words)
    np.testing.assert_array_equal(awq_layout.unpack(packed), codes)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_packed_codes_are_the_unpacked_codes_transposed_and_packed(pairs, words, data):
    """The load's one pass over words gives the bytes of the definition's three steps."""
    raw = data.draw(arrays(np.uint32, (2 * pairs, words)))
    qweight = raw.view(np.int32)
    want = quant.pack4(np.ascontiguousarray(awq_layout.unpack(qweight).T))
    np.testing.assert_array_equal(awq_layout.packed_codes(qweight), want)
    with pytest.raises(ValueError, match="even width"):
        awq_layout.packed_codes(qweight[:-1])


def test_packed_tensor_read_by_the_written_definition():
    codes = seeded_rng().integers(0, 16, (5, 24)).astype(np.uint8)
    packed = awq_layout.pack(codes)
    for r in range(5):
        for c in range(24):
            assert read_code(packed, r, c) == codes[r, c]
    np.testing.assert_array_equal(packed, write_by_definition(codes))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([8, 16, 32]), st.integers(1, 4), st.integers(1, 3), st.floats(0.01, 100))
def test_group_quantization_error_is_within_half_a_step(g, groups, out, scale):
    w = (seeded_rng().standard_normal((out, g * groups)) * scale).astype(np.float32)
    codes, scales, zeros = quantize(w, g)
    assert codes.max() <= 15 and zeros.max() <= 15
    err = np.abs(dequantize(codes, scales, zeros) - w).reshape(out, groups, g)
    step = scales.astype(np.float32)[..., None]
    # half a step, plus the fp16 rounding of the step (2^-11 relative) over up to 16 steps: a
    # one-sided group too (rare in real weights; AutoAWQ clamps its zero point and only the
    # grid's reach bounded its error), whose grid is widened to hold 0
    assert np.all(err <= step * (0.5 + 16 * 2.0 ** -11) + 1e-6 * scale)


@pytest.mark.parametrize("group", [[0.5] * 32, [1e5] * 32, list(np.linspace(0.5, 0.6, 32)),
                                   list(np.linspace(-3.0, -2.0, 32))])
def test_a_one_sided_or_flat_group_is_quantized_to_itself(group):
    """A group of one sign (a constant one too) within half a step of itself, not clipped to
    nonsense (a constant 0.5 came back as 1e-5)."""
    w = np.asarray([group], np.float32)
    codes, scales, zeros = quantize(w, 32)
    step = float(scales[0, 0])
    assert np.abs(dequantize(codes, scales, zeros) - w).max() <= step * (0.5 + 2.0 ** -7)


@pytest.mark.parametrize("g, bits", [(32, 4), (128, 4), (64, 3), (16, 8)])
def test_the_compiled_quantizer_follows_its_definition(g, bits):
    """quantize and fake_quantize (Numba loops) give exactly what the module docstring's
    formulas give in NumPy float32, rounding half to even: on ties (weights on a quarter grid)
    and flat (one-sided) groups too; fake_quantize is dequantize(quantize) exactly."""
    rng = seeded_rng()
    w = rng.standard_normal((37, 4 * g)).astype(np.float32)
    w[::3] = np.round(w[::3] * 4) / 4
    w[1, :g] = 0.25
    wg = w.reshape(37, 4, g)
    qmax = 2 ** bits - 1
    lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
    s16 = (np.maximum(hi - lo, np.float32(1e-5)) / np.float32(qmax)).astype(np.float16)
    s = s16.astype(np.float32)
    z = np.clip(np.round(-lo / s), 0, qmax)
    q = np.clip(np.round(wg / s[..., None]) + z[..., None], 0, qmax)
    codes, scales, zeros = quantize(w, g, bits)
    np.testing.assert_array_equal(codes, q.reshape(w.shape))
    np.testing.assert_array_equal(scales, s16)
    np.testing.assert_array_equal(zeros, z)
    want = ((q - z[..., None]) * s[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(fake_quantize(w, g, bits), want)
    np.testing.assert_array_equal(dequantize(codes, scales, zeros), want)


def test_pack_linear_dequantizes_to_the_fake_quantized_weight():
    w = seeded_rng().standard_normal((48, 64)).astype(np.float32)
    t = pack_linear(w, 32)
    assert t["qweight"].shape == (64, 6) and t["qzeros"].shape == (2, 6) and t["scales"].shape == (2, 48)
    assert t["scales"].dtype == np.float16
    layer = awq_layout.QuantizedLinear(t["qweight"], t["qzeros"], t["scales"])
    np.testing.assert_array_equal(quant.dequantize(awq_layout.to_quant(layer)), fake_quantize(w, 32))


def test_scale_search_never_loses_to_plain_rounding():
    """Without the duo form the grid starts at s = 1 (plain rounding), so the chosen scales' loss
    is at most that of round-to-nearest."""
    rng = seeded_rng()
    x = rng.standard_normal((300, 64)).astype(np.float32)
    x[:, [3, 17]] *= 30                                     # salient input channels
    w = rng.standard_normal((32, 64)).astype(np.float32)
    opts = QuantOptions(group_size=32, duo_scaling=False)
    loss = linear_mse(x, w)
    s = search_scales(x, [w], loss, opts)
    rtn = loss([fake_quantize(w, 32)])
    assert loss([fake_quantize(w * s, 32) / s]) <= rtn
    assert loss([fake_quantize(w * s, 32) / s]) < 0.7 * rtn  # and here it clearly wins
    exact = output_mse(lambda W: x @ W[0].T, x @ w.T)
    W2 = [fake_quantize(w * s, 32) / s]
    assert exact(W2) == pytest.approx(loss(W2), rel=1e-3)   # the Gram form is exact
    few = x[:40]                                            # fewer tokens than inputs: direct
    assert linear_mse(few, w)(W2) == pytest.approx(
        output_mse(lambda W: few @ W[0].T, few @ w.T)(W2), rel=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv_heads", [6, 2, 1])                # GQA ratios 1, 3, 6
def test_folded_scales_keep_the_float_layer(kv_heads, family):
    """Scales folded into norms and producing linears leave the float layer's function unchanged:
    without clipping, the searched layer computes what the original does, whatever scales the
    search chose (o_proj's only without GQA, where v_proj can take their inverse, its bias too).
    The layer is the model file's own (models.llama), as the calibration runs it."""
    from tinyrt.kernels import reference as ops
    from tinyrt.models.rope import rope_inv_freq

    rng = seeded_rng()
    d = tiny_config(num_key_value_heads=kv_heads, model_type=family)
    cfg = ModelConfig.from_dict(d)
    w = {k: v for k, v in random_weights(d, seed=int(rng.integers(1 << 30))).items()
         if k.startswith("model.layers.0.")}
    x = rng.standard_normal((2, 40, cfg.hidden_size)).astype(np.float32)
    x[..., rng.choice(cfg.hidden_size, 3, replace=False)] *= 20
    cos, sin = ops.rope_tables(rope_inv_freq(cfg), np.arange(40))
    scaled = awq_layer(cfg, w, 0, x, cos, sin, QuantOptions(group_size=32, clip=False))
    o = "model.layers.0.self_attn.o_proj.weight"
    assert np.allclose(scaled[o], w[o]) == (kv_heads != 6)  # o_proj scaled only without GQA
    ref = layer_forward(cfg, x, w, 0, cos, sin)
    assert rel_err(layer_forward(cfg, x, scaled, 0, cos, sin), ref) < 1e-5


# -- end to end on tiny models -------------------------------------------------------------------

def _salient_model(tmp_path):
    """A tiny model whose norms make a few activation channels large, as in real LLMs."""
    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2)
    w = random_weights(cfg, seed=3)
    rng = np.random.default_rng(4)
    for i in range(cfg["num_hidden_layers"]):
        for n in ("input_layernorm", "post_attention_layernorm"):
            norm = w[f"model.layers.{i}.{n}.weight"]
            norm[rng.choice(128, 4, replace=False)] *= 25
    return write_tiny_model(tmp_path / "float", cfg, weights=w), cfg


def _logits(directory, ids, device="reference"):
    m = load_model(directory, get_backend(device))
    return m.forward(ids, make_cache(CacheOptions(kv_size=256, kv_type="f32"), m),
                     all_logits=True)   # float32: vs transformers


def test_awq_beats_round_to_nearest_on_salient_channels(tmp_path):
    src, cfg = _salient_model(tmp_path)
    calib = tmp_path / "calib.txt"
    calib.write_text(CORPUS * 3)
    awq = convert(src, tmp_path / "awq", method="awq", group_size=32, calib=calib, calib_samples=8,
                  calib_seqlen=64)
    rtn = convert(src, tmp_path / "rtn", method="rtn", group_size=32)
    conf = json.loads((awq / "config.json").read_text())
    assert conf["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32,
                                           "zero_point": True, "version": "gemm"}
    from tinyrt.tokenizer import load_tokenizer

    ids = load_tokenizer(src).encode("Pack my box with five dozen liquor jugs. 987 How vexingly "
                                     "quick daft zebras jump! class A:\n    pass\n" * 2)  # held out
    ref = _logits(src, ids)
    e_awq, e_rtn = rel_err(_logits(awq, ids), ref), rel_err(_logits(rtn, ids), ref)
    assert e_awq < 0.8 * e_rtn, (e_awq, e_rtn)


def _autoawq_checkpoint(directory, cfg, g, seed=0):
    """An AutoAWQ-style checkpoint written by the layout's definition, sharded with an index, and
    the float weights it stands for."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    float_w = random_weights(cfg, seed)
    tensors = {k: v.astype(np.float16) for k, v in float_w.items() if "_proj" not in k}
    deq = {k: v.astype(np.float32) for k, v in tensors.items()}
    from tinyrt.models.config import ModelConfig

    for name, (out_f, in_f) in linear_shapes(ModelConfig.from_dict(cfg)).items():
        codes = rng.integers(0, 16, (in_f, out_f)).astype(np.uint8)
        zeros = rng.integers(0, 16, (in_f // g, out_f)).astype(np.uint8)
        scales = (rng.uniform(0.5, 1.5, (in_f // g, out_f)) / np.sqrt(in_f) / 4).astype(np.float16)
        tensors[name + ".qweight"] = write_by_definition(codes)
        tensors[name + ".qzeros"] = write_by_definition(zeros)
        tensors[name + ".scales"] = scales
        w_t = (codes.astype(np.float32) - np.repeat(zeros, g, 0)) * np.repeat(scales, g, 0).astype(np.float32)
        deq[name + ".weight"] = w_t.T.copy()
    directory.mkdir(parents=True)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for f, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(directory / f), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    qcfg = dict(cfg, torch_dtype="float16", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"})
    (directory / "config.json").write_text(json.dumps(qcfg))
    return deq


@pytest.mark.parametrize("g, tied", [(32, False), (64, True), (128, False)])
def test_autoawq_checkpoint_loads_and_runs(tmp_path, g, tied):
    """An AutoAWQ GEMM checkpoint packed by the layout's written definition (sharded, groups of
    32 to 128, tied or untied head) runs on the reference and CPU kernels as the float model of
    its dequantized weights runs in transformers."""
    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      tie_word_embeddings=tied)
    deq = _autoawq_checkpoint(tmp_path / "awq", cfg, g=g)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    q, s = int8_rows(deq[head])                                  # a 4-bit model's head is int8 rows
    deq["lm_head.weight"] = q * s[:, None]
    # the same weights, in float (untied: the head is the embedding's int8 rows)
    write_tiny_model(tmp_path / "float", dict(cfg, tie_word_embeddings=False), weights=deq)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "awq" / f).write_bytes((tmp_path / "float" / f).read_bytes())
    ids = np.random.default_rng(5).integers(0, 320, 32)
    want = hf_logits(hf_model(tmp_path / "float"), ids)
    assert rel_err(_logits(tmp_path / "awq", ids), want) < 1e-5
    # the CPU's kernels round a prompt's activations, as a decode step's, to int16 per block
    # (about 1e-4 over this model's two layers)
    assert rel_err(_logits(tmp_path / "awq", ids, "cpu"), want) < 3e-4
    import tinyrt

    assert tinyrt.LLM(tmp_path / "awq").generate("hello", max_tokens=4)  # runs end to end


def test_packed_tensors_of_the_wrong_shape(tmp_path):
    cfg = tiny_config()
    _autoawq_checkpoint(tmp_path / "awq", cfg, g=32)
    conf = json.loads((tmp_path / "awq" / "config.json").read_text())
    conf["quantization_config"]["group_size"] = 16               # scales then have the wrong rows
    (tmp_path / "awq" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ModelFormatError, match=r"qzeros.*shape \[3, 12\].*\[6, 12\]"):
        load_model(tmp_path / "awq", get_backend("reference"))


def test_group_size_choice_and_errors(tmp_path):
    src = write_tiny_model(tmp_path / "m", tiny_config())        # hidden 96, intermediate 160
    with pytest.raises(TinyrtError, match="group size 128 does not divide the 96 inputs.*sizes that fit every layer: 32"):
        convert(src, tmp_path / "out", method="rtn", group_size=128)
    out = convert(src, tmp_path / "out", method="rtn")           # default: largest that fits
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 32
    assert not list(tmp_path.glob(".out.tmp*"))


@pytest.mark.parametrize("content, words", [("", "empty"), ("   \n\n", "empty"),
                                            ("short text", "too short"),
                                            ('{"text": "a"}\n{"nope": 1}\n', 'a string "text" field'),
                                            ('{"text": "a"}\n{broken\n', "not a JSON object")])
def test_bad_calibration_files(tmp_path, content, words):
    src = write_tiny_model(tmp_path / "m", tiny_config())
    f = tmp_path / "calib.txt"
    f.write_text(content)
    with pytest.raises(TinyrtError, match=words):
        convert(src, tmp_path / "out", method="awq", calib=f, calib_samples=4, calib_seqlen=32)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_calibration_json_lines(tmp_path):
    from tinyrt.converters.calibration import calibration_ids, read_text

    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in ["first doc", "second doc"]))
    assert read_text(f) == "first doc\n\nsecond doc"
    ids = calibration_ids(lambda s: list(range(len(s))), "x" * 100, 3, 10, seed=1)
    assert ids.shape == (3, 10) and len({tuple(r) for r in ids}) == 3
    assert np.all(ids % 10 == np.arange(10))                     # whole, aligned windows


def _shape(hidden, ffn, layers, heads, kv_heads) -> ModelConfig:
    return ModelConfig.from_dict(dict(model_type="llama", architectures=["LlamaForCausalLM"],
                                      hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, vocab_size=32000))


def test_default_calibration_size_follows_the_machine():
    """The default calibration takes as many samples as the cores search in the time budget:
    more with more cores, fewer for a larger model, from 4 to the paper's 128, and no more than
    half the available memory holds."""
    from tinyrt.converters.awq import peak_bytes
    from tinyrt.converters.calibration import MIN_SAMPLES, PAPER_SAMPLES, default_samples

    small, large = _shape(576, 1536, 30, 9, 3), _shape(4096, 11008, 32, 32, 32)
    lots = 1 << 40
    by_cores = [default_samples(small, 512, c, lots) for c in (1, 2, 4, 8, 16, 1024)]
    assert by_cores == sorted(by_cores) and by_cores[0] == MIN_SAMPLES < by_cores[3]
    assert by_cores[-1] == PAPER_SAMPLES
    assert default_samples(large, 512, 16, lots) < default_samples(small, 512, 16, lots)
    assert default_samples(large, 512, 1, lots) == MIN_SAMPLES         # never fewer
    assert default_samples(small, 512, 1024, 0) == MIN_SAMPLES         # memory: none to spare
    memory = 2 * peak_bytes(small, 20 * 512)
    assert default_samples(small, 512, 1024, memory) == 20


def test_default_calibration_size_is_said_and_fits_the_text(tmp_path, monkeypatch):
    """A conversion without --calib-samples says how many samples it calibrates on and takes
    no more than the text holds; a size given is kept (and a text too short for it refused)."""
    from tinyrt.converters import calibration
    from tinyrt.tokenizer import load_tokenizer

    src = write_tiny_model(tmp_path / "m", tiny_config())
    f = tmp_path / "calib.txt"
    f.write_text(" ".join(CORPUS.split()[:200]))
    monkeypatch.setattr(calibration, "default_samples", lambda cfg, seqlen: 1000)
    notices = []
    convert(src, tmp_path / "out", method="awq", calib=f, calib_seqlen=16, notice=notices.append)
    windows = len(load_tokenizer(src).encode(f.read_text())) // 16
    assert calibration.MIN_SAMPLES < windows < 1000
    assert len(notices) == 1 and f"calibrating on {windows} samples of 16 tokens" in notices[0]
    with pytest.raises(TinyrtError, match="too short"):
        convert(src, tmp_path / "out2", method="awq", calib=f, calib_seqlen=16,
                calib_samples=windows + 1)


@pytest.mark.parametrize("method, stop_at", [("none", 5), ("awq", 1)])   # tensors / layers done
def test_interrupted_conversion_leaves_nothing(tmp_path, method, stop_at):
    src = write_tiny_model(tmp_path / "m", tiny_config())

    def interrupt(done, total, what):
        if done == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "out", method=method, calib_samples=2, calib_seqlen=32,
                progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    convert(src, tmp_path / "out", method="rtn")
    with pytest.raises(TinyrtError, match="already exists"):
        convert(src, tmp_path / "out", method="rtn")
    convert(src, tmp_path / "out", method="rtn", force=True)


def test_awq_model_file_is_compact(tmp_path):
    src = write_tiny_model(tmp_path / "m", tiny_config(hidden_size=256, intermediate_size=512,
                                                       num_attention_heads=4, num_key_value_heads=2))
    out = convert(src, tmp_path / "q", method="rtn", group_size=64)
    from tinyrt.converters.conversion import bits_per_weight

    lin, _ = bits_per_weight(out)
    assert lin == pytest.approx(4 + (16 + 4) / 64)
    store = WeightStore(out)
    assert store.dtype("model.layers.0.mlp.down_proj.qweight") == "I32"
    assert store.dtype("model.embed_tokens.weight") == "F16"
