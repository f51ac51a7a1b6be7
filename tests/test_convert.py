"""Conversion of HF directories and GGUF metadata into model directories."""

import json

import numpy as np
import pytest

from gguf_helpers import write_gguf
from helpers import (byte_level_tokenizer, hf_logits, hf_model, random_weights, rel_err, seeded_rng,
                     tiny_config, write_tiny_model)
from tinyrt.converters import convert
from tinyrt.errors import ModelFormatError, TinyrtError
from tinyrt.kernels import get_backend
from tinyrt.kv_cache import make_cache
from tinyrt.kv_options import CacheOptions
from tinyrt.models import ModelConfig, WeightStore, load_model
from tinyrt.models.rope import rope_inv_freq


def _logits(directory, ids):
    m = load_model(directory, get_backend("reference"))
    return m.forward(ids, make_cache(CacheOptions(kv_size=64, kv_type="f32"), m),
                     all_logits=True)             # float32: vs transformers


def test_sharded_bf16_hf_directory(tmp_path):
    import torch
    from safetensors.torch import save_file

    cfg = tiny_config(torch_dtype="bfloat16", tie_word_embeddings=True)
    src = write_tiny_model(tmp_path / "src", cfg)
    (src / "model.safetensors").unlink()
    w = {k: torch.from_numpy(v).bfloat16() for k, v in random_weights(cfg, 9).items()}
    names = sorted(w)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for f, ns in shards.items():
        save_file({n: w[n] for n in ns}, str(src / f), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    ids = seeded_rng().integers(0, 320, 24)
    want = hf_logits(hf_model(src), ids)
    out32 = convert(src, tmp_path / "f32", method="none", dtype="f32")
    assert rel_err(_logits(out32, ids), want) < 1e-5       # bf16 widens to f32 exactly
    out16 = convert(src, tmp_path / "f16", method="none", dtype="f16")
    assert WeightStore(out16).dtype("model.norm.weight") == "F16"
    assert rel_err(_logits(out16, ids), want) < 1e-2
    assert (out16 / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((out16 / "config.json").read_text())["torch_dtype"] == "float16"
    assert rel_err(hf_logits(hf_model(out16), ids), want) < 1e-2  # transformers reads our output


@pytest.mark.parametrize("method", ["none", "rtn"])
def test_a_model_past_the_shard_size_is_written_in_shards(tmp_path, method):
    """Shards of at most the size asked for (one tensor past it alone in its file), an index in
    transformers' layout naming each tensor once, and the same model as one file gives."""
    src = write_tiny_model(tmp_path / "src", tiny_config(), seed=4)
    whole = convert(src, tmp_path / "whole", method=method, dtype="f32")
    limit = 60_000
    out = convert(src, tmp_path / "sharded", method=method, dtype="f32", max_shard_bytes=limit)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert [p.name for p in shards] == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                        for i in range(len(shards))]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    store, one = WeightStore(out), WeightStore(whole)
    assert sorted(index["weight_map"]) == sorted(one.keys()) == sorted(store.keys())
    assert index["metadata"]["total_size"] == one.nbytes
    for shard in shards:
        names = [n for n, f in index["weight_map"].items() if f == shard.name]
        size = sum(one.get(n).nbytes for n in names)
        assert size <= limit or len(names) == 1
    for name in one.keys():
        np.testing.assert_array_equal(store.get(name), one.get(name))
    ids = seeded_rng().integers(0, 320, 12)
    np.testing.assert_array_equal(_logits(out, ids), _logits(whole, ids))
    if method == "none":                                   # transformers reads the shards
        assert rel_err(hf_logits(hf_model(out), ids), _logits(whole, ids)) < 1e-4


def test_shard_sizes_read_as_people_write_them():
    from tinyrt.errors import TinyrtError
    from tinyrt.memory import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("500 mb") == 5 * 10**8
    assert parse_size("2GiB") == 2 << 30 and parse_size("1.5KB") == 1500 and parse_size("7") == 7
    for bad in ("", "0", "0.1B", "-1GB", "5 parsecs", "GB", "1e9"):
        with pytest.raises(TinyrtError, match="not a size"):
            parse_size(bad)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_a_source_reads_each_tensor_once_and_keeps_no_pages(tmp_path, kind):
    """A conversion reads each tensor of its source once: the arrays are its own (no view of
    the mapped file) and the file's pages leave the resident set after each read, so that a
    conversion of a large model does not end holding the whole file in memory."""
    from gguf_helpers import write_gguf
    from test_weights import _rss_file_kb
    from tinyrt.converters.sources import open_source
    from tinyrt.models.weights import is_mapped

    cfg = tiny_config(vocab_size=4096, hidden_size=1024, intermediate_size=256,
                      num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=1)
    weights = random_weights(cfg, 2, np.float16 if kind == "gguf" else np.float32)
    path = write_tiny_model(tmp_path / "hf", cfg, weights=weights)
    if kind == "gguf":
        tok = (path / "tokenizer.json").read_text()
        path = tmp_path / "m.gguf"
        weights = write_gguf(path, cfg, weights, tok, qtype="F16")
    source = open_source(path)
    start = _rss_file_kb()
    for name, want in weights.items():
        got = source.get(name)
        assert not is_mapped(got)
        np.testing.assert_array_equal(got, want)
    assert _rss_file_kb() - start < 2 * 1024       # the embedding alone is 8 MiB or more


def test_unexpected_tensors_are_refused(tmp_path):
    cfg = tiny_config()
    w = random_weights(cfg)
    w["model.layers.0.self_attn.q_proj.bias"] = np.zeros(96, np.float32)
    src = write_tiny_model(tmp_path / "src", cfg, weights=w)
    with pytest.raises(ModelFormatError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        convert(src, tmp_path / "out", method="none")
    assert not (tmp_path / "out").exists()


def test_f16_overflow_is_refused(tmp_path):
    cfg = tiny_config()
    w = random_weights(cfg)
    w["model.norm.weight"][3] = 1e6
    src = write_tiny_model(tmp_path / "src", cfg, weights=w)
    with pytest.raises(ModelFormatError, match="overflows float16.*--dtype f32"):
        convert(src, tmp_path / "out", method="none", dtype="f16")
    convert(src, tmp_path / "out", method="none", dtype="f32")


def _llama3(cfg):
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("matches", [True, False])
def test_gguf_rope_freqs_become_llama3_scaling(tmp_path, matches):
    """Llama 3.1 GGUF files carry per-frequency divisors (rope_freqs), not the parameters."""
    cfg = tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                      rope_theta=500000.0, max_position_embeddings=131072)
    base = ModelConfig.from_dict(cfg)
    scaled = ModelConfig.from_dict({**cfg, "rope_scaling": _llama3(cfg)})
    freqs = (rope_inv_freq(base) / rope_inv_freq(scaled)).astype(np.float32)
    if not matches:
        freqs[3] *= 1.5
    path = tmp_path / "m.gguf"
    tok = byte_level_tokenizer(cfg["vocab_size"])
    write_gguf(path, cfg, {**random_weights(cfg), "rope_freqs.weight": freqs}, tok.to_str())
    if matches:
        out = convert(path, tmp_path / "out", method="none")
        assert json.loads((out / "config.json").read_text())["rope_scaling"] == _llama3(cfg)
    else:
        with pytest.raises(ModelFormatError, match="rope_freqs"):
            convert(path, tmp_path / "out", method="none")


@pytest.mark.parametrize("method", ["none", "rtn"])
def test_a_full_disk_gives_a_clean_error_and_leaves_nothing(tmp_path, monkeypatch, method):
    """ENOSPC in the middle of writing the weights: one-line error, no output, no temporaries."""
    import errno

    import tinyrt.converters.conversion as conversion
    from tinyrt.errors import TinyrtError

    src = write_tiny_model(tmp_path / "src")
    real = conversion.write_safetensors

    def full_disk(path, specs, arrays, metadata=None):
        def some(arrays):
            for i, a in enumerate(arrays):
                if i == 3:
                    raise OSError(errno.ENOSPC, "No space left on device")
                yield a
        real(path, specs, some(arrays), metadata)

    monkeypatch.setattr(conversion, "write_safetensors", full_disk)
    out = tmp_path / "out"
    with pytest.raises(TinyrtError, match=r"cannot write .*out: No space left on device"):
        convert(src, out, method=method)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("qtype", ["Q4_0", "F32"])
def test_quantizing_a_quantized_file_is_refused_first(tmp_path, monkeypatch, qtype):
    """From a GGUF whose layers are quantized already, rtn/awq stops before reading a tensor,
    writing nothing, saying why and how to run the file instead; `requantize` converts it. A
    float source converts without it."""
    from tinyrt.converters import conversion

    cfg = tiny_config()
    src = tmp_path / f"m.{qtype}.gguf"
    write_gguf(src, cfg, random_weights(cfg), byte_level_tokenizer(cfg["vocab_size"]).to_str(),
               qtype=qtype)
    if qtype != "F32":
        def no_work(*a, **k):
            raise AssertionError("the conversion began")

        with monkeypatch.context() as m:
            m.setattr(conversion, "check_tensors", no_work)      # (the first look at tensors)
            for method in ("rtn", "awq"):
                with pytest.raises(TinyrtError) as e:
                    convert(src, tmp_path / "q", method=method, group_size=32)
                assert "Q4_0" in str(e.value) and f"tinyrt chat -m {src}" in str(e.value)
                assert "--requantize" in str(e.value) and "\n" not in str(e.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]
    out = convert(src, tmp_path / "q", method="rtn", group_size=32,
                  requantize=qtype != "F32")
    assert (out / "config.json").exists()


# -- what --force may replace ------------------------------------------------------------------------

def _snapshot(root):
    """Everything under `root`: relative path -> the file's bytes, a link's target or "dir"."""
    import os
    from pathlib import Path

    seen = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(here) / name
            rel = str(p.relative_to(root))
            seen[rel] = (("link", os.readlink(p)) if p.is_symlink() else
                         p.read_bytes() if p.is_file() else "dir")
    return seen


def test_force_never_touches_the_source_or_what_tinyrt_did_not_write(tmp_path):
    """OUT that is or holds SRC (directly or through a symlink), a file, or a directory tinyrt
    did not write: refused with one line, everything left byte for byte."""
    from helpers import assert_refused, run_tinyrt

    d = tmp_path / "d"
    src = write_tiny_model(d / "src")
    (d / "notes.txt").write_text("the user's own notes")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")          # looks like a model, is not ours
    (tmp_path / "alias").symlink_to(d)
    (tmp_path / "srclink").symlink_to(src)
    before = _snapshot(tmp_path)
    for s, o, words in [(src, d, ("SRC",)), (src, src, ("SRC",)), (src, tmp_path / "alias", ("SRC",)),
                        (tmp_path / "srclink", d, ("SRC",)), (src, tmp_path, ("SRC",)),
                        (src, d / "notes.txt", ("OUT", "not a directory")),
                        (src, tmp_path / "mine", ("OUT", "did not write"))]:
        p = run_tinyrt("convert", str(s), str(o), "--method", "none", "--force")
        assert_refused(p, *words)
        assert _snapshot(tmp_path) == before, (s, o)


def test_force_replaces_a_previous_output_and_only_that(tmp_path):
    """An output of tinyrt's (here inside the source directory, which it does not hold) is
    replaced with --force, the source untouched; once it holds a file tinyrt did not write, or
    one of its files changed, it is not replaced."""
    from helpers import assert_refused, run_tinyrt
    from tinyrt.converters.writer import MANIFEST

    src = write_tiny_model(tmp_path / "src")
    source = _snapshot(src)
    out = src / "out"
    convert(src, out, method="none")
    assert (out / MANIFEST).is_file()
    convert(src, out, method="none", dtype="f32", force=True)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert {k: v for k, v in _snapshot(src).items() if not k.startswith("out")} == source
    assert sorted(p.name for p in src.iterdir()) == sorted([*source, "out"])   # nothing stray

    (out / "mine.txt").write_text("mine")
    before = _snapshot(tmp_path)
    assert_refused(run_tinyrt("convert", str(src), str(out), "--method", "none", "--force"),
                   "mine.txt", "did not write")
    assert _snapshot(tmp_path) == before
    (out / "mine.txt").unlink()
    with open(out / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(TinyrtError, match="changed since tinyrt wrote it"):
        convert(src, out, method="none", force=True)


def test_force_onto_a_symlinked_out_replaces_where_it_points(tmp_path):
    """OUT a symlink to an output of tinyrt's: the directory it points to is replaced, the link
    stays, nothing stray is left beside either; a dangling link gets its directory."""
    src = write_tiny_model(tmp_path / "src")
    convert(src, tmp_path / "real", method="none")
    (tmp_path / "out").symlink_to("real")
    convert(src, tmp_path / "out", method="none", dtype="f32", force=True)
    assert (tmp_path / "out").is_symlink() and str((tmp_path / "out").readlink()) == "real"
    assert json.loads((tmp_path / "real" / "config.json").read_text())["torch_dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "real", "src"]
    (tmp_path / "dangling").symlink_to("later")
    convert(src, tmp_path / "dangling", method="none")
    assert (tmp_path / "dangling").is_symlink() and (tmp_path / "later" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "later", "out", "real", "src"]


def test_a_killed_conversion_leaves_nothing_a_later_one_keeps(tmp_path):
    """What a conversion killed between its two renames leaves (the previous output moved aside,
    the new one complete in its temporary) is swept by the next conversion: only the files the
    old output's manifest lists; a stranger's file stays."""
    import shutil
    import subprocess
    import sys

    src = write_tiny_model(tmp_path / "src")
    convert(src, tmp_path / "out", method="none")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()   # a pid that is gone
    (tmp_path / "out").rename(tmp_path / f".out.old-{dead}")
    shutil.copytree(tmp_path / f".out.old-{dead}", tmp_path / f".out.tmp-{dead}")
    (tmp_path / f".out.old-{dead}" / "theirs.txt").write_text("not tinyrt's")
    other, third = (subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                   capture_output=True, text=True).stdout.strip()
                    for _ in range(2))
    (tmp_path / f".out.tmp-{other}").mkdir()          # a stranger's, named as a temporary is
    (tmp_path / f".out.tmp-{other}" / "theirs.txt").write_text("not tinyrt's")
    # a temporary of tinyrt's (its manifest) that a stranger's files were put in: only the
    # files a conversion writes go
    shutil.copytree(tmp_path / f".out.tmp-{dead}", tmp_path / f".out.tmp-{third}")
    (tmp_path / f".out.tmp-{third}" / "sub").mkdir()
    (tmp_path / f".out.tmp-{third}" / "sub" / "f").write_text("not tinyrt's")
    (tmp_path / f".out.tmp-{third}" / "theirs.txt").write_text("not tinyrt's")
    convert(src, tmp_path / "out", method="none")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".out.old-{dead}", f".out.tmp-{other}", f".out.tmp-{third}", "out", "src"])
    assert [p.name for p in (tmp_path / f".out.old-{dead}").iterdir()] == ["theirs.txt"]
    assert [p.name for p in (tmp_path / f".out.tmp-{other}").iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in (tmp_path / f".out.tmp-{third}").iterdir()) == ["sub",
                                                                                   "theirs.txt"]


def test_progress_off_a_terminal_is_plain_lines(capsys, monkeypatch):
    """A conversion logged to a file (stderr no terminal): a line for each tenth of the work
    and the end, no more often than LINE_EVERY_S, with the time taken and left."""
    from tinyrt.cli.convert import ConvertProgress

    progress = ConvertProgress("awq m (4-bit)")
    for i in range(1, 31):
        progress(i, 30, "layers")
    progress.close()
    assert capsys.readouterr().err == ""          # (done within LINE_EVERY_S: nothing said)
    monkeypatch.setattr(ConvertProgress, "LINE_EVERY_S", 0)
    progress = ConvertProgress("awq m (4-bit)")
    for i in range(1, 31):
        progress(i, 30, "layers")
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("awq m (4-bit): 30/30, ") and \
        all(" so far, about " in line for line in lines), lines
