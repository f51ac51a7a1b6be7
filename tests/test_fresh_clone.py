"""A new user's first steps: the tests of a fresh clone pass with nothing beside it, and the first
run on a machine says that it compiles the kernels, whose compilation no reply's timings count."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SESSION_SEED, run_tinyrt, tiny_config, write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
# a quick subset of the clone's own tests (its conftest and helpers; no model, no kernels)
QUICK = ["tests/test_config.py", "tests/test_sampling.py"]


# On the path of the clone's processes, run at their start: this checkout's editable install
# (a finder that setuptools appends to sys.meta_path) would supply a module the clone lacks.
SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
"""


def _install_layout(clone: Path, site: Path) -> None:
    """The clone's packages laid out under `site` as an install lays them out (pyproject's
    package-dir: tinyrt/, and models/ as tinyrt/models, ...), in symlinks: with `site` on the
    path, `import tinyrt` imports the clone's code rather than this checkout's (the editable
    install), so that a file missing from the commit fails here as it would for a user."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    pyproject = tomllib.loads((clone / "pyproject.toml").read_text())
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    pkg = site / "tinyrt"
    pkg.mkdir(parents=True)
    for f in (clone / dirs["tinyrt"]).iterdir():
        (pkg / f.name).symlink_to(f)
    for name, folder in dirs.items():
        target = pkg.joinpath(*name.split(".")[1:])
        if not target.exists():                       # (tinyrt/cli is there already)
            target.symlink_to(clone / folder, target_is_directory=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)


def test_a_fresh_clone_passes_its_quick_tests_with_nothing_beside_it(tmp_path):
    """`git clone` of this repository into an empty folder (nothing beside it, as a user's
    lone clone has): no test refers to files outside the clone, and a quick subset of its tests
    passes there, importing the clone's own package."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout (no .git): nothing to clone")
    clone = tmp_path / "tinyrt"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    # the project's neighbouring folder, which benchmarks may read and tests may not (the names
    # joined here, so that this file, scanned too, does not hold them)
    neighbour = "/".join(("..", "shared"))
    for f in sorted((clone / "tests").rglob("*.py")):
        text = f.read_text(encoding="utf-8")
        for outside in (neighbour, "/".join(("shared", "data"))):
            assert outside not in text, f"{f.relative_to(clone)} refers to {outside}"

    site = tmp_path / "site"
    _install_layout(clone, site)
    # PYTHONSAFEPATH: the working directory (the clone's root, whose tinyrt/ lacks the other
    # packages) is not put first on the path, in these processes nor in those they start
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1",
           "TINYRT_TEST_SEED": str(SESSION_SEED)}
    where = subprocess.run(
        [sys.executable, "-c", "import json, tinyrt.cli, tinyrt.converters, tinyrt.kernels, "
         "tinyrt.models, tinyrt.sampling as s; print(json.dumps([m.__file__ for m in (tinyrt.cli, "
         "tinyrt.converters, tinyrt.kernels, tinyrt.models, s)]))"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr
    for f in json.loads(where.stdout):
        assert Path(f).resolve().is_relative_to(clone.resolve()), f

    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *QUICK],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) > 0, run.stdout[-2000:]


# -- the first run on a machine: the kernels compile, once ----------------------------------------

def test_the_first_run_says_it_compiles_the_kernels_and_later_runs_do_not(tmp_path):
    """With no machine code in Numba's cache (a fresh machine: an empty NUMBA_CACHE_DIR),
    `tinyrt generate` says on stderr, once, that it compiles the kernels; the next run reads
    them from the cache and says nothing of it. --json's stdout is one JSON object both times."""
    d = write_tiny_model(tmp_path / "m")
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = [run_tinyrt("generate", "-m", str(d), "hello", "-n", "4", "--device", "cpu", "--json",
                       env=env, timeout=600) for _ in range(2)]
    for p in runs:
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["tokens"] == 4
    assert runs[0].stderr.count("compiling kernels") == 1, runs[0].stderr
    assert "compiling kernels" not in runs[1].stderr, runs[1].stderr


# Which kernels' signatures (each compiled, or read from Numba's cache, on its first call) a
# reply adds after the load: a fresh process, so that no earlier test has called them.
NEW_SIGNATURES = """
import json, sys
import tinyrt
from numba.core.dispatcher import Dispatcher
from tinyrt.kernels.cpu import attention, kv, layer, linear, ops, simd

def signatures():
    return {f"{m.__name__}.{k}": len(v.overloads) for m in (attention, kv, layer, linear, ops, simd)
            for k, v in vars(m).items() if isinstance(v, Dispatcher)}

llm = tinyrt.load(sys.argv[1], device="cpu", quiet=True, **json.loads(sys.argv[2]))
loaded = signatures()
assert loaded, "no kernels found"
prompt = "The quick brown fox jumps over the lazy dog, " * 3       # a prompt: the GEMM path
llm.generate(prompt, max_tokens=8, temperature=0)
llm.generate(prompt + "again", max_tokens=8, temperature=0)       # a follow-up: a short prompt
now = signatures()
print(json.dumps({k: n - loaded.get(k, 0) for k, n in now.items() if n != loaded.get(k, 0)}))
"""


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny float model and its 4-bit (RTN) conversion."""
    from tinyrt.converters import convert

    tmp = tmp_path_factory.mktemp("warm")
    d = write_tiny_model(tmp / "f32", tiny_config(max_position_embeddings=256))
    return {"float": d, "4-bit": convert(d, tmp / "q4", method="rtn", group_size=32)}


@pytest.mark.parametrize("model, cache", [
    ("float", {}),
    ("4-bit", {}),
    ("4-bit", {"kv_type": "q8"}),
    ("4-bit", {"kv_policy": "h2o", "kv_size": 48, "sinks": 4, "recent": 16}),
    ("4-bit", {"kv_policy": "sink", "kv_type": "q4"}),
    ("float", {"draft": "4-bit"}),
])
def test_the_kernels_are_ready_before_a_reply_is_timed(tiny_pair, model, cache):
    """A load runs every kernel a reply calls (models.warm_up), so that their compilation (the
    first time on a machine) counts in load_s and never in TTFT or decode tok/s: a reply, a
    prompt's and a follow-up's, calls no kernel with argument types it has not seen."""
    if "draft" in cache:
        cache = {**cache, "draft": str(tiny_pair[cache["draft"]])}
    p = subprocess.run([sys.executable, "-c", NEW_SIGNATURES, str(tiny_pair[model]),
                        json.dumps(cache)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.splitlines()[-1]) == {}
