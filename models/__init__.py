"""Model configuration, weight files, the decoders of each family (FAMILIES) and their loader."""

from __future__ import annotations

import ctypes
from pathlib import Path

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


def trim_heap() -> None:
    """Hand the heap memory freed by the temporaries of a load back to the OS (glibc keeps it
    otherwise: about 30 MB for the default model). A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


__all__ = ["ModelConfig", "QuantConfig", "FAMILIES", "family", "model_class", "Layer", "LlamaModel",
           "expected_shapes", "linear_shapes", "open_weights", "load_model", "ModelWeights",
           "DirectoryWeights", "SafetensorsFile", "WeightStore", "write_safetensors"]
