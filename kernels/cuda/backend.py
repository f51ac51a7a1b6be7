"""The backend that runs the decoder on the CUDA kernels (`CudaBackend`), and why it cannot
run on a machine (`unavailable`)."""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .. import kv_quant, quant, reference
from .gemv import GpuQuant, chunk, repack, repack_f16
from .launchers import (attention_counts, fits, launch_attention, launch_attention_decode_q,
                        launch_dequantize, launch_dequantize_kv, launch_gemv, launch_rmsnorm,
                        launch_rope, launch_rope_store, launch_silu_mul, launch_store_kv,
                        launch_store_kv_q, split_sums, sums_needed)
from .primitives import LANES, SIM


class CudaBackend(reference.ReferenceBackend):
    """The decoder's ops on this package's CUDA kernels. Device arrays are torch tensors on the
    GPU (the kernels read them through the CUDA array interface, no copies); in Numba's CUDA
    simulator torch tensors in host memory, so that the whole backend runs, slowly and as it
    does on a GPU, where there is none.
    Weights are uploaded once, at load: quantized layers as kernels.quant holds them, float
    weights as float16.
    Host inputs (positions, RoPE tables, the sinks' keys) are copied up where an op takes them.
    """

    name = "cuda"
    host_memory = False
    quantized_kv = True      # float16, float32 and kv_quant caches

    def __init__(self, cuda_graph: bool = True):
        import torch

        self.cuda_graph = cuda_graph     # decode steps replayed as a CUDA graph (tinyrt.device_decode)

        self.torch = torch
        # in Numba's CUDA simulator the tensors live in host memory, and `launch` hands the
        # kernels NumPy views of them: the rest of the backend is the code the GPU runs
        self.device = "cpu" if SIM else "cuda"
        self._types = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
                       np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                       np.dtype(np.uint8): torch.uint8}
        self._sums = None        # the split-K GEMVs' scratch (launchers.SplitSums), at load
        self._counts = {}        # queries 1 or more (0) -> attention's counts (int32 zeros)

    # -- memory ----------------------------------------------------------------------------------

    def dev(self, a, dtype=np.float32):
        """A contiguous device tensor of `a` (host array or tensor) as `dtype`; a host array is
        copied."""
        t = self._types[np.dtype(dtype)]
        if isinstance(a, self.torch.Tensor):
            return a.to(device=self.device, dtype=t).contiguous()
        return self.torch.tensor(np.ascontiguousarray(a, dtype), device=self.device)

    def empty(self, shape, dtype=np.float32):
        return self.torch.empty(shape, dtype=self._types[np.dtype(dtype)], device=self.device)

    def zeros(self, shape, dtype=np.float32):
        return self.torch.zeros(shape, dtype=self._types[np.dtype(dtype)], device=self.device)

    def to_numpy(self, x) -> np.ndarray:
        """A host copy, of the same dtype (as the reference backend's arrays are)."""
        if isinstance(x, np.ndarray):
            return x
        return x.detach().to("cpu", copy=True).numpy()

    def _matmul(self, x, w_t):
        """x [T, in] @ w_t [in, out] on the device (cuBLAS through torch), in float32: a
        float16 GEMM overflows where activations pass 65504 (random-weight models do)."""
        return x @ w_t.float()

    # -- weights ---------------------------------------------------------------------------------

    def prepare_linear(self, parts: list):
        """Quantized layers as one float scale and offset per group and 4- or 8-bit codes,
        float ones as float16 weights: either way the GEMV's layout (gemv.repack)."""
        if all(isinstance(p, quant.QuantWeight) for p in parts):
            w = quant.concat(parts)
            w = quant.flat(w, 4 if w.bits == 4 else 8)
            codes, scale, offset = repack(w, LANES)
            scale, offset = self.dev(scale, scale.dtype), self.dev(offset, offset.dtype)
            bits, group = w.bits, w.group_size
        else:
            w = super().prepare_linear(parts)
            codes, scale, offset = repack_f16(w, LANES), self.empty(0), self.empty(0)
            bits, group = 16, w.shape[1]
        w = GpuQuant(self.dev(codes, np.int64), scale, offset, bits, w.shape[1], LANES, group)
        if self._sums is None or not fits(self._sums, w):     # (at load: before any graph)
            rows, tiles = sums_needed(w)
            if self._sums is not None:
                tiles, rows = max(tiles, self._sums.parts.shape[0]), max(rows,
                                                                         self._sums.parts.shape[1])
            self._sums = split_sums(self.zeros, rows, tiles)
        return w

    def prepare_head(self, table: np.ndarray, quantized: bool = False):
        """A 4-bit model's float head as the reference's int8 rows (reference.prepare_head),
        held as 8-bit codes c + 128 with the row's scale s and offset -128 s: half the bytes of
        float16 for the same products; a float model's as float16."""
        if not quantized:
            return self.prepare_linear([table])
        q, s = reference.int8_rows(table)
        n_in = table.shape[1]
        g = chunk(8)                 # groups of the most chunks dividing a row, a power of two
        while n_in % (2 * g) == 0:   # of them (the GEMV's fast path); each the row's scale
            g *= 2
        s = np.repeat(s[:, None], n_in // g, axis=1)
        return self.prepare_linear([quant.make((q.astype(np.int16) + 128).astype(np.uint8), 8,
                                                s, -128 * s)])

    def prepare_vector(self, a: np.ndarray):
        return self.dev(a)

    def prepare_embedding(self, table):
        if not isinstance(table, np.ndarray):        # rows dequantized as indexed: all of them
            table = table[np.arange(table.shape[0])]
        return self.dev(table, np.float16)

    # -- ops -------------------------------------------------------------------------------------

    def embedding(self, table, ids):
        if not isinstance(ids, self.torch.Tensor):
            ids = self.torch.as_tensor(np.asarray(ids, np.int64), device=self.device)
        return table[ids].float()

    def linear(self, x, w):
        x = self.dev(x)
        if x.shape[0] == 1:
            y = self.empty((1, w.shape[0]))
            launch_gemv(x[0], w, y[0], self._sums)
            return y
        w_t = self.empty((w.shape[1], w.shape[0]))
        launch_dequantize(w, w_t)
        return self._matmul(x, w_t)

    def gated(self, h, w, gelu: bool):
        if h.shape[0] == 1:                     # a decode step: one launch
            y = self.empty((1, w.shape[0] // 2))
            launch_gemv(self.dev(h)[0], w, y[0], self._sums, "gelu" if gelu else "silu")
            return y
        return super().gated(h, w, gelu)

    def norm_linear(self, x, norm_w, eps, w, act: str | None = None):
        """A decode step's RMSNorm and the projection after it in one launch: y [1, out] =
        RMSNorm(x) * norm_w @ W.T; act ("silu", "gelu"): W a gated MLP's gate|up and y its
        activation [1, out / 2]."""
        y = self.empty((1, w.shape[0] // 2 if act else w.shape[0]))
        launch_gemv(x[0], w, y[0], self._sums, act, (norm_w, eps))
        return y

    def linear_add(self, x, w, res):
        """res + x @ W.T in one launch (a decode step's projection and its residual add), into
        a new array [1, out]."""
        y = self.empty((1, w.shape[0]))
        launch_gemv(self.dev(x)[0], w, y[0], self._sums, res=res[0])
        return y

    def rmsnorm(self, x, w, eps):
        x = self.dev(x)
        y = self.empty(x.shape)
        launch_rmsnorm(x, w, eps, y)
        return y

    def add_rmsnorm(self, x, d, w, eps):
        """x += d (a device tensor, in place; d None: nothing), then its RMSNorm, in one launch."""
        y = self.empty(x.shape)
        launch_rmsnorm(x, w, eps, y, d)
        return y

    def rope_store(self, qkv, bias, q_norm, k_norm, eps, cos, sin, k_buf, v_buf, slots, heads):
        """The queries [T, heads, D] of a q|k|v projection's output qkv [T, (heads + 2G) D], their
        keys and values stored into the float cache k_buf, v_buf [G, C, D] at slots [G, T]:
        LlamaModel.attention's bias, q/k norms (None: none) and RoPE, and store_kv, in one
        launch (kernels.rope_store)."""
        none = self.empty(0)             # (an empty vector: none)
        q = self.empty((qkv.shape[0], heads, k_buf.shape[2]))
        launch_rope_store(qkv, none if bias is None else bias, none if q_norm is None else q_norm,
                          none if k_norm is None else k_norm, eps, cos, sin, k_buf, v_buf, slots, q)
        return q

    def rope(self, x, cos, sin):
        x = self.dev(x)
        y = self.empty(x.shape)
        launch_rope(x, self.dev(cos), self.dev(sin), y)
        return y

    def geglu(self, gu):
        gu = self.dev(gu)
        I = gu.shape[-1] // 2
        gelu = self.torch.nn.functional.gelu(gu[..., :I], approximate="tanh")
        return gelu * gu[..., I:]

    def swiglu(self, gu):
        gu = self.dev(gu)
        y = self.empty((gu.shape[0], gu.shape[1] // 2))
        launch_silu_mul(gu, y)
        return y

    def store_kv(self, k_buf, v_buf, slots, k, v):
        slots, k, v = self.dev(slots, np.int64), self.dev(k), self.dev(v)
        if isinstance(k_buf, kv_quant.QuantKV):
            launch_store_kv_q(k_buf, slots, k, v)
        else:
            launch_store_kv(k_buf, v_buf, slots, k, v)

    def _dequantized(self, store: kv_quant.QuantKV, n: int):
        """Slots [0, n) of a quantized cache as float32 device arrays k, v [N, n, D]."""
        N, D = store.where.shape[0], store.head_dim
        k, v = self.empty((N, n, D)), self.empty((N, n, D))
        launch_dequantize_kv(store, k, v)
        return k, v

    def read_kv(self, k_buf, v_buf, n):
        if isinstance(k_buf, kv_quant.QuantKV):
            return tuple(self.to_numpy(a) for a in self._dequantized(k_buf, n))
        return super().read_kv(k_buf, v_buf, n)

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None, score=None, live=None):
        """Flash-decoding over a float cache, a prompt's queries in one launch set (their own
        and later tokens' slots hidden by the causal mask); the positions uploaded once, k_pos
        with its own first dim (one table for all heads, or one per head); live: the slots of
        k_pos read, the first live[0] (int64 [1] on the device; None: all). A quantized cache (k
        a QuantKV) is read in place for one query; for a prompt's, its slots are dequantized
        once into float32 buffers that the float kernels read."""
        q = self.dev(q)
        T, Q, D = q.shape
        quantized = isinstance(k, kv_quant.QuantKV)
        G, S = (k.where if quantized else k).shape[0], k_pos.shape[-1]
        k_pos = self.dev(k_pos, np.int64).reshape(-1, S)
        sc = self.empty((G, 0)) if score is None else self.dev(score)
        out = self.empty((T, Q, D))
        if quantized and T == 1:
            launch_attention_decode_q(q[0], k, int(q_pos[0]), k_pos.expand(G, S).contiguous(),
                                      scale, window or 0, sc, self.empty((Q, S)), out[0])
        else:
            if quantized:
                k, v = self._dequantized(k, S)
            if live is None:
                live = self.dev(np.array([S]), np.int64)
            launch_attention(q, k, v, self.dev(q_pos, np.int64), k_pos, live, scale, window or 0,
                             sc, out, self.empty, self._attention_counts(q, k))
        if score is not None and sc is not score:
            score[...] = self.to_numpy(sc)          # a cache that keeps its scores on the host
        return out

    def _attention_counts(self, q, k):
        """launch_attention's counts (zeros, which its kernels leave zeros): one query's apart
        from a prompt's, so that a captured decode step's stay the ones it read while prompts
        of any length come and go (theirs are made again only larger); one query's made at
        the first attention, a prompt's, before any decode step."""
        if 1 not in self._counts:
            self._counts[1] = self.zeros(attention_counts(q[:1], k), np.int32)
        n = attention_counts(q, k)
        if q.shape[0] > 1 and (0 not in self._counts or self._counts[0].shape[0] < n):
            self._counts[0] = self.zeros(n, np.int32)
        return self._counts[int(q.shape[0] == 1)]


def unavailable() -> str | None:
    """Why the CUDA backend cannot run here (None: it can; Numba's CUDA simulator counts)."""
    if numba.config.ENABLE_CUDASIM:
        return None
    try:
        import torch
    except ImportError:
        return 'the CUDA backend needs PyTorch built with CUDA (pip install "tinyrt[cuda]")'
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU (no device, no driver, or a CPU-only build of torch)"
    if not cuda.is_available():
        return "Numba sees no CUDA GPU (is the CUDA driver installed?)"
    from numba.cuda.cudadrv import nvvm

    if not nvvm.is_available():      # (the kernels compile through it; torch's wheels lack it)
        return ("Numba finds no libNVVM to compile the CUDA kernels with (torch's wheels do not "
                "ship it): pip install \"tinyrt[cuda]\" (or tinyrt[cuda12] for CUDA 12), or "
                "install the CUDA toolkit, or set CUDA_HOME to one")
    return None
