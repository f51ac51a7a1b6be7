"""tinyrt: an edge / on-device LLM chat runtime.

    import tinyrt
    llm = tinyrt.load()                      # the default model, fetched on first use
    print(llm.generate("What is the capital of France?"))
    for r in llm.stream("Tell me a story", max_tokens=64):
        print(r.text, end="", flush=True)
"""

from .api import LLM, load
from .errors import CacheFullError, ModelFormatError, TinyrtError
from .generate import Response, Timings
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "load", "Response", "Timings", "SamplingParams", "TinyrtError",
           "ModelFormatError", "CacheFullError", "__version__"]
