"""The decode GEMV (kernels/cuda/gemv.py) against the NumPy reference on fresh seeded inputs, in
Numba's CUDA simulator where there is no GPU, on the GPU where there is one: 4- and 8-bit codes
in groups of 16 to 128 (whole chunks or not: the slow path), float16 weights, its stream-K
grid (row blocks a block covers whole, and ones cut between blocks or slabs of x), the gated
MLP's activation, the RMSNorm before the layer and the residual add after it, the 8-bit head
of a 4-bit model, and outputs and inputs that fill a block's rows and tiles or not.

Every result is brought to the host before it is compared, and compared within a relative
error (a GPU's compiler contracts multiply-adds as it likes, and the kernel sums in its own
order): the float32 sums of a few hundred products, 1e-5."""

import numpy as np
import pytest

from helpers import random_quant, rel_err, seeded_rng
from test_kernels_gpu import gpu_shapes  # noqa: F401  (a fixture: a GPU's launch shapes)
from tinyrt.kernels import quant
from tinyrt.kernels import reference as ref
from tinyrt.kernels.cuda import CudaBackend, gemv, launchers

pytestmark = pytest.mark.usefixtures("quick_barriers")


def gemv_error(out: int, n_in: int, bits: int, g: int, form: str, per_slab: int | None, rng,
               act: str | None = None, norm: bool = False, res: bool = False) -> float:
    """rel_err of launch_gemv on a random layer prepared by the backend (form: float16 scales
    and offsets, float32 ones, K-quant sub-scales (float32 products), or "f16": float16
    weights) and a fresh x (per_slab: the blocks a slab, forced, or None: the launcher's),
    against the reference; y starts as NaN, and the counts of row blocks shared between
    blocks are left 0 (a graph replays them). act: W is a gated MLP's gate|up of 2 out rows,
    against the reference's SwiGLU or GeGLU of that product; norm: x RMS-normed times a random
    weight first; res: a residual added after."""
    rows = 2 * out if act else out
    be = CudaBackend()
    if form == "f16":
        w = rng.standard_normal((rows, n_in)).astype(np.float16)
        dense = w.astype(np.float32)
    else:
        w = random_quant(rows, n_in, bits, g, form != "float32", rng,
                         "k" if form == "k" else "offset")
        dense = quant.dequantize(w)
    prepared = be.prepare_linear([w])
    x = rng.standard_normal(n_in).astype(np.float32)
    y = be.dev(np.full(out, np.nan, np.float32))
    inputs = x
    normed = None
    if norm:
        nw = rng.standard_normal(n_in).astype(np.float32)
        normed, inputs = (be.dev(nw), 1e-5), ref.rmsnorm(x[None], nw, 1e-5)[0]
    r = rng.standard_normal(out).astype(np.float32) if res else None
    launchers.launch_gemv(be.dev(x), prepared, y, be._sums, act, normed,
                          None if r is None else be.dev(r), per_slab)
    assert not be.to_numpy(be._sums.arrived).any()
    want = ref.linear(inputs[None], dense)[0]
    if act:
        gu = want[None]
        want = (ref.ReferenceBackend.geglu(gu) if act == "gelu" else
                ref.ReferenceBackend.swiglu(gu))[0]
    if res:
        want = want + r
    return rel_err(be.to_numpy(y), want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("out, form, per_slab", [(8, "offset", 1), (13, "k", 3),
                                                 (3, "float32", 2), (21, "offset", None),
                                                 (29, "offset", 7)])
def test_q_gemv_against_the_reference(bits, g, out, form, per_slab):
    """At the simulator's launch shapes (4 lanes: tiles of 64 4-bit or 32 8-bit inputs, 8 rows a
    block): 3 groups (4-bit, g 32: a tile and a half) and 11 (up to 22 tiles); 8, 13, 3, 21 and
    29 outputs (whole row blocks, or not, or less than one: not 1, whose relative error would be
    that of one sum, any of which may nearly cancel); float16 scales and offsets, float32 ones
    (the K-quants' products); 1 to 7 blocks (one block's all the units; row blocks cut between
    blocks; more blocks than units), or as many as the launcher makes."""
    rng = seeded_rng()
    for groups in (3, 11):
        assert gemv_error(out, groups * g, bits, g, form, per_slab, rng) < 1e-5, groups


@pytest.mark.parametrize("bits, g", [(4, 48), (4, 8), (8, 6), (8, 24)])
def test_groups_of_no_whole_chunks_take_the_slow_path(bits, g):
    """Groups that do not hold whole chunks of a lane's inputs (16 of 4-bit codes, 8 of 8-bit),
    or a number of them that is not a power of two: each input's group looked up (the _slow
    kernels), split-K or not."""
    rng = seeded_rng()
    assert gemv.group_shift(bits, g) == -1
    for per_slab in (1, 3):
        assert gemv_error(7, 6 * g, bits, g, "offset", per_slab, rng) < 1e-5, per_slab


@pytest.mark.parametrize("n_in, per_slab", [(100, 1), (250, 3), (64, 2)])
def test_float16_weights(n_in, per_slab):
    """A float layer as float16 weights (bits 16: their bits read into float32s, each half
    exact): against x @ W.T of the same float16 values, subnormal and negative halves among
    them."""
    rng = seeded_rng()
    assert gemv_error(9, n_in, 16, n_in, "f16", per_slab, rng) < 1e-5
    be = CudaBackend()
    w = np.array([[6e-8, -6e-8, 3e-5, -65504, 1.5, -0.0, 2 ** -20, 1]], np.float16)
    x = rng.standard_normal(8).astype(np.float32)
    y = be.dev(np.full(1, np.nan, np.float32))
    launchers.launch_gemv(be.dev(x), be.prepare_linear([w]), y, be._sums)
    want = float(x.astype(np.float64) @ w[0].astype(np.float64))
    assert abs(be.to_numpy(y)[0] - want) <= 1e-6 * abs(want)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("bits, g, out, per_slab", [(4, 32, 5, 2), (8, 64, 8, 1),
                                                    (4, 48, 3, 2), (4, 32, 13, 5)])
def test_gated_gemv_is_the_mlp_s_activation(act, bits, g, out, per_slab):
    """A decode step's gate|up GEMV gives the gated MLP's activations in the same launch (a warp
    per two outputs: their gate and up rows): SwiGLU and GeGLU against the reference's of the
    layer's product, row blocks cut between blocks or not, outputs filling a block or not,
    groups of whole chunks or not (48: the slow path)."""
    rng = seeded_rng()
    for groups in (3, 11):
        err = gemv_error(out, groups * g, bits, g, "offset", per_slab, rng, act)
        assert err < 1e-5, groups


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("n_in, per_slab, form", [(256, 1, "offset"), (160, 3, "offset"),
                                                  (96, 2, "f16")])
@pytest.mark.parametrize("slabs", [1, 2])
def test_the_norm_before_and_the_residual_after(act, n_in, per_slab, form, slabs, monkeypatch):
    """norm_linear's launch: the input RMS-normed over the whole row in every block (also those
    of a slab that stage a part of it: STAGED_BYTES made small) times the norm's weight,
    against the reference's rmsnorm then product; linear_add's: a residual added to each
    output, row blocks cut between blocks or not."""
    if slabs == 2:
        monkeypatch.setattr(launchers, "STAGED_BYTES", 2 * launchers.LANES * 9 * 8)
    rng = seeded_rng()
    assert gemv_error(7, n_in, 4, 32, form, per_slab, rng, act, norm=True) < 1e-5
    if act is None:
        assert gemv_error(7, n_in, 4, 32, form, per_slab, rng, res=True) < 1e-5


@pytest.mark.parametrize("out, n_in, bits, g", [
    (13, 640, 4, 128),        # a tile and a quarter (tiles of 512), a block and part of one
    (16, 320, 8, 64),         # a tile and a quarter (tiles of 256), a whole block (16 rows)
    (3, 4608, 4, 32)])        # 9 tiles: three turns of the three-buffer loop
def test_q_gemv_at_the_gpu_s_launch_shapes(gpu_shapes, out, n_in, bits, g):
    """At a GPU's launch shapes (32 lanes, 4 warps of 4 rows a block), 1 and 2 blocks and the
    launcher's."""
    rng = seeded_rng()
    for per_slab in (1, 2, None):
        assert gemv_error(out, n_in, bits, g, "offset", per_slab, rng) < 1e-5, per_slab


def test_the_head_of_a_4_bit_model_is_its_int8_rows():
    """A 4-bit model's float head runs as the reference's int8 rows (reference.int8_rows: half
    the bytes of float16), held as 8-bit codes c + 128 with the row's scale and offset -128
    s, in groups of a power of two of chunks (576 inputs: groups of 64): the reference's head,
    times x."""
    rng = seeded_rng()
    be = CudaBackend()
    for n_in in (576, 256):
        table = rng.standard_normal((11, n_in)).astype(np.float32)
        head = be.prepare_head(table, quantized=True)
        assert head.bits == 8 and gemv.group_shift(8, head.group) >= 0
        x = rng.standard_normal(n_in).astype(np.float32)
        y = be.linear(be.dev(x[None]), head)
        want = ref.linear(x[None], ref.ReferenceBackend().prepare_head(table, quantized=True))
        assert rel_err(be.to_numpy(y), want) < 1e-5


def test_group_shift():
    """Chunk c's group is c >> group_shift where a group holds 2**s chunks, else -1 (the slow
    path: groups that do not hold whole chunks, or not a power of two of them)."""
    assert [gemv.group_shift(4, g) for g in (16, 32, 64, 128, 48, 8, 17)] == [0, 1, 2, 3, -1, -1,
                                                                             -1]
    assert [gemv.group_shift(8, g) for g in (8, 16, 32, 6)] == [0, 1, 2, -1]


def test_the_loads_ahead_stay_inside_the_arrays():
    """A warp's loads run DEPTH units ahead of its sums, unchecked, and the last row block's
    rows past the layer's are summed (not written): repack pads every array with PAD_ROWS rows
    of zeros, enough for two row blocks past the last row; a layer of one row block and one
    tile, all its loads but the first past its rows, is right."""
    rng = seeded_rng()
    w = quant.flat(random_quant(3, 64, 4, 32, True, rng), 4)
    codes, scale, offset = gemv.repack(w, 4)
    wid = gemv.width(4, 64, 4)
    assert wid == 4 and gemv.PAD_ROWS >= 2 * 4 * gemv.R
    for a, per_row in ((codes, wid), (scale, 2), (offset, 2)):
        assert a.shape == ((3 + gemv.PAD_ROWS) * per_row,) and not a[3 * per_row:].any()
    assert gemv_error(3, 64, 4, 32, "offset", 1, rng) < 1e-5


def test_shared_row_blocks_leave_their_scratch_ready():
    """The row blocks that blocks share leave their parts in the backend's SplitSums, which
    every GEMV shares: with its parts NaN and its lens garbage to begin with, two layers of
    different widths one after the other over the same sums, cut among 5 and 3 blocks, are
    each right, and the counts are left 0 for the next launch; sums too small are refused."""
    rng = seeded_rng()
    be = CudaBackend()
    layers = [random_quant(out, 3 * 64, 4, 64, True, rng, "offset") for out in (13, 6)]
    prepared = [be.prepare_linear([w]) for w in layers]
    be._sums.parts[...] = float("nan")
    be._sums.lens[...] = 7
    for w, dev, per_slab in zip(layers, prepared, (5, 3)):
        x = rng.standard_normal(w.shape[1]).astype(np.float32)
        y = be.dev(np.full(w.shape[0], np.nan, np.float32))
        launchers.launch_gemv(be.dev(x), dev, y, be._sums, per_slab=per_slab)
        assert rel_err(be.to_numpy(y), ref.linear(x[None], quant.dequantize(w))[0]) < 1e-5
        assert not be.to_numpy(be._sums.arrived).any()
    with pytest.raises(ValueError, match="split sums too small for a layer of 13 rows"):
        launchers.launch_gemv(be.dev(x), prepared[0], y, launchers.split_sums(be.zeros, 6, 1))


def test_the_grid_is_the_gpu_s_blocks_once_and_bounds_the_staged_x(monkeypatch):
    """The launcher's grid is the GPU's resident blocks once, split among the slabs of x that
    STAGED_BYTES of shared memory allow a block (Llama-2-7B's down projection, 22 tiles of 512
    inputs: two slabs; its q|k|v, 8 tiles: one)."""
    monkeypatch.setattr(launchers, "resident_blocks", lambda: 660)
    monkeypatch.setattr(launchers, "LANES", 32)
    w = gemv.GpuQuant(None, None, None, 4, 4096, 32, 128)
    assert launchers.gemv_grid(w) == (660, 1, 8 * 32 * 9 * 8)
    blocks, slabs, shared = launchers.gemv_grid(w._replace(n_in=11008))
    assert (blocks, slabs) == (660, 2) and shared <= launchers.STAGED_BYTES
    assert launchers.gemv_grid(w, 7) == (7, 1, 8 * 32 * 9 * 8)
