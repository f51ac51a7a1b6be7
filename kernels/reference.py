"""NumPy reference ops: the definition every fast backend is tested against.

Shapes: T tokens, H hidden, Q query heads, G KV heads (Q = G * R), D head dim, S cache slots.
All activations are float32; weights may be stored as float16 or float32.
"""

from __future__ import annotations

import numpy as np


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table [V, H], ids [T] -> [T, H] float32."""
    return table[ids].astype(np.float32)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [T, H], w [H] -> x / rms(x) * w, in float32 (as HF: normalize, then scale)."""
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * w.astype(np.float32)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in], w [out, in] -> x @ w.T [T, out] float32."""
    return x @ w.T if w.dtype == np.float32 else x @ w.astype(np.float32).T


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
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, elementwise, float32."""
    g = gate.astype(np.float32)
    with np.errstate(over="ignore"):  # exp(-g) -> inf for very negative g gives silu = 0, rightly
        return g / (np.float32(1) + np.exp(-g)) * up


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
              scale: float, window: int | None = None) -> np.ndarray:
    """Grouped-query attention of T queries over S cached keys, for prefill and decode alike.

    q [T, Q, D]; k, v [G, S, D]; q_pos [T] and k_pos [S] are the positions of queries and cached
    tokens (k_pos -1 marks an empty slot). A query sees a key when k_pos <= q_pos (causal) and, with
    a sliding window, q_pos - k_pos < window. Slots may hold positions in any order (a ring buffer).
    Query head h reads KV head h // R. Returns [T, Q, D] float32.
    """
    T, Q, D = q.shape
    G, S, _ = k.shape
    R = Q // G
    qg = q.reshape(T, G, R, D).transpose(1, 2, 0, 3)                 # [G, R, T, D]
    scores = np.matmul(qg, k[:, None].swapaxes(-1, -2)) * np.float32(scale)  # [G, R, T, S]
    visible = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])   # [T, S]
    if window is not None:
        visible &= (q_pos[:, None] - k_pos[None, :]) < window
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p.astype(np.float32), v[:, None])               # [G, R, T, D]
    return out.transpose(2, 0, 1, 3).reshape(T, Q, D).astype(np.float32)


class ReferenceBackend:
    """The ops above behind the backend interface the decoder calls.

    `prepare_*` turn weights as stored into what the ops read (here: float32 arrays); the decoder
    never looks inside a prepared weight.
    """

    name = "reference"

    def zeros(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        # np.zeros maps untouched pages lazily, so a large cache costs memory only as it fills.
        return np.zeros(shape, dtype)

    def prepare_linear(self, parts: list[np.ndarray]) -> np.ndarray:
        """Float weights [out_i, in] -> one float32 [sum(out_i), in] (fused projections)."""
        if len(parts) == 1:
            return np.ascontiguousarray(parts[0], dtype=np.float32)
        return np.concatenate([p.astype(np.float32) for p in parts], axis=0)

    def prepare_vector(self, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def prepare_embedding(self, table: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(table, dtype=np.float32)

    embedding = staticmethod(embedding)
    rope_tables = staticmethod(rope_tables)
    rmsnorm = staticmethod(rmsnorm)
    linear = staticmethod(linear)
    rope = staticmethod(rope)
    silu_mul = staticmethod(silu_mul)
    attention = staticmethod(attention)

    @staticmethod
    def store_kv(k_buf: np.ndarray, v_buf: np.ndarray, slots: np.ndarray,
                 k: np.ndarray, v: np.ndarray) -> None:
        """Write k, v [T, G, D] into the cache buffers [G, S, D] at `slots` [T]."""
        k_buf[:, slots] = k.transpose(1, 0, 2)
        v_buf[:, slots] = v.transpose(1, 0, 2)

    @staticmethod
    def to_numpy(x) -> np.ndarray:
        return x
