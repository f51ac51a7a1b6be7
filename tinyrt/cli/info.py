"""`tinyrt info`: what a model is: architecture, sizes, quantization, files."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from tinyrt.errors import TinyrtError


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe a model",
                       description="Describe MODEL (model directory, GGUF file, HF directory or "
                                   "known name; default: the default model) without loading it.")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL")


def _gguf_rows(path: Path) -> list[tuple[str, str]]:
    from collections import Counter

    from tinyrt.converters import GGUFFile

    g = GGUFFile(path)
    types = Counter(t.tensor_type.name for t in g.tensors.values())
    return [("file", f"{path} (GGUF, {path.stat().st_size / 1e6:.1f} MB)"),
            ("tensor types", ", ".join(f"{k} x{v}" for k, v in types.most_common())),
            ("parameters", f"{g.n_params / 1e6:.1f} M")], g.config()


def _dir_rows(path: Path):
    from tinyrt.models import ModelConfig, WeightStore

    cfg = ModelConfig.from_file(path / "config.json")
    store = WeightStore(path)
    n = sum(math.prod(store.shape(k)) for k in store.keys())
    dtypes = sorted({store.dtype(k) for k in store.keys()})
    q = cfg.quant
    quant = f"AWQ {q.bits}-bit, group {q.group_size}" if q else f"none ({'/'.join(dtypes)} weights)"
    tok = ("tokenizer.json" if (path / "tokenizer.json").exists()
           else "tokenizer.model" if (path / "tokenizer.model").exists() else "missing")
    return [("directory", str(path)), ("weights", f"{store.nbytes / 1e6:.1f} MB in {len(store.files)} file(s)"),
            ("quantization", quant), ("tensors", f"{len(store.keys())} ({n / 1e6:.1f} M values)"),
            ("tokenizer", tok)], cfg.to_dict()


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tinyrt.registry import ALIASES, KNOWN_MODELS, cache_dir, is_model_dir

    spec = args.model
    path = Path(spec).expanduser() if spec else None
    if path is not None and path.is_file():
        rows, cfg = _gguf_rows(path)
    elif path is not None and path.is_dir():
        if not is_model_dir(path):
            raise TinyrtError(f"{path} is not a model directory")
        rows, cfg = _dir_rows(path)
    else:
        name = ALIASES.get(spec or "default", spec)
        if name not in KNOWN_MODELS:
            raise TinyrtError(f"model {spec!r} is neither a file, a directory nor a known name")
        local = cache_dir() / "models" / f"{name}-f16"
        if not is_model_dir(local):
            print(f"{name}: {KNOWN_MODELS[name].description}; not fetched yet (tinyrt pull {name})")
            return 0
        rows, cfg = _dir_rows(local)
    table = Table(show_header=False, box=None)
    for k, v in rows:
        table.add_row(k, v)
    keys = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps",
            "tie_word_embeddings", "sliding_window"]
    for k in keys:
        if cfg.get(k) is not None:
            table.add_row(k, str(cfg[k]))
    Console().print(table)
    return 0
