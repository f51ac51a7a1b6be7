"""The KV cache: contiguous buffers allocated once, and a slot table saying what each slot holds.

Layout: K and V are [n_layers, kv_heads, capacity, head_dim]; `layer(i)` gives the [kv_heads,
capacity, head_dim] pair of layer i. `slot_pos[s]` is the position of the token in slot s (-1 when
free). The decoder asks `allocate(n)` for the slots and positions of n new tokens, writes their K/V
there, and attends over `slot_positions()`: the leading slots in use, in whatever order they hold
positions. A policy decides which slot a token takes: dense (KVCache: fill in order, then refuse)
or sink (SinkCache: StreamingLLM's attention sinks and a ring over the recent tokens; n_sink = 0
is the sliding window).

Elements are float16 by default, as llama.cpp keeps them: half the memory and half the bytes
decode attention reads per token, for a relative rounding error of at most 2**-11 per element.
float32 ("f32") keeps the float path bit-comparable with float32 references.
"""

from __future__ import annotations

import numpy as np

from tinyrt.errors import CacheFullError, TinyrtError

KV_TYPES = {"f16": np.float16, "f32": np.float32}


def kv_dtype(kv_type: str) -> np.dtype:
    """The element type of a KV cache named as on the command line (`--kv-type`)."""
    if kv_type not in KV_TYPES:
        raise TinyrtError(f"unknown KV cache type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
    return np.dtype(KV_TYPES[kv_type])


class KVCache:
    """Dense policy: token t takes slot t until the cache is full."""

    policy = "dense"
    n_sink = 0

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
                 dtype=np.float16):
        if capacity <= 0:
            raise CacheFullError(f"the KV cache needs a positive size, got {capacity}")
        self.capacity = capacity
        self.k = backend.zeros((n_layers, kv_heads, capacity, head_dim), dtype)
        self.v = backend.zeros((n_layers, kv_heads, capacity, head_dim), dtype)
        self.slot_pos = np.full(capacity, -1, dtype=np.int64)
        self.length = 0        # tokens held
        self.span = 0          # slots [0, span) may be in use
        self.next_pos = 0      # the position the next token gets

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

    def allocate(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots and positions for the next n tokens."""
        if n > self.free:
            raise CacheFullError(
                f"the KV cache holds {self.capacity} tokens and {self.length} are in use; "
                f"{n} more do not fit. Use a larger --kv-size, or --kv-policy sink to "
                "stream past the cache size")
        slots = np.arange(self.length, self.length + n)
        self.slot_pos[slots] = slots
        self.length += n
        self.next_pos += n
        self.span = max(self.span, self.length)
        return slots, slots.copy()

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.slot_pos[self.length - n:self.length] = -1
        self.length -= n
        self.next_pos -= n
        self.span = self.length

    def reset(self) -> None:
        self.slot_pos[:] = -1
        self.length = self.span = self.next_pos = 0

    def slot_positions(self) -> np.ndarray:
        """Positions of slots [0, span) (-1 for a free slot): what attention reads."""
        return self.slot_pos[:self.span]

    def layer(self, i: int):
        return self.k[i], self.v[i]


class SinkCache(KVCache):
    """StreamingLLM: the first n_sink tokens stay in slots [0, n_sink) (the attention sinks);
    later tokens take the other W = capacity - n_sink slots as a ring, each overwriting the
    oldest. n_sink = 0 is the plain sliding window.

    Positions within the cache (StreamingLLM section 3.2) without re-rotating the cache: a token
    keeps the RoPE rotation of its position in the stream, which gives the right distance
    between a query and every token of the window (they are consecutive in the stream). Only the
    sinks fall behind: their distance to a query must be that of cache positions, so once the
    window has moved past position n_sink the sink keys are re-rotated to position
    i + sink_shift, where sink_shift = (the oldest position in the window) - n_sink. The decoder
    does that (models.llama, n_sink x kv_heads rows per layer per step) from float32 copies of
    the sinks' un-rotated keys kept here (`sink_keys`), so no rounding accumulates.
    """

    policy = "sink"

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
                 dtype=np.float16, n_sink: int = 4):
        if not 0 <= n_sink < capacity:
            raise CacheFullError(f"--sinks {n_sink} must be at least 0 and below the KV cache "
                                 f"size {capacity}")
        super().__init__(n_layers, kv_heads, head_dim, capacity, backend, dtype)
        self.n_sink = n_sink
        self.window = capacity - n_sink
        self.sink_keys = None        # float32 [n_layers, n_sink, kv_heads, D], un-rotated
        self.rotated_shift = 0       # the shift the cached sink keys are rotated for

    @property
    def chunk(self) -> int:
        # a chunk that filled the whole window would see only the sinks before it
        return max(1, min(512, self.window // 2))

    def fits(self, n: int) -> bool:
        return n <= self.window

    @property
    def sink_shift(self) -> int:
        """(oldest position in the window) - n_sink: 0 until the window first wraps."""
        return max(0, self.next_pos - self.capacity)

    def allocate(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > self.window:
            raise CacheFullError(f"{n} tokens at once exceed the window of {self.window} "
                                 "slots (longer prompts are run in chunks)")
        pos = np.arange(self.next_pos, self.next_pos + n)
        slots = np.where(pos < self.n_sink, pos, self.n_sink + (pos - self.n_sink) % self.window)
        self.slot_pos[slots] = pos
        self.next_pos += n
        self.length = min(self.next_pos, self.capacity)
        self.span = self.length
        return slots, pos

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens; refused where they overwrote older ones (those are
        gone)."""
        if not 0 <= n <= self.length or self.next_pos > self.capacity:
            raise ValueError(f"cannot roll back {n} tokens of a {self.policy} cache that has "
                             "evicted tokens")
        super().rollback(n)

    def reset(self) -> None:
        super().reset()
        self.sink_keys = None
        self.rotated_shift = 0


POLICIES = {"dense": KVCache, "sink": SinkCache}


def make_cache(policy: str, n_layers: int, kv_heads: int, head_dim: int, capacity: int, backend,
               dtype=np.float16, n_sink: int = 4) -> KVCache:
    """A KV cache of the named policy (`--kv-policy`)."""
    if policy == "dense":
        return KVCache(n_layers, kv_heads, head_dim, capacity, backend, dtype)
    if policy == "sink":
        return SinkCache(n_layers, kv_heads, head_dim, capacity, backend, dtype, n_sink)
    raise TinyrtError(f"unknown KV cache policy {policy!r}: choose one of {', '.join(POLICIES)}")
