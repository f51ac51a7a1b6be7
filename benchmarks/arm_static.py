"""What LLVM makes of tinyrt's CPU kernels on 64-bit Arm, seen from any machine: the LLVM IR Numba
generates for the 4-bit GEMV's tile loop (simd.tile_dot4) and for decode attention's K/V row
loops (simd.cache_dots, cache_axpy4), compiled by llvmlite for Arm cores and for x86, and each
hot loop's instructions counted.

    python benchmarks/arm_static.py [--json] [--target NAME ...] [--form pairs|neon]
                                    [--bits 4] [--tokens 1]

Targets: cortex-a78 (+dotprod: Jetson Orin's cores; Raspberry Pi 5's Cortex-A76 is of the same
Armv8.2 family), apple-m1, cortex-a57 (Armv8.0: Jetson Nano's), and for reference x86 (znver4:
AVX-512 VNNI) and x86-avx2 (haswell). The GEMV's form is the one Numba builds on each target
(simd.gemv_form) unless --form names one (`--form pairs` shows what Arm ran before its own
form). Per target and loop: the instructions of the loop (the innermost loop, found by its
backward branch, with the most multiply products), how many touch the stack (spills), the
products per iteration (4 per smlal, 16 per sdot, 32 per zmm vpdpwssd, ...) and instructions per
product: per 4-bit weight for the GEMV of one token (--tokens: per weight and token).

How: the wrapper of each intrinsic is compiled here by Numba and its IR taken before Numba
optimizes it (on an Arm machine Numba optimizes that IR for Arm; the host's optimized IR would
carry the host's cost choices and intrinsics), its triple, data layout and target attributes
replaced by the target's, then optimized at O3 and compiled as Numba's JIT does (large code
model: a constant vector is a 5-instruction load wherever it must be reloaded).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys

import numpy as np

TARGETS = {   # name: (triple, cpu, features)
    "cortex-a78": ("aarch64-unknown-linux-gnu", "cortex-a78", "+dotprod"),
    "apple-m1": ("arm64-apple-macosx", "apple-m1", ""),
    "cortex-a57": ("aarch64-unknown-linux-gnu", "cortex-a57", ""),
    "x86": ("x86_64-unknown-linux-gnu", "znver4", ""),
    "x86-avx2": ("x86_64-unknown-linux-gnu", "haswell", ""),
}
DEFAULT_TARGETS = ["cortex-a78", "apple-m1", "cortex-a57", "x86"]

# multiply instructions, integer or float, and the products one makes per lane of its
# destination (an Arm arrangement such as .4s, or an x86 register's width in 32-bit lanes)
PRODUCTS = {
    "int": {"smull": 1, "smull2": 1, "smlal": 1, "smlal2": 1, "umull": 1, "umull2": 1,
            "umlal": 1, "umlal2": 1, "mul": 1, "mla": 1, "sdot": 4, "udot": 4, "usdot": 4,
            "vpdpwssd": 2, "vpmaddwd": 2, "vpdpbusd": 4, "vpmulld": 1},
    "float": {"fmul": 1, "fmla": 1, "vmulps": 1, "vfmadd231ps": 1, "vfmadd213ps": 1,
              "vfmadd132ps": 1},
}
X86_LANES = {"zmm": 16, "ymm": 8, "xmm": 4}
ARM_LANES = {"4s": 4, "2s": 2, "8h": 8, "4h": 4, "2d": 2}


# -- assembly: the hot loop and its counts -------------------------------------------------------

def instructions(asm: str) -> list[tuple[int, str, str]]:
    """(line number, mnemonic, operands) of each instruction of `asm` (labels, directives and
    comments dropped; Apple's arrangement suffixes moved from the mnemonic to the operands)."""
    out = []
    for i, line in enumerate(asm.splitlines()):
        code = re.split(r"\s//|\s#|;", line)[0].strip()
        if not code or code.endswith(":") or code.startswith("."):
            continue
        mnemonic, *operands = code.split(None, 1)
        operands = operands[0] if operands else ""
        apple = re.match(r"^(\w+)\.(\d+[bhsd])$", mnemonic)   # Apple's smlal.4s v0, v1, v2
        if apple:
            mnemonic, operands = apple.group(1), f"{operands} .{apple.group(2)}"
        out.append((i, mnemonic, operands))
    return out


def loops(asm: str) -> list[tuple[int, int]]:
    """The innermost loops of `asm` as (first, last) line numbers: a branch to a label above it
    closes a loop, innermost when no other loop lies inside it."""
    labels, spans = {}, []
    for i, line in enumerate(asm.splitlines()):
        m = re.match(r"^([.\w$]+):", line)
        if m:
            labels[m.group(1)] = i
            continue
        m = re.match(r"^\s+(b\.\w+|b|cbn?z|tbn?z|j[a-z]+)\s+(?:[^,]*,\s*)*([.\w$]+)\s*$",
                     re.split(r"\s//|\s#", line)[0])
        if m and m.group(2) in labels and labels[m.group(2)] < i:
            spans.append((labels[m.group(2)], i))
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def products(mnemonic: str, operands: str, kind: str = "int") -> int:
    """Multiply products of one instruction of `kind` ("int" or "float"; 0 for any other)."""
    per_lane = PRODUCTS[kind].get(mnemonic, 0)
    arm = re.search(r"\.(\d+[bhsd])\b", operands)
    x86 = re.search(r"%([xyz]mm)", operands)
    lanes = ARM_LANES.get(arm.group(1), 0) if arm else X86_LANES[x86.group(1)] if x86 else 0
    return per_lane * lanes


def spills(operands: str) -> bool:
    """Whether an instruction's operands address the stack (Arm's [sp...], x86's (%rsp))."""
    return "[sp" in operands or "(%rsp)" in operands


def hot_loop(asm: str, kind: str = "int") -> dict:
    """The innermost loop with the most multiply products of `kind` per iteration, counted: its
    instructions, their mnemonics, the stack accesses among them, the products per iteration,
    and instructions per product (per weight, for a GEMV of one token)."""
    code = instructions(asm)
    best = None
    for first, last in loops(asm):
        body = [(m, ops) for i, m, ops in code if first <= i <= last]
        made = sum(products(m, ops, kind) for m, ops in body)
        if best is None or made > best[0]:
            best = (made, body)
    if best is None:
        raise ValueError("no loop in the assembly")
    made, body = best
    counts = collections.Counter(m for m, _ in body)
    return {"instructions": len(body), "mnemonics": dict(counts.most_common()),
            "stack_accesses": sum(spills(ops) for _, ops in body),
            "products": made, "per_product": round(len(body) / made, 3) if made else None}


# -- IR: from Numba, retargeted ------------------------------------------------------------------

@contextlib.contextmanager
def raw_ir():
    """Collects the IR modules Numba compiles in the block, as generated (before its passes)."""
    from numba.core import codegen
    modules = []
    add = codegen.CPUCodeLibrary.add_ir_module

    def keep(self, ir_module):
        modules.append(str(ir_module))
        return add(self, ir_module)

    codegen.CPUCodeLibrary.add_ir_module = keep
    try:
        yield modules
    finally:
        codegen.CPUCodeLibrary.add_ir_module = add


def function_ir(modules: list[str], name: str) -> str:
    """The module among `modules` that defines Numba's function `name` (the njit wrapper, not
    its Python-facing one), with every other function's body dropped (their declarations
    stay): only the hot function is compiled for the target."""
    for text in modules:
        if not re.search(rf'^define .*@"?_ZN[\w.$]*{name}', text, re.M):
            continue
        out, skip = [], False
        for line in text.splitlines():
            if line.startswith("define"):
                skip = not re.search(rf'@"?_ZN[\w.$]*{name}', line)
                if skip:
                    sig = re.match(r"define\s+(?:(?:internal|private|linkonce_odr|weak_odr|"
                                   r"dso_local)\s+)*(.*\))[^)]*\{$", line).group(1)
                    out.append("declare " + sig)
                    continue
            if not skip:
                out.append(line)
            elif line == "}":
                skip = False
        return "\n".join(out) + "\n"
    raise ValueError(f"no module defines {name}")


def compile_for(ir_text: str, target: str) -> str:
    """`ir_text` compiled for `target` (a TARGETS name): the host's triple, data layout and
    target attributes replaced, O3 as Numba runs it, then assembly as its JIT makes it."""
    import llvmlite.binding as llvm
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    triple, cpu, features = TARGETS[target]
    tm = llvm.Target.from_triple(triple).create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="default", codemodel="jitdefault", jit=True)
    ir_text = re.sub(r'^target (datalayout|triple) = .*$', "", ir_text, flags=re.M)
    ir_text = re.sub(r'"target-(cpu|features)"="[^"]*"', "", ir_text)
    module = llvm.parse_assembly(ir_text)
    module.triple, module.data_layout = triple, str(tm.target_data)
    module.verify()
    options = llvm.create_pipeline_tuning_options(speed_level=3)
    options.loop_vectorization = options.slp_vectorization = True
    passes = llvm.create_pass_builder(tm, options)
    passes.getModulePassManager().run(module, passes)
    return tm.emit_assembly(module)


# -- the kernels, as Numba generates them ---------------------------------------------------------

def _qlinear(bits: int, n_in: int = 256, tiles: int = 2):
    """An empty QLinear of `bits`-bit codes with the default model's types (Q4_1: float16 scales
    and offsets, groups of 32)."""
    from tinyrt.kernels.cpu.linear import QLinear
    z = np.zeros
    return QLinear(z((tiles, n_in // 8, 16), np.int32), z((tiles, n_in * (bits - 4) // 32, 16),
                   np.int32), z((tiles, n_in // 32, 16), np.uint16), z((tiles, 0, 16), np.int8),
                   z((tiles, n_in // 32, 16), np.uint16), z((tiles, 0, 16), np.int8), 0, bits,
                   32, 16 * tiles)


def gemv_ir(form: str, bits: int = 4, tokens: int = 1) -> str:
    """The IR Numba generates for a GEMV over tiles with simd's tile_dot of `form`."""
    from numba import njit
    from tinyrt.kernels.cpu import simd
    tile = simd.make_tile_dot(bits, tokens, form)

    @njit(fastmath=True)
    def arm_static_gemv(w, xp, sx, xsum, out):
        for k in range(w.lo.shape[0]):
            tile(w, k, xp, sx, xsum, 0, out)

    w = _qlinear(bits)
    blocks = w.lo.shape[1] * 8 // 32
    xp = np.zeros((tokens, w.lo.shape[1] * 4), np.int32)
    sx = np.zeros((tokens, blocks), np.float32)
    out = np.zeros((tokens, simd.LANES) if tokens > 1 else simd.LANES, np.float32)
    with raw_ir() as modules:
        arm_static_gemv(w, xp, sx, sx.copy(), out)
    return function_ir(modules, "arm_static_gemv")


def attention_ir(which: str, heads: int = 4) -> str:
    """The IR Numba generates for decode attention's row loop over a float16 KV cache: `which`
    "dots" (simd.cache_dots, q . k for `heads` query heads) or "axpy" (simd.cache_axpy4)."""
    from numba import njit
    from tinyrt.kernels.cpu import simd
    S, D = 8, 64
    kv = np.zeros((S, D), np.uint16)
    q = np.zeros((heads, D), np.float32)
    scores = np.zeros((heads, S), np.float32)

    @njit(fastmath=True)
    def arm_static_dots(q, k, S, D, out):
        for s in range(S):
            simd.cache_dots(q, 0, k, s, D, out, 0, s, 4)

    @njit(fastmath=True)
    def arm_static_axpy(e, v, S, D, out):
        for s in range(0, S, 4):
            simd.cache_axpy4(e, 0, s, v, s, out, 0, D, 4)

    with raw_ir() as modules:
        if which == "dots":
            arm_static_dots(q, kv, S, D, scores)
        else:
            arm_static_axpy(scores, kv, S, D, q)
    return function_ir(modules, f"arm_static_{which}")


def report(targets: list[str], form: str | None, bits: int, tokens: int) -> list[dict]:
    from tinyrt.kernels.cpu import simd
    forms = {t: form or simd.gemv_form(TARGETS[t][0]) for t in targets}
    gemv = {f: gemv_ir(f, bits, tokens) for f in set(forms.values())}
    attention = {which: attention_ir(which) for which in ("dots", "axpy")}
    rows = []
    for t in targets:
        triple, cpu, features = TARGETS[t]
        loops_ = {f"gemv{bits}": hot_loop(compile_for(gemv[forms[t]], t))}
        for which, text in attention.items():
            loops_[f"attention_{which}"] = hot_loop(compile_for(text, t), kind="float")
        rows.append({"target": t, "triple": triple, "cpu": cpu, "features": features,
                     "form": forms[t], "tokens": tokens, "loops": loops_})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per target")
    p.add_argument("--target", action="append", choices=sorted(TARGETS),
                   help=f"repeatable; default: {' '.join(DEFAULT_TARGETS)}")
    p.add_argument("--form", choices=("pairs", "neon"), help="the GEMV's form on every target")
    p.add_argument("--bits", type=int, choices=(4, 5, 6, 8), default=4)
    p.add_argument("--tokens", type=int, default=1, help="tokens per tile pass (1: the GEMV)")
    args = p.parse_args()
    for row in report(args.target or DEFAULT_TARGETS, args.form, args.bits, args.tokens):
        if args.json:
            print(json.dumps(row))
            continue
        print(f"{row['target']} ({row['cpu']}{' ' + row['features'] if row['features'] else ''}"
              f", GEMV form {row['form']})")
        for name, loop in row["loops"].items():
            top = " ".join(f"{m}:{n}" for m, n in list(loop["mnemonics"].items())[:10])
            print(f"  {name:18} {loop['instructions']:4} instructions, {loop['per_product']} per "
                  f"product, stack {loop['stack_accesses']}: {top}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
