"""Writing a model directory atomically: everything goes into a hidden temporary directory beside
the target, which is renamed into place only when complete. An interrupted conversion leaves the
old output (or none), never a half-written one; temporaries of dead runs are swept up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from tinyrt.errors import TinyrtError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(out: Path) -> None:
    """Remove temporaries left beside `out` by conversions that were killed."""
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yields a temporary directory to fill; on success it becomes `out`."""
    out = Path(out)
    if out.exists() and not force:
        raise TinyrtError(f"{out} already exists (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as e:          # a full disk, a read-only or vanished directory
        shutil.rmtree(tmp, ignore_errors=True)
        raise TinyrtError(f"cannot write {out}: {e.strerror or e} (nothing was written)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
