"""Choosing the next token from logits. The model returns logits; everything else happens here.

Order of operations (as HF's logits processors): the penalties on recent tokens (repetition, then
presence and frequency), then greedy argmax when the temperature is 0, else temperature, top-k,
top-p, min-p, and a draw from what is left.
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
    and repeat_penalty; 0 disables min_p, presence_penalty and frequency_penalty (OpenAI's additive
    penalties: a token seen in the last `repeat_last_n` ids loses presence_penalty once and
    frequency_penalty per time seen, as llama.cpp applies them)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top-k must be >= 0"),
            (0 < self.top_p <= 1, "top-p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min-p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat-penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence-penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency-penalty must be in [-2, 2]"),
            (self.repeat_last_n >= 0, "repeat-last-n must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TinyrtError(msg)


def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], penalty: float,
                         last_n: int, presence: float = 0.0, frequency: float = 0.0) -> np.ndarray:
    """Penalties on the tokens seen in the last `last_n` ids: CTRL's (positive logits divided by
    `penalty`, negative ones multiplied), then `presence` subtracted once and `frequency` once per
    time seen. Returns a new array."""
    logits = np.array(logits, dtype=np.float32)
    if (penalty != 1.0 or presence or frequency) and last_n and len(history):
        ids, counts = np.unique(np.asarray(history[-last_n:], dtype=np.int64), return_counts=True)
        v = logits[ids]
        if penalty != 1.0:
            v = np.where(v > 0, v / penalty, v * penalty)
        logits[ids] = v - presence - frequency * counts
    return logits


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities after temperature, top-k, top-p and min-p (temperature
    > 0). Probabilities sum to 1, ids are sorted by decreasing probability."""
    # the largest logit subtracted first: a tiny temperature then takes the others to -inf (the
    # greedy limit), where dividing first overflowed to inf - inf = NaN
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        x = (x - x.max()) / p.temperature
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
        """How many of the latest ids `__call__` looks at (the penalties' window)."""
        p = self.params
        return p.repeat_last_n if p.repeat_penalty != 1.0 or p.presence_penalty \
            or p.frequency_penalty else 0

    def penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        return apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n,
                                    p.presence_penalty, p.frequency_penalty)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """logits [V] -> token id."""
        p = self.params
        x = self.penalized(logits, history)
        if p.temperature == 0:
            return int(np.argmax(x))
        ids, probs = filtered_probs(x, p)
        return pick(ids, probs, self.rng)

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution `__call__` draws from, dense over the logits' ids: float64 [V];
        greedy puts all the mass on the argmax."""
        p = self.params
        x = self.penalized(logits, history)
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
