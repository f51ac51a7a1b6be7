"""Hostile files where a model's files should be (issue 46, classes 2 and 4): a FIFO, a device,
/proc/self/mem, a directory or a symlink loop under a file's name, and JSON nested deeper than
the interpreter recurses. Each is refused through the command line in one line
(tests/helpers.assert_refused: no traceback, no hang, non-zero exit). Every file tinyrt reads
is opened by tinyrt.paths.open_regular; these tests reach it through each reader."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from helpers import assert_refused, run_tinyrt, tiny_config, write_tiny_model

# a FIFO with no writer blocks a plain open for ever: a hang is a failure well before this
FIFO_SECONDS = 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("hostile_files") / "tiny")


def _copy(tiny, tmp_path) -> Path:
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    return d


def _sharded(tiny, tmp_path) -> Path:
    """The tiny model with its weights named by an index as the one shard s1.safetensors."""
    d = _copy(tiny, tmp_path)
    (d / "model.safetensors").rename(d / "s1.safetensors")
    keys = _keys(d / "s1.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "s1.safetensors" for k in keys}}))
    return d


def _keys(path: Path) -> list[str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]


def _replace(path: Path, kind: str) -> None:
    """Put `kind` where the file `path` is: a FIFO, a directory, a symlink loop, /dev/zero."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":                   # two links naming each other
        other = path.with_name(path.name + ".other")
        other.symlink_to(path.name)
        path.symlink_to(other.name)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        raise ValueError(kind)


KIND_WORDS = {"fifo": "FIFO", "directory": "directory", "loop": "symbolic links",
              "device": "device"}


# -- the shard index: read by the weights' loader ---------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "directory", "loop", "device"])
def test_info_refuses_an_index_that_is_not_a_regular_file(tiny, tmp_path, kind):
    """A FIFO here hung `tinyrt info` (the folder was accepted, then the index read with a
    plain read); a loop was taken for no index at all."""
    d = _sharded(tiny, tmp_path)
    _replace(d / "model.safetensors.index.json", kind)
    assert_refused(run_tinyrt("info", str(d), timeout=FIFO_SECONDS),
                   "model.safetensors.index.json", KIND_WORDS[kind])


def test_convert_refuses_an_index_that_is_a_fifo(tiny, tmp_path):
    d = _sharded(tiny, tmp_path)
    _replace(d / "model.safetensors.index.json", "fifo")
    out = tmp_path / "out"
    assert_refused(run_tinyrt("convert", str(d), str(out), "--method", "none",
                              timeout=FIFO_SECONDS), "model.safetensors.index.json", "FIFO")
    assert not out.exists()


@pytest.mark.parametrize("nested", ["[" * 100_000 + "]" * 100_000,
                                    '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"])
def test_info_refuses_an_index_nested_a_hundred_thousand_levels(tiny, tmp_path, nested):
    """A RecursionError traceback before."""
    d = _sharded(tiny, tmp_path)
    (d / "model.safetensors.index.json").write_text(nested)
    assert_refused(run_tinyrt("info", str(d)), "model.safetensors.index.json", "nested")


# -- the weights: model.safetensors or a shard -------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "directory", "loop", "device"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "shard"])
def test_info_refuses_weights_that_are_not_a_regular_file(tiny, tmp_path, kind, sharded):
    """A directory gave IsADirectoryError, a loop OSError [Errno 40]; a FIFO or a device was
    called a safetensors file of 0 bytes."""
    d = _sharded(tiny, tmp_path) if sharded else _copy(tiny, tmp_path)
    name = "s1.safetensors" if sharded else "model.safetensors"
    _replace(d / name, kind)
    line = assert_refused(run_tinyrt("info", str(d), timeout=FIFO_SECONDS), KIND_WORDS[kind])
    assert name in line or f"{name}.other" in line, line


def test_generate_refuses_weights_that_are_a_directory(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    _replace(d / "model.safetensors", "directory")
    assert_refused(run_tinyrt("generate", "-m", str(d), "hi", "-n", "1"),
                   "model.safetensors", "directory")


def test_info_refuses_a_safetensors_header_nested_a_hundred_thousand_levels(tiny, tmp_path):
    d = _copy(tiny, tmp_path)
    header = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert_refused(run_tinyrt("info", str(d)), "model.safetensors", "not JSON")


# -- JSON that parses but nests deeper than anything may later recurse over it -------------

@pytest.mark.parametrize("depth", [150, 900])
def test_info_refuses_a_config_nested_too_deep_to_copy(tiny, tmp_path, depth):
    """A rope_scaling object nested 150 levels parsed, then broke the config's deep copy (a
    RecursionError traceback in `tinyrt info`)."""
    d = _copy(tiny, tmp_path)
    text = json.dumps(tiny_config(rope_scaling="X")).replace(
        '"X"', '{"rope_type": "linear", "factor": 2.0, "x": '
        + '{"a": ' * depth + "1" + "}" * depth + "}")
    (d / "config.json").write_text(text)
    assert_refused(run_tinyrt("info", str(d)), "config.json", "levels deep")


# -- a GGUF file that cannot be read ---------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux's /proc")
def test_info_refuses_a_gguf_that_is_proc_self_mem(tmp_path):
    """/proc/self/mem is a "regular file" of size 0 whose reads fail: an OSError [Errno 5]
    traceback before."""
    path = tmp_path / "x.gguf"
    path.symlink_to("/proc/self/mem")
    assert_refused(run_tinyrt("info", str(path)), "x.gguf")


# -- a Hugging Face snapshot with a symlink loop ----------------------------------------------

def _hub(tmp_path, tiny) -> tuple[Path, dict]:
    """A Hugging Face cache holding org/m (huggingface_hub's layout: the snapshot's files are
    links into blobs/), and the environment that points tinyrt at it, offline."""
    hub = tmp_path / "hub"
    repo = hub / "models--org--m"
    snap, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in tiny.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    return hub, {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("spec", ["org/m", "folder"])
def test_info_refuses_a_snapshot_whose_weights_link_in_a_loop(tiny, tmp_path, spec):
    """OSError [Errno 40] traceback in `tinyrt info` before."""
    hub, env = _hub(tmp_path, tiny)
    blob = hub / "models--org--m" / "blobs" / "model.safetensors"
    _replace(blob, "loop")
    spec = str(hub / "models--org--m") if spec == "folder" else spec
    assert_refused(run_tinyrt("info", spec, env=env), "model.safetensors", "symbolic links")


@pytest.mark.parametrize("kind,words", [("fifo", "a fifo"), ("loop", "symbolic links"),
                                        ("directory", "it is a directory")])
def test_a_config_that_is_no_file_is_named(tiny, tmp_path, kind, words):
    """config.json a FIFO, a link loop or a directory: the one line says so (not only that the
    folder is no model directory)."""
    d = _copy(tiny, tmp_path)
    _replace(d / "config.json", kind)
    assert_refused(run_tinyrt("info", str(d), timeout=FIFO_SECONDS), "config.json", words)


def test_a_chat_history_that_is_no_file_is_kept_in_memory(tmp_path):
    """The chat's history file a FIFO (the prompt hung), a directory, a broken link or a link
    loop (a traceback at each line): not used; a regular file, a link to one, or none yet is."""
    from tinyrt.cli.chat import _history_file

    regular = tmp_path / "regular"
    regular.write_text("")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "link").symlink_to(regular)
    for name in ("fifo", "dir", "dangling", "loop"):
        assert not _history_file(tmp_path / name), name
    for name in ("regular", "link", "absent"):
        assert _history_file(tmp_path / name), name


CUT_SHORT = """
import os, sys
import tinyrt
llm = tinyrt.load(sys.argv[1], device="cpu", quiet=True)
print(llm.generate("hi", max_tokens=2, temperature=0), flush=True)
os.truncate(sys.argv[1], 4096)
print(llm.generate("hi again", max_tokens=2, temperature=0), flush=True)
"""


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
def test_a_model_file_cut_short_while_in_use_ends_in_one_line(tmp_path, qtype):
    """A GGUF file truncated after it is mapped (its weights are read there as the model runs):
    the next reply's read of a lost page is a bus error, which ends the process with one line
    and exit code 1, not a silent death by SIGBUS."""
    import subprocess
    import sys

    from gguf_helpers import write_gguf
    from helpers import CHATML, byte_level_tokenizer, random_weights

    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, random_weights(cfg), byte_level_tokenizer(300).to_str(), qtype=qtype,
               chat_template=CHATML)
    p = subprocess.run([sys.executable, "-c", CUT_SHORT, str(path)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and p.stdout.count("\n") == 1, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.splitlines() == [
        "tinyrt: error: a model file was cut short or changed while tinyrt was reading it (a bus "
        "error reading its weights): load the model again"], p.stderr
