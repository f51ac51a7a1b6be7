"""tinyrt.paths: names the user types and the text files tinyrt reads, each bad one a TinyrtError
of one line naming it; through the CLI, the bar of assert_refused."""

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_refused, run_tinyrt, write_tiny_model
from tinyrt.errors import TinyrtError
from tinyrt.paths import read_bytes, read_json, read_text, stat_or_none, user_path

LONG = "x" * 300                          # past NAME_MAX (255) of every common filesystem


@pytest.fixture
def odd(tmp_path):
    """Paths of every kind that is not a readable text file, by name."""
    (tmp_path / "file").write_text("text")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 20)                # sparse: large, nothing on disk
    (tmp_path / "latin1").write_bytes("café".encode("latin-1"))
    return {"missing": tmp_path / "missing", "dir": tmp_path, "fifo": fifo, "zero": "/dev/zero",
            "big": big, "latin1": tmp_path / "latin1", "under a file": tmp_path / "file" / "x",
            "long": tmp_path / LONG, "no user": "~no_such_user_here/x"}


@pytest.mark.parametrize("kind, words", [
    ("missing", "no such file"), ("dir", "directory"), ("fifo", "FIFO"), ("zero", "device"),
    ("big", "more than"), ("latin1", "not UTF-8"), ("under a file", "not a directory"),
    ("long", "too long"), ("no user", "no_such_user_here")])
def test_read_text_refuses_with_one_line(odd, kind, words):
    with pytest.raises(TinyrtError) as e:
        read_text(user_path(odd[kind], "--text"), "--text", limit=1000)
    line = str(e.value)
    assert "\n" not in line and "--text" in line and words.lower() in line.lower(), line


def test_read_helpers_on_good_and_missing_files(tmp_path):
    (tmp_path / "a.json").write_text('{"k": [1, 2]}')
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert read_json(tmp_path / "a.json") == {"k": [1, 2]}
    assert read_json(tmp_path / "nothing.json", missing_ok=True) is None
    assert read_bytes(tmp_path / "a.json", limit=13) == b'{"k": [1, 2]}'
    with pytest.raises(TinyrtError, match="more than"):
        read_bytes(tmp_path / "a.json", limit=12)
    with pytest.raises(TinyrtError, match="JSON object"):
        read_json(tmp_path / "list.json")
    with pytest.raises(TinyrtError, match="not valid JSON"):
        read_json(tmp_path / "deep.json")
    assert stat_or_none(tmp_path / "nothing") is None
    assert user_path("~/x") == user_path(os.path.expanduser("~/x"))
    for bad in ("", "a\0b"):
        with pytest.raises(TinyrtError, match="not a file name"):
            user_path(bad, "--calib")


# odd names: long ones, bytes that are not UTF-8 (as os.fsdecode gives them), ~ and ~user forms,
# control characters, nested under a regular file; a regular file and a FIFO by their names
_parts = st.one_of(
    st.text(min_size=1, max_size=300),
    st.binary(min_size=1, max_size=40).map(os.fsdecode),
    st.sampled_from(["~", "~root", "~no_such_user_here", "..", ".", "/", "\n", "x" * 256,
                     "file", "fifo"]),
)
_names = st.lists(_parts, min_size=1, max_size=3).map("/".join)


@pytest.fixture(scope="module")
def nest(tmp_path_factory):
    d = tmp_path_factory.mktemp("names")
    (d / "file").write_text("a regular file")
    os.mkfifo(d / "fifo")
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=_names, under=st.sampled_from(["", "file/"]), absolute=st.booleans())
def test_odd_names_give_text_or_one_clear_line(nest, name, under, absolute):
    """Whatever the name, reading it gives its text or a TinyrtError of one line; nothing else
    escapes, and nothing blocks (FIFOs and devices are refused before any read)."""
    full = (f"{nest}/{under}{name}" if absolute else name).replace("\0", "")
    try:
        path = user_path(full, "--text")
        stat_or_none(path, "--text")
        text = read_text(path, "--text", limit=1 << 16)
    except TinyrtError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
    else:
        assert isinstance(text, str)


# -- through the command line ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("paths") / "m")


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "under a file", "long", "no user"])
def test_ppl_text_and_convert_calib_refuse_odd_files(model, odd, tmp_path, kind):
    """/dev/zero and a FIFO are refused at once (not read without end, not waited on); the other
    odd paths with one line naming the flag."""
    p = run_tinyrt("ppl", "-m", str(model), "--text", str(odd[kind]), timeout=30)
    assert_refused(p, "--text")
    p = run_tinyrt("convert", str(model), str(tmp_path / "out"), "--calib", str(odd[kind]),
                   timeout=30)
    assert_refused(p, "--calib")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_odd_src_and_out(model, odd, tmp_path):
    assert_refused(run_tinyrt("convert", "~no_such_user_here/m", str(tmp_path / "o")), "SRC",
                   "no_such_user_here")
    assert_refused(run_tinyrt("convert", str(odd["long"]), str(tmp_path / "o")), "SRC", "too long")
    assert_refused(run_tinyrt("convert", str(odd["fifo"]), str(tmp_path / "o")), "SRC")
    assert_refused(run_tinyrt("convert", str(model), str(odd["long"]), "--method", "none"),
                   "OUT", "too long")
    assert_refused(run_tinyrt("convert", str(model), str(odd["under a file"]), "--method", "none"),
                   "OUT", "not a directory")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja", "tokenizer.json"])
def test_a_model_file_that_is_a_directory_is_refused(model, tmp_path, name):
    d = tmp_path / "m"
    d.mkdir()
    for f in model.iterdir():
        os.symlink(f, d / f.name)
    if name == "chat_template.jinja":              # read where the config has no template
        config = json.loads((model / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (d / "tokenizer_config.json").unlink()
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / name).unlink(missing_ok=True)
    (d / name).mkdir()
    assert_refused(run_tinyrt("generate", "-m", str(d), "hi", "-n", "2"), name, "directory")
