"""Choosing the next token from logits. The model returns logits; everything else happens here.

Order of operations (as HF's logits processors): the penalties on recent tokens (repetition, then
presence and frequency), then greedy argmax when the temperature is 0, else temperature, top-k,
top-p, min-p, and a draw from what is left.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from tinyrt.errors import TinyrtError, closest, shown

# Below this a temperature is taken as 0 (greedy): its distribution is the argmax's to within
# float32 logits' precision, and dividing by it overflows (a float32 device sampler even rounds
# 1e-320 to 0 and divides by zero).
MIN_TEMPERATURE = 1e-5
DEFAULT_MAX_TOKENS = 512
MAX_TOKENS = 2**31 - 1
MAX_STOPS = 16
MAX_STOP_CHARS = 500         # a stop string's tail is matched against every token's text
MAX_REPEAT_LAST_N = 1 << 16  # ids a penalty looks back over (a buffer of them on a GPU)

# Every generation setting (LLM.generation's options, a saved chat's settings, the server's and
# the command line's fields) and what it must be: (integer?, test, rule in words). The one place
# they are checked: `check_settings` for a caller's options, `SamplingParams` for the sampler.
RULES = {
    "temperature": (False, lambda v: v >= 0, "a number >= 0 (0: greedy)"),
    # (bounded as max_tokens is, far above any vocabulary: a k of hundreds of digits is a
    # mistake, not a wish for every token)
    "top_k": (True, lambda v: 0 <= v <= MAX_TOKENS, f"an integer in [0, {MAX_TOKENS}] (0: off)"),
    "top_p": (False, lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)"),
    "min_p": (False, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)"),
    # (outside it the penalized logits overflow float32)
    "repeat_penalty": (False, lambda v: 0.01 <= v <= 100, "a number in [0.01, 100] (1: off)"),
    "presence_penalty": (False, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"),
    "frequency_penalty": (False, lambda v: -2 <= v <= 2, "a number in [-2, 2] (0: off)"),
    "repeat_last_n": (True, lambda v: 0 <= v <= MAX_REPEAT_LAST_N,
                      f"an integer in [0, {MAX_REPEAT_LAST_N}]"),
    "seed": (True, lambda v: -1 <= v < 2**64, "an integer in [0, 2**64) (-1: random)"),
    "max_tokens": (True, lambda v: 1 <= v <= MAX_TOKENS, f"an integer in [1, {MAX_TOKENS}]"),
}
# LLM.generation's options
OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
           "presence_penalty", "frequency_penalty", "seed", "stop", "ignore_eos")
# Other runtimes' names for them, taken as ours: mlx-lm's `temp`, OpenAI's
# `max_completion_tokens`, HF transformers' `max_new_tokens` and `repetition_penalty`
ALIASES = {"temp": "temperature", "max_completion_tokens": "max_tokens",
           "max_new_tokens": "max_tokens", "repetition_penalty": "repeat_penalty"}

# The sampler's defaults where neither the caller nor the model says (its generation_config.json,
# its GGUF metadata): temperature 0.2 and top-p 0.9 (SmolLM2's model card's), with llama.cpp's
# top-k 40 and min-p 0.05, and ollama's repeat penalty of 1.1 over the last 64 tokens (llama.cpp's
# is 1, off). An edge runtime runs small models, which a high temperature takes off course: the
# default model at llama.cpp's 0.8 answered "What is the capital of France?" in French nonsense
# in some runs; at these settings, of 9 simple questions it answers right greedily, asked with 10
# seeds each, 70 of 90 first sentences were right (benchmarks/default_answers.py, docs/CHAT.md,
# where cooler settings are measured too). The cost: "Write a poem about the sea" ran to a
# 400-token limit in 3 runs of 15 (0 at 0.8). The penalty, because small models loop without
# it. Greedy (temperature 0) has no penalty unless one is asked for: it is the plain argmax, as
# HF transformers and llama.cpp compute it.
DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9
DEFAULT_REPEAT_PENALTY = 1.1
# the settings a model may set for itself, shown where tinyrt says which defaults apply
SHOWN_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")


class SettingError(TinyrtError):
    """A generation setting the runtime cannot use; `name` is the setting as the caller named it
    (a field, a flag), for a server's `param`."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def option_name(key: str, flags: bool = False) -> str:
    """A setting as the caller knows it: "top_k", or the flag "--top-k"."""
    return "--" + key.replace("_", "-") if flags else key


def check_value(key: str, value: Any, name: str | None = None) -> Any:
    """`value` of setting `key` (RULES, or stop or ignore_eos) as the runtime uses it: an int or
    a float (a tiny temperature 0, seed -1 None), stop a list of strings; None (the default)
    stays None. A SettingError naming `name` (default `key`) for anything else."""
    name = name or key
    if value is None:
        return None
    if key == "stop":
        return _check_stop(value, name)
    if key == "ignore_eos":
        if not isinstance(value, (bool, np.bool_)):
            raise SettingError(name, f"{name} must be true or false, got {shown(value)}")
        return bool(value)
    integer, ok, rule = RULES[key]
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kind):
        raise SettingError(name, f"{name} must be {rule}, got {shown(value)}")
    try:
        v = int(value) if integer else float(value)
    except OverflowError:                    # an int past float's range
        v = math.inf
    # (an int is compared as it is: math.isfinite of one past float's range overflows)
    if not integer and not math.isfinite(v) or not ok(v):
        raise SettingError(name, f"{name} must be {rule}, got {shown(value)}")
    if key == "temperature" and v < MIN_TEMPERATURE:
        return 0.0
    if key == "seed" and v == -1:            # (as llama.cpp: a random seed)
        return None
    return v


def _check_stop(value: Any, name: str) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    rule = (f"{name} must be a string or a list of at most {MAX_STOPS} non-empty strings of at "
            f"most {MAX_STOP_CHARS} characters")
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise SettingError(name, f"{rule}, got {shown(value)}")
    for s in stops:
        if not is_text(s):
            raise SettingError(name, f"{name} is not valid Unicode text (an invalid byte or a "
                                     f"lone surrogate in {shown(s)})")
    return list(stops)


def is_text(s: str) -> bool:
    """Whether `s` is text a tokenizer takes: no lone surrogates (which a JSON \\ud800 escape or
    an argument of invalid UTF-8 bytes, surrogate-escaped, puts in a str)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_settings(options: Mapping[str, Any], *, flags: bool = False) -> dict:
    """Generation options (OPTIONS: LLM.generation's keywords, or their ALIASES) checked and made
    what the runtime uses (`check_value`), under our names; None stays None (the default). A
    setting given twice, under two names, takes the later value that is not None (as a later
    keyword would: ChatSession.send's options over its settings). A SettingError naming the
    first bad one as the caller named it (as a flag with `flags`), or one the runtime does not
    know, with the closest name it does."""
    out = {}
    for given, value in options.items():
        key = ALIASES.get(given, given)
        name = option_name(given, flags)
        if key not in OPTIONS:
            raise SettingError(name, unknown_option(name, [option_name(k, flags) for k in
                                                           (*OPTIONS, *ALIASES)]))
        value = check_value(key, value, name)
        if value is not None or key not in out:
            out[key] = value
    return out


def unknown_option(name: str, known) -> str:
    """The refusal of an option (a keyword) not among `known`: the closest, else them all."""
    close = closest(name, known)
    return f"unknown option {name!r} " + (f"(did you mean {close!r}?)" if close else
                                          f"(the options: {', '.join(known)})")


@dataclass(frozen=True)
class SamplingParams:
    """The defaults: DEFAULT_TEMPERATURE and DEFAULT_TOP_P (above), llama.cpp's top-k and min-p
    and ollama's repeat penalty; temperature 0 is greedy (below MIN_TEMPERATURE is 0). 0 disables top_k; 1.0
    disables top_p and repeat_penalty (None: DEFAULT_REPEAT_PENALTY when sampling, 1.0 when
    greedy); 0 disables min_p, presence_penalty and frequency_penalty (OpenAI's additive
    penalties: a token seen in the last `repeat_last_n` ids loses presence_penalty once and
    frequency_penalty per time seen, as llama.cpp applies them). seed None or -1: a random one.
    Each value is checked (RULES)."""

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 40
    top_p: float = DEFAULT_TOP_P
    min_p: float = 0.05
    repeat_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name not in ("seed", "repeat_penalty"):
                raise SettingError(f.name, f"{f.name} must be {RULES[f.name][2]}, got None")
            object.__setattr__(self, f.name, check_value(f.name, value))
        if self.repeat_penalty is None:
            object.__setattr__(self, "repeat_penalty",
                               DEFAULT_REPEAT_PENALTY if self.temperature else 1.0)


class BrokenModelError(TinyrtError):
    """The model produced logits no distribution comes from (NaN, +inf, or every one -inf):
    its weights are broken (or overflow), and no token can be chosen."""


def check_logits(logits: np.ndarray) -> None:
    """Refuse logits [..., V] that no token can be chosen from, in one line. One reduction (a
    NaN anywhere makes the maximum NaN, a +inf makes it inf, all -inf makes it -inf), cheap
    beside a forward pass; -inf on some ids (masked tokens) is a valid distribution."""
    x = np.asarray(logits)
    if not x.size:
        return
    top = x.max(axis=-1)
    if np.isfinite(top).all():
        return
    if np.isnan(top).any():
        kind = "NaN logits"
    elif (top == np.inf).any():
        kind = "infinite logits"
    else:
        kind = "logits that are all -inf"
    raise BrokenModelError(f"the model produced {kind}: its weights are broken (or overflow), "
                           "and no token can be chosen")


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
            with np.errstate(over="ignore"):     # (an overflow: the sampler's check says so)
                v = np.where(v > 0, v / penalty, v * penalty)
        logits[ids] = v - presence - frequency * counts
    return logits


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities after temperature, top-k, top-p and min-p (temperature
    > 0). Probabilities sum to 1, ids are sorted by decreasing probability."""
    # the largest logit subtracted first: a tiny temperature then takes the others to -inf (the
    # greedy limit), where dividing first overflowed to inf - inf = NaN
    x = logits.astype(np.float64)
    top = x.max()
    if not np.isfinite(top):       # (NaN everywhere after the subtraction: no candidates)
        check_logits(x)
    with np.errstate(over="ignore"):
        x = (x - top) / p.temperature
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
        """The logits with the penalties applied; a BrokenModelError for logits that no token
        can come from (greedy too: its argmax of NaN would be token 0 forever)."""
        p = self.params
        x = apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n,
                                 p.presence_penalty, p.frequency_penalty)
        check_logits(x)        # after the penalties: a penalty may take a huge logit to inf
        return x

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
