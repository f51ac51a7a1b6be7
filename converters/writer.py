"""Writing a model directory atomically: everything goes into a hidden temporary directory beside
the target, which is renamed into place only when complete. An interrupted conversion leaves the
old output (or none), never a half-written one; temporaries of dead runs (each marked as
tinyrt's by a manifest from the start) are swept up.

Every output holds MANIFEST, the names and sizes of the files tinyrt wrote into it. `--force`
replaces only such a directory, holding nothing but those files, and never one that is or holds
the source: what tinyrt did not write, it never deletes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from tinyrt.errors import TinyrtError
from tinyrt.paths import MAX_JSON_BYTES, read_json, shown_path, stat_or_none

from .sources import TOKENIZER_FILES

MANIFEST = "tinyrt-convert.json"
WRITTEN_BY = "tinyrt convert"
# the files a conversion writes (a model directory's): all of tinyrt's that a killed one's
# temporary directory can hold
_OUTPUTS = {MANIFEST, "config.json", "generation_config.json", "model.safetensors",
            "model.safetensors.index.json", *TOKENIZER_FILES}
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _real(path: Path) -> Path:
    """`path` with every symlink resolved: the directory a rename of the output acts on (renaming
    the link itself would replace the link and leave what it points to behind)."""
    try:
        return Path(os.path.realpath(path))
    except (OSError, RuntimeError) as e:          # a symlink loop, a name too long
        raise TinyrtError(f"cannot use {shown_path(path)}: {e}") from None


def _manifest(directory: Path) -> dict[str, int] | None:
    """The files tinyrt wrote into `directory` (name -> size), None for a directory tinyrt did not
    write."""
    try:
        m = read_json(directory / MANIFEST, limit=MAX_JSON_BYTES, missing_ok=True)
    except TinyrtError:
        return None
    files = m.get("files") if m and m.get("written_by") == WRITTEN_BY else None
    if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
        return None
    return files


def _not_ours(directory: Path) -> str | None:
    """Why `directory` is not an output of tinyrt's that may be replaced whole, or None: it must
    hold MANIFEST and nothing but the regular files it lists, of the sizes it lists."""
    if not directory.is_dir():
        return "is not a directory"
    files = _manifest(directory)
    if files is None:
        return f"has no {MANIFEST}: tinyrt did not write it"
    try:
        with os.scandir(directory) as entries:
            for e in entries:
                if e.name == MANIFEST:
                    continue
                if e.name not in files:
                    return f"holds {e.name!r}, which tinyrt did not write"
                if not e.is_file(follow_symlinks=False) or \
                        e.stat(follow_symlinks=False).st_size != files[e.name]:
                    return f"holds {e.name!r}, changed since tinyrt wrote it"
    except OSError as e:
        return f"cannot be listed ({e.strerror or e})"
    return None


def check_output(out: Path, force: bool = False, src: Path | None = None) -> Path:
    """The real directory the output `out` will be (where a symlink `out` points), after checking
    that writing it replaces nothing but an output of tinyrt's (and that only with `force`), and
    neither is nor holds `src`. TinyrtError otherwise."""
    target = _real(out)
    if src is not None:
        real_src = _real(src)
        if real_src == target or target in real_src.parents:
            raise TinyrtError(f"OUT {shown_path(out)} is or holds SRC {shown_path(src)}: refusing to "
                              "write over the source")
    if stat_or_none(out, "OUT") is None:
        return target                  # nothing there (a symlink `out` is written where it points)
    if not force:
        raise TinyrtError(f"{shown_path(out)} already exists (use --force to replace it)")
    why = _not_ours(target)
    if why:
        raise TinyrtError(f"OUT {shown_path(out)} {why}; --force replaces only a model directory "
                          "tinyrt wrote (remove it yourself if it is to go)")
    return target


def _remove_output(directory: Path) -> None:
    """An output of tinyrt's, moved aside: the files in it that its manifest lists (then the
    directory, if that left it empty). The names come from the directory's own listing, never
    from the manifest: "../x" in one would name a file elsewhere."""
    files = _manifest(directory)
    if files is not None:
        _remove_files(directory, lambda e: e.name in files or e.name == MANIFEST)


def _remove_temporary(directory: Path) -> None:
    """A killed conversion's temporary directory (its manifest marks it as tinyrt's): the files
    of the names a conversion writes (then the directory, if that left it empty)."""
    _remove_files(directory, lambda e: (e.name in _OUTPUTS or _SHARD.fullmatch(e.name))
                  and e.is_file(follow_symlinks=False))


def _remove_files(directory: Path, ours) -> None:
    """The entries of `directory` that `ours(entry)` picks, the manifest last (the mark that
    they are tinyrt's), then the directory if that left it empty: anything else in it is not
    tinyrt's to delete."""
    try:
        with os.scandir(directory) as entries:
            names = [e.name for e in entries if ours(e)]
    except OSError:
        return
    for name in sorted(names, key=lambda n: n == MANIFEST):
        with contextlib.suppress(OSError):
            os.unlink(directory / name)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def sweep_stale(target: Path) -> None:
    """Remove what conversions that were killed left beside `target`: their temporary directories
    (ours by name, and by the pid of a process that is gone) and outputs they had moved aside."""
    prefix = f".{target.name}."
    try:
        names = [e.name for e in os.scandir(target.parent) if e.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        p = target.parent / name
        kind, _, pid = name[len(prefix):].rpartition("-")
        if not pid.isdigit() or _pid_alive(int(pid)) or p.is_symlink() or not p.is_dir():
            continue
        if kind == "tmp" and _manifest(p) is not None:     # marked as tinyrt's when made
            _remove_temporary(p)
        elif kind == "old":
            _remove_output(p)


@contextlib.contextmanager
def atomic_directory(out: str | Path, force: bool = False, src: str | Path | None = None
                     ) -> Iterator[Path]:
    """Yields a temporary directory to fill; on success it becomes `out` (see check_output for
    what may be replaced), with a MANIFEST of the files in it."""
    out = Path(out)
    src = Path(src) if src is not None else None
    target = check_output(out, force, src)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TinyrtError(f"cannot create {shown_path(out)}: {e.strerror or e}") from None
    sweep_stale(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    if not tmp.is_symlink() and _manifest(tmp) is not None:
        _remove_temporary(tmp)                   # this process's own, from an earlier call
    try:
        tmp.mkdir()
    except OSError as e:                         # there, and not tinyrt's: left as it is
        raise TinyrtError(f"cannot write {shown_path(out)}: {shown_path(tmp)}: {e.strerror or e}") from None
    try:
        # a manifest of no files from the start: what a killed run leaves is known as tinyrt's
        (tmp / MANIFEST).write_text(json.dumps({"written_by": WRITTEN_BY, "files": {}}),
                                    encoding="utf-8")
        yield tmp
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.name != MANIFEST}
        (tmp / MANIFEST).write_text(json.dumps({"written_by": WRITTEN_BY, "files": files},
                                               indent=1) + "\n", encoding="utf-8")
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        # again: OUT may have changed during a long conversion
        if check_output(out, force, src) != target:
            raise TinyrtError(f"{shown_path(out)} changed during the conversion (nothing was written)")
        if os.path.lexists(target):
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp, target)
            _remove_output(old)
        else:
            os.replace(tmp, target)
    except OSError as e:          # a full disk, a read-only or vanished directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise TinyrtError(f"cannot write {shown_path(out)}: {e.strerror or e} (nothing was written)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
