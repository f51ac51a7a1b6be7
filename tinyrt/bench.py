"""`tinyrt bench`: what a model costs on this machine. Load time; TTFT and prefill speed of a
prompt of `prompt_tokens` tokens (WikiText-like text is not shipped, so the prompt is the Python
documentation that calibrates AWQ); decode speed over `decode_tokens` greedy tokens (median of
`runs` runs, EOS ignored, after a warm-up reply: a later reply's speed, and apart from it what
the first reply took more, a GPU's graph capture); peak RSS; the bytes a decoded token reads
(weights, and the KV cache at its mean length over the decoded tokens) and the GB/s that makes."""

from __future__ import annotations

import numbers
import resource
import statistics

import numpy as np

from tinyrt.errors import TinyrtError, shown
from tinyrt.sampling import option_name

MAX_TOKENS = 1 << 17     # prompt or decoded tokens: a cache of their sum is allocated
MAX_RUNS = 1000


def check_args(prompt_tokens, decode_tokens, runs, *, flags: bool = False) -> None:
    """A TinyrtError naming the first of the benchmark's sizes that is not a whole number in its
    range (as the flag, with `flags`); before any work, since the cache is sized by them."""
    for key, value, high in (("prompt_tokens", prompt_tokens, MAX_TOKENS),
                             ("decode_tokens", decode_tokens, MAX_TOKENS), ("runs", runs, MAX_RUNS)):
        name = option_name(key, flags)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
                or not 1 <= value <= high:
            raise TinyrtError(f"{name} must be an integer in [1, {high}], got {shown(value)}")


def weight_bytes(model) -> int:
    """Bytes of prepared weights one decoded token reads: every layer and the LM head (the
    embedding reads one row)."""
    def nbytes(w) -> int:
        if w is None:
            return 0
        if hasattr(w, "nbytes"):          # a NumPy array, a torch tensor (CUDA), a QLinear
            return int(w.nbytes)
        return sum(int(p.nbytes) for p in w if hasattr(p, "nbytes"))   # a NamedTuple of arrays

    layers = sum(nbytes(w) for L in model.layers for w in vars(L).values())
    return layers + nbytes(model.lm_head) + nbytes(model.norm)


def prompt_ids(llm, n: int) -> np.ndarray:
    from tinyrt.sample_text import default_text

    ids = llm.tokenizer.encode(default_text()[:n * 12], add_special=True)
    if len(ids) < n:
        raise ValueError(f"the benchmark text has only {len(ids)} tokens")
    return np.asarray(ids[:n], dtype=np.int64)


def greedy_reply(llm, ids, max_tokens: int):
    """The reply of `max_tokens` tokens to prompt `ids`, run to its end (its tokens and timings):
    greedy and no penalty (whatever the model's generation_config.json asks), past any
    end-of-sequence token: the plain decode step, the same tokens every run."""
    g = llm.generation(ids, max_tokens=max_tokens, temperature=0, repeat_penalty=1.0,
                       ignore_eos=True)
    for _ in g:
        pass
    return g


WARM_TOKENS = 3      # the warm-up reply's: its first step (a GPU's capture) and a replay


def timed_runs(llm, ids: np.ndarray, decode_tokens: int, runs: int, progress=None,
               first: dict | None = None):
    """Seconds to the first token of prompt `ids` from an empty cache, and seconds per greedy
    decoded token after it, for each of `runs` runs (after a warm-up reply), through the
    generation loop as a reply runs (on a GPU: its decode steps on the device; with a draft:
    speculative decoding). Also the drafts' figures of the median run (None without a draft).
    `progress(what, done, total)` hears of each phase and run as it starts (see `run`).

    The warm-up is a short greedy reply (ids[:8], a few steps): it makes the kernels' first
    calls and, on a GPU, captures the decode step's CUDA graph, which the runs then replay as a
    chat's later replies do. `first`, where given, receives under "first_reply_extra_s" the
    seconds that reply's decode took beyond its steps at the runs' median rate (the first
    reply's own cost: on a GPU its eager first step and the capture; 0 if already captured)."""
    say = progress or (lambda what, done, total: None)
    say("warm-up", 0, None)
    llm.reset()
    warm = greedy_reply(llm, ids[:8], WARM_TOKENS).timings
    results = []
    what = f"{runs} run{'s' * (runs != 1)}, prompt {len(ids)} + decode {decode_tokens} tokens"
    for k in range(runs):
        say(what, k, runs)
        llm.reset()
        t = greedy_reply(llm, ids, decode_tokens + 1).timings
        spec = t.speculative and t.speculative.as_dict()
        results.append((t.decode_s / max(t.decode_steps, 1), t.ttft_s, spec))
    say(what, runs, runs)
    results.sort(key=lambda r: r[0])
    if first is not None:
        step = results[len(results) // 2][0]
        first["first_reply_extra_s"] = max(0.0, warm.decode_s - warm.decode_steps * step)
    return [r[1] for r in results], [r[0] for r in results], results[len(results) // 2][2]


def run(llm, prompt_tokens: int = 512, decode_tokens: int = 128, runs: int = 5,
        progress=None) -> dict:
    """Measure `llm` (a tinyrt.LLM); returns a dict of figures (medians over `runs`). With a
    draft, decode is greedy speculative decoding and "speculative" holds the drafts' figures.
    `progress(what, done, total)`, where given, is called as each phase starts ("warm-up", total
    None) and before and after each run (the runs' phase, done runs of total), after every
    check: a run that is refused calls it never."""
    check_args(prompt_tokens, decode_tokens, runs)
    context = llm.config.max_position_embeddings
    if prompt_tokens + decode_tokens > context:       # (as ppl's --ctx: positions it never had)
        raise TinyrtError(f"prompt + decode = {prompt_tokens + decode_tokens} tokens exceed the "
                          f"model's context of {context} tokens")
    model, cache = llm.model, llm.cache
    ids = prompt_ids(llm, prompt_tokens)
    if prompt_tokens + decode_tokens > cache.capacity:
        raise ValueError(f"prompt + decode = {prompt_tokens + decode_tokens} tokens exceed the "
                         f"KV cache of {cache.capacity}")
    first: dict = {}
    ttft, decode, spec = timed_runs(llm, ids, decode_tokens, runs, progress, first)
    step = max(statistics.median(decode), 1e-9)     # (a clock too coarse to see a step)
    per_token = weight_bytes(model)
    kv_per_token = cache.bytes_per_token * (prompt_tokens + decode_tokens / 2)
    return {
        "model": str(llm.directory), "device": model.backend.name,
        "threads": getattr(model.backend, "threads", None),
        "load_s": llm.load_s,
        "prompt_tokens": prompt_tokens, "ttft_s": statistics.median(ttft),
        "prefill_tok_s": prompt_tokens / max(statistics.median(ttft), 1e-9),
        "decode_tokens": decode_tokens, "decode_tok_s": 1 / step,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weight_mb_per_token": per_token / 1e6, "kv_mb_per_token": kv_per_token / 1e6,
        "kv_cache": llm.cache_options.describe(llm.config, cache.capacity),
        "decode_gb_s": (per_token + kv_per_token) / step / 1e9,
        # (the decode figures are a later reply's: the first pays this once, beside them)
        "first_reply_extra_s": first["first_reply_extra_s"],
        **({} if spec is None else {"speculative": spec}),
    }
