"""Resource bounds are checked before memory is touched: a KV cache or a model that does not fit
gets an error with the figures (needed, available)."""

import numpy as np
import pytest

import tinyrt
from tinyrt import memory
from tinyrt.errors import TinyrtError
from tinyrt.kernels import get_backend
from tinyrt.kv_cache import POLICIES, KVLayout
from tinyrt.kv_options import CacheOptions

from helpers import status_kib, write_tiny_model


def test_available_memory_is_read():
    avail = memory.available_bytes()
    assert avail is None or avail > 2**20


@pytest.mark.parametrize("policy", ["dense", "sink", "h2o"])
def test_a_cache_that_does_not_fit_is_refused_before_allocating(policy):
    be = get_backend("reference")
    with pytest.raises(TinyrtError, match=r"KV cache of 1,000,000,000,000 tokens needs [\d,]+ MiB but "
                                          r"[\d,]+ MiB of memory is available: choose a smaller"):
        POLICIES[policy](KVLayout(32, 8, 128, [np.ones(64)] * 32), 10**12, be, CacheOptions(policy))
    assert POLICIES[policy](KVLayout(2, 2, 16, [np.ones(8)] * 2), 64, be, CacheOptions(policy)).capacity == 64


def test_a_model_larger_than_free_memory_is_refused(tmp_path, monkeypatch):
    d = write_tiny_model(tmp_path / "m")
    monkeypatch.setattr(memory, "available_bytes", lambda: 100_000)
    with pytest.raises(TinyrtError, match=r"the model in .* needs [\d,]+ MiB but 0 MiB of memory is "
                                          r"available"):
        tinyrt.load(d, device="reference", quiet=True)
    monkeypatch.setattr(memory, "available_bytes", lambda: None)       # unknown: no check
    llm = tinyrt.load(d, device="reference", quiet=True)
    assert np.isfinite(llm.model.backend.to_numpy(llm.model.forward([1, 2], llm.cache))).all()


def test_a_vocabulary_of_a_billion_tokens_is_refused(tmp_path):
    """A config.json and a GGUF tokenizer that claim 10**9 tokens: refused from the claim, under
    an address-space limit that any allocation of that size would break."""
    import json
    import resource
    import struct

    from gguf_helpers import write_gguf
    from helpers import CHATML, byte_level_tokenizer, random_weights, tiny_config
    from tinyrt.converters.sources import open_source

    cfg = tiny_config()
    d = write_tiny_model(tmp_path / "m", cfg)
    claimed = dict(json.loads((d / "config.json").read_text()), vocab_size=10**9)
    (d / "config.json").write_text(json.dumps(claimed))
    path = tmp_path / "m.gguf"
    write_gguf(path, cfg, random_weights(cfg), byte_level_tokenizer(300).to_str(), chat_template=CHATML)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    assert struct.unpack_from("<IIQ", raw, at) == (9, 8, 320)           # array of 320 strings
    struct.pack_into("<Q", raw, at + 8, 10**9)
    path.write_bytes(bytes(raw))
    used = status_kib("VmSize") << 10
    limit = resource.getrlimit(resource.RLIMIT_AS)        # the table alone would take 384 GB
    resource.setrlimit(resource.RLIMIT_AS, (used + (4 << 30), limit[1]))
    try:
        with pytest.raises(TinyrtError, match=r"the config needs \[1000000000, "):
            tinyrt.load(d, device="reference", quiet=True)
        with pytest.raises(TinyrtError, match="not a readable GGUF file"):
            open_source(path)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)


LIMITS = [pytest.param(("RLIMIT_AS", "VmSize"), id="ulimit -v"),
          pytest.param(("RLIMIT_DATA", "VmData"), id="ulimit -d")]


@pytest.fixture(params=LIMITS)
def rlimit(request):
    import resource

    return getattr(resource, request.param[0]), request.param[1], request.node.callspec.id


def test_the_process_s_limits_are_read_as_well_as_free_memory(rlimit):
    """Under `ulimit -v` or `ulimit -d` the machine's free memory is not what the process may
    take: ensure_fits names the limit that is short."""
    import resource

    kind, field, name = rlimit
    limit = resource.getrlimit(kind)
    resource.setrlimit(kind, (status_kib(field) * 1024 + (1 << 30), limit[1]))
    try:
        (room, what), = [r for r in memory.process_rooms() if name in r[1]]
        left = (1 << 30) - memory.HEADROOM          # (kept for the kernels' compiling)
        assert left - (64 << 20) < room <= left
        memory.ensure_fits("a thing", 256 << 20)
        with pytest.raises(TinyrtError, match=rf"a thing needs 2,048 MiB but [\d,]+ MiB is left "
                                              rf"under the process's .*\({name}\): lower it"):
            memory.ensure_fits("a thing", 2 << 30, ": lower it")
    finally:
        resource.setrlimit(kind, limit)


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_s_limit_is_read(tmp_path, version):
    """A container's limit (cgroup v2's memory.max, v1's memory.limit_in_bytes) less what its
    group uses, its droppable page cache aside; a parent's tighter limit counts, none set is
    none."""
    proc = tmp_path / "cgroup"
    base = tmp_path if version == 2 else tmp_path / "memory"
    proc.write_text("0::/a/b\n" if version == 2 else "4:memory:/a/b\n0::/\n")
    files = {2: ("memory.max", "memory.current", "inactive_file", "max"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
                 str(2**63 - 4096))}[version]
    limit_file, use_file, cache_field, unlimited = files
    for group, limit in ((base, unlimited), (base / "a", unlimited), (base / "a" / "b", 8 << 30)):
        group.mkdir(parents=True, exist_ok=True)
        (group / limit_file).write_text(f"{limit}\n")
        (group / use_file).write_text(f"{3 << 30}\n")
        (group / "memory.stat").write_text(f"anon 1\n{cache_field} {1 << 30}\n")
    assert memory._cgroup_room(str(tmp_path), str(proc)) == 6 << 30
    (base / "a" / limit_file).write_text(f"{4 << 30}\n")
    assert memory._cgroup_room(str(tmp_path), str(proc)) == 2 << 30
    for group in (base / "a", base / "a" / "b"):
        (group / limit_file).write_text(f"{unlimited}\n")
    assert memory._cgroup_room(str(tmp_path), str(proc)) is None


def test_an_allocation_that_fails_is_one_line_naming_the_option(tmp_path, monkeypatch):
    """Where no check could see it coming (the limits unread here), the KV cache's failed
    allocation under `ulimit -v` is one TinyrtError naming --kv-size, not an OSError."""
    import resource

    d = write_tiny_model(tmp_path / "m")
    monkeypatch.setattr(memory, "process_rooms", lambda: [])
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    limit = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (status_kib("VmSize") * 1024 + (1 << 30), limit[1]))
    try:
        with pytest.raises(TinyrtError, match=r"a KV cache of 16,000,000 tokens ran out of "
                                              r"memory.*--kv-size"):
            tinyrt.load(d, device="reference", quiet=True, kv_size=16_000_000)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)


def test_a_cache_past_ulimit_is_refused_in_one_line(tmp_path):
    """`tinyrt generate -c 16000000` under `ulimit -v`: one line, the limit and the option."""
    import subprocess
    import sys

    from helpers import assert_refused

    d = write_tiny_model(tmp_path / "m")

    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))

    p = subprocess.run([sys.executable, "-m", "tinyrt", "generate", str(d), "-c", "16000000",
                        "hi"], capture_output=True, text=True, preexec_fn=limit, timeout=300)
    p.peak_bytes = 0
    assert_refused(p, "16,000,000 tokens", "ulimit -v", "--kv-size")
