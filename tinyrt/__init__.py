"""tinyrt: an edge / on-device LLM chat runtime.

    import tinyrt
    llm = tinyrt.load()                      # the default model, fetched on first use
    print(llm.generate("What is the capital of France?"))
    for r in llm.stream("Tell me a story", max_tokens=64):
        print(r.text, end="", flush=True)
"""

import os

# NumPy's OpenBLAS keeps its threads spinning for about 2**28 cycles after each call before they
# sleep: after a prompt's BLAS GEMMs they took a core from the first decode steps (which use no
# BLAS) and doubled those steps' times. 2**18 cycles (about 0.1 ms) lets them sleep between calls.
# Read when OpenBLAS loads, so it takes effect where tinyrt is imported before NumPy; a value the
# user set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

from .errors import CacheFullError, ModelFormatError, TinyrtError  # noqa: E402

__version__ = "0.1.0"

# The public names, imported on first use: `import tinyrt` stays cheap (no NumPy, no kernels)
# for a program that only asks for the version or an error class, and for the CLI's --help.
_LAZY = {"LLM": "api", "load": "api", "ChatSession": "chat", "Response": "generate",
         "Timings": "generate", "SamplingParams": "sampling", "CacheOptions": "kv_cache"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tinyrt' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["LLM", "load", "ChatSession", "Response", "Timings", "SamplingParams", "CacheOptions",
           "TinyrtError", "ModelFormatError", "CacheFullError", "__version__"]
