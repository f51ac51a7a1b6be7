"""AWQ: activation-aware weight quantization (Lin et al., MLSys 2024), one decoder layer at a time.

For each layer, on the calibration activations that reach it:

1. Run the float layer, keeping the inputs of its linear groups.
2. For each group of linears that reads the same input, search s = mean|x|^a (or the duo form
   mean|x|^a / mean|w|^(1-a)), a on a grid of 20, normalized so that max(s) * min(s) = 1, that
   minimizes the MSE of the group's module output when the weights W * s are quantized (and the
   input divided by s). The groups and where 1/s is folded:
     q, k, v -> input_layernorm (loss on the attention block's output)
     o       -> v_proj rows, only where v_proj and o_proj have the same shape (not with GQA)
     gate, up-> post_attention_layernorm (loss on the MLP's output)
     down    -> up_proj rows
3. Search per group of weights the clipping range max|w| * (1 - i/20), i < 10, that minimizes the
   MSE of the group's partial outputs (q and k excluded: their errors are amplified by the dot
   products of attention).
4. Quantize: asymmetric 4-bit codes with a zero point per group (converters.quantize).
5. Run the quantized layer to make the next layer's input, so later layers calibrate against the
   errors of earlier ones.

Only one layer's weights and activations are held at a time; the peak above the interpreter's is
about  calibration tokens x 4 (8 H + 4 I)  +  three float32 copies of one layer  +  two float32
copies of the embedding  bytes (`peak_bytes`). Measured for SmolLM2-135M (H 576, I 1536): 582, 652
and 879 MB at 2k, 4k and 8k calibration tokens; the formula gives 356, 444 and 620 MB above a
~230 MB interpreter with numpy, tokenizers and the GGUF reader. For a Llama-2-7B shape (H 4096,
I 11008, vocab 32000) at 2k tokens: 0.63 + 2.4 + 1.0 GB, about 4 GB: a 16 GB machine is enough.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from tinyrt.kernels import reference as ops
from tinyrt.models.config import LlamaConfig
from tinyrt.models.rope import rope_inv_freq

from .quantize import fake_quantize, pack_linear

LossFn = Callable[[list[np.ndarray]], float]
ATTN_BLOCK = 128  # queries per block in calibration attention


@dataclass(frozen=True)
class QuantOptions:
    method: str = "awq"          # "awq" or "rtn" (round to nearest, no search)
    group_size: int = 128
    bits: int = 4
    clip: bool = True            # AWQ's clipping search
    duo_scaling: bool = True     # s = mean|x|^a / mean|w|^(1-a) instead of mean|x|^a
    n_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512       # tokens sampled for the clipping search
    propagate_quantized: bool = True  # next layer's input: the quantized layer's output (else float)


def peak_bytes(cfg: LlamaConfig, n_tokens: int) -> int:
    """Estimated peak of the calibration above the interpreter's (see the module docstring)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    layer = 2 * cfg.q_size * H + 2 * cfg.kv_size * H + 3 * H * I
    return 4 * (n_tokens * (8 * H + 4 * I) + 3 * layer + 2 * cfg.vocab_size * H)


# -- the float layer, batched over calibration sequences ---------------------------------------

Layer = dict  # one decoder layer's float32 weights: norms and linears [out, in] by short name


def attention(cfg: LlamaConfig, xn: np.ndarray, wq, wk, wv, wo, cos, sin):
    """xn [N, T, H] (normed) -> (o_proj input [N, T, Q*D], attention block output [N, T, H])."""
    N, T, H = xn.shape
    Q, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    flat = xn.reshape(N * T, H)
    q = ops.rope((flat @ wq.T).reshape(N, T, Q, D), cos, sin)
    k = ops.rope((flat @ wk.T).reshape(N, T, G, D), cos, sin).transpose(0, 2, 1, 3)
    v = (flat @ wv.T).reshape(N, T, G, D).transpose(0, 2, 1, 3)
    pos = np.arange(T)
    a = np.empty((N, T, Q, D), np.float32)
    for b in range(0, T, ATTN_BLOCK):  # a block of queries sees only the keys up to its end
        e = min(b + ATTN_BLOCK, T)
        a[:, b:e] = ops.attention(q[:, b:e], k[:, :, :e], v[:, :, :e], pos[b:e], pos[:e],
                                  D ** -0.5, cfg.sliding_window)
    a = a.reshape(N * T, Q * D)
    return a.reshape(N, T, Q * D), (a @ wo.T).reshape(N, T, H)


def mlp(xn: np.ndarray, wg, wu, wd):
    """xn [N, T, H] -> (down_proj input [N, T, I], MLP output [N, T, H])."""
    N, T, H = xn.shape
    flat = xn.reshape(N * T, H)
    act = ops.silu_mul(flat @ wg.T, flat @ wu.T)
    return act.reshape(N, T, -1), (act @ wd.T).reshape(N, T, H)


def layer_forward(cfg: LlamaConfig, x: np.ndarray, L: Layer, cos, sin) -> np.ndarray:
    eps = cfg.rms_norm_eps
    _, attn = attention(cfg, ops.rmsnorm(x, L["input_norm"], eps), L["q"], L["k"], L["v"], L["o"],
                        cos, sin)
    h = x + attn
    _, out = mlp(ops.rmsnorm(h, L["post_norm"], eps), L["gate"], L["up"], L["down"])
    return h + out


# -- searches ------------------------------------------------------------------------------------

def search_scales(x: np.ndarray, linears: list[np.ndarray], loss: LossFn,
                  opts: QuantOptions) -> np.ndarray:
    """The per-input-channel scales s [in] of a group of linears sharing the input x [n, in]:
    the grid point whose quantized weights W*s (inputs x/s) give the smallest `loss`."""
    g = opts.group_size
    x_mean = np.abs(x).mean(axis=0, dtype=np.float64)
    w = np.abs(np.concatenate(linears, axis=0)).reshape(-1, g)
    w_mean = (w / (w.max(axis=1, keepdims=True) + 1e-6)).reshape(-1, x.shape[1]).mean(axis=0)
    best, best_loss = np.ones(x.shape[1], np.float32), np.inf
    for i in range(opts.n_grid):
        a = i / opts.n_grid
        s = x_mean ** a / (w_mean ** (1 - a) + 1e-4) if opts.duo_scaling else x_mean ** a
        s = np.maximum(s, 1e-4)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        cur = loss([fake_quantize(W * s, g, opts.bits) / s for W in linears])
        if cur < best_loss:
            best, best_loss = s, cur
    return best


def output_mse(forward: Callable[[list[np.ndarray]], np.ndarray], reference: np.ndarray) -> LossFn:
    """Loss: MSE of a module's output against its float output."""
    return lambda W: float(np.mean(np.square(forward(W) - reference, dtype=np.float32)))


def linear_mse(x: np.ndarray, w: np.ndarray) -> LossFn:
    """Loss: MSE of x @ W'.T against x @ w.T, exactly, through the Gram matrix of x:
    mean((x dW.T)^2) = sum((dW G) * dW) / (n out) with G = x.T x. Costs out*in^2, not n*in*out."""
    gram = (x.T.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
    n = x.shape[0] * w.shape[0]
    return lambda W: float(np.sum((W[0] - w) @ gram * (W[0] - w)) / n)


def search_clip(x: np.ndarray, w: np.ndarray, opts: QuantOptions) -> np.ndarray:
    """Clipping thresholds [out, in/g] for w [out, in] with inputs x [n, in]: per group of
    weights, the shrink of max|w| whose quantized partial outputs best match the float ones."""
    g = opts.group_size
    out_f, in_f = w.shape
    step = max(1, x.shape[0] // opts.clip_tokens)
    xg = x[::step].reshape(-1, in_f // g, g).transpose(1, 2, 0)          # [groups, g, tokens]
    wg = w.reshape(out_f, in_f // g, g).transpose(1, 0, 2)               # [groups, out, g]
    ref = wg @ xg                                                        # [groups, out, tokens]
    org_max = np.abs(wg).max(axis=2, keepdims=True)                      # [groups, out, 1]
    best_max, best_err = org_max.copy(), np.full(org_max.shape, np.inf, np.float32)
    for i in range(int(opts.max_shrink * opts.n_grid)):
        max_val = org_max * (1 - i / opts.n_grid)
        cur = np.clip(wg, -max_val, max_val)
        q = fake_quantize(cur.reshape(-1, g), g, opts.bits).reshape(cur.shape)
        err = np.mean(np.square(q @ xg - ref), axis=2, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_max = np.where(better, max_val, best_max)
    return best_max[:, :, 0].T                                           # [out, groups]


def apply_clip(w: np.ndarray, max_val: np.ndarray, g: int) -> np.ndarray:
    m = np.repeat(max_val, g, axis=1)
    return np.clip(w, -m, m)


# -- one layer -------------------------------------------------------------------------------------

def awq_layer(cfg: LlamaConfig, L: Layer, x: np.ndarray, cos, sin, opts: QuantOptions) -> Layer:
    """Scale, clip (AWQ) the float layer L for the calibration input x [N, T, H]; returns the layer
    with scales folded in and clipping applied, still float (quantized by the caller)."""
    eps = cfg.rms_norm_eps
    w = dict(L)
    xa = ops.rmsnorm(x, w["input_norm"], eps)
    o_in, attn_out = attention(cfg, xa, w["q"], w["k"], w["v"], w["o"], cos, sin)
    h = x + attn_out
    xm = ops.rmsnorm(h, w["post_norm"], eps)
    act, mlp_out = mlp(xm, w["gate"], w["up"], w["down"])
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731

    # 2. scales, each searched against the float layer
    s_qkv = search_scales(flat(xa), [w["q"], w["k"], w["v"]], output_mse(
        lambda W: attention(cfg, xa, *W, w["o"], cos, sin)[1], attn_out), opts)
    s_o = None
    if w["v"].shape == w["o"].shape:
        s_o = search_scales(flat(o_in), [w["o"]], linear_mse(flat(o_in), w["o"]), opts)
    s_gu = search_scales(flat(xm), [w["gate"], w["up"]], output_mse(
        lambda W: mlp(xm, W[0], W[1], w["down"])[1], mlp_out), opts)
    s_d = search_scales(flat(act), [w["down"]], linear_mse(flat(act), w["down"]), opts)

    # fold: W * s on the columns of each linear, 1/s into the op that produces its input
    w["input_norm"] = w["input_norm"] / s_qkv
    for k in ("q", "k", "v"):
        w[k] = w[k] * s_qkv
    feats = {"v": flat(xa) / s_qkv, "o": flat(o_in), "gate": flat(xm) / s_gu, "up": flat(xm) / s_gu,
             "down": flat(act) / s_d}
    if s_o is not None:
        w["v"] = w["v"] / s_o[:, None]
        w["o"] = w["o"] * s_o
        feats["o"] = feats["o"] / s_o
    w["post_norm"] = w["post_norm"] / s_gu
    w["gate"], w["up"] = w["gate"] * s_gu, w["up"] * s_gu
    w["up"] = w["up"] / s_d[:, None]
    w["down"] = w["down"] * s_d

    # 3. clipping (not q, k)
    if opts.clip:
        for k, feat in feats.items():
            w[k] = apply_clip(w[k], search_clip(feat, w[k], opts), opts.group_size)
    return w


LINEAR_KEYS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
               "down": "mlp.down_proj"}
NORM_KEYS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}


def quantize_model(cfg: LlamaConfig, get: Callable[[str], np.ndarray], calib: np.ndarray | None,
                   opts: QuantOptions, progress: Callable[[int, int], None] | None = None
                   ) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """Yield (layer prefix, tensors) for each decoder layer: the two norms (float32) and each
    linear's qweight/qzeros/scales. `get(name)` returns a float source tensor (HF name and layout);
    `calib` [N, T] token ids (AWQ only)."""
    x = cos = sin = None
    if opts.method == "awq":
        x = get("model.embed_tokens.weight")[calib].astype(np.float32)      # [N, T, H]
        cos, sin = ops.rope_tables(rope_inv_freq(cfg), np.arange(calib.shape[1]))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        L = {k: get(p + n + ".weight").astype(np.float32)
             for k, n in {**LINEAR_KEYS, **NORM_KEYS}.items()}
        L_float = L
        if opts.method == "awq":
            L = awq_layer(cfg, L, x, cos, sin, opts)
        tensors = {p + n + ".weight": L[k] for k, n in NORM_KEYS.items()}
        deq = dict(L)
        for k, n in LINEAR_KEYS.items():
            packed = pack_linear(L[k], opts.group_size, opts.bits)
            tensors.update({f"{p}{n}.{part}": t for part, t in packed.items()})
            deq[k] = fake_quantize(L[k], opts.group_size, opts.bits)
        if x is not None and i + 1 < cfg.num_hidden_layers:
            x = layer_forward(cfg, x, deq if opts.propagate_quantized else L_float, cos, sin)
        yield p, tensors
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
