"""The AutoAWQ GEMM layout of a 4-bit group-quantized linear layer, defined here.

A linear layer y = x @ W.T with W [out, in] is stored as three tensors:

- `qweight` int32 [in, out/8]: row i holds the 4-bit codes q[i, :] of input channel i, eight output
  channels per int32. Within word c, the nibble at bit shift 4*j holds output channel
  8*c + ORDER[j], ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (AutoAWQ's interleaving, made for its CUDA
  dequantization; reading nibbles 0..7 back into channel order uses REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]).
- `qzeros` int32 [in/g, out/8]: the 4-bit zero point z of each group of g input channels and each
  output channel, packed the same way.
- `scales` float16 [in/g, out]: the step s of each group and output channel.

W.T[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]. Codes and zero points are unsigned 0..15; an
int32 word may read as negative when its top nibble is 8 or more.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import quant


class QuantizedLinear(NamedTuple):
    """A 4-bit linear layer in this layout."""

    qweight: np.ndarray  # int32 [in, out/8]
    qzeros: np.ndarray   # int32 [in/g, out/8]
    scales: np.ndarray   # float16 [in/g, out]


ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)
PACK = 8  # 4-bit values per int32


def pack(codes: np.ndarray) -> np.ndarray:
    """uint4 codes [rows, cols] (values 0..15, cols % 8 == 0) -> int32 [rows, cols/8]."""
    rows, cols = codes.shape
    if cols % PACK:
        raise ValueError(f"cannot pack {cols} columns: not a multiple of {PACK}")
    c = codes.astype(np.uint32).reshape(rows, cols // PACK, PACK)[:, :, ORDER]
    shifts = np.arange(PACK, dtype=np.uint32) * 4
    return np.bitwise_or.reduce(c << shifts, axis=2).view(np.int32)


def unpack(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, cols/8] -> uint4 codes uint8 [rows, cols]."""
    rows, words = packed.shape
    shifts = np.arange(PACK, dtype=np.uint32) * 4
    nibbles = (packed.view(np.uint32)[:, :, None] >> shifts) & 0xF     # [rows, words, j]
    return nibbles[:, :, REVERSE].reshape(rows, words * PACK).astype(np.uint8)


def shapes(in_features: int, out_features: int, group_size: int) -> dict[str, tuple[int, int]]:
    """Shapes of qweight, qzeros and scales for a layer."""
    return {"qweight": (in_features, out_features // PACK),
            "qzeros": (in_features // group_size, out_features // PACK),
            "scales": (in_features // group_size, out_features)}


def packed_codes(qweight: np.ndarray) -> np.ndarray:
    """int32 [in, out/8] (in even) -> the codes transposed to [out, in] as quant.pack4 packs
    them, uint8 [out, in/2]. The same bytes as pack4(unpack(qweight).T), but only whole words
    are transposed, each nibble then taken from two of them: 25x faster at Llama-2-7B's layers
    (unpacked codes took 70 s of a 73 s load of its 32 layers)."""
    if qweight.shape[0] % 2:
        raise ValueError(f"4-bit codes [{qweight.shape[1] * PACK}, {qweight.shape[0]}] must be "
                         "of an even width")
    w = np.ascontiguousarray(qweight.view(np.uint32).T)                # [out/8, in]
    even, odd = w[:, 0::2], w[:, 1::2]
    out = np.empty((w.shape[0], PACK, w.shape[1] // 2), np.uint8)      # [out/8, j, in/2]
    for j in range(PACK):
        shift = np.uint32(4 * j)
        out[:, ORDER[j]] = ((even >> shift) & 0xF) | ((odd >> shift) & 0xF) << 4
    return out.reshape(-1, w.shape[1] // 2)


def to_quant(layer: QuantizedLinear) -> quant.QuantWeight:
    """The layer in the runtime's one quantized form (kernels.quant): codes transposed to
    [out, in], scale s, offset -s with the zero point z as its integer sub-scale (m = -z s)."""
    s = np.ascontiguousarray(layer.scales.T)                           # [out, in/g]
    return quant.make(packed_codes(layer.qweight), 4, s, -s,
                      offset_q=np.ascontiguousarray(unpack(layer.qzeros).T), packed=True)
