"""benchmarks/arm_static.py: the GEMV's Arm form, compiled for Arm cores from this machine with
llvmlite's own AArch64 backend, has widening multiply-accumulates (smlal, smlal2) in its inner
loop and no stack access there; x86's form keeps its multiply-adds of pairs; and the tool finds
and counts loops as it says."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("arm_static", ROOT / "benchmarks" / "arm_static.py")
arm_static = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arm_static)


def _backend(triple: str) -> None:
    import llvmlite.binding as llvm
    llvm.initialize_all_targets()
    try:
        llvm.Target.from_triple(triple)
    except RuntimeError as e:          # an llvmlite built without that backend
        pytest.skip(f"llvmlite has no backend for {triple}: {e}")


@pytest.fixture(scope="module")
def gemv():
    """The IR Numba generates for the 4-bit GEMV of one token, in each form."""
    return {form: arm_static.gemv_ir(form) for form in ("pairs", "neon")}


@pytest.mark.parametrize("target", ["cortex-a78", "apple-m1", "cortex-a57"])
def test_the_arm_form_multiply_accumulates_in_registers(gemv, target):
    """On Armv8.0 (cortex-a57) and later cores the Arm form's inner loop is smlal and smlal2 on
    the codes and activations, no smull with its uzp1/uzp2 and ext, nothing on the stack, and
    fewer instructions per weight than the x86 form compiled for the same core."""
    _backend(arm_static.TARGETS[target][0])
    neon = arm_static.hot_loop(arm_static.compile_for(gemv["neon"], target))
    pairs = arm_static.hot_loop(arm_static.compile_for(gemv["pairs"], target))
    ops = neon["mnemonics"]
    assert ops.get("smlal", 0) > 0 and ops.get("smlal2", 0) > 0, ops
    assert not {"smull", "smull2", "uzp1", "uzp2", "ext"} & set(ops), ops
    assert neon["stack_accesses"] == 0, ops
    assert neon["per_product"] < pairs["per_product"], (neon, pairs)


def test_x86_keeps_its_multiply_adds_of_pairs(gemv):
    """x86 (AVX-512 VNNI) compiles the x86 form to vpdpwssd, with nothing on the stack."""
    _backend(arm_static.TARGETS["x86"][0])
    loop = arm_static.hot_loop(arm_static.compile_for(gemv["pairs"], "x86"))
    assert loop["mnemonics"].get("vpdpwssd", 0) > 0 and loop["stack_accesses"] == 0, loop


def test_the_form_follows_the_target():
    from tinyrt.kernels.cpu import simd
    assert [simd.gemv_form(t) for t in ("aarch64-unknown-linux-gnu", "arm64-apple-darwin23.0.0",
                                        "x86_64-unknown-linux-gnu", "riscv64-unknown-linux-gnu")] \
        == ["neon", "neon", "pairs", "pairs"]


ASM = """\
f:
\tmov\tx0, #0
.LBB0_1:
\tldr\tq0, [x1], #16
.LBB0_2:
\tsmlal\tv1.4s, v0.4h, v2.4h
\tsmlal2\tv3.4s, v0.8h, v2.8h
\tstr\tq4, [sp, #32]
\tsubs\tx2, x2, #1
\tb.ne\t.LBB0_2
\tsdot\tv5.4s, v6.16b, v7.16b
\tcbnz\tx3, .LBB0_1
.LBB0_3:
\tfmla.4s\tv1, v2, v3
\tb.lt\t.LBB0_3
\tb\t.LBB0_9
.LBB0_9:
\tret
"""


def test_loops_are_found_and_counted():
    """Backward branches close loops (a forward one does not); only the innermost count; the hot
    one makes the most products of its kind (smlal/smlal2 4 each, sdot 16; Apple's fmla.4s 4
    float ones); a store to [sp] is a stack access."""
    assert arm_static.loops(ASM) == [(4, 9), (12, 14)]
    hot = arm_static.hot_loop(ASM)
    assert hot["mnemonics"] == {"smlal": 1, "smlal2": 1, "str": 1, "subs": 1, "b.ne": 1}
    assert (hot["products"], hot["stack_accesses"], hot["per_product"]) == (8, 1, 0.625)
    floats = arm_static.hot_loop(ASM, kind="float")
    assert (floats["mnemonics"], floats["products"]) == ({"fmla": 1, "b.lt": 1}, 4)
    assert arm_static.products("sdot", "v5.4s, v6.16b, v7.16b") == 16
    assert arm_static.products("vpdpwssd", "%zmm1, %zmm2, %zmm3") == 32
    assert arm_static.products("vpmaddwd", "%ymm1, %ymm2, %ymm3") == 16
