"""Rotary position embedding frequencies from the config (default, linear and llama3 scaling),
and which layers use them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:          # (config.py imports the families, whose models import this module)
    from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] float64, as HF computes them for this config."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    kind, s = cfg.rope_type, cfg.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = np.clip((old / wavelen - lo) / (hi - lo), 0.0, 1.0)
        inv = np.where(wavelen < old / hi, inv,
                       np.where(wavelen > old / lo, inv / factor,
                                (1 - smooth) * inv / factor + smooth * inv))
    return inv


def per_layer(uses_rope: list[bool], cos, sin) -> list:
    """Each layer's RoPE tables: the position's, or for a NoPE layer (uses_rope False) tables
    that rotate nothing (cos 1, sin 0: x * 1 - y * 0 is x exactly, so the same kernels serve
    both). NumPy arrays or device tensors alike."""
    if all(uses_rope):
        return [(cos, sin)] * len(uses_rope)
    identity = (cos * 0 + 1, sin * 0)
    return [(cos, sin) if r else identity for r in uses_rope]
