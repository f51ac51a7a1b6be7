"""A pass of more than one token on the GPU (a prompt, a draft's check): its GEMMs on the tensor
cores and its attention through torch's fused kernels (`PromptOps`).

A decode step reads every weight once for one token (gemv.py: memory-bound); a pass of T tokens
does T times the arithmetic on the same bytes, which only the tensor cores keep up with, as
vLLM's and AutoAWQ's W4A16 prompt paths do: each layer is dequantized into one reusable 16-bit
scratch (gemv.q_dequantize) and multiplied by cuBLAS through torch, and the causal attention
over the cache runs in torch's scaled_dot_product_attention (flash or memory-efficient).

The numbers (docs/GPU.md states the contract the tests hold):
- bfloat16 operands where the GPU multiplies them natively (compute capability 8 and later:
  Jetson Orin, RTX 30/40, A100, H100, H200): no overflow, 8 bits of mantissa;
- float16 ones before that (Turing), each row of x scaled by a power of two so that it stays
  under 2**14 (activations past 65504 do occur: exact, as the scale is undone on the sums);
- sums in float32, and a float32 product (torch.mm's out_dtype) where torch has it; where it
  has not, bfloat16's product rounded, and float32 operands instead of float16 ones;
- attention in the cache's precision (float16: its keys and values as stored, the queries
  clamped to float16's range; float32), scores and softmax in float32 inside the kernel.
"""

from __future__ import annotations

import numpy as np

from .launchers import launch_dequantize
from .primitives import HALF_MAX

PASS_TOKENS = 4096         # the most tokens of one pass: activations and masks stay bounded,
PASS_BYTES = 512 << 20     # the widest activation (float32, gate|up's) to at most this
SCORES_BYTES = 64 << 20    # float32 attention weights a block of queries keeps (H2O's scores)
X16_TOP = 2.0 ** 14        # float16 operands are scaled under this (products' sums in float32)


def _out_f32(torch, device: str, dtype) -> bool:
    """Whether torch multiplies `dtype` matrices into a float32 product on `device`, as
    PromptOps.mm calls it (the second operand transposed; batches too)."""
    if device == "cpu":
        return False
    try:
        a = torch.zeros((2, 8, 16), dtype=dtype, device=device)
        return torch.mm(a[0], a[1].t(), out_dtype=torch.float32).dtype == torch.float32 and \
            torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


class PromptOps:
    """The prompt's GEMMs and attention on torch tensors of `device` ("cuda"; "cpu" in Numba's
    CUDA simulator, where torch's CPU kernels stand in for cuBLAS and the fused attention).
    `dtype`: the GEMMs' operands, a torch dtype (None: as the GPU allows, see above); up(a): a
    host array of positions as an int64 tensor on the device."""

    def __init__(self, torch, device: str, up, dtype=None):
        self.torch, self.device, self.up = torch, device, up
        if dtype is None:
            if device == "cpu" or torch.cuda.get_device_capability()[0] >= 8:
                dtype = torch.bfloat16
            elif _out_f32(torch, device, torch.float16):
                dtype = torch.float16
            else:
                dtype = torch.float32
        self.dtype = dtype
        self.out_f32 = dtype != torch.float32 and _out_f32(torch, device, dtype)
        self.largest = 0            # elements of the largest layer (its scratch), set at load
        self.widest = 1             # outputs of the widest layer
        self.scratch = None

    def fit(self, w) -> int:
        """Take layer w (a GpuQuant) into the scratch's size; the tokens of a pass from now on:
        PASS_TOKENS, fewer (a multiple of 256) where the widest layer's float32 product would
        pass PASS_BYTES."""
        self.largest = max(self.largest, w.shape[0] * w.shape[1])
        self.widest = max(self.widest, w.shape[0])
        return max(256, min(PASS_TOKENS, PASS_BYTES // (4 * self.widest) // 256 * 256))

    # -- GEMMs ----------------------------------------------------------------------------------

    def mm(self, a, b):
        """a @ b in float32, of 16-bit (or float32) operands: a [M, K] and b [K, N], or batches
        of them ([B, M, K], [B, K, N])."""
        t = self.torch
        if a.dtype == t.float32:
            return a @ b
        mm = t.mm if a.dim() == 2 else t.bmm
        if self.out_f32:
            return mm(a, b, out_dtype=t.float32)
        if self.device == "cpu":      # (the simulator: cuBLAS's float32 sums of 16-bit products)
            return mm(a.float(), b.float())
        return mm(a, b).float()        # (bfloat16 only: float16 needs out_dtype, see __init__)

    def operand(self, x):
        """x [T, K] float32 as the GEMM's operand, and the factor per row to multiply its
        product by (None: none): float16 rows past X16_TOP scaled down by a power of two."""
        t = self.torch
        if self.dtype != t.float16:
            return x.to(self.dtype), None
        big = x.abs().amax(dim=1, keepdim=True)
        s = t.exp2(t.ceil(t.log2(big / X16_TOP)).clamp_(min=0))
        return (x / s).to(t.float16), s

    def linear(self, x, w):
        """x [T, in] float32 @ W.T -> [T, out] float32, W a GpuQuant (gemv.py) dequantized into
        the scratch: a layer at once, a larger one (the LM head) a block of its rows at a time."""
        t = self.torch
        out, n_in = w.shape
        x16, s = self.operand(x)
        rows = min(out, max(1, self.largest // n_in))
        if self.scratch is None or self.scratch.numel() < rows * n_in:
            self.scratch = None        # (freed before the larger one is taken)
            self.scratch = t.empty(max(self.largest, rows * n_in), dtype=self.dtype,
                                   device=self.device)
        y = None if rows == out else t.empty((x.shape[0], out), device=self.device)
        for r0 in range(0, out, rows):
            r = min(rows, out - r0)
            wr = self.scratch[:r * n_in].view(r, n_in)
            launch_dequantize(w, wr.view(t.int16) if self.dtype == t.bfloat16 else wr, r0)
            part = self.mm(x16, wr.t())
            if y is None:
                y = part
            else:
                y[:, r0:r0 + r] = part
        return y if s is None else y * s

    # -- attention ------------------------------------------------------------------------------

    def attention(self, q, k, v, q_pos: np.ndarray, k_pos: np.ndarray, scale: float,
                  window: int | None, score=None):
        """reference.attention of T queries q [T, Q, D] (float32) over the float cache k, v
        [G, C, D] whose slots [0, S) hold positions k_pos [G, S] (host int64), at positions
        q_pos [T] (host): in the cache's precision, score [G, C] (float32, on the device; H2O)
        getting each slot's weights added. Slots in position order ending at the queries (a
        cache filled in order, no window cutting them): flash attention's causal mask; others,
        the mask of positions; per-head tables or scores: blocks of queries (_blocked)."""
        t = self.torch
        T, Q, D = q.shape
        G, S = k.shape[0], k_pos.shape[-1]
        k, v = k[:, :S], v[:, :S]
        q = q * scale
        if k.dtype == t.float16:         # (the cache's keys are clamped so when stored)
            q = q.clamp_(-HALF_MAX, HALF_MAX)
        q = q.to(k.dtype).transpose(0, 1)                                  # [Q, T, D]
        rows = k_pos[0]
        if score is not None or not (k_pos == rows).all():
            return self._blocked(q, k, v, q_pos, k_pos, window, score)
        if Q > G:                        # (the fused kernels with a mask take no GQA)
            k, v = k.repeat_interleave(Q // G, 0), v.repeat_interleave(Q // G, 0)
        out = self.fused(q, k, v, self._causal(rows, q_pos, window, k.dtype))
        return out.transpose(0, 1).to(t.float32, memory_format=t.contiguous_format)

    def fused(self, q, k, v, mask):
        """torch's scaled_dot_product_attention of q [Q, T, D] over k, v [Q, S, D] (prescaled q),
        `mask` a CausalBias or a float mask [T, S]."""
        return self.torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=1.0)[0]

    def _causal(self, rows: np.ndarray, q_pos: np.ndarray, window: int | None, dtype):
        """What keys each query sees: flash attention's lower-right causal mask where the slots
        hold positions rows[0], rows[0] + 1, ... and the queries are the last of them (no
        window cutting them), else a mask [T, S] of `dtype` (0 seen, -inf not) of the positions."""
        t = self.torch
        from torch.nn.attention.bias import causal_lower_right

        T, S = len(q_pos), len(rows)
        if T <= S and rows[0] >= 0 and np.array_equal(rows, np.arange(rows[0], rows[0] + S)) \
                and np.array_equal(q_pos, rows[S - T:]) and (not window or S <= window):
            return causal_lower_right(T, S)
        seen = self._seen(self.up(rows), self.up(q_pos)[:, None], window)
        # (rows of a multiple of 8 elements: the memory-efficient kernel's alignment)
        mask = t.full((T, -(-S // 8) * 8), -float("inf"), dtype=dtype, device=self.device)[:, :S]
        return mask.masked_fill_(seen, 0)

    @staticmethod
    def _seen(k_pos, qp, window: int | None):
        """Whether query t sees slot s: [..., T, S] bool of k_pos [..., 1, S] and the queries'
        positions qp [T, 1], on the device."""
        seen = (k_pos >= 0) & (k_pos <= qp)
        return seen & (qp - k_pos < window) if window else seen

    def _blocked(self, q, k, v, q_pos, k_pos, window, score):
        """Attention of q [Q, T, D] (the cache's type) with each KV head's own slot table k_pos
        [G, S] (H2O), score getting the weights' sums: queries in blocks whose float32 weights
        [Q, block, S] stay under SCORES_BYTES (never T x S at once), each block's products
        16-bit operands into float32 sums (mm), its softmax in float32."""
        t = self.torch
        Q, T, D = q.shape
        G, S = k.shape[0], k.shape[1]
        R = Q // G
        kp, qp = self.up(k_pos)[:, None, None], self.up(q_pos)[:, None]
        kt = k.transpose(1, 2)
        out = t.empty((Q, T, D), device=self.device)
        n = max(1, SCORES_BYTES // (4 * Q * S))
        for a in range(0, T, n):
            b = min(T, a + n)
            qb = q[:, a:b].reshape(G, R * (b - a), D)
            w = self.mm(qb, kt).view(G, R, b - a, S)
            w.masked_fill_(~self._seen(kp, qp[a:b], window), -float("inf"))
            w = t.softmax(w, dim=-1)
            if score is not None:
                score[:, :S] += w.sum(dim=(1, 2))
            out[:, a:b] = self.mm(w.view(G, R * (b - a), S).to(k.dtype), v).view(Q, b - a, D)
        return out.transpose(0, 1).contiguous()
