"""GGUF quantized blocks mapped into the runtime's one quantized form (models/gguf_quants.py):
dequantized, they give back exactly what the `gguf` package (llama.cpp's own Python) dequantizes.

Exactness: every value both sides compute is exact, or computed by the same float32 operations.
Q4_0, Q5_0, Q8_0 and Q6_K: gguf computes d * (q - z); we compute q * s + (-z s), s = d (Q6_K: d
times its int8 sub-scale, exact in float32). q * s is exact
(a float16's 11 significant bits times a code of at most 8 bits, and for Q6_K a sub-scale of at
most 7 bits' magnitude times a 6-bit code: 24 bits at most), -z s is exact (z a power of two),
and their sum is (q - z) * s, itself representable, so it rounds to itself: both sides give the
exact product. Q4_1, Q5_1: both compute d * q + m, the same two operations. Q4_K, Q5_K: both
compute (d sc) * q - dmin m, where d sc and dmin m are exact in float32 (11 bits times 6): the
same operations again. Hence assert_array_equal everywhere, no tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tinyrt.kernels import quant
from tinyrt.models.gguf_quants import GGUF_TO_QUANT, to_quant

QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]     # gguf has a quantizer for these
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]                         # not for these: random blocks
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q6_K: 6, Q.Q8_0: 8}
# bits held per weight: the file's block, but 5- and 6-bit codes one per byte
HELD = {Q.Q4_0: 4.5, Q.Q4_1: 5, Q.Q4_K: 4.625, Q.Q5_0: 8.5, Q.Q5_1: 9, Q.Q5_K: 8.625,
        Q.Q6_K: 8.5625, Q.Q8_0: 8.5}
GROUP = {t: 16 if t == Q.Q6_K else 32 for t in BITS}
HALVES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of a block's float16s


def _kquant_blocks(qtype: Q, rows: int, n_in: int, rng) -> np.ndarray:
    """Random K-quant rows: random bytes, with finite float16 d (and dmin) of either sign and
    modest magnitude (some zero), [rows, bytes_per_row]."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * n_in // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in HALVES[qtype]:
        d = rng.choice([-1, 1], n) * rng.uniform(1e-4, 0.05, n)
        d[rng.random(n) < 0.02] = 0
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, n_in // block * size)


def _check(raw: np.ndarray, qtype: Q, n_in: int) -> quant.QuantWeight:
    w = to_quant(raw, qtype, n_in)
    rows = raw.shape[0]
    assert w.shape == (rows, n_in) and w.bits == BITS[qtype] and w.group_size == GROUP[qtype]
    assert w.codes.dtype == np.uint8 and w.scale.dtype == np.float16
    assert all(a.dtype in (np.float16, np.int8) for a in w.arrays)   # the file's floats, as is
    assert 8 * w.nbytes == HELD[qtype] * rows * n_in
    assert int(quant.unpack(w).max()) < 2 ** w.bits
    ours = quant.dequantize(w)
    theirs = dequantize(raw, qtype).reshape(rows, n_in)
    assert ours.dtype == theirs.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)   # exact: see the module's docstring
    return w


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n_in", [(1, 32), (7, 96), (48, 512)])
def test_quantized_weights_map_exactly(qtype, rows, n_in):
    rng = np.random.default_rng(rows * 1000 + n_in + int(qtype))
    x = (rng.standard_normal((rows, n_in)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    x[0, :8] = 0                              # a block with zeros, and one of equal values
    x[-1, -32:] = 0.25
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape[0] == rows
    _check(raw, qtype, n_in)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n_in", [(1, 256), (5, 768), (32, 1024)])
def test_kquant_blocks_map_exactly(qtype, rows, n_in):
    rng = np.random.default_rng(rows * 1000 + n_in + int(qtype))
    raw = _kquant_blocks(qtype, rows, n_in, rng)
    _check(raw, qtype, n_in)


def test_codes_reach_every_value():
    """Each layout's every code appears (all bit positions are decoded, none dropped)."""
    rng = np.random.default_rng(3)
    for qtype in KQUANTS:
        w = to_quant(_kquant_blocks(qtype, 16, 1024, rng), qtype, 1024)
        assert set(np.unique(quant.unpack(w))) == set(range(64 if qtype == Q.Q6_K else
                                                            2 ** (4 if qtype == Q.Q4_K else 5)))
    x = np.random.default_rng(4).standard_normal((16, 256)).astype(np.float32)
    for qtype, n in ((Q.Q4_0, 16), (Q.Q4_1, 16), (Q.Q5_0, 32), (Q.Q5_1, 32), (Q.Q8_0, 255)):
        codes = quant.unpack(to_quant(quantize(x, qtype), qtype, 256))
        assert len(np.unique(codes)) >= n


def test_the_table_and_its_refusals():
    assert set(GGUF_TO_QUANT) == set(BITS)
    raw = quantize(np.ones((2, 64), np.float32), Q.Q8_0)
    with pytest.raises(ValueError, match="Q8_0 rows of 96 values"):
        to_quant(raw, Q.Q8_0, 96)
    with pytest.raises(ValueError, match="Q8_0 rows of 30 values"):
        to_quant(raw[:, :30], Q.Q8_0, 30)
    with pytest.raises(ValueError, match="no exact quantized form"):
        to_quant(raw, Q.Q2_K, 256)
