"""`tinyrt convert`: a GGUF file or HF directory in, a model directory (docs/DESIGN.md) out —
float weights (method "none") or 4-bit AWQ / round-to-nearest in the AutoAWQ GEMM layout."""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tinyrt.errors import ModelFormatError, TinyrtError, check_int, shown
from tinyrt.kernels import awq_layout
from tinyrt.models import ModelConfig, expected_shapes, linear_shapes
from tinyrt.models.llama import NORMS
from tinyrt.models.weights import all_finite, held_layers, write_safetensors
from tinyrt.paths import shown_path, user_path
from tinyrt.sample_text import default_text

from . import calibration
from .awq import QuantOptions, quantize_model
from .sources import Source, open_source
from .writer import atomic_directory, check_output, write_json

METHODS = ("awq", "rtn", "none")
FLOAT_DTYPES = {"f16": np.float16, "f32": np.float32}
TORCH_DTYPE_NAMES = {"f16": "float16", "f32": "float32"}
GROUP_SIZES = (128, 64, 32)
# the most bytes of tensors per safetensors file, transformers' save_pretrained's and mlx-lm's
# default: files that any filesystem and download take
DEFAULT_SHARD_BYTES = 5 * 10**9

# progress(done, total, what): called as tensors (float) or layers (quantized) are done
Progress = Callable[[int, int, str], None]


def check_tensors(source: Source, cfg: ModelConfig) -> list[str]:
    """The tensors to carry over, in the source's order; a clear error for any missing, misshapen
    or unexpected tensor, before anything is written."""
    held = held_layers(source.shapes)       # (before the per-layer table of expected shapes)
    if cfg.num_hidden_layers > held:
        raise ModelFormatError(f"{source.path}: config.json claims {cfg.num_hidden_layers} layers "
                               f"(num_hidden_layers), its tensors hold {held}")
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in source.shapes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFormatError(f"{source.path}: missing tensors {', '.join(missing[:3])}{more}")
    names = []
    for name, shape in source.shapes.items():
        if name not in expected:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # a tied head some checkpoints store anyway
            raise ModelFormatError(f"{source.path}: unexpected tensor {name!r} for a "
                                   f"{cfg.model_type} model (unsupported variant?)")
        if tuple(shape) != expected[name]:
            raise ModelFormatError(f"{source.path}: tensor {name!r} has shape {list(shape)}, "
                                   f"the config needs {list(expected[name])}")
        names.append(name)
    return names


def choose_group_size(cfg: ModelConfig, requested: int | None) -> int:
    """The requested group size if it divides every linear layer's input, else a clear error; with
    none requested, the largest of 128, 64, 32 that does."""
    dims = linear_shapes(cfg)
    fits = [g for g in GROUP_SIZES if all(i % g == 0 for _, i in dims.values())]
    if any(o % awq_layout.PACK for o, _ in dims.values()):
        raise TinyrtError("a linear layer's output size is not a multiple of 8: the AWQ layout "
                          "cannot hold it")
    if requested is None:
        if not fits:
            raise TinyrtError("no group size of 128, 64 or 32 divides every layer's input")
        return fits[0]
    if requested <= 0:
        raise TinyrtError(f"group size must be positive, got {requested}")
    for name, (_, inp) in dims.items():
        if inp % requested:
            hint = f"sizes that fit every layer: {', '.join(map(str, fits))}" if fits else \
                "no group size of 128, 64 or 32 fits"
            raise TinyrtError(f"group size {requested} does not divide the {inp} inputs of {name} "
                              f"({hint})")
    return requested


def _float_tensors(source: Source, names: list[str], np_dtype, progress: Progress | None):
    for i, name in enumerate(names):
        if progress:
            progress(i, len(names), name)
        yield name, _cast(source.get(name), np_dtype, name, source.path)
    if progress:
        progress(len(names), len(names), "done")


def _cast(a: np.ndarray, np_dtype, name: str, where) -> np.ndarray:
    with np.errstate(over="ignore"):  # checked just below, with a clearer message
        b = a.astype(np_dtype, copy=False)
    if not np.isfinite(b).all():
        reason = "overflows float16 (convert with --dtype f32)" if np.isfinite(a).all() \
            else "holds inf or nan"
        raise ModelFormatError(f"{where}: tensor {name!r} {reason}")
    return b


def _quantized_tensors(source: Source, cfg: ModelConfig, opts: QuantOptions, calib_ids,
                       np_dtype, progress: Progress | None) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of a quantized model in the order of `_quantized_specs`."""
    def own(name):
        return name, _cast(source.get(name), np_dtype, name, source.path)

    yield own("model.embed_tokens.weight")
    layers = quantize_model(cfg, source.get, calib_ids, opts,
                            progress and (lambda d, t: progress(d, t, "layers")))
    for _, tensors in layers:
        for name, t in tensors.items():
            yield name, (t if t.dtype in (np.int32, np.float16) else _cast(t, np_dtype, name, source.path))
    yield own("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield own("lm_head.weight")


def _quantized_specs(cfg: ModelConfig, g: int, np_dtype) -> list[tuple[str, np.dtype, tuple]]:
    """File order of a quantized model, as `_quantized_tensors` yields it: the embedding, each
    layer's tensors as awq.quantize_model yields them, the final norm and the head."""
    qcfg = dataclasses.replace(cfg, quantization_config={"quant_method": "awq", "bits": 4,
                                                         "group_size": g})
    shapes = expected_shapes(qcfg)
    part_dtypes = {"qweight": np.int32, "qzeros": np.int32, "scales": np.float16}

    def spec(name):
        return name, part_dtypes.get(name.rsplit(".", 1)[1], np_dtype), shapes[name]

    specs = [spec("model.embed_tokens.weight")]
    for i in range(cfg.num_hidden_layers):
        specs += [spec(n) for n in shapes if n.startswith(f"model.layers.{i}.")]
    specs.append(spec("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        specs.append(spec("lm_head.weight"))
    return specs


def _nbytes(spec) -> int:
    return int(np.prod(spec[2], dtype=np.int64)) * np.dtype(spec[1]).itemsize


def _shard_plan(specs: list, max_bytes: int) -> list[list]:
    """`specs` (name, dtype, shape) in file order, cut into runs of at most `max_bytes` of
    tensors each (a tensor larger than that alone in its run)."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        n = _nbytes(spec)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _write_shards(directory: Path, specs: list, arrays: Iterator[np.ndarray],
                  max_bytes: int) -> None:
    """The tensors into `model.safetensors`, or, past `max_bytes`, into shards
    model-0000i-of-0000n.safetensors named by model.safetensors.index.json (transformers'
    layout), written one after the other as `arrays` yields them."""
    shards = _shard_plan(specs, max_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(directory / name, shard, itertools.islice(arrays, len(shard)),
                          metadata={"format": "pt"})
    if len(shards) > 1:
        write_json(directory / "model.safetensors.index.json", {
            "metadata": {"total_size": sum(map(_nbytes, specs))},
            "weight_map": {spec[0]: name for name, shard in zip(names, shards) for spec in shard}})


def _checked(specs, named: Iterator[tuple[str, np.ndarray]]) -> Iterator[np.ndarray]:
    """The tensors to write, in order, each finite: NaN or inf in the source (which the runtime
    refuses at load), or a quantization that overflowed float16, stops the conversion with
    nothing written."""
    for (want, _, _), (name, a) in zip(specs, named):
        if name != want:  # a programming error, not bad input
            raise AssertionError(f"tensor order: expected {want}, got {name}")
        if not all_finite(a):
            raise ModelFormatError(f"{name} would hold NaN or infinite values (the source's, or "
                                   "its quantization's past float16): nothing was written")
        yield a


def convert(src: str | Path, out: str | Path, *, method: str = "awq", dtype: str = "f16",
            bits: int = 4, group_size: int | None = None, calib: str | Path | None = None,
            calib_samples: int | None = None,
            calib_seqlen: int = calibration.DEFAULT_SEQLEN, clip: bool = True,
            duo_scaling: bool = True, seed: int = 0, force: bool = False,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Progress | None = None,
            notice: Callable[[str], None] | None = None, requantize: bool = False) -> Path:
    """Convert `src` into the model directory `out`.

    method "none" keeps float weights of `dtype`; "rtn" and "awq" quantize every decoder linear to
    4-bit groups (AWQ calibrates on `calib`, by default the Python documentation, in
    `calib_samples` windows of `calib_seqlen` tokens, by default as many as
    calibration.default_samples chooses for this machine); the other tensors are stored as
    `dtype`. The tensors go in files of at most `max_shard_bytes` each (see _write_shards),
    written to a temporary directory that is renamed into place when complete.
    `notice(text)` hears of anything the user should know before it starts (the calibration
    size chosen). A source whose weights are quantized already (a 4-bit GGUF) is refused with
    "rtn" and "awq", which would round them again, unless `requantize`."""
    if method not in METHODS:
        raise TinyrtError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if dtype not in FLOAT_DTYPES:
        raise TinyrtError(f"unknown dtype {dtype!r} (choose f16 or f32)")
    if method != "none" and bits != 4:
        raise TinyrtError("only 4-bit weights are supported (--w-bit 4)")
    # every number checked before any arithmetic (the calibration's size divides by the
    # sequence length; a seed past 64 bits or below 0 is NumPy's error, not the user's)
    if group_size is not None:
        check_int("--group-size", group_size, 1, 1 << 16)
    if calib_samples is not None:
        check_int("--calib-samples", calib_samples, 1, 1 << 20)
    check_int("--calib-seqlen", calib_seqlen, 2, 1 << 20)
    check_int("--seed", seed, 0, 2**64 - 1)
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise TinyrtError(f"the shard size must be a positive number of bytes, "
                          f"not {shown(max_shard_bytes)}")
    src, out = user_path(src, "SRC"), user_path(out, "OUT")
    check_output(out, force, src)       # at once, before the source is read
    source = open_source(src)
    if source.quantized and method != "none" and not requantize:
        # refused before any work (the default model's AWQ took minutes, to a worse model)
        raise TinyrtError(f"{shown_path(source.path.name)} holds quantized weights "
                          f"({', '.join(source.quantized)}): --method {method} would round them "
                          f"a second time, at a cost in quality; tinyrt runs the file as it is: "
                          f"tinyrt chat -m {shlex.quote(shown_path(source.path))} (--requantize "
                          "converts it anyway)")
    cfg = ModelConfig.from_dict(source.config)
    model = cfg.family.model
    if method == "awq" and (len(model.linears["qkv"]) != 3 or model.norms != NORMS):
        raise TinyrtError(f"--method awq: the AWQ search of {cfg.model_type} models (q, k and v "
                          "one fused projection, or norms of their own kind) is not written "
                          "yet; --method rtn converts them")
    names = check_tensors(source, cfg)
    np_dtype = FLOAT_DTYPES[dtype]
    config = {k: v for k, v in source.config.items() if k != "quantization_config"}
    config["torch_dtype"] = TORCH_DTYPE_NAMES[dtype]
    if method != "none":
        g = choose_group_size(cfg, group_size)
        opts = QuantOptions(method=method, group_size=g, bits=bits, clip=clip,
                            duo_scaling=duo_scaling)
        config["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": g,
                                         "zero_point": True, "version": "gemm"}
        calib_text = None
        if method == "awq":
            calib_text = calibration.read_text(calib) if calib else default_text()
    # (overflow is reported by _checked in one line; NumPy's warnings would add lines)
    with atomic_directory(out, force=force, src=src) as tmp, \
            np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for name, content in source.files.items():
            (tmp / name).write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        if source.generation_config:
            write_json(tmp / "generation_config.json", source.generation_config)
        if method == "none":
            specs = [(n, np_dtype, tuple(source.shapes[n])) for n in names]
            named = _float_tensors(source, names, np_dtype, progress)
        else:
            calib_ids = None
            if method == "awq":
                from tinyrt.tokenizer import load_tokenizer

                n = calib_samples if calib_samples is not None else \
                    calibration.default_samples(cfg, calib_seqlen)
                calib_ids = calibration.calibration_ids(load_tokenizer(tmp).encode, calib_text,
                                                        n, calib_seqlen, seed,
                                                        at_most=calib_samples is None)
                if notice and calib_samples is None:
                    notice(f"calibrating on {len(calib_ids)} samples of {calib_seqlen} tokens, "
                           f"{calibration.DEFAULT_RULE} (--calib-samples "
                           f"{calibration.PAPER_SAMPLES} for the AWQ paper's size)")
            specs = _quantized_specs(cfg, g, np_dtype)
            named = _quantized_tensors(source, cfg, opts, calib_ids, np_dtype, progress)
        _write_shards(tmp, specs, _checked(specs, named), max_shard_bytes)
        write_json(tmp / "config.json", config)
    return out


def bits_per_weight(directory: str | Path) -> tuple[float, float]:
    """(bits per weight of the quantized linears, bits per parameter of the whole file)."""
    from tinyrt.models.weights import WeightStore

    store = WeightStore(directory)
    cfg = ModelConfig.from_file(Path(directory) / "config.json")
    lin_bits = lin_n = 0
    for name, (o, i) in linear_shapes(cfg).items():
        parts = [k for k in store.keys() if k.startswith(name + ".")]
        lin_bits += sum(8 * store.get(k).nbytes for k in parts)
        lin_n += o * i
    other = [k for k in store.keys() if not any(k.startswith(n + ".") for n in linear_shapes(cfg))]
    n_other = sum(int(np.prod(store.shape(k))) for k in other)
    return lin_bits / lin_n, 8 * store.nbytes / (lin_n + n_other)
