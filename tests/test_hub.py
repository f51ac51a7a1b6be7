"""Models named by Hugging Face id, through a fake Hugging Face cache in tmp_path (huggingface_hub's
layout: models--org--name/refs/<revision> -> snapshots/<hash>/); downloads through a stand-in for
huggingface_hub that copies from a local folder. Nothing here touches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import assert_refused, run_tinyrt, write_tiny_model
from tinyrt import model_cache, registry
from tinyrt.errors import TinyrtError
from tinyrt.registry import NotFetched, choose_gguf, hf_hub_cache, resolve


def snapshot(hub: Path, repo: str, commit: str = "a" * 40, refs=("main",)) -> Path:
    """An empty snapshot folder of `repo` in the cache `hub`, named by `refs`."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for ref in refs:
        (repo_dir / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, as $HF_HOME/hub, offline."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))     # tinyrt's own cache
    path = tmp_path / "hf" / "hub"
    path.mkdir(parents=True)
    return path


def test_the_cache_is_where_huggingface_hub_keeps_it(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hf_hub_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_hub_cache() == tmp_path / "hub"


def test_an_hf_id_resolves_to_its_snapshot_by_revision(hub):
    main = write_tiny_model(snapshot(hub, "org/tiny", "1" * 40, refs=("main",)))
    v1 = write_tiny_model(snapshot(hub, "org/tiny", "2" * 40, refs=("v1.0", "refs/pr/3")))
    assert resolve("org/tiny") == main
    assert resolve("org/tiny@v1.0") == v1
    assert resolve("org/tiny@refs/pr/3") == v1
    assert resolve("org/tiny@" + "1" * 40) == main           # a commit hash as the revision
    assert resolve("hf.co/org/tiny") == main                 # as ollama writes it
    # the cache folder itself, given as a path, is its main snapshot
    assert resolve(hub / "models--org--tiny") == main
    with pytest.raises(TinyrtError, match="not in the Hugging Face cache"):
        resolve("org/tiny@v2")
    with pytest.raises(TinyrtError, match="not in the Hugging Face cache"):
        resolve("org/tiny@../../x")


def test_a_snapshot_missing_a_shard_is_not_taken_for_the_model(hub):
    snap = write_tiny_model(snapshot(hub, "org/sharded"))
    (snap / "model.safetensors").rename(snap / "model-00001-of-00002.safetensors")
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(TinyrtError, match="not in the Hugging Face cache"):
        resolve("org/sharded")
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert resolve("org/sharded") == snap


def _ggufs(snap: Path, *types: str) -> None:
    for t in types:
        (snap / f"Tiny-{t}.gguf").write_bytes(b"GGUF")


def test_a_gguf_repository_gives_the_file_its_suffix_names(hub):
    snap = snapshot(hub, "org/tiny-GGUF")
    _ggufs(snap, "Q8_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_0_4_4")
    (snap / "mmproj-Tiny-f16.gguf").write_bytes(b"GGUF")     # a vision projector: no model
    assert resolve("org/tiny-GGUF") == snap / "Tiny-Q4_K_M.gguf"     # the default type
    assert resolve("org/tiny-GGUF:q8_0") == snap / "Tiny-Q8_0.gguf"  # case-insensitive
    assert resolve("org/tiny-GGUF:Q4_0") == snap / "Tiny-Q4_0.gguf"  # the exact type first
    with pytest.raises(TinyrtError) as e:
        resolve("org/tiny-GGUF:Q4_K")
    assert "Q4_K_M" in str(e.value) and "Q4_K_S" in str(e.value)
    with pytest.raises(TinyrtError) as e:
        resolve("org/tiny-GGUF:Q2_K")                            # not cached, and offline
    assert "HF_HUB_OFFLINE" in str(e.value) and "Q8_0" in str(e.value)


def test_choosing_a_gguf_file():
    assert choose_gguf(["only-F16.gguf"], None, "r") == "only-F16.gguf"
    assert choose_gguf(["a-Q8_0.gguf", "a-Q4_1.gguf"], None, "r") == "a-Q4_1.gguf"
    assert choose_gguf(["a-Q8_0.gguf", "a-Q4_1.gguf"], "Q5_K_M", "r") is None
    with pytest.raises(TinyrtError) as e:                       # no default among them
        choose_gguf(["a-Q8_0.gguf", "a-Q6_K.gguf"], None, "org/r")
    assert "org/r:TYPE" in str(e.value) and "Q8_0, Q6_K" in str(e.value)


def test_a_directory_of_gguf_files_and_a_cache_folder_without_refs(hub, tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    _ggufs(d, "Q4_K_M", "Q8_0")
    assert resolve(d) == d / "Tiny-Q4_K_M.gguf"
    snap = snapshot(hub, "org/norefs", refs=())
    _ggufs(snap, "Q8_0")
    assert resolve(hub / "models--org--norefs") == snap / "Tiny-Q8_0.gguf"


def test_not_cached_offline_or_not_to_download(hub):
    with pytest.raises(TinyrtError) as e:
        resolve("meta-llama/Llama-3.2-1B")
    msg = str(e.value)
    assert "meta-llama/Llama-3.2-1B" in msg and str(hub) in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(NotFetched, match="tinyrt pull meta-llama/Llama-3.2-1B:Q4_0"):
        resolve("meta-llama/Llama-3.2-1B:Q4_0", download=False)


def test_unknown_names_get_a_did_you_mean(hub):
    write_tiny_model(snapshot(hub, "org/Llama-Tiny"))
    with pytest.raises(TinyrtError, match="did you mean smollm2"):
        resolve("smolm2")
    with pytest.raises(TinyrtError, match="did you mean org/Llama-Tiny"):
        resolve("org-llama-tiny")
    with pytest.raises(TinyrtError) as e:
        resolve("llama3")
    assert "known name" in str(e.value) and "Hugging Face id" in str(e.value)


class FakeHub:
    """huggingface_hub's model_info and snapshot_download over a local folder (the "repository"):
    snapshot_download copies the files allow_patterns names into the cache's layout."""

    def __init__(self, monkeypatch, repo_files: Path, commit: str = "c" * 40):
        import huggingface_hub

        self.files, self.commit, self.calls = repo_files, commit, []
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", self.model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)

    def model_info(self, repo_id, revision=None, files_metadata=False, **kw):
        names = sorted(p.relative_to(self.files).as_posix() for p in self.files.rglob("*")
                       if p.is_file())
        return SimpleNamespace(siblings=[SimpleNamespace(
            rfilename=n, size=(self.files / n).stat().st_size) for n in names])

    def snapshot_download(self, repo_id, *, revision=None, cache_dir=None, allow_patterns=None,
                          **kw):
        self.calls.append(list(allow_patterns))
        repo_dir = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
        snap = repo_dir / "snapshots" / self.commit
        for name in allow_patterns:
            if (self.files / name).is_file():
                (snap / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.files / name, snap / name)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / (revision or "main")).write_text(self.commit)
        return str(snap)


def test_download_asks_only_for_the_files_tinyrt_reads(hub, tmp_path, monkeypatch):
    repo = write_tiny_model(tmp_path / "repo")
    (repo / "generation_config.json").write_text("{}")
    for other in ("pytorch_model.bin", "README.md", "onnx/model.onnx", "original/params.json"):
        (repo / other).parent.mkdir(exist_ok=True)
        (repo / other).write_bytes(b"not for tinyrt")
    fake = FakeHub(monkeypatch, repo)
    got = resolve("org/tiny", quiet=True)
    assert fake.calls == [["config.json", "generation_config.json", "tokenizer.json",
                           "tokenizer_config.json"], ["model.safetensors"]]
    assert got == hub / "models--org--tiny" / "snapshots" / fake.commit
    assert sorted(p.name for p in got.iterdir()) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")                    # cached now: no second download
    assert resolve("org/tiny") == got and len(fake.calls) == 2


def test_download_of_a_sharded_model_takes_the_shards_its_index_names(hub, tmp_path, monkeypatch):
    repo = write_tiny_model(tmp_path / "repo")
    (repo / "model.safetensors").rename(repo / "model-00001-of-00001.safetensors")
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    (repo / "consolidated.safetensors").write_bytes(b"the same weights in another layout")
    fake = FakeHub(monkeypatch, repo)
    got = resolve("org/sharded", quiet=True)
    assert "model.safetensors.index.json" in fake.calls[0]
    assert fake.calls[1] == ["model-00001-of-00001.safetensors"]
    assert not (got / "consolidated.safetensors").exists()


def test_download_of_a_gguf_repository_takes_one_file(hub, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _ggufs(repo, "Q8_0", "Q4_K_M", "Q2_K")
    (repo / "mmproj-f16.gguf").write_bytes(b"GGUF")
    (repo / "README.md").write_text("hi")
    fake = FakeHub(monkeypatch, repo)
    assert resolve("org/tiny-GGUF:Q8_0", quiet=True).name == "Tiny-Q8_0.gguf"
    assert resolve("org/tiny-GGUF", quiet=True).name == "Tiny-Q4_K_M.gguf"
    assert fake.calls == [["Tiny-Q8_0.gguf"], ["Tiny-Q4_K_M.gguf"]]
    with pytest.raises(TinyrtError) as e:
        resolve("org/tiny-GGUF:Q5_K_M")
    assert "Q5_K_M" in str(e.value) and "Q2_K" in str(e.value) and len(fake.calls) == 2


def test_a_failed_download_is_one_line(hub, tmp_path, monkeypatch):
    import huggingface_hub

    FakeHub(monkeypatch, tmp_path)
    RepositoryNotFoundError = type("RepositoryNotFoundError", (OSError,), {})

    def fails(error):
        def model_info(*a, **kw):
            raise error
        return model_info

    for error, words in [(ConnectionError("Name or service not known\nmore"), "Name or service"),
                         (RepositoryNotFoundError("404 Client Error.\nRequest ID: x"), "no such model")]:
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", fails(error))
        with pytest.raises(TinyrtError) as e:
            resolve("org/nothing")
        msg = str(e.value)
        assert "\n" not in msg and "could not be downloaded" in msg and words in msg, msg


def test_every_command_takes_an_hf_id(hub, tmp_path):
    """convert and info resolve MODEL as generate does (offline, from the fake cache); a
    command refuses a misspelt name with one line."""
    import os

    write_tiny_model(snapshot(hub, "org/tiny"))
    env = {k: os.environ[k] for k in ("HF_HOME", "HF_HUB_OFFLINE", "XDG_CACHE_HOME")}
    p = run_tinyrt("info", "org/tiny", env=env)
    assert p.returncode == 0 and "num_key_value_heads" in p.stdout, p.stderr
    # not here: refused in one line that says how to fetch it, nothing downloaded
    assert_refused(run_tinyrt("info", "org/elsewhere", env=env), "tinyrt pull org/elsewhere")
    assert_refused(run_tinyrt("info", env=env), "not fetched", "tinyrt pull")  # the default
    p = run_tinyrt("convert", "org/tiny", str(tmp_path / "out"), "--method", "none", env=env)
    assert p.returncode == 0 and (tmp_path / "out" / "config.json").is_file(), p.stderr
    assert_refused(run_tinyrt("convert", "smolm2", str(tmp_path / "o2"), env=env), "SRC",
                   "did you mean smollm2")
    assert_refused(run_tinyrt("info", "x" * 300, env=env), "too long")


# --- tinyrt list / rm ----------------------------------------------------------------------

@pytest.fixture
def caches(hub, tmp_path):
    """tinyrt's cache holding the default model's file (recorded), a leftover of a killed
    fetch and a file tinyrt did not write; the Hugging Face cache holding a model."""
    import os

    gguf = model_cache.gguf_dir()
    gguf.mkdir(parents=True)
    known = registry.KNOWN_MODELS[registry.DEFAULT_MODEL]
    ours = gguf / Path(known.member).name
    ours.write_bytes(b"GGUF" + bytes(2_000_000))
    model_cache._write_record(ours, known.sha256, known.source, wrote=True)
    (gguf / ".fetch-abc").mkdir()
    model_cache.mark_fetch(gguf / ".fetch-abc", ["partial"], ["work"])
    (gguf / ".fetch-abc" / "partial").write_bytes(bytes(1000))
    (gguf / ".fetch-abc" / "work").mkdir()
    (gguf / ".fetch-abc" / "work" / "pip-x").write_bytes(bytes(10))
    (gguf / "mine.gguf").write_bytes(b"the user's own")
    snap = write_tiny_model(snapshot(hub, "org/tiny"))
    env = {k: os.environ[k] for k in ("HF_HOME", "HF_HUB_OFFLINE", "XDG_CACHE_HOME")}
    return SimpleNamespace(ours=ours, snap=snap, gguf=gguf, env=env, known=known)


def test_list_shows_both_caches(caches):
    p = run_tinyrt("list", env=caches.env)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.strip()}
    assert "2.0 MB" in rows[caches.known.name] and caches.known.package in rows[caches.known.name]
    assert "huggingface" in rows["org/tiny"] and "llama" in rows["org/tiny"]
    assert ".fetch-abc" in rows and "mine.gguf" not in p.stdout
    assert "compiled kernels" in p.stdout


def test_rm_asks_and_removes_only_tinyrt_copies(caches):
    env = caches.env
    hf_before = sorted(p.name for p in caches.snap.iterdir())
    # stdin is not a terminal here: no confirmation, nothing removed
    assert_refused(run_tinyrt("rm", caches.known.name, env=env), "confirmation", "-y")
    assert caches.ours.exists()
    assert_refused(run_tinyrt("rm", "org/tiny", "-y", env=env), "Hugging Face cache", "hf cache rm")
    assert_refused(run_tinyrt("rm", "mine.gguf", "-y", env=env), "not in tinyrt's cache")
    assert_refused(run_tinyrt("rm", "-y", env=env), "--all")
    p = run_tinyrt("rm", "default", "-y", env=env)              # an alias of the known name
    assert p.returncode == 0 and "removed" in p.stdout, p.stderr
    assert not caches.ours.exists() and not Path(str(caches.ours) + ".json").exists()
    p = run_tinyrt("rm", "--all", "-y", env=env)
    assert p.returncode == 0, p.stderr
    assert sorted(p.name for p in caches.gguf.iterdir()) == ["mine.gguf"]
    assert sorted(p.name for p in caches.snap.iterdir()) == hf_before


def test_a_damaged_hf_entry_is_one_row_of_the_list(caches):
    """A repository of the Hugging Face cache whose refs/main is a folder, or not text: `tinyrt
    list` shows it as damaged and lists the rest; `tinyrt rm` of a tinyrt copy still works. A
    ref too long for a file name is no snapshot (not an OSError)."""
    hub = registry.hf_hub_cache()
    for repo, damage in [("org/folder", lambda f: f.mkdir()),
                         ("org/binary", lambda f: f.write_bytes(b"\xff\x00" * 8)),
                         ("org/long", lambda f: f.write_text("a" * 256))]:
        snap = write_tiny_model(snapshot(hub, repo))
        refs_main = snap.parent.parent / "refs" / "main"
        refs_main.unlink(missing_ok=True)
        damage(refs_main)
    p = run_tinyrt("list", env=caches.env)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.strip()}
    assert "huggingface" in rows["org/tiny"] and caches.known.name in rows
    assert "damaged" in rows["org/folder"] and "damaged" in rows["org/binary"]
    for command in ("info", "generate"):
        p = run_tinyrt(command, "org/long", env=caches.env)
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 1, p.stderr
    p = run_tinyrt("rm", caches.known.name, "-y", env=caches.env)
    assert p.returncode == 0 and not caches.ours.exists(), p.stderr


def test_rm_leaves_a_running_fetch_alone(caches):
    """`rm --all -y` while a fetch runs (its folder's mark locked, as `pull` holds it) removes
    the rest and leaves the live folder whole; `list` tells it from a killed one's. Once the
    fetch ends its folder goes with it."""
    files = ["model.gguf.part", "pip.log"]
    with model_cache.fetch_folder(caches.gguf, files, ["work"]) as live:
        (live / "model.gguf.part").write_bytes(bytes(100))
        (live / "work").mkdir()
        p = run_tinyrt("list", env=caches.env)
        assert "a fetch running now" in p.stdout and "an interrupted fetch" in p.stdout, p.stdout
        p = run_tinyrt("rm", live.name, "-y", env=caches.env)
        assert p.returncode == 1 and "running now" in p.stderr, p.stderr
        p = run_tinyrt("rm", "--all", "-y", env=caches.env)
        assert p.returncode == 0 and "running now" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
        assert (live / "model.gguf.part").exists() and (live / "work").is_dir()
        assert not (caches.gguf / ".fetch-abc").exists() and not caches.ours.exists()
    assert not live.exists()
    assert sorted(p.name for p in caches.gguf.iterdir()) == ["mine.gguf"]


def test_removal_is_idempotent(caches):
    """A fetch folder removed twice (two `rm --all -y` at once), or one whose mark lists
    itself: the second removal finds it gone, which is no error."""
    selfish = caches.gguf / ".fetch-self"
    selfish.mkdir()
    model_cache.mark_fetch(selfish, [model_cache.FETCH_MARK, "partial"], []).close()
    (selfish / "partial").write_bytes(b"x")
    entries = {m.name: m for m in model_cache.tinyrt_cached()}
    for name in (".fetch-abc", ".fetch-self", caches.known.name):
        model_cache.remove_cached(entries[name])
        model_cache.remove_cached(entries[name])
    assert sorted(p.name for p in caches.gguf.iterdir()) == ["mine.gguf"]


@pytest.mark.parametrize("name", ["\ud800x", "a\u0000b", "../x", "/etc/passwd"])
def test_a_mark_listing_a_name_the_system_cannot_take_is_no_fetch_of_ours(caches, name):
    """A forged mark whose list holds an unencodable name or a NUL: the folder is not taken as
    tinyrt's (listed, removed) and nothing fails."""
    d = caches.gguf / ".fetch-forged"
    d.mkdir()
    (d / model_cache.FETCH_MARK).write_text(json.dumps({"files": [name], "folders": []}))
    assert ".fetch-forged" not in [m.name for m in model_cache.tinyrt_cached()]
    p = run_tinyrt("rm", "--all", "-y", env=caches.env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert d.is_dir()


def test_a_fetch_another_remover_is_removing_is_taken_as_removed(caches, monkeypatch):
    """Remover A holds a killed fetch's folder (its lock, mid-removal) when remover B comes to
    it: B finds it taken (renamed away), which is done, not a running fetch nor a folder that
    is not tinyrt's."""
    import threading

    entry = next(m for m in model_cache.tinyrt_cached() if m.name == ".fetch-abc")
    removing, release = threading.Event(), threading.Event()
    rmtree = shutil.rmtree

    def slow_rmtree(path, **kwargs):
        removing.set()
        release.wait(10)
        rmtree(path, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    errors = []

    def remover_a():
        try:
            model_cache.remove_cached(entry)
        except Exception as e:                    # (reported below)
            errors.append(e)

    a = threading.Thread(target=remover_a)
    a.start()
    assert removing.wait(10)
    try:
        model_cache.remove_cached(entry)          # remover B: no error
    finally:
        release.set()
        a.join(10)
    assert not errors and not any(p.name.startswith(".fetch-") for p in caches.gguf.iterdir())
