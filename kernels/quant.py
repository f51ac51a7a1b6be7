"""The one form of a quantized weight inside the runtime, whatever file it came from.

A linear layer y = x @ W.T with W [out, in] is split along the input into groups of g inputs;
each output row's group has a scale s and an offset m, and each weight an unsigned code q of
`bits` bits (4, 5, 6 or 8):

    W[o, i] = q[o, i] * s[o, i // g] + m[o, i // g]

s and m are stored as compactly as the source allows, and exactly:
- scale: a float per block of k*g inputs (k >= 1), times an optional small integer per group
  (`scale_q`): s = scale[o, i // (k g)] * scale_q[o, i // g] (the K-quants' super-block
  scale d times a 6-bit or int8 sub-block scale); without scale_q (k = 1), s = scale.
- offset: a float per block of k'g inputs times an optional small integer per group
  (`offset_q`), as the scale; or, where the source's offset is a fixed multiple of its scale
  (symmetric codes centred on an integer `zero`), no offset array: m = -zero * s.

Every source maps into this exactly, once, at load (no code is rounded again):

| source | bits | g | scale | scale_q | offset | offset_q | zero |
|---|---|---|---|---|---|---|---|
| AutoAWQ (zero point z, step s) | 4 | 32-128 | s | - | -s | z | - |
| GGUF Q4_0 (d; codes 0..15 centred on 8) | 4 | 32 | d | - | - | - | 8 |
| GGUF Q4_1 (d, min) | 4 | 32 | d | - | min | - | - |
| GGUF Q4_K (d, dmin per 256; 6-bit sc, mn) | 4 | 32 | d | sc | -dmin | mn | - |
| GGUF Q5_0 / Q5_1 | 5 | 32 | d | - | - / min | - | 16 / - |
| GGUF Q5_K | 5 | 32 | d | sc | -dmin | mn | - |
| GGUF Q6_K (d per 256; int8 sc per 16) | 6 | 16 | d | sc | - | - | 32 |
| GGUF Q8_0 (d; int8 codes c) | 8 (c + 128) | 32 | d | - | - | - | 128 |

Stored (`QuantWeight`):
- `codes` uint8: for 4 bits [out, in/2], byte j of a row holding input 2j in its low nibble and
  input 2j + 1 in its high nibble; for 5-8 bits [out, in], one code per byte;
- `scale` and `offset` float16 where every value of the layer is a float16 exactly (all the
  sources above), else float32; `scale_q`, `offset_q` int8.

Backends repack this once into their own layout (kernels/cpu/linear.py,
kernels/cuda/kernels.py); the NumPy reference dequantizes it (`dequantize`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

BITS = (4, 5, 6, 8)


class QuantWeight(NamedTuple):
    """A quantized linear layer W [out, in] (see the module's docstring)."""

    codes: np.ndarray                  # uint8 [out, in/2] (4 bits) or [out, in] (5-8 bits)
    bits: int
    scale: np.ndarray                  # float16 | float32 [out, in/(k g)]
    scale_q: np.ndarray | None = None  # int8 [out, in/g]
    offset: np.ndarray | None = None   # float, as scale [out, in/(k' g)]; None: m = -zero * s
    offset_q: np.ndarray | None = None  # int8 [out, in/g]
    zero: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as a float weight's."""
        return self.codes.shape[0], self.codes.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The scale and offset arrays it has, each [out, some division of in]."""
        return tuple(a for a in (self.scale, self.scale_q, self.offset, self.offset_q)
                     if a is not None)

    @property
    def group_size(self) -> int:
        return self.shape[1] // max(a.shape[1] for a in self.arrays)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + sum(a.nbytes for a in self.arrays)

    def scaled_rows(self, factor: np.ndarray) -> QuantWeight:
        """The layer with output row o times factor[o] (its scales and offsets scaled)."""
        f = np.asarray(factor, np.float32)[:, None]
        times = (lambda a: None if a is None else _float(a.astype(np.float32) * f))
        return self._replace(scale=times(self.scale), offset=times(self.offset))

    def rows(self, index) -> QuantWeight:
        """The output rows `index` (a slice or an index array) of the layer."""
        pick = (lambda a: None if a is None else np.ascontiguousarray(a[index]))
        return self._replace(codes=pick(self.codes), scale=pick(self.scale),
                             scale_q=pick(self.scale_q), offset=pick(self.offset),
                             offset_q=pick(self.offset_q))


def _float(a: np.ndarray | None) -> np.ndarray | None:
    """float16/32/64 values -> float16 if each is one exactly, else float32 (ValueError if a
    value is not a float32 exactly)."""
    if a is None:
        return None
    if a.dtype == np.float16:                  # each one a float16 and a float32 already
        return np.ascontiguousarray(a)
    a32 = np.asarray(a).astype(np.float32)
    if not np.array_equal(a32, a, equal_nan=True):
        raise ValueError("scales and offsets must be float32 values")
    with np.errstate(over="ignore"):
        a16 = a32.astype(np.float16)
    return np.ascontiguousarray(a16 if np.array_equal(a16, a32, equal_nan=True) else a32)


def _int8(a: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return None
    if a.size and (a.min() < -128 or a.max() > 127):
        raise ValueError("integer sub-scales must fit in int8")
    return np.ascontiguousarray(a, np.int8)


def pack4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [out, in] (in even) -> [out, in/2], input 2j low, 2j + 1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def make(codes: np.ndarray, bits: int, scale: np.ndarray, offset: np.ndarray | None = None, *,
         scale_q: np.ndarray | None = None, offset_q: np.ndarray | None = None,
         zero: int = 0, packed: bool = False) -> QuantWeight:
    """A QuantWeight from codes [out, in] (one per byte, < 2**bits; already packed [out, in/2]
    if `packed`) and float scales and offsets (and integer sub-scales) as the module's docstring
    describes them; floats stored as float16 where exact."""
    if bits not in BITS:
        raise ValueError(f"codes of {bits} bits: the runtime holds {', '.join(map(str, BITS))}")
    c = np.ascontiguousarray(codes, np.uint8)
    if c.ndim != 2:
        raise ValueError(f"codes {list(c.shape)} are not a matrix")
    if bits == 4 and not packed:
        if c.shape[1] % 2:
            raise ValueError(f"4-bit codes {list(c.shape)} must be of an even width")
        c = pack4(c)
    w = QuantWeight(c, bits, _float(scale), _int8(scale_q), _float(offset), _int8(offset_q),
                    int(zero))
    out, n_in = w.shape
    named = [(name, a) for name, a in zip(("scale", "scale_q", "offset", "offset_q"),
                                          (w.scale, w.scale_q, w.offset, w.offset_q))
             if a is not None]
    groups = max(a.shape[1] if a.ndim == 2 else 0 for _, a in named)
    for name, a in named:
        if a.ndim != 2 or a.shape[0] != out or not a.shape[1] or groups % a.shape[1] \
                or n_in % groups:
            raise ValueError(f"{name} {list(a.shape)} does not fit codes of a [{out}, {n_in}] layer")
    if (w.scale_q is not None and w.scale_q.shape[1] != groups) or \
            (w.offset_q is not None and w.offset_q.shape[1] != groups):
        raise ValueError("integer sub-scales are per group")
    return w


def unpack(w: QuantWeight) -> np.ndarray:
    """The codes one per byte, uint8 [out, in]."""
    if w.bits != 4:
        return w.codes
    out = np.empty(w.shape, np.uint8)
    out[:, 0::2] = w.codes & 15
    out[:, 1::2] = w.codes >> 4
    return out


def _per_group(a: np.ndarray, groups: int) -> np.ndarray:
    """[out, n] (n divides groups) -> float64 [out, groups], each value repeated."""
    return np.repeat(a.astype(np.float64), groups // a.shape[1], axis=1)


def scales(w: QuantWeight) -> tuple[np.ndarray, np.ndarray]:
    """(s, m), float64 [out, in/g] each: every group's scale and offset as values."""
    groups = w.shape[1] // w.group_size
    s = _per_group(w.scale, groups)
    if w.scale_q is not None:
        s *= w.scale_q
    if w.offset is None:
        return s, -w.zero * s
    m = _per_group(w.offset, groups)
    if w.offset_q is not None:
        m *= w.offset_q
    return s, m


def dequantize(w: QuantWeight, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """W [out, in] float32 (or the output rows `rows` of it): q * s + m, each product and sum in
    float32 from the exact float32 s and m."""
    w = w.rows(rows)
    q = unpack(w)
    n, n_in = q.shape
    g = w.group_size
    s, m = (a.astype(np.float32)[:, :, None] for a in scales(w))
    return (q.reshape(n, n_in // g, g).astype(np.float32) * s + m).reshape(n, n_in)


def flat(w: QuantWeight, bits: int) -> QuantWeight:
    """The same weights with one float scale and offset per group and codes of `bits` >= w.bits
    (for a kernel that reads no other form): exact."""
    if bits < w.bits or bits not in BITS:
        raise ValueError(f"cannot hold {w.bits}-bit codes as {bits}-bit codes")
    s, m = scales(w)
    codes = w.codes if bits == w.bits else unpack(w)
    return make(codes, bits, s, m, packed=bits == 4)


def fused_form(parts: list[QuantWeight]) -> tuple[int, int, dict]:
    """What `concat(parts)` makes of layers sharing an input, but their codes: (bits, inputs per
    group, make's scale and offset arguments). A backend that tiles each part's codes itself
    needs no copy of them side by side."""
    n_in = parts[0].shape[1]
    if any(p.shape[1] != n_in for p in parts):
        raise ValueError("fused layers must share their input size")
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    if len(parts) == 1:
        p = parts[0]
        return bits, group, dict(scale=p.scale, scale_q=p.scale_q, offset=p.offset,
                                 offset_q=p.offset_q, zero=p.zero)
    groups = n_in // group

    def ints(get):                      # a per-group integer array of every part, or None
        arrays = [get(p) for p in parts]
        if all(a is None for a in arrays):
            return None
        arrays = [np.ones((p.shape[0], 1), np.int8) if a is None else a
                  for p, a in zip(parts, arrays)]
        return _int8(np.concatenate([np.repeat(a, groups // a.shape[1], axis=1) for a in arrays]))

    def floats(arrays):
        if len({(a.dtype, a.shape[1]) for a in arrays}) == 1:    # alike: side by side as they are
            return _float(np.concatenate(arrays))
        cols = math.lcm(*(a.shape[1] for a in arrays))
        return _float(np.concatenate([_per_group(a, cols) for a in arrays]))

    form = dict(scale=floats([p.scale for p in parts]), scale_q=ints(lambda p: p.scale_q))
    zeros = {p.zero for p in parts}
    if all(p.offset is None for p in parts) and len(zeros) == 1:
        return bits, group, dict(form, offset=None, offset_q=None, zero=zeros.pop())
    # a part without offsets takes -zero * scale (and its sub-scales as offset sub-scales)
    offset = floats([p.offset if p.offset is not None else -p.zero * p.scale.astype(np.float64)
                     for p in parts])
    offset_q = ints(lambda p: p.offset_q if p.offset is not None else p.scale_q)
    return bits, group, dict(form, offset=offset, offset_q=offset_q, zero=0)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """Layers sharing an input, side by side along the output, in one QuantWeight: codes of the
    most bits, groups of the greatest common size, each scale and offset array at the finest
    division any part has (values repeated, sub-scales of 1 and offsets -zero * scale where a
    part has none): exact, and as compact as the parts allow."""
    bits, _, form = fused_form(parts)
    if len(parts) == 1:
        return parts[0]
    codes = np.concatenate([p.codes if p.bits == bits else unpack(p) for p in parts])
    return make(codes, bits, packed=bits == 4, **form)
