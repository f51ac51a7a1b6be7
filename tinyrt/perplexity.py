"""Perplexity by the protocol of the AWQ papers: the text tokenized whole (as the tokenizer does for
a prompt, BOS included where the model wants one), cut into non-overlapping windows of `ctx`
tokens, each window run from an empty cache; the mean NLL over every predicted token (ctx - 1 per
window; the tail shorter than a window is left out).

`stream_perplexity` is the streaming evaluation of the StreamingLLM paper: the text fed one token
at a time through a cache of a given policy and size, each step's next-token NLL recorded."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tinyrt.errors import TinyrtError, shown

from .kv_cache import make_cache
from .kv_options import CacheOptions
from .sampling import check_logits


@dataclass
class Perplexity:
    ppl: float
    tokens: int          # predicted tokens
    windows: int
    seconds: float

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "tokens": self.tokens, "windows": self.windows,
                "seconds": self.seconds}


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row of logits [n, V] (float32, overwritten), in float64;
    a broken model's (NaN or inf logits) is sampling's BrokenModelError, not a NaN perplexity."""
    check_logits(logits)
    target = logits[np.arange(len(targets)), targets].astype(np.float64)
    m = logits.max(axis=1, keepdims=True)
    logits -= m
    np.exp(logits, out=logits)
    return m[:, 0].astype(np.float64) + np.log(logits.sum(axis=1, dtype=np.float64)) - target


def window_nll(model, ids: np.ndarray, cache, chunk: int = 256) -> float:
    """Sum of -log p(ids[t+1] | ids[:t+1]) over a window. The window goes through the cache
    `chunk` tokens at a time (the same result as one pass, without the masked half of a full
    attention matrix), and the LM head sees `chunk` rows at a time, so [ctx, vocab] logits are
    never held at once."""
    cache.reset()
    total = 0.0
    for a in range(0, len(ids), chunk):
        b = min(a + chunk, len(ids) - 1)          # the last token predicts nothing
        h = model.hidden_states(ids[a:a + chunk], cache)
        if b <= a:
            break
        logits = model.backend.to_numpy(model.logits(h[:b - a]))          # [n, V] float32
        total += float(np.sum(_nll(logits, ids[a + 1:b + 1])))
    return total


def check_options(ctx: int = 2048, max_windows: int | None = None,
                  max_tokens: int | None = None, skip: int = 0) -> None:
    """TinyrtError for a window, window count, token count or skip that measures nothing (a
    negative count would slice the text from its end)."""
    for flag, value, least in (("--ctx", ctx, 2), ("--max-windows", max_windows, 1),
                               ("--max-tokens", max_tokens, 2), ("skip", skip, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < least):
            raise TinyrtError(f"{flag} must be a whole number of at least {least}, not {shown(value)}")


def perplexity(llm, text: str, ctx: int = 2048, max_windows: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> Perplexity:
    """Perplexity of `llm` (a tinyrt.LLM) on `text`."""
    cfg = llm.config
    check_options(ctx, max_windows)
    if ctx > cfg.max_position_embeddings:
        raise TinyrtError(f"--ctx {shown(ctx)} exceeds the model's context of "
                          f"{cfg.max_position_embeddings} tokens")
    ids = np.asarray(llm.tokenizer.encode(text, add_special=True), dtype=np.int64)
    windows = len(ids) // ctx
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise TinyrtError(f"the text has {len(ids)} tokens: fewer than one window of {ctx}")
    cache = make_cache(dataclasses.replace(llm.cache_options, kv_policy="dense", kv_size=ctx,
                                           kv_mem=None),
                       llm.model)
    start = time.perf_counter()
    nll = 0.0
    for w in range(windows):
        nll += window_nll(llm.model, ids[w * ctx:(w + 1) * ctx], cache)
        if progress:
            progress(w + 1, windows)
    n = windows * (ctx - 1)
    return Perplexity(_exp(nll / n), n, windows, time.perf_counter() - start)


def _exp(x: float) -> float:
    """e**x, inf where that is past the largest float (a model far off the text; math.exp
    raises OverflowError there)."""
    return math.exp(x) if x < 709.78 else math.inf


@dataclass
class StreamPerplexity:
    ppl: float
    tokens: int                  # predicted tokens
    seconds: float
    nll: np.ndarray              # [tokens] float64, the NLL of each predicted token in order

    def ppl_of(self, start: int, stop: int) -> float:
        """Perplexity over predicted tokens [start, stop)."""
        return _exp(float(self.nll[start:stop].mean()))

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "tokens": self.tokens, "windows": 1, "seconds": self.seconds}


def stream_perplexity(llm, text: str, cache: CacheOptions, *, max_tokens: int | None = None,
                      skip: int = 0, progress: Callable[[int, int], None] | None = None
                      ) -> StreamPerplexity:
    """Feed `text` (tokenized whole; its first `skip` tokens dropped, then cut at `max_tokens`)
    one token at a time through a fresh KV cache built as `cache` says (its element type that
    of the LLM's cache, with its group and residual); perplexity over every next-token prediction. A dense cache must hold
    the whole text."""
    check_options(max_tokens=max_tokens, skip=skip)
    ids = np.asarray(llm.tokenizer.encode(text, add_special=True), dtype=np.int64)
    ids = ids[skip:skip + max_tokens if max_tokens else None]
    if len(ids) < 2:
        raise TinyrtError(f"the text has {len(ids)} tokens: nothing to predict")
    own = llm.cache_options
    options = dataclasses.replace(cache, kv_type=own.kv_type, kv_group=own.kv_group,
                                  kv_residual=own.kv_residual)
    cache = make_cache(options, llm.model)
    if not cache.fits(len(ids) - 1):
        raise TinyrtError(f"a dense cache of {cache.capacity} cannot hold {len(ids) - 1} tokens: "
                          "use --kv-size at least that, or a streaming policy")
    start = time.perf_counter()
    nll = np.empty(len(ids) - 1)
    for t in range(len(ids) - 1):
        logits = llm.model.backend.to_numpy(llm.model.forward(ids[t:t + 1], cache))
        nll[t] = _nll(logits, ids[t + 1:t + 2])[0]
        if progress and (t % 64 == 63 or t == len(ids) - 2):
            progress(t + 1, len(ids) - 1)
    return StreamPerplexity(_exp(float(nll.mean())), len(nll), time.perf_counter() - start, nll)
