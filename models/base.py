"""What every model family shares: its entry in the FAMILIES table (models/families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    """An architecture family, an entry of models.FAMILIES: its HF `model_type` and class name,
    its decoder, its name in GGUF files (`general.architecture`) and the HF config keys it
    reads in its own way."""

    model_type: str
    architecture: str                  # HF class name, for the config.json we write
    model: type                        # its decoder class (LlamaModel or a subclass)
    gguf_arch: str | None = None       # None: the same as model_type
    # whether llama.cpp's converter interleaved each head's Q/K rows (its "llama" rope layout)
    gguf_permuted_qk: bool = True
    # HF config dict -> the dict the config dataclass reads (keys this family uses otherwise)
    adapt_config: Callable[[dict], dict] = staticmethod(lambda d: d)
    # (a GGUF file's config dict of the keys every family has, its attention.sliding_window or
    # None) -> the file's config dict: what llama.cpp's files of the family leave unsaid
    gguf_config: Callable[[dict, int | None], dict] = staticmethod(lambda d, window: d)
