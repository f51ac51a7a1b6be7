"""The Python API: `tinyrt.load()` returns an `LLM` that streams replies."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from array import array
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from tinyrt.errors import ModelFormatError, TinyrtError

from .chat_template import template_from_config
from .generate import Generation, Response
from .kernels import get_backend
from .kv_cache import CacheOptions, make_cache
from .models import load_model, trim_heap
from .models.weights import FLOAT_TYPES
from .sampling import Sampler, SamplingParams
from .speculative import MAX_GAMMA, SpeculativeGeneration, make_drafter
from .tokenizer import load_tokenizer

Prompt = str | Sequence[dict]


def _generation_config(directory: Path) -> dict:
    path = directory / "generation_config.json"
    if not directory.is_dir() or not path.exists():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFormatError(f"{path} is not valid JSON") from None
    return d if isinstance(d, dict) else {}


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
        try:
            cache = dataclasses.replace(cache or CacheOptions(), **cache_fields)
        except TypeError:
            raise TinyrtError(f"unknown options: {', '.join(sorted(cache_fields))} (KV cache "
                              f"options: {', '.join(CacheOptions.__dataclass_fields__)})") from None
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
        self.template = template_from_config(self.tokenizer.config)
        trim_heap()
        self.model = load_model(self.directory, self.backend, dtype)
        self.config = cfg = self.model.config
        self.generation_config = _generation_config(self.directory)
        if draft is not None:
            if not 1 <= draft_tokens <= 32:
                raise TinyrtError(f"--draft-tokens must be between 1 and 32, got {draft_tokens}")
            # the draft's own cache, if it needs one, of the target's size (not its context's)
            cache = dataclasses.replace(cache, slack=draft_tokens + 1, kv_size=cache.size_for(cfg),
                                        kv_mem=None)
        self.draft_tokens = draft_tokens
        self.cache_options = cache
        self.cache = make_cache(cache, self.model)
        self._held: array | None = array("i")   # the token ids the cache holds (None: unknown)
        self._current: Generation | None = None  # the last `complete`'s reply
        self.drafter = None if draft is None else make_drafter(
            str(draft), self.model, self.tokenizer, self.cache,
            lambda model: make_cache(cache, model), load_model, load_tokenizer)
        gen_eos = self.generation_config.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = {i for i in (*cfg.eos_token_ids, *gen_eos, self.tokenizer.eos_id)
                        if isinstance(i, int)}
        self.load_s = time.perf_counter() - start

    # -- prompts ------------------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt, *, system: str | None = None, raw: bool = False) -> list[int]:
        """Token ids for a prompt: the chat template applied (when the model has one) unless raw."""
        if raw or self.template is None:
            if not isinstance(prompt, str):
                raise TinyrtError("a raw prompt must be a string")
            text = prompt if system is None else f"{system}\n\n{prompt}"
            return self.tokenizer.encode(text, add_special=True)
        text = self.template.render(chat_messages(prompt, system), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special=False)

    def sampling_defaults(self) -> dict:
        """Sampling settings the model's generation_config.json asks for."""
        g = self.generation_config
        names = (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                 ("min_p", "min_p"), ("repeat_penalty", "repetition_penalty"))
        d = {ours: g[theirs] for ours, theirs in names
             if isinstance(g.get(theirs), (int, float)) and not isinstance(g.get(theirs), bool)}
        if g.get("do_sample") is False:
            d["temperature"] = 0.0
        return d

    # -- generation ---------------------------------------------------------------------------

    def stream(self, prompt: Prompt, *, system: str | None = None, raw: bool = False,
               **options) -> Iterator[Response]:
        """Stream the reply to `prompt`, one `Response` per token; the last has `finish_reason`.
        Options as for `generation`. The cache starts empty: each call is a new conversation
        (`ChatSession` keeps one going)."""
        ids = self.prompt_ids(prompt, system=system, raw=raw)
        self.reset()
        yield from self.generation(ids, **options)

    def generation(self, ids: Sequence[int], *, max_tokens: int = 512,
                   temperature: float | None = None, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repeat_penalty: float | None = None, presence_penalty: float | None = None,
                   frequency_penalty: float | None = None, seed: int | None = None,
                   stop: Sequence[str] = (), ignore_eos: bool = False) -> Generation:
        """A reply to prompt token `ids` appended to what the cache holds. Sampling options left
        None take the model's generation_config.json or the sampler's defaults
        (sampling.SamplingParams); `ignore_eos` goes on past end-of-sequence tokens (to
        max_tokens, or a full dense cache)."""
        self._held = None                        # (`complete` knows what the cache holds)
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                     frequency_penalty=frequency_penalty)
        params = {**self.sampling_defaults(), **{k: v for k, v in given.items() if v is not None}}
        sampler = Sampler(SamplingParams(seed=seed, **params))
        if max_tokens <= 0:
            raise TinyrtError("max tokens must be positive")
        args = (self.model, self.cache, self.tokenizer, ids, sampler)
        kwargs = dict(max_tokens=max_tokens, eos_ids=() if ignore_eos else self.eos_ids,
                      stop=stop, load_s=self.load_s)
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
        ids = list(ids)
        if not ids:
            raise TinyrtError("the prompt is empty")
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


def load(model: str | os.PathLike | None = None, *, device: str = "auto",
         threads: int | None = None, dtype: str | None = None,
         draft: str | os.PathLike | None = None,
         draft_tokens: int = MAX_GAMMA, quiet: bool = False, cache: CacheOptions | None = None,
         cuda_graph: bool = True, **cache_fields) -> LLM:
    """Load a model: a model directory (float or AWQ safetensors), a GGUF file (run in place:
    its quantized tensors on the quantized kernels), a known name, or None for the default model
    (its GGUF fetched on first use). `dtype` "f16" / "f32": run on float weights instead. `draft`
    (speculative decoding): a model with the same vocabulary (as `model`), `lookup` (prompt
    lookup) or `layers:N` (the model's first N layers); drafts of at most `draft_tokens`.
    `cache` is the KV cache options (kv_cache.CacheOptions), or give its fields as keywords
    (kv_policy, kv_size or kv_mem, kv_type, sinks, recent). `cuda_graph` False runs a GPU's
    decode steps eagerly instead of replaying them as a CUDA graph (debugging).

    This is the front end of the API: names become files here (fetched where they must be),
    then `LLM` loads the directory or file."""
    from .registry import resolve            # (it imports the converter only to convert)

    start = time.perf_counter()
    if draft is not None and str(draft) != "lookup" and not str(draft).startswith("layers:"):
        draft = resolve(draft, quiet=quiet)
    llm = LLM(resolve(model, quiet=quiet), device=device, threads=threads, dtype=dtype, cache=cache,
              draft=draft, draft_tokens=draft_tokens, cuda_graph=cuda_graph, **cache_fields)
    fallbacks = llm.model.weights.float_fallbacks()
    if fallbacks and not quiet and dtype is None:
        types = ", ".join(sorted(set(fallbacks.values())))
        print(f"note: {len(fallbacks)} tensors of type {types} have no quantized kernel here and run "
              f"as float ({', '.join(list(fallbacks)[:3])}{', ...' if len(fallbacks) > 3 else ''})",
              file=sys.stderr)
    llm.load_s = time.perf_counter() - start
    return llm
