"""The Python API: `tinyrt.load()` returns an `LLM` that streams replies."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator, Sequence

from tinyrt.errors import ModelFormatError, TinyrtError

from .chat_template import template_from_config
from .generate import Generation, Response
from .kernels import get_backend
from .kv_cache import kv_dtype, make_cache
from .models import load_model, trim_heap
from .registry import resolve
from .sampling import Sampler, SamplingParams
from .speculative import (MAX_GAMMA, LookupDrafter, ModelDrafter, SpeculativeGeneration,
                          check_compatible, first_layers, shares_cache)
from .tokenizer import load_tokenizer

DEFAULT_KV_SIZE = 4096
Prompt = str | Sequence[dict]


def _generation_config(directory: Path) -> dict:
    path = directory / "generation_config.json"
    if not path.exists():
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
    """

    def __init__(self, directory: str | os.PathLike, *, device: str = "auto",
                 threads: int | None = None, kv_size: int | None = None, kv_type: str = "f16",
                 kv_policy: str = "dense", sinks: int = 4, recent: int | None = None,
                 draft: str | os.PathLike | None = None, draft_tokens: int = MAX_GAMMA):
        start = time.perf_counter()
        self.directory = Path(directory)
        try:
            self.backend = get_backend(device, threads)
        except ValueError as e:
            raise TinyrtError(str(e)) from None
        # the tokenizer first: its JSON parse peaks ~30 MB above what it keeps (freed, then
        # trimmed), a peak that would otherwise come on top of the loaded model's memory
        self.tokenizer = load_tokenizer(self.directory)
        self.template = template_from_config(self.tokenizer.config)
        trim_heap()
        self.model = load_model(self.directory, self.backend)
        self.config = cfg = self.model.config
        self.generation_config = _generation_config(self.directory)
        size = kv_size or min(cfg.max_position_embeddings, DEFAULT_KV_SIZE)
        if draft is not None and kv_policy == "h2o":
            raise TinyrtError("a draft does not work with --kv-policy h2o (its evictions follow "
                              "the attention of tokens a draft may take back); use dense or sink")
        if draft is not None and not 1 <= draft_tokens <= 32:
            raise TinyrtError(f"--draft-tokens must be between 1 and 32, got {draft_tokens}")
        self.draft_tokens = draft_tokens

        def cache(model_cfg):
            return make_cache(kv_policy, model_cfg.num_hidden_layers, model_cfg.num_key_value_heads,
                              model_cfg.head_dim, size, self.backend, kv_dtype(kv_type), sinks,
                              recent, slack=0 if draft is None else draft_tokens + 1)

        self.cache = cache(cfg)
        self.drafter = None if draft is None else self._drafter(str(draft), cache)
        gen_eos = self.generation_config.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = {i for i in (*cfg.eos_token_ids, *gen_eos, self.tokenizer.eos_id)
                        if isinstance(i, int)}
        self.load_s = time.perf_counter() - start

    def _drafter(self, draft: str, cache):
        """`lookup`, `layers:N` (this model's first N layers) or a draft model."""
        if draft == "lookup":
            return LookupDrafter()
        if draft.startswith("layers:"):
            try:
                n = int(draft.split(":", 1)[1])
            except ValueError:
                raise TinyrtError(f"--draft {draft}: N in layers:N is a number of layers") from None
            return self._model_drafter(first_layers(self.model, n), draft, cache)
        directory = resolve(draft, quiet=True)
        model = load_model(directory, self.backend)
        check_compatible(self.tokenizer, load_tokenizer(directory), self.config, model.config)
        return self._model_drafter(model, Path(directory).name, cache)

    def _model_drafter(self, model, name: str, cache) -> ModelDrafter:
        """A draft model on this model's KV cache where it is a copy of this model (see
        speculative.shares_cache), else on a cache of its own."""
        if shares_cache(self.model, model):
            return ModelDrafter(model, self.cache, name, shared=True)
        return ModelDrafter(model, cache(model.config), name)

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
        self.cache.reset()
        yield from self.generation(ids, **options)

    def generation(self, ids: Sequence[int], *, max_tokens: int = 512,
                   temperature: float | None = None, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repeat_penalty: float | None = None, seed: int | None = None,
                   stop: Sequence[str] = (), ignore_eos: bool = False) -> Generation:
        """A reply to prompt token `ids` appended to what the cache holds. Sampling options left
        None take the model's generation_config.json or the sampler's defaults; `ignore_eos`
        goes on past end-of-sequence tokens (to max_tokens, or a full dense cache)."""
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     repeat_penalty=repeat_penalty)
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

    def generate(self, prompt: Prompt, **options) -> str:
        """The whole reply as text (options as for `stream`)."""
        return "".join(r.text for r in self.stream(prompt, **options))


def load(model: str | os.PathLike | None = None, *, device: str = "auto",
         threads: int | None = None, kv_size: int | None = None, kv_type: str = "f16",
         kv_policy: str = "dense", sinks: int = 4, recent: int | None = None,
         draft: str | os.PathLike | None = None, draft_tokens: int = MAX_GAMMA,
         quiet: bool = False) -> LLM:
    """Load a model: a model directory, a GGUF file or HF directory (converted once and cached),
    a known name, or None for the default model (fetched and converted on first use). `draft`
    (speculative decoding): a model with the same vocabulary (as `model`), `lookup` (prompt
    lookup) or `layers:N` (the model's first N layers); drafts of at most `draft_tokens`."""
    start = time.perf_counter()
    if draft is not None and str(draft) != "lookup" and not str(draft).startswith("layers:"):
        draft = resolve(draft, quiet=quiet)          # (a file converts here, with progress)
    llm = LLM(resolve(model, quiet=quiet), device=device, threads=threads, kv_size=kv_size,
              kv_type=kv_type, kv_policy=kv_policy, sinks=sinks, recent=recent, draft=draft,
              draft_tokens=draft_tokens)
    llm.load_s = time.perf_counter() - start
    return llm
