"""The backend that runs the decoder on the CUDA kernels (`CudaBackend`), and why it cannot
run on a machine (`unavailable`)."""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda

from .. import kv_quant, quant, reference
from .gemv import GpuQuant, chunk, repack, repack_f16
from .launchers import (attention_counts, fits, launch_attention, launch_attention_decode_q,
                        launch_dequantize_kv, launch_gemv, launch_rmsnorm, launch_rope,
                        launch_rope_store, launch_silu_mul, launch_store_kv, launch_store_kv_q,
                        split_sums, sums_needed)
from .primitives import HALF_MAX, LANES, SIM
from .prompt import PASS_TOKENS, PromptOps

PINNED_MAX = 4 << 20     # host arrays up to this size go up through pinned memory (see dev)


class CudaBackend(reference.ReferenceBackend):
    """The decoder's ops on this package's CUDA kernels. Device arrays are torch tensors on the
    GPU (the kernels read them through the CUDA array interface, no copies); in Numba's CUDA
    simulator torch tensors in host memory, so that the whole backend runs, slowly and as it
    does on a GPU, where there is none.
    Weights are uploaded once, at load: quantized layers as kernels.quant holds them, float
    weights as float16.
    Host inputs (positions, RoPE tables, the sinks' keys) are copied up where an op takes them.
    One token's ops are this package's kernels; a pass of more (a prompt) multiplies on the
    tensor cores and attends through torch's fused attention (prompt.PromptOps: `prompt_dtype`
    its GEMMs' operands, None: as the GPU allows), at most `pass_tokens` tokens a pass.
    """

    name = "cuda"
    host_memory = False
    quantized_kv = True      # float16, float32 and kv_quant caches
    pass_tokens = PASS_TOKENS

    def __init__(self, cuda_graph: bool = True, prompt_dtype=None):
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
        self._counts = None      # a decode step's attention's counts (int32 zeros)
        self.prompt = PromptOps(torch, self.device, lambda a: self.dev(a, np.int64),
                                prompt_dtype)

    # -- memory ----------------------------------------------------------------------------------

    def dev(self, a, dtype=np.float32):
        """A contiguous device tensor of `a` (host array or tensor) as `dtype`; a host array is
        copied: a small one through pinned memory, so that the copy queues behind the GPU's
        work instead of waiting for it (torch waits out a copy from pageable memory)."""
        t, torch = self._types[np.dtype(dtype)], self.torch
        if isinstance(a, torch.Tensor):
            return a.to(device=self.device, dtype=t).contiguous()
        a = np.ascontiguousarray(a, dtype)
        if SIM or a.nbytes > PINNED_MAX or torch.cuda.is_current_stream_capturing():
            return torch.tensor(a, device=self.device)
        return torch.from_numpy(a).pin_memory().to(self.device, non_blocking=True)

    def empty(self, shape, dtype=np.float32):
        return self.torch.empty(shape, dtype=self._types[np.dtype(dtype)], device=self.device)

    def zeros(self, shape, dtype=np.float32):
        return self.torch.zeros(shape, dtype=self._types[np.dtype(dtype)], device=self.device)

    def to_numpy(self, x) -> np.ndarray:
        """A host copy, of the same dtype (as the reference backend's arrays are)."""
        if isinstance(x, np.ndarray):
            return x
        return x.detach().to("cpu", copy=True).numpy()

    # -- weights ---------------------------------------------------------------------------------

    def prepare_linear(self, parts: list):
        """Quantized layers as one float scale and offset per group and 4- or 8-bit codes,
        float ones as float16 weights: either way the GEMV's layout (gemv.repack). A prompt's
        scratch takes the largest of them."""
        w = self._prepare(parts)
        self.pass_tokens = self.prompt.fit(w)
        return w

    def _prepare(self, parts: list):
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

    def prepare_head(self, table, quantized: bool = False):
        """A 4-bit model's float head as the reference's int8 rows (reference.prepare_head),
        held as 8-bit codes c + 128 with the row's scale s and offset -128 s: half the bytes of
        float16 for the same products; a float model's as float16, a quantized one as stored.
        (Not the prompt's scratch's size: a prompt's logits take the head a block at a time.)"""
        if not quantized or isinstance(table, quant.QuantWeight):
            return self._prepare([table])
        q, s = reference.int8_rows(table)
        n_in = table.shape[1]
        g = chunk(8)                 # groups of the most chunks dividing a row, a power of two
        while n_in % (2 * g) == 0:   # of them (the GEMV's fast path); each the row's scale
            g *= 2
        s = np.repeat(s[:, None], n_in // g, axis=1)
        return self._prepare([quant.make((q.astype(np.int16) + 128).astype(np.uint8), 8,
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
        return self.prompt.linear(x, w)

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

    def _strided(self, x):
        """A float32 device tensor as it is (a kernel reads any strides: a prompt's q, k and v,
        slices of its q|k|v projection, are not copied first), else dev(x)."""
        t = self.torch
        if isinstance(x, t.Tensor) and x.dtype == t.float32 and x.device.type == self.device:
            return x
        return self.dev(x)

    def rope(self, x, cos, sin):
        x = self._strided(x)
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
        slots = self.dev(slots, np.int64)
        if isinstance(k_buf, kv_quant.QuantKV):
            launch_store_kv_q(k_buf, slots, self.dev(k), self.dev(v))
        else:
            launch_store_kv(k_buf, v_buf, slots, self._strided(k), self._strided(v))

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

    def rope_tables(self, inv_freq, positions):
        """reference.rope_tables, on the device (once a pass, not once an op)."""
        return tuple(self.dev(a) for a in reference.rope_tables(inv_freq, positions))

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None, score=None, live=None):
        """One query: flash-decoding over the cache in one launch set (a quantized cache, k a
        QuantKV, read in place); the positions uploaded once, k_pos with its own first dim (one
        table for all heads, or one per head); live: the slots of k_pos read, the first live[0]
        (int64 [1] on the device, which a captured step reads afresh; None: all). More queries
        (a prompt's, q_pos and k_pos on the host): prompt.PromptOps.attention, a quantized
        cache's slots dequantized into float16 first (float32 where the prompt's GEMMs are)."""
        q = self.dev(q)
        T, Q, D = q.shape
        quantized = isinstance(k, kv_quant.QuantKV)
        G, S = (k.where if quantized else k).shape[0], k_pos.shape[-1]
        sc = None if score is None else self.dev(score)
        counts = self._attention_counts(q[:1], G)
        if T > 1:
            if quantized and self.prompt.dtype != self.torch.float32:     # (the fallback's:
                k, v = (a.clamp_(-HALF_MAX, HALF_MAX).half() for a in self._dequantized(k, S))
            elif quantized:                                               # float32 throughout)
                k, v = self._dequantized(k, S)
            k_pos = np.broadcast_to(self.to_numpy(k_pos), (G, S))
            out = self.prompt.attention(q, k, v, self.to_numpy(q_pos), k_pos, scale, window, sc)
        else:
            k_pos = self.dev(k_pos, np.int64).reshape(-1, S)
            sc = self.empty((G, 0)) if sc is None else sc
            out = self.empty((T, Q, D))
            if quantized:
                launch_attention_decode_q(q[0], k, int(q_pos[0]), k_pos.expand(G, S).contiguous(),
                                          scale, window or 0, sc, self.empty((Q, S)), out[0])
            else:
                if live is None:
                    live = self.dev(np.array([S]), np.int64)
                launch_attention(q, k, v, self.dev(q_pos, np.int64), k_pos, live, scale,
                                 window or 0, sc, out, self.empty, counts)
        if score is not None and sc is not score:
            score[...] = self.to_numpy(sc)          # a cache that keeps its scores on the host
        return out

    def _attention_counts(self, q, G: int):
        """launch_attention's counts for one query q [1, Q, D] over G KV heads (zeros, which its
        kernels leave zeros), made at the first attention (a prompt's): so before any decode
        step, whose every tensor a captured graph must find where it was."""
        if self._counts is None:
            self._counts = self.zeros(attention_counts(q, G), np.int32)
        return self._counts


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
