"""No code path can load a pickle: a model file is untrusted input, and unpickling runs code."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(r"\bimport\s+(c?pickle|dill|joblib|shelve|marshal)\b|\bfrom\s+(c?pickle|dill|joblib"
                       r"|shelve|marshal)\b|torch\.load\(|allow_pickle\s*=\s*True|\.load_state_dict\(|"
                       r"np\.load\(|numpy\.load\(|__reduce__")


def sources():
    for folder in ("tinyrt", "models", "kernels", "converters", "benchmarks", "examples"):
        yield from (ROOT / folder).rglob("*.py")


def test_sources_never_unpickle():
    files = list(sources())
    assert len(files) > 20
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
             for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             if FORBIDDEN.search(line)]
    assert not found, "\n".join(found)


def test_the_scan_finds_what_it_looks_for():
    for line in ("import pickle", "from pickle import loads", "w = torch.load(path)",
                 "np.load(f, allow_pickle=True)", "import joblib"):
        assert FORBIDDEN.search(line), line
