"""The KV cache: contiguous buffers allocated once, and slot tables saying what each slot holds.

Layout: K and V are [n_layers, kv_heads, capacity, head_dim]. The decoder asks `allocate(n)` for
the positions of n new tokens, then `layer(i)` for layer i's buffers, the slots its KV heads put
the new tokens in and the positions their slots hold (-1 for a free slot), and attends over
those: slots [0, span), in whatever order they hold positions. A policy decides which slot a
token takes:

- dense (KVCache): fill in order, then refuse;
- sink (SinkCache): StreamingLLM's attention sinks and a ring over the recent tokens; n_sink = 0
  is the sliding window;
- h2o (H2OCache): sinks, a window of recent tokens and the heavy hitters, the tokens with the
  most attention accumulated, chosen per KV head of every layer.

Dense and sink give every layer and head the same slots (one slot table); h2o keeps one table per
KV head of each layer, and a score per slot that the attention kernels add to.

Elements are float16 by default, as llama.cpp keeps them: half the memory and half the bytes
decode attention reads per token, for a relative rounding error of at most 2**-11 per element.
float32 ("f32") keeps the float path bit-comparable with float32 references.
"""

from __future__ import annotations

import numpy as np

from tinyrt.errors import CacheFullError, TinyrtError
from tinyrt.memory import ensure_fits

KV_TYPES = {"f16": np.float16, "f32": np.float32}


def kv_dtype(kv_type: str) -> np.dtype:
    """The element type of a KV cache named as on the command line (`--kv-type`)."""
    if kv_type not in KV_TYPES:
        raise TinyrtError(f"unknown KV cache type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
    return np.dtype(KV_TYPES[kv_type])


class KVCache:
    """Dense policy: token t takes slot t until the cache is full."""

    policy = "dense"
    streams = False        # whether it takes any number of tokens (evicting) or stops when full
    n_sink = 0

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
                 dtype=np.float16):
        if capacity <= 0:
            raise CacheFullError(f"the KV cache needs a positive size, got {capacity}")
        if backend.host_memory:          # a GPU reports its own shortage
            ensure_fits(f"a KV cache of {capacity:,} tokens",
                        2 * n_layers * kv_heads * capacity * head_dim * np.dtype(dtype).itemsize,
                        ": choose a smaller --kv-size")
        self.capacity, self.kv_heads = capacity, kv_heads
        self.k = backend.zeros((n_layers, kv_heads, capacity, head_dim), dtype)
        self.v = backend.zeros((n_layers, kv_heads, capacity, head_dim), dtype)
        self.slot_pos = np.full(capacity, -1, dtype=np.int64)    # the position each slot holds
        self.length = 0        # tokens held
        self.span = 0          # slots [0, span) may be in use
        self.next_pos = 0      # the position the next token gets
        self._slots = self._k_pos = None     # [G, n] and [G, span]: what layer() gives every layer

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

    def layer(self, i: int):
        """Layer i's K and V buffers [G, capacity, D], the slots its KV heads write the tokens
        of the last `allocate` to [G, n], the positions their slots [0, span) hold [G, span],
        and the attention scores to add to [G, capacity] (None: the policy keeps none)."""
        return self.k[i], self.v[i], self._slots, self._k_pos, None

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
    i + sink_shift, where sink_shift = (the oldest position in the window) - n_sink. The decoder
    does that (models.llama, n_sink x kv_heads rows per layer per step) from float32 copies of
    the sinks' un-rotated keys kept here (`sink_keys`, and their values in `sink_values`), so
    no rounding accumulates.
    """

    policy = "sink"
    streams = True

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
                 dtype=np.float16, n_sink: int = 4, slack: int = 0):
        if not 0 <= n_sink < capacity:
            raise CacheFullError(f"--sinks {n_sink} must be at least 0 and below the KV cache "
                                 f"size {capacity}")
        super().__init__(n_layers, kv_heads, head_dim, capacity + slack, backend, dtype)
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
        return self._taken(slots, pos)

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
        ring = self.length - min(self.n_sink, self.next_pos)           # tokens in the ring
        gone = min(n, max(0, self.next_pos - self.n_sink))               # of them rolled back
        keep = min(self.window, max(0, self.next_pos - n - self.n_sink))
        if not 0 <= n <= self.next_pos or ring - gone < keep:
            raise ValueError(f"cannot roll back {n} tokens of a {self.policy} cache that has "
                             "evicted the tokens before them")
        slots = self._slot(np.arange(self.next_pos - n, self.next_pos))
        self.slot_pos[slots] = -1
        self.length -= n
        self.next_pos -= n
        used = np.flatnonzero(self.slot_pos >= 0)
        self.span = int(used[-1]) + 1 if used.size else 0

    def reset(self) -> None:
        super().reset()
        self.sink_keys = self.sink_values = None
        self.rotated_shift = 0


class H2OCache(SinkCache):
    """H2O (Zhang et al., 2023) with attention sinks: the first n_sink tokens stay, the `recent`
    most recent tokens stay, and the other capacity - n_sink - recent slots keep the heavy
    hitters: the tokens that have received the most attention, summed over every query since
    they came in (prefill and decode) and over the query heads of a GQA group. Each KV head of
    each layer keeps its own set (its own slot table, `slot_pos` [L, G, capacity]); a new token
    takes, in every head, the slot of the lowest-scored token outside the sinks and the recent
    window (ties: the lowest slot), or a free slot while there is one.

    Tokens keep the RoPE rotation of their stream position, so the distance between a query and a
    heavy hitter is the true one; the sinks are re-rotated as SinkCache does, to sit just before
    the window they would have in a sink cache of the same size.
    """

    policy = "h2o"

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
                 dtype=np.float16, n_sink: int = 4, recent: int | None = None):
        super().__init__(n_layers, kv_heads, head_dim, capacity, backend, dtype, n_sink)
        # the recent window by default: 64 tokens, or half the slots past the sinks in a small
        # cache. The default model streaming 2048 tokens through 410 slots: 16 to 64 recent
        # tokens measure best (PPL 23.4 to 23.25), better than H2O's even split (25.6); through
        # 64 slots, half (30 recent tokens: 50.1; 7: 72.6) (`tinyrt ppl --stream --recent`)
        self.recent = min(64, max(1, self.window // 2)) if recent is None else recent
        if not 1 <= self.recent <= self.window:
            raise CacheFullError(f"--recent {self.recent} must be at least 1 and at most the "
                                 f"KV cache size less the sinks ({self.window})")
        self.backend = backend
        self.slot_pos = np.full((n_layers, kv_heads, capacity), -1, dtype=np.int64)
        self.score = np.zeros((n_layers, kv_heads, capacity), np.float32)
        # each layer's buffers, slot table and scores, indexed once (layer() runs per layer
        # per token)
        self._views = list(zip(self.k, self.v, self.slot_pos, self.score))

    def allocate(self, n: int) -> np.ndarray:
        self._check_chunk(n)
        L, G, C = self.slot_pos.shape
        held = self.length
        evict = n - min(n, C - held)              # free slots [held, C) first, in order
        pos = self._positions(n)
        slots = np.empty((L, G, n), np.int64)
        slots[..., :n - evict] = np.arange(held, held + n - evict)
        if evict:      # the lowest scored outside the sinks and the recent window (there are
                       # at least n of those: n <= window)
            slots[..., n - evict:] = self.backend.lowest_scored(
                self.slot_pos, self.score, self.n_sink, pos[-1] - self.recent, evict)
        np.put_along_axis(self.slot_pos, slots, pos, axis=-1)
        np.put_along_axis(self.score, slots, 0, axis=-1)
        self.length = self.span = held + n - evict
        self._slots = slots
        return pos

    def layer(self, i: int):
        k, v, table, score = self._views[i]
        k_pos = table if self.span == self.capacity else np.ascontiguousarray(table[:, :self.span])
        return k, v, self._slots[i], k_pos, score

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens; refused once tokens were evicted (the scores of
        every token have moved since)."""
        if not 0 <= n <= self.length or self.next_pos > self.capacity:
            raise ValueError(f"cannot roll back {n} tokens of an h2o cache that has evicted tokens")
        KVCache.rollback(self, n)

    def reset(self) -> None:
        super().reset()
        self.score[...] = 0


POLICIES = {"dense": KVCache, "sink": SinkCache, "h2o": H2OCache}


def make_cache(policy: str, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
               dtype=np.float16, n_sink: int = 4, recent: int | None = None,
               slack: int = 0) -> KVCache:
    """A KV cache of the named policy (`--kv-policy`); n_sink for sink and h2o, recent for h2o,
    slack (rollback after eviction) for sink."""
    if policy not in POLICIES:
        raise TinyrtError(f"unknown KV cache policy {policy!r}: choose one of {', '.join(POLICIES)}")
    args = (n_layers, kv_heads, head_dim, capacity, backend, dtype)
    if policy == "dense":
        return KVCache(*args)
    if policy == "sink":
        return SinkCache(*args, n_sink, slack)
    return H2OCache(*args, n_sink, recent)
