"""The decode kernels compiled for a GPU without one: SASS of the quantized GEMV's inner loop,
registers and spills of every kernel a decode step launches, and launches per token.

A decode step of a tiny 4-bit model of Llama-2-7B's layer structure (MHA, fused q|k|v and
gate|up projections, SwiGLU, RMSNorm; benchmarks/gpu.py's AWQ model writer at toy sizes) runs
in Numba's CUDA simulator, once with 1 layer and once with 2: every Numba kernel launch is
counted (the simulator's kernel call is wrapped) and its argument types recorded. The
difference is one layer's launches; the rest a token's fixed ones; at Llama-2-7B's 32 layers a
token makes fixed + 32 per_layer launches, `launches_per_token_per_layer_7b` of them a layer
(torch's own ops are not counted: tests/test_device_decode.py checks a layer runs none).

Each recorded kernel is compiled to PTX by Numba's CUDA target for each --arch (default sm_90,
an H100's, and sm_87, Jetson Orin's), then by ptxas (-v: registers, spill stores and loads).
The 4- and 8-bit GEMVs are also disassembled (nvdisasm): their inner loop is the innermost
loop (a backward branch) that reads x from shared memory, and its instructions, divided by the
weights one turn of it multiplies (two rows' chunks), are `q4_gemv_sass_per_weight` (float16
scales; float32 ones too). The tools: Numba with libNVVM, ptxas and nvdisasm (found on PATH,
under CUDA_HOME, or in NVIDIA's pip wheels); a missing one is named with its pip package.

    python benchmarks/gpu_static.py             # a table
    python benchmarks/gpu_static.py --json      # the figures as JSON
    python benchmarks/gpu_static.py --sass      # and the GEMVs' inner loops, instruction by
                                                # instruction
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS_7B = 32
# the tiny model: Llama-2-7B's structure (as many KV heads as heads), AWQ groups of 32
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 260, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
PACKAGES = {"ptxas": "nvidia-cuda-nvcc", "nvdisasm": "nvidia-cuda-nvdisasm"}


class Missing(Exception):
    """A tool this script needs is not here (the message says what to install)."""


def tool(name: str) -> str:
    """The path of a CUDA tool: in NVIDIA's pip wheels, on PATH, or under CUDA_HOME. The wheels
    first: numba-cuda's cu13 extra installs libNVVM as a wheel, and a ptxas of an older toolkit
    on PATH refuses the newer PTX version it writes ("Unsupported .version")."""
    try:
        import nvidia
    except ImportError:
        roots = []
    else:
        roots = list(nvidia.__path__)
    for root in roots:             # cu13 wheels: nvidia/cu13/bin; cu12: nvidia/cuda_nvcc/bin
        for path in sorted(glob.glob(os.path.join(root, "*", "bin", name))):
            if os.access(path, os.X_OK):
                return path
    found = shutil.which(name)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not found and home and os.access(Path(home, "bin", name), os.X_OK):
        found = str(Path(home, "bin", name))
    if not found:
        raise Missing(f"{name} not found: pip install {PACKAGES[name]}")
    return found


# -- in the simulator: a decode step's launches ---------------------------------------------------

def record() -> dict:
    """Run in Numba's CUDA simulator: launches of the last decode step of the tiny model with 1
    and with 2 layers, and the argument types of every kernel those steps launched."""
    from numba import typeof, types
    from numba.cuda.simulator import kernel as simulated

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu as gpu_bench            # benchmarks/gpu.py: its AWQ model writer

    gpu_bench.AWQ = dict(gpu_bench.AWQ, group_size=32)      # (its models' 128: too wide here)

    import tinyrt
    from tinyrt import device_decode

    seen, counts = set(), []
    call = simulated.FakeCUDAKernel.__call__

    def spec(a):
        t = typeof(a)
        return [str(t.dtype), t.ndim, t.layout] if isinstance(t, types.Array) else str(t)

    def counted(self, *args):
        if not self._device and counts:
            counts[-1] += 1
            seen.add(json.dumps([self.fn.__module__, self.fn.__name__, [spec(a) for a in args]]))
        return call(self, *args)

    step = device_decode.DeviceDecoder.step

    def counted_step(self, token):
        counts.append(0)
        return step(self, token)

    simulated.FakeCUDAKernel.__call__ = counted
    device_decode.DeviceDecoder.step = counted_step
    # the simulator frees a barrier when its polling thread, taking turns with the block's
    # threads, sees them all waiting: at Python's 5 ms switch interval that is ~10 ms a barrier
    sys.setswitchinterval(1e-4)
    per_step = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (1, 2):
            shape = dict(TINY, num_hidden_layers=layers)
            path = gpu_bench.awq_model(Path(tmp), f"tiny{layers}", shape, False)
            llm = tinyrt.load(path, device="cuda", quiet=True, cuda_graph=False)
            counts.clear()
            for _ in llm.generation([5], max_tokens=2, ignore_eos=True, temperature=0):
                pass
            if not counts:
                raise RuntimeError("no decode step ran on the device")
            per_step[layers] = counts[-1]
    return {"per_step": per_step, "kernels": sorted(json.loads(s) for s in seen)}


def launches() -> dict:
    """record() in a child process in the simulator."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    run = subprocess.run([sys.executable, __file__, "--record"], env=env, capture_output=True,
                         text=True)
    if run.returncode:
        raise RuntimeError(f"the simulated decode step failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.splitlines()[-1])


# -- outside the simulator: PTX, ptxas, SASS ------------------------------------------------------

def _numba_for(cc: tuple[int, int]):
    """Numba's CUDA target, compiling device functions for cc (there is no GPU to ask)."""
    import types

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    from numba.cuda.cudadrv import nvvm

    try:
        nvvm.NVVM()
    except Exception as e:
        raise Missing(f"Numba finds no libNVVM ({str(e).splitlines()[0]}): install the CUDA "
                      "toolkit, or set CUDA_HOME to one") from None
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    return cuda


def signature(args: list):
    from numba.core import types as t

    return tuple(t.Array(getattr(t, a[0]), a[1], a[2]) if isinstance(a, list) else getattr(t, a)
                 for a in args)


def assemble(ptx: str, arch: str, work: Path, name: str) -> tuple[dict, Path]:
    """ptxas -v of a kernel's PTX: ({registers, spill_stores, spill_loads}, the cubin)."""
    src, cubin = work / f"{name}.{arch}.ptx", work / f"{name}.{arch}.cubin"
    src.write_text(ptx)
    run = subprocess.run([tool("ptxas"), f"-arch={arch}", "-v", str(src), "-o", str(cubin)],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed on {name} for {arch}:\n{run.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    return {"registers": int(regs.group(1)) if regs else 0,
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0}, cubin


def sass(cubin: Path) -> list[tuple[int, str]]:
    """The instructions of a cubin (nvdisasm): (address, text) in order, and the labels'
    addresses as ('label', name) entries where they stand."""
    run = subprocess.run([tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"nvdisasm failed: {run.stderr[-2000:]}")
    out = []
    for line in run.stdout.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if label:
            out.append((-1, label.group(1)))
        elif ins:
            out.append((int(ins.group(1), 16), ins.group(2)))
    return out


def loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """Each loop's instructions, from its backward branch's target to the branch (NOPs left
    out), innermost ones only (no other backward branch inside)."""
    where, pending, ins = {}, [], []
    for addr, text in code:
        if addr < 0:
            pending.append(text)
            continue
        for label in pending:
            where[label] = addr
        pending = []
        ins.append((addr, text))
    spans = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+`?\(?(\.L_x_\d+)", text)
        if m and where.get(m.group(1), addr + 1) <= addr:
            spans.append((where[m.group(1)], addr))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [[t for a, t in ins if lo <= a <= hi and not t.startswith("NOP")] for lo, hi in inner]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def gemv_loop(code, weights: int) -> dict:
    """The GEMV's inner loop: the innermost loop that loads x from shared memory (LDS)."""
    found = [body for body in loops(code) if any(opcode(t).startswith("LDS") for t in body)]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} innermost loops read shared memory, not 1")
    body = found[0]
    ops = collections.Counter(opcode(t) for t in body)
    return {"instructions": len(body), "weights": weights,
            "per_weight": round(len(body) / weights, 3),
            "ffma_per_weight": round(ops["FFMA"] / weights, 3),
            "opcodes": dict(ops.most_common()), "listing": body}


def analyse(archs: list[str], recorded: dict) -> dict:
    from numba.core import types as t

    out: dict = {"kernels": {}, "gemv": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for arch in archs:
            cc = (int(arch[3:-1]), int(arch[-1]))
            cuda = _numba_for(cc)
            from tinyrt.kernels.cuda import gemv

            regs = out["kernels"][arch] = {}
            for i, (module, name, args) in enumerate(recorded["kernels"]):
                fn = getattr(importlib.import_module(module), name).py_func
                ptx, _ = cuda.compile_ptx(fn, signature(args), cc=cc)
                stats = assemble(ptx, arch, work, f"{name}{i}")[0]
                old = regs.get(name, stats)         # (a kernel of several signatures: the most)
                regs[name] = {k: max(v, old[k]) for k, v in stats.items()}
            a = lambda dt: t.Array(dt, 1, "C")      # noqa: E731
            loops_here = out["gemv"][arch] = {}
            for bits, kernel in ((4, gemv.q4_gemv), (8, gemv.q8_gemv)):
                for scales in ("float16", "float32"):
                    f = getattr(t, scales)
                    sig = (a(t.float32), a(t.int64), a(t.int64), a(f), a(f), t.int64, t.int64,
                           t.int64, t.int64, a(t.float32), t.Array(t.float32, 2, "C"),
                           a(t.int32))
                    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
                    name = f"q{bits}_gemv_{scales}"
                    stats, cubin = assemble(ptx, arch, work, name)
                    weights = gemv.ROWS_PER_WARP * gemv.chunk(bits)
                    loops_here[name] = {**stats, **gemv_loop(sass(cubin), weights)}
    return out


def report(archs: list[str]) -> dict:
    recorded = launches()
    one, two = recorded["per_step"]["1"], recorded["per_step"]["2"]
    per_layer, fixed = two - one, 2 * one - two
    result = analyse(archs, recorded)
    main = result["gemv"][archs[0]]
    return {"arch": archs[0],
            "q4_gemv_sass_per_weight": main["q4_gemv_float16"]["per_weight"],
            "q4_gemv_sass_per_weight_float32_scales": main["q4_gemv_float32"]["per_weight"],
            "q8_gemv_sass_per_weight": main["q8_gemv_float16"]["per_weight"],
            "launches_per_token_per_layer_7b":
                round((fixed + LAYERS_7B * per_layer) / LAYERS_7B, 3),
            "launches": {"per_layer": per_layer, "per_token_fixed": fixed,
                         "layers_7b": LAYERS_7B},
            **result}


def table(r: dict, listing: bool) -> str:
    lines = [f"SASS per weight in the GEMV's inner loop ({r['arch']}): 4-bit "
             f"{r['q4_gemv_sass_per_weight']} (float32 scales "
             f"{r['q4_gemv_sass_per_weight_float32_scales']}), 8-bit "
             f"{r['q8_gemv_sass_per_weight']}",
             f"launches a token, a layer, at Llama-2-7B's {LAYERS_7B} layers: "
             f"{r['launches_per_token_per_layer_7b']} ({r['launches']['per_layer']} a layer, "
             f"{r['launches']['per_token_fixed']} a token besides)", ""]
    for arch, loops_here in r["gemv"].items():
        for name, s in loops_here.items():
            lines.append(f"{arch} {name}: {s['instructions']} instructions for {s['weights']} "
                         f"weights ({s['per_weight']} a weight), {s['registers']} registers, "
                         f"spills {s['spill_stores']}/{s['spill_loads']} bytes")
            if listing:
                lines += ["    " + t for t in s["listing"]]
    lines.append("")
    for arch, kernels in r["kernels"].items():
        lines.append(f"{arch}: " + ", ".join(
            f"{k} {v['registers']}r" + (f" (spills {v['spill_stores']}/{v['spill_loads']} B)"
                                       if v["spill_stores"] or v["spill_loads"] else "")
            for k, v in kernels.items()))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="the figures as JSON")
    ap.add_argument("--sass", action="store_true", help="list the GEMVs' inner loops")
    ap.add_argument("--arch", nargs="+", default=["sm_90", "sm_87"])
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        print(json.dumps(record()))
        return 0
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("run it outside Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM unset): it compiles "
              "for a real GPU", file=sys.stderr)
        return 2
    try:
        tool("ptxas"), tool("nvdisasm")
        r = report(args.arch)
    except Missing as e:
        print(e, file=sys.stderr)
        return 3
    if not args.sass:
        for loops_here in r["gemv"].values():
            for s in loops_here.values():
                del s["listing"]
    print(json.dumps(r, indent=1) if args.json else table(r, args.sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
