"""Rotary position embedding frequencies from the config (default, linear and llama3 scaling),
and which layers use them."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:          # (config.py imports the families, whose models import this module)
    from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> np.ndarray:
    """Inverse frequencies [head_dim/2] float64, as HF computes them for this config (longrope:
    its short factors, or with `long` its long ones). With partial rotary (rotary_dim <
    head_dim) the frequencies of the dims it leaves alone are 0 (they pair up as
    `rotary_order` lays the head's dims out)."""
    d = cfg.rotary_dim
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
    elif kind == "longrope":
        inv = inv / np.asarray(s["long_factor" if long else "short_factor"], np.float64)
    return np.concatenate([inv, np.zeros((cfg.head_dim - d) // 2)])


def rotary_order(cfg: ModelConfig) -> np.ndarray | None:
    """With partial rotary, the order in which the head's dims of q and k are kept (None: as
    they are): HF rotates pairs (i, i + r/2) of the first r dims and leaves the rest; laid out
    as [rotated first halves, half the rest, rotated second halves, the other half], every
    kernel's rotate-half pairs (i, i + D/2) are HF's, and the dims left alone pair up with a
    frequency of 0 (cos 1, sin 0). Attention's dot products are the same in any order of the
    dims, q's and k's alike; v keeps its order."""
    D, r = cfg.head_dim, cfg.rotary_dim
    if r == D:
        return None
    rest = np.arange(r, D)
    return np.concatenate([np.arange(r // 2), rest[:len(rest) // 2], np.arange(r // 2, r),
                           rest[len(rest) // 2:]])


def rotary_magnitude(cfg: ModelConfig) -> float:
    """longrope's attention factor, by which HF scales its cos and sin tables (so the rotated
    dims of q and k): sqrt(1 + ln(s) / ln(original)) for a context stretched s times; else 1."""
    if cfg.rope_type != "longrope":
        return 1.0
    s = cfg.rope_scaling
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    scale = s.get("factor") or cfg.max_position_embeddings / cfg.longrope_original
    return math.sqrt(1 + math.log(scale) / math.log(cfg.longrope_original)) if scale > 1 else 1.0


def layer_inv_freqs(cfg: ModelConfig, long: bool = False) -> list[np.ndarray]:
    """Each layer's RoPE frequencies (rope_inv_freq's), one array shared by the layers alike:
    a sliding layer's of base rope_local_base_freq where the config names one (Gemma 3), a
    NoPE layer's all 0 (cos 1, sin 0: x * 1 - y * 0 is x exactly, so the same kernels serve
    it)."""
    full = rope_inv_freq(cfg, long)
    local = None
    if cfg.rope_local_base_freq is not None:
        plain = dataclasses.replace(cfg, rope_theta=cfg.rope_local_base_freq, rope_scaling=None)
        local = rope_inv_freq(plain)
    none = np.zeros_like(full)
    return [none if not cfg.uses_rope(i) else local if local is not None and
            cfg.window(i) is not None else full for i in range(cfg.num_hidden_layers)]
