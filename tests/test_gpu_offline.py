"""A GPU machine with no network: benchmarks/gpu_offline.sh's `run` installs tinyrt over that
machine's Python from what `prepare` brought (here without `prepare`, which downloads: its folder
is made by hand), and benchmarks/gpu.py says in one line what a missing package stops."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_offline.sh"
MARK = ".made-by-gpu_offline"


def _sources() -> list[str]:
    return re.search(r"^SOURCES=\((.*?)\)", SCRIPT.read_text(), re.M).group(1).split()


def test_the_hashed_sources_are_what_the_wheel_is_built_from():
    """SOURCES (hashed, and copied to build the wheel) names pyproject's package-dir folders."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {d.split("/")[0] for d in dirs["package-dir"].values()}
    assert sorted(_sources()) == sorted({"pyproject.toml", "README.md", *tops})


def _tree(tmp: Path, sha: str = "0" * 64) -> Path:
    """A copy of the package sources and the two scripts, with a prepared folder whose hash of
    the sources is `sha` (not theirs unless given) and no wheels."""
    tree = tmp / "tree"
    for name in _sources():
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, tree / name)
    (tree / "benchmarks").mkdir()
    for f in ("gpu.py", "gpu_check.py", "gpu_offline.sh"):
        shutil.copy(ROOT / "benchmarks" / f, tree / "benchmarks" / f)
    off = tree / ".gpu_offline"
    (off / "tinyrt").mkdir(parents=True)
    (off / "wheels").mkdir()
    (off / MARK).touch()
    (off / "sources.sha256").write_text(sha + "\n")
    return tree


def _run(tree: Path, python: str, *args: str, timeout: int = 300, **env):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | env
    return subprocess.run(["bash", str(tree / "benchmarks" / "gpu_offline.sh"), *args],
                          env=dict(env, PYTHON=python), capture_output=True, text=True,
                          timeout=timeout)


def test_run_without_prepare_and_a_bad_verb_are_one_line(tmp_path):
    tree = _tree(tmp_path)
    shutil.rmtree(tree / ".gpu_offline")
    p = _run(tree, sys.executable, "run", "--help")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "no .gpu_offline/" in p.stderr and " prepare" in p.stderr
    p = _run(tree, sys.executable, "prepar")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("usage:")


def test_changed_sources_without_setuptools_are_refused(tmp_path):
    """Sources that are not the prepared wheel's, on a Python with no setuptools to build them
    again: one line, and no venv made."""
    bare = tmp_path / "bare"          # a Python with the standard library only
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    assert subprocess.run([bare / "bin" / "python", "-c", "import setuptools"]).returncode
    tree = _tree(tmp_path)
    p = _run(tree, str(bare / "bin" / "python"), "run", "--help")
    assert p.returncode == 1 and p.stdout == "", p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert "sources changed since prepare" in p.stderr and "no setuptools" in p.stderr
    assert not (tree / ".gpu_offline_venv").exists()


def test_run_installs_tinyrt_over_the_machine_s_python_with_no_index(tmp_path):
    """This Python (a venv, with setuptools) as the machine's: changed sources are built into a
    wheel again there, installed with pip --no-index into a venv that sees this Python's
    packages, and gpu.py runs with it; the same sources again (a cache file beside them does not
    count) reuse that venv; another change builds again."""
    tree = _tree(tmp_path)
    p = _run(tree, sys.executable, "run", "--help")
    assert p.returncode == 0, p.stderr
    assert "building its wheel again here" in p.stderr and "tinyrt 0.1.0" in p.stderr
    assert p.stdout.startswith("usage: gpu.py")
    venv_python = tree / ".gpu_offline_venv" / "bin" / "python"
    where = subprocess.run([venv_python, "-c", "import tinyrt, numpy; print(tinyrt.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    # the venv's, not this checkout's (nor the one in the tests' working folder: `-c` looks there)
    assert where.startswith(str(tree / ".gpu_offline_venv"))
    (tree / "tinyrt" / "__pycache__").mkdir(exist_ok=True)
    (tree / "tinyrt" / "__pycache__" / "x.pyc").write_bytes(b"x")
    p = _run(tree, sys.executable, "run", "--help")
    assert p.returncode == 0 and "already installed" in p.stderr, p.stderr
    with open(tree / "tinyrt" / "errors.py", "a") as f:
        f.write("# changed\n")
    p = _run(tree, sys.executable, "run", "--help")
    assert p.returncode == 0 and "building its wheel again here" in p.stderr, p.stderr


def test_first_runs_the_checklist_each_step_within_its_time(tmp_path):
    """`first DIR --smoke`, a GPU machine's first minutes on toy models without a GPU: gpu.py,
    gpu_check.py (the CUDA path in Numba's simulator against the CPU's) and the tests (which
    import the installed tinyrt, not the checkout's tinyrt/ folder), each step's output in DIR
    and a line on stderr; a step that fails, or overruns what is left of the budget, is named,
    the next ones run, and the status says it; with no time left a step is skipped."""
    tree = _tree(tmp_path)
    (tree / "tests").mkdir()
    (tree / "tests" / "test_one.py").write_text(
        "import tinyrt.kernels\n\n\ndef test_one():\n"
        "    assert '.gpu_offline_venv' in tinyrt.kernels.__file__\n")
    (tree / "tests" / "test_slow.py").write_text(
        "import time\n\n\ndef test_slow():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    p = _run(tree, sys.executable, "first", str(out), "--smoke", timeout=600,
             GPU_TESTS="tests/test_one.py", TMPDIR=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert [line.split(":")[1] for line in p.stderr.splitlines() if " done in " in line] == [
        " gpu", " check", " tests"], p.stderr
    figures = json.loads((out / "gpu.out").read_text())["models"]["llama2-7b"]["tinyrt"]
    assert figures["contexts"]["64"]["decode_tok_s"] > 0
    # (on stderr as soon as measured: they stand where the peer's run overruns the step)
    early = [json.loads(line.split(": ", 2)[2]) for line in
             (out / "gpu.err").read_text().splitlines() if line.startswith("llama2-7b: tinyrt: ")]
    assert [e["contexts"]["64"]["decode_tok_s"] for e in early] == [
        figures["contexts"]["64"]["decode_tok_s"]]
    check = json.loads((out / "check.out").read_text())
    assert check["agree"] and check["graph_equals_eager"], check
    assert check["device"] == "Numba's CUDA simulator" and check["logits_rel_err"] < 3e-3
    assert "1 passed" in (out / "tests.out").read_text()

    p = _run(tree, sys.executable, "first", str(out), "llama1-7b", "--smoke",
             GPU_TESTS="tests/test_slow.py", TMPDIR=str(tmp_path), FIRST_BUDGET="40")
    assert p.returncode == 1
    failed = [line for line in p.stderr.splitlines() if "failed (exit status 2)" in line]
    assert [line.split(":")[1] for line in failed] == [" gpu", " check"], p.stderr
    assert "unknown model 'llama1-7b'" in failed[0] and "no model 'llama1-7b'" in failed[1]
    last = p.stderr.splitlines()[-1]
    assert re.fullmatch(r"gpu_offline: tests: stopped at its limit of \d+ s", last), p.stderr

    p = _run(tree, sys.executable, "first", str(out), "--smoke", FIRST_BUDGET="5")
    assert p.returncode == 1
    assert [line.split(": ", 1)[1] for line in p.stderr.splitlines()[-3:]] == [
        f"{step}: skipped: no time left" for step in ("gpu", "check", "tests")], p.stderr


# A Python where some packages are not installed: importing one raises ModuleNotFoundError
BLOCK = """import runpy, sys
blocked = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_gpu_py_says_what_a_missing_package_stops_in_one_line(tmp_path):
    """No platformdirs (the default model's place in tinyrt's cache) and no transformers (the
    peer): one line each, no traceback, and the script runs to its end."""
    gpu = str(ROOT / "benchmarks" / "gpu.py")
    p = subprocess.run([sys.executable, "-c", BLOCK, "platformdirs,transformers", gpu,
                        "--device", "cpu", "--smoke", "--models", "default", "--threads", "1",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.splitlines() == [
        "transformers skipped: the Python package transformers is not installed",
        "default: skipped: the Python package platformdirs is not installed "
        "(or give --default-model)"]
