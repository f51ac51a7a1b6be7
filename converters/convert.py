"""`tinyrt convert`: a GGUF file or HF directory in, a model directory (DESIGN.md) out."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from tinyrt.errors import ModelFormatError, TinyrtError
from tinyrt.models.config import LlamaConfig
from tinyrt.models.llama import expected_shapes
from tinyrt.models.weights import write_safetensors

from .sources import Source, open_source
from .writer import atomic_directory, write_json

FLOAT_DTYPES = {"f16": np.float16, "f32": np.float32}
TORCH_DTYPE_NAMES = {"f16": "float16", "f32": "float32"}

# progress(done, total, what): called as tensors are written
Progress = Callable[[int, int, str], None]


def check_tensors(source: Source, cfg: LlamaConfig) -> list[str]:
    """The tensors to write, in the source's order; a clear error for any missing, misshapen or
    unexpected tensor, before anything is written."""
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in source.shapes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(f"{source.path}: missing tensors {', '.join(missing[:3])}{more}")
    names = []
    for name, shape in source.shapes.items():
        if name not in expected:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # a tied head some checkpoints store anyway
            raise ModelFormatError(f"{source.path}: unexpected tensor {name!r} for a "
                                   f"{cfg.model_type} model (unsupported variant?)")
        if tuple(shape) != expected[name]:
            raise ModelFormatError(f"{source.path}: tensor {name!r} has shape {list(shape)}, "
                                   f"the config needs {list(expected[name])}")
        names.append(name)
    return names


def convert(src: str | Path, out: str | Path, *, dtype: str = "f16", force: bool = False,
            progress: Progress | None = None) -> Path:
    """Convert `src` into the model directory `out` with float weights of `dtype` (f16 or f32).
    Written to a temporary directory and renamed into place when complete."""
    if dtype not in FLOAT_DTYPES:
        raise TinyrtError(f"unknown dtype {dtype!r} (choose f16 or f32)")
    out = Path(out)
    if out.exists() and not force:
        raise TinyrtError(f"{out} already exists (use --force to replace it)")
    source = open_source(src)
    cfg = LlamaConfig.from_dict(source.config)
    names = check_tensors(source, cfg)
    np_dtype = FLOAT_DTYPES[dtype]
    specs = [(n, np_dtype, tuple(source.shapes[n])) for n in names]
    wanted = set(names)

    def arrays():
        for i, (name, a) in enumerate((n, a) for n, a in source.tensors() if n in wanted):
            if progress:
                progress(i, len(names), name)
            with np.errstate(over="ignore"):  # checked just below, with a clearer message
                b = a.astype(np_dtype)
            if not np.isfinite(b).all():
                where = "overflows float16" if np.isfinite(a).all() else "holds inf or nan"
                raise ModelFormatError(f"{source.path}: tensor {name!r} {where}"
                                       + (" (convert with --dtype f32)" if dtype == "f16" else ""))
            yield b
        if progress:
            progress(len(names), len(names), "done")

    config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    config["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
    with atomic_directory(out, force=force) as tmp:
        write_safetensors(tmp / "model.safetensors", specs, arrays(), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        if source.generation_config:
            write_json(tmp / "generation_config.json", source.generation_config)
        for name, content in source.files.items():
            data = content.encode("utf-8") if isinstance(content, str) else content
            (tmp / name).write_bytes(data)
    return out
