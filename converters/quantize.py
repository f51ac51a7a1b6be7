"""Asymmetric group quantization (round to nearest, a zero point per group), as pure functions.

For a group with minimum lo and maximum hi: s = (hi - lo) / (2^bits - 1) (rounded to float16, the
precision it is stored in), z = round(-lo / s) clipped to [0, 2^bits - 1], q = clip(round(w / s) + z).
The value it stands for is (q - z) * s.
"""

from __future__ import annotations

import numpy as np

from tinyrt.kernels import awq_layout


ROW_BYTES = 16 << 20     # float32 rows quantized at a time: the temporaries of a large layer


def quantize(w: np.ndarray, group_size: int, bits: int = 4):
    """w [out, in] -> codes uint8 [out, in], scales float16 [out, in/g], zeros uint8 [out, in/g]."""
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"group size {group_size} does not divide {inp} input channels")
    codes = np.empty((out, inp), np.uint8)
    scales = np.empty((out, inp // group_size), np.float16)
    zeros = np.empty((out, inp // group_size), np.uint8)
    qmax = 2 ** bits - 1
    step = max(1, ROW_BYTES // (4 * inp))
    for r in range(0, out, step):
        wg = w[r:r + step].astype(np.float32).reshape(-1, inp // group_size, group_size)
        lo, hi = wg.min(axis=2), wg.max(axis=2)
        scales[r:r + step] = np.maximum(hi - lo, 1e-5) / qmax
        s = scales[r:r + step].astype(np.float32)
        z = np.clip(np.round(-lo / s), 0, qmax)
        zeros[r:r + step] = z
        q = np.clip(np.round(wg / s[..., None]) + z[..., None], 0, qmax)
        codes[r:r + step] = q.reshape(len(q), inp)
    return codes, scales, zeros


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """Inverse of `quantize`: [out, in] float32."""
    g = codes.shape[1] // scales.shape[1]
    cg = codes.reshape(codes.shape[0], -1, g).astype(np.float32)
    w = (cg - zeros[..., None].astype(np.float32)) * scales[..., None].astype(np.float32)
    return w.reshape(codes.shape)


def fake_quantize(w: np.ndarray, group_size: int, bits: int = 4) -> np.ndarray:
    """quantize then dequantize: the weight the model will really compute with."""
    return dequantize(*quantize(w, group_size, bits))


def pack_linear(w: np.ndarray, group_size: int, bits: int = 4) -> dict[str, np.ndarray]:
    """w [out, in] -> the AutoAWQ GEMM tensors qweight, qzeros, scales (see kernels.awq_layout)."""
    if bits != 4:
        raise ValueError("the AutoAWQ GEMM layout holds 4-bit codes")
    codes, scales, zeros = quantize(w, group_size, bits)
    return {"qweight": awq_layout.pack(codes.T), "qzeros": awq_layout.pack(zeros.T),
            "scales": np.ascontiguousarray(scales.T)}
