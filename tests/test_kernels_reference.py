"""The NumPy reference ops against independent torch formulations (as HF writes them)."""

import os

import numpy as np
import pytest
import torch

from helpers import seeded_rng, status_kib
from tinyrt.kernels import reference as ref


def test_rmsnorm():
    rng = seeded_rng()
    x, w = rng.standard_normal((5, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    xt = torch.from_numpy(x)
    want = (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + 1e-5)) * torch.from_numpy(w)
    np.testing.assert_allclose(ref.rmsnorm(x, w, 1e-5), want.numpy(), rtol=1e-5, atol=1e-6)


def test_rope_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = seeded_rng()
    T, N, D = 7, 3, 16
    x = rng.standard_normal((T, N, D)).astype(np.float32)
    pos = rng.integers(0, 1000, T)
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    cos, sin = ref.rope_tables(inv, pos)
    ang = torch.from_numpy(np.outer(pos, inv))              # float64: exact angles up to 1000 rad
    emb = torch.cat([ang, ang], -1)
    xt = torch.from_numpy(x).double().transpose(0, 1)[None]  # [1, N, T, D]
    want, _ = apply_rotary_pos_emb(xt, xt, emb.cos()[None], emb.sin()[None])
    np.testing.assert_allclose(ref.rope(x, cos, sin), want[0].transpose(0, 1).numpy(), atol=1e-5)


def test_silu_mul():
    rng = seeded_rng()
    g, u = rng.standard_normal((4, 33)).astype(np.float32), rng.standard_normal((4, 33)).astype(np.float32)
    want = torch.nn.functional.silu(torch.from_numpy(g)) * torch.from_numpy(u)
    np.testing.assert_allclose(ref.silu_mul(g, u), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("Q, G", [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("T, past", [(1, 9), (5, 0), (7, 4)])
def test_attention_matches_sdpa_gqa(Q, G, T, past):
    rng = seeded_rng()
    D, S = 16, past + T
    q = rng.standard_normal((T, Q, D)).astype(np.float32)
    k = rng.standard_normal((G, S, D)).astype(np.float32)
    v = rng.standard_normal((G, S, D)).astype(np.float32)
    q_pos, k_pos = np.arange(past, past + T), np.arange(S)
    got = ref.attention(q, k, v, q_pos, k_pos, D ** -0.5)
    kt = torch.from_numpy(k).repeat_interleave(Q // G, 0)[None]
    vt = torch.from_numpy(v).repeat_interleave(Q // G, 0)[None]
    mask = torch.from_numpy(k_pos[None, :] <= q_pos[:, None])
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).transpose(0, 1)[None], kt, vt, attn_mask=mask)[0].transpose(0, 1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def test_attention_ignores_slot_order_and_free_slots():
    rng = seeded_rng()
    G, Q, S, D = 2, 4, 12, 8
    q = rng.standard_normal((3, Q, D)).astype(np.float32)
    k = rng.standard_normal((G, S, D)).astype(np.float32)
    v = rng.standard_normal((G, S, D)).astype(np.float32)
    k_pos = np.arange(S)
    k_pos[[2, 7]] = -1                                    # free slots
    q_pos = np.array([9, 10, 11])
    perm = rng.permutation(S)                             # a ring buffer holds slots in any order
    a = ref.attention(q, k, v, q_pos, k_pos, 0.3)
    b = ref.attention(q, k[:, perm], v[:, perm], q_pos, k_pos[perm], 0.3)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    keep = k_pos >= 0
    c = ref.attention(q, k[:, keep], v[:, keep], q_pos, k_pos[keep], 0.3)
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_sliding_window():
    rng = seeded_rng()
    G, Q, S, D, W = 1, 2, 10, 8, 4
    q = rng.standard_normal((1, Q, D)).astype(np.float32)
    k = rng.standard_normal((G, S, D)).astype(np.float32)
    v = rng.standard_normal((G, S, D)).astype(np.float32)
    pos = np.arange(S)
    a = ref.attention(q, k, v, np.array([9]), pos, 0.5, window=W)
    b = ref.attention(q, k[:, -W:], v[:, -W:], np.array([9]), pos[-W:], 0.5)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_cache_buffers_cost_memory_only_where_written():
    """A KV-cache-sized buffer (30 layers x 3 heads x 4096 slots x 64, 94 MB) with one token
    written per layer and head costs a few pages per region, not a 2 MB huge page each."""
    buf = ref.ReferenceBackend().zeros((30, 3, 4096, 64))
    assert buf.shape == (30, 3, 4096, 64) and buf.dtype == np.float32 and not buf.any()
    before = status_kib("VmRSS")
    buf[:, :, 0] = 1.0
    assert status_kib("VmRSS") - before < 30 * 3 * 16          # at most 16 KiB per region written
    assert buf.sum() == 30 * 3 * 64
