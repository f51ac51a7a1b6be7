"""Conversion sources: a GGUF file or an HF directory, seen the same way — an HF config dict, float
tensors under HF names, and the tokenizer files to write beside them."""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from tinyrt.errors import ModelFormatError
from tinyrt.gguf_tokenizer import tokenizer_files
from tinyrt.models.gguf import GGUFFile
from tinyrt.models.weights import WeightStore, all_finite, is_mapped
from tinyrt.paths import (MAX_TOKENIZER_BYTES, read_bytes, read_json, shown_path, stat_or_none,
                          user_path)

# files of an HF directory that travel with the weights, as they are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "added_tokens.json")


@dataclass
class Source:
    path: Path
    config: dict
    shapes: dict[str, tuple[int, ...]]              # HF name -> shape, in file order
    get: Callable[[str], np.ndarray]                # HF name -> float array in HF layout, read
                                                    # once (read_once): the caller's own
    files: dict[str, str | bytes] = field(default_factory=dict)  # file name -> contents
    generation_config: dict | None = None
    quantized: list[str] = field(default_factory=list)   # quantized types of its linear layers


def read_once(get: Callable[[str], np.ndarray], release: Callable[[], None]
              ) -> Callable[[str], np.ndarray]:
    """`get` for a conversion, which reads each tensor once: each array is the caller's own (a
    view of the mapped file is copied) and the file's pages leave the resident set after each
    read. Pages read from a map stay resident until dropped, so a conversion would otherwise
    end holding the whole source file in its RSS. A tensor of NaN or inf is refused (the
    runtime refuses it at load; quantized, it could turn into finite nonsense)."""
    def read(name: str) -> np.ndarray:
        a = get(name)
        a = np.array(a) if is_mapped(a) else a
        release()
        if not all_finite(a):
            raise ModelFormatError(f"the source's tensor {name!r} holds NaN or infinite values")
        return a
    return read


def open_source(path: str | Path) -> Source:
    """A GGUF file or an HF directory (config.json + safetensors)."""
    path = user_path(path, "SRC")
    info = stat_or_none(path, "SRC")
    if info is None:
        raise ModelFormatError(f"SRC {shown_path(path)} does not exist")
    if stat.S_ISDIR(info.st_mode):
        return hf_source(path)
    if not stat.S_ISREG(info.st_mode):          # a FIFO or a device: nothing to map
        raise ModelFormatError(f"SRC {shown_path(path)} is neither a GGUF file nor an HF directory")
    return gguf_source(path)


def gguf_source(path: Path) -> Source:
    g = GGUFFile(path)
    files = tokenizer_files(g)
    cfg = g.config()
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    quantized = sorted(t.name for t in g.layer_types() if t.name not in ("F32", "F16", "BF16"))
    return Source(path, cfg, g.hf_shapes(), read_once(g.hf_tensor, g.release), files, gen or None,
                  quantized)


def hf_source(path: Path) -> Source:
    cfg = read_json(path / "config.json", missing_ok=True)
    if cfg is None:
        raise ModelFormatError(f"{shown_path(path)} has no config.json: not an HF model directory")
    if cfg.get("quantization_config"):
        raise ModelFormatError(f"{path} is already quantized; convert from the float checkpoint")
    store = WeightStore(path)
    names = [n for n in store.keys() if not n.endswith("rotary_emb.inv_freq")]
    files = {name: data for name in TOKENIZER_FILES
             if (data := read_bytes(path / name, limit=MAX_TOKENIZER_BYTES, missing_ok=True,
                                    error=ModelFormatError)) is not None}
    gen = read_json(path / "generation_config.json", missing_ok=True)
    return Source(path, cfg, {n: store.shape(n) for n in names},
                  read_once(store.get_float, store.release), files, gen)
