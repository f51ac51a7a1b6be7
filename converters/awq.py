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
copies of the embedding  bytes (`peak_bytes`; measured figures in docs/FORMATS.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from tinyrt.kernels import reference as ops
from tinyrt.models import Layer, model_class
from tinyrt.models.config import ModelConfig
from tinyrt.models.llama import LINEARS, NORMS
from tinyrt.models.rope import layer_inv_freqs

from .quantize import fake_quantize, pack_linear

LossFn = Callable[[list[np.ndarray]], float]
ATTN_BLOCK = 128  # queries per block in calibration attention
OPS = ops.ReferenceBackend()        # the model's own layer runs on the reference ops


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


def layer_weights(cfg: ModelConfig) -> int:
    """The weights of one decoder layer's linears."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return 2 * cfg.q_size * H + 2 * cfg.kv_size * H + 3 * H * I


def peak_bytes(cfg: ModelConfig, n_tokens: int) -> int:
    """Estimated peak of the calibration above the interpreter's (see the module docstring)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return 4 * (n_tokens * (8 * H + 4 * I) + 3 * layer_weights(cfg) + 2 * cfg.vocab_size * H)


# -- the model's own layer, batched over calibration sequences -----------------------------------

Weights = dict  # one decoder layer's float32 tensors by HF name (norms, linears' .weight, biases)


def causal_attend(cfg: ModelConfig, i: int) -> Callable:
    """Attention of sequences over themselves, for the model's layer i: q [N, T, Q, D] and k, v
    [N, T, G, D] -> [N, T, Q, D], a block of queries at a time (it sees the keys up to its end)."""
    def attend(q, k, v):
        N, T, Q, D = q.shape
        k, v, pos = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), np.arange(T)
        a = np.empty((N, T, Q, D), np.float32)
        for b in range(0, T, ATTN_BLOCK):
            e = min(b + ATTN_BLOCK, T)
            a[:, b:e] = ops.attention(q[:, b:e], k[:, :, :e], v[:, :, :e], pos[b:e], pos[:e],
                                      cfg.attention_scale, cfg.window(i))
        return a
    return attend


def make_layer(cfg: ModelConfig, w: Weights, i: int) -> Layer:
    """The model's Layer i of float32 weights `w` (full HF names)."""
    return model_class(cfg).make_layer(cfg, i, OPS, w.__getitem__, lambda n: w[n + ".weight"])


def layer_forward(cfg: ModelConfig, x: np.ndarray, w: Weights, i: int, cos, sin) -> np.ndarray:
    """The model's layer i over calibration sequences x [N, T, H]."""
    return model_class(cfg).layer(OPS, cfg, make_layer(cfg, w, i), x, cos, sin,
                                  causal_attend(cfg, i))


class _Recorder(ops.ReferenceBackend):
    """The reference ops, keeping the input of each linear the layer runs, by weight."""

    def __init__(self):
        self.inputs: dict[int, np.ndarray] = {}

    def linear(self, x, w):
        self.inputs[id(w)] = x
        return ops.linear(x, w)


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
    """Loss: MSE of x @ W'.T against x @ w.T for x [n, in]. With more tokens than inputs,
    through the Gram matrix of x: mean((x dW.T)^2) = sum((dW G) * dW) / (n out) with
    G = x.T x, which costs out*in^2 instead of n*in*out."""
    n = x.shape[0] * w.shape[0]
    if x.shape[0] <= x.shape[1]:
        return lambda W: float(np.sum(np.square(x @ (W[0] - w).T)) / n)
    gram = (x.T.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
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

def awq_layer(cfg: ModelConfig, w: Weights, i: int, x: np.ndarray, cos, sin,
              opts: QuantOptions) -> Weights:
    """Scale, clip (AWQ) the float layer i, weights `w`, for the calibration input x [N, T, H];
    returns its weights with scales folded in and clipping applied, still float (quantized by
    the caller). The model's own layer makes the inputs of each linear and the outputs that the
    searches compare against."""
    model, p = model_class(cfg), f"model.layers.{i}."
    w = dict(w)
    (q, k, v), (o,), (gate, up), (down,) = ([p + n + ".weight" for n in LINEARS[f]]
                                            for f in ("qkv", "o", "gate_up", "down"))
    in_norm, post_norm = (p + NORMS[f] + ".weight" for f in ("input_norm", "post_norm"))
    L, rec, attend = make_layer(cfg, w, i), _Recorder(), causal_attend(cfg, i)
    model.layer(rec, cfg, L, x, cos, sin, attend)
    xa, o_in, xm, act = (rec.inputs[id(getattr(L, f))] for f in LINEARS)   # linears' inputs
    attn_out, mlp_out = ops.linear(o_in, L.o), ops.linear(act, L.down)
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731

    # 2. scales, each searched against the float layer's own outputs
    s_qkv = search_scales(flat(xa), [w[q], w[k], w[v]], output_mse(
        lambda W: model.attention(OPS, cfg, dataclasses.replace(L, qkv=np.concatenate(W)), xa,
                                  cos, sin, attend), attn_out), opts)
    s_o = None
    if w[v].shape == w[o].shape:
        s_o = search_scales(flat(o_in), [w[o]], linear_mse(flat(o_in), w[o]), opts)
    s_gu = search_scales(flat(xm), [w[gate], w[up]], output_mse(
        lambda W: model.mlp(OPS, cfg, dataclasses.replace(L, gate_up=np.concatenate(W)), xm),
        mlp_out), opts)
    s_d = search_scales(flat(act), [w[down]], linear_mse(flat(act), w[down]), opts)

    # fold: W * s on the columns of each linear, 1/s into the op that produces its input
    w[in_norm] = w[in_norm] / s_qkv
    for n in (q, k, v):
        w[n] = w[n] * s_qkv
    feats = {v: flat(xa) / s_qkv, o: flat(o_in), gate: flat(xm) / s_gu, up: flat(xm) / s_gu,
             down: flat(act) / s_d}
    if s_o is not None:
        w[v] = w[v] / s_o[:, None]
        w[o] = w[o] * s_o
        feats[o] = feats[o] / s_o
        if p + LINEARS["qkv"][2] + ".bias" in w:       # v's bias, like its rows
            w[p + LINEARS["qkv"][2] + ".bias"] = w[p + LINEARS["qkv"][2] + ".bias"] / s_o
    w[post_norm] = w[post_norm] / s_gu
    w[gate], w[up] = w[gate] * s_gu, w[up] * s_gu
    w[up] = w[up] / s_d[:, None]
    w[down] = w[down] * s_d

    # 3. clipping (not q, k)
    if opts.clip:
        for n, feat in feats.items():
            w[n] = apply_clip(w[n], search_clip(feat, w[n], opts), opts.group_size)
    return w


def quantize_model(cfg: ModelConfig, get: Callable[[str], np.ndarray], calib: np.ndarray | None,
                   opts: QuantOptions, progress: Callable[[int, int], None] | None = None
                   ) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """Yield (layer prefix, tensors) for each decoder layer: its float tensors (norms, biases;
    float32) and each linear's qweight/qzeros/scales. `get(name)` returns a float source tensor
    (HF name and layout); `calib` [N, T] token ids (AWQ only)."""
    x, tables = None, [(None, None)] * cfg.num_hidden_layers
    if opts.method == "awq":
        x = get("model.embed_tokens.weight")[calib].astype(np.float32)      # [N, T, H]
        positions = np.arange(calib.shape[1])
        tables = [ops.rope_tables(f, positions) for f in layer_inv_freqs(cfg)]
    float_cfg = dataclasses.replace(cfg, quantization_config=None)
    names = list(model_class(cfg).expected_shapes(float_cfg))
    linears = {n + ".weight" for n in model_class(cfg).linear_shapes(cfg)}
    for i, (cos, sin) in enumerate(tables):
        p = f"model.layers.{i}."
        layer = [n for n in names if n.startswith(p)]
        if x is None:        # RTN: one tensor in memory at a time, whatever the model's size
            w_float, w = None, ((n, get(n).astype(np.float32)) for n in layer)
        else:
            w_float = {n: get(n).astype(np.float32) for n in layer}
            w = awq_layer(cfg, w_float, i, x, cos, sin, opts).items()
        tensors, deq = {}, {}
        for n, t in w:
            if n not in linears:
                tensors[n] = deq[n] = t
                continue
            module = n[:-len(".weight")]
            tensors.update({f"{module}.{part}": a
                            for part, a in pack_linear(t, opts.group_size, opts.bits).items()})
            if x is not None:
                deq[n] = fake_quantize(t, opts.group_size, opts.bits)
        if x is not None and i + 1 < cfg.num_hidden_layers:
            x = layer_forward(cfg, x, deq if opts.propagate_quantized else w_float, i, cos, sin)
        yield p, tensors
        if progress:
            progress(i + 1, cfg.num_hidden_layers)
