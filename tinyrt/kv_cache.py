"""The KV cache: contiguous buffers allocated once, and a slot table saying what each slot holds.

Layout: K and V are [n_layers, kv_heads, capacity, head_dim]; `layer(i)` gives the [kv_heads,
capacity, head_dim] pair of layer i. `slot_pos[s]` is the position of the token in slot s (-1 when
free). The decoder asks `allocate(n)` for the slots and positions of n new tokens, writes their K/V
there, and attends over `slot_positions()`: the leading slots in use, in whatever order they hold
positions. A policy decides which slot a token takes; this is the dense one (fill in order, then
refuse); the streaming policies build on the same table.

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

    @property
    def free(self) -> int:
        """How many more tokens fit."""
        return self.capacity - self.length

    def allocate(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots and positions for the next n tokens."""
        if n > self.free:
            raise CacheFullError(
                f"the KV cache holds {self.capacity} tokens and {self.length} are in use; "
                f"{n} more do not fit. Use a larger --kv-size, or --kv-policy sink or h2o to "
                "stream past the cache size")
        slots = np.arange(self.length, self.length + n)
        self.slot_pos[slots] = slots
        self.length += n
        self.span = max(self.span, self.length)
        return slots, slots.copy()

    def rollback(self, n: int) -> None:
        """Forget the last n appended tokens."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back {n} of {self.length} tokens")
        self.slot_pos[self.length - n:self.length] = -1
        self.length -= n
        self.span = self.length

    def reset(self) -> None:
        self.slot_pos[:] = -1
        self.length = self.span = 0

    def slot_positions(self) -> np.ndarray:
        """Positions of slots [0, span) (-1 for a free slot): what attention reads."""
        return self.slot_pos[:self.span]

    def layer(self, i: int):
        return self.k[i], self.v[i]
