"""The Python API: `tinyrt.load()` returns an `LLM` that streams replies."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from array import array
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tinyrt.errors import ModelFormatError, TinyrtError, printable, shown

from .chat_template import template_from_config
from .generate import DecoderHolder, Generation, Response
from .kernels import get_backend, on_first_compile
from .kv_cache import make_cache
from .kv_options import CacheOptions
from .models import load_model, trim_heap, warm_up
from .memory import CACHE_HINT, cpu_count, out_of_memory_is
from .models.weights import FLOAT_TYPES
from .paths import read_json
from .sampling import (DEFAULT_MAX_TOKENS, SHOWN_SETTINGS, Sampler, SamplingParams, SettingError,
                       check_settings, check_value, unknown_option)
from .speculative import MAX_GAMMA, SpeculativeGeneration, make_drafter
from .tokenizer import load_tokenizer

Prompt = str | Sequence[dict]

# The most text `LLM.encode` tokenizes, in bytes of UTF-8. Tokenizing takes some 300 bytes of
# memory a token, and a token is at least one byte (byte-level BPE, SentencePiece's byte
# fallback): a bound in bytes bounds that memory. For a dense cache, BYTES_PER_TOKEN a token of
# its size (far more than any tokenizer's tokens average, so that no text that could fit is
# refused), and MAX_TEXT_BYTES (some 300 MB to tokenize) for any cache.
BYTES_PER_TOKEN = 64
MAX_TEXT_BYTES = 1 << 20
MAX_DRAFT_TOKENS = 32    # (--draft-tokens)


def check_runtime(threads: int | None = None, draft_tokens: int | None = None) -> None:
    """A TinyrtError naming --threads or --draft-tokens where it is not a whole number in its
    range (None: the default); `load` checks them before anything loads."""
    for flag, value, high in (("--threads", threads, cpu_count()),
                              ("--draft-tokens", draft_tokens, MAX_DRAFT_TOKENS)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not 1 <= value <= high:
            where = " (the CPUs this process may use)" if flag == "--threads" else ""
            raise TinyrtError(f"{flag} must be a whole number from 1 to {high}{where}, "
                              f"got {shown(value)}")


def _cache_options(cache: CacheOptions | None = None, **fields) -> CacheOptions:
    """KV cache options: `cache` (default: the defaults) with `fields` replaced, checked
    (CacheOptions); a TinyrtError naming a field it does not have, and the closest it does."""
    if cache is not None and not isinstance(cache, CacheOptions):
        raise TinyrtError(f"cache must be a tinyrt.CacheOptions, not {shown(cache)}")
    try:
        return dataclasses.replace(cache or CacheOptions(), **fields)
    except TypeError:
        known = CacheOptions.__dataclass_fields__
        raise TinyrtError(unknown_option(next(k for k in fields if k not in known),
                                         list(known))) from None


def _generation_config(directory: Path) -> dict:
    if not directory.is_dir():              # a GGUF file, whose settings are in its metadata
        return {}
    return read_json(directory / "generation_config.json", missing_ok=True) or {}


def model_sampling(directory: Path, weights, generation_config: dict | None = None) -> dict:
    """The sampling settings a model asks for, name -> (value, source): its GGUF metadata's
    (`weights`: models.weights.ModelWeights), then its generation_config.json's over them. A
    value the sampler cannot use (top_k 2.5, a string) is left out, with one line: the model
    still runs, on the default, as it would without it."""
    if generation_config is None:
        generation_config = _generation_config(directory)
    sources = [("GGUF metadata", weights.sampling(), directory),
               ("generation_config.json", generation_config,
                directory / "generation_config.json")]
    names = (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
             ("min_p", "min_p"), ("repeat_penalty", "repetition_penalty"))
    d = {}
    for source, g, where in sources:             # the later source wins
        for ours, theirs in names:
            try:
                value = check_value(ours, g.get(theirs), theirs)
            except SettingError as e:
                print(printable(f"warning: {where}: {e}; using the default"), file=sys.stderr)
                continue
            if value is not None:
                d[ours] = value, source
        if g.get("do_sample") is False:
            d["temperature"] = 0.0, source
    return d


def sampling_sources(asked: dict) -> dict:
    """Every shown setting of the sampler (SHOWN_SETTINGS) for a model that asks for `asked`
    (model_sampling's): name -> (value, source), "tinyrt" where the model says nothing."""
    params = SamplingParams(**{k: v for k, (v, _) in asked.items()})
    return {name: asked.get(name, (getattr(params, name), "tinyrt")) for name in SHOWN_SETTINGS}


def describe_sampling(sources: dict) -> str:
    """sampling_sources' settings in one line, grouped by where they come from:
    "temperature 0.6, top_p 0.9 (generation_config.json); top_k 40, ... (tinyrt's defaults)"."""
    groups: dict[str, list[str]] = {}
    for name, (value, source) in sources.items():
        where = "tinyrt's defaults" if source == "tinyrt" else source
        groups.setdefault(where, []).append(f"{name} {value:g}")
    return "; ".join(f"{', '.join(names)} ({where})" for where, names in groups.items())


def _largest_token_id(tokenizer) -> int:
    """The largest id the tokenizer can produce. A tokenizer.json's ids need not be contiguous
    (its count can be below its largest id), so an HF tokenizer's vocabulary is scanned; a
    sentencepiece model's ids are 0 .. size-1."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        return max(hf.get_vocab(with_added_tokens=True).values(), default=-1)
    return tokenizer.vocab_size - 1


def _check_token_ids(where: Path, largest: int, tokenizer, cfg, generation_config: dict) -> None:
    """Refuse, at load, a tokenizer or a special token id beyond the embedding's rows (the
    weights were checked to have config.json's vocab_size): the first such token would otherwise
    fail in the embedding lookup. Negative ids stand for "none" in some configs."""
    rows = cfg.vocab_size
    if largest >= rows:
        raise ModelFormatError(f"{where}: the tokenizer has token ids up to {largest}, but the "
                               f"embedding has {rows} rows (vocab_size)")

    def ints(v):
        return [i for i in (v if isinstance(v, list) else [v])
                if isinstance(i, int) and not isinstance(i, bool)]

    config = "config.json" if where.is_dir() else "the GGUF metadata's"
    named = [("the tokenizer's BOS token", [tokenizer.bos_id]),
             ("the tokenizer's EOS token", [tokenizer.eos_id]),
             (f"{config} bos_token_id", [cfg.bos_token_id]),
             (f"{config} eos_token_id", list(cfg.eos_token_ids)),
             (f"{config} pad_token_id", [cfg.pad_token_id])]
    named += [(f"generation_config.json {k}", generation_config.get(k))
              for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    for name, ids in named:
        for i in ints(ids):
            if i >= rows:
                raise ModelFormatError(f"{where}: {name} {i} is beyond the embedding's {rows} "
                                       "rows (vocab_size)")


def chat_messages(prompt: Prompt, system: str | None = None) -> list[dict]:
    """A prompt as chat messages; `system` replaces any system message."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        msgs = [{"role": "system", "content": system}] + [m for m in msgs if m.get("role") != "system"]
    return msgs


class LLM:
    """A loaded model with its tokenizer, chat template and KV cache.

    `stream(prompt)` yields `Response`s; `generate(prompt)` returns the reply text. A prompt is a
    string (a user message, put through the chat template unless `raw=True`) or a list of
    {"role", "content"} messages.

    `directory` is a model directory or a GGUF file (`load` resolves names to one); `dtype`
    "f16" / "f32" runs on float weights (a quantized model's dequantized at load), None (the
    default) on the weights as stored; `cache` the KV cache options, or their fields as keywords (kv_policy="sink", kv_size=...);
    `draft` (speculative decoding) a draft model's directory, "lookup" or "layers:N" (see
    speculative.make_drafter), proposing at most `draft_tokens`; `cuda_graph` as for `load`.
    """

    def __init__(self, directory: str | os.PathLike, *, device: str = "auto",
                 threads: int | None = None, dtype: str | None = None,
                 cache: CacheOptions | None = None,
                 draft: str | os.PathLike | None = None, draft_tokens: int = MAX_GAMMA,
                 cuda_graph: bool = True, **cache_fields):
        start = time.perf_counter()
        check_runtime(threads, draft_tokens)
        cache = _cache_options(cache, **cache_fields)
        self.directory = Path(directory)
        if dtype not in (None, *FLOAT_TYPES):
            raise TinyrtError(f"unknown weight type {dtype!r} (choose {' or '.join(FLOAT_TYPES)})")
        try:
            self.backend = get_backend(device, threads, cuda_graph=cuda_graph)
        except ValueError as e:
            raise TinyrtError(str(e)) from None
        # the tokenizer first: its JSON parse peaks ~30 MB above what it keeps (freed, then
        # trimmed), a peak that would otherwise come on top of the loaded model's memory
        self.tokenizer = load_tokenizer(self.directory)
        largest = _largest_token_id(self.tokenizer)      # (its scan's memory is trimmed next)
        self.template = template_from_config(self.tokenizer.config)
        trim_heap()
        with out_of_memory_is(f"loading the model in {self.directory}",
                              ": a smaller model, or a quantized one (tinyrt convert)"):
            self.model = load_model(self.directory, self.backend, dtype)
        self.config = cfg = self.model.config
        self.generation_config = _generation_config(self.directory)
        _check_token_ids(self.directory, largest, self.tokenizer, cfg, self.generation_config)
        if draft is not None:
            # the draft's own cache, if it needs one, of the target's size (not its context's)
            cache = dataclasses.replace(cache, slack=draft_tokens + 1, kv_size=cache.size_for(cfg),
                                        kv_mem=None)
        self.draft_tokens = draft_tokens
        self.cache_options = cache
        with out_of_memory_is(f"a KV cache of {cache.size_for(cfg):,} tokens", CACHE_HINT):
            self.cache = make_cache(cache, self.model)
            # the kernels compiled now, in load_s, not in a reply's timings; a streaming
            # cache's evictions call kernels of their own: a small cache of its kind is run
            # past its size
            warm_up(self.model, self.cache)
        if self.cache.streams:
            small = dataclasses.replace(cache, kv_size=cache.sinks + 32, kv_mem=None,
                                        recent=8 if cache.recent else None)
            warm_up(self.model, make_cache(small, self.model), past=True)
        self._held: array | None = array("i")   # the token ids the cache holds (None: unknown)
        self._current: Generation | None = None  # the last `complete`'s reply
        # a GPU's decode step, captured in a reply, replayed in the next ones (its cache and
        # sampler settings alike)
        self._decoders = DecoderHolder()
        self.drafter = None if draft is None else make_drafter(
            str(draft), self.model, self.tokenizer, self.cache,
            lambda model: make_cache(cache, model), load_model, load_tokenizer)
        if getattr(self.drafter, "model", None) is not None:      # a draft model's kernels too
            warm_up(self.drafter.model, self.drafter.cache)
        gen_eos = self.generation_config.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = {i for i in (*cfg.eos_token_ids, *gen_eos, self.tokenizer.eos_id)
                        if isinstance(i, int)}
        self.load_s = time.perf_counter() - start

    # -- prompts ------------------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt, *, system: str | None = None, raw: bool = False) -> list[int]:
        """Token ids for a prompt: the chat template applied (when the model has one) unless raw."""
        if not prompt:
            raise TinyrtError("the prompt is empty")
        if system is not None and not isinstance(system, str):
            raise TinyrtError("the system message must be a string")
        if raw or self.template is None:
            if not isinstance(prompt, str):
                raise TinyrtError("a raw prompt must be a string")
            text = prompt if system is None else f"{system}\n\n{prompt}"
            return self.encode(text, add_special=True)
        text = self.template.render(chat_messages(prompt, system), add_generation_prompt=True)
        return self.encode(text)

    def text_budget(self) -> int:
        """The most bytes of text (UTF-8) `encode` tokenizes: far more than the KV cache could
        hold (a streaming cache takes any prompt: MAX_TEXT_BYTES)."""
        if self.cache.streams:
            return MAX_TEXT_BYTES
        return min(MAX_TEXT_BYTES, self.cache.capacity * BYTES_PER_TOKEN)

    def check_text(self, text: str, what: str = "the prompt") -> None:
        """A TinyrtError naming `what` for text the tokenizer cannot take (lone surrogates: a
        JSON \\ud800 escape, invalid UTF-8 bytes passed through) or longer than `text_budget`,
        found before tokenizing it."""
        if not isinstance(text, str):
            raise TinyrtError(f"{what} must be a string")
        budget = self.text_budget()
        size = len(text)                      # (characters, no more than its bytes: no copy yet)
        if size <= budget:
            try:
                size = len(text.encode("utf-8"))
            except UnicodeEncodeError:
                raise TinyrtError(f"{what} is not valid Unicode text (a lone surrogate, or an "
                                  "invalid byte passed through)") from None
        if size > budget:
            raise TinyrtError(f"{what} is {size:,} bytes of text or more, more than a KV cache of "
                              f"{self.cache.capacity:,} tokens could hold (tinyrt tokenizes at "
                              f"most {budget:,} bytes for it); shorten it")

    def encode(self, text: str, *, add_special: bool = False, what: str = "the prompt") -> list[int]:
        """Token ids of `text` (`check_text` first: bounded work and memory)."""
        self.check_text(text, what)
        return self.tokenizer.encode(text, add_special=add_special)

    def token_ids(self, ids: Sequence[int]) -> list[int]:
        """Prompt token ids as a list of ints, each a token of the model; a TinyrtError for an
        empty list or anything else."""
        try:
            a = np.asarray(ids)
        except (TypeError, ValueError):
            a = None
        if a is None or a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise TinyrtError("the prompt's token ids must be a list of integers")
        if not a.size:
            raise TinyrtError("the prompt is empty (no token ids)")
        vocab = self.config.vocab_size
        if a.min() < 0 or a.max() >= vocab:
            raise TinyrtError(f"the prompt's token ids must be in [0, {vocab})")
        return a.tolist()

    def sampling_defaults(self) -> dict:
        """Sampling settings the model asks for: its generation_config.json's, else its GGUF
        metadata's (llama.cpp's `general.sampling.*`); the sampler's own defaults fill the rest."""
        return {k: v for k, (v, _) in self._sampling_defaults.items()}

    def sampling_sources(self) -> dict:
        """Every default setting of the sampler as it applies to this model: name -> (value,
        where it comes from: "generation_config.json", "GGUF metadata" or "tinyrt")."""
        return sampling_sources(self._sampling_defaults)

    @functools.cached_property
    def _sampling_defaults(self) -> dict:
        return model_sampling(self.directory, self.model.weights, self.generation_config)

    # -- generation ---------------------------------------------------------------------------

    def stream(self, prompt: Prompt, *, system: str | None = None, raw: bool = False,
               **options) -> Iterator[Response]:
        """Stream the reply to `prompt`, one `Response` per token; the last has `finish_reason`.
        Options as for `generation`. The cache starts empty: each call is a new conversation
        (`ChatSession` keeps one going)."""
        check_settings(options)                  # (before tokenizing; `generation` again)
        ids = self.prompt_ids(prompt, system=system, raw=raw)
        self.reset()
        yield from self.generation(ids, **options)

    def generation(self, ids: Sequence[int], *, max_tokens: int | None = None,
                   temperature: float | None = None, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repeat_penalty: float | None = None, presence_penalty: float | None = None,
                   frequency_penalty: float | None = None, seed: int | None = None,
                   stop: Sequence[str] = (), ignore_eos: bool = False, **other) -> Generation:
        """A reply to prompt token `ids` appended to what the cache holds, of at most
        `max_tokens` (default DEFAULT_MAX_TOKENS). Sampling options left None take the model's
        generation_config.json or the sampler's defaults (sampling.SamplingParams); `ignore_eos`
        goes on past end-of-sequence tokens (to max_tokens, or a full dense cache). `other`:
        other runtimes' names for these (sampling.ALIASES: temp, max_new_tokens, ...). Every
        option is checked (sampling.check_settings) before any work; an unknown one is refused
        naming the closest known."""
        opts = check_settings(dict(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, seed=seed, stop=stop, ignore_eos=ignore_eos,
            **other))
        ids = self.token_ids(ids)
        self._held = None                        # (`complete` knows what the cache holds)
        given = {k: v for k, v in opts.items()
                 if k in SamplingParams.__dataclass_fields__ and v is not None}
        sampler = Sampler(SamplingParams(**{**self.sampling_defaults(), **given}))
        args = (self.model, self.cache, self.tokenizer, ids, sampler)
        kwargs = dict(max_tokens=opts["max_tokens"] or DEFAULT_MAX_TOKENS,
                      eos_ids=() if opts["ignore_eos"] else self.eos_ids,
                      stop=opts["stop"] or (), load_s=self.load_s, decoders=self._decoders)
        if self.drafter is None:
            return Generation(*args, **kwargs)
        return SpeculativeGeneration(*args, drafter=self.drafter, max_gamma=self.draft_tokens,
                                     gamma=min(4, self.draft_tokens), **kwargs)

    def complete(self, ids: Sequence[int], **options) -> Generation:
        """The reply to token ids `ids`, the whole context (options as for `generation`). The KV
        cache keeps the longest common prefix of `ids` and the tokens it holds (the last
        `complete`'s prompt and as much of its reply as it ran), and only the rest is prefilled
        (`Timings.cached_tokens` counts what was kept): a conversation's next turn, or a prompt
        that shares a system message, starts at its first new token. Where the cache cannot take
        back what follows the common prefix (a streaming policy that evicted), it starts empty.
        Refuses, before any work, what cannot fit."""
        ids = self.token_ids(ids)
        # `_held` is None (unknown) until the end, where Ctrl-C at any point leaves it
        held, self._held = self._held, None
        keep = self._keep_prefix(ids, held)
        try:
            gen = self.generation(ids[keep:], **options)
        finally:
            self._held = array("i", ids[:keep])     # (until the reply settles)
        gen.timings.cached_tokens = keep
        start = self.cache.next_pos
        self._current = gen
        gen.on_done = lambda: self._settle(gen, ids, keep, start)
        return gen

    def _keep_prefix(self, ids: list[int], held: array | None) -> int:
        """Roll the cache back to the longest common prefix of `ids` and `held`, what it holds,
        less the last token of `ids` (a forward pass gives the next token's logits); returns its
        length. A cache that holds something else (used outside `complete`) starts empty."""
        if held is None or len(held) != self.cache.next_pos:
            self.reset()
            return 0
        n = min(len(held), len(ids) - 1)
        same = np.frombuffer(held, dtype=np.int32, count=n) != np.asarray(ids[:n], dtype=np.int32)
        keep = int(np.argmax(same)) if same.any() else n
        if keep < len(held):
            try:
                self.cache.rollback(len(held) - keep)
            except ValueError:                   # it evicted what came after
                self.reset()
                return 0
        return keep

    def _settle(self, gen: Generation, ids: list[int], keep: int, start: int) -> None:
        """After a reply, complete or not: the tokens the cache holds. Those are the prompt when
        its first token was drawn, then one per later decode step; a pass cut short (Ctrl-C, an
        error) may have taken slots of its own, which are taken back."""
        if gen is not self._current:             # (a reply closed after a later one began)
            return
        self._held = None
        t = gen.timings
        done = start + (len(gen.prompt) + t.decode_steps if t.ttft_s > 0 else 0)
        if self.cache.next_pos > done:
            try:
                self.cache.rollback(self.cache.next_pos - done)
            except ValueError:                   # it evicted: start empty next time
                self.reset()
                return
        held = array("i", ids if t.ttft_s > 0 else ids[:keep])
        held.extend(gen.tokens[:t.decode_steps] if t.ttft_s > 0 else [])
        self._held = held

    def reset(self) -> None:
        """Empty the KV cache (the next `complete` prefills its whole prompt)."""
        self.cache.reset()
        self._held = array("i")

    def generate(self, prompt: Prompt, **options) -> str:
        """The whole reply as text (options as for `stream`)."""
        return "".join(r.text for r in self.stream(prompt, **options))

    def embed(self, text: str, *, truncate: bool = True) -> np.ndarray:
        """An embedding of `text`: the mean of its tokens' final (normed) hidden states,
        L2-normalized [hidden_size], as ollama's /api/embed gives one for a model without a
        pooling of its own. Tokens past the KV cache's size are left out (`truncate`) or
        refused. Run on a cache of its own: the conversation's cache is left as it is."""
        ids = self.encode(text, add_special=True, what="the text")
        size = self.cache.capacity
        if not ids:
            raise TinyrtError("the text to embed is empty")
        if len(ids) > size:
            if not truncate:
                raise TinyrtError(f"the text has {len(ids)} tokens; the KV cache holds {size}")
            ids = ids[:size]
        own = dataclasses.replace(self.cache_options, kv_policy="dense", kv_size=len(ids),
                                  kv_mem=None, slack=0)
        with out_of_memory_is(f"embedding {len(ids):,} tokens", CACHE_HINT):
            h = self.model.backend.to_numpy(self.model.hidden_states(ids, make_cache(
                own, self.model))).astype(np.float64)
        v = h.mean(axis=0)
        return (v / max(np.linalg.norm(v), 1e-30)).astype(np.float32)


def _compiling_notice() -> None:
    # the first run on a machine waits for Numba to compile the kernels: say why, once
    print("note: compiling kernels, once on this machine (~20 s); later runs read them from "
          "Numba's cache", file=sys.stderr, flush=True)


def load(model: str | os.PathLike | None = None, *, device: str = "auto",
         threads: int | None = None, dtype: str | None = None,
         draft: str | os.PathLike | None = None,
         draft_tokens: int = MAX_GAMMA, quiet: bool = False, cache: CacheOptions | None = None,
         cuda_graph: bool = True, **cache_fields) -> LLM:
    """Load a model: a model directory (float or AWQ safetensors), a GGUF file (run in place:
    its quantized tensors on the quantized kernels), a known name, or None for the default model
    (its GGUF fetched on first use). `threads`: the most threads of the CPU kernels (default: a
    thread per CPU this process may use); fewer while other programs keep cores busy, measured as
    it runs (kernels.cpu.cores). `dtype` "f16" / "f32": run on float weights instead. `draft`
    (speculative decoding): a model with the same vocabulary (as `model`), `lookup` (prompt
    lookup) or `layers:N` (the model's first N layers); drafts of at most `draft_tokens`.
    `cache` is the KV cache options (kv_cache.CacheOptions), or give its fields as keywords
    (kv_policy, kv_size or kv_mem, kv_type, sinks, recent). `cuda_graph` False runs a GPU's
    decode steps eagerly instead of replaying them as a CUDA graph (debugging).

    This is the front end of the API: names become files here (fetched where they must be),
    then `LLM` loads the directory or file."""
    from .registry import resolve            # (it imports the converter only to convert)

    start = time.perf_counter()
    # the options first: a mistake is said before a model is fetched or read
    check_runtime(threads, draft_tokens)
    cache = _cache_options(cache, **cache_fields)
    if draft is not None and str(draft) != "lookup" and not str(draft).startswith("layers:"):
        draft = resolve(draft, quiet=quiet)
    path = resolve(model, quiet=quiet)
    with contextlib.nullcontext() if quiet else on_first_compile(_compiling_notice):
        llm = LLM(path, device=device, threads=threads, dtype=dtype, cache=cache, draft=draft,
                  draft_tokens=draft_tokens, cuda_graph=cuda_graph)
    fallbacks = llm.model.weights.float_fallbacks()
    if fallbacks and not quiet and dtype is None:
        types = ", ".join(sorted(set(fallbacks.values())))
        print(f"note: {len(fallbacks)} tensors of type {types} have no quantized kernel here and run "
              f"as float ({', '.join(list(fallbacks)[:3])}{', ...' if len(fallbacks) > 3 else ''})",
              file=sys.stderr)
    llm.load_s = time.perf_counter() - start
    return llm
