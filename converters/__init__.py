"""Model conversion: GGUF files and HF directories in, tinyrt model directories out.

The runtime never imports this package; front ends call it to convert a model on first use.
"""

from .conversion import FLOAT_DTYPES, convert
from tinyrt.models.gguf import GGUFFile
from .sources import Source, open_source

__all__ = ["FLOAT_DTYPES", "convert", "GGUFFile", "Source", "open_source"]
