"""Model configuration, weight files, the decoders of each family (FAMILIES) and their loader."""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import numpy as np

from tinyrt.errors import ModelFormatError
from tinyrt.memory import ensure_fits

from .config import ModelConfig, QuantConfig
from .families import FAMILIES, family
from .llama import Layer, LlamaModel
from .weights import DirectoryWeights, ModelWeights, SafetensorsFile, WeightStore, write_safetensors


def model_class(cfg: ModelConfig) -> type[LlamaModel]:
    """The decoder class of a config's family."""
    return family(cfg.model_type).model


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor of a model of this config (see LlamaModel)."""
    return model_class(cfg).expected_shapes(cfg)


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Decoder-layer linear module name (HF) -> (out, in)."""
    return model_class(cfg).linear_shapes(cfg)


def open_weights(path: str | Path, dtype: str | None = None) -> tuple[ModelConfig, ModelWeights]:
    """The config and weights of a model directory (config.json + safetensors, float or AWQ)
    or of a GGUF file (run in place: its quantized tensors as they are), checked against each
    other. `dtype` "f16" / "f32": float weights throughout (see ModelWeights)."""
    path = Path(path)
    if path.is_file():
        from .gguf import GGUFWeights

        weights = GGUFWeights(path, dtype)
        return weights.config, weights
    if not path.is_dir():
        raise ModelFormatError(f"{path} is neither a model directory nor a GGUF file")
    config = ModelConfig.from_file(path / "config.json")
    return config, DirectoryWeights(path, config, dtype)


def load_model(path: str | Path, backend, dtype: str | None = None) -> LlamaModel:
    """Load a model directory or a GGUF file (open_weights) onto `backend`, as the decoder of
    its family."""
    config, weights = open_weights(path, dtype)
    if backend.host_memory:              # its weights end up in RAM, whatever their form
        ensure_fits(f"the model in {path}", weights.nbytes)
    model = model_class(config)(config, weights, backend)
    trim_heap()
    return model


def warm_up(model: LlamaModel, cache, past: bool = False) -> None:
    """Run `model`'s kernels once, on its empty KV cache `cache` (emptied again after), where
    its backend compiles them on first use (Numba: tens of seconds the first time on a machine,
    then a read of its cache): so that this time is spent at load, not inside a reply's
    timings. The backend says what to run (see CpuBackend.warm_up): a few layers, not the
    whole model, so that a warm start pays milliseconds for it. `past`: then as many tokens as
    the cache holds, and one more (a small streaming cache: its evictions call kernels too)."""
    how = getattr(model.backend, "warm_up", None)
    if how is None:                        # (NumPy, nothing to compile)
        return
    layers, counts = how(model.layers)
    part = copy.copy(model)                # the same weights and backend, fewer layers
    part.layers = layers
    if past:
        counts = (*counts, cache.capacity, 1)
    try:
        for n in counts:
            if cache.fits(n):              # (a tiny dense cache: nor will a reply's)
                part.forward(np.zeros(n, np.int64), cache)
    finally:
        cache.reset()


def trim_heap() -> None:
    """Hand the heap memory freed by the temporaries of a load back to the OS (glibc keeps it
    otherwise: about 30 MB for the default model). A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


__all__ = ["ModelConfig", "QuantConfig", "FAMILIES", "family", "model_class", "Layer", "LlamaModel",
           "expected_shapes", "linear_shapes", "open_weights", "load_model", "warm_up",
           "ModelWeights", "DirectoryWeights", "SafetensorsFile", "WeightStore",
           "write_safetensors"]
