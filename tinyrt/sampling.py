"""Choosing the next token from logits. The model returns logits; everything else happens here.

Order of operations (as HF's logits processors): repetition penalty, then greedy argmax when the
temperature is 0, else temperature, top-k, top-p, min-p, and a draw from what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tinyrt.errors import TinyrtError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (the default, as in HF transformers and mlx-lm; the model's
    generation_config.json or the caller may ask for sampling). 0 disables top_k; 1.0 disables top_p
    and repeat_penalty; 0 disables min_p."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top-k must be >= 0"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat-penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TinyrtError(msg)


def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], penalty: float,
                         last_n: int) -> np.ndarray:
    """CTRL-style penalty on tokens seen in the last `last_n` ids: positive logits are divided by
    the penalty, negative ones multiplied. Returns a new array."""
    logits = np.array(logits, dtype=np.float32)
    if penalty != 1.0 and last_n and len(history):
        ids = np.unique(np.asarray(history[-last_n:], dtype=np.int64))
        v = logits[ids]
        logits[ids] = np.where(v > 0, v / penalty, v * penalty)
    return logits


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities after temperature, top-k, top-p and min-p (temperature
    > 0). Probabilities sum to 1, ids are sorted by decreasing probability."""
    x = logits.astype(np.float64) / p.temperature
    if 0 < p.top_k < len(x):
        ids = np.argpartition(-x, p.top_k - 1)[:p.top_k]
    else:
        ids = np.arange(len(x))
    ids = ids[np.argsort(-x[ids], kind="stable")]
    probs = np.exp(x[ids] - x[ids[0]])
    probs /= probs.sum()
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep = probs >= p.min_p * probs[0]
        ids, probs = ids[keep], probs[keep]
    return ids, probs / probs.sum()


class Sampler:
    """Draws next tokens with its own random generator (seeded for reproducible output)."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)

    @property
    def history_size(self) -> int:
        """How many of the latest ids `__call__` looks at (the repeat penalty's window)."""
        p = self.params
        return p.repeat_last_n if p.repeat_penalty != 1.0 else 0

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits [V] -> token id."""
        p = self.params
        x = apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n)
        if p.temperature == 0:
            return int(np.argmax(x))
        ids, probs = filtered_probs(x, p)
        return pick(ids, probs, self.rng)

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution `__call__` draws from, dense over the logits' ids: float64 [V];
        greedy puts all the mass on the argmax."""
        p = self.params
        x = apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n)
        out = np.zeros(len(x))
        if p.temperature == 0:
            out[int(np.argmax(x))] = 1.0
        else:
            ids, probs = filtered_probs(x, p)
            out[ids] = probs
        return out

    def draw(self, probs: np.ndarray) -> int:
        """A token from a dense distribution (the argmax when greedy)."""
        if self.params.temperature == 0:
            return int(np.argmax(probs))
        return draw(probs, self.rng)


def pick(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    """One of `ids` drawn with probabilities `probs` (summing to 1), from one uniform number."""
    return int(ids[min(np.searchsorted(np.cumsum(probs), rng.random()), len(ids) - 1)])


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token from a dense distribution [V] (its zeros never drawn), as `pick` draws."""
    ids = np.flatnonzero(probs)
    return pick(ids, probs[ids] / probs[ids].sum(), rng)
