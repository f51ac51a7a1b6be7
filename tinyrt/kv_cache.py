"""The KV cache: contiguous buffers allocated once, and slot tables saying what each slot holds.

The contract every policy implements (the decoder, the generation loop and speculative decoding
use nothing else):

- `allocate(n)`: take slots for the next n tokens and return their positions [n] (the RoPE angle
  and the causal order); a policy may evict, or refuse with CacheFullError;
- `layer(i)` -> `LayerView` of layer i: its K and V buffers, the slots the last `allocate` gave
  each KV head, the positions slots [0, span) hold (-1: not read) and the scores to add to;
- `rollback(n)`: forget the last n appended tokens; `can_rollback` says whether the policy
  can (speculative decoding needs it), `fits(n)`, `free` and `chunk` how many tokens may come;
- `reset()`: empty, buffers kept;
- memory figures: `nbytes` (the buffers) and `bytes_per_token` (one token's K and V, all layers).

Layout: K and V are [n_layers, kv_heads, capacity, head_dim]; attention reads slots [0, span),
in whatever order they hold positions. The policies (`POLICIES`, picked by `--kv-policy`):

- dense (KVCache): fill in order, then refuse;
- sink (SinkCache): StreamingLLM's attention sinks and a ring over the recent tokens; n_sink = 0
  is the sliding window;
- h2o (H2OCache): sinks, a window of recent tokens and the heavy hitters, the tokens with the
  most attention lately (a decaying sum), chosen per KV head of every layer.

Dense and sink give every layer and head the same slots (one slot table); h2o keeps one table per
KV head of each layer, and a score per slot that the attention kernels add to. A model with
sliding-window layers gets a WindowedCache: those layers in a ring of their window, the others in
the policy's cache. The settings travel as one `kv_options.CacheOptions`, from the command line
or the API to `make_cache`.

Elements are float16 by default, as llama.cpp keeps them: half the memory and half the bytes
decode attention reads per token, for a relative rounding error of at most 2**-11 per element.
float32 ("f32") keeps the float path bit-comparable with float32 references. q8, q4 and q2 hold
KIVI's codes (kernels.kv_quant: its layout, and how the most recent tokens and the sinks stay
float16): K and V are then one kv_quant.QuantKV (`self.k`; `self.v` is None), which the
backend's store_kv, attention and read_kv take in place of the buffers; slot tables and
policies are the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from tinyrt.errors import CacheFullError, TinyrtError
from tinyrt.kernels import kv_quant
from tinyrt.kv_options import POLICY_NAMES, RING_CHUNK, CacheOptions, windowed_layers
from tinyrt.memory import CACHE_HINT, ensure_fits


class KVLayout(NamedTuple):
    """What a cache must know of its model: sizes, each layer's RoPE frequencies [head_dim/2]
    (the sink policy re-rotates its sinks' keys) and each layer's sliding window (None: none,
    or not known)."""

    n_layers: int
    kv_heads: int
    head_dim: int
    layer_freqs: list
    windows: list | None = None

    @classmethod
    def of(cls, model) -> "KVLayout":
        c = model.config
        return cls(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.layer_freqs,
                   [c.window(i) for i in range(c.num_hidden_layers)])

    def part(self, layers: list[int]) -> "KVLayout":
        """The layout of some of its layers."""
        windows = self.windows or [None] * self.n_layers
        return KVLayout(len(layers), self.kv_heads, self.head_dim,
                        [self.layer_freqs[i] for i in layers], [windows[i] for i in layers])


class LayerView(NamedTuple):
    """One layer's part of the cache, as the decoder's attention reads and writes it."""

    k: Any                  # [G, capacity, D] keys (float16 or float32; a backend's array), or
                            # the layer's kernels.kv_quant.QuantKV (keys and values)
    v: Any                  # [G, capacity, D] values, or None with a QuantKV
    slots: np.ndarray       # [G, n] int64: the slot each KV head puts each new token in
    k_pos: np.ndarray       # [G, span] int64: the position each slot [0, span) holds (-1: not read)
    score: Any              # [G, capacity] float32 attention accumulated per slot, or None


class KVCache:
    """Dense policy: token t takes slot t until the cache is full."""

    policy = "dense"
    streams = False        # whether it takes any number of tokens (evicting) or stops when full
    n_sink = 0

    def __init__(self, layout: KVLayout, capacity: int, backend,
                 options: CacheOptions | None = None):
        if capacity <= 0:
            raise CacheFullError(f"the KV cache needs a positive size, got {capacity}")
        n_layers, kv_heads, head_dim = layout.n_layers, layout.kv_heads, layout.head_dim
        options = options or CacheOptions()
        options.check(layout)
        self.quantized = bool(options.bits)
        if self.quantized and not backend.quantized_kv:
            raise TinyrtError(f"--kv-type {options.kv_type} needs kernels that read KV codes; "
                              f"the {backend.name} kernels read f16 and f32 caches")
        if self.quantized:       # whole blocks of slots
            B = options.group
            slots = -(-capacity // B) * B
            pin, entries = options.pool()
            need = n_layers * kv_heads * (kv_quant.token_bytes(options.bits, B, head_dim) * slots
                                          + entries * 4 * B * head_dim)
        else:
            need = 2 * n_layers * kv_heads * capacity * head_dim * options.dtype.itemsize
        if backend.host_memory:          # a GPU reports its own shortage
            ensure_fits(f"a KV cache of {capacity:,} tokens", int(need), CACHE_HINT)
        self.layout, self.backend = layout, backend
        self.capacity, self.kv_heads = capacity, kv_heads
        if self.quantized:
            self.k = kv_quant.allocate((n_layers, kv_heads), slots, head_dim, options.bits, B,
                                       entries, pin, backend.zeros)
            self.v = None
            self._per_layer = [(self.k.rows(i), None) for i in range(n_layers)]
        else:
            self.k = backend.zeros((n_layers, kv_heads, capacity, head_dim), options.dtype)
            self.v = backend.zeros((n_layers, kv_heads, capacity, head_dim), options.dtype)
            self._per_layer = list(zip(self.k, self.v))
        self.slot_pos = np.full(capacity, -1, dtype=np.int64)    # the position each slot holds
        self.length = 0        # tokens held
        self.span = 0          # slots [0, span) may be in use
        self.next_pos = 0      # the position the next token gets
        self._slots = self._k_pos = None     # [G, n] and [G, span]: what layer() gives every layer

    @property
    def can_rollback(self) -> bool:
        """Whether `rollback` can take back the last tokens (of at most `slack` for a policy that
        evicts): speculative decoding needs it."""
        return True

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V buffers (of a quantized cache: all its arrays)."""
        return self.k.nbytes + (0 if self.quantized else self.v.nbytes)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V in every layer (quantized: codes, scales and zeros)."""
        if self.quantized:
            L, G, D = self.layout.n_layers, self.kv_heads, self.layout.head_dim
            return round(L * G * kv_quant.token_bytes(self.k.bits, self.k.block, D))
        return self.nbytes // self.capacity

    def _flat(self) -> tuple:
        """The K and V buffers with every layer's KV heads as one axis of rows."""
        if self.quantized:
            return self.k.flat(), None
        L, G, C, D = self.k.shape
        return self.k.reshape(L * G, C, D), self.v.reshape(L * G, C, D)

    @property
    def free(self) -> int:
        """How many more tokens fit without evicting any."""
        return self.capacity - self.length

    @property
    def chunk(self) -> int:
        """The most tokens one forward pass may append (longer prompts go in chunks)."""
        return self.capacity

    def fits(self, n: int) -> bool:
        """Whether n more tokens can be appended (after evictions, for a streaming policy)."""
        return n <= self.free

    def holds(self, n: int) -> bool:
        """Whether n tokens fit the cache when it is empty (a streaming policy takes any)."""
        return n <= self.capacity

    def allocate(self, n: int) -> np.ndarray:
        """Take slots for the next n tokens (see `layer`); returns their positions [n]."""
        if n > self.free:
            raise CacheFullError(
                f"the KV cache holds {self.capacity} tokens and {self.length} are in use; "
                f"{n} more do not fit. Use a larger --kv-size, or --kv-policy sink or h2o to "
                "stream past the cache size")
        slots = np.arange(self.length, self.length + n)
        self.slot_pos[slots] = slots
        self.length += n
        self.next_pos += n
        self.span = max(self.span, self.length)
        return self._taken(slots, slots.copy())

    def _taken(self, slots: np.ndarray, pos: np.ndarray) -> np.ndarray:
        G = self.kv_heads
        self._slots = np.ascontiguousarray(np.broadcast_to(slots, (G, len(slots))))
        self._k_pos = np.ascontiguousarray(np.broadcast_to(self._visible(), (G, self.span)))
        return pos

    def _visible(self) -> np.ndarray:
        """The positions of slots [0, span) that attention reads (-1: not read)."""
        return self.slot_pos[:self.span]

    def layer(self, i: int) -> LayerView:
        """Layer i's buffers, the slots of the tokens of the last `allocate` and the positions
        slots [0, span) hold (see LayerView); no scores."""
        return LayerView(*self._per_layer[i], self._slots, self._k_pos, None)

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.slot_pos[..., self.length - n:self.length] = -1
        self.length -= n
        self.next_pos -= n
        self.span = self.length

    def reset(self) -> None:
        self.slot_pos[...] = -1
        self.length = self.span = self.next_pos = 0
        if self.quantized:
            kv_quant.reset(self.k)

    def slot_positions(self) -> np.ndarray:
        """Positions of slots [0, span) (-1 for a free slot)."""
        return self.slot_pos[..., :self.span]


class SinkCache(KVCache):
    """StreamingLLM: the first n_sink tokens stay in slots [0, n_sink) (the attention sinks);
    later tokens take the other W = capacity - n_sink slots as a ring, each overwriting the
    oldest. n_sink = 0 is the plain sliding window. `slack` slots more in the ring keep as many
    older tokens, unread, so that the last `slack` tokens can be rolled back (speculative
    decoding) however far the ring has wrapped: attention still reads the sinks and the last W.

    Positions within the cache (StreamingLLM section 3.2) without re-rotating the cache: a token
    keeps the RoPE rotation of its position in the stream, which gives the right distance
    between a query and every token of the window (they are consecutive in the stream). Only the
    sinks fall behind: their distance to a query must be that of cache positions, so once the
    window has moved past position n_sink the sink keys are re-rotated to position
    i + sink_shift, where sink_shift = (the oldest position in the window) - n_sink. `allocate`
    does that (n_sink x kv_heads rows per layer, all layers in one RoPE and one store) from
    float32 copies of the sinks' un-rotated keys and of their values, taken from the cache the
    first time (sink i still rotated by its own position i then), so no rounding accumulates.
    """

    policy = "sink"
    streams = True

    def __init__(self, layout: KVLayout, capacity: int, backend,
                 options: CacheOptions | None = None):
        options = options or CacheOptions()
        n_sink, slack = options.sinks, options.slack
        options.check_size(capacity)
        super().__init__(layout, capacity + slack, backend, options)
        self.size = capacity         # the sinks and the window; slack slots come on top
        self.n_sink = n_sink
        self.window = capacity - n_sink
        self.ring = self.window + slack
        self.slack = slack
        self.sink_keys = None        # float32 [n_sink, n_layers * kv_heads, D], un-rotated
        self.sink_values = None      # float32 [n_sink, n_layers * kv_heads, D]
        self.rotated_shift = 0       # the shift the cached sink keys are rotated for

    @property
    def chunk(self) -> int:
        # a chunk that filled the whole window would see only the sinks before it
        return max(1, min(512, self.window // 2))

    @property
    def free(self) -> int:
        return self.size - self.length

    def fits(self, n: int) -> bool:
        return True            # in chunks, evicting

    def holds(self, n: int) -> bool:
        return True

    @property
    def sink_shift(self) -> int:
        """(oldest position in the window) - n_sink: 0 until the window first wraps."""
        return max(0, self.next_pos - self.size)

    def _visible(self) -> np.ndarray:
        pos = self.slot_pos[:self.span]
        if not self.slack:
            return pos
        # the slack slots' older tokens are kept for a rollback, not read: attention reads the
        # sinks and the last `window` positions, as without slack
        return np.where((pos >= self.n_sink) & (pos < self.next_pos - self.window), -1, pos)

    def _slot(self, pos: np.ndarray) -> np.ndarray:
        return np.where(pos < self.n_sink, pos, self.n_sink + (pos - self.n_sink) % self.ring)

    def allocate(self, n: int) -> np.ndarray:
        self._check_chunk(n)
        slots = self._slot(np.arange(self.next_pos, self.next_pos + n))
        self.length += int((self.slot_pos[slots] < 0).sum())
        pos = self._positions(n)
        self.slot_pos[slots] = pos
        self.span = max(self.span, int(slots.max()) + 1)
        self._rotate_sinks()
        return self._taken(slots, pos)

    def _rotate_sinks(self, shift: int | None = None) -> None:
        """Rotate the sinks' cached keys to positions i + shift (default sink_shift: see the
        class), if they are not rotated so already."""
        n, shift = self.n_sink, self.sink_shift if shift is None else shift
        if not n or shift == self.rotated_shift or not self.layout.n_layers:
            return
        be, G = self.backend, self.kv_heads
        k_buf, v_buf = self._flat()

        def rotated(k, positions, sign):      # k [n, L*G, D]: each layer's rows by its frequencies
            groups = {}
            for i, f in enumerate(self.layout.layer_freqs):
                groups.setdefault(id(f), (f, []))[1].extend(range(i * G, (i + 1) * G))
            if len(groups) == 1:
                cos, sin = be.rope_tables(self.layout.layer_freqs[0], positions)
                return be.rope(k, cos, sign * sin)
            out = np.array(be.to_numpy(k), np.float32)        # (Gemma 3's two kinds of layer)
            for f, rows in groups.values():
                cos, sin = be.rope_tables(f, positions)
                out[:, rows] = be.to_numpy(be.rope(out[:, rows], cos, sign * sin))
            return out

        if self.sink_keys is None:       # rows [L*G, n, D] -> [n, L*G, D]
            k, v = (np.ascontiguousarray(a.transpose(1, 0, 2))
                    for a in be.read_kv(k_buf, v_buf, n))
            self.sink_keys, self.sink_values = rotated(k, np.arange(n), -1), v
        slots = np.tile(np.arange(n), (self.sink_keys.shape[1], 1))              # [L*G, n]
        be.store_kv(k_buf, v_buf, slots, rotated(self.sink_keys, np.arange(n) + shift, 1),
                    self.sink_values)
        self.rotated_shift = shift

    def _check_chunk(self, n: int) -> None:
        if n > self.window:
            raise CacheFullError(f"{n} tokens at once exceed the window of {self.window} "
                                 "slots (longer prompts are run in chunks)")

    def _positions(self, n: int) -> np.ndarray:
        pos = np.arange(self.next_pos, self.next_pos + n)
        self.next_pos += n
        return pos

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens. The tokens they overwrote are gone: refused unless
        the window keeps its `window` most recent tokens, which the `slack` slots allow for up
        to `slack` tokens (speculative decoding's drafts)."""
        self.check_rollback(n)
        slots = self._slot(np.arange(self.next_pos - n, self.next_pos))
        self.slot_pos[slots] = -1
        self.length -= n
        self.next_pos -= n
        if self.next_pos < self.n_sink and self.sink_keys is not None:
            # sinks to come again: the kept ones back at their own positions, and the copies
            # taken again (of the new sinks) once the window next moves
            self._rotate_sinks(0)
            self.sink_keys = self.sink_values = None
        used = np.flatnonzero(self.slot_pos >= 0)
        self.span = int(used[-1]) + 1 if used.size else 0

    def check_rollback(self, n: int) -> None:
        """A ValueError if `rollback(n)` cannot be done (it changes nothing then)."""
        ring = self.length - min(self.n_sink, self.next_pos)           # tokens in the ring
        gone = min(n, max(0, self.next_pos - self.n_sink))               # of them rolled back
        keep = min(self.window, max(0, self.next_pos - n - self.n_sink))
        if not 0 <= n <= self.next_pos or ring - gone < keep:
            raise ValueError(f"cannot roll back {n} tokens of a {self.policy} cache that has "
                             "evicted the tokens before them")

    def reset(self) -> None:
        super().reset()
        self.sink_keys = self.sink_values = None
        self.rotated_shift = 0


# per token appended, the factor on every earlier query's share of an h2o score (a time
# constant of about 100 tokens): long enough to keep what the text keeps returning to, short
# enough to let go of what it has left (chosen with benchmarks/kv_policies.py budget; README)
SCORE_DECAY = 0.99
SCORE_FLOOR = 1e-30     # a score decayed below this is 0 (no slow denormal arithmetic)


class H2OCache(SinkCache):
    """H2O (Zhang et al., 2023) with attention sinks: the first n_sink tokens stay, the `recent`
    most recent tokens stay, and the other capacity - n_sink - recent slots keep the heavy
    hitters: the tokens that have received the most attention lately. A token's score is the
    attention it received from every query (prefill and decode, summed over the query heads of
    a GQA group), each query's weight decaying by SCORE_DECAY for every token appended after it
    (a chunk of n tokens: the scores decay by SCORE_DECAY**n, then its queries add theirs).
    Each KV head of each layer keeps its own set (its own slot table, `slot_pos` [L, G,
    capacity]); a new token takes, in every head, the slot of the lowest-scored token outside
    the sinks and the recent window (ties: the lowest slot), or a free slot while there is one.

    Why a decaying sum and not H2O's plain one: a plain sum favours old tokens, which have had
    more queries to collect attention from, so the heavy hitters go stale as the text moves on,
    and on texts whose context is mostly local (code, documentation) h2o then loses to a sink
    cache of the same size (benchmarks/kv_policies.py budget; the README has the figures).

    Tokens keep the RoPE rotation of their stream position, so the distance between a query and a
    heavy hitter is the true one; the sinks are re-rotated as SinkCache does, to sit just before
    the window they would have in a sink cache of the same size.

    With KIVI's codes (kernels.kv_quant), a new token does not take its victim's slot: the
    victim's slot becomes a hole, and the new token takes a hole of the block the last new
    token went to, or else of the block with the most holes. One spare block of slots per row
    keeps holes to fill, so new tokens go to a few blocks at a time, which stay in the float
    pool while they fill: taking their victims' slots, they would be spread over every block,
    each opened for one token and sealed again a few tokens later, and no recent token would
    stay float.
    """

    policy = "h2o"

    def __init__(self, layout: KVLayout, capacity: int, backend,
                 options: CacheOptions | None = None):
        options = options or CacheOptions()
        # a quantized cache: capacity tokens in whole blocks of slots, and a spare block
        B = options.group
        spare = -(-capacity // B) * B + B - capacity if options.bits else 0
        super().__init__(layout, capacity, backend, dataclasses.replace(options, slack=spare))
        self.slack = 0                 # (not for rollbacks: the spare slots are holes)
        self.block = B if options.bits else 0
        n_layers, kv_heads, recent = layout.n_layers, layout.kv_heads, options.recent
        # the recent window by default: 64 tokens, or half the slots past the sinks in a small
        # cache. The default model streaming 2048 tokens through 410 slots: 16 to 64 recent
        # tokens measure best (PPL 23.4 to 23.25), better than H2O's even split (25.6); through
        # 64 slots, half (30 recent tokens: 50.1; 7: 72.6) (`tinyrt ppl --stream --recent`)
        self.recent = min(64, max(1, self.window // 2)) if recent is None else recent
        options.check_size(capacity, self.recent)
        self.slot_pos = np.full((n_layers, kv_heads, capacity + spare), -1, dtype=np.int64)
        self.score = np.zeros((n_layers, kv_heads, capacity + spare), np.float32)
        self._filling = np.full((n_layers, kv_heads), -1, np.int64)  # the block new tokens fill
        self._holes = None             # [L, G, blocks] holes per block, once evictions began
        # each layer's buffers, slot table and scores, indexed once (layer() runs per layer
        # per token)
        self._views = [(*kv, table, score) for kv, table, score
                       in zip(self._per_layer, self.slot_pos, self.score)]

    def allocate(self, n: int) -> np.ndarray:
        self._check_chunk(n)
        L, G, S = self.slot_pos.shape
        held = self.length
        evict = n - min(n, self.size - held)      # free slots [held, size) first, in order
        pos = self._positions(n)
        slots = np.empty((L, G, n), np.int64)
        slots[..., :n - evict] = np.arange(held, held + n - evict)
        self.score *= np.float32(SCORE_DECAY ** n)
        self.score[self.score < SCORE_FLOOR] = 0
        if evict:      # the lowest scored outside the sinks and the recent window (there are
                       # at least n of those: n <= window)
            victims = self.backend.lowest_scored(
                self.slot_pos, self.score, self.n_sink, pos[-1] - self.recent, evict)
            slots[..., n - evict:] = self._fill_holes(victims, pos[n - evict:]) if self.block \
                else victims
        np.put_along_axis(self.slot_pos, slots, pos, axis=-1)
        np.put_along_axis(self.score, slots, 0, axis=-1)
        self.length = held + n - evict
        self.span = S if evict and self.block else self.length
        self._slots = slots
        self._rotate_sinks()
        return pos

    def _fill_holes(self, victims: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Slots [L, G, len(pos)] for new tokens at positions pos in a quantized cache, once the
        victims' slots [L, G, len(pos)] are holes (holding no position): in each row the lowest
        hole of the block it is filling, or else of the block with the most holes (see the
        class). The holes are counted per block as they come and go."""
        L, G, S = self.slot_pos.shape
        B = self.block
        np.put_along_axis(self.slot_pos, victims, -1, axis=-1)
        if self._holes is None:                  # the first evictions: count them all once
            self._holes = (self.slot_pos < 0).reshape(L, G, S // B, B).sum(axis=-1)
        else:
            for t in range(victims.shape[-1]):
                _add_at(self._holes, victims[..., t] // B, 1)
        table = self.slot_pos.reshape(L, G, S // B, B)
        slots = np.empty((L, G, len(pos)), np.int64)
        for t, p in enumerate(pos):
            filling = np.maximum(self._filling, 0)[..., None]
            left = np.take_along_axis(self._holes, filling, axis=-1)[..., 0]
            block = np.where((self._filling >= 0) & (left > 0), filling[..., 0],
                             self._holes.argmax(axis=-1))
            rows = np.take_along_axis(table, block[..., None, None], axis=2)[:, :, 0]
            slots[..., t] = block * B + (rows < 0).argmax(axis=-1)
            np.put_along_axis(self.slot_pos, slots[..., t:t + 1], p, axis=-1)
            _add_at(self._holes, block, -1)
            self._filling = block
        return slots

    def layer(self, i: int) -> LayerView:
        k, v, table, score = self._views[i]
        k_pos = table if self.span == self.capacity else np.ascontiguousarray(table[:, :self.span])
        return LayerView(k, v, self._slots[i], k_pos, score)

    @property
    def can_rollback(self) -> bool:
        return False         # once a token is evicted, every score has moved since

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens; refused once tokens were evicted (the scores of
        every token have moved since)."""
        if not 0 <= n <= self.length or self.next_pos > self.size:
            raise ValueError(f"cannot roll back {n} tokens of an h2o cache that has evicted tokens")
        KVCache.rollback(self, n)

    def reset(self) -> None:
        super().reset()
        self.score[...] = 0
        self._filling[...] = -1
        self._holes = None


def _add_at(counts: np.ndarray, index: np.ndarray, n: int) -> None:
    """counts[..., index[...]] += n: one index per row of counts [..., k]."""
    at = index[..., None]
    np.put_along_axis(counts, at, np.take_along_axis(counts, at, axis=-1) + n, axis=-1)


POLICIES = dict(zip(POLICY_NAMES, (KVCache, SinkCache, H2OCache)))


class WindowedCache:
    """Per-layer attention windows: the layers that attend only within a sliding window (Gemma
    3's five of every six, Mistral's and Phi-3's every layer) keep their last tokens only, in a
    ring (a sink cache without sinks, of the window, a pass's tokens and some slack: see
    kv_options.RING_CHUNK); the other layers are a cache of the chosen policy, which decides
    what the whole holds (its size, when it is full, what it evicts). Each `allocate` gives
    both the same positions; a layer reads its own part, where attention's window mask leaves
    a windowed layer the same keys as a full cache would. Rolling back past the ring's slack
    is refused (a chat turn then starts afresh, exactly).

    The cache of the other layers answers for the whole: `SHARED` names what it tells."""

    SHARED = {"capacity", "length", "next_pos", "free", "streams", "policy", "n_sink", "quantized",
              "can_rollback", "fits", "holds"}

    def __init__(self, layout: KVLayout, capacity: int, backend,
                 options: CacheOptions | None = None):
        options = options or CacheOptions()
        ringed, ring, slack = windowed_layers(layout.windows or [], capacity, options.slack)
        held = [i for i in range(layout.n_layers) if i not in ringed]
        self.held = POLICIES[options.kv_policy](layout.part(held), capacity, backend, options)
        self.ring = SinkCache(layout.part(ringed), ring, backend, options.ring_options(slack))
        self.layout, self.backend = layout, backend
        self._parts = [(self.ring, ringed.index(i)) if i in ringed else (self.held, held.index(i))
                       for i in range(layout.n_layers)]

    def __getattr__(self, name: str):
        if name in WindowedCache.SHARED:
            return getattr(self.held, name)
        raise AttributeError(name)

    @property
    def chunk(self) -> int:
        return min(self.held.chunk, RING_CHUNK)

    @property
    def nbytes(self) -> int:
        return self.held.nbytes + self.ring.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.held.bytes_per_token

    def allocate(self, n: int) -> np.ndarray:
        pos = self.held.allocate(n)           # (first: it may refuse, before the ring moves)
        self.ring.allocate(n)
        return pos

    def layer(self, i: int) -> LayerView:
        part, j = self._parts[i]
        return part.layer(j)

    def rollback(self, n: int) -> None:
        self.ring.check_rollback(n)
        self.held.rollback(n)                 # (it refuses before it changes anything)
        self.ring.rollback(n)

    def reset(self) -> None:
        self.held.reset()
        self.ring.reset()


def make_cache(options: CacheOptions, model) -> KVCache | WindowedCache:
    """A KV cache for `model` (a decoder: its config, RoPE frequencies and backend) as `options`
    say: with rings for its windowed layers where they are smaller than the cache."""
    layout, size = KVLayout.of(model), options.size_for(model.config)
    if windowed_layers(layout.windows, size, options.slack)[0]:
        return WindowedCache(layout, size, model.backend, options)
    return POLICIES[options.kv_policy](layout, size, model.backend, options)
