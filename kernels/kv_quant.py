"""The quantized KV cache (KIVI, Liu et al. 2024): its layout, and the NumPy reference of its ops.

KIVI quantizes keys per channel (a few channels of the keys carry outliers, so a token's
channels do not share a range well) and values per token, each with a scale and a zero per
group, and keeps the most recent tokens in float until a group of them is complete. Here, for
N rows (KV heads: the cache holds [L, G] of them, one layer [G]), C slots and head dim D, with
b-bit codes (b = 8, 4 or 2), blocks of B slots (B a power of two) and value groups of
Gv = min(B, D) channels:

- keys, per channel in blocks of B slots: in block j, channel d of every slot is
  code * ks[j, 0, d] + ks[j, 1, d] (scale, zero: ks [N, C/B, 2, D] float16); their codes
  kc [N, C/B, D, B b / 8] uint8 lie by channel, a block's slots along each channel's row
  (decode attention then sums q_d scale_d code[d, s] over d for B slots at once, in vector
  lanes, with no sum across lanes per slot);
- values, per slot in groups of Gv channels: channel d of slot s is
  code * vs[s, 0, d // Gv] + vs[s, 1, d // Gv] (vs [N, C, 2, D/Gv] float16); their codes
  vc [N, C, D b / 8] uint8 lie by slot;
- a row of codes (of a key channel or of a value slot) holds its n values in "planes": byte w
  of a row of W bytes holds values w, w + W, w + 2W, ... (8/b of them), value w + pW at bit
  p b, so a kernel takes a plane apart with one shift and mask over W contiguous bytes;
- a float16 pool of P blocks, fk and fv [N, P, B, D]: the blocks written lately, held as
  floats. where [N, C/B] int32 is the pool entry that holds block j (-1: the block is
  quantized), owner [N, P] int32 the block an entry holds (-1: free), stamp [N, P] int64 when
  it was last written (a count of writes, per row).

A write to a slot of a quantized block opens the block: it takes a free entry, or else the
least recently written entry, which is sealed first (its block quantized from the floats it
holds: requantize); the block's codes are dequantized into the entry and the slot's row written
there.
Blocks [0, pin) are never sealed once opened (the attention sinks, whose keys are re-rotated
as the window moves on, stay exact). With P = pin + ceil(R/B) + 1 entries, a cache written in
slot order (dense, and the sink ring) holds at least its last R tokens as floats, and every
block it seals is whole: KIVI's residual of R tokens. A block sealed again after a few of its
slots were written (h2o's evictions, a rollback past the residual) keeps, group by group, the
grid and the codes of the values that are still as its opening gave them, where the new values
fit that grid: quantized afresh from its floats, every other token's values would be rounded
once more at each of the block's reopenings.

Codes: code = floor((x - zero) / scale + 1/2) clipped to [0, 2**b - 1], with the float16 scale
(max - min) / (2**b - 1) and zero min of the group, both as float32; an all-equal group has
scale 0 and codes 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

BITS = {"q8": 8, "q4": 4, "q2": 2}


class QuantKV(NamedTuple):
    """A quantized K/V store (module doc): every array has the rows [N] (or [L, G]) first."""

    kc: np.ndarray       # [N, C/B, D, B b/8] uint8 key codes, by channel
    ks: np.ndarray       # [N, C/B, 2, D] float16 key scale, zero per block and channel
    vc: np.ndarray       # [N, C, D b/8] uint8 value codes, by slot
    vs: np.ndarray       # [N, C, 2, D/Gv] float16 value scale, zero per slot and channel group
    fk: np.ndarray       # [N, P, B, D] float16 pool of keys
    fv: np.ndarray       # [N, P, B, D] float16 pool of values
    where: np.ndarray    # [N, C/B] int32 pool entry of each block, -1: quantized
    owner: np.ndarray    # [N, P] int32 block of each pool entry, -1: free
    stamp: np.ndarray    # [N, P] int64 last write to each entry
    pin: int             # blocks [0, pin) stay in the pool once opened

    @property
    def head_dim(self) -> int:
        return self.fk.shape[-1]

    @property
    def block(self) -> int:
        return self.fk.shape[-2]

    @property
    def value_channels(self) -> int:
        """Channels per value group."""
        return self.head_dim // self.vs.shape[-1]

    @property
    def bits(self) -> int:
        return self.vc.shape[-1] * 8 // self.head_dim

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self[:-1])

    def rows(self, index) -> "QuantKV":
        """The store of the rows `index` selects (a layer: an int on [L, G, ...] arrays)."""
        return QuantKV(*(a[index] for a in self[:-1]), self.pin)

    def flat(self) -> "QuantKV":
        """All rows as one axis: [L, G, ...] -> [L*G, ...]."""
        lead = self.where.ndim - 1
        return QuantKV(*(a.reshape(-1, *a.shape[lead:]) for a in self[:-1]), self.pin)


def value_group(block: int, head_dim: int) -> int:
    return min(block, head_dim)


def check_layout(bits: int, block: int, head_dim: int) -> str | None:
    """Why a head dim cannot take this layout, or None."""
    if bits not in BITS.values():
        return f"{bits}-bit codes: choose 8, 4 or 2"
    if block < 1 or block & (block - 1):
        return f"a group of {block} tokens: choose a power of two"
    if block * bits < 8:
        return f"a group of {block} tokens is less than a byte of {bits}-bit codes"
    if head_dim % value_group(block, head_dim) or head_dim % (8 // bits):
        return f"a head dim of {head_dim} does not split into groups of {block} channels"
    return None


def token_bytes(bits: int, block: int, head_dim: int) -> float:
    """Bytes of one token's K and V in one row: codes, scales and zeros, and its share of the
    block table (not the pool)."""
    D = head_dim
    return 2 * D * bits / 8 + 4 * D / block + 4 * D / value_group(block, D) + 4 / block


def pool_entries(block: int, residual: int, pin: int) -> int:
    return pin + -(-residual // block) + 1


def allocate(lead: tuple[int, ...], capacity: int, head_dim: int, bits: int, block: int,
             entries: int, pin: int, zeros=np.zeros) -> QuantKV:
    """An empty store of rows `lead` and `capacity` slots (a multiple of `block`); `zeros`
    (shape, dtype) makes its arrays."""
    D, nb = head_dim, capacity // block
    W, Gv = D * bits // 8, value_group(block, D)
    store = QuantKV(zeros((*lead, nb, D, block * bits // 8), np.uint8),
                    zeros((*lead, nb, 2, D), np.float16),
                    zeros((*lead, capacity, W), np.uint8),
                    zeros((*lead, capacity, 2, D // Gv), np.float16),
                    zeros((*lead, entries, block, D), np.float16),
                    zeros((*lead, entries, block, D), np.float16),
                    zeros((*lead, nb), np.int32), zeros((*lead, entries), np.int32),
                    zeros((*lead, entries), np.int64), pin)
    reset(store)
    return store


def reset(store: QuantKV) -> None:
    """Every block quantized (to zeros: what a fresh store reads), every entry free."""
    store.where[...] = -1
    store.owner[...] = -1
    store.stamp[...] = 0


# -- the math ------------------------------------------------------------------------------------

def quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups along the last axis of x -> codes uint8 (unpacked, x's shape), scale and zero
    float16 (x's shape less the last axis)."""
    x = x.astype(np.float32)
    mn, mx = x.min(axis=-1), x.max(axis=-1)
    scale = ((mx - mn) / np.float32(2 ** bits - 1)).astype(np.float16)
    zero = (mn + np.float32(0)).astype(np.float16)     # + 0: a zero of -0.0 and +0.0 is +0.0
    s = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.floor((x - zero.astype(np.float32)[..., None]) / s + np.float32(0.5))
    c = np.where(s > 0, c, 0)
    return np.clip(c, 0, 2 ** bits - 1).astype(np.uint8), scale, zero


def to_pool(x: np.ndarray) -> np.ndarray:
    """float32 values as a float16 pool (or float16 cache) holds them: rounded to nearest,
    clamped to the finite range (no infinities to meet an attention weight of 0; a group's top
    code can read back past the largest float16)."""
    top = np.finfo(np.float16).max
    return np.clip(x, -top, top).astype(np.float16)


def requantize(x: np.ndarray, was: np.ndarray, codes: np.ndarray, scale: np.ndarray,
               zero: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize of groups x (along the last axis) that had codes (unpacked, x's shape), scale
    and zero, which dequantized to was (float16, x's shape): where a group holds a value still
    equal to what its codes gave and its other values fit its grid (their codes in [0, 2**b
    - 1]), the grid stays, the values still as they were keep their codes and the others are
    coded on it; other groups are quantized afresh."""
    x = x.astype(np.float32)
    c, s, z = quantize(x, bits)
    sf, zf = scale.astype(np.float32)[..., None], zero.astype(np.float32)[..., None]
    kept = x == was.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.floor((x - zf) / sf + np.float32(0.5))
    fits = kept | ((u >= 0) & (u <= 2 ** bits - 1))
    stay = (scale > 0) & kept.any(axis=-1) & fits.all(axis=-1)
    c = np.where(stay[..., None], np.where(kept, codes, u), c)
    return c.astype(np.uint8), np.where(stay, scale, s), np.where(stay, zero, z)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., D] -> bytes [..., D b / 8] in planes (module doc)."""
    n = 8 // bits
    W = codes.shape[-1] // n
    out = np.zeros((*codes.shape[:-1], W), np.uint8)
    for p in range(n):
        out |= (codes[..., p * W:(p + 1) * W] << (p * bits)).astype(np.uint8)
    return out


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """pack's inverse: bytes [..., W] -> codes [..., W 8 / b] float32."""
    mask = 2 ** bits - 1
    return np.concatenate([(packed >> (p * bits)) & mask for p in range(8 // bits)],
                          axis=-1).astype(np.float32)


def _key_block(store: QuantKV, row: int, j: int) -> np.ndarray:
    """Block j's keys of one row, dequantized: [B, D] float32."""
    scale, zero = store.ks[row, j].astype(np.float32)
    return unpack(store.kc[row, j], store.bits).T * scale + zero


def _values(store: QuantKV, row: int, s0: int, s1: int) -> np.ndarray:
    """Slots [s0, s1) of one row's values, dequantized: [n, D] float32."""
    D = store.head_dim
    Gv = store.value_channels
    c = unpack(store.vc[row, s0:s1], store.bits).reshape(s1 - s0, D // Gv, Gv)
    sz = store.vs[row, s0:s1].astype(np.float32)                 # [n, 2, D/Gv]
    return (c * sz[:, 0, :, None] + sz[:, 1, :, None]).reshape(s1 - s0, D)


def seal(store: QuantKV, row: int, entry: int) -> None:
    """Quantize the block pool entry `entry` of `row` holds into its codes; free the entry."""
    j, B, bits = store.owner[row, entry], store.block, store.bits
    was = to_pool(_key_block(store, row, j))                     # [B, D]: as opened
    c, scale, zero = requantize(store.fk[row, entry].T, was.T, unpack(store.kc[row, j], bits),
                                *store.ks[row, j], bits)         # per channel: [D, B]
    store.kc[row, j] = pack(c, bits)
    store.ks[row, j, 0], store.ks[row, j, 1] = scale, zero
    slots, Gv = slice(j * B, (j + 1) * B), store.value_channels
    was = to_pool(_values(store, row, j * B, (j + 1) * B))
    groups = (B, -1, Gv)                                         # per slot and channel group
    c, scale, zero = requantize(store.fv[row, entry].reshape(groups), was.reshape(groups),
                                unpack(store.vc[row, slots], bits).reshape(groups),
                                *store.vs[row, slots].transpose(1, 0, 2), bits)
    store.vc[row, slots] = pack(c.reshape(B, -1), bits)
    store.vs[row, slots, 0], store.vs[row, slots, 1] = scale, zero
    store.where[row, j] = -1
    store.owner[row, entry] = -1


def _open(store: QuantKV, row: int, j: int) -> int:
    """The pool entry holding block j of `row`, opening the block if it is quantized."""
    e = store.where[row, j]
    if e >= 0:
        return e
    owner = store.owner[row]
    free = np.flatnonzero(owner < 0)
    if free.size:
        e = free[0]
    else:
        stamps = np.where(owner >= store.pin, store.stamp[row], np.iinfo(np.int64).max)
        e = int(stamps.argmin())
        seal(store, row, e)
    B = store.block
    store.fk[row, e] = to_pool(_key_block(store, row, j))
    store.fv[row, e] = to_pool(_values(store, row, j * B, (j + 1) * B))
    store.where[row, j], store.owner[row, e] = e, j
    return e


def store_kv(store: QuantKV, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Write k, v [T, N, D] (float32) at row n's slots slots[n] ([N, T]), in token order, as
    float16 into the pool (rounded to nearest, clamped to the finite range)."""
    B = store.block
    for n in range(slots.shape[0]):
        for t, s in enumerate(slots[n]):
            e = _open(store, n, s // B)
            store.stamp[n, e] = store.stamp[n].max() + 1
            store.fk[n, e, s % B] = to_pool(k[t, n])
            store.fv[n, e, s % B] = to_pool(v[t, n])


def dequantize(store: QuantKV, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots [0, span) of every row as float32 k, v [N, span, D]: what attention reads."""
    N, D, B = store.where.shape[0], store.head_dim, store.block
    k, v = np.empty((N, span, D), np.float32), np.empty((N, span, D), np.float32)
    for n in range(N):
        for j in range(-(-span // B)):
            s0, s1 = j * B, min(span, (j + 1) * B)
            e = store.where[n, j]
            if e >= 0:
                k[n, s0:s1] = store.fk[n, e, :s1 - s0]
                v[n, s0:s1] = store.fv[n, e, :s1 - s0]
            else:
                k[n, s0:s1] = _key_block(store, n, j)[:s1 - s0]
                v[n, s0:s1] = _values(store, n, s0, s1)
    return k, v
