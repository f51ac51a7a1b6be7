"""The generation loop: token ids, then response objects with text deltas and timings.

Layers: `Generation._token_ids` runs prefill and decode and yields token ids; iterating a
`Generation` turns them into `Response`s (incremental detokenization, stop strings, EOS, max tokens)
and keeps the timings, the one place where time is measured. Printers (CLI, chat) only read the
responses.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from tinyrt.errors import CacheFullError

from .sampling import Sampler
from .tokenizer import Detokenizer, Tokenizer


@dataclass
class Timings:
    load_s: float = 0.0
    prompt_tokens: int = 0       # prefilled; `cached_tokens` more the cache held already
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0       # the forward pass over the prompt
    ttft_s: float = 0.0          # start of the request to the first token
    decode_s: float = 0.0        # every later forward pass and draw
    decode_steps: int = 0        # tokens after the first
    speculative: Any = None      # speculative.SpecStats when a draft proposes tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tok_s"], d["decode_tok_s"] = self.prefill_tok_s, self.decode_tok_s
        if self.speculative is None:
            del d["speculative"]
        else:
            d["speculative"] = self.speculative.as_dict()
        return d


@dataclass
class Response:
    """One step of a streamed reply."""

    text: str                     # text released by this step (may be empty)
    token: int | None             # the token drawn (None on a final flush)
    finish_reason: str | None     # None while streaming; "stop" (EOS or stop string) or "length"
    timings: Timings


class StopStrings:
    """Finds stop strings in streamed text, holding back any tail that could begin one."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to release, whether a stop string was reached)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def check_fits(cache, n_prompt: int, context: int) -> None:
    """A clear error, before any work, for a prompt the cache cannot take (a streaming cache
    takes any prompt, in chunks)."""
    if not cache.fits(n_prompt):
        raise CacheFullError(
            f"the prompt has {n_prompt} tokens but the KV cache has room for {cache.free} "
            f"(size {cache.capacity}, model context {context}); shorten the prompt or use a larger "
            "--kv-size")


class DecoderHolder:
    """Where an owner of replies (an `LLM`) keeps the device decoder (tinyrt.device_decode) of
    its last reply for the next: a new decoder's first step runs eagerly and then captures the
    step's CUDA graph, hundreds of launches from Python twice over (a quarter second a reply at
    Llama-2-7B's size), which a decoder restarted in place skips. At most one is kept: one that
    does not serve the next reply (another cache, other sampler settings) is dropped first, so
    that its graph's memory is freed before a new one is made."""

    def __init__(self):
        self.decoder = None

    def decoder_for(self, model, cache, sampler: Sampler, history, graph: bool):
        """A decoder for a reply's steps: the kept one restarted where it serves them, else a
        new one, kept (unless the kept one is still stepping another reply: it stays)."""
        from . import device_decode      # (it imports the CUDA kernels)

        kept = self.decoder
        if kept is not None and kept.serves(model, cache, sampler, graph):
            kept.restart(sampler, history)
            return kept

        def made():
            return device_decode.DeviceDecoder(model, cache, sampler, history, graph=graph)

        if kept is not None and kept.busy:     # (another reply steps on it still: it stays)
            return made()
        self.decoder = kept = None             # (freed before the new one allocates)
        self.decoder = made()
        return self.decoder

    def drop(self) -> None:
        """Forget the kept decoder (a reply that steps on the host), unless it is stepping."""
        if self.decoder is not None and not self.decoder.busy:
            self.decoder = None


class Generation:
    """One reply: iterate to get `Response`s. The cache must already hold any earlier context.
    `decoders`, where given, keeps a GPU's decoder from one reply to the next (DecoderHolder)."""

    def __init__(self, model, cache, tokenizer: Tokenizer, prompt: Sequence[int], sampler: Sampler,
                 *, max_tokens: int, eos_ids: Iterable[int], stop: Iterable[str] = (),
                 load_s: float = 0.0, decoders: DecoderHolder | None = None):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.decoders = decoders
        self.prompt = list(prompt)
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.eos_ids = set(eos_ids)
        self.stop = StopStrings(stop)
        self.timings = Timings(load_s=load_s, prompt_tokens=len(self.prompt))
        self.tokens = array("i")               # the reply's ids: 4 bytes a token
        self.finish_reason: str | None = None
        self.on_done = None      # called once the reply's forward passes are over (LLM.complete)
        check_fits(cache, len(self.prompt), model.config.max_position_embeddings)

    def _logits(self, ids: Sequence[int]) -> np.ndarray:
        return self.model.backend.to_numpy(self.model.forward(ids, self.cache))[-1]

    def _token_ids(self) -> Iterator[int]:
        t = self.timings
        start = time.perf_counter()
        logits = self._logits(self.prompt)
        t.prefill_s = time.perf_counter() - start
        keep = self.sampler.history_size      # ids the sampler reads: a bounded list, however long
        history = self.prompt[len(self.prompt) - keep:] if keep else []
        tok = self.sampler(logits, history)
        t.ttft_s = time.perf_counter() - start
        device = self._device_decoder(history)
        try:
            while True:
                if keep:
                    history.append(tok)
                    if len(history) > 2 * keep:
                        del history[:-keep]
                yield tok
                if not (self.cache.fits(1) if device is None else device.fits()):
                    return
                step = time.perf_counter()
                if device is not None:
                    tok = device.step(tok)
                else:
                    tok = self.sampler(self._logits([tok]), history)
                t.decode_s += time.perf_counter() - step
                t.decode_steps += 1
        finally:
            if device is not None:
                device.finish()

    def _device_decoder(self, history):
        """Decode steps on the GPU (tinyrt.device_decode) where they can run, else None."""
        be = self.model.backend
        if be.name != "cuda":
            return None
        from . import device_decode      # (it imports the CUDA kernels)

        if not device_decode.usable(self.model, self.cache):
            if self.decoders is not None:
                self.decoders.drop()
            return None
        if self.decoders is None:
            return device_decode.DeviceDecoder(self.model, self.cache, self.sampler, history,
                                               graph=be.cuda_graph)
        return self.decoders.decoder_for(self.model, self.cache, self.sampler, history,
                                         be.cuda_graph)

    def __iter__(self) -> Iterator[Response]:
        detok = Detokenizer(self.tokenizer)
        t = self.timings
        reason, hit_stop = "length", False
        ids = self._token_ids()
        try:
            for tok in ids:
                if tok in self.eos_ids:
                    reason = "stop"
                    break
                self.tokens.append(tok)
                t.generated_tokens = len(self.tokens)
                text, hit_stop = self.stop.feed(detok.add(tok))
                yield Response(text, tok, None, t)
                if hit_stop:
                    reason = "stop"
                    break
                if len(self.tokens) >= self.max_tokens:
                    break
        finally:
            ids.close()          # (a speculative step settles its caches)
            if self.on_done is not None:
                self.on_done()
        tail = ""
        if not hit_stop:  # release what was held back, unless a stop string cut the reply
            tail, hit_stop = self.stop.feed(detok.flush())
            if hit_stop:
                reason = "stop"
            else:
                tail += self.stop.flush()
        self.finish_reason = reason
        yield Response(tail, None, reason, t)
