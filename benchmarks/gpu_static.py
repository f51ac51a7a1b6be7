"""The decode kernels compiled for a GPU without one, and the step model they feed: SASS of the
GEMV's and attention's hot loops, registers and spills of every kernel a decode step launches,
launches per token, and (benchmarks/gpu_model.py) each kernel's time and the step's tok/s and
share of the copy bandwidth at Llama-2-7B's and Llama-3-8B's shapes on an H200 and a Jetson AGX
Orin, the model fitted first to the first GPU run's profile of the kernels of main af730b3.

A decode step of a tiny 4-bit model of Llama-2-7B's layer structure (MHA, fused q|k|v and
gate|up projections, SwiGLU, RMSNorm; benchmarks/gpu.py's AWQ model writer at toy sizes) runs
in Numba's CUDA simulator, once with 1 layer and once with 2: every Numba kernel launch is
counted (the simulator's kernel call is wrapped) and its argument types recorded. The
difference is one layer's launches; the rest a token's fixed ones; at Llama-2-7B's 32 layers a
token makes fixed + 32 per_layer launches, `launches_per_token_per_layer_7b` of them a layer
(torch's own ops are not counted: tests/test_device_decode.py checks a layer runs none).

Each recorded kernel is compiled to PTX by Numba's CUDA target for each --arch (default sm_90,
an H100's and H200's, and sm_87, Jetson Orin's), then by ptxas (-v: registers, spill stores
and loads). The GEMVs' hot path (a unit: a tile of R rows; compiled without the flush a row
block's end runs, gemv.FLUSH) and attention's (a turn of U slots) are disassembled (nvdisasm):
their instructions a unit and a slot, and those of the integer pipe, go to the model;
`q4_gemv_sass_per_weight` is the 4-bit unit's over its R x 16 weights a lane. The tools: Numba
with libNVVM, ptxas and nvdisasm (found in NVIDIA's pip wheels, on PATH, or under CUDA_HOME); a
missing one is named with its pip package.

    python benchmarks/gpu_static.py             # a table
    python benchmarks/gpu_static.py --json      # the figures as JSON (predicted_*, model_*...)
    python benchmarks/gpu_static.py --sass      # and the hot loops, instruction by instruction
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

sys.path.insert(0, str(Path(__file__).resolve().parent))     # (gpu.py, gpu_model.py beside)
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
            fn = self.py_func
            seen.add(json.dumps([fn.__module__, fn.__name__, [spec(a) for a in args]]))
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


# the integer pipe's opcodes (half the FP32 pipe's rate on sm_80 and later); the uniform
# datapath's (U...) issue apart, and are left out
INTEGER = ("IADD", "IMAD", "LOP", "SHF", "LEA", "SEL", "ISETP", "VIADD", "PRMT", "FLO", "POPC",
           "BMSK", "IABS", "IMNMX")


def loop_counts(body: list[str]) -> dict:
    ops = collections.Counter(opcode(t) for t in body)
    return {"instructions": len(body),
            "integer": sum(n for op, n in ops.items() if op.startswith(INTEGER)),
            "opcodes": dict(ops.most_common()), "listing": body}


def compiled(cuda, kernel, sig: tuple, arch: str, work: Path, name: str):
    """(ptxas's {registers, spills}, the SASS) of a kernel (its Python function) compiled for
    arch, with the launch bounds it has."""
    cc = (int(arch[3:-1]), int(arch[-1]))
    bounds = kernel.targetoptions.get("launch_bounds")
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, launch_bounds=bounds)
    stats, cubin = assemble(ptx, arch, work, name)
    return stats, sass(cubin)


def _gemv_signature() -> tuple:
    from numba.core import types as t

    a = lambda dt, nd=1: t.Array(dt, nd, "C")      # noqa: E731
    return (a(t.float32), a(t.float32), t.float32, a(t.float32), a(t.int64), a(t.float16),
            a(t.float16), t.int64, t.int64, t.int64, t.int64, a(t.float32), a(t.float32, 2),
            a(t.int32), a(t.int32), t.int64)


def gemv_units(arch: str, work: Path) -> dict:
    """bits -> the GEMV's hot loop a unit: compiled with gemv.FLUSH off (the loop of three units
    with no flush in it, innermost). Its own process: Numba keeps a device function as first
    compiled, FLUSH and all."""
    from tinyrt.kernels.cuda import gemv

    gemv.FLUSH = False
    cuda = _numba_for((int(arch[3:-1]), int(arch[-1])))
    out = {}
    for bits in (4, 8, 16):
        _, code = compiled(cuda, gemv.KERNELS[bits, False, False], _gemv_signature(), arch,
                           work, f"q{bits}_hot")
        found = [body for body in loops(code) if any(opcode(x).startswith("LDS") for x in body)
                 and any(opcode(x) == "FFMA" for x in body)]
        if len(found) != 1:
            raise RuntimeError(f"{len(found)} hot loops in q{bits}'s SASS, not 1")
        out[bits] = loop_counts(found[0])
    return out


def gemv_hot(cuda, arch: str, work: Path) -> dict:
    """bits -> the GEMV's registers (its whole code) and its hot loop a unit (gemv_units')."""
    from tinyrt.kernels.cuda import gemv

    run = subprocess.run([sys.executable, __file__, "--units", arch, str(work)],
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"the GEMV's hot loops did not compile:\n{run.stderr[-2000:]}")
    units = json.loads(run.stdout)
    out = {}
    for bits in (4, 8, 16):
        stats, _ = compiled(cuda, gemv.KERNELS[bits, False, False], _gemv_signature(), arch,
                            work, f"q{bits}")
        c = units[str(bits)]
        weights = gemv.R * gemv.chunk(bits)             # a unit's, a lane's
        out[bits] = {**stats, "unit": c["instructions"] / 3, "integer": c["integer"] / 3,
                     "per_weight": round(c["instructions"] / 3 / weights, 3),
                     "opcodes": c["opcodes"], "listing": c["listing"]}
    return out


def attention_hot(cuda, arch: str, work: Path) -> dict:
    """"RQxCH" -> attention's registers and instructions a slot (a warp's: its turn of U slots,
    unrolled as LLVM unrolled it, over the slots whose K and V rows it loads), head dim 128 (the
    model's shapes')."""
    from numba.core import types as t

    from tinyrt.kernels.cuda import attention

    a = lambda dt, nd=1: t.Array(dt, nd, "C")      # noqa: E731
    f32, i64 = t.float32, t.int64
    sig = (a(f32, 3), a(t.float16), a(t.float16), i64, a(i64), a(i64, 2), a(i64), f32, i64, i64,
           a(f32, 3), a(f32, 4), a(f32, 4), a(t.int32), a(f32, 3), a(f32, 3))
    out = {}
    for rq in (1, 2, 4, 8):
        for D in (128,):
            name = f"{rq}x{D // 32}"
            kernel = attention.kernel_for(rq, D)[0]
            stats, code = compiled(cuda, kernel, sig, arch, work, f"attention_{name}")
            found = [b for b in loops(code) if any(opcode(x) == "SHFL.BFLY" for x in b)
                     and any(opcode(x).startswith("LDG") for x in b)]
            if len(found) != 1:
                raise RuntimeError(f"{len(found)} hot loops in attention_{name}'s SASS, not 1")
            c = loop_counts(found[0])
            slots = sum(opcode(x).startswith("LDG.E.U16") for x in found[0]) / (2 * D // 32)
            out[name] = {**stats, "slot": c["instructions"] / slots,
                         "integer": c["integer"] / slots, "slots": slots,
                         "opcodes": c["opcodes"], "listing": c["listing"]}
    return out


def analyse(archs: list[str], recorded: dict) -> dict:
    out: dict = {"kernels": {}, "gemv": {}, "attention": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for arch in archs:
            cc = (int(arch[3:-1]), int(arch[-1]))
            cuda = _numba_for(cc)
            regs = out["kernels"][arch] = {}
            for i, (module, name, args) in enumerate(recorded["kernels"]):
                mod = importlib.import_module(module)
                kernel = getattr(mod, name, None) or mod.named(name)
                stats, _ = compiled(cuda, kernel, signature(args), arch, work, f"{name}{i}")
                old = regs.get(name, stats)         # (a kernel of several signatures: the most)
                regs[name] = {k: max(v, old[k]) for k, v in stats.items()}
            out["gemv"][arch] = gemv_hot(cuda, arch, work)
            out["attention"][arch] = attention_hot(cuda, arch, work)
    return out


def report(archs: list[str]) -> dict:
    import gpu_model

    recorded = launches()
    one, two = recorded["per_step"]["1"], recorded["per_step"]["2"]
    per_layer, fixed = two - one, 2 * one - two
    result = analyse(archs, recorded)
    hot_gemv, hot_att = result["gemv"]["sm_90"], result["attention"]["sm_90"]
    sass_facts = gpu_model.Sass(
        gemv={b: {k: v[k] for k in ("registers", "unit", "integer")} for b, v in hot_gemv.items()},
        attention={n: {k: v[k] for k in ("registers", "slot", "integer")}
                   for n, v in hot_att.items()})
    model = gpu_model.predictions(sass_facts)
    h200 = model["machines"]["h200"]
    return {"arch": archs[0],
            "q4_gemv_sass_per_weight": hot_gemv[4]["per_weight"],
            "q8_gemv_sass_per_weight": hot_gemv[8]["per_weight"],
            "q4_gemv_bytes_in_flight_per_sm": model["q4_gemv_bytes_in_flight_per_sm"],
            "model_error_vs_af730b3": model["model_error_vs_af730b3"],
            **{f"predicted_pct_copy_bw_{shape}_{ctx}": h200[shape][ctx]["pct_copy_bw"]
               for shape in h200 for ctx in h200[shape]},
            **{f"predicted_tok_s_{shape}_{ctx}": h200[shape][ctx]["tok_s"]
               for shape in h200 for ctx in h200[shape]},
            **{f"predicted_prefill_tok_s_{shape}_{T}": p["tok_s"]
               for shape, per in model["prefill"].items() for T, p in per.items()},
            **{f"predicted_ttft_ms_{shape}_{T}": p["ttft_ms"]
               for shape, per in model["prefill"].items() for T, p in per.items()},
            "launches_per_token_per_layer_7b":
                round((fixed + LAYERS_7B * per_layer) / LAYERS_7B, 3),
            "launches": {"per_layer": per_layer, "per_token_fixed": fixed,
                         "layers_7b": LAYERS_7B},
            "step_model": model, **result}


def table(r: dict, listing: bool) -> str:
    m = r["step_model"]
    lines = [f"GEMV hot path ({r['arch']}): {r['q4_gemv_sass_per_weight']} SASS a 4-bit weight, "
             f"{r['q8_gemv_sass_per_weight']} an 8-bit one; {r['q4_gemv_bytes_in_flight_per_sm']}"
             " bytes in flight an SM (4-bit, Llama-2-7B's q|k|v on an H200)",
             f"launches a token, a layer, at Llama-2-7B's {LAYERS_7B} layers: "
             f"{r['launches_per_token_per_layer_7b']} ({r['launches']['per_layer']} a layer, "
             f"{r['launches']['per_token_fixed']} a token besides)",
             f"step model: latencies {m['latency_us']} us, fitted to af730b3's profile within "
             f"{100 * m['model_error_vs_af730b3']:.0f} % (its four kernels; "
             f"{100 * m['fit_error_all']:.0f} % with the small ones)"]
    lines += [f"  af730b3 {k}: {v['predicted']} us predicted, {v['measured']} measured"
              for k, v in m["af730b3"].items()]
    for shape, per in m["prefill"].items():
        for T, p in per.items():
            lines.append(f"  h200 {shape} prompt of {T}: {p['tok_s']:.0f} tok/s, TTFT "
                         f"{p['ttft_ms']} ms (ms: " + ", ".join(
                             f"{k[:-3]} {v}" for k, v in p.items() if k.endswith("_ms")
                             and k != "ttft_ms") + ")")
    for machine, shapes in m["machines"].items():
        for shape, ctxs in shapes.items():
            for ctx, p in ctxs.items():
                lines.append(f"  {machine} {shape} at {ctx}: {p['tok_s']} tok/s, "
                             f"{p['pct_copy_bw']} % of copy; us a layer: "
                             + ", ".join(f"{k} {v}" for k, v in p["kernels_us_per_layer"].items()))
    lines.append("")
    for arch in r["gemv"]:
        for bits, s in r["gemv"][arch].items():
            lines.append(f"{arch} {bits}-bit GEMV: {s['unit']:.0f} instructions a unit "
                         f"({s['per_weight']} a weight), {s['registers']} registers, "
                         f"spills {s['spill_stores']}/{s['spill_loads']} bytes")
            if listing:
                lines += ["    " + t for t in s["listing"]]
        for name, s in r["attention"][arch].items():
            lines.append(f"{arch} attention {name}: {s['slot']:.0f} instructions a slot, "
                         f"{s['registers']} registers")
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
    ap.add_argument("--units", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        print(json.dumps(record()))
        return 0
    if args.units:
        print(json.dumps(gemv_units(args.units[0], Path(args.units[1]))))
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
        for hot in (*r["gemv"].values(), *r["attention"].values()):
            for s in hot.values():
                del s["listing"]
    print(json.dumps(r, indent=1) if args.json else table(r, args.sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
