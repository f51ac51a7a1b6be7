"""Resource bounds are checked before memory is touched: a KV cache or a model that does not fit
gets an error with the figures (needed, available)."""

import numpy as np
import pytest

import tinyrt
from tinyrt import memory
from tinyrt.errors import TinyrtError
from tinyrt.kernels import get_backend
from tinyrt.kv_cache import make_cache

from helpers import write_tiny_model


def test_available_memory_is_read():
    avail = memory.available_bytes()
    assert avail is None or avail > 2**20


@pytest.mark.parametrize("policy", ["dense", "sink", "h2o"])
def test_a_cache_that_does_not_fit_is_refused_before_allocating(policy):
    be = get_backend("reference")
    with pytest.raises(TinyrtError, match=r"KV cache of 1,000,000,000,000 tokens needs [\d,]+ MiB but "
                                          r"[\d,]+ MiB of memory is available: choose a smaller"):
        make_cache(policy, 32, 8, 128, 10**12, be)
    assert make_cache(policy, 2, 2, 16, 64, be).capacity == 64


def test_a_model_larger_than_free_memory_is_refused(tmp_path, monkeypatch):
    d = write_tiny_model(tmp_path / "m")
    monkeypatch.setattr(memory, "available_bytes", lambda: 100_000)
    with pytest.raises(TinyrtError, match=r"the model in .* needs [\d,]+ MiB but 0 MiB of memory is "
                                          r"available"):
        tinyrt.load(d, device="reference", quiet=True)
    monkeypatch.setattr(memory, "available_bytes", lambda: None)       # unknown: no check
    llm = tinyrt.load(d, device="reference", quiet=True)
    assert np.isfinite(llm.model.backend.to_numpy(llm.model.forward([1, 2], llm.cache))).all()
