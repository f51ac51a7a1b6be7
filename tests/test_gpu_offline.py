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
    for f in ("gpu.py", "gpu_check.py", "gpu_offline.sh", "gpu_summary.py"):
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


# What prepare's gpu_static.py --json might hold: its step model's predictions (opaque to first,
# beside the measurements where shaped models -> NAME -> CONTEXT), and keys first leaves out
STATIC = {"arch": "sm_90", "kernels": {}, "predicted_step_us_7b": 7000.0,
          "model_error_vs_af730b3": {"tok_s": 0.1},
          "step_model": {"version": 1, "models": {"llama2-7b": {"64": {
              "tok_s": 1000.0, "pct_copy_bw": 20.0,
              "kernels_us_per_layer": {"q4_gemv": 9.0, "gemv::attention_split": 2.0}}}}}}


def _steps(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())["steps"]


def test_first_runs_the_checklist_each_step_within_its_time(tmp_path):
    """`first DIR --smoke`, a GPU machine's first minutes on toy models without a GPU: gpu.py on
    both models, gpu_check.py on each (the CUDA path in Numba's simulator against the CPU's) and
    the tests (which import the installed tinyrt, not the checkout's tinyrt/ folder), each step's
    output in DIR, a line on stderr, and every figure in DIR/summary.json; a step that fails, or
    overruns its limit, is named, the next ones run, the status says it, and the summary is
    written (partial); with no time left a step is skipped."""
    tree = _tree(tmp_path)
    (tree / ".gpu_offline" / "gpu_static.json").write_text(json.dumps(STATIC))
    (tree / "tests").mkdir()
    (tree / "tests" / "test_one.py").write_text(
        "import tinyrt.kernels\n\n\ndef test_one():\n"
        "    assert '.gpu_offline_venv' in tinyrt.kernels.__file__\n")
    (tree / "tests" / "test_fail.py").write_text("def test_fail():\n    assert False\n")
    (tree / "tests" / "test_slow.py").write_text(
        "import time\n\n\ndef test_slow():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    p = _run(tree, sys.executable, "first", str(out), "--smoke", timeout=600,
             GPU_TESTS="tests/test_one.py", TMPDIR=str(tmp_path))
    assert p.returncode == 0, p.stderr
    names = ["machine", "gpu", "check-llama2-7b", "tests", "check-llama3-8b"]
    assert [line.split(": ")[1] for line in p.stderr.splitlines() if " done in " in line] == names
    report = json.loads((out / "gpu.out").read_text())["models"]
    figures = report["llama2-7b"]["tinyrt"]
    assert figures["contexts"]["64"]["decode_tok_s"] > 0
    # (on stderr as soon as measured, a line a context: they stand where the step is cut short)
    early = [json.loads(line.split(": ", 2)[2]) for line in
             (out / "gpu.err").read_text().splitlines() if line.startswith("llama2-7b: tinyrt: ")]
    assert [list(e["contexts"]) for e in early] == [[], ["64"], ["64", "256"]]
    for c in figures["contexts"].values():      # (the ratio comes after transformers' run)
        del c["ratio_vs_transformers"]
    assert early[-1] == figures
    check = json.loads((out / "check-llama2-7b.out").read_text())
    assert check["agree"] and check["graph_equals_eager"], check
    assert check["device"] == "Numba's CUDA simulator" and check["logits_rel_err"] < 3e-3
    gqa = json.loads((out / "check-llama3-8b.out").read_text())     # (grouped-query)
    assert gqa["agree"] and gqa["tokens"] == 2 and "check-gqa" in gqa["model"]
    assert "1 passed" in (out / "tests.out").read_text()

    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "complete" and s["smoke"] and s["budget_s"] == 570
    assert list(s["steps"]) == ["install", *names]
    assert all(v["status"] == "ok" and v["wall_s"] > 0 for v in s["steps"].values())
    assert s["steps"]["gpu"]["limit_s"] == 300 and s["steps"]["install"]["limit_s"] is None
    import numpy
    assert s["machine"]["numpy"] == numpy.__version__ and s["machine"]["gpu"] is None
    assert re.fullmatch(r"[0-9a-f]{64}", s["project"]["sources_sha256"])
    assert not s["project"]["sources_as_prepared"]      # (the tree's prepared hash is made up)
    for name in ("llama2-7b", "llama3-8b"):
        t, hf = report[name]["tinyrt"], report[name]["transformers"]
        for ctx in ("64", "256"):
            c = s["models"][name]["contexts"][ctx]
            assert c["decode_tok_s"] == t["contexts"][ctx]["decode_tok_s"]
            assert c["pct_copy_bw"] == t["contexts"][ctx]["pct_copy_bw"] > 0
            assert c["transformers_prefill_tok_s"] == hf["contexts"][ctx]["prefill_tok_s"]
            assert c["decode_ratio_vs_transformers"] == pytest.approx(
                c["decode_tok_s"] / hf["contexts"][ctx]["decode_tok_s"])
            assert c["runs"] == c["transformers_runs"] == 2
        assert s["models"][name]["load_s"] == t["load_s"]
        assert s["check"][name]["agree"]
        assert s["check"][name]["greedy"]["graph"]["verdict"] == "equal"
    assert s["profile"] == {}                            # (the simulator has no profiler)
    assert s["tests"] == {"passed": 1, "failed": 0, "errors": 0, "skipped": 0, "failing": [],
                          "from": "tests.xml"}
    pred = s["predictions"]
    assert set(pred) == {"step_model", "predicted_step_us_7b", "model_error_vs_af730b3",
                         "measured_beside_predicted"}
    assert pred["step_model"] == STATIC["step_model"]
    row = pred["measured_beside_predicted"]["llama2-7b"]["64"]
    assert row["tok_s"] == {"predicted": 1000.0,
                            "measured": s["models"]["llama2-7b"]["contexts"]["64"]["decode_tok_s"]}
    assert row["kernels_us_per_layer"]["q4_gemv"]["measured"] is None     # (no profile)

    # a failing test and one cut at the tests' limit; an unknown model: gpu and its check fail
    p = _run(tree, sys.executable, "first", str(out), "llama1-7b", "--smoke",
             GPU_TESTS="tests/test_fail.py tests/test_slow.py", TMPDIR=str(tmp_path),
             FIRST_BUDGET="90", FIRST_TESTS_LIMIT="15")
    assert p.returncode == 1
    failed = [line for line in p.stderr.splitlines() if "failed (exit status 2)" in line]
    assert [line.split(":")[1] for line in failed] == [" gpu", " check-llama1-7b"], p.stderr
    assert "unknown model 'llama1-7b'" in failed[0] and "no model 'llama1-7b'" in failed[1]
    assert re.search(r"^gpu_offline: tests: stopped at its limit of 15 s$", p.stderr, re.M)
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "partial" and list(s["steps"]) == [
        "install", "machine", "gpu", "check-llama1-7b", "tests"]
    assert [s["steps"][k]["status"] for k in ("gpu", "check-llama1-7b", "tests")] == [
        "failed", "failed", "timeout"]
    assert "unknown model" in s["steps"]["gpu"]["why"] and s["steps"]["gpu"]["rc"] == 2
    assert s["models"] == {} and s["check"] == {}
    # (no junit XML from a pytest stopped: its -v lines say what ended)
    assert s["tests"] == {"passed": 0, "failed": 1, "errors": 0, "skipped": 0,
                          "failing": ["tests/test_fail.py::test_fail"],
                          "from": "tests.out (no tests.xml: cut short?)"}

    p = _run(tree, sys.executable, "first", str(out), "--smoke", FIRST_BUDGET="5")
    assert p.returncode == 1
    steps = ("machine", "gpu", "check-llama2-7b", "tests", "check-llama3-8b")
    assert [line.split(": ", 1)[1] for line in p.stderr.splitlines()[-6:-1]] == [
        f"{step}: skipped: no time left" for step in steps], p.stderr
    s = _steps(out)
    assert s["install"]["status"] == "ok"
    assert all(s[k] == {"status": "skipped", "rc": None, "wall_s": s[k]["wall_s"],
                        "limit_s": None, "why": "no time left"} for k in steps), s


def test_first_writes_its_summary_when_the_install_fails(tmp_path):
    """No .gpu_offline/ (nor so gpu_static.json): the install fails, every step is skipped, and
    the summary says so, written with the machine's Python."""
    tree = _tree(tmp_path)
    shutil.rmtree(tree / ".gpu_offline")
    out = tmp_path / "out"
    p = _run(tree, sys.executable, "first", str(out), "llama2-7b")
    assert p.returncode == 1 and "no .gpu_offline/" in p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "partial" and s["steps"]["install"]["status"] == "failed"
    assert "no .gpu_offline/" in s["steps"]["install"]["why"]
    assert [(k, v["status"], v["why"]) for k, v in s["steps"].items()][1:] == [
        (k, "skipped", "the install failed") for k in ("machine", "gpu", "check-llama2-7b",
                                                       "tests")]
    assert s["models"] == s["check"] == s["profile"] == s["tests"] == {}
    assert "missing" in s["predictions"] and s["machine"] == {}
    assert s["project"]["commit_at_prepare"] is None and not s["project"]["sources_as_prepared"]


def _summarize(d: Path, offline: Path, models: str = "llama2-7b") -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_summary.py"), str(d),
                    "--root", str(d / "tree"), "--offline", str(offline), "--models", models,
                    "--budget", "570",
                    "--sources-sha256", "ab" * 32], check=True, timeout=60)
    return json.loads((d / "summary.json").read_text())


# A decode step's profile of 4 layers and the head (gpu_check's, microseconds a step)
PROFILE = {"steps": 8, "context": [75, 82], "launches": 31.0, "us": 879.0, "kernels": {
    "gemv::q4_gemv": {"launches": 16.0, "us": 364.0},
    "kernels::attention_split": {"launches": 4.0, "us": 248.0},
    "kernels::gemv": {"launches": 1.0, "us": 192.0},
    "kernels::add_rmsnorm": {"launches": 9.0, "us": 63.0},
    "torch argmax": {"launches": 1.0, "us": 12.0}}}


def test_the_summary_of_a_run_cut_short(tmp_path):
    """Steps stopped at their limits: gpu.py's figures from the last whole line of each on its
    stderr (a line cut in the middle left out), gpu_check's from its stderr, the tests' from
    pytest's -v lines (no XML); a skipped step's stale output is not read; no gpu_static.json.
    The profile per layer: a kernel's launches a step over the 4 layers' multiple are in the
    layers (add_rmsnorm's 9: 2 a layer and the final norm), the rest once a step."""
    (tmp_path / "steps.tsv").write_text("".join(f"{n}\t{st}\t{rc}\t{w}\t{lim}\t{why}\n" for
                                                n, st, rc, w, lim, why in (
        ("install", "ok", 0, 9.5, "", ""), ("machine", "ok", 0, 4.2, 30, ""),
        ("gpu", "timeout", 124, 300.1, 300, "stopped at its limit"),
        ("check-llama2-7b", "timeout", 124, 105.0, 105, "stopped at its limit"),
        ("tests", "timeout", 124, 140.0, 140, "stopped at its limit"),
        ("check-llama3-8b", "skipped", "", 0.0, "", "no time left"))))
    (tmp_path / "machine.out").write_text(json.dumps({"gpu": "NVIDIA H200", "numpy": "2.5.2"}))
    (tmp_path / "gpu.out").write_text("")
    ctx = {"prefill_tok_s": 1296.0, "decode_tok_s": 128.8, "pct_copy_bw": 12.2, "runs": 3}
    (tmp_path / "gpu.err").write_text("\n".join([
        'device: copy: {"device": "NVIDIA H200", "copy_gb_s": 4237.6, "torch": "2.11.0"}',
        "llama2-7b: writing (workdir)/llama2-7b-awq-g128-centred ...",
        'llama2-7b: tinyrt: {"load_s": 35.6, "contexts": {}}',
        f'llama2-7b: tinyrt: {json.dumps({"load_s": 35.6, "contexts": {"512": ctx}})}',
        'llama2-7b: transformers: {"contexts": {"512": {"prefill_tok_s": 14336.0, '
        '"decode_tok_s": 34.7, "runs": 3}}}',
        'llama3-8b: tinyrt: {"load_s": 40.1, "contexts": {}}',
        'llama3-8b: tinyrt: {"load_s": 40.1, "contexts": {"512": {"prefill_tok_s": 1}',
        ""]))
    verdict = {"layers": 4, "agree": True, "graph_equals_eager": True, "logits_rel_err": 4e-4,
               "greedy": {"graph": {"equal": True, "tokens": 64}, "eager": {
                   "equal": False, "step": 7, "cpu_margin": 0.002, "gpu_margin": 0.001,
                   "near_tie": True, "logits_rel_err": 5e-4}}}
    (tmp_path / "check-llama2-7b.err").write_text(
        f"gpu_check: {json.dumps(verdict)}\n"
        f"gpu_check: {json.dumps(dict(verdict, profile={'graph': PROFILE}))}\n")
    (tmp_path / "check-llama3-8b.out").write_text(json.dumps(verdict))     # (an earlier run's)
    (tmp_path / "tests.out").write_text(        # (run from DIR: paths from there)
        "tree/tests/test_a.py::test_x PASSED                  [ 10%]\n"
        "tree/tests/test_a.py::test_y[float16-q/k norms] FAILED [ 20%]\n"
        "tree/tests/test_b.py::TestC::test_z SKIPPED (no GPU)  [ 30%]\n"
        "tree/tests/test_b.py::test_e ERROR                    [ 40%]\n")
    s = _summarize(tmp_path, tmp_path / "none", "llama2-7b,llama3-8b")
    assert s["status"] == "partial" and s["machine"]["gpu"] == "NVIDIA H200"
    assert [v["status"] for v in s["steps"].values()] == [
        "ok", "ok", "timeout", "timeout", "timeout", "skipped"]
    assert s["steps_wall_s"] == pytest.approx(558.8)
    assert s["measurement"]["partial"] and s["measurement"]["copy_gb_s"] == 4237.6
    c = s["models"]["llama2-7b"]["contexts"]["512"]
    assert c["decode_tok_s"] == 128.8 and c["transformers_decode_tok_s"] == 34.7
    assert c["decode_ratio_vs_transformers"] == pytest.approx(128.8 / 34.7)
    assert c["prefill_ratio_vs_transformers"] == pytest.approx(1296 / 14336)
    assert s["models"]["llama3-8b"] == {"load_s": 40.1, "contexts": {}}
    assert list(s["check"]) == ["llama2-7b"]               # (llama3-8b's check was skipped)
    v = s["check"]["llama2-7b"]
    assert v["agree"] and v["logits_rel_err"] == 4e-4
    assert v["greedy"] == {"graph": {"verdict": "equal", "tokens": 64}, "eager": {
        "verdict": "near tie", "step": 7, "cpu_margin": 0.002, "gpu_margin": 0.001,
        "logits_rel_err": 5e-4}}
    p = s["profile"]["llama2-7b"]["prompt_graph"]
    assert p["us_per_layer"] == pytest.approx({
        "gemv::q4_gemv": 91.0, "kernels::attention_split": 62.0,
        "kernels::add_rmsnorm": 63.0 * 8 / 9 / 4})
    assert p["us_per_step"] == pytest.approx({
        "kernels::gemv": 192.0, "kernels::add_rmsnorm": 7.0, "torch argmax": 12.0})
    assert p["layer_us"] == pytest.approx(167.0) and p["step_us"] == pytest.approx(211.0)
    # (gpu.py's shape of the full model was cut off with its JSON: 32 layers assumed)
    assert p["full_model_us"] == pytest.approx(167.0 * 32 + 211.0)
    assert p["context"] == [75, 82]
    assert s["tests"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1, "failing": [
        "tests/test_a.py::test_y[float16-q/k norms]", "tests/test_b.py::test_e"],
        "from": "tests.out (no tests.xml: cut short?)"}
    assert set(s["predictions"]) == {"missing"}


def test_the_summary_reads_the_tests_xml_and_sets_predictions_beside(tmp_path):
    """pytest's junit XML (xunit1: each case's file) gives the counts and the failing ids (a
    class's too); gpu_static.json's step model is copied whole, with its predicted_* keys and
    its error against af730b3 (not its other keys), and each predicted figure beside the
    measured one, a kernel matched on its function's name in the profile at that context (or
    else the prompt's, named)."""
    (tmp_path / "steps.tsv").write_text("".join(f"{n}\tok\t0\t1.0\t9\t\n" for n in (
        "install", "gpu", "check-llama2-7b", "tests")))
    gpu_out = {"copy_gb_s": 4000.0, "runs": {"512": 3, "4096": 2}, "models": {"llama2-7b": {
        "shape": {"num_hidden_layers": 8},
        "tinyrt": {"contexts": {"512": {"decode_tok_s": 120.0, "pct_copy_bw": 11.0},
                                "4096": {"decode_tok_s": 70.0, "pct_copy_bw": 9.0}}},
        "transformers": {"contexts": {"512": {"decode_tok_s": 30.0}}}}}}
    (tmp_path / "gpu.out").write_text(json.dumps(gpu_out))
    at512 = dict(PROFILE, kernels=dict(PROFILE["kernels"], **{
        "kernels::attention_split": {"launches": 4.0, "us": 400.0}}))
    (tmp_path / "check-llama2-7b.out").write_text(json.dumps({
        "layers": 4, "agree": True, "greedy": {}, "profile": {"graph": PROFILE},
        "profile_at": {"512": at512}}))
    (tmp_path / "tests.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" file="tests/test_a.py" name="test_x"/>'
        '<testcase classname="tests.test_a" file="tests/test_a.py" name="test_y[f16]">'
        '<failure message="assert False">...</failure></testcase>'
        '<testcase classname="tests.test_b.TestC" file="tests/test_b.py" name="test_z">'
        '<error message="fixture">...</error></testcase>'
        '<testcase classname="tests.test_b" file="tests/test_b.py" name="test_s">'
        '<skipped message="no GPU"/></testcase></testsuite></testsuites>')
    (tmp_path / "tests.out").write_text("tests/test_a.py::test_x PASSED\n")    # (not read)
    off = tmp_path / "off"
    off.mkdir()
    (off / "sources.sha256").write_text("ab" * 32 + "\n")
    (off / "commit.txt").write_text("af730b3" + "0" * 33 + "\n")
    model = {"llama2-7b": {"512": {"tok_s": 150.0, "pct_copy_bw": 14.0, "kernels_us_per_layer": {
        "q4_gemv": 80.0, "attention_split": 90.0, "rope_store": 3.0}},
        "4096": {"tok_s": 90.0, "kernels_us_per_layer": {"kernels::attention_split": 300.0}}},
        "llama3-8b": {"512": {"tok_s": 140.0}}}
    (off / "gpu_static.json").write_text(json.dumps({
        "arch": "sm_90", "kernels": {"sm_90": {}}, "predicted_launches": 9.2,
        "model_error_vs_af730b3": 0.15, "step_model": {"models": model, "how": "opaque"}}))
    s = _summarize(tmp_path, off)
    assert s["status"] == "complete"
    assert s["project"] == {"commit_at_prepare": "af730b3" + "0" * 33, "sources_sha256": "ab" * 32,
                            "sources_as_prepared": True}
    assert s["tests"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1, "failing": [
        "tests/test_a.py::test_y[f16]", "tests/test_b.py::TestC::test_z"], "from": "tests.xml"}
    assert s["measurement"]["runs"] == {"512": 3, "4096": 2}
    # the full model's layers from gpu.py's shape
    assert s["profile"]["llama2-7b"]["512"]["full_model_us"] == pytest.approx(
        (91.0 + 100.0 + 14.0) * 8 + 211.0)
    pred = s["predictions"]
    assert set(pred) == {"step_model", "predicted_launches", "model_error_vs_af730b3",
                         "measured_beside_predicted"}
    assert pred["step_model"] == {"models": model, "how": "opaque"}
    vs = pred["measured_beside_predicted"]["llama2-7b"]
    assert vs["512"]["tok_s"] == {"predicted": 150.0, "measured": 120.0}
    assert vs["512"]["pct_copy_bw"] == {"predicted": 14.0, "measured": 11.0}
    assert vs["512"]["kernels_at"] == "512" and vs["512"]["kernels_us_per_layer"] == {
        "q4_gemv": {"predicted": 80.0, "measured": 91.0, "profiled": ["gemv::q4_gemv"]},
        "attention_split": {"predicted": 90.0, "measured": 100.0,
                            "profiled": ["kernels::attention_split"]},
        "rope_store": {"predicted": 3.0, "measured": None, "profiled": []}}
    assert vs["4096"]["kernels_at"] == "prompt_graph"     # (no profile at 4096)
    assert vs["4096"]["kernels_us_per_layer"]["kernels::attention_split"]["measured"] == 62.0
    assert "pct_copy_bw" not in vs["4096"]
    assert pred["measured_beside_predicted"]["llama3-8b"] == {     # (not measured)
        "512": {"tok_s": {"predicted": 140.0, "measured": None}}}
    # a step model with no such shape is copied and set beside nothing
    (off / "gpu_static.json").write_text(json.dumps({"step_model": [1, 2]}))
    assert _summarize(tmp_path, off)["predictions"] == {"step_model": [1, 2]}


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
