"""Model configuration: a frozen dataclass whose fields are the HF `config.json` key names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyrt.errors import ModelFormatError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _is(v: Any, kind: str) -> bool:
    """Whether a JSON value is of `kind`: int, number, str, bool, object, ints (an int or a list
    of them) or strs (a list of strings)."""
    if kind in ("int", "number") and isinstance(v, bool):
        return False
    if kind == "ints" and isinstance(v, list):
        return all(_is(x, "int") for x in v)
    if kind == "strs":
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    types = {"int": int, "ints": int, "number": (int, float), "str": str, "bool": bool,
             "object": dict}
    return isinstance(v, types[kind])


def _check_kind(name: str, v: Any, kind: str) -> None:
    if not _is(v, kind):
        raise ModelFormatError(f"config.json: {name} must be {_WHAT[kind]}, got {str(v)[:40]!r}")


_WHAT = {"int": "an integer", "ints": "an integer or a list of integers", "number": "a number",
         "str": "a string", "bool": "true or false", "object": "an object",
         "strs": "a list of strings"}
# the JSON kind of each ModelConfig field, checked by `from_dict`
_KINDS = {**dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "head_dim",
                           "max_position_embeddings", "sliding_window", "bos_token_id",
                           "pad_token_id"), "int"),
          **dict.fromkeys(("rms_norm_eps", "rope_theta"), "number"),
          **dict.fromkeys(("model_type", "hidden_act", "torch_dtype"), "str"),
          **dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), "bool"),
          **dict.fromkeys(("rope_scaling", "quantization_config"), "object"),
          "eos_token_id": "ints", "architectures": "strs"}
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
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
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
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a config dict, dropping unknown keys and filling HF defaults."""
        if not isinstance(d, dict):
            raise ModelFormatError("config.json must hold a JSON object")
        d = dict(d)
        if isinstance(d.get("model_type", "llama"), str):
            from .families import family

            d = family(d.get("model_type", "llama")).adapt_config(d)
        # transformers 5 writes rope settings under `rope_parameters`; older files use the two keys.
        params = d.pop("rope_parameters", None)
        if isinstance(params, dict):
            d.setdefault("rope_theta", params.get("rope_theta", 10000.0))
            if params.get("rope_type", "default") != "default" and d.get("rope_scaling") is None:
                d["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            raise ModelFormatError(f"config.json lacks required keys: {', '.join(missing)}")
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
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelFormatError(f"{path} is missing") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFormatError(f"{path} is not valid JSON ({e})") from None
        return cls.from_dict(d)

    def __post_init__(self) -> None:
        fail = ModelFormatError
        from .families import family

        family(self.model_type)               # a clear error for a family tinyrt does not run
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise fail(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"config.json: num_attention_heads ({self.num_attention_heads}) is not a "
                       f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise fail(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise fail(f"unsupported activation {self.hidden_act!r} (only silu)")
        if self.attention_bias or self.mlp_bias:
            raise fail("linear layers with bias are not supported")
        if not self.rms_norm_eps > 0:
            raise fail(f"config.json: rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise fail(f"config.json: rope_theta must be positive, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise fail(f"config.json: sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise fail("config.json: rope_scaling must be an object")
            kind = self.rope_type
            if kind not in SUPPORTED_ROPE_TYPES:
                raise fail(f"unsupported rope_scaling type {kind!r} "
                           f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
            need = {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings")}.get(kind, ())
            for key in need:
                if not isinstance(self.rope_scaling.get(key), (int, float)):
                    raise fail(f"config.json: rope_scaling ({kind}) needs a number for {key!r}")
        if self.quantization_config is not None:
            self.quant  # validates

    # -- derived values -----------------------------------------------------------------------

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

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
            raise ModelFormatError("config.json: quantization_config must be an object")
        for k, kind in _QUANT_KINDS.items():
            if k in q:
                _check_kind(f"quantization_config.{k}", q[k], kind)
        qc = QuantConfig(**{k: v for k, v in q.items() if k in _QUANT_KINDS})
        if qc.quant_method != "awq" or qc.bits != 4 or qc.version.lower() != "gemm":
            raise ModelFormatError(
                f"unsupported quantization {qc.quant_method} {qc.bits}-bit {qc.version} "
                "(tinyrt reads AWQ 4-bit GEMM checkpoints)")
        if qc.group_size <= 0:
            raise ModelFormatError(f"config.json: quantization_config.group_size must be "
                                   f"positive, got {qc.group_size}")
        return qc

    def to_dict(self) -> dict[str, Any]:
        """The config.json we write: HF key names, None values left out."""
        from .families import family

        d = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        d.setdefault("architectures", [family(self.model_type).architecture])
        return d
