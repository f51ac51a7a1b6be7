import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import status_kib
from tinyrt.errors import ModelFormatError
from tinyrt.models.weights import (SafetensorsFile, WeightStore, bf16_to_f32, release_pages,
                                  write_safetensors)


def _arrays(rng):
    return {"a": rng.standard_normal((3, 5)).astype(np.float32),
            "b": rng.standard_normal(7).astype(np.float16),
            "c": rng.integers(-2**31, 2**31, (4, 2), dtype=np.int64).astype(np.int32),
            "empty": np.zeros((0, 3), np.float32)}


def test_our_writer_is_read_by_safetensors(tmp_path):
    arrays = _arrays(np.random.default_rng(1))
    path = tmp_path / "x.safetensors"
    write_safetensors(path, [(k, v.dtype, v.shape) for k, v in arrays.items()], arrays.values(),
                      metadata={"format": "pt"})
    back = load_file(str(path))
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)


def test_safetensors_files_are_read_without_copies(tmp_path):
    arrays = _arrays(np.random.default_rng(2))
    path = tmp_path / "y.safetensors"
    save_file(arrays, str(path))
    f = SafetensorsFile(path)
    for k, v in arrays.items():
        got = f.get(k)
        np.testing.assert_array_equal(got, v)
        assert got.dtype == v.dtype and not got.flags.writeable
    assert isinstance(f.get("a").base, np.ndarray)  # a view into the mapping


def test_released_pages_read_back(tmp_path):
    """release() drops the file's pages from the process; views taken before and after still
    read the tensors."""
    arrays = _arrays(np.random.default_rng(3))
    save_file(arrays, str(tmp_path / "z.safetensors"))
    f = SafetensorsFile(tmp_path / "z.safetensors")
    before = {k: f.get(k) for k in arrays}
    f.release()
    for k, v in arrays.items():
        np.testing.assert_array_equal(before[k], v)
        np.testing.assert_array_equal(f.get(k), v)


def _rss_file_kb() -> int:
    try:
        return status_kib("RssFile")
    except IndexError:
        pytest.skip("no RssFile in /proc/self/status")


def test_release_pages_drops_one_tensor_from_the_resident_set(tmp_path):
    """An embedding table is read a few rows at a time: release_pages unmaps what was read (the
    process's file-backed RSS falls back by the table's size) and the table still reads right."""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((4096, 2048)).astype(np.float16)        # 16 MiB
    save_file({"a": np.ones(3, np.float32), "t": table}, str(tmp_path / "z.safetensors"))
    t = SafetensorsFile(tmp_path / "z.safetensors").get("t")
    start = _rss_file_kb()
    np.testing.assert_array_equal(t, table)                             # every page read
    assert _rss_file_kb() - start > 12 * 1024
    release_pages(t)
    assert _rss_file_kb() - start < 2 * 1024
    rows = rng.integers(0, 4096, 5)
    np.testing.assert_array_equal(t[rows], table[rows])
    release_pages(table)                                                # not mapped: no-op
    release_pages(t[rows])                                              # a copy: no-op


def test_writer_rejects_a_mismatched_array(tmp_path):
    with pytest.raises(ValueError, match="expected"):
        write_safetensors(tmp_path / "z.safetensors", [("a", np.float32, (2, 2))],
                          [np.zeros((2, 3), np.float32)])


def test_bf16_widening():
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bf16
    got = bf16_to_f32(bits)
    assert np.all(np.abs(got - x) <= np.abs(x) * 2 ** -7)


def test_sharded_index(tmp_path):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 2)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00002-of-00002.safetensors"}}))
    store = WeightStore(tmp_path)
    np.testing.assert_array_equal(store.get("a"), a)
    np.testing.assert_array_equal(store.get("b"), b)
    assert sorted(store.keys()) == ["a", "b"]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_index_cannot_name_files_outside_the_directory(tmp_path, shard):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(ModelFormatError, match="outside the model directory"):
        WeightStore(tmp_path)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.ones((64, 64), np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ModelFormatError, match="truncated"):
        SafetensorsFile(path)


@pytest.mark.parametrize("content", [b"", b"abc", b"\xff" * 8 + b"{}", b"\x05\x00\x00\x00\x00\x00\x00\x00hello",
                                     b"\x02\x00\x00\x00\x00\x00\x00\x00[]"])
def test_not_a_safetensors_file(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match="not a safetensors file"):
        SafetensorsFile(path)


def test_missing_weights(tmp_path):
    with pytest.raises(ModelFormatError, match="no .safetensors"):
        WeightStore(tmp_path)


def _raw_safetensors(path, header: dict, data: bytes = b""):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**70], [0, 2**62], [1] * 65])
def test_shapes_no_file_holds_are_refused(tmp_path, shape):
    """Shapes whose element count an int64 product wraps around (2^80 -> 0: an "empty" tensor
    of 0 bytes), overflows, or no array can have (an empty one of 2^62 columns, 65 dimensions):
    counted exactly, each is one line, not an OverflowError or NumPy's ValueError."""
    path = tmp_path / "huge.safetensors"
    _raw_safetensors(path, {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(ModelFormatError, match="huge.safetensors") as e:
        np.array(SafetensorsFile(path).get("w"))
    assert "\n" not in str(e.value)


def test_an_empty_tensor_still_reads(tmp_path):
    path = tmp_path / "empty.safetensors"
    _raw_safetensors(path, {"w": {"dtype": "F32", "shape": [0, 4096], "data_offsets": [0, 0]}})
    assert SafetensorsFile(path).get("w").shape == (0, 4096)


def test_a_config_claiming_more_layers_than_the_weights_hold_is_refused_first(tmp_path):
    """num_hidden_layers 10^8 over a 2-layer file: refused from the file's tensors before the
    per-layer list of expected tensors (some 3.7 GB for 10^8 layers) is built."""
    import tracemalloc

    from helpers import tiny_config, write_tiny_model
    from tinyrt.models import open_weights

    d = write_tiny_model(tmp_path / "m")
    (d / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=10**8)))
    tracemalloc.start()
    try:
        with pytest.raises(ModelFormatError, match="claims 100000000 layers .*its tensors hold 2"):
            open_weights(d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, peak        # (the list alone: some 3.7 GB)
    (d / "config.json").write_text(json.dumps(tiny_config(num_hidden_layers=3)))
    with pytest.raises(ModelFormatError, match="claims 3 layers .*its tensors hold 2"):
        open_weights(d)
