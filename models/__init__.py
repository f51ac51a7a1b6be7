"""Model configuration, weight files and the Llama/Mistral decoder."""

from __future__ import annotations

from pathlib import Path

from tinyrt.errors import ModelFormatError

from .config import LlamaConfig, QuantConfig
from .llama import LINEARS, LlamaModel, expected_shapes, linear_shapes
from .weights import SafetensorsFile, WeightStore, write_safetensors


def load_model(directory: str | Path, backend) -> LlamaModel:
    """Load a model directory (config.json + safetensors weights) onto `backend`."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelFormatError(f"{directory} is not a model directory")
    config = LlamaConfig.from_file(directory / "config.json")
    return LlamaModel(config, WeightStore(directory), backend)


__all__ = ["LlamaConfig", "QuantConfig", "LlamaModel", "expected_shapes", "linear_shapes", "LINEARS", "load_model",
           "SafetensorsFile", "WeightStore", "write_safetensors"]
