"""Model configuration, weight files and the Llama/Mistral decoder."""

from __future__ import annotations

import ctypes
from pathlib import Path

from tinyrt.errors import ModelFormatError
from tinyrt.memory import ensure_fits

from .config import LlamaConfig, QuantConfig
from .llama import LINEARS, LlamaModel, expected_shapes, linear_shapes
from .weights import SafetensorsFile, WeightStore, write_safetensors


def load_model(directory: str | Path, backend) -> LlamaModel:
    """Load a model directory (config.json + safetensors weights) onto `backend`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelFormatError(f"{directory} is not a model directory")
    config = LlamaConfig.from_file(directory / "config.json")
    weights = WeightStore(directory)
    if backend.host_memory:              # its weights end up in RAM, whatever their form
        ensure_fits(f"the model in {directory}", weights.nbytes)
    model = LlamaModel(config, weights, backend)
    trim_heap()
    return model


def trim_heap() -> None:
    """Hand the heap memory freed by the temporaries of a load back to the OS (glibc keeps it
    otherwise: about 30 MB for the default model). A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


__all__ = ["LlamaConfig", "QuantConfig", "LlamaModel", "expected_shapes", "linear_shapes", "LINEARS", "load_model",
           "SafetensorsFile", "WeightStore", "write_safetensors"]
