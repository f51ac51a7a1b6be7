"""Model conversion: GGUF files and HF directories in, tinyrt model directories out.

The runtime never imports this package; front ends call it to convert a model on first use.
"""

import importlib

# name -> module, imported on first use: the command line imports this package for its help text,
# and the converters' compiled quantizer would load Numba into every command's start
_EXPORTS = {"FLOAT_DTYPES": ".conversion", "convert": ".conversion", "GGUFFile": "tinyrt.models.gguf",
            "Source": ".sources", "open_source": ".sources"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
