"""`tinyrt info`: what a model is: architecture, sizes, quantization, files."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import add_model_option, model_spec


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe a model",
                       description="Describe MODEL (model directory, GGUF file, HF directory, "
                                   "known name or Hugging Face id; default: the default model) "
                                   "without loading it or downloading it.")
    add_model_option(p, positional=True)


def _rows(path: Path) -> tuple[list[tuple[str, str]], dict, list[tuple[str, str, str]]]:
    """(what the file is, its HF config, (kind, stored as, runs as) per kind of tensor)."""
    from tinyrt.kv_options import CacheOptions
    from tinyrt.models import open_weights

    cfg, weights = open_weights(path)
    if path.is_file():
        rows = [("file", f"{path} (GGUF, {path.stat().st_size / 1e6:.1f} MB)")]
    else:
        tok = ("tokenizer.json" if (path / "tokenizer.json").exists()
               else "tokenizer.model" if (path / "tokenizer.model").exists() else "missing")
        rows = [("directory", str(path)),
                ("weights", f"{weights.nbytes / 1e6:.1f} MB in {len(weights.store.files)} file(s)"),
                ("tokenizer", tok)]
    q = cfg.quant
    rows.append(("quantization", f"AWQ {q.bits}-bit, groups of {q.group_size}" if q
                 else "per tensor, as below" if weights.quantized else "none (float weights)"))
    rows.append(("KV cache", CacheOptions().describe(cfg) + " by default (--kv-size N or "
                 "--kv-mem SIZE, --kv-type f16|f32|q8|q4|q2)"))
    return rows, cfg.to_dict(), weights.describe()


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tinyrt.registry import NotFetched, resolve

    try:
        path = resolve(model_spec(args), download=False)
    except NotFetched as e:      # describing a model is no reason to download it
        print(e)
        return 0
    rows, cfg, kinds = _rows(path)
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
    console = Console()
    console.print(table)
    tensors = Table("tensor", "stored as", "runs as", box=None)
    for row in kinds:
        tensors.add_row(*row)
    console.print(tensors)
    return 0
