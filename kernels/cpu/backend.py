"""The backend that runs the decoder on the CPU kernels: weights prepared once at load, and
each op routed to its kernel by the number of tokens. Up to SMALL_TOKENS (a decode step, a
draft's verification) layers run as GEMVs that read each weight once for all the tokens, and
attention as decode attention per token; above (a prompt), quantized layers run as GEMMs and
attention as BLAS matmuls. A float LM head of a quantized model is held as int8 rows."""

from __future__ import annotations

import threading

import numba
import numpy as np

from .. import kv_quant, quant, reference
from . import cores, kv, simd
from .attention import (attention_decode, attention_decode_q, attention_prompt, lowest_scored,
                        store_kv)
from .layer import decode_layer, decode_layer_q
from .linear import (Int8Rows, QLinear, gemv_rows, int8_dequantize, q_gemm, q_gemv,
                     quantize_int8_rows, repack)
from .ops import gated, rmsnorm, rope

SMALL_TOKENS = 16        # up to this many tokens, layers run as GEMVs and attention as decode
                         # attention per token; above, quantized layers run as GEMMs (q_gemm)
DEQUANT_TILE_BYTES = 8 << 20   # an int8 head's dequantized tile in a prompt's GEMM

_NO_SCORES = np.zeros((1, 0), np.float32)
_NO_SCALES = np.zeros(0, np.float32)          # gemv_rows of float weights

# The thread counts last set: Numba's is each thread's own (get_num_threads costs a microsecond,
# and a token reads the count ~35 times), BLAS's the process's; and the process's measures of the
# free cores, by the most threads asked for.
_numba_threads = threading.local()
_SET = {"blas": None}
_CORES: dict[int, cores.Cores] = {}


def _scores(score):
    """An H2O score table [G, S] for the kernels, or an empty one: keep none."""
    return _NO_SCORES if score is None else score


def _bits(buf: np.ndarray) -> np.ndarray:
    """A KV buffer as the kernels take it: float16 as its uint16 bits (Numba's CPU target has no
    float16), float32 as it is."""
    return buf.view(np.uint16) if buf.dtype == np.float16 else buf


def _quant_arrays(store: kv_quant.QuantKV) -> tuple:
    """A quantized cache's arrays as the kernels take them (_bits), and its pinned blocks."""
    return tuple(_bits(a) for a in store[:-1]) + (store.pin,)


class CpuBackend(reference.ReferenceBackend):
    """The decoder's ops on this package's Numba kernels. Prepared weights: QLinear for quantized
    projections, Int8Rows for the LM head, float32 [out, in] arrays for float projections."""

    name = "cpu"

    def __init__(self, threads: int | None = None):
        from threadpoolctl import ThreadpoolController

        # at most `threads` (default: Numba's pool, a thread per CPU), fewer while other programs
        # keep cores busy: one measure for the process (a draft model's backend shares it)
        most = threads or numba.config.NUMBA_NUM_THREADS
        if most not in _CORES:
            _CORES[most] = cores.Cores(most)
        self.cores = _CORES[most]
        self._fixed = None
        self._scratch = np.empty(0, np.float32)
        self._blas = ThreadpoolController()

    @property
    def threads(self) -> int:
        """The threads the next kernel runs on (kernels.cores), set for it: Numba's count is the
        calling thread's own, and BLAS's the process's."""
        n = self._fixed or self.cores.threads()
        pool = min(n, numba.config.NUMBA_NUM_THREADS)
        if getattr(_numba_threads, "n", None) != pool:
            numba.set_num_threads(pool)
            _numba_threads.n = pool
        if _SET["blas"] != pool:
            self._blas.limit(limits=pool, user_api="blas")
            _SET["blas"] = pool
        return n

    @threads.setter
    def threads(self, n: int) -> None:
        """A fixed count of tasks for the kernels to split their work into (a test of the
        split), whatever the machine's load; Numba's threads are at most its pool."""
        self._fixed = n

    def _one_blas_thread(self):
        """A context in which BLAS runs on one thread, for its calls between the parallel Numba
        kernels of a quantized model's prompt (attention, an int8 head): BLAS workers spin for
        a while after each call before they sleep, and spinning on the cores the next Numba
        kernel runs on, they slow it several times over."""
        return self._blas.limit(limits=1, user_api="blas")

    def warm_up(self, layers: list) -> tuple[list, tuple[int, ...]]:
        """What to run once at load so that every kernel a reply calls is compiled (or read
        from Numba's cache) before any timing: (layers, token counts of the forward passes).
        Numba compiles a kernel once per set of argument types, so one layer of each kind of
        weights (float16 or float32 scales, quantized or float, ...) and a pass of each path
        (a prompt's GEMMs, a token's fused layer) compile them all."""
        kinds = {}
        for layer in layers:
            key = tuple(numba.typeof(w) for w in vars(layer).values())
            kinds.setdefault(key, layer)
        return list(kinds.values()), (SMALL_TOKENS + 1, 1)

    def prepare_linear(self, parts: list):
        if all(isinstance(p, quant.QuantWeight) for p in parts):
            _ = self.threads               # (the count repack's prange runs on)
            return repack(parts)
        return super().prepare_linear(parts)

    def prepare_head(self, table, quantized: bool = False):
        # the same int8 rows as the reference (see ReferenceBackend.prepare_head), read as int8
        if not quantized or isinstance(table, quant.QuantWeight):
            return self.prepare_linear([table])
        return quantize_int8_rows(table)

    def prepare_embedding(self, table: np.ndarray) -> np.ndarray:
        return table          # looked up a few rows at a time: stays as stored (mmap, f16 or f32)

    def _int8_prompt(self, x: np.ndarray, w: Int8Rows) -> np.ndarray:
        """x [T, in] @ W.T for a prompt and an int8 head: W dequantized a tile of columns at a
        time into a scratch buffer of at most DEQUANT_TILE_BYTES, each tile one BLAS GEMM, so
        that the buffer stays small (the default model's whole head would take 113 MB)."""
        n_out, n_in = w.shape
        cols = max(simd.LANES, DEQUANT_TILE_BYTES // (4 * n_in) // simd.LANES * simd.LANES)
        if self._scratch.size < n_in * cols:
            self._scratch = np.empty(n_in * cols, np.float32)
        tiles = []
        for c0 in range(0, n_out, cols):
            c1 = min(n_out, c0 + cols)
            dst = self._scratch[:n_in * (c1 - c0)].reshape(n_in, c1 - c0)
            int8_dequantize(w.q, w.s, c0, c1, dst)
            with self._one_blas_thread():
                tiles.append(x @ dst)
        return tiles[0] if len(tiles) == 1 else np.concatenate(tiles, axis=1)

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        if isinstance(w, np.ndarray):
            if T > SMALL_TOKENS or w.dtype != np.float32:
                return reference.linear(x, w)
            y = np.empty((T, w.shape[0]), np.float32)
            gemv_rows(x, w, _NO_SCALES, y, self.threads)
            return y
        if isinstance(w, Int8Rows):
            if T > SMALL_TOKENS:
                return self._int8_prompt(x, w)
            y = np.empty((T, w.shape[0]), np.float32)
            gemv_rows(x, w.q, w.s, y, self.threads)
            return y
        y = np.empty((T, w.shape[0]), np.float32)
        (q_gemm if T > SMALL_TOKENS else q_gemv)(x, w, y, self.threads)
        return y

    def fused_decode(self, layer, tokens: int) -> bool:
        return tokens <= SMALL_TOKENS and all(
            isinstance(w, QLinear) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def decode_layer(self, x, layer, kv, pos, cos, sin, cfg, window):
        """A few tokens x [T, H] through decoder layer `layer` (models.llama.Layer) over the
        cache layer `kv` (kv_cache.LayerView), for a model of config `cfg`, its attention
        within `window` (None: all it holds) (the kernel decode_layer)."""
        x = np.array(x, np.float32)
        bias, q_norm, k_norm, attn_out, mlp_out = (
            _NO_SCALES if w is None else w for w in (layer.qkv_bias, layer.q_norm, layer.k_norm,
                                                     layer.attn_out_norm, layer.mlp_out_norm))
        weights = (x, layer.input_norm, layer.post_norm, np.float32(cfg.rms_norm_eps), layer.qkv,
                   bias, q_norm, k_norm, layer.o, layer.gate_up, layer.down, attn_out, mlp_out,
                   cfg.geglu)
        rest = (kv.slots, np.ascontiguousarray(pos, np.int64), kv.k_pos, _scores(kv.score), cos,
                sin, cfg.num_attention_heads, np.float32(cfg.attention_scale), window or 0,
                self.threads)
        if isinstance(kv.k, kv_quant.QuantKV):
            decode_layer_q(*weights, *_quant_arrays(kv.k), *rest)
        else:
            decode_layer(*weights, _bits(kv.k), _bits(kv.v), *rest)
        return x

    def rmsnorm(self, x, w, eps):
        return rmsnorm(np.ascontiguousarray(x, dtype=np.float32), w, eps)

    def rope(self, x, cos, sin):
        return rope(x, cos, sin)

    def swiglu(self, gu):
        return gated(np.ascontiguousarray(gu, dtype=np.float32), False)

    def geglu(self, gu):
        return gated(np.ascontiguousarray(gu, dtype=np.float32), True)

    def attention(self, q, k, v, q_pos, k_pos, scale, window=None, score=None):
        if q.ndim == 4:
            return reference.attention(q, k, v, q_pos, k_pos, scale, window, score)
        # [G, S], writable (a read-only array would compile, and round, apart)
        quantized = isinstance(k, kv_quant.QuantKV)
        G = k.where.shape[0] if quantized else k.shape[0]
        k_pos = np.ascontiguousarray(k_pos if k_pos.ndim == 2 else np.tile(k_pos, (G, 1)))
        if quantized and q.shape[0] <= SMALL_TOKENS:
            return attention_decode_q(np.ascontiguousarray(q, np.float32), *_quant_arrays(k)[:7],
                                      np.ascontiguousarray(q_pos, np.int64), k_pos,
                                      np.float32(scale), window or 0, self.threads, _scores(score))
        if quantized:          # a prompt: BLAS over a float32 copy, as of a float16 cache
            k, v = self.read_kv(k, None, k_pos.shape[1])
        if q.shape[0] > SMALL_TOKENS:
            with self._one_blas_thread():
                return attention_prompt(q, k, v, q_pos, k_pos, scale, window, score)
        # a few tokens (a draft's verification): decode attention, each query as if alone, the
        # later tokens' slots hidden by the causal mask; no BLAS call, whose spinning threads
        # would slow the Numba kernels around it
        return attention_decode(np.ascontiguousarray(q, np.float32), _bits(k), _bits(v),
                                np.ascontiguousarray(q_pos, np.int64), k_pos, np.float32(scale),
                                window or 0, self.threads, _scores(score))

    lowest_scored = staticmethod(lowest_scored)

    def read_kv(self, k_buf, v_buf, n):
        if not isinstance(k_buf, kv_quant.QuantKV):
            return super().read_kv(k_buf, v_buf, n)
        N, D = k_buf.where.shape[0], k_buf.head_dim
        k, v = np.empty((N, n, D), np.float32), np.empty((N, n, D), np.float32)
        kv.dequantize(*_quant_arrays(k_buf)[:7], n, k, v)
        return k, v

    def store_kv(self, k_buf, v_buf, slots, k, v):
        if isinstance(k_buf, kv_quant.QuantKV):
            return kv.store_kv(*_quant_arrays(k_buf), slots, np.ascontiguousarray(k, np.float32),
                                   np.ascontiguousarray(v, np.float32))
        store_kv(_bits(k_buf), _bits(v_buf), slots, np.ascontiguousarray(k, np.float32),
                 np.ascontiguousarray(v, np.float32))
