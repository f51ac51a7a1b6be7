"""GGUF files: tiny files written like llama.cpp's converter, read back through our converter and
compared with the source weights and with transformers loading the same file."""

import numpy as np
import pytest

from gguf_helpers import permute, write_gguf
from helpers import (CHATML, byte_level_tokenizer, hf_logits, random_weights, rel_err, seeded_rng,
                     status_kib, tiny_config)
from tinyrt.converters import convert
from tinyrt.models.gguf import unpermute
from tinyrt.errors import ModelFormatError
from tinyrt.kernels import get_backend
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models import WeightStore, load_model


@pytest.mark.parametrize("heads, rows_per_head, cols", [(1, 8, 3), (4, 16, 5), (3, 64, 2)])
def test_unpermute_inverts_llamacpp_permute(heads, rows_per_head, cols):
    w = seeded_rng().standard_normal((heads * rows_per_head, cols))
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
    ids = seeded_rng().integers(0, cfg["vocab_size"], 24)
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


def test_the_weights_keep_no_tokenizer_arrays(tmp_path):
    """The tokenizer reads the file itself: the weights' reader forgets its vocabulary and
    merges (megabytes of Python strings), and keeps the scalars and the config."""
    from tinyrt.models.gguf import GGUFFile, GGUFWeights

    cfg = tiny_config()
    path, _, _ = _tiny_gguf(tmp_path, cfg, "Q4_0")
    assert isinstance(GGUFFile(path).get("tokenizer.ggml.tokens"), list)
    w = GGUFWeights(path)
    assert w.file.get("tokenizer.ggml.tokens") is None
    assert w.file.get("tokenizer.ggml.eos_token_id") == GGUFFile(path).get("tokenizer.ggml.eos_token_id") is not None
    assert w.config.vocab_size == cfg["vocab_size"]


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


# -- our reader (models/gguf.py) -----------------------------------------------------------------

def test_reader_reads_every_value_type(tmp_path):
    """Every GGUF value type, arrays of each and arrays of arrays, a custom alignment: read as
    written, as `gguf.GGUFReader` reads them, and the tensors at the reader's offsets."""
    import gguf
    from gguf import GGUFValueType as V

    from tinyrt.models.gguf import GGUFFile

    p = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_custom_alignment(64)
    scalars = {"u8": (V.UINT8, 250), "i8": (V.INT8, -7), "u16": (V.UINT16, 65000),
               "i16": (V.INT16, -3000), "u32": (V.UINT32, 4_000_000_000), "i32": (V.INT32, -5),
               "f32": (V.FLOAT32, 1.25), "b": (V.BOOL, True), "u64": (V.UINT64, 2**63 + 5),
               "i64": (V.INT64, -2**40), "f64": (V.FLOAT64, 0.1), "s": (V.STRING, "héllo ✓")}
    for k, (t, v) in scalars.items():
        w.add_key_value(f"t.{k}", v, t)
    arrays = {"a.i16": (V.INT16, [1, -2, 3]), "a.f32": (V.FLOAT32, [0.5, -1.5]),
              "a.bool": (V.BOOL, [True, False, True]), "a.u64": (V.UINT64, [2**64 - 1]),
              "a.str": (V.STRING, ["", "a b", "Ġt", "日本"]), "a.nested": (None, [[1, 2], [3]]),
              "a.nested_str": (None, [["x"], ["y", "z"]])}
    for k, (t, v) in arrays.items():
        w.add_key_value(k, v, V.ARRAY, sub_type=t)
    tensors = {"x.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
               "y.weight": np.arange(5, dtype=np.float16)}
    for k, v in tensors.items():
        w.add_tensor(k, v)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    g = GGUFFile(p)
    assert g.version == 3 and g.alignment == 64 and g.arch == "llama"
    for k, (_, v) in scalars.items():
        assert g.get(f"t.{k}") == v and type(g.get(f"t.{k}")) is type(v), k
    for k, (_, v) in arrays.items():
        assert g.get(k) == v, k
    r = gguf.GGUFReader(p)
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "a.nested" and k != "a.nested_str":
            assert g.get(k) == f.contents(), k
    for t in r.tensors:
        assert g.tensors[t.name].data_offset == t.data_offset and g.tensors[t.name].data_offset % 64 == 0
        np.testing.assert_array_equal(g.tensor(t.name), tensors[t.name])
        assert g.tensor(t.name).dtype == tensors[t.name].dtype
    assert g.get("missing", 3) == 3


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                                   "Q4_K", "Q5_K", "Q6_K"])
def test_hf_linear_is_the_stored_weight_exactly(tmp_path, qtype):
    """hf_linear: the runtime's quantized form where the type has one (dequantized: what
    llama.cpp reads, Q/K rows un-permuted, exactly), float otherwise."""
    from tinyrt.kernels import quant
    from tinyrt.models.gguf import GGUFFile
    from tinyrt.models.gguf_quants import GGUF_TO_QUANT

    kquant = qtype.endswith("_K")
    cfg = (tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2) if kquant else tiny_config())
    path, _, back = _tiny_gguf(tmp_path, cfg, qtype)
    g = GGUFFile(path)
    for name, w in back.items():
        if w.ndim != 2 or name == "model.embed_tokens.weight":
            continue
        module = name.removesuffix(".weight")
        got = g.hf_linear(module)
        if g.tensor_type(g._gguf_names[name]).name in {t.name for t in GGUF_TO_QUANT}:
            assert isinstance(got, quant.QuantWeight) and got.shape == w.shape
            np.testing.assert_array_equal(quant.dequantize(got), w)
        else:
            assert isinstance(got, np.ndarray) and got.dtype == np.float32
            np.testing.assert_array_equal(got, w)
        np.testing.assert_array_equal(g.hf_tensor(name), w)


def _header(version=3, n_tensors=0, n_kv=1, kv=b""):
    import struct

    arch = b"general.architecture"
    kv = kv or struct.pack("<Q", len(arch)) + arch + struct.pack("<IQ", 8, 5) + b"llama"
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kv


@pytest.mark.parametrize("raw, match", [
    (_header(n_tensors=10**15), "not a readable GGUF file .*tensor count claims 1000000000000000"),
    (_header(n_kv=2**63), "not a readable GGUF file .*metadata count claims"),
    (_header(version=1), "not a readable GGUF file .*version 1"),
    (_header(version=3 << 24), "not a readable GGUF file .*big-endian"),
    (_header()[:-3], "truncated"),
    (_header()[:30], "truncated"),
    (_header(kv=b"\x04" + bytes(7) + b"abcd" + b"\x09\0\0\0" + b"\x08\0\0\0" + b"\xff" * 8),
     "not a readable GGUF file .*'abcd' claims 18446744073709551615 items"),
    (_header(kv=b"\x04" + bytes(7) + b"abcd" + b"\x0d\0\0\0"), "unknown value type 13"),
])
def test_reader_refuses_damaged_headers_in_one_line(tmp_path, raw, match):
    from tinyrt.models.gguf import GGUFFile

    p = tmp_path / "bad.gguf"
    p.write_bytes(raw)
    with pytest.raises(ModelFormatError, match=match) as e:
        GGUFFile(p)
    assert "\n" not in str(e.value)


@pytest.mark.real_model
def test_the_default_model_parses_from_its_header(default_gguf):
    """Our own reader (benchmarks/gguf_parse.py: a 49k-token vocabulary and its merges in tens
    of ms, where GGUFReader took seconds) reads the metadata and the tensor table from the
    file's header: the weights behind it (94 MB) are not read."""
    from tinyrt.models.gguf import GGUFFile

    before = status_kib("RssFile")          # (a fresh mapping: only the pages read count)
    g = GGUFFile(default_gguf)
    read_mib = (status_kib("RssFile") - before) / 1024
    assert len(g.get("tokenizer.ggml.tokens")) == 49152 and g.config()["num_hidden_layers"] == 30
    assert len(g.tensors) == 30 * 9 + 2          # 9 a layer, the embedding, the final norm
    assert read_mib < 16, read_mib          # the header is about 2 MB


def _tensor_header(dims, qtype, offset):
    """A header with one tensor `t.weight` (GGUF dims, type number, offset), padded to the data
    start."""
    import struct

    name = b"t.weight"
    info = (struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", qtype, offset))
    head = _header(n_tensors=1) + info
    return head + bytes(-len(head) % 32)


@pytest.mark.parametrize("offset, ok", [(0, True), (32, False), (2**63, False)])
def test_reader_refuses_a_tensor_placed_past_the_end(tmp_path, offset, ok):
    """The file holds every byte of its tensor (8 float32s), but the header places it beyond."""
    from tinyrt.models.gguf import GGUFFile

    p = tmp_path / "past.gguf"
    p.write_bytes(_tensor_header([8], 0, offset) + np.arange(8, dtype=np.float32).tobytes())
    if ok:                             # (the same file, placed right, reads back)
        np.testing.assert_array_equal(GGUFFile(p).tensor("t.weight"), np.arange(8))
        return
    with pytest.raises(ModelFormatError, match=r"tensor t\.weight runs past the end") as e:
        GGUFFile(p)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dims, qtype", [
    ([2**62 + 8], 0),                  # F32: 4 * (2^62 + 8) = 2^64 + 32 bytes, 32 in u64 arithmetic
    ([2**64 - 32, 2**64 - 1], 2),      # Q4_0: (2^64 - 32) / 32 blocks of 18 bytes, 2^64 - 1 rows
    ([2**32, 2**32, 2**32, 2**32], 0),  # 2^128 elements
])
def test_reader_refuses_a_shape_whose_byte_count_overflows(tmp_path, dims, qtype):
    """A shape whose size in bytes exceeds 64 bits: wrapped around, the first would claim 32
    bytes, the 32 the file holds; counted exactly, it runs past the end."""
    from tinyrt.models.gguf import GGUFFile

    p = tmp_path / "huge.gguf"
    p.write_bytes(_tensor_header(dims, qtype, 0) + bytes(32))
    with pytest.raises(ModelFormatError, match=r"tensor t\.weight runs past the end") as e:
        GGUFFile(p)
    assert "\n" not in str(e.value)


# -- hostile metadata: each a clear error from the reader, which the converter and the runtime
# both read through (GGUFFile.config) ---------------------------------------------------------

def hostile_gguf(path, changes: dict, tensors: dict | None = None, cfg: dict | None = None):
    """The tiny llama GGUF of `_tiny_gguf` (float32) with metadata `changes`: key -> (value,
    GGUFValueType, item type of an array or None), replacing a key the writer adds or added;
    `tensors` (GGUF name -> array) added. Returns `path`."""
    from unittest import mock

    import gguf

    class Writer(gguf.GGUFWriter):
        def add_key_value(self, key, val, vtype, sub_type=None):
            if key not in changes:
                super().add_key_value(key, val, vtype, sub_type=sub_type)

        def write_header_to_file(self, path=None):
            for key, (val, vtype, sub_type) in changes.items():
                super().add_key_value(key, val, vtype, sub_type=sub_type)
            for name, a in (tensors or {}).items():
                self.add_tensor(name, a)
            super().write_header_to_file(path)

    cfg = cfg or tiny_config()
    with mock.patch.object(gguf, "GGUFWriter", Writer):
        write_gguf(path, cfg, random_weights(cfg, seed=7),
                   byte_level_tokenizer(cfg["vocab_size"]).to_str(), chat_template=CHATML)
    return path


def _v():
    from gguf import GGUFValueType

    return GGUFValueType


HOSTILE_METADATA = {
    # name: (changes, extra tensors, words the one line names)
    "string hidden size": ({"llama.embedding_length": ("96", "STRING", None)}, None,
                           "llama.embedding_length is not an integer"),
    "string epsilon": ({"llama.attention.layer_norm_rms_epsilon": ("1e-5", "STRING", None)}, None,
                       "llama.attention.layer_norm_rms_epsilon is not a number"),
    "NaN epsilon": ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), "FLOAT32", None)},
                    None, "rms_norm_eps must be a finite number, got nan"),
    "infinite theta": ({"llama.rope.freq_base": (float("inf"), "FLOAT32", None)}, None,
                       "rope_theta must be a finite number"),
    "head counts that differ": ({"llama.attention.head_count": ([6, 3], "ARRAY", "UINT32")}, None,
                                "llama.attention.head_count differs between layers"),
    "a list of strings for heads": ({"llama.attention.head_count_kv": (["2"], "ARRAY", "STRING")},
                                    None, "llama.attention.head_count_kv is not an integer"),
    "linear scaling without a factor": ({"llama.rope.scaling.type": ("linear", "STRING", None)},
                                        None, "llama.rope.scaling.factor is missing"),
    "a zero linear factor": ({"llama.rope.scaling.type": ("linear", "STRING", None),
                              "llama.rope.scaling.factor": (0.0, "FLOAT32", None)}, None,
                             "rope_scaling.factor (linear) must be at least 1"),
    "rope_freqs of the wrong length": ({}, {"rope_freqs.weight": np.ones(5, np.float32)},
                                       r"rope_freqs.weight has shape [5], head_dim 16 needs [8]"),
    "rope_freqs holding NaN": ({}, {"rope_freqs.weight": np.full(8, np.nan, np.float32)},
                               "rope_freqs tensor matches no rope scaling"),
    "a billion layers": ({"llama.block_count": (10**9, "UINT32", None)}, None,
                         "llama.block_count is 1000000000, but the file holds tensors of 2 layers"),
    "a context of 2^62": ({"llama.context_length": (2**62, "UINT64", None)}, None,
                          "max_position_embeddings must be between 1 and 2147483647"),
}


@pytest.mark.parametrize("case", HOSTILE_METADATA)
def test_hostile_metadata_is_one_clear_line(tmp_path, case):
    from tinyrt.models.gguf import GGUFFile, GGUFWeights

    changes, tensors, words = HOSTILE_METADATA[case]
    V = _v()
    changes = {k: (v, V[t], sub and V[sub]) for k, (v, t, sub) in changes.items()}
    path = hostile_gguf(tmp_path / "bad.gguf", changes, tensors)
    for read in (lambda: GGUFFile(path).config(), lambda: GGUFWeights(path)):
        with pytest.raises(ModelFormatError) as e:
            read()
        msg = str(e.value)
        assert msg.startswith(str(path)) and words in msg and "\n" not in msg, msg


def test_per_layer_head_counts_that_agree_are_read_as_one(tmp_path):
    """GGUF may give head_count_kv (and head_count) per layer: when every layer has the same,
    the file is the model with that count, and runs as the plain file does."""
    from tinyrt.models.gguf import GGUFFile

    V = _v()
    plain = hostile_gguf(tmp_path / "plain.gguf", {})
    per_layer = hostile_gguf(tmp_path / "per-layer.gguf", {
        "llama.attention.head_count": ([6, 6], V.ARRAY, V.UINT32),
        "llama.attention.head_count_kv": ([2, 2], V.ARRAY, V.UINT32)})
    assert GGUFFile(per_layer).config() == GGUFFile(plain).config()
    ids = [5, 70, 3, 200]
    np.testing.assert_array_equal(_ours_logits(per_layer, ids), _ours_logits(plain, ids))


def test_a_gguf_s_sampling_metadata_is_its_default(tmp_path, capsys):
    """llama.cpp's `general.sampling.*` keys (its converter writes them from a model's
    generation_config.json) are the file's sampling defaults, and say so; what they do not set
    is tinyrt's; a value the sampler cannot use is a warning and the default."""
    import tinyrt
    from tinyrt.sampling import SamplingParams

    cfg = tiny_config()
    path, _, _ = _tiny_gguf(tmp_path, cfg, "F32", metadata={
        "general.sampling.temp": 0.65, "general.sampling.top_k": 7,
        "general.sampling.min_p": -1.0})
    llm = tinyrt.load(str(path), device="cpu", quiet=True)
    assert llm.sampling_defaults() == {"temperature": np.float32(0.65).item(), "top_k": 7}
    sources = llm.sampling_sources()
    assert sources["temperature"] == (np.float32(0.65).item(), "GGUF metadata")
    assert sources["top_k"] == (7, "GGUF metadata")
    plain = SamplingParams()
    assert sources["top_p"] == (plain.top_p, "tinyrt")
    assert sources["min_p"] == (plain.min_p, "tinyrt")
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and str(path) in warned[0] and "min_p" in warned[0], warned
    # the defaults are what a reply samples with: the same text as the settings given outright
    kw = dict(max_tokens=12, ignore_eos=True, seed=3)
    stated = llm.generate("hi", temperature=np.float32(0.65).item(), top_k=7, **kw)
    assert llm.generate("hi", **kw) == stated
    assert llm.generate("hi", temperature=0.8, top_k=40, **kw) != stated
