"""NumPy reference ops: the definition every fast backend is tested against.

Shapes: T tokens, H hidden, Q query heads, G KV heads (Q = G * R), D head dim, S cache slots.
All activations are float32; weights may be stored as float16 or float32.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from . import kv_quant, quant


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table [V, H], ids [T] -> [T, H] float32."""
    return table[ids].astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [T, H], w [H] -> x / rms(x) * w, in float32 (as HF: normalize, then scale)."""
    x = x.astype(np.float32, copy=False)
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1 / np.sqrt(var + np.float32(eps))) * w.astype(np.float32, copy=False)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in], w [out, in] -> x @ w.T [T, out] float32."""
    return x @ w.T if w.dtype == np.float32 else x @ w.astype(np.float32).T


def int8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: w [out, in] -> q int8 [out, in], s float32 [out] with
    w ~ q * s[:, None], s = max|row| / 127, q = round(w / s) (half to even)."""
    w = w.astype(np.float32, copy=False)
    s = np.abs(w).max(axis=1) / np.float32(127)
    s[s == 0] = 1
    return np.round(w / s[:, None]).astype(np.int8), s.astype(np.float32)


def rope_tables(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """inv_freq [D/2], positions [T] -> cos, sin [T, D/2] float32."""
    ang = np.outer(positions.astype(np.float64), inv_freq.astype(np.float64))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, N, D] by the angles of cos/sin [T, D/2], HF rotate-half layout: element i pairs
    with element i + D/2 (not the interleaved pairs of the original paper)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu(gate) * up with GELU's tanh approximation (HF's gelu_pytorch_tanh): 0.5 g (1 +
    tanh(sqrt(2/pi) (g + 0.044715 g^3))), elementwise, float32."""
    g = np.asarray(gate, np.float32)
    inner = np.float32(math.sqrt(2 / math.pi)) * (g + np.float32(0.044715) * g * g * g)
    return (np.float32(0.5) * g * (np.float32(1) + np.tanh(inner)) * up).astype(np.float32)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise, float32."""
    t = np.negative(gate, dtype=np.float32)
    with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g gives silu = 0, rightly
        np.exp(t, out=t)
    t += 1
    np.divide(gate, t, out=t)
    t *= up
    return t


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
              scale: float, window: int | None = None, score: np.ndarray | None = None) -> np.ndarray:
    """Grouped-query attention of T queries over S cached keys, for prefill and decode alike.

    q [T, Q, D]; k, v [G, S', D] (or k a kv_quant.QuantKV of G rows, read dequantized); q_pos
    [T] are the queries' positions, k_pos [S] or [G, S] the
    positions the cache slots hold (per KV head when the heads keep different tokens; -1 marks
    an empty slot); slots S and beyond (S' >= S, a whole cache buffer) are not read. A query sees
    a key when k_pos <= q_pos (causal) and, with a sliding window, q_pos - k_pos < window. Slots
    may hold positions in any order (a ring buffer). Query head h reads KV head h // R.
    `score` [G, S'], when given, gets each slot's attention weights added, summed over the
    queries and the R query heads of its KV head (H2O's accumulated attention).
    Returns [T, Q, D] float32. A leading batch dimension B on q, k and v ([B, T, Q, D],
    [B, G, S, D]) runs B sequences with the same positions at once.
    """
    if isinstance(k, kv_quant.QuantKV):
        k, v = kv_quant.dequantize(k, k_pos.shape[-1])
    batched = q.ndim == 4
    if not batched:
        q, k, v = q[None], k[None], v[None]
    S = k_pos.shape[-1]
    k, v = k[:, :, :S], v[:, :, :S]
    B, T, Q, D = q.shape
    G = k.shape[1]
    k_pos = np.broadcast_to(k_pos, (G, S))[:, None, None, :]       # [G, 1, 1, S]
    qp = q_pos[:, None]                                              # [T, 1]
    qg = q.reshape(B, T, G, Q // G, D).transpose(0, 2, 3, 1, 4)      # [B, G, R, T, D]
    scores = np.matmul(qg, k[:, :, None].swapaxes(-1, -2))           # [B, G, R, T, S]
    scores *= np.float32(scale)
    visible = (k_pos >= 0) & (k_pos <= qp)                           # [G, 1, T, S]
    if window is not None:
        visible &= (qp - k_pos) < window
    scores += np.where(visible, np.float32(0), np.float32(-np.inf))  # mask added in place
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    if score is not None:
        score[:, :S] += scores.sum(axis=(0, 2, 3))
    out = np.matmul(scores, v[:, :, None])                           # [B, G, R, T, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, Q, D)
    return out if batched else out[0]


def lowest_scored(slot_pos: np.ndarray, score: np.ndarray, first: int, last: int, n: int) -> np.ndarray:
    """H2O's choice of the tokens to evict: in each row (a KV head of a layer) of the slot table
    slot_pos [L, G, C] and the scores [L, G, C], the n slots of lowest score among those holding
    a position in [first, last], lowest score first, ties by lowest slot -> [L, G, n] int64.
    Each row must have n such slots."""
    evictable = (slot_pos >= first) & (slot_pos <= last)
    key = np.where(evictable, score, np.float32(np.inf))
    if n == 1:
        return key.argmin(axis=-1)[..., None]
    return np.argsort(key, axis=-1, kind="stable")[..., :n]


class ReferenceBackend:
    """The ops above behind the backend interface the decoder calls.

    `prepare_*` turn weights as stored into what the ops read (here: float32 arrays); the decoder
    never looks inside a prepared weight.
    """

    name = "reference"
    host_memory = True       # its arrays (weights, KV cache) live in the machine's RAM
    quantized_kv = True      # whether it reads a kv_quant.QuantKV cache
    pass_tokens = None       # the most tokens a forward pass takes (None: as the cache allows)

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A zeroed array whose pages are mapped as they are first written, 4 KiB at a time, so a
        large cache costs memory only as it fills (numpy would ask for 2 MiB huge pages: the first
        token written to each head's region of a KV buffer would take 2 MiB)."""
        count = int(np.prod(shape, dtype=np.int64))
        buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            buf.madvise(mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(buf, dtype, count=count).reshape(shape)

    def prepare_linear(self, parts: list) -> np.ndarray:
        """Weights of projections that share an input -> one float32 [sum(out_i), in]. A part is a
        float array [out_i, in] or a quant.QuantWeight (dequantized here, once, at load)."""
        mats = [quant.dequantize(p) if isinstance(p, quant.QuantWeight) else p for p in parts]
        if len(mats) == 1:
            return np.ascontiguousarray(mats[0], dtype=np.float32)
        return np.concatenate([m.astype(np.float32) for m in mats], axis=0)

    def prepare_head(self, table, quantized: bool = False) -> np.ndarray:
        """The LM head [V, H] (the embedding when tied), or a quant.QuantWeight head as stored.
        A 4-bit model runs its float head as int8 rows (`int8_rows`) on every backend: half the
        bytes of float16 per decoded token, at a measured perplexity cost of well under 1 %
        (benchmarks/head_quality.py)."""
        if not quantized or isinstance(table, quant.QuantWeight):
            return self.prepare_linear([table])
        q, s = int8_rows(table)
        return q.astype(np.float32) * s[:, None]

    def prepare_vector(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def prepare_embedding(self, table):
        """The embedding table [V, H]: an array (float32 here), or a table whose rows are
        dequantized as they are indexed (`table[ids]`), kept as it is."""
        if not isinstance(table, np.ndarray):
            return table
        return np.ascontiguousarray(table, dtype=np.float32)

    def fused_decode(self, layer, tokens: int) -> bool:
        """Whether `decode_layer(x, layer, kv, pos, cos, sin, cfg)` runs this decoder layer
        (models.llama.Layer) for `tokens` tokens after the cache's: the same math as the model
        file's layer in one call; a backend with no fused layer says no, and the decoder calls
        the ops one by one."""
        return False

    embedding = staticmethod(embedding)
    rope_tables = staticmethod(rope_tables)
    rmsnorm = staticmethod(rmsnorm)
    linear = staticmethod(linear)
    rope = staticmethod(rope)

    def gated(self, h, w, gelu: bool):
        """A gated MLP's hidden activations: gelu(gate) * up (Gemma's GeGLU) or silu(gate) * up
        (SwiGLU) of h's projection by w, its fused gate|up weight [2I, H] (gate first)."""
        gu = self.linear(h, w)
        return self.geglu(gu) if gelu else self.swiglu(gu)

    @staticmethod
    def swiglu(gu: np.ndarray) -> np.ndarray:
        """silu(gate) * up of the fused gate/up projection's output gu [T, 2I] (gate first)."""
        I = gu.shape[-1] // 2
        return silu_mul(gu[..., :I], gu[..., I:])

    @staticmethod
    def geglu(gu: np.ndarray) -> np.ndarray:
        """gelu_tanh(gate) * up of the fused gate/up projection's output gu [T, 2I] (Gemma)."""
        I = gu.shape[-1] // 2
        return gelu_tanh_mul(gu[..., :I], gu[..., I:])
    attention = staticmethod(attention)
    lowest_scored = staticmethod(lowest_scored)

    @staticmethod
    def store_kv(k_buf: np.ndarray, v_buf: np.ndarray, slots: np.ndarray,
                 k: np.ndarray, v: np.ndarray) -> None:
        """Write k, v [T, G, D] into the cache buffers [G, S, D], KV head g's rows at its slots
        slots[g] ([G, T]). Into float16 buffers, rounded to nearest and clamped to the finite
        range (no infinities to meet an attention weight of 0); into a quantized cache
        (k_buf a kv_quant.QuantKV, v_buf unused) as kv_quant.store_kv."""
        if isinstance(k_buf, kv_quant.QuantKV):
            return kv_quant.store_kv(k_buf, slots, k, v)
        if k_buf.dtype == np.float16:
            k, v = kv_quant.to_pool(k), kv_quant.to_pool(v)
        for g in range(k_buf.shape[0]):
            k_buf[g, slots[g]] = k[:, g]
            v_buf[g, slots[g]] = v[:, g]

    def read_kv(self, k_buf, v_buf, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots [0, n) of cache buffers [N, S, D] (or of a kv_quant.QuantKV k_buf: its K and V)
        as float32 k, v [N, n, D] on the host."""
        if isinstance(k_buf, kv_quant.QuantKV):
            return kv_quant.dequantize(k_buf, n)
        return (self.to_numpy(k_buf[:, :n]).astype(np.float32),
                self.to_numpy(v_buf[:, :n]).astype(np.float32))

    @staticmethod
    def to_numpy(x) -> np.ndarray:
        return x
