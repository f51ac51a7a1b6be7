"""Calibration text for AWQ: a file the user gives (plain text or JSON lines with a "text" field),
or by default the Python documentation that ships with Python itself (tinyrt.sample_text): English
prose with code, always present where tinyrt runs, and never the evaluation text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from tinyrt.errors import TinyrtError

DEFAULT_SAMPLES = 4
DEFAULT_SEQLEN = 512


def read_text(path: str | Path) -> str:
    """A calibration file: JSON lines ({"text": ...} per line) or plain text."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TinyrtError(f"calibration file {path} does not exist") from None
    except UnicodeDecodeError:
        raise TinyrtError(f"calibration file {path} is not UTF-8 text") from None
    lines = [l for l in raw.splitlines() if l.strip()]
    if lines and all(l.lstrip().startswith("{") for l in lines):
        texts = []
        for n, line in enumerate(lines, 1):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise TinyrtError(f"{path}:{n}: not a JSON object") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise TinyrtError(f'{path}:{n}: a JSON line needs a string "text" field')
            texts.append(obj["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise TinyrtError(f"calibration file {path} is empty")
    return raw


def calibration_ids(encode: Callable[[str], list[int]], text: str, n_samples: int, seqlen: int,
                    seed: int = 0) -> np.ndarray:
    """`n_samples` non-overlapping windows of `seqlen` tokens [n_samples, seqlen], drawn at random
    (seeded) from the tokenized text."""
    if n_samples <= 0 or seqlen <= 1:
        raise TinyrtError("calibration needs at least one sample of at least two tokens")
    ids = np.asarray(encode(text), dtype=np.int64)
    windows = len(ids) // seqlen
    if windows < n_samples:
        raise TinyrtError(
            f"the calibration text has {len(ids)} tokens: too short for {n_samples} samples of "
            f"{seqlen} tokens ({n_samples * seqlen} needed); give a longer --calib file or fewer "
            "--calib-samples / a smaller --calib-seqlen")
    pick = np.sort(np.random.default_rng(seed).choice(windows, n_samples, replace=False))
    return ids[:windows * seqlen].reshape(windows, seqlen)[pick]
