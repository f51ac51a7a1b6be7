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
