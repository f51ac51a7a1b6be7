"""The one form of a quantized weight inside the runtime, whatever file it came from.

A linear layer y = x @ W.T with W [out, in] is split along the input into groups of g inputs;
each output row's group has a float scale s and a float offset m, and each weight a code q of
`bits` bits (unsigned):

    W[o, i] = q[o, i] * s[o, i // g] + m[o, i // g]

Every source maps into this exactly, once, at load (no code is rounded again):

| source | bits | g | s | m |
|---|---|---|---|---|
| AutoAWQ (zero point z, step s) | 4 | 32-128 | s | -z * s |
| GGUF Q4_0 (d; codes 0..15 centred on 8) | 4 | 32 | d | -8 d |
| GGUF Q4_1 (d, min) | 4 | 32 | d | min |
| GGUF Q4_K (d, dmin; 6-bit sub-scales sc, mins mn) | 4 | 32 | d sc | -dmin mn |
| GGUF Q5_0 / Q5_1 | 8 (codes 0..31) | 32 | d | -16 d / min |
| GGUF Q5_K | 8 (0..31) | 32 | d sc | -dmin mn |
| GGUF Q6_K (d; int8 sub-scales sc) | 8 (0..63) | 16 | d sc | -32 d sc |
| GGUF Q8_0 (d; int8 codes c) | 8 (c + 128) | 32 | d | -128 d |

Stored (`QuantWeight`):
- `codes` uint8: for 4 bits [out, in/2], byte j of a row holding input 2j in its low nibble and
  input 2j + 1 in its high nibble; for 8 bits [out, in], one code per byte;
- `scale` and `offset` [out, in/g], both float16 where every value of the layer is a float16
  exactly (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else both float32 (AWQ's -z s, the K-quants' products
  of two factors): a float32 holds each of them exactly.

Backends repack this once into their own layout (kernels/cpu.py, kernels/gpu.py); the NumPy
reference dequantizes it (`dequantize`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

BITS = (4, 8)


class QuantWeight(NamedTuple):
    """A quantized linear layer W [out, in] (see the module's docstring)."""

    codes: np.ndarray    # uint8 [out, in/2] (4 bits) or [out, in] (8 bits)
    scale: np.ndarray    # float16 | float32 [out, in/g]
    offset: np.ndarray   # as scale
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as a float weight's."""
        return self.codes.shape[0], self.codes.shape[1] * 8 // self.bits

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.offset.nbytes


def exact_floats(scale: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (or float64) scales and offsets -> both float16 if each value is a float16
    exactly, else both float32 (ValueError if a value is not a float32 exactly)."""
    s32, m32 = scale.astype(np.float32), offset.astype(np.float32)
    if not (np.array_equal(s32, scale) and np.array_equal(m32, offset)):
        raise ValueError("scales and offsets must be float32 values")
    with np.errstate(over="ignore"):
        s16, m16 = s32.astype(np.float16), m32.astype(np.float16)
    if np.array_equal(s16, s32) and np.array_equal(m16, m32):
        return s16, m16
    return s32, m32


def pack4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [out, in] (in even) -> [out, in/2], input 2j low, 2j + 1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def make(codes: np.ndarray, bits: int, scale: np.ndarray, offset: np.ndarray) -> QuantWeight:
    """A QuantWeight from codes [out, in] (one per byte, < 2**bits) and float32 scales and
    offsets [out, in/g], stored as the module's docstring says."""
    if bits not in BITS:
        raise ValueError(f"codes of {bits} bits: the runtime holds 4 or 8")
    out, n_in = codes.shape
    if scale.shape != offset.shape or scale.shape[0] != out or n_in % scale.shape[1]:
        raise ValueError(f"scales {scale.shape} and offsets {offset.shape} do not fit "
                         f"codes {codes.shape}")
    s, m = exact_floats(scale, offset)
    c = pack4(codes) if bits == 4 else np.ascontiguousarray(codes, np.uint8)
    return QuantWeight(c, np.ascontiguousarray(s), np.ascontiguousarray(m), bits)


def unpack(w: QuantWeight) -> np.ndarray:
    """The codes one per byte, uint8 [out, in]."""
    if w.bits == 8:
        return w.codes
    out = np.empty(w.shape, np.uint8)
    out[:, 0::2] = w.codes & 15
    out[:, 1::2] = w.codes >> 4
    return out


def dequantize(w: QuantWeight, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """W [out, in] float32 (or the output rows `rows` of it): q * s + m, in float32."""
    q = unpack(QuantWeight(w.codes[rows], w.scale[rows], w.offset[rows], w.bits))
    n, n_in = q.shape
    g = w.group_size
    s = w.scale[rows].astype(np.float32)[:, :, None]
    m = w.offset[rows].astype(np.float32)[:, :, None]
    return (q.reshape(n, n_in // g, g).astype(np.float32) * s + m).reshape(n, n_in)


def widen(w: QuantWeight, bits: int, group_size: int) -> QuantWeight:
    """The same weights with codes of `bits` >= w.bits and groups of `group_size` dividing
    w's (the scales and offsets repeated): exact."""
    if bits < w.bits or w.group_size % group_size:
        raise ValueError(f"cannot hold {w.bits}-bit codes in groups of {w.group_size} as "
                         f"{bits}-bit codes in groups of {group_size}")
    if bits == w.bits and group_size == w.group_size:
        return w
    r = w.group_size // group_size
    s, m = np.repeat(w.scale, r, axis=1), np.repeat(w.offset, r, axis=1)
    codes = w.codes if bits == w.bits else unpack(w)
    return QuantWeight(np.ascontiguousarray(codes), s, m, bits)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """Layers sharing an input, side by side along the output, in one QuantWeight: codes of the
    most bits, groups of the greatest common size, float32 scales if any part has them (the
    parts widened exactly where they differ)."""
    n_in = parts[0].shape[1]
    if any(p.shape[1] != n_in for p in parts):
        raise ValueError("fused layers must share their input size")
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    g = math.gcd(*(p.group_size for p in parts))
    parts = [widen(p, bits, g) for p in parts]
    dtype = np.result_type(*(p.scale.dtype for p in parts))
    return QuantWeight(np.concatenate([p.codes for p in parts]),
                       np.concatenate([p.scale.astype(dtype) for p in parts]),
                       np.concatenate([p.offset.astype(dtype) for p in parts]), bits)
