"""Asymmetric group quantization (round to nearest, a zero point per group), as pure functions.

For a group with minimum lo and maximum hi, its range widened to hold 0 (lo <= 0 <= hi: the zero
point must be a code, or a group of one sign, constant ones too, clips to nonsense; a group of
both signs, every real one, is as AutoAWQ quantizes it): s = (hi - lo) / (2^bits - 1) (rounded to
float16, the precision it is stored in), z = round(-lo / s) clipped to [0, 2^bits - 1],
q = clip(round(w / s) + z). The value it stands for is (q - z) * s. All in float32, rounding
half to even as NumPy does. The passes over the weights are Numba loops on all cores: AWQ's
searches quantize every layer's weights some sixty times.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from tinyrt.kernels import awq_layout


@njit(parallel=True, cache=True)
def _group_ranges(w, g, lo, hi):
    """lo, hi float32 [out, in/g] = the least and largest of each group of g inputs of w."""
    for r in prange(w.shape[0]):
        for j in range(w.shape[1] // g):
            a = b = w[r, j * g]
            for i in range(j * g + 1, j * g + g):
                a, b = min(a, w[r, i]), max(b, w[r, i])
            lo[r, j], hi[r, j] = a, b


@njit(parallel=True, cache=True)
def _round_groups(w, g, s, z, qmax, codes, values):
    """The codes q of w float32 [out, in] for scales s and zero points z float32 [out, in/g]
    into codes uint8 [out, in] and/or the values (q - z) * s into values float32 [out, in]
    (an output with no rows: not wanted)."""
    for r in prange(w.shape[0]):
        for j in range(w.shape[1] // g):
            sj, zj = s[r, j], z[r, j]
            for i in range(j * g, j * g + g):
                q = min(max(np.round(np.float32(w[r, i] / sj)) + zj, np.float32(0)), qmax)
                if codes.shape[0]:
                    codes[r, i] = np.uint8(q)
                if values.shape[0]:
                    values[r, i] = (q - zj) * sj


_NO_CODES = np.empty((0, 0), np.uint8)
_NO_VALUES = np.empty((0, 0), np.float32)


def _grid(w: np.ndarray, group_size: int, bits: int):
    """w as float32 and its groups' scales (float16 and float32) and zero points (float32)."""
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"group size {group_size} does not divide {inp} input channels")
    w = np.ascontiguousarray(w, np.float32)
    lo = np.empty((out, inp // group_size), np.float32)
    hi = np.empty_like(lo)
    _group_ranges(w, group_size, lo, hi)
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    qmax = 2 ** bits - 1
    scales = (np.maximum(hi - lo, 1e-5) / qmax).astype(np.float16)
    s = scales.astype(np.float32)
    return w, scales, s, np.clip(np.round(-lo / s), 0, qmax), np.float32(qmax)


def quantize(w: np.ndarray, group_size: int, bits: int = 4):
    """w [out, in] -> codes uint8 [out, in], scales float16 [out, in/g], zeros uint8 [out, in/g]."""
    w, scales, s, z, qmax = _grid(w, group_size, bits)
    codes = np.empty(w.shape, np.uint8)
    _round_groups(w, group_size, s, z, qmax, codes, _NO_VALUES)
    return codes, scales, z.astype(np.uint8)


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """Inverse of `quantize`: [out, in] float32."""
    g = codes.shape[1] // scales.shape[1]
    cg = codes.reshape(codes.shape[0], -1, g).astype(np.float32)
    w = (cg - zeros[..., None].astype(np.float32)) * scales[..., None].astype(np.float32)
    return w.reshape(codes.shape)


def fake_quantize(w: np.ndarray, group_size: int, bits: int = 4) -> np.ndarray:
    """quantize then dequantize (in one pass): the weight the model will really compute with."""
    w, _, s, z, qmax = _grid(w, group_size, bits)
    values = np.empty(w.shape, np.float32)
    _round_groups(w, group_size, s, z, qmax, _NO_CODES, values)
    return values


def pack_linear(w: np.ndarray, group_size: int, bits: int = 4) -> dict[str, np.ndarray]:
    """w [out, in] -> the AutoAWQ GEMM tensors qweight, qzeros, scales (see kernels.awq_layout)."""
    if bits != 4:
        raise ValueError("the AutoAWQ GEMM layout holds 4-bit codes")
    codes, scales, zeros = quantize(w, group_size, bits)
    return {"qweight": awq_layout.pack(codes.T), "qzeros": awq_layout.pack(zeros.T),
            "scales": np.ascontiguousarray(scales.T)}
