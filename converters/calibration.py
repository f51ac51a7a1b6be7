"""Calibration text for AWQ: a file the user gives (plain text or JSON lines with a "text" field),
or by default the Python documentation that ships with Python itself (tinyrt.sample_text): English
prose with code, always present where tinyrt runs, and never the evaluation text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from tinyrt import paths
from tinyrt.errors import TinyrtError
from tinyrt.memory import available_bytes, cpu_count

DEFAULT_SEQLEN = 512
MIN_SAMPLES = 4           # the fewest the default takes, however slow the machine
PAPER_SAMPLES = 128       # the AWQ paper's 128 x 512 tokens: the most the default takes
SEARCH_BUDGET_S = 120     # the default takes as many samples as fit about this search time
# core-seconds of the search per calibration token and decoder linear weight; fitted to this
# project's conversions on 2 cores (TinyLlama-1.1B's shape, 4 x 512 tokens: 15.6 minutes;
# SmolLM2-135M: about 2 minutes) and rounded up
CORE_S_PER_TOKEN_WEIGHT = 1e-9
DEFAULT_RULE = f"as many as this machine's cores search in about {SEARCH_BUDGET_S // 60} minutes"


def default_samples(cfg, seqlen: int = DEFAULT_SEQLEN, cores: int | None = None,
                    available: int | None = None) -> int:
    """The calibration samples of `seqlen` tokens a conversion of `cfg` (a ModelConfig) takes by
    default on a machine of `cores` cores (default: those this process may use) with `available`
    bytes of memory (default: what the system says is available now): as many as AWQ's search
    runs through in about SEARCH_BUDGET_S, from MIN_SAMPLES to PAPER_SAMPLES, and no more than
    half that memory holds."""
    from .awq import layer_weights, peak_bytes     # not at import: the CLI's start stays light

    if cores is None:
        cores = cpu_count()
    available = available_bytes() if available is None else available
    weights = layer_weights(cfg) * cfg.num_hidden_layers
    n = int(SEARCH_BUDGET_S * cores / (CORE_S_PER_TOKEN_WEIGHT * weights * seqlen))
    n = min(max(n, MIN_SAMPLES), PAPER_SAMPLES)
    while n > MIN_SAMPLES and available is not None and peak_bytes(cfg, n * seqlen) > available / 2:
        n -= 1
    return n


def read_text(path: str | Path) -> str:
    """A calibration file: JSON lines ({"text": ...} per line) or plain text."""
    path = paths.user_path(path, "--calib")
    raw = paths.read_text(path, "--calib")
    lines = [l for l in raw.splitlines() if l.strip()]
    if lines and all(l.lstrip().startswith("{") for l in lines):
        texts = []
        for n, line in enumerate(lines, 1):
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError):        # RecursionError: nesting too deep
                raise TinyrtError(f"--calib {paths.shown_path(path)}:{n}: not a JSON object") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TinyrtError(f'--calib {paths.shown_path(path)}:{n}: a JSON line needs a string '
                                  '"text" field')
            texts.append(obj["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise TinyrtError(f"--calib {paths.shown_path(path)} is empty")
    return raw


def calibration_ids(encode: Callable[[str], list[int]], text: str, n_samples: int, seqlen: int,
                    seed: int = 0, at_most: bool = False) -> np.ndarray:
    """`n_samples` non-overlapping windows of `seqlen` tokens [n_samples, seqlen], drawn at random
    (seeded) from the tokenized text (`at_most`: fewer where the text holds fewer, at least
    MIN_SAMPLES)."""
    if n_samples <= 0 or seqlen <= 1:
        raise TinyrtError("calibration needs at least one sample of at least two tokens")
    ids = np.asarray(encode(text), dtype=np.int64)
    windows = len(ids) // seqlen
    if at_most:
        n_samples = min(n_samples, max(windows, MIN_SAMPLES))
    if windows < n_samples:
        raise TinyrtError(
            f"the calibration text has {len(ids)} tokens: too short for {n_samples} samples of "
            f"{seqlen} tokens ({n_samples * seqlen} needed); give a longer --calib file or fewer "
            "--calib-samples / a smaller --calib-seqlen")
    pick = np.sort(np.random.default_rng(seed).choice(windows, n_samples, replace=False))
    return ids[:windows * seqlen].reshape(windows, seqlen)[pick]
