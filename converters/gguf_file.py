"""Reading GGUF files (through the `gguf` package maintained with llama.cpp) into HF terms:
an HF config dict, tensors under HF names in HF layout, and tokenizer metadata."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tinyrt.errors import ModelFormatError
from tinyrt.models.families import gguf_family
from tinyrt.models.llama import GGUF_GLOBAL, GGUF_LAYER

# GGUF name -> HF name, from the one table of tensor names (models.llama)
_LAYER_NAMES = {g: hf for hf, g in GGUF_LAYER.items()}
_GLOBAL_NAMES = {g: hf for hf, g in GGUF_GLOBAL.items()}


def hf_name(name: str) -> str | None:
    """HF tensor name for a GGUF tensor name, or None for tensors we do not carry over."""
    module, _, kind = name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. Its converter reorders each head's rows from HF's
    rotate-half layout (first half, second half) into interleaved pairs; this restores HF order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class GGUFFile:
    """A GGUF model file: metadata, HF config and float tensors (dequantized on demand)."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path} is missing")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFormatError(f"{self.path} is not a GGUF file (bad magic {magic!r})")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises many kinds of error on damaged files
            raise ModelFormatError(f"{self.path} is not a readable GGUF file "
                                   f"(truncated or damaged: {type(e).__name__}: {e})") from None
        size = self.path.stat().st_size
        self.tensors = {}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelFormatError(f"{self.path} is truncated (tensor {t.name} runs past the end)")
            self.tensors[t.name] = t
        self._gguf_names = {hf_name(n): n for n in self.tensors if hf_name(n)}
        self.arch = self.get("general.architecture")
        try:
            self.family = gguf_family(self.arch)
        except ModelFormatError as e:
            raise ModelFormatError(f"{self.path}: {e}") from None

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars as Python values, arrays as lists)."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception:
            raise ModelFormatError(f"{self.path}: metadata {key!r} is unreadable") from None

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def config(self) -> dict[str, Any]:
        """The HF config.json this file describes."""
        need = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
        missing = [k for k in need if self._arch(k) is None]
        if missing:
            raise ModelFormatError(f"{self.path}: metadata lacks {', '.join(self.arch + '.' + k for k in missing)}")
        hidden, heads = int(self._arch("embedding_length")), int(self._arch("attention.head_count"))
        head_dim = int(self._arch("attention.key_length", hidden // max(heads, 1)))
        rot = self._arch("rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise ModelFormatError(f"{self.path}: partial rotary embeddings ({rot} of {head_dim}) "
                                   "are not supported")
        tokens = self.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else self._arch("vocab_size")
        if "token_embd.weight" in self.tensors:
            vocab = int(self.tensors["token_embd.weight"].shape[-1])
        cfg = {
            "architectures": [self.family.architecture],
            "model_type": self.family.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        window = self._arch("attention.sliding_window")
        if window and self.family.model_type in ("llama", "mistral"):
            cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
            cfg["sliding_window"] = int(window)
        scaling = self._rope_scaling(cfg)
        if scaling:
            cfg["rope_scaling"] = scaling
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            v = self.get(f"tokenizer.ggml.{name}")
            if v is not None:
                cfg[key] = int(v)
        return cfg

    def _rope_scaling(self, cfg: dict) -> dict | None:
        kind = self._arch("rope.scaling.type")
        if kind in (None, "none") and "rope_freqs.weight" not in self.tensors:
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._arch("rope.scaling.factor"))}
        if kind not in (None, "none"):
            raise ModelFormatError(f"{self.path}: rope scaling {kind!r} is not supported")
        # Llama 3.1 files store the per-frequency divisors as a tensor, not the parameters. Accept
        # them only if the standard llama3 parameters reproduce the tensor.
        freqs = self.tensor("rope_freqs.weight").astype(np.float64).ravel()
        from tinyrt.models.config import ModelConfig
        from tinyrt.models.rope import rope_inv_freq

        scaling = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        base = ModelConfig.from_dict({**cfg, "rope_scaling": None})
        scaled = ModelConfig.from_dict({**cfg, "rope_scaling": scaling})
        if np.allclose(rope_inv_freq(base) / rope_inv_freq(scaled), freqs, rtol=1e-3):
            return scaling
        raise ModelFormatError(f"{self.path}: its rope_freqs tensor matches no rope scaling that "
                               "tinyrt knows")

    def tensor(self, name: str) -> np.ndarray:
        """A GGUF tensor dequantized to float32 (float16 stays float16), numpy shape order."""
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        t = self.tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost first
        if t.tensor_type in (Q.F32, Q.F16):
            return np.asarray(t.data).reshape(shape)
        try:
            out = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelFormatError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, "
                                   "which the gguf package cannot dequantize") from None
        return out.reshape(shape)

    def hf_tensor(self, hf: str) -> np.ndarray:
        """A tensor by its HF name, in HF layout (Q/K rows un-permuted)."""
        name = self._gguf_names[hf]
        w = self.tensor(name)
        heads = self._arch("attention.head_count")
        if hf.endswith("k_proj.weight"):
            heads = self._arch("attention.head_count_kv", heads)
        if self.family.gguf_permuted_qk and hf.endswith(("q_proj.weight", "k_proj.weight")):
            if not isinstance(heads, int) or heads <= 0 or w.shape[0] % (2 * heads):
                raise ModelFormatError(f"{self.path}: tensor {name} {list(w.shape)} does not "
                                       f"split into {heads} heads")
            w = unpermute(w, heads)
        return w

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {hf_name(n): tuple(int(s) for s in reversed(t.shape))
                for n, t in self.tensors.items() if hf_name(n)}

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.hf_shapes().values())
