"""A vector loop that Numba cannot be made to write: the integer core of the 4-bit GEMV.

Numba types integer arithmetic in 64 bits, and LLVM's vectorizer then multiplies 4-bit codes by
activations in 64-bit lanes. Written directly as LLVM vector IR, the same loop lowers to the
CPU's 16-bit multiply-add of pairs (x86: pmaddwd, or vpdpwssd where AVX-512 VNNI / AVX-VNNI exist;
Arm: smull + addp), which multiplies 32 code/activation pairs per instruction. The IR is
target-independent; LLVM picks the instructions for the machine Numba compiles for.

The layout it reads, "pair-planar": a 4-bit layer W.T [in, out] is stored as int32 [in/8, out];
word [r, o] holds the codes of output o for inputs 8r .. 8r+7, input 8r + 2m at bit 4m and input
8r + 2m + 1 at bit 16 + 4m (m = 0..3). So (word >> 4m) & 0x000F000F is two 16-bit integers, the
codes of a pair of inputs, ready for a pairwise multiply-add with the pair's two int16 activations.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16          # outputs per vector: int32 lanes of a 512-bit register (LLVM splits if narrower)
PAIR_MASK = 0x000F000F


@njit(cache=True, inline="always")
def pair_shift(t):
    """The bit at which word [r, o] of the pair-planar layout holds the code of input 8r + t."""
    return 4 * (t // 2) + 16 * (t % 2)


@intrinsic
def pair_dot(typingctx, w, r0, r1, c0, c1, xp, dst):
    """dst[c - c0] (int32) = sum over word rows r in [r0, r1) and m = 0..3 of
    lo(w[r, c] >> 4m) * lo(xp[4r + m]) + hi(w[r, c] >> 4m) * hi(xp[4r + m]), for c in [c0, c1),
    (c1 - c0) a multiple of LANES. lo/hi: the 16-bit halves, codes masked to 4 bits, activations
    signed. w int32 [in/8, out] (pair-planar), xp int32 [in/2] (pairs of int16 activations),
    dst int32 [>= c1 - c0]."""
    sig = types.void(w, r0, r1, c0, c1, xp, dst)

    def codegen(context, builder, signature, args):
        w_ty, r0_ty, r1_ty, c0_ty, c1_ty, xp_ty, dst_ty = signature.args
        intp = context.get_value_type(types.intp)
        r0v, r1v, c0v, c1v = (context.cast(builder, v, t, types.intp)
                              for v, t in zip(args[1:5], (r0_ty, r1_ty, c0_ty, c1_ty)))
        w_arr = context.make_array(w_ty)(context, builder, args[0])
        xp_arr = context.make_array(xp_ty)(context, builder, args[5])
        dst_arr = context.make_array(dst_ty)(context, builder, args[6])

        i32 = ir.IntType(32)
        vec = ir.VectorType(i32, LANES)                      # 16 x i32: one lane per output
        halves = ir.VectorType(ir.IntType(16), 2 * LANES)    # the same bits as 32 x i16
        wide = ir.VectorType(i32, 2 * LANES)
        even = ir.Constant(vec, list(range(0, 2 * LANES, 2)))
        odd = ir.Constant(vec, list(range(1, 2 * LANES, 2)))
        mask = ir.Constant(vec, [PAIR_MASK] * LANES)
        splat0 = ir.Constant(vec, [0] * LANES)
        accs = [cgutils.alloca_once(builder, vec) for _ in range(4)]   # one chain per m

        def const(v):
            return ir.Constant(intp, v)

        n_vec = builder.sdiv(builder.sub(c1v, c0v), const(LANES))
        with cgutils.for_range(builder, n_vec) as col:
            offset = builder.mul(col.index, const(LANES))
            c = builder.add(c0v, offset)
            for acc in accs:
                builder.store(ir.Constant(vec, None), acc)
            with cgutils.for_range(builder, r1v, start=r0v) as row:
                r = row.index
                ptr = cgutils.get_item_pointer(context, builder, w_ty, w_arr, [r, c])
                words = builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)
                for m, acc in enumerate(accs):
                    pair = builder.load(cgutils.get_item_pointer(
                        context, builder, xp_ty, xp_arr, [builder.add(builder.mul(r, const(4)), const(m))]))
                    x = builder.shuffle_vector(
                        builder.insert_element(ir.Constant(vec, ir.Undefined), pair, ir.Constant(i32, 0)),
                        ir.Constant(vec, ir.Undefined), splat0)
                    codes = words if m == 0 else builder.lshr(words, ir.Constant(vec, [4 * m] * LANES))
                    codes = builder.and_(codes, mask)
                    prod = builder.mul(builder.sext(builder.bitcast(codes, halves), wide),
                                       builder.sext(builder.bitcast(x, halves), wide))
                    undef = ir.Constant(wide, ir.Undefined)
                    total = builder.add(builder.load(acc), builder.shuffle_vector(prod, undef, even))
                    builder.store(builder.add(total, builder.shuffle_vector(prod, undef, odd)), acc)
            a = [builder.load(acc) for acc in accs]
            out = builder.add(builder.add(a[0], a[1]), builder.add(a[2], a[3]))
            ptr = cgutils.get_item_pointer(context, builder, dst_ty, dst_arr, [offset])
            builder.store(out, builder.bitcast(ptr, vec.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are the int32 `bits` (a bit cast; Numba has none for scalars).
    LLVM vectorizes loops that use it."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def float_from_half(typingctx, bits):
    """The float32 value of the IEEE half-precision number whose bits are the uint16 `bits`
    (Numba's CPU target has no float16 type). Vectorized, a half-to-single conversion
    instruction (x86 F16C, Arm fcvtl)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen
