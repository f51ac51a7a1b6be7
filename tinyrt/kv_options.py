"""How to build a KV cache: its settings (`CacheOptions`, from the command line or the API) and
the memory they take, which `--kv-mem`, `info` and the chat banner report before any cache exists.

A model whose layers attend within a sliding window (Gemma 3's five of every six, Mistral's and
Phi-3's every layer) keeps such a layer's last tokens only, in a ring (kv_cache.WindowedCache):
`windowed_layers` says which layers, and how large the ring is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from tinyrt.errors import CacheFullError, TinyrtError, shown
from tinyrt.kernels import kv_quant
from tinyrt.memory import parse_size

POLICY_NAMES = ("dense", "sink", "h2o")     # kv_cache.POLICIES, by --kv-policy

KV_TYPES = {"f16": np.float16, "f32": np.float32, **dict.fromkeys(kv_quant.BITS)}
DEFAULT_SIZE = 4096      # tokens, where the model's context is longer
# KIVI's group (tokens per key scale, channels per value scale) and float residual, by type
# (README, "Quantized KV cache", has the measurements): 64 keeps q8 and q4 within their memory
# (a group of 32 would take 0.56x and 0.31x of float16's bytes); q2 fits at 32, where it loses
# less. KIVI's residual of 128.
DEFAULT_GROUPS = {"q8": 64, "q4": 64, "q2": 32}
DEFAULT_RESIDUAL = 128
MAX_GROUP = 256          # a block of decode attention's slots (cpu.attention.ATTENTION_BLOCK)
# The most tokens a cache may hold (--kv-size, and --sinks and --recent within it): 16M, past
# any model's context; a larger number is a mistake, said before anything loads
MAX_SIZE = 1 << 24


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """How to build a KV cache (`--kv-policy`, `--kv-size` or `--kv-mem`, `--kv-type`,
    `--kv-group`, `--kv-residual`, `--sinks`, `--recent`): the size in tokens, or as memory
    (bytes, or a text such as "512MB": as many tokens as fit, `token_bytes` each, after the
    float residual's `fixed_bytes`), or neither: the model's context, at most DEFAULT_SIZE; the
    element type (f16, f32, or KIVI codes of 8, 4 or 2 bits: kernels.kv_quant), and for codes
    the group (a power of two) and the residual, the most recent tokens kept in float; sinks
    for sink and h2o, recent for h2o (None: its default); slack, slots kept for rolling back
    drafts (sink)."""

    kv_policy: str = "dense"
    kv_size: int | None = None
    kv_type: str = "f16"
    sinks: int = 4
    recent: int | None = None
    slack: int = 0
    kv_mem: int | str | None = None
    kv_group: int | None = None
    kv_residual: int = DEFAULT_RESIDUAL

    def __post_init__(self):
        if self.kv_policy not in POLICY_NAMES:
            raise TinyrtError(f"unknown KV cache policy {self.kv_policy!r}: choose one of "
                              f"{', '.join(POLICY_NAMES)}")
        if self.kv_type not in KV_TYPES:
            raise TinyrtError(f"unknown KV cache type {self.kv_type!r}: choose one of "
                              f"{', '.join(KV_TYPES)}")
        if self.kv_mem is not None:
            if self.kv_size is not None:
                raise TinyrtError("give the KV cache's size in tokens (--kv-size) or as memory "
                                  "(--kv-mem), not both")
            if isinstance(self.kv_mem, bool) or not isinstance(self.kv_mem, (int, str)):
                raise TinyrtError(f"the KV cache's memory must be bytes or a size such as 512MB, "
                                  f"not {self.kv_mem!r}")
            object.__setattr__(self, "kv_mem", parse_size(self.kv_mem, "--kv-mem"))
        # whole numbers in their ranges (None: the default, where there is one)
        for name, low, high, optional in (
                ("kv_size", 1, MAX_SIZE, True), ("sinks", 0, MAX_SIZE, False),
                ("recent", 1, MAX_SIZE, True), ("slack", 0, MAX_SIZE, False),
                ("kv_group", 1, MAX_GROUP, True), ("kv_residual", 0, 1 << 16, False)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or not low <= value <= high:
                raise TinyrtError(f"--{name.replace('_', '-')} must be a whole number from {low} "
                                  f"to {high:,}, not {shown(value)}")
            object.__setattr__(self, name, int(value))
        if self.kv_policy != "dense" and self.kv_size is not None:
            self.check_size(self.kv_size, self.recent if self.kv_policy == "h2o" else None)
        group = self.group
        if not 1 <= group <= MAX_GROUP or group & (group - 1):
            raise TinyrtError(f"--kv-group must be a power of two from 1 to {MAX_GROUP}, "
                              f"not {group}")

    def check_size(self, size: int, recent: int | None = None) -> None:
        """A CacheFullError where the sinks (sink and h2o), or h2o's `recent` tokens, leave no
        room in a cache of `size` tokens."""
        if not self.sinks < size:
            raise CacheFullError(f"--sinks {self.sinks} must be at least 0 and below the KV cache "
                                 f"size {size}")
        if recent is not None and not 1 <= recent <= size - self.sinks:
            raise CacheFullError(f"--recent {recent} must be at least 1 and at most the KV cache "
                                 f"size less the sinks ({size - self.sinks})")

    @property
    def group(self) -> int:
        """A quantized cache's group: `kv_group`, or the type's default."""
        return DEFAULT_GROUPS.get(self.kv_type, 64) if self.kv_group is None else self.kv_group

    @property
    def bits(self) -> int | None:
        """The bits of a quantized cache's codes, None for a float cache."""
        return kv_quant.BITS.get(self.kv_type)

    @property
    def dtype(self) -> np.dtype:
        """A float cache's element type."""
        return np.dtype(KV_TYPES[self.kv_type])

    def check(self, layout) -> None:
        """A TinyrtError if a model (a KVLayout, or a config) cannot have this cache."""
        why = self.bits and kv_quant.check_layout(self.bits, self.group, layout.head_dim)
        if why:
            raise TinyrtError(f"--kv-type {self.kv_type} with --kv-group {self.group}: {why}")

    def token_bytes(self, config, layers: int | None = None) -> int:
        """The memory one cached token takes in `layers` layers (default: all) of a model of
        `config`: its K and V in every such layer and KV head (codes with their scales and
        zeros: kernels.kv_quant.token_bytes), and the policy's per-slot tables (slot positions;
        h2o: per head, with a score)."""
        L = config.num_hidden_layers if layers is None else layers
        G, D = config.num_key_value_heads, config.head_dim
        table = L * G * (8 + 4) if self.kv_policy == "h2o" else 8
        if self.bits:
            return math.ceil(L * G * kv_quant.token_bytes(self.bits, self.group, D)) + table
        return 2 * L * G * D * self.dtype.itemsize + table

    def pool(self) -> tuple[int, int]:
        """A quantized cache's pinned blocks (those of the sinks) and float pool entries."""
        pin = -(-self.sinks // self.group)
        return pin, kv_quant.pool_entries(self.group, self.kv_residual, pin)

    def fixed_bytes(self, config, layers: int | None = None) -> int:
        """The memory a quantized cache of `layers` layers (default: all) takes whatever its
        size: its float pool (the residual, the sinks and the block being filled, as float16 K
        and V, with its tables), and h2o's spare block (H2OCache)."""
        if not self.bits:
            return 0
        L = config.num_hidden_layers if layers is None else layers
        G, D = config.num_key_value_heads, config.head_dim
        entries = self.pool()[1]
        spare = self.group * self.token_bytes(config, L) if self.kv_policy == "h2o" else 0
        return L * G * entries * (2 * self.group * D * 2 + 12) + spare

    def ring_options(self, slack: int) -> "CacheOptions":
        """The options of the ring of a cache's windowed layers (kv_cache.WindowedCache): a
        sink cache without sinks, with `slack`."""
        return dataclasses.replace(self, kv_policy="sink", sinks=0, recent=None, slack=slack,
                                   kv_size=None, kv_mem=None)

    def memory(self, config, size: int) -> "CacheMemory":
        """What a cache of `size` tokens for a model of `config` takes (see CacheMemory)."""
        L = config.num_hidden_layers
        ringed, ring, slack = windowed_layers([config.window(i) for i in range(L)], size,
                                              self.slack)
        held = L - len(ringed)
        rings = 0
        if ringed:
            r = self.ring_options(slack)
            rings = (ring + slack) * r.token_bytes(config, len(ringed)) \
                + r.fixed_bytes(config, len(ringed))
        return CacheMemory(self.token_bytes(config, held), self.fixed_bytes(config, held), rings,
                           len(ringed), ring + slack)

    def describe(self, config, tokens: int | None = None) -> str:
        """Its memory in words: per token, and for `tokens` (default: its size) tokens."""
        n = tokens or self.size_for(config)
        m = self.memory(config, n)
        spare = " and a spare block" if self.kv_policy == "h2o" else ""
        residual = f" (and {m.residual / 2**20:,.1f} MiB of float residual{spare})" \
            if m.residual else ""
        rings = (f"; {m.ringed} of {config.num_hidden_layers} layers keep only their sliding "
                 f"window, {m.ring:,} slots in {m.rings / 2**20:,.1f} MiB") if m.ringed else ""
        total = n * m.per_token + m.residual + m.rings
        return (f"{self.kv_policy} {self.kv_type}, {m.per_token / 1024:.1f} KiB per token: "
                f"{n:,} tokens in {total / 2**20:,.0f} MiB{residual}{rings}")

    def size_for(self, config) -> int:
        """The cache's size in tokens for a model of `config`."""
        if self.kv_size:
            return self.kv_size
        if self.kv_mem is None:
            return min(config.max_position_embeddings, DEFAULT_SIZE)
        # The layers that keep only their window change with the size (a ring must be smaller
        # than the cache), and so does the memory a token takes: between two rings' sizes the
        # set is fixed and the memory grows with the size, so the largest size within budget
        # is the best of each such span's.
        L = config.num_hidden_layers
        rings = sorted({r for i in range(L) if (w := config.window(i)) is not None
                        and (r := ring_slots(w, self.slack)) < MAX_SIZE})
        best, low = 0, 1
        for high in [*rings, MAX_SIZE]:
            m = self.memory(config, high)            # (the set of every size in [low, high])
            left = self.kv_mem - m.residual - m.rings
            if left >= 0:
                n = min(high, left // m.per_token if m.per_token else high)
                if m.ringed == L:        # no layer keeps every token: the model's context
                    n = min(n, config.max_position_embeddings)
                if n >= low:
                    best = max(best, n)
            low = high + 1
        if best < 1:
            m = self.memory(config, 1)
            raise CacheFullError(
                f"--kv-mem {self.kv_mem:,} bytes holds no token: one takes {m.per_token:,} "
                f"bytes in a {self.kv_type} cache"
                + (f", after {m.residual:,} bytes of float residual" if m.residual else ""))
        if best == MAX_SIZE and self.memory(config, best).ringed < L:
            raise CacheFullError(f"--kv-mem {self.kv_mem:,} bytes holds more than {MAX_SIZE:,} "
                                 f"tokens, the most a KV cache may: give less")
        return best


class CacheMemory(NamedTuple):
    """The memory of a cache of some size: bytes per token (its layers that keep every token),
    the float residual of a quantized cache, and the rings of the `ringed` layers that keep
    only their window (`ring` slots each)."""

    per_token: int
    residual: int
    rings: int
    ringed: int
    ring: int


# A windowed layer's ring: its window, and RING_CHUNK - 1 slots more, since a pass of up to
# RING_CHUNK tokens reads the window before its first token; and RING_SLACK slots (or the
# options' slack, if more) of older tokens kept unread, so that a chat turn can roll back the
# end of the last reply and a draft its rejected tokens. Longer rollbacks start afresh.
RING_CHUNK = 512
RING_SLACK = 32


def ring_slots(window: int, slack: int = 0) -> int:
    """Every slot of the ring of a layer of this window (see RING_CHUNK), slack included."""
    return window + RING_CHUNK - 1 + max(slack, RING_SLACK)


def windowed_layers(windows: list, size: int, slack: int = 0) -> tuple[list[int], int, int]:
    """The layers of a cache of `size` tokens that keep only their window (`windows`: each
    layer's, None for none): those whose ring (ring_slots) is smaller than `size`; and the
    ring's size (the largest such window, and RING_CHUNK - 1) and its slack."""
    ringed = [i for i, w in enumerate(windows) if w is not None and ring_slots(w, slack) < size]
    return ringed, max((windows[i] for i in ringed), default=0) + RING_CHUNK - 1, \
        max(slack, RING_SLACK)
