"""One decoder layer for a few tokens in one Numba call (decode_layer): the ops of the model
file's layer, so that the cost of a call from Python is paid once per layer, not per op."""

from __future__ import annotations

import numpy as np
from numba import njit

from . import kv
from .attention import attention_decode, attention_decode_q, store_kv
from .linear import q_gemv
from .ops import gated, rmsnorm, rope


@njit(fastmath=True, cache=True)
def _layer_qkv(x, in_norm, eps, qkv, qkv_b, q_norm, k_norm, cos, sin, n_heads, G, D, threads):
    """decode_layer's first part: the tokens' q [T, Q, D], k and v [T, G, D], each head's q and
    k RMS-normed where q_norm, k_norm [D] are not empty, RoPE applied."""
    T = x.shape[0]
    Qd, Gd = n_heads * D, G * D
    qkv_out = np.empty((T, Qd + 2 * Gd), np.float32)
    q_gemv(rmsnorm(x, in_norm, eps), qkv, qkv_out, threads)
    if qkv_b.shape[0]:
        # (element by element: a row += an array compiles Numba's shape-mismatch message,
        # string formatting that was a fifth of a cold start's compiling)
        for t in range(T):
            for j in range(qkv_b.shape[0]):
                qkv_out[t, j] += qkv_b[j]
    q = np.ascontiguousarray(qkv_out[:, :Qd]).reshape(T * n_heads, D)
    k = np.ascontiguousarray(qkv_out[:, Qd:Qd + Gd]).reshape(T * G, D)
    if q_norm.shape[0]:
        q, k = rmsnorm(q, q_norm, eps), rmsnorm(k, k_norm, eps)
    q = rope(q.reshape(T, n_heads, D), cos, sin)
    k = rope(k.reshape(T, G, D), cos, sin)
    return q, k, np.ascontiguousarray(qkv_out[:, Qd + Gd:]).reshape(T, G, D)


@njit(fastmath=True, cache=True)
def _layer_rest(x, a, post_norm, eps, o, gate_up, down, attn_out_norm, mlp_out_norm, gelu,
                threads):
    """decode_layer's last part, from the attention's output a [T, Q, D]: x updated in place.
    attn_out_norm, mlp_out_norm [H]: the norms of the attention's and the MLP's outputs before
    they are added (Gemma 3), or empty: none; `gelu`: GeGLU, else SwiGLU."""
    T, H = x.shape
    y = np.empty((T, H), np.float32)
    q_gemv(a.reshape(T, a.shape[1] * a.shape[2]), o, y, threads)
    x += rmsnorm(y, attn_out_norm, eps) if attn_out_norm.shape[0] else y
    n_inner = down.lo.shape[1] * 8
    gu = np.empty((T, 2 * n_inner), np.float32)
    q_gemv(rmsnorm(x, post_norm, eps), gate_up, gu, threads)
    q_gemv(gated(gu, gelu), down, y, threads)
    x += rmsnorm(y, mlp_out_norm, eps) if mlp_out_norm.shape[0] else y


@njit(fastmath=True, cache=True)
def decode_layer(x, in_norm, post_norm, eps, qkv, qkv_b, q_norm, k_norm, o, gate_up, down,
                 attn_out_norm, mlp_out_norm, gelu, k_buf, v_buf, slots, pos, k_pos, score, cos,
                 sin, n_heads, scale, window, threads):
    """A few tokens x [T, H] (a decode step, a draft's verification) through one decoder layer
    of quantized linears (QLinear: qkv, o, gate_up, down), in place; their K/V go to `slots`
    [G, T] of the cache buffers k_buf, v_buf [G, S, D] (k_pos [G, S] already holds their
    positions `pos` [T]; score as for attention_decode); qkv_b [(Q+2G)*D] the q/k/v biases, or
    empty: none; q_norm, k_norm [D] the per-head norms of q and k, or empty: none; the output
    norms and `gelu` as for _layer_rest. The ops of the model file's layer (models.llama
    LlamaModel.layer) in a single call, so the costs of a call from Python are paid once per
    layer; each token's result is the one it gets alone, to the bit."""
    q, k, v = _layer_qkv(x, in_norm, eps, qkv, qkv_b, q_norm, k_norm, cos, sin, n_heads,
                         k_buf.shape[0], k_buf.shape[2], threads)
    store_kv(k_buf, v_buf, slots, k, v)
    a = attention_decode(q, k_buf, v_buf, pos, k_pos, scale, window, threads, score)
    _layer_rest(x, a, post_norm, eps, o, gate_up, down, attn_out_norm, mlp_out_norm, gelu,
                threads)


@njit(fastmath=True, cache=True)
def decode_layer_q(x, in_norm, post_norm, eps, qkv, qkv_b, q_norm, k_norm, o, gate_up, down,
                   attn_out_norm, mlp_out_norm, gelu, kc, ks, vc, vs, fk, fv, where, owner, stamp,
                   pin, slots, pos, k_pos, score, cos, sin, n_heads, scale, window, threads):
    """decode_layer over a quantized cache (kernels.kv_quant's arrays, float16 ones as uint16
    bits)."""
    q, k, v = _layer_qkv(x, in_norm, eps, qkv, qkv_b, q_norm, k_norm, cos, sin, n_heads,
                         where.shape[0], fk.shape[3], threads)
    kv.store_kv(kc, ks, vc, vs, fk, fv, where, owner, stamp, pin, slots, k, v)
    a = attention_decode_q(q, kc, ks, vc, vs, fk, fv, where, pos, k_pos, scale, window, threads,
                           score)
    _layer_rest(x, a, post_norm, eps, o, gate_up, down, attn_out_norm, mlp_out_norm, gelu,
                threads)
