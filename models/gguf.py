"""GGUF model files (llama.cpp's format) read in place, in HF terms: an HF config dict, tensors
under HF names in HF layout (float, or the runtime's quantized form, exactly), and the tokenizer
metadata.

The file is parsed by a lean reader of our own and memory-mapped read-only; a tensor is a view of
its bytes. (`gguf.GGUFReader` builds a NumPy view per item of every metadata array, 2-5 s for a
49k-token vocabulary and its merges; this reader takes a few tens of milliseconds.) The format's
constants are the `gguf` package's.

Layout (little-endian): magic "GGUF" | version u32 (2 or 3) | tensor count u64 | kv count u64 |
kv pairs (key string, value type u32, value) | tensor infos (name string, n_dims u32, dims u64
each, innermost first, type u32, offset u64 from the data start) | padding to `general.alignment`
(default 32) | tensor data. A string is a u64 length and UTF-8 bytes; an array is an item type u32,
a count u64 and the items (arrays may nest).
"""

from __future__ import annotations

import functools
import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from tinyrt.errors import ModelFormatError
from tinyrt.kernels.quant import QuantWeight
from tinyrt.models.config import ModelConfig
from tinyrt.models.families import gguf_family
from tinyrt.models.gguf_quants import (FLOAT_FIELDS, FORMS, GGUF_TO_QUANT, finite_scales,
                                       to_quant)
from tinyrt.models.llama import GGUF_GLOBAL
from tinyrt.models.weights import (ModelWeights, all_finite, held_layers, map_file,
                                   release_pages)
from tinyrt.paths import open_regular

Q = GGMLQuantizationType
V = GGUFValueType

# GGUF name -> HF name, from the one table of tensor names (models.llama; a family's own, for a
# layer's modules)
_GLOBAL_NAMES = {g: hf for hf, g in GGUF_GLOBAL.items()}

MAX_DIMS = 4            # GGML_MAX_DIMS
MAX_DEPTH = 8           # arrays of arrays: deeper than any real file nests them

# value type -> (struct format of one scalar, NumPy dtype of an array of them)
_NUMBERS = {
    V.UINT8: ("<B", "<u1"), V.INT8: ("<b", "<i1"), V.UINT16: ("<H", "<u2"),
    V.INT16: ("<h", "<i2"), V.UINT32: ("<I", "<u4"), V.INT32: ("<i", "<i4"),
    V.FLOAT32: ("<f", "<f4"), V.BOOL: ("<?", "<u1"), V.UINT64: ("<Q", "<u8"),
    V.INT64: ("<q", "<i8"), V.FLOAT64: ("<d", "<f8"),
}
_SCALAR = {t: struct.Struct(f) for t, (f, _) in _NUMBERS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    """HF tensor name for a GGUF tensor name (a layer's module names: llama.cpp's -> HF's, of
    the file's family), or None for tensors we do not carry over."""
    module, _, kind = name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{kind}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    return None


@functools.lru_cache(maxsize=None)
def readable(qtype: GGMLQuantizationType) -> bool:
    """Whether tensors of type `qtype` read as float (as stored, as the runtime's quantized
    form, or dequantized by the gguf package: its one block of zeros tried): not the integer
    types (I8 to I64), F64, or a type newer than the package."""
    if qtype in (Q.F32, Q.F16) or qtype in GGUF_TO_QUANT:
        return True
    from gguf.quants import dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. Its converter reorders each head's rows from HF's
    rotate-half layout (first half, second half) into interleaved pairs; this restores HF order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class TensorInfo(NamedTuple):
    """A tensor's entry in the file. `shape` is GGUF's order (innermost first: a weight
    [out, in] is (in, out)); `np_shape` is NumPy's."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int      # from the start of the file
    n_bytes: int

    @property
    def np_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Unreadable:
    """A metadata value that does not decode (its key's `get` raises)."""


_UNREADABLE = _Unreadable()


class _Damaged(Exception):
    """Raised inside the parser; becomes one ModelFormatError line naming the file."""


class _Parser:
    """Sequential reader of the header: every count and length is checked against the bytes
    left before anything is allocated or looped over."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos, self.end = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise _Damaged(f"truncated: {what} runs past the end")

    def count(self, n: int, least: int, what: str) -> int:
        """A claimed count of items of at least `least` bytes each, refused if they cannot fit."""
        if n * least > self.end - self.pos:
            raise _Damaged(f"{what} claims {n} items, more than the {self.end - self.pos} bytes "
                           "left can hold (truncated or damaged)")
        return n

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def raw_string(self, what: str) -> memoryview:
        n = self.u64(what)
        self.need(n, what)
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def name(self, what: str) -> str:
        try:
            return str(self.raw_string(what), "utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what} is not UTF-8") from None

    def value_type(self, what: str) -> GGUFValueType:
        t = self.u32(what)
        try:
            return V(t)
        except ValueError:
            raise _Damaged(f"{what} has an unknown value type {t}") from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
        """A value of type `vtype`: numbers and bools as Python values, strings as str (or
        _UNREADABLE), arrays as lists."""
        if vtype in _SCALAR:
            s = _SCALAR[vtype]
            self.need(s.size, what)
            v = s.unpack_from(self.buf, self.pos)[0]
            self.pos += s.size
            return v
        if vtype == V.STRING:
            try:
                return str(self.raw_string(what), "utf-8")
            except UnicodeDecodeError:
                return _UNREADABLE
        # an array
        if depth >= MAX_DEPTH:
            raise _Damaged(f"{what} nests arrays more than {MAX_DEPTH} deep")
        itype = self.value_type(what)
        n = self.u64(what)
        if itype in _NUMBERS:
            dtype = np.dtype(_NUMBERS[itype][1])
            self.count(n, dtype.itemsize, what)
            a = np.frombuffer(self.buf, dtype, n, self.pos)
            self.pos += n * dtype.itemsize
            return (a != 0).tolist() if itype == V.BOOL else a.tolist()
        if itype == V.STRING:
            return self._strings(self.count(n, 8, what), what)
        self.count(n, 12, what)     # arrays: an item type and a count each at least
        items = [self.value(itype, what, depth + 1) for _ in range(n)]
        return _UNREADABLE if any(x is _UNREADABLE for x in items) else items

    def _strings(self, n: int, what: str) -> list[str] | _Unreadable:
        buf, pos, end, u64 = self.buf, self.pos, self.end, _U64.unpack_from
        out = [None] * n
        bad = False
        for i in range(n):
            if end - pos < 8:
                raise _Damaged(f"truncated: {what} runs past the end")
            k = u64(buf, pos)[0]
            pos += 8
            if k > end - pos:
                raise _Damaged(f"truncated: {what} runs past the end")
            try:
                out[i] = str(buf[pos:pos + k], "utf-8")
            except UnicodeDecodeError:
                bad = True
            pos += k
        self.pos = pos
        return _UNREADABLE if bad else out


def _parse(buf: memoryview, size: int) -> tuple[int, dict[str, Any], dict[str, TensorInfo], int]:
    """(version, metadata, tensors, alignment) of a GGUF file's bytes (magic already checked)."""
    p = _Parser(buf)
    p.pos = 4
    version = p.u32("the version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16:
            raise _Damaged("a big-endian GGUF file; tinyrt reads little-endian ones")
        raise _Damaged(f"GGUF version {version}; tinyrt reads versions 2 and 3")
    n_tensors = p.count(p.u64("the tensor count"), 24, "the tensor count")
    n_kv = p.count(p.u64("the metadata count"), 13, "the metadata count")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.name("a metadata key")
        if key in meta:
            raise _Damaged(f"metadata key {key!r} appears twice")
        meta[key] = p.value(p.value_type(f"metadata {key!r}"), f"metadata {key!r}")
    align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise _Damaged(f"general.alignment {align!r} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        name = p.name("a tensor name")
        what = f"tensor {name}"
        n_dims = p.u32(what)
        if n_dims > MAX_DIMS:
            raise _Damaged(f"{what} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = tuple(p.u64(what) for _ in range(n_dims))
        t = p.u32(what)
        try:
            qtype = Q(t)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _Damaged(f"{what} has an unknown type {t}") from None
        offset = p.u64(what)
        if dims and dims[0] % block:
            raise _Damaged(f"{what} has rows of {dims[0]}, not whole {qtype.name} blocks of {block}")
        if offset % align:
            raise _Damaged(f"{what} is not aligned to {align} bytes")
        infos.append((name, dims, qtype, offset, math.prod(dims) // block * type_size))
    data = -(-p.pos // align) * align
    tensors: dict[str, TensorInfo] = {}
    for name, dims, qtype, offset, n_bytes in infos:
        if name in tensors:
            raise _Damaged(f"tensor {name} appears twice")
        if data + offset + n_bytes > size:
            raise _Damaged(f"truncated: tensor {name} runs past the end")
        tensors[name] = TensorInfo(name, dims, qtype, data + offset, n_bytes)
    return version, meta, tensors, align


class GGUFFile:
    """A GGUF model file: metadata, HF config, tensors (float on demand, or quantized as the
    runtime holds them: `hf_linear`), all read from a read-only memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # (a directory, a FIFO, a device or a symlink loop under the name: one line, no hang)
        opened = open_regular(self.path, missing_ok=True, error=ModelFormatError)
        if opened is None:
            raise ModelFormatError(f"{self.path} is missing")
        f, info = opened
        size = info.st_size
        with f:
            try:
                magic = f.read(4)
                if magic != b"GGUF":
                    raise ModelFormatError(f"{self.path} is not a GGUF file (bad magic {magic!r})")
                self._bytes = map_file(f).view(np.ndarray)
            except OSError as e:    # /proc/self/mem: a "regular file" that cannot be read
                raise ModelFormatError(f"cannot read {self.path}: {e.strerror or e}") from None
        try:
            self.version, self.metadata, self.tensors, self.alignment = _parse(
                memoryview(self._bytes), size)
        except _Damaged as e:
            msg = str(e)
            if msg.startswith("truncated"):
                raise ModelFormatError(f"{self.path} is truncated ({msg[len('truncated: '):]})") from None
            raise ModelFormatError(f"{self.path} is not a readable GGUF file ({msg})") from None
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise ModelFormatError(f"{self.path}: metadata general.architecture is missing or "
                                   "not a string")
        try:
            self.family = gguf_family(self.arch)
        except ModelFormatError as e:
            raise ModelFormatError(f"{self.path}: {e}") from None
        self._layer_names = {g: hf for hf, g in self.family.model.gguf_layer.items()}
        self._gguf_names = {h: n for n in self.tensors if (h := hf_name(n, self._layer_names))}

    def drop_arrays(self, prefix: str) -> None:
        """Forget the array values of the metadata keys that start with `prefix` (the memory
        they hold: a vocabulary of 50k tokens and its merges take ~10 MB as Python strings)."""
        self.metadata = {k: v for k, v in self.metadata.items()
                         if not (k.startswith(prefix) and isinstance(v, list))}

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalars as Python values, arrays as lists)."""
        v = self.metadata.get(key, default)
        if v is _UNREADABLE:
            raise ModelFormatError(f"{self.path}: metadata {key!r} is unreadable")
        return v

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def _int(self, key: str, default: Any = None, per_layer: bool = False) -> Any:
        """An integer of the architecture's metadata (None if absent and no default). With
        `per_layer`, GGUF may also give one value per layer (a head count): accepted when all
        are equal, since tinyrt runs models whose layers are alike."""
        v = self._arch(key, default)
        if per_layer and isinstance(v, list) and v and all(type(x) is int for x in v):
            if len(set(v)) > 1:
                raise ModelFormatError(f"{self.path}: metadata {self.arch}.{key} differs between "
                                       f"layers ({min(v)} to {max(v)}); tinyrt runs models whose "
                                       "layers are alike")
            v = v[0]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ModelFormatError(f"{self.path}: metadata {self.arch}.{key} is not an integer")
        return v

    def _float(self, key: str, default: float | None) -> float:
        """A number of the architecture's metadata (its range is ModelConfig's to check)."""
        v = self._arch(key, default)
        if v is None:
            raise ModelFormatError(f"{self.path}: metadata {self.arch}.{key} is missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelFormatError(f"{self.path}: metadata {self.arch}.{key} is not a number")
        return float(v)

    def config(self) -> dict[str, Any]:
        """The HF config.json this file describes, its values checked as config.json's are
        (ModelConfig) and its sizes against the file's tensors."""
        need = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
        missing = [k for k in need if self._arch(k) is None]
        if missing:
            lacks = ", ".join(f"{self.arch}.{k}" for k in missing)
            raise ModelFormatError(f"{self.path}: metadata lacks {lacks}")
        hidden = self._int("embedding_length")
        heads = self._int("attention.head_count", per_layer=True)
        # the layer count bounds every per-layer table built from this config (a converter's
        # list of expected tensors first): no more layers than the file has tensors of
        blocks, held = self._int("block_count"), held_layers(self._gguf_names)
        if blocks > held:
            raise ModelFormatError(f"{self.path}: metadata {self.arch}.block_count is {blocks}, "
                                   f"but the file holds tensors of {held} layers")
        head_dim = self._int("attention.key_length", hidden // max(heads, 1))
        rot = self._int("rope.dimension_count")
        tokens = self.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) and tokens else self._int("vocab_size")
        if "token_embd.weight" in self.tensors:
            shape = self.tensors["token_embd.weight"].shape
            if len(shape) != 2:
                raise ModelFormatError(f"{self.path}: token_embd.weight {list(shape[::-1])} is "
                                       "not a matrix")
            vocab = shape[1]
        if vocab is None:
            raise ModelFormatError(f"{self.path}: no vocabulary size (no tokens, no "
                                   f"{self.arch}.vocab_size, no token_embd.weight)")
        cfg = {
            "architectures": [self.family.architecture],
            "model_type": self.family.model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._int("feed_forward_length"),
            "num_hidden_layers": blocks,
            "num_attention_heads": heads,
            "num_key_value_heads": self._int("attention.head_count_kv", heads, per_layer=True),
            "head_dim": head_dim,
            "max_position_embeddings": self._int("context_length", 2048),
            "rms_norm_eps": self._float("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": self._float("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if rot is not None and rot != head_dim:
            cfg["partial_rotary_factor"] = rot / head_dim
            if type(rot) is not int or int(head_dim * (rot / head_dim)) != rot:
                raise ModelFormatError(f"{self.path}: metadata {self.arch}.rope.dimension_count "
                                       f"{rot} is not a share of head dim {head_dim}")
        cfg = self.family.gguf_config(cfg, self._int("attention.sliding_window") or None)
        scaling = self._rope_scaling(cfg)
        if scaling:
            cfg["rope_scaling"] = scaling
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            v = self.get(f"tokenizer.ggml.{name}")
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ModelFormatError(f"{self.path}: metadata tokenizer.ggml.{name} is not "
                                           "an integer")
                cfg[key] = v
        ModelConfig.from_dict(cfg, str(self.path))       # the ranges, as for a config.json
        return cfg

    def _rope_scaling(self, cfg: dict) -> dict | None:
        if "rope_factors_long.weight" in self.tensors:        # longrope (Phi-3's converter)
            original = self._int("rope.scaling.original_context_length")
            cfg["original_max_position_embeddings"] = original
            return {"rope_type": "longrope", "original_max_position_embeddings": original,
                    "attention_factor": self._float("rope.scaling.attn_factor", None),
                    **{f"{k}_factor": self.tensor(f"rope_factors_{k}.weight").astype(float).tolist()
                       for k in ("long", "short")}}
        kind = self._arch("rope.scaling.type")
        if kind in (None, "none") and "rope_freqs.weight" not in self.tensors:
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": self._float("rope.scaling.factor", None)}
        if kind not in (None, "none"):
            raise ModelFormatError(f"{self.path}: rope scaling {kind!r} is not supported")
        # Llama 3.1 files store the per-frequency divisors as a tensor, not the parameters. Accept
        # them only if the standard llama3 parameters reproduce the tensor.
        from tinyrt.models.rope import rope_inv_freq

        info, d = self.tensors["rope_freqs.weight"], cfg["head_dim"]
        if info.shape != (d // 2,):       # (checked before head_dim sizes any table)
            raise ModelFormatError(f"{self.path}: tensor rope_freqs.weight has shape "
                                   f"{list(info.np_shape)}, head_dim {d} needs [{d // 2}]")
        freqs = self.tensor("rope_freqs.weight").astype(np.float64)
        no_match = ModelFormatError(f"{self.path}: its rope_freqs tensor matches no rope scaling "
                                    "that tinyrt knows")
        if not (np.isfinite(freqs).all() and freqs.min() >= 1):    # divisors: 1 keeps a frequency
            raise no_match
        scaling = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        base = ModelConfig.from_dict({**cfg, "rope_scaling": None}, str(self.path))
        scaled = ModelConfig.from_dict({**cfg, "rope_scaling": scaling}, str(self.path))
        if np.allclose(rope_inv_freq(base) / rope_inv_freq(scaled), freqs, rtol=1e-3):
            return scaling
        raise no_match

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self.tensors[name].tensor_type

    def release(self) -> None:
        """Drop the file's pages from this process's resident memory (views read later fault
        them back in, from the OS's file cache)."""
        release_pages(self._bytes)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's stored bytes, uint8 [rows, bytes_per_row] (a read-only view of the file;
        rows = every dimension but the innermost)."""
        t = self.tensors[name]
        rows = math.prod(t.shape[1:])
        data = self._bytes[t.data_offset:t.data_offset + t.n_bytes]
        return data.reshape(rows, t.n_bytes // rows if rows else 0)

    def rows(self, name: str, ids=slice(None)) -> np.ndarray:
        """Rows `ids` of a tensor (every dimension but the innermost counted as rows) as float
        [n, inner]: float32, float16 as stored, other types dequantized to float32."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        raw = self.raw(name)[ids]
        if t.tensor_type == Q.F32:
            return raw.view(np.float32)
        if t.tensor_type == Q.F16:
            return raw.view(np.float16)
        try:
            # (broken blocks give NaN or inf, which the load's finite check names in one line;
            # NumPy's warnings would add lines of their own)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                return dequantize(raw, t.tensor_type).reshape(len(raw), t.shape[0])
        except NotImplementedError:
            raise ModelFormatError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, "
                                   "which the gguf package cannot dequantize") from None

    def finite(self, name: str) -> bool:
        """Whether tensor `name` holds finite values only: float types by their values, block
        types by their blocks' float16 fields (FLOAT_FIELDS), others dequantized a few thousand
        rows at a time."""
        t = self.tensors[name]
        if t.tensor_type in FLOAT_FIELDS:
            return finite_scales(self.raw(name), t.tensor_type)
        rows, step = math.prod(t.shape[1:]), 4096
        return all(all_finite(self.rows(name, slice(i, i + step))) for i in range(0, rows, step))

    def tensor(self, name: str) -> np.ndarray:
        """A GGUF tensor dequantized to float32 (float16 stays float16), numpy shape order."""
        return self.rows(name).reshape(self.tensors[name].np_shape)

    def layer_types(self) -> set[GGMLQuantizationType]:
        """The types of the decoder layers' matrices."""
        return {t.tensor_type for n, t in self.tensors.items()
                if n.startswith("blk.") and len(t.shape) == 2}

    def _qk_heads(self, hf: str, name: str, rows: int) -> int | None:
        """The number of heads whose rows llama.cpp permuted in this q/k tensor, or None."""
        if not (self.family.gguf_permuted_qk and hf.endswith(("q_proj.weight", "k_proj.weight"))):
            return None
        heads = self._int("attention.head_count", per_layer=True)
        if hf.endswith("k_proj.weight"):
            heads = self._int("attention.head_count_kv", heads, per_layer=True)
        if type(heads) is not int or heads <= 0 or rows % (2 * heads):
            raise ModelFormatError(f"{self.path}: tensor {name} with {rows} rows does not "
                                   f"split into {heads} heads")
        return heads

    def hf_tensor(self, hf: str) -> np.ndarray:
        """A tensor by its HF name, in HF layout (Q/K rows un-permuted; a Gemma norm's weight
        w where llama.cpp stores 1 + w), float."""
        name = self._gguf_names[hf]
        w = self.tensor(name)
        shift = self.family.model.norm_shift
        if shift and hf.endswith("norm.weight"):
            return w.astype(np.float32) - np.float32(shift)
        heads = self._qk_heads(hf, name, w.shape[0])
        return w if heads is None else unpermute(w, heads)

    def hf_linear(self, hf_module: str) -> QuantWeight | np.ndarray:
        """A linear layer's weight [out, in] by its HF module name ("model.layers.0.mlp.up_proj";
        "model.embed_tokens" for a tied head), in HF layout (llama.cpp's Q/K row permutation
        undone on codes, scales and offsets alike): a QuantWeight, exactly, when the file's type
        has a quantized form in the runtime (models/gguf_quants.py), else float (F32 / F16 as
        stored, other types dequantized to float32). KeyError if the file has no such tensor."""
        hf = f"{hf_module}.weight"
        name = self._gguf_names[hf]
        t = self.tensors[name]
        if t.tensor_type not in GGUF_TO_QUANT:
            return self.hf_tensor(hf)
        if len(t.shape) != 2:
            raise ModelFormatError(f"{self.path}: tensor {name} {list(t.np_shape)} is not a matrix")
        raw = self.raw(name)
        w = to_quant(raw, t.tensor_type, t.shape[0])
        release_pages(raw)         # read once: the file's pages need not stay beside the copy
        heads = self._qk_heads(hf, name, t.shape[1])
        if heads is None:
            return w
        return w.rows(unpermute(np.arange(w.shape[0]), heads))

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {hf: self.tensors[n].np_shape for hf, n in self._gguf_names.items()}

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.hf_shapes().values())


class GGUFRows:
    """A GGUF table [V, H] read a few rows at a time (the embedding): `table[ids]` -> float32
    rows, dequantized from the file's bytes as they are indexed; nothing else is held."""

    def __init__(self, gguf: GGUFFile, name: str):
        self.file, self.name = gguf, name
        self.pages = gguf.raw(name)          # uint8 [V, bytes per row], a view of the file
        self.shape = gguf.tensors[name].np_shape

    def __getitem__(self, ids) -> np.ndarray:
        return self.file.rows(self.name, ids).astype(np.float32, copy=False)

    def finite(self) -> bool:
        return self.file.finite(self.name)


class GGUFWeights(ModelWeights):
    """A GGUF file's weights, run in place: each linear layer of a quantized type the runtime
    holds (models/gguf_quants.py) as that quantized form, exactly; float tensors as stored; any
    other type (Q2_K, Q3_K, IQ*, ...) dequantized to float at load (see `float_fallbacks`)."""

    def __init__(self, path: str | Path, dtype: str | None = None):
        super().__init__(dtype)
        self.file = g = GGUFFile(path)
        self.name = str(path)
        self.config = ModelConfig.from_dict(g.config(), self.name)
        g.drop_arrays("tokenizer.")        # the tokenizer reads the file on its own
        self.check_shapes(g.hf_shapes())
        self._quantized = bool(g.layer_types() & set(GGUF_TO_QUANT))
        self.nbytes = g._bytes.nbytes        # (the file as mapped: no second look at the path)

    config_name = "its metadata"

    # llama.cpp's sampling keys (its converter writes them from generation_config.json) -> the
    # names generation_config.json gives them
    SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                "general.sampling.penalty_repeat": "repetition_penalty"}

    def sampling(self) -> dict:
        """The sampling settings the file's metadata asks for, under generation_config.json's
        names (values as stored: the caller checks them)."""
        return {hf: self.file.get(key) for key, hf in self.SAMPLING.items()
                if self.file.get(key) is not None}

    def _stored_name(self, hf: str) -> str:
        gguf = self.file._gguf_names.get(hf)
        return f"{gguf} ({hf})" if gguf else hf

    def _check_type(self, hf: str) -> None:
        name = self.file._gguf_names[hf]
        t = self.file.tensors[name]
        if not readable(t.tensor_type):
            raise ModelFormatError(
                f"{self.name}: tensor {name} ({hf}) is {t.tensor_type.name} "
                f"{list(t.np_shape)}, expected a float or quantized type (F32, F16, BF16, "
                f"Q4_0, ..., Q8_0, K-quants, IQ types)")

    def _tensor(self, name: str) -> np.ndarray:
        return self.file.hf_tensor(name)

    def _linear(self, module: str):
        return self.file.hf_linear(module)

    def _embedding(self):
        return GGUFRows(self.file, "token_embd.weight")

    def _head(self):
        return self.file.hf_linear("model.embed_tokens" if self.config.tie_word_embeddings
                                   else "lm_head")

    def release(self) -> None:
        self.file.release()

    def float_fallbacks(self) -> dict[str, str]:
        """Linear tensors (GGUF name -> type) whose type has no quantized form in the runtime:
        they run as float."""
        return {n: t.tensor_type.name for n, t in self.file.tensors.items()
                if len(t.shape) == 2 and t.tensor_type not in GGUF_TO_QUANT
                and t.tensor_type not in (Q.F32, Q.F16) and n != "token_embd.weight"}

    def _stored_types(self):
        for hf, name in self.file._gguf_names.items():
            module, _, part = hf.rpartition(".")
            if part == "weight":
                yield module, self.file.tensor_type(name).name

    def _form(self, stored: str) -> tuple[int, int] | None:
        return FORMS.get(Q[stored])
