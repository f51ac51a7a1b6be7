"""benchmarks/gpu_model.py: the model of the GPU decode step that predicts today's kernels from
their SASS facts, checked without a GPU: it reproduces the profile it was fitted to, its limits
are the ones its docstring states (occupancy, Little's law, bandwidth), and its predictions
cover every machine, shape and context the issue asks for."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_model  # noqa: E402
from test_kernels_gpu import gpu_shapes  # noqa: E402, F401  (the kernels' shapes on a GPU)

# SASS facts of the shape gpu_static.py reports (sm_90, today's kernels), so that the model runs
# here without compiling anything
SASS = gpu_model.Sass(
    gemv={4: dict(registers=96, unit=224, integer=106), 8: dict(registers=96, unit=152, integer=86),
          16: dict(registers=96, unit=131, integer=104)},
    attention={"1x4": dict(registers=96, slot=89, integer=46),
               "2x4": dict(registers=114, slot=118, integer=54),
               "4x4": dict(registers=157, slot=182, integer=79),
               "8x4": dict(registers=173, slot=383, integer=179)})


@pytest.fixture(scope="module")
def fitted():
    return gpu_model.fit()


def test_the_fit_reproduces_the_profile_it_was_fitted_to(fitted):
    """Every kernel of af730b3's measured profile (the four big ones and the small launches)
    within 35 % of its measurement, at the fitted latencies (a DRAM round trip longer than an
    L2 one)."""
    lat, big, worst, got = fitted
    assert big <= worst <= 0.35
    for name, measured in gpu_model.MEASURED_AF730B3.items():
        assert abs(got[name] / measured - 1) <= 0.35, (name, got[name], measured)
    for launch, measured in gpu_model.SMALL_AF730B3.values():
        assert abs(gpu_model.time_us(launch, gpu_model.H200, lat) / measured - 1) <= 0.35
    assert lat.l2 < lat.dram


def test_occupancy_and_little_s_law(fitted, gpu_shapes):
    """Registers and shared memory bound the blocks an SM holds (96 registers: five blocks of
    128 threads, 104: four; a block's 48 KB of shared memory: four on an H200, three on an
    Orin); a GEMV whose warps keep more bytes in flight is no slower, and a bound one runs at
    its bytes over the copy bandwidth at best."""
    lat = fitted[0]
    k = gpu_model.gemv_launch(SASS, gpu_model.H200, 11008, 4096)
    assert replace(k, registers=96, smem=0).occupancy(gpu_model.H200) == 5
    assert replace(k, registers=104, smem=0).occupancy(gpu_model.H200) == 4
    assert replace(k, registers=32, smem=48 * 1024).occupancy(gpu_model.H200) == 4
    assert replace(k, registers=32, smem=48 * 1024).occupancy(gpu_model.ORIN) == 3
    times = [gpu_model.time_us(replace(k, depth=d, per_warp=d * 1024), gpu_model.H200, lat)
             for d in (1, 2, 4)]
    assert times[0] >= times[1] >= times[2]
    assert times[2] >= k.bytes / (gpu_model.H200.copy_gb_s * 1e3)


def test_predictions_cover_every_machine_shape_and_context(gpu_shapes):
    """Both machines, both shapes, both contexts: each kernel's time, the step's tok/s and its
    share of the copy bandwidth (at most all of it); a longer context takes longer."""
    p = gpu_model.predictions(SASS)
    for machine in ("h200", "orin"):
        for shape in ("7b", "8b"):
            short, long = (p["machines"][machine][shape][ctx] for ctx in (512, 4096))
            for s in (short, long):
                assert len(s["kernels_us_per_layer"]) == 6 and 0 < s["pct_copy_bw"] <= 100
                assert s["tok_s"] == pytest.approx(1e6 / s["step_us"], rel=1e-2)
            assert long["step_us"] > short["step_us"]
    assert p["q4_gemv_bytes_in_flight_per_sm"] > 0


def test_the_prefill_model_adds_up_and_names_gpu_py_s_models(gpu_shapes):
    """A prompt's predicted TTFT is its layers' GEMM, dequantization, attention and elementwise
    milliseconds (or the host's launches, where longer); a 4,096-token prompt takes longer than
    a 512-token one but runs more tokens a second (the GEMMs' share grows); the H200's figures
    go to gpu_summary under gpu.py's model names, decode's and prefill's side by side."""
    p = gpu_model.predictions(SASS)
    for shape in ("7b", "8b"):
        short, long = (p["prefill"][shape][T] for T in (512, 4096))
        for f in (short, long):
            parts = sum(v for k, v in f.items() if k.endswith("_ms") and k not in
                        ("ttft_ms", "host_ms"))
            assert f["ttft_ms"] == pytest.approx(max(parts, f["host_ms"]), rel=1e-2)
        assert long["ttft_ms"] > short["ttft_ms"] and long["tok_s"] > short["tok_s"]
    assert set(p["prefill_ratio_vs_transformers_7b"]) == {512, 4096}
    row = p["models"]["llama2-7b"]["4096"]
    assert row["ttft_ms"] == p["prefill"]["7b"][4096]["ttft_ms"]
    assert row["tok_s"] == p["machines"]["h200"]["7b"][4096]["tok_s"]
