"""The quantized GEMV (kernels/cuda/gemv.py) against the NumPy reference on fresh seeded inputs,
in Numba's CUDA simulator: groups of 32, 64 and 128, 4- and 8-bit codes, outputs that fill a
block's rows or not, inputs that fill the tiles or not, and more tiles than one slab of x."""

import numpy as np
import pytest

from helpers import random_quant, rel_err, seeded_rng
from test_kernels_gpu import gpu_shapes  # noqa: F401  (a fixture: a GPU's launch shapes)
from tinyrt.kernels import quant
from tinyrt.kernels import reference as ref
from tinyrt.kernels.cuda import CudaBackend, gemv, launchers

pytestmark = pytest.mark.usefixtures("quick_barriers")


def gemv_error(out: int, n_in: int, bits: int, g: int, form: str, split: bool, rng,
               monkeypatch, act: str | None = None) -> float:
    """rel_err of launch_q_gemv (split-K or not) on a random layer prepared by the backend
    (form: float16 scales and offsets, float32 ones, or K-quant sub-scales: float32 products)
    and a fresh x, against x @ dequantize(W).T; y starts as NaN. With act, W is a gated MLP's
    gate|up of 2 out rows, against the reference's SwiGLU or GeGLU of that product."""
    rows = 2 * out if act else out
    w = random_quant(rows, n_in, bits, g, form != "float32", rng, "k" if form == "k" else "offset")
    be = CudaBackend()
    x = rng.standard_normal(n_in).astype(np.float32)
    y = be.dev(np.full(out, np.nan, np.float32))
    monkeypatch.setattr(launchers, "SPLIT_BELOW", 10 ** 9 if split else 0)
    launchers.launch_q_gemv(be.dev(x), be.prepare_linear([w]), y, be._sums, act)
    want = ref.linear(x[None], quant.dequantize(w))
    if act:
        want = ref.ReferenceBackend.geglu(want) if act == "gelu" else ref.ReferenceBackend.swiglu(want)
    return rel_err(be.to_numpy(y), want[0])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("out, form, split", [(8, "offset", False), (13, "k", True),
                                              (3, "float32", True)])
def test_q_gemv_against_the_reference(bits, g, out, form, split, monkeypatch):
    """At the simulator's launch shapes (4 lanes: tiles of 64 4-bit or 32 8-bit inputs, 4 rows a
    block): 3 groups (4-bit, g 32: a tile and a half) and 11 (up to 22 tiles: 3 slabs); 8, 13
    and 3 outputs (whole blocks, or not, or less than one: not 1, whose relative error would be
    that of one sum, any of which may nearly cancel); float16 scales and offsets, float32 ones
    (the K-quants' products), split-K or not."""
    rng = seeded_rng()
    for groups in (3, 11):
        assert gemv_error(out, groups * g, bits, g, form, split, rng, monkeypatch) < 1e-5, groups


@pytest.mark.parametrize("out, n_in, bits, g", [
    (13, 640, 4, 128),        # a tile and a quarter (tiles of 512), a block and part of one
    (16, 320, 8, 64),         # a tile and a quarter (tiles of 256), a whole block (16 rows)
    (3, 4608, 4, 32)])        # 9 tiles: 2 slabs of x
def test_q_gemv_at_the_gpu_s_launch_shapes(gpu_shapes, monkeypatch, out, n_in, bits, g):
    """At a GPU's launch shapes (32 lanes, 16 rows a block), split-K and not."""
    rng = seeded_rng()
    for split in (False, True):
        assert gemv_error(out, n_in, bits, g, "offset", split, rng, monkeypatch) < 1e-5, split


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("bits, g, out, split", [(4, 32, 5, True), (8, 64, 8, False),
                                                 (4, 48, 3, True)])
def test_gated_gemv_is_the_mlp_s_activation(act, bits, g, out, split, monkeypatch):
    """A decode step's gate|up GEMV gives the gated MLP's activations in the same launch (a warp
    per output: its gate and up rows): SwiGLU and GeGLU against the reference's of the layer's
    product, split-K or not, outputs filling a block or not, groups of whole chunks or not (48:
    the slow path)."""
    rng = seeded_rng()
    for groups in (3, 11):
        err = gemv_error(out, groups * g, bits, g, "offset", split, rng, monkeypatch, act)
        assert err < 1e-5, groups


def test_group_shift():
    """Chunk c's group is c >> group_shift where a group holds 2**s chunks, else -1 (the slow
    path: groups that do not hold whole chunks, or not a power of two of them)."""
    assert [gemv.group_shift(4, g) for g in (16, 32, 64, 128, 48, 8, 17)] == [0, 1, 2, 3, -1, -1,
                                                                             -1]
    assert [gemv.group_shift(8, g) for g in (8, 16, 32, 6)] == [0, 1, 2, -1]


def test_split_sums_are_scratch_left_ready(monkeypatch):
    """Split-K's blocks leave their sums in the backend's SplitSums, which every GEMV shares: with
    its parts NaN to begin with, two layers of different widths one after the other over the same
    sums are each right, and its counts are left 0 for the next launch (a graph replays them)."""
    rng = seeded_rng()
    monkeypatch.setattr(launchers, "SPLIT_BELOW", 10 ** 9)
    be = CudaBackend()
    layers = [random_quant(out, 3 * 64, 4, 64, True, rng, "offset") for out in (13, 6)]
    prepared = [be.prepare_linear([w]) for w in layers]
    be._sums.parts[...] = float("nan")
    for w, dev in zip(layers, prepared):
        x = rng.standard_normal(w.shape[1]).astype(np.float32)
        y = be.dev(np.full(w.shape[0], np.nan, np.float32))
        launchers.launch_q_gemv(be.dev(x), dev, y, be._sums)
        assert rel_err(be.to_numpy(y), ref.linear(x[None], quant.dequantize(w))[0]) < 1e-5
        assert not be.to_numpy(be._sums.arrived).any()
    with pytest.raises(ValueError, match="split sums for 6 outputs, not 13"):
        launchers.launch_q_gemv(be.dev(x), prepared[0], y, launchers.split_sums(be.zeros, 6))
