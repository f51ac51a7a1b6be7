"""`tinyrt info`: what a model is: architecture, sizes, quantization, files."""

from __future__ import annotations

import argparse
import sys
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
    from tinyrt.api import describe_sampling, model_sampling, sampling_sources
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
    rows.append(("sampling", describe_sampling(sampling_sources(model_sampling(path, weights)))))
    return rows, cfg.to_dict(), weights.describe()


def columns(rows: list[tuple[str, ...]]) -> str:
    """`rows` as lines of columns aligned with two spaces, each value whole. Not a rich table:
    rich lays one out at the console's width (80 columns where stdout is no terminal) and cuts
    a long path there."""
    from tinyrt.errors import printable

    # (a model's names, paths and fields are a file's: shown safe, and measured as shown)
    rows = [tuple(map(printable, r)) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "".join("  ".join([*(f"{v:<{w}}" for v, w in zip(r, widths)), r[-1]]) + "\n"
                   for r in rows)


def main(args: argparse.Namespace) -> int:
    from tinyrt.registry import resolve

    # describing a model is no reason to download it: one not here is an error (NotFetched
    # says how to fetch it)
    path = resolve(model_spec(args), download=False)
    rows, cfg, kinds = _rows(path)
    keys = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps",
            "tie_word_embeddings", "sliding_window"]
    rows += [(k, str(cfg[k])) for k in keys if cfg.get(k) is not None]
    sys.stdout.write(columns(rows) + "\n" + columns([("tensor", "stored as", "runs as"), *kinds]))
    return 0
