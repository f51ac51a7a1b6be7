"""Model configuration: a frozen dataclass whose fields are the HF `config.json` key names."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyrt.errors import ModelFormatError

from .families import family, text_config

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")     # of the gated MLP: SwiGLU, GeGLU (Gemma)
LAYER_TYPES = ("sliding_attention", "full_attention")
# The largest size or token id a config may name: no real model comes near it, and beyond it the
# runtime's int32 token ids and positions (and NumPy's shapes) would overflow. Whether the weights
# hold what the config names is checked against the file (ModelWeights.check_shapes).
INT_MAX = 2**31 - 1
FLOAT32_TINY = 1.1754943508222875e-38   # the smallest normal float32


def _is(v: Any, kind: str) -> bool:
    """Whether a JSON value is of `kind`: int, number, str, bool, object, ints (an int or a list
    of them) or strs (a list of strings)."""
    if kind in ("int", "ints", "number") and isinstance(v, bool):
        return False
    if kind == "ints" and isinstance(v, list):
        return all(_is(x, "int") for x in v)
    if kind == "strs":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    types = {"int": int, "ints": int, "number": (int, float), "str": str, "bool": bool,
             "object": dict}
    return isinstance(v, types[kind])


def _shown(v: Any) -> str:
    """A value for a message, short: str() of an int of thousands of digits raises, and a long
    string or list would not fit one line."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    return repr(v)[:40]


def _check_kind(name: str, v: Any, kind: str) -> None:
    if not _is(v, kind):
        raise ModelFormatError(f"{name} must be {_WHAT[kind]}, got {_shown(v)}")


MAX_ROPE_THETA, MAX_ROPE_FACTOR = 1e15, 1e6


def _check_number(name: str, v: Any, low: float, high: float = math.inf, *,
                  low_ok: bool = False) -> float:
    """`v` as a finite float above `low` (at `low` too if `low_ok`) and below `high`: JSON
    allows NaN, Infinity and integers too large for a float, none of which a model runs with."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ModelFormatError(f"{name} must be a number, got {_shown(v)}")
    try:
        x = float(v)
    except OverflowError:                 # an integer beyond any float
        x = math.inf
    if not math.isfinite(x):
        raise ModelFormatError(f"{name} must be a finite number, got {_shown(v)}")
    if not ((low <= x) if low_ok else (low < x)) or not x < high:
        bound = f"at least {low:g}" if low_ok else f"above {low:g}"
        if high < math.inf:
            bound += f" and below {high:g}"
        raise ModelFormatError(f"{name} must be {bound}, got {_shown(v)}")
    return x


_WHAT = {"int": "an integer", "ints": "an integer or a list of integers", "number": "a number",
         "str": "a string", "bool": "true or false", "object": "an object",
         "strs": "a list of strings"}
# the JSON kind of each ModelConfig field, checked by `from_dict`
_KINDS = {**dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "head_dim",
                           "max_position_embeddings", "sliding_window", "bos_token_id",
                           "pad_token_id", "no_rope_layer_interval",
                           "original_max_position_embeddings"), "int"),
          **dict.fromkeys(("rms_norm_eps", "rope_theta", "partial_rotary_factor",
                           "rope_local_base_freq", "query_pre_attn_scalar",
                           "final_logit_softcapping", "attn_logit_softcapping"), "number"),
          **dict.fromkeys(("model_type", "hidden_act", "torch_dtype"), "str"),
          **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), "bool"),
          **dict.fromkeys(("rope_scaling", "quantization_config"), "object"),
          "eos_token_id": "ints", "no_rope_layers": "ints", "architectures": "strs",
          "layer_types": "strs"}
_QUANT_KINDS = {"quant_method": "str", "bits": "int", "group_size": "int", "zero_point": "bool",
                "version": "str"}


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of an AWQ model directory (AutoAWQ's keys)."""

    quant_method: str = "awq"
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"


@dataclass(frozen=True)
class ModelConfig:
    """The HF config of a decoder of any family in models.FAMILIES (the keys they share; a
    family reads its own keys in its `adapt_config`). Unknown keys are dropped by `from_dict`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    model_type: str = "llama"
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # the share of each head's dims that RoPE rotates (its first ones; Phi-3, Phi-4-mini)
    partial_rotary_factor: float | None = None
    original_max_position_embeddings: int | None = None    # (longrope: the context it extends)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # each layer's kind: "sliding_attention" (attends within sliding_window, RoPE base
    # rope_local_base_freq where given) or "full_attention"; None: every layer alike
    layer_types: list[str] | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None     # attention's scale: its -1/2 power (Gemma)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # layers that attend without positions (NoPE: no RoPE on q and k): those whose entry of
    # no_rope_layers is 0, or (without it) every no_rope_layer_interval-th
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    architectures: list[str] | None = None
    quantization_config: dict | None = field(default=None, compare=False)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a config dict, dropping unknown keys and filling HF defaults. Every value is
        checked (its JSON kind here, its range in __post_init__); `source` names the file in the
        one-line error (config.json, or the GGUF file whose metadata `d` was read from)."""
        try:
            return cls._from_dict(d)
        except ModelFormatError as e:
            raise ModelFormatError(f"{source}: {e}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ModelFormatError("the config is not a JSON object")
        d = text_config(dict(d))
        if isinstance(d.get("model_type", "llama"), str):
            d = family(d.get("model_type", "llama")).adapt_config(d)
        # transformers 5 writes rope settings under `rope_parameters`; older files use the two keys.
        params = d.pop("rope_parameters", None)
        if isinstance(params, dict):
            d.setdefault("rope_theta", params.get("rope_theta", 10000.0))
            for key in ("partial_rotary_factor", "original_max_position_embeddings"):
                if key in params:
                    d.setdefault(key, params[key])
            if params.get("rope_type", "default") != "default" and d.get("rope_scaling") is None:
                d["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise ModelFormatError(f"lacks required keys: {', '.join(missing)}")
        nullable = {f.name for f in dataclasses.fields(cls) if f.default is None}
        for name, v in kwargs.items():
            if v is not None or name not in nullable:
                _check_kind(name, v, _KINDS[name])
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if kwargs.get("head_dim") is None and kwargs["num_attention_heads"] > 0:
            kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        from tinyrt.paths import read_json    # (bounded; one line for any file it cannot read)

        return cls.from_dict(read_json(path), str(path))

    def __post_init__(self) -> None:
        """The ranges of the values (from_dict has checked their kinds): messages name the field;
        from_dict adds the file."""
        fail = ModelFormatError
        self.family                           # a clear error for a family tinyrt does not run
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "sliding_window",
                     "original_max_position_embeddings"):
            v = getattr(self, name)
            if v is not None and not 0 < v <= INT_MAX:
                raise fail(f"{name} must be between 1 and {INT_MAX}, got {_shown(v)}")
        # token ids: negative ones (-1) stand for "none" in some configs; the tokenizer's and
        # these ids are checked against the embedding's rows when the model loads (tinyrt.api)
        for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
            for v in self.eos_token_ids if name == "eos_token_id" else (getattr(self, name),):
                if v is not None and not -INT_MAX - 1 <= v <= INT_MAX:
                    raise fail(f"{name} {_shown(v)} is not a token id")
        if self.no_rope_layers is not None and (
                not isinstance(self.no_rope_layers, list)
                or len(self.no_rope_layers) < self.num_hidden_layers
                or any(v not in (0, 1) for v in self.no_rope_layers)):
            raise fail(f"no_rope_layers must hold a 0 or 1 for each of the "
                       f"{self.num_hidden_layers} layers")
        if self.no_rope_layer_interval is not None and not 0 < self.no_rope_layer_interval <= INT_MAX:
            raise fail(f"no_rope_layer_interval must be between 1 and {INT_MAX}, "
                       f"got {_shown(self.no_rope_layer_interval)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"num_attention_heads ({self.num_attention_heads}) is not a "
                       f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise fail(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.partial_rotary_factor is not None and _check_number(
                "partial_rotary_factor", self.partial_rotary_factor, 0) > 1:
            raise fail(f"partial_rotary_factor must be at most 1, got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise fail(f"partial_rotary_factor {self.partial_rotary_factor} rotates "
                       f"{self.rotary_dim} of head_dim {self.head_dim}: not an even number above 0")
        if self.hidden_act not in ACTIVATIONS:
            raise fail(f"unsupported activation {self.hidden_act!r} "
                       f"(supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None and (
                len(self.layer_types) < self.num_hidden_layers
                or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise fail(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                       f"{self.num_hidden_layers} layers")
        for name in ("rope_local_base_freq", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), 1 if name.startswith("rope") else 0,
                              MAX_ROPE_THETA)
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                raise fail(f"{name} (Gemma 2's) is not supported")
        if self.attention_bias or self.mlp_bias:
            raise fail("linear layers with bias are not supported")
        # an epsilon, not a scale, that float32 holds (a smaller one is 0 there); theta above 1
        # so that the frequencies fall (1 / theta^(i/d)), and theta and the factor far above
        # any model's yet bounded, so that the slowest frequency, about 1 / (theta * factor),
        # stays a normal float32
        _check_number("rms_norm_eps", self.rms_norm_eps, FLOAT32_TINY, 1, low_ok=True)
        _check_number("rope_theta", self.rope_theta, 1, MAX_ROPE_THETA)
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise fail("rope_scaling must be an object")
            kind = self.rope_type
            if kind not in SUPPORTED_ROPE_TYPES:
                raise fail(f"unsupported rope_scaling type {kind!r} "
                           f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            s = self.rope_scaling
            if kind in ("linear", "llama3"):
                # the frequencies are divided by the factor: at least 1, a stretch of the context
                _check_number(f"rope_scaling.factor ({kind})", s.get("factor"), 1,
                              MAX_ROPE_FACTOR, low_ok=True)
            if kind == "llama3":
                # the ramp between the two divides by low and by high - low (models/rope.py)
                lo = _check_number("rope_scaling.low_freq_factor", s.get("low_freq_factor"), 0)
                hi = _check_number("rope_scaling.high_freq_factor", s.get("high_freq_factor"), 0)
                if not hi > lo:
                    raise fail(f"rope_scaling.high_freq_factor ({hi:g}) must be above "
                               f"low_freq_factor ({lo:g})")
                _check_number("rope_scaling.original_max_position_embeddings",
                              s.get("original_max_position_embeddings"), 1, INT_MAX + 1,
                              low_ok=True)
            if kind == "longrope":
                # a divisor per rotated frequency, for contexts up to and past the original one
                for name in ("short_factor", "long_factor"):
                    v = s.get(name)
                    if not isinstance(v, list) or len(v) != self.rotary_dim // 2:
                        raise fail(f"rope_scaling.{name} must be a list of {self.rotary_dim // 2} "
                                   f"numbers (one per rotated frequency)")
                    for x in v:
                        _check_number(f"rope_scaling.{name}", x, 0, MAX_ROPE_FACTOR)
                _check_number("original_max_position_embeddings (longrope)",
                              self.longrope_original, 1, INT_MAX + 1)
                for name in ("factor", "attention_factor"):
                    if s.get(name) is not None:
                        _check_number(f"rope_scaling.{name} (longrope)", s[name], 0,
                                      MAX_ROPE_FACTOR)
        if self.quantization_config is not None:
            self.quant  # validates

    # -- derived values -----------------------------------------------------------------------

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (its first ones)."""
        f = self.partial_rotary_factor
        return self.head_dim if f is None else int(self.head_dim * f)

    @property
    def longrope_original(self) -> int | None:
        """longrope's original context: past it, the long factors apply."""
        s = self.rope_scaling or {}
        return s.get("original_max_position_embeddings", self.original_max_position_embeddings)

    @property
    def geglu(self) -> bool:
        """Whether the gated MLP is GeGLU (GELU's tanh form: Gemma) rather than SwiGLU."""
        return self.hidden_act == "gelu_pytorch_tanh"

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to all it holds)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q . k by."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates its q and k by position (False: a NoPE layer)."""
        if self.no_rope_layers is not None:
            return bool(self.no_rope_layers[layer])
        n = self.no_rope_layer_interval
        return n is None or (layer + 1) % n != 0

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (the GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def n_params(self) -> int:
        """The weights' count as the config describes them (embedding and head, each layer's
        projections and norms): what ollama's parameter_size says (biases, per-head norms
        aside)."""
        H, L = self.hidden_size, self.num_hidden_layers
        layer = 2 * H * self.q_size + 2 * H * self.kv_size + 3 * H * self.intermediate_size + 2 * H
        return self.vocab_size * H * (1 if self.tie_word_embeddings else 2) + L * layer + H

    @property
    def family(self):
        """Its entry of models.FAMILIES (models.base.Family)."""
        return family(self.model_type)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, list) else (e,)

    @property
    def quant(self) -> QuantConfig | None:
        q = self.quantization_config
        if q is None:
            return None
        if not isinstance(q, dict):
            raise ModelFormatError("quantization_config must be an object")
        for k, kind in _QUANT_KINDS.items():
            if k in q:
                _check_kind(f"quantization_config.{k}", q[k], kind)
        qc = QuantConfig(**{k: v for k, v in q.items() if k in _QUANT_KINDS})
        if qc.quant_method != "awq" or qc.bits != 4 or qc.version.lower() != "gemm":
            raise ModelFormatError(
                f"unsupported quantization {qc.quant_method} {qc.bits}-bit {qc.version} "
                "(tinyrt reads AWQ 4-bit GEMM checkpoints)")
        if not 0 < qc.group_size <= INT_MAX:
            raise ModelFormatError(f"quantization_config.group_size must be between 1 and "
                                   f"{INT_MAX}, got {_shown(qc.group_size)}")
        return qc

    def to_dict(self) -> dict[str, Any]:
        """The config.json we write: HF key names, None values left out."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        d.setdefault("architectures", [family(self.model_type).architecture])
        return d
