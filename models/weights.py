"""safetensors files: a memory-mapped reader (no copies) and a streaming writer.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N, N
bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the tensor bytes; offsets count from the end of the header. The `safetensors` package reads the
files we write and we read its files (tests check both ways). We read it ourselves because the
package copies every tensor into memory, while a runtime wants pages mapped straight from the file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from tinyrt.errors import ModelFormatError
from tinyrt.paths import open_regular, read_json

# safetensors dtype -> numpy dtype. BF16 has no numpy type: it is read as uint16 bits.
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
          np.dtype(np.int8): "I8", np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32",
          np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
# what each kind of tensor may be stored as: weights, norms, biases and AWQ scales are floats;
# AWQ's packed codes and zero points are 32-bit words of eight nibbles
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
SCALE_DTYPES = ("F16", "BF16", "F32")  # (kernels.quant holds scales as float32 values at most)
PACKED_DTYPES = ("I32", "U32")
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit
MAX_DIMS = 8                    # no model tensor has more (NumPy's limit is 64)


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of a float array is finite (no NaN, no inf); any other array is.
    In chunks (no temporary the size of a model's tensor); float16 by its bits: NumPy's isfinite
    on float16 takes ~2.4 ns a value, the exponent's bits ~0.13 ns (float32: ~0.2 ns)."""
    flat = np.asarray(a).reshape(-1)
    if flat.dtype.kind != "f":
        return True
    step = 1 << 18
    if flat.dtype == np.float16:
        bits = flat.view(np.uint16)
        return all(int((bits[i:i + step] & 0x7FFF).max()) < 0x7C00
                   for i in range(0, bits.size, step))
    return all(np.isfinite(flat[i:i + step]).all() for i in range(0, flat.size, step))


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: the high half of an f32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def map_file(f) -> np.ndarray:
    """The open file `f` mapped read-only as bytes: from the descriptor checked, not from the
    path opened again. Its weights are read there while the model runs, so a bus error (the
    file cut short meanwhile) ends the process in one line (kernels.sigbus)."""
    from tinyrt.kernels import sigbus

    sigbus.install()
    return np.memmap(f, np.uint8, mode="r")


class SafetensorsFile:
    """One .safetensors file, mapped read-only. `get(name)` returns a view into the mapping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        # (a directory, a FIFO, a device or a symlink loop under the name: one line, no hang)
        opened = open_regular(self.path, missing_ok=True, error=ModelFormatError)
        if opened is None:
            raise ModelFormatError(f"{self.path} is missing")
        f, info = opened
        size = info.st_size
        bad = f"{self.path} is not a safetensors file"
        with f:
            if size < 8:
                raise ModelFormatError(f"{bad} (only {size} bytes)")
            try:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(MAX_HEADER, size - 8):
                    raise ModelFormatError(f"{bad} (header length {n} exceeds the file)")
                raw = f.read(n)
                mapped = map_file(f) if size > 8 + n else None
            except (OSError, struct.error) as e:   # struct.error: it shrank meanwhile
                raise ModelFormatError(f"cannot read {self.path}: "
                                       f"{getattr(e, 'strerror', None) or e}") from None
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError):   # RecursionError: nested too deep
            raise ModelFormatError(f"{bad} (header is not JSON)") from None
        if not isinstance(header, dict):
            raise ModelFormatError(f"{bad} (header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        data_len = size - 8 - n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
                ok = (dtype in DTYPES and len(shape) <= MAX_DIMS
                      and all(isinstance(s, int) and s >= 0 for s in shape)
                      and isinstance(begin, int) and isinstance(end, int))
            except (TypeError, KeyError, ValueError):
                ok = False
            if not ok:
                raise ModelFormatError(f"{bad} (bad header entry for {name!r})")
            # exact (Python ints: an int64 product wraps around); an empty tensor's other
            # dimensions are bounded too, since NumPy refuses an array that could not be addressed
            itemsize = np.dtype(DTYPES[dtype]).itemsize
            nbytes = math.prod(shape) * itemsize
            if math.prod(s for s in shape if s) * itemsize >= 2**62:
                raise ModelFormatError(f"{bad} (tensor {name!r} has a shape too large for "
                                       "any file)")
            if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
                raise ModelFormatError(
                    f"{self.path}: tensor {name!r} ({dtype} {list(shape)}) lies outside the file "
                    f"or has the wrong byte count; the file may be truncated")
            self.entries[name] = (dtype, shape, 8 + n + begin, nbytes)
        self._map = mapped

    def keys(self) -> list[str]:
        return list(self.entries)

    def release(self) -> None:
        """Drop the file's pages from this process's resident memory (the mapping stays: views
        read later fault their pages back in, from the OS's file cache)."""
        if self._map is not None:
            release_pages(self._map)

    def dtype(self, name: str) -> str:
        return self.entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored (BF16 as uint16 bits), a read-only view of the mapped file."""
        dtype, shape, offset, nbytes = self.entries[name]
        if nbytes == 0:
            empty = np.zeros(shape, DTYPES[dtype])
            empty.flags.writeable = False
            return empty
        buf = self._map[offset:offset + nbytes]
        return buf.view(DTYPES[dtype]).reshape(shape)


# where a vision-language checkpoint keeps its text model: (prefix of the decoder's tensors, the
# head's name) as transformers 5 saves it, and as the checkpoints published before it have it
TEXT_MODEL = (("model.language_model.", "lm_head.weight"),
              ("language_model.model.", "language_model.lm_head.weight"))


class WeightStore:
    """All tensors of a model directory: `model.safetensors`, or shards named by
    `model.safetensors.index.json`. Name -> mapped array."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        # read as any JSON file of a model (a FIFO, a loop or a nesting too deep: one line)
        weight_map = read_json(index, missing_ok=True, error=ModelFormatError)
        if weight_map is not None:
            files = self._shards(index, weight_map)
        elif single.exists():
            files = ["model.safetensors"]
        else:
            found = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not found:
                raise ModelFormatError(f"{self.directory} has no .safetensors weights")
            files = found
        self.files = [SafetensorsFile(self.directory / f) for f in files]
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}    # name -> (file, its name there)
        for f in self.files:
            for k in f.keys():
                self._where[k] = (f, k)
        self._text_part()

    def _text_part(self) -> None:
        """A vision-language checkpoint (Gemma 3's 4B and up): its language model's tensors go
        by the names of a text model's, and the rest (the vision tower, its projector) are not
        read. Its text model sits under one of TEXT_MODEL's prefixes, by the transformers
        version that saved it."""
        for prefix, head in TEXT_MODEL:
            if prefix + "embed_tokens.weight" in self._where:
                where = self._where
                self._where = {"model." + k[len(prefix):]: v for k, v in where.items()
                               if k.startswith(prefix)}
                if head in where:
                    self._where["lm_head.weight"] = where[head]
                return

    def _shards(self, index: Path, contents: dict) -> list[str]:
        try:
            weight_map = contents["weight_map"]
            names = sorted(set(weight_map.values()))
        except (KeyError, TypeError, AttributeError):
            raise ModelFormatError(f"{index} is not a valid safetensors index") from None
        for name in names:
            # A shard name comes from a downloaded file: it must name a file in this directory.
            if (not isinstance(name, str) or not name or name != os.path.basename(name)
                    or name in (".", "..") or "\\" in name):
                raise ModelFormatError(f"{index} names a shard outside the model directory: {name!r}")
        return names

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def dtype(self, name: str) -> str:
        f, stored = self._where[name]
        return f.dtype(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        f, stored = self._where[name]
        return f.shape(stored)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ModelFormatError(f"{self.directory}: tensor {name!r} is missing")
        f, stored = self._where[name]
        return f.get(stored)

    def check_dtype(self, name: str, allowed: tuple[str, ...], what: str) -> None:
        """Refuse tensor `name` unless stored as one of `allowed` (safetensors dtypes), before
        its bytes are viewed as that type: an I64 weight read as float, or F16 words unpacked
        as AWQ codes, would be nonsense or a reshape error. `what` says what it holds."""
        if name not in self._where:
            raise ModelFormatError(f"{self.directory}: tensor {name!r} is missing")
        dtype = self.dtype(name)
        if dtype not in allowed:
            raise ModelFormatError(
                f"{self.directory}: tensor {name!r} is {dtype} {list(self.shape(name))}, "
                f"expected {', '.join(allowed[:-1])} or {allowed[-1]} ({what})")

    def get_float(self, name: str) -> np.ndarray:
        """A float tensor as float16/float32 (bfloat16 widened to float32); a tensor of another
        type is refused (check_dtype)."""
        self.check_dtype(name, FLOAT_DTYPES, "a float tensor")
        a = self.get(name)
        if self.dtype(name) == "BF16":
            return bf16_to_f32(a)
        if a.dtype not in (np.float16, np.float32):
            return a.astype(np.float32)
        return a

    def release(self) -> None:
        """Once the backend has prepared its weights: the file pages read while preparing them
        leave the resident set; tensors used as stored (an embedding table) page in as read."""
        for f in self.files:
            f.release()

    @property
    def nbytes(self) -> int:
        return sum(f.entries[stored][3] for f, stored in self._where.values())


def _mapped_root(a) -> np.ndarray | None:
    """The array over a memory map that `a` is a view of, or None."""
    root = a
    while isinstance(root, np.ndarray) and isinstance(root.base, np.ndarray):
        root = root.base
    return root if isinstance(root, np.ndarray) and isinstance(root.base, mmap.mmap) else None


def is_mapped(a) -> bool:
    """Whether the array `a` is a view of a mapped file."""
    return _mapped_root(a) is not None


def release_pages(a) -> None:
    """Drop the pages of `a`, a NumPy view of a mapped file (or a table whose `pages` is one),
    from the resident set; they fault back in from the OS's file cache when read again. Other
    arrays: no-op."""
    a = getattr(a, "pages", a)
    root = _mapped_root(a)
    if root is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = a.ctypes.data - root.ctypes.data
    page = start - start % mmap.PAGESIZE
    root.base.madvise(mmap.MADV_DONTNEED, page, start + a.nbytes - page)


def write_safetensors(path: str | Path, specs: list[tuple[str, np.dtype, tuple[int, ...]]],
                      arrays: Iterable[np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Stream tensors into a safetensors file without holding them all in memory.

    `specs` lists (name, dtype, shape) in file order; `arrays` yields the tensors in that order (a
    generator may compute each one on demand). Each array must match its spec.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in specs:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    it: Iterator[np.ndarray] = iter(arrays)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in specs:
            a = next(it, None)
            if a is None:
                raise ValueError(f"write_safetensors: no array for {name}")
            if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
                raise ValueError(f"write_safetensors: {name} is {a.dtype} {a.shape}, "
                                 f"expected {np.dtype(dtype)} {tuple(shape)}")
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


FLOAT_TYPES = {"f16": np.float16, "f32": np.float32}


def held_layers(names: Iterable[str]) -> int:
    """How many decoder layers the tensors `names` (HF names) belong to: what bounds the layer
    count a config may claim, known before anything is built per layer."""
    return len({n.split(".", 3)[2] for n in names if n.startswith("model.layers.")})


class ModelWeights:
    """What a decoder reads from a model file, whatever its format (a model directory: below;
    a GGUF file: models.gguf): float tensors by HF name, each linear layer as a float weight
    [out, in] or a kernels.quant.QuantWeight, the embedding table (rows read as needed) and the
    LM head. `dtype` "f16" / "f32" asks for float weights throughout (quantized layers
    dequantized at load: the float path); None keeps what is stored.

    A format implements `_tensor`, `_linear`, `_embedding`, `_head`, `release`, `nbytes`,
    `_stored_types` and `_form`; it checks every tensor's presence and shape against the config
    when built (`check_shapes`, which checks each one's stored type too: `_check_type`), and
    each tensor read (`tensor`, `linear`, `embedding`, `head`) for NaN and inf (`_check_finite`)."""

    name: str = ""      # the file or directory, for messages
    config_name = "the config"      # what sets the sizes, for messages

    def sampling(self) -> dict:
        """Sampling settings stored with the weights, under generation_config.json's names (a
        directory has none here: its generation_config.json is the runtime's to read)."""
        return {}

    def check_shapes(self, have: dict[str, tuple[int, ...]]) -> None:
        """Refuse weights (`have`: HF name -> shape) that do not hold the config's model, before
        anything is allocated: first the layer count, against the layers the file holds (the
        expected shapes are listed per layer, and a config that claims 10^8 layers would take
        gigabytes to list), then each tensor's presence and shape (which bounds every other
        size: vocabulary, hidden, heads)."""
        cfg, held = self.config, held_layers(have)
        if cfg.num_hidden_layers > held:
            raise ModelFormatError(f"{self.name}: {self.config_name} claims "
                                   f"{cfg.num_hidden_layers} layers (num_hidden_layers), its "
                                   f"tensors hold {held}")
        for name, shape in cfg.family.model.expected_shapes(cfg).items():
            if name not in have:
                raise ModelFormatError(
                    f"{self.name}: tensor {self._stored_name(name)!r} is missing")
            if tuple(have[name]) != shape:
                raise ModelFormatError(
                    f"{self.name}: tensor {self._stored_name(name)!r} has shape "
                    f"{list(have[name])}, {self.config_name} needs {list(shape)}")
            self._check_type(name)

    def _check_type(self, hf: str) -> None:
        """Refuse tensor `hf` (HF name, present, of the right shape) if it is stored in a type
        its part cannot be read as: at open, before any tensor is viewed as its type."""

    def _stored_name(self, hf: str) -> str:
        """A tensor's name in the file (for messages)."""
        return hf

    def __init__(self, dtype: str | None = None):
        if dtype not in (None, *FLOAT_TYPES):
            raise ValueError(f"unknown weight type {dtype!r} (choose f16 or f32)")
        self.dtype = dtype

    def _float(self, w):
        from tinyrt.kernels.quant import QuantWeight, dequantize

        if self.dtype and isinstance(w, QuantWeight):
            return dequantize(w).astype(FLOAT_TYPES[self.dtype])
        return w

    def linear(self, module: str):
        """Linear layer `module` (HF name without .weight): float [out, in] or QuantWeight."""
        return self._float(self._check_finite(module, self._linear(module)))

    def embedding(self):
        """The embedding table [V, H]: an array, or rows dequantized as indexed (table[ids])."""
        table = self._embedding()
        if self.config.tie_word_embeddings:      # checked as the head, in its read form
            return table                         # (on the default model: 0.3 ms, not 20)
        finite = getattr(table, "finite", None)      # (a table of rows read as indexed)
        if not (finite() if finite else all_finite(table)):
            self._broken("model.embed_tokens", "values")
        return table

    def head(self):
        """The LM head [V, H] (the embedding when tied): float or QuantWeight."""
        module = "model.embed_tokens" if self.config.tie_word_embeddings else "lm_head"
        return self._float(self._check_finite(module, self._head()))

    def tensor(self, name: str) -> np.ndarray:
        """A float tensor by HF name (a norm, a bias)."""
        return self._check_finite(name, self._tensor(name))

    def _check_finite(self, name: str, w):
        """`w` (tensor or module `name`'s float array or QuantWeight), refused if a value or,
        quantized, a scale or offset is NaN or infinite: a model that would produce NaN
        logits, said at load. Scales are 1/16 to 1/32 of a layer's values; a float layer is
        read whole once (~0.2 ns a value, the load's own reading of it costs more)."""
        from tinyrt.kernels.quant import QuantWeight

        quantized = isinstance(w, QuantWeight)
        if not all(map(all_finite, w.arrays if quantized else (w,))):
            self._broken(name, "scales" if quantized else "values")
        return w

    def _broken(self, name: str, what: str):
        stored = self._stored_name(name if name.endswith((".weight", ".bias")) else
                                   name + ".weight")
        if what == "scales":
            stored = self._scales_name(name) or stored
        raise ModelFormatError(f"{self.name}: tensor {stored!r} holds NaN or infinite {what}: "
                               "the model's weights are broken")

    def _scales_name(self, module: str) -> str | None:
        """The stored tensor that holds a quantized layer's scales, if not its weight."""
        return None

    @property
    def quantized(self) -> bool:
        """Whether the decoder layers run on quantized weights."""
        return self.dtype is None and self._quantized

    def _tensor(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def _linear(self, module: str):
        raise NotImplementedError

    def _embedding(self):
        raise NotImplementedError

    def _head(self):
        raise NotImplementedError

    _quantized = False

    def release(self) -> None:
        """Drop the file pages read so far from the resident set (see WeightStore.release)."""

    nbytes = 0

    def float_fallbacks(self) -> dict[str, str]:
        """Linear tensors stored in a quantized type that has no quantized kernel here, which
        therefore run as float: name -> type."""
        return {}

    def _stored_types(self):
        """(HF module name, stored type) of each weight matrix and table in the file (norms
        may be among them)."""
        raise NotImplementedError

    def _tied_head(self, kinds: dict[str, dict[str, int]]) -> dict[str, int]:
        """What a tied LM head is stored as: the embedding's types."""
        return kinds["model.embed_tokens"]

    def stored_kinds(self) -> dict[str, dict[str, int]]:
        """Linear layers and tables by kind (HF module name without its layer: self_attn.q_proj,
        model.embed_tokens, lm_head) -> {stored type: how many}."""
        kinds: dict[str, dict[str, int]] = {}
        for module, t in self._stored_types():
            if "layernorm" in module or module == "model.norm":
                continue
            kind = module.split(".", 3)[3] if module.startswith("model.layers.") else module
            counts = kinds.setdefault(kind, {})
            counts[t] = counts.get(t, 0) + 1
        if self.config.tie_word_embeddings:
            kinds["lm_head"] = self._tied_head(kinds)
        return kinds

    def _form(self, stored: str) -> tuple[int, int] | None:
        """The (bits, group size) a stored type runs as, None for float."""
        raise NotImplementedError

    def describe(self) -> list[tuple[str, str, str]]:
        """(kind, how the file stores it, what it runs as) for each kind of linear layer and
        table: what `tinyrt info` shows."""
        rows = []
        for kind, counts in self.stored_kinds().items():
            stored = ", ".join(t if len(counts) == 1 else f"{t} x {n}" for t, n in counts.items())
            runs = []
            for t in counts:
                form = None if self.dtype else self._form(t)
                if kind == "model.embed_tokens":
                    runs.append("rows dequantized as they are read" if form else "float rows")
                elif form:
                    runs.append(f"W{form[0]}A16 kernel ({form[0]}-bit codes, groups of {form[1]})")
                elif kind == "lm_head" and self.quantized:
                    runs.append("int8 rows (quantized at load)")
                else:
                    runs.append(f"float32 ({self.dtype or 'as stored'})")
            rows.append((kind, stored, "; ".join(dict.fromkeys(runs))))
        return rows


class DirectoryWeights(ModelWeights):
    """A model directory's safetensors weights: float (f32, f16, bf16) or AutoAWQ 4-bit GEMM
    (config.json `quantization_config`, kernels.awq_layout), mapped into kernels.quant's form
    as each layer is read."""

    def __init__(self, directory: str | Path, config, dtype: str | None = None):
        super().__init__(dtype)
        self.store = WeightStore(directory)
        self.name = str(directory)
        self.config = config
        self.check_shapes({n: self.store.shape(n) for n in self.store.keys()})
        self._quantized = config.quant is not None
        self.nbytes = self.store.nbytes

    def _check_type(self, hf: str) -> None:
        if hf.endswith((".qweight", ".qzeros")):
            self.store.check_dtype(hf, PACKED_DTYPES, "AutoAWQ's 4-bit values packed 8 to a "
                                                      "32-bit word")
        elif hf.endswith(".scales"):
            self.store.check_dtype(hf, SCALE_DTYPES, "AutoAWQ's scales")
        else:
            self.store.check_dtype(hf, FLOAT_DTYPES, "a float tensor")

    def _tensor(self, name: str) -> np.ndarray:
        return self.store.get_float(name)

    def _linear(self, module: str):
        if not self._quantized:
            return self.store.get_float(module + ".weight")
        from tinyrt.kernels import awq_layout

        # (types checked at open: _check_type; scales may be bfloat16, hence get_float)
        return awq_layout.to_quant(awq_layout.QuantizedLinear(
            self.store.get(module + ".qweight"), self.store.get(module + ".qzeros"),
            self.store.get_float(module + ".scales")))

    def _scales_name(self, module: str) -> str | None:
        return module + ".scales" if self._quantized else None

    def _embedding(self):
        return self.store.get_float("model.embed_tokens.weight")

    def _head(self):
        tied = self.config.tie_word_embeddings
        return self.store.get_float("model.embed_tokens.weight" if tied else "lm_head.weight")

    def release(self) -> None:
        self.store.release()

    def _stored_types(self):
        for name in self.store.keys():
            module, _, part = name.rpartition(".")
            if part in ("weight", "qweight"):
                yield module, "AWQ" if part == "qweight" else self.store.dtype(name)

    def _tied_head(self, kinds):
        return {"(the embedding)": 1}

    def _form(self, stored: str) -> tuple[int, int] | None:
        return (4, self.config.quant.group_size) if stored == "AWQ" else None
