"""Decode steps that stay on the GPU, captured once in a CUDA graph and replayed.

A step on the CUDA backend is hundreds of kernel launches (10 a layer: models.llama
decode_layers); issued one by one from Python, with the positions, slot tables and RoPE angles
copied up and the logits copied down each token, the host is the bottleneck. Here a step
reads everything that changes from device memory (the token, the cache's state and tables:
kernels.cuda.step), so the same launches replay as a CUDA graph; sampling runs on the device
too (torch ops), and one token id crosses to the host per step.

While a `DeviceDecoder` runs, the device owns the KV cache's bookkeeping (position, length,
slot tables, h2o scores, the sinks' rotation and copies); `finish` writes it back into the cache
object, so that everything after (a next prompt, a rollback, `LLM.complete`'s prefix reuse) sees
the cache as the host steps would have left it.

A decoder outlives its reply: `restart` readies it for the next one over the same model, cache
object and sampler settings (`serves`), writing the cache's bookkeeping into the same device
tensors, so that the graph captured in the first reply replays in every later one (an `LLM`
keeps its last decoder: generate.DecoderHolder).

What runs here: the CUDA backend, a float16 or float32 cache (dense, sink, h2o, no rollback
slack), every sampler setting. A quantized (KIVI) cache or a draft model steps on the host.
`--no-cuda-graph` runs the same step eagerly (for debugging, and in Numba's CUDA simulator,
which cannot capture graphs).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from tinyrt.kernels.cuda import step as gs
from tinyrt.kernels.cuda.primitives import SIM

from .kv_cache import SCORE_DECAY, SCORE_FLOOR, H2OCache, KVCache, SinkCache
from .sampling import Sampler

UNIFORMS = 1024        # uniform numbers drawn on the device at a time (sampling reads one a step)


def usable(model, cache) -> bool:
    """Whether decode steps of `model` over `cache` can run on the device."""
    be = model.backend
    return (be.name == "cuda" and not cache.quantized and getattr(cache, "slack", 0) == 0
            and type(cache) in (KVCache, SinkCache, H2OCache)
            # (one set of RoPE frequencies for every layer and every step: not Gemma 3's two, or
            # NoPE layers', or longrope's, which change with the position)
            and all(f is model.layer_freqs[0] for f in model.layer_freqs)
            and model.layer_freqs_long is None)


def _scratch(be) -> tuple:
    """The storage of every tensor the backend keeps (scratch that a step reads, such as the
    split-K GEMVs' sums): a graph holds the addresses it was captured with, so a backend that
    has since put one in a new tensor (grown for a larger launch) needs a new capture."""
    t, out = be.torch, []
    for v in vars(be).values():
        out += [x.data_ptr() for x in (v if isinstance(v, tuple) else (v,))
                if isinstance(x, t.Tensor)]
    return tuple(out)


class DeviceSampler:
    """Sampler.__call__ on the device: the same penalties (over a ring of the last ids and their
    counts, kept on the device), greedy argmax, temperature, top-k, top-p and min-p, a draw from
    a uniform number read from a block drawn ahead (so that no random state changes inside a
    graph). Greedy gives the host sampler's token; a draw has the same distribution."""

    def __init__(self, be, sampler: Sampler, vocab: int, seed: int):
        t = self.torch = be.torch
        self.p = sampler.params
        self.device = dev = be.device
        self.n = sampler.history_size
        self.gen = t.Generator(device=dev)
        self.gen.manual_seed(seed)
        self.uniform = t.empty(UNIFORMS, device=dev)
        self.drawn = t.zeros(1, dtype=t.int64, device=dev)     # uniforms used
        self.vocab = vocab
        if self.n:     # the penalties' ring of the last ids, their counts [V + 1] (the last
                       # bucket counts the ring's empty places) and the ring's next place
            self.ring = t.empty(self.n, dtype=t.int64, device=dev)
            self.counts = t.empty(vocab + 1, device=dev)
            self.at = t.empty(1, dtype=t.int64, device=dev)

    def start(self, history, seed: int | None = None) -> None:
        """The ids so far (the last `repeat_last_n` count for the penalties), written into the
        sampler's own tensors (a captured graph reads them where they are); `seed` re-seeds the
        draws (a reused decoder's next reply)."""
        t = self.torch
        if seed is not None:
            self.gen.manual_seed(seed)
        self.drawn.zero_()
        if self.n:
            recent = np.asarray(list(history)[-self.n:], np.int64)
            ring = np.full(self.n, self.vocab, np.int64)
            ring[:len(recent)] = recent
            self.ring.copy_(t.as_tensor(ring))
            self.counts.copy_(t.as_tensor(np.bincount(ring, minlength=self.vocab + 1)))
            self.at.fill_(len(recent) % self.n)

    def refill(self) -> None:
        """A new block of uniform numbers (outside the graph, every UNIFORMS steps)."""
        self.uniform.uniform_(generator=self.gen)
        self.drawn.zero_()

    def penalized(self, logits):
        """logits [1, V] -> [V] float32, the penalties applied (Sampler.penalized)."""
        t, p = self.torch, self.p
        x = logits[0, :self.vocab]
        if self.n:
            counts = self.counts[:self.vocab]
            seen = counts > 0
            if p.repeat_penalty != 1.0:
                x = t.where(seen, t.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty), x)
            x = x - p.presence_penalty * seen - p.frequency_penalty * counts
        return x

    def candidates(self, x):
        """Penalized logits x [V] -> the ids a draw picks from, most likely first, and their
        weights (sampling.filtered_probs, not normalized: a draw scales by their sum)."""
        t, p = self.torch, self.p
        x = (x - x.max()) / p.temperature
        vals, ids = t.topk(x, p.top_k if 0 < p.top_k < x.shape[0] else x.shape[0])
        probs = t.softmax(vals, 0)
        if p.top_p < 1.0:              # the smallest prefix whose mass reaches top_p
            probs = probs * ((t.cumsum(probs, 0) - probs) < p.top_p)
        if p.min_p > 0.0:
            probs = probs * (probs >= p.min_p * probs[0])
        return ids, probs

    def __call__(self, logits, out) -> None:
        """logits [1, V] -> the token id into out [1] (int64)."""
        t = self.torch
        x = self.penalized(logits)
        if self.p.temperature == 0:
            out.copy_(t.argmax(x).reshape(1))
        else:
            ids, probs = self.candidates(x)
            c = t.cumsum(probs, 0)
            u = self.uniform.gather(0, self.drawn) * c[-1]
            i = t.searchsorted(c, u, right=True).clamp_(max=ids.shape[0] - 1)
            out.copy_(ids.gather(0, i))
            self.drawn.add_(1)
        if self.n:                     # the token enters the ring, the oldest leaves it
            old = self.ring.gather(0, self.at)
            self.counts.index_add_(0, old, t.full((1,), -1.0, device=out.device))
            self.ring.index_copy_(0, self.at, out)
            self.counts.index_add_(0, out, t.ones(1, device=out.device))
            self.at.add_(1).remainder_(self.n)


class DeviceDecoder:
    """Decode steps of `model` over `cache` on the device (see the module). `step(token)` feeds
    the token just drawn (only the first step's crosses to the device) and returns the next;
    `finish()` hands the cache's bookkeeping back to the host. `history` is the host's list of
    the ids so far, read at the first step (the penalties' window).

    A decoder serves later replies too (`restart`), where `serves` says that its captured step
    holds for them: the first step runs eagerly and then captures the graph, hundreds of
    launches from Python twice over, which a chat would otherwise pay on every reply. So every
    tensor a step reads or writes is allocated here once, and a restart copies the cache's
    state into those same tensors: a graph replays the addresses it recorded."""

    def __init__(self, model, cache, sampler: Sampler, history, *, graph: bool = True):
        be = self.be = model.backend
        t = self.t = be.torch
        self.model, self.cache = model, cache
        cfg = model.config
        L, G, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        C = cache.capacity
        dev = be.device
        self.policy = gs.H2O if isinstance(cache, H2OCache) else \
            gs.SINK if isinstance(cache, SinkCache) else gs.DENSE
        self.n_sink = cache.n_sink
        self.size = getattr(cache, "size", C)
        self.ring = getattr(cache, "ring", C)
        self.bakes = self._bakes(model, cache, sampler, graph)
        self.state = be.zeros(gs.N_STATE, np.int64)
        self.pos = self.state[gs.POS:gs.POS + 1]                   # the query's position [1]
        self.span = self.state[gs.SPAN:gs.SPAN + 1]      # the slots attention reads: [0, span)
        if self.policy == gs.H2O:
            self.table = be.zeros((L * G, C), np.int64)
            self.score = be.zeros((L * G, C))
            self.slots = be.zeros((L * G, 1), np.int64)
            rows = [slice(i * G, (i + 1) * G) for i in range(L)]
            self.views = [(self.slots[r], self.table[r], self.score[r]) for r in rows]
        else:
            self.table = be.zeros((1, C), np.int64)
            self.slots = be.zeros((G, 1), np.int64)
            self.views = [(self.slots, self.table, None)] * L
        self.inv_freq = t.as_tensor(np.asarray(model.layer_freqs[0]), device=dev)
        self.cos, self.sin = be.zeros((1, D // 2)), be.zeros((1, D // 2))
        self.attends = [self._attend(i) for i in range(L)]
        if self.n_sink and self.policy != gs.DENSE:
            self.sink_k = be.zeros((self.n_sink, L * G, D))
            self.sink_v = be.zeros((self.n_sink, L * G, D))
        self.tok = be.zeros(1, np.int64)
        self.sampler = DeviceSampler(be, sampler, cfg.vocab_size, 0)
        self.use_graph = graph and not SIM
        self.graph = None
        self.host_tok = t.zeros(1, dtype=t.int64, pin_memory=dev != "cpu")
        self.busy = False
        self.scratch = None       # the backend's tensors as the first step found them
        self.restart(sampler, history)

    @staticmethod
    def _bakes(model, cache, sampler: Sampler, graph: bool) -> tuple:
        """What a captured step holds as it was when it was recorded, beside the model and the
        cache object: the cache's buffers and sizes, and the sampler's settings (its branches
        and constants; the seed only seeds the draws, outside the graph)."""
        return (type(cache), cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity,
                cache.n_sink, getattr(cache, "size", None), getattr(cache, "ring", None),
                getattr(cache, "recent", None), dataclasses.replace(sampler.params, seed=None),
                graph)

    def serves(self, model, cache, sampler: Sampler, graph: bool) -> bool:
        """Whether this decoder's steps are a reply's over `model` and `cache` with `sampler`
        (and the graph it captured holds for them), so that `restart` may run them."""
        return not self.busy and model is self.model and cache is self.cache \
            and self._bakes(model, cache, sampler, graph) == self.bakes \
            and self.scratch in (None, _scratch(self.be))

    def restart(self, sampler: Sampler, history) -> None:
        """Start a reply: the cache's bookkeeping as the host holds it now (after the prompt)
        copied into the step's tensors in place, the sampler's seed drawn from `sampler` (as a
        new decoder draws it) and its penalties' window from `history` at the first step."""
        be, t, c = self.be, self.t, self.cache
        state = np.zeros(gs.N_STATE, np.int64)
        state[[gs.NEXT, gs.LENGTH]] = c.next_pos, c.length
        state[gs.SHIFT] = state[gs.ROTATED] = getattr(c, "rotated_shift", 0)
        state[gs.COPIES] = getattr(c, "sink_keys", None) is not None
        state[gs.SPAN] = c.span
        self.state.copy_(t.as_tensor(state))
        self.table.copy_(t.as_tensor(c.slot_pos.reshape(self.table.shape)))
        if self.policy == gs.H2O:
            self.score.copy_(t.as_tensor(c.score.reshape(self.score.shape)))
        if self.n_sink and self.policy != gs.DENSE and c.sink_keys is not None:
            # (the copies the host took, or the ones this decoder handed the cache last time)
            for mine, host in ((self.sink_k, c.sink_keys), (self.sink_v, c.sink_values)):
                if host is not mine:
                    mine.copy_(be.dev(host))
        self.history = history
        self.seed = int(sampler.rng.integers(2 ** 62))
        self.sampler.p = sampler.params
        self.steps = 0
        self.busy = True

    def fits(self) -> bool:
        """Whether one more token fits (a dense cache stops when full)."""
        return self.policy != gs.DENSE or self.cache.next_pos + self.steps < self.cache.capacity

    def _attend(self, i: int):
        """Layer i's attention for decode_layers: its q|k|v output made ready and stored, then
        attention over the slots in use (the span read from the device: a graph replays it).
        (It holds the tensors, not the decoder: no reference cycle keeps a dropped decoder's
        graph and its memory until a garbage collection.)"""
        be, cache, m = self.be, self.cache, self.model
        cfg = m.config
        slots, table, score = self.views[i]
        k_buf, v_buf, window = cache.k[i], cache.v[i], cfg.window(i)
        cos, sin, pos, span = self.cos, self.sin, self.pos, self.span

        def attend(qkv, L):
            q = be.rope_store(qkv, L.qkv_bias, L.q_norm, L.k_norm, cfg.rms_norm_eps, cos, sin,
                              k_buf, v_buf, slots, cfg.num_attention_heads)
            return be.attention(q, k_buf, v_buf, pos, table, m.scale, window, score, span)
        return attend

    def _step(self) -> None:
        """One decode step, every launch reading its inputs from device memory."""
        m, c = self.model, self.cache
        gs.launch_begin(self.state, self.policy, self.n_sink, self.size, self.ring)
        if self.policy == gs.H2O:
            gs.launch_take_slot_h2o(self.state, self.slots, self.table, self.score, self.n_sink,
                                    c.recent, SCORE_DECAY, SCORE_FLOOR)
        else:
            gs.launch_take_slot(self.state, self.slots, self.table)
        if self.n_sink and self.policy != gs.DENSE:
            k, v = c._flat()
            gs.launch_rotate_sinks(k, v, self.sink_k, self.sink_v, self.state, self.inv_freq)
        gs.launch_rope_row(self.inv_freq, self.state, self.cos, self.sin)
        self.sampler(m.decode_layers(m.embed_tokens(self.tok), self.attends), self.tok)

    def step(self, token: int) -> int:
        """The token after `token` (the one drawn last)."""
        t = self.t
        if self.steps == 0:
            self.tok.fill_(token)
            self.sampler.start(self.history, self.seed)
        if self.steps % UNIFORMS == 0:
            self.sampler.refill()
        if not self.use_graph:
            self._step()
        elif self.graph is None:
            self._warm_and_capture()
        else:
            self.graph.replay()
        if self.scratch is None:         # (the addresses a graph captured in this step holds)
            self.scratch = _scratch(self.be)
        self.steps += 1
        if self.be.device == "cpu":
            return int(self.tok[0])
        self.host_tok.copy_(self.tok, non_blocking=True)      # the one copy of a step
        t.cuda.current_stream().synchronize()
        return int(self.host_tok[0])

    def _warm_and_capture(self) -> None:
        """The first step runs eagerly on a side stream (kernels compiled and loaded, torch's
        allocator and cuBLAS warmed, as torch asks before a capture); then the step is captured
        for the next ones (capture records the launches, it runs nothing). A capture that fails
        in any way (torch's RuntimeError, Numba's CudaAPIError from a launch, anything) leaves
        the eager step: a generation must not end for want of a graph."""
        t = self.t
        if self.be.device == "cpu":       # (torch tensors in host memory: Numba's simulator)
            self._step()
        else:
            side = t.cuda.Stream()
            side.wait_stream(t.cuda.current_stream())
            with t.cuda.stream(side):
                self._step()
            t.cuda.current_stream().wait_stream(side)
        try:
            self.graph = self._capture()
        except Exception as e:           # noqa: BLE001 (the step it would record ran above)
            self.graph, self.use_graph = None, False
            first = e
            while first.__context__ is not None:   # the first failure, not capture_end's after
                first = first.__context__
            why = (str(first).splitlines() or [""])[0]
            print(f"note: a CUDA graph of the decode step could not be captured "
                  f"({type(first).__name__}: {why}); the steps run eagerly", file=sys.stderr)

    def _capture(self):
        """The decode step recorded as a CUDA graph."""
        t = self.t
        graph = t.cuda.CUDAGraph()
        stream = t.cuda.current_stream()
        try:
            with t.cuda.graph(graph, capture_error_mode="thread_local"):
                self._step()
        finally:   # (torch's graph leaves its capture stream current if ending the capture fails)
            t.cuda.set_stream(stream)
        return graph

    def finish(self) -> None:
        """Write the cache's bookkeeping back into the cache object (after the last step); the
        decoder may then `restart` for another reply."""
        self.busy = False
        if self.steps == 0:
            return
        c = self.cache
        state = self.be.to_numpy(self.state)
        c.next_pos, c.length = int(state[gs.NEXT]), int(state[gs.LENGTH])
        table = self.be.to_numpy(self.table)
        c.slot_pos[...] = table.reshape(c.slot_pos.shape)
        c.span = int(state[gs.SPAN])
        if self.policy == gs.H2O:
            c.score[...] = self.be.to_numpy(self.score).reshape(c.score.shape)
        if self.n_sink and self.policy != gs.DENSE:
            copies = state[gs.COPIES] or state[gs.SHIFT] != state[gs.ROTATED]
            c.rotated_shift = int(state[gs.SHIFT])
            if copies:
                c.sink_keys, c.sink_values = self.sink_k, self.sink_v
        self.steps = 0
