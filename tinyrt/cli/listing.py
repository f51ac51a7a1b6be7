"""`tinyrt list`: the models tinyrt has fetched, those of the Hugging Face cache it can run, and
the size of its compiled kernels."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    sub.add_parser("list", help="list cached models",
                   description="List the models in tinyrt's cache (which `tinyrt rm` removes) "
                               "and those in the Hugging Face cache that tinyrt can run (left to "
                               "huggingface_hub's `hf cache`), by the names MODEL takes, with "
                               "their sizes; and the size of Numba's cache of compiled kernels.")


def size_text(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# the packages with cache=True kernels (each package's own __pycache__: its subpackages too)
KERNEL_PACKAGES = ("tinyrt.kernels", "tinyrt.kernels.cpu", "tinyrt.kernels.cuda", "tinyrt.models",
                   "tinyrt.converters")


def kernel_cache() -> tuple[list[Path], int] | None:
    """The directories where Numba keeps tinyrt's compiled kernels and their files' size; None
    where Numba's internals are not as read here. Numba writes a kernel's cache files (named
    after its module: cpu.rmsnorm-123.py311.nbi, ...) beside its source in __pycache__, or under
    NUMBA_CACHE_DIR, or, where __pycache__ is read-only, in its user-wide cache directory; the
    latter two in a subdirectory named after the source's directory."""
    import importlib.util

    try:
        from numba.core import caching, config
        from numba.misc.appdirs import AppDirs

        places = []               # (a directory Numba may write to, the module names there)
        for package in KERNEL_PACKAGES:
            spec = importlib.util.find_spec(package)
            source = Path(next(iter(spec.submodule_search_locations)))
            stems = {f.stem for f in source.glob("*.py")}
            sub = caching._CacheLocator.get_suitable_cache_subpath(str(source / "__init__.py"))
            dirs = ([Path(config.CACHE_DIR) / sub] if config.CACHE_DIR else
                    [source / "__pycache__",
                     Path(AppDirs("numba", appauthor=False).user_cache_dir) / sub])
            places += [(d, stems) for d in dirs]
    except (ImportError, AttributeError, TypeError, StopIteration):
        return None
    found, total = [], 0
    for d, stems in places:
        try:
            files = [f for f in d.iterdir() if f.suffix in (".nbi", ".nbc")
                     and f.name.split(".", 1)[0] in stems]
            total += sum(f.stat().st_size for f in files)
        except OSError:
            continue
        if files:
            found.append(d)
    return found, total


def main(args: argparse.Namespace) -> int:
    from tinyrt.model_cache import cache_dir, tinyrt_cached
    from tinyrt.registry import hf_cached, hf_hub_cache

    from tinyrt.errors import printable

    # (a name and a source are a file's and a record's: shown safe, and measured as shown)
    rows = [tuple(map(printable, (m.name, size_text(m.size), m.owner, m.source)))
            for m in tinyrt_cached() + hf_cached()]
    if rows:
        # plain columns, not a rich table: piped output must not wrap or cut a long name
        rows.insert(0, ("MODEL", "SIZE", "CACHE", "FROM"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)), row[3], sep="  ")
        print(printable(f"tinyrt's cache: {cache_dir()} (`tinyrt rm NAME`, `tinyrt rm --all`); "
                        f"the Hugging Face cache: {hf_hub_cache()} (`hf cache rm`)"))
    else:
        print(printable(f"No models cached (tinyrt's cache: {cache_dir()}; the Hugging Face "
                        f"cache: {hf_hub_cache()}). `tinyrt pull` fetches the default model."))
    kernels = kernel_cache()
    if kernels is not None:
        where, total = kernels
        print(f"compiled kernels (Numba's cache, compiled again when removed): {size_text(total)}"
              + (f" in {', '.join(map(str, where))}" if where else ""))
    return 0
