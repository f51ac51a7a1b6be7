"""benchmarks/gpu_static.py: the decode kernels compiled for a Hopper GPU without one (Numba's
PTX, ptxas, nvdisasm), and a decode step's launches counted in Numba's CUDA simulator."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_static.py"
BUDGET = 6      # SASS instructions a 4-bit weight in the GEMV's inner loop, at most


def test_the_4_bit_gemv_fits_its_instruction_budget():
    """The script's figures for sm_90: the 4-bit GEMV's inner loop (found by its backward
    branch) spends at most BUDGET instructions a weight, two FFMAs of them (the weight, the
    sum: the loop it found holds every weight), without spilling; a decode step of a tiny
    Llama-2-7B-shaped model launches the 4-bit GEMV among its kernels, and the launches a
    layer add up. Skips, saying what to install, where a tool is missing (ptxas and libNVVM
    come with the CUDA toolkit, nvdisasm with the test extra's nvidia-cuda-nvdisasm)."""
    import pytest

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--json", "--arch", "sm_90"], env=env,
                         capture_output=True, text=True)
    if run.returncode == 3:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout)
    assert r["q4_gemv_sass_per_weight"] <= BUDGET, r["gemv"]["sm_90"]["q4_gemv_float16"]
    for name, loop in r["gemv"]["sm_90"].items():
        assert loop["ffma_per_weight"] == 2, (name, loop["opcodes"])
        assert loop["spill_stores"] == loop["spill_loads"] == 0, name
    kernels = r["kernels"]["sm_90"]
    assert "q4_gemv" in kernels and all(k["registers"] > 0 for k in kernels.values())
    n = r["launches"]
    assert n["per_layer"] >= 4 and n["per_token_fixed"] >= 1     # (4 GEMVs a layer at least)
    assert r["launches_per_token_per_layer_7b"] == round(
        (n["per_token_fixed"] + 32 * n["per_layer"]) / 32, 3)
